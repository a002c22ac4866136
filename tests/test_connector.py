"""The engine loop's connector (serving/engine/connector.py) and the engine methods a
worker uses through it instead of the engine's internals (serving/engine/remote.py): the
loop admits through the connector with the caller's keyword arguments and ticks it; a
held request's memory is read through ``held_memory`` and ended in any state by
``discard``; a loop whose only work is transfers waits instead of stepping."""

import asyncio

import pytest

from serving.async_engine import AsyncEngine
from serving.engine import SamplingParams
from serving.engine.connector import EngineConnector
from test_engine_fake import BLOCK, VOCAB, assert_all_free, make_engine
from test_engine_fake_model import reference_next

ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


class Recording(EngineConnector):
    """Admits held prefill-style requests and records what the loop calls."""

    def __init__(self):
        self.admitted, self.ticks, self.stopped = [], 0, None

    def admit(self, engine, request_id, prompt, params, *, tag):
        self.admitted.append((request_id, tag))
        engine.add_request(prompt, params, request_id, hold_on_finish=True)

    def tick(self, engine):
        self.ticks += 1

    def on_stop(self, error):
        self.stopped = error


def test_the_loop_admits_through_the_connector_and_ticks_it():
    eng = make_engine(False)
    connector = Recording()

    async def run():
        aeng = AsyncEngine(eng, connector=connector)
        try:
            stream = await aeng.add("a", [3, 4, 5, 6, 7], ONE, tag="first")
            outs = [o async for o in stream]
            with pytest.raises(TypeError):  # the connector's admit takes `tag`
                await aeng.add("b", [3, 4], ONE)
            blocks, slot = await aeng.call(lambda e: e.held_memory("a"))
            await aeng.call(lambda e: e.release("a"))
            return outs, blocks, slot
        finally:
            aeng.shutdown()

    outs, blocks, slot = asyncio.run(run())
    assert connector.admitted == [("a", "first")] and outs[-1].finished
    assert len(blocks) == -(-5 // BLOCK) and slot is not None and connector.ticks > 0
    assert connector.stopped is not None  # the loop stopped: the connector heard it


def test_held_memory_and_discard_in_every_state():
    """``held_memory`` only for a finished, held request; ``discard`` ends a waiting
    request, a finished held one, and ignores unknown ids; every block comes back."""
    eng = make_engine(False)
    try:
        waiting = eng.add_request([3, 4, 5], ONE, "w", hold_on_finish=True)
        with pytest.raises(ValueError, match="holds no finished"):
            eng.held_memory(waiting)
        eng.discard(waiting)
        assert not eng.has_request(waiting)
        done = eng.add_request([3, 4, 5, 6], ONE, "d", hold_on_finish=True)
        while eng.has_unfinished():
            eng.step()
        blocks, slot = eng.held_memory(done)
        assert blocks and slot is not None and eng.has_request(done)
        eng.discard(done)
        eng.discard("nobody")
        assert not eng.has_request(done)
        eng.step()  # the fence returns the memory
        assert_all_free(eng)
    finally:
        eng.close()


def test_engine_loop_waits_while_only_transfers_are_pending():
    """A request being filled by a transfer is no step's work: the host loop sleeps
    until woken (the transfer's progress thread does it) instead of stepping in a
    spin that takes the GIL from that thread."""
    eng = make_engine(False)
    steps = []
    step = eng.step
    eng.step = lambda: steps.append(1) or step()
    aeng = AsyncEngine(eng)
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        rid = await aeng.call(
            lambda e: e.add_remote_request(prompt, reference_next(prompt, VOCAB), sp))
        await aeng.call(lambda e: e.reserve_transfers())
        await asyncio.sleep(0.3)
        idle = len(steps)
        await aeng.call(lambda e: e.finish_transfer(rid, ok=False))  # recompute it
        while await aeng.call(lambda e: e.has_unfinished()):
            await asyncio.sleep(0.01)
        return idle

    try:
        assert asyncio.run(run()) <= 2  # at most the idle step that drains the fence
        assert len(steps) > 2  # then it ran: prefill and decode steps
    finally:
        aeng.shutdown()
        eng.close()
