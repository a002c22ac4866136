"""Decode-worker bookkeeping without processes or NIXL: ``Worker._tick`` and
``Worker.confirmation`` on a fake-model engine and stand-ins for the transfer manager
(tests/test_disagg.py runs real workers)."""
import asyncio
import collections
from types import SimpleNamespace

import pytest
from test_engine_fake_model import FakeBatch, FakeCache, FakeModel, reference_next

from serving.async_engine import EngineDead
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets
from serving import worker as worker_mod
from transfer.manager import Completion, TransferError

VOCAB, BLOCK, NUM_BLOCKS, SLOTS = 97, 4, 64, 4


def _engine():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, num_slots=SLOTS,
                       eos_token_ids=(0,),
                       buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(4,), decode_seqs=(4,)))
    return Engine(FakeModel(VOCAB), FakeCache.allocate(NUM_BLOCKS, BLOCK, SLOTS), cfg,
                  batch_type=FakeBatch)


def _transfers(landed=(), completions=(), settled=()):
    """A stand-in for the transfer manager's owner-side calls, one tick's worth."""
    return SimpleNamespace(landed=lambda: list(landed), collect=lambda: list(completions),
                           settled=lambda: list(settled))


def _decode_worker_with_a_pull(pull_id):
    """An engine holding one remote request whose pull is ``pull_id``, a stand-in worker
    around it, and the lists of requests it failed and confirmations it resolved."""
    eng = _engine()
    prompt = [5, 6, 7, 8, 9, 10]
    rid, _, _ = eng.add_remote_request(prompt, reference_next(prompt, VOCAB),
                                       SamplingParams(max_tokens=8, temperature=0))
    failed, confirmed = [], []
    w = SimpleNamespace(
        recompute=False, _pulls={pull_id: rid}, _started=set(), _draining={},
        counters=collections.Counter(), transfer=_transfers(),
        engine=SimpleNamespace(fail=lambda r, e: failed.append(r)),
        _confirm=lambda r, e=None: confirmed.append((r, e)))
    return eng, rid, w, failed, confirmed


@pytest.mark.parametrize("landed", [False, True])
def test_failed_pull_frees_the_request_at_once(landed):
    """A pull that fails (before or after its READ landed) ends the request with the
    error and returns its blocks and slot: it never decodes from unwritten memory."""
    eng, rid, w, failed, confirmed = _decode_worker_with_a_pull(7)
    w.transfer = _transfers(landed=[7] if landed else [])
    worker_mod.Worker._tick(w, eng)  # the READ landed (or not yet)
    w.transfer = _transfers(completions=[
        Completion(7, "lease", TransferError("error", "injected"), 0, 0, 0.0)])
    worker_mod.Worker._tick(w, eng)
    assert failed == [rid] and confirmed[0][0] == rid
    assert isinstance(confirmed[0][1], worker_mod.TransferFailed)
    assert rid not in eng.requests and not eng.has_unfinished()
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS and eng.slots.num_free == SLOTS
    eng.close()


def test_failed_pull_whose_read_runs_on_holds_its_memory_until_the_read_ends():
    """NIXL's UCX backend does not stop a released READ: a pull that timed out with its
    READ in flight (``settled`` False) fails the request at once, but its blocks and slot
    stay out of the pools, where the READ may still write, until ``settled()`` lists it."""
    eng, rid, w, failed, confirmed = _decode_worker_with_a_pull(7)
    w.transfer = _transfers(completions=[
        Completion(7, "lease", TransferError("timeout", "deadline"), 0, 0, 0.0, settled=False)])
    worker_mod.Worker._tick(w, eng)
    assert failed == [rid] and isinstance(confirmed[0][1], worker_mod.TransferFailed)
    for settled, freed in (([], False), ([7], True)):  # still in flight, then ended
        w.transfer = _transfers(settled=settled)
        worker_mod.Worker._tick(w, eng)
        eng.fence.wait_all()
        assert (eng.blocks.num_free == NUM_BLOCKS) == freed
        assert (eng.slots.num_free == SLOTS) == freed
    assert rid not in eng.requests and not eng.has_unfinished() and not w._draining
    eng.close()


def test_recompute_does_not_wait_for_a_read_that_runs_on():
    """With ``--on-transfer-failure recompute``, a pull that timed out with its READ in
    flight recomputes the prompt at once, in fresh memory: the request finishes with
    the right tokens while the READ still writes into the memory it gave up, which
    stays out of the pools until ``settled()`` lists the pull."""
    import jax
    import numpy as np
    from test_engine_fake_model import reference_greedy

    eng, rid, w, failed, confirmed = _decode_worker_with_a_pull(7)
    w.recompute = True
    prompt = eng.requests[rid].prompt_token_ids
    old_blocks, old_slot = list(eng.requests[rid].block_ids), eng.requests[rid].slot
    w.transfer = _transfers(completions=[
        Completion(7, "lease", TransferError("timeout", "deadline"), 0, 0, 0.0, settled=False)])
    worker_mod.Worker._tick(w, eng)
    assert failed == [] and confirmed == [(rid, None)] and 7 in w._draining
    late_read = jax.jit(lambda c: type(c)(c.kv.at[np.asarray(old_blocks)].set(-5),
                                          c.ssm.at[old_slot].set(-5)), donate_argnums=0)
    done, used = {}, set()
    w.transfer = _transfers()
    for _ in range(100):  # the READ has not ended: settled() stays empty
        if not eng.has_unfinished():
            break
        if rid in eng.requests and eng.requests[rid].block_ids:
            used |= set(eng.requests[rid].block_ids) | {eng.requests[rid].slot + 1000}
        eng.runner.cache = late_read(eng.runner.cache)  # its bytes keep landing
        done.update({o.request_id: o for o in eng.step() if o.finished})
        worker_mod.Worker._tick(w, eng)
    assert done[rid].token_ids == reference_greedy(prompt, 8, VOCAB)
    assert not used & (set(old_blocks) | {old_slot + 1000})
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS - len(old_blocks) and eng.slots.num_free == SLOTS - 1
    w.transfer = _transfers(settled=[7])  # the READ ended
    worker_mod.Worker._tick(w, eng)
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS and eng.slots.num_free == SLOTS and not w._draining
    eng.close()


def test_confirmation_wait_ends_when_the_engine_dies():
    """Only the engine thread resolves a pull's confirmation: if it stops, the waiting
    request gets EngineDead instead of hanging."""
    import functools

    from serving.async_engine import AsyncEngine

    eng = _engine()

    def lost():
        raise RuntimeError("device lost")

    eng.step = lost

    async def run():
        fut = asyncio.get_running_loop().create_future()
        w = SimpleNamespace(_confirmations={"r": (fut, asyncio.get_running_loop())})
        w._confirm = functools.partial(worker_mod.Worker._confirm, w)
        aeng = AsyncEngine(eng, on_stop=functools.partial(
            worker_mod.Worker._fail_confirmations, w))
        try:
            await aeng.add("x", [1, 2, 3], SamplingParams(max_tokens=2))  # its step dies
        except EngineDead:
            pass
        try:
            await asyncio.wait_for(fut, timeout=5)
        finally:
            aeng.shutdown()

    with pytest.raises(EngineDead, match="device lost"):
        asyncio.run(run())
    eng.close()


def test_engine_loop_waits_while_only_transfers_are_pending():
    """A request being filled by a transfer is no step's work: the host loop sleeps
    until woken (the transfer's progress thread does it) instead of stepping in a
    spin that takes the GIL from that thread."""
    from serving.async_engine import AsyncEngine

    eng = _engine()
    steps = []
    step = eng.step
    eng.step = lambda: steps.append(1) or step()
    aeng = AsyncEngine(eng)
    prompt = [5, 6, 7, 8]
    sp = SamplingParams(max_tokens=4, temperature=0)

    async def run():
        rid, _, _ = await aeng.call(
            lambda e: e.add_remote_request(prompt, reference_next(prompt, VOCAB), sp))
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


def test_duplicate_request_id_on_decode_leaves_the_first_alone():
    first = object()
    w = SimpleNamespace(_confirmations={"r": first})

    async def run():
        await worker_mod.Worker.decode(w, "r", [1, 2], 3, SamplingParams(), {})

    with pytest.raises(ValueError, match="duplicate request id r"):
        asyncio.run(run())
    assert w._confirmations == {"r": first}


def test_prefill_cancelled_during_admission_releases_its_hold():
    """A prefill request is held after it finishes (for its lease); one whose caller
    went away while it was being admitted must not stay held."""
    from serving.async_engine import AsyncEngine

    eng = _engine()
    aeng = AsyncEngine(eng)
    w = SimpleNamespace(engine=aeng)

    async def run():
        task = asyncio.ensure_future(worker_mod.Worker.prefill(
            w, "p1", [5, 6, 7, 8], SamplingParams(max_tokens=4, temperature=0)))
        await asyncio.sleep(0)  # the add is queued; the task waits for its admission
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(500):  # the abort and the release land within a few steps
            if not await aeng.call(lambda e: e.has_unfinished() or bool(e.requests)):
                break
            await asyncio.sleep(0.01)
        await aeng.call(lambda e: e.fence.wait_all())
        return await aeng.call(lambda e: (list(e.requests), e.blocks.num_free,
                                          e.slots.num_free))

    try:
        assert asyncio.run(run()) == ([], NUM_BLOCKS, SLOTS)
    finally:
        aeng.shutdown()
        eng.close()


def _decode_worker(connect):
    """A stand-in worker for ``Worker.decode``: a source it has not met, ``connect`` as the
    handshake, and an engine that records when it is asked to add the request."""
    calls = []

    async def add(request_id, prompt, params, submit):
        calls.append(("add", request_id))
        return "stream"

    w = SimpleNamespace(_confirmations={}, engine=SimpleNamespace(add=add),
                        transfer=SimpleNamespace(knows_source=lambda params: False,
                                                 connect_source=lambda params: connect(calls)))
    return w, calls


def test_decode_shakes_hands_with_a_new_source_off_the_loop_and_the_engine_thread():
    """The first pull from a new source needs a handshake (a socket round trip, up to
    2 x 5 s to an unreachable peer): it runs in an executor thread before the request
    reaches the engine, whose thread would otherwise stall every running request."""
    import threading

    w, calls = _decode_worker(lambda calls: calls.append(("connect", threading.get_ident())))

    async def run():
        return await worker_mod.Worker.decode(w, "r", [1, 2], 3, SamplingParams(), {}), \
            threading.get_ident()

    (stream, _), loop_thread = asyncio.run(run())
    assert stream == "stream"
    assert [c[0] for c in calls] == ["connect", "add"]
    assert calls[0][1] != loop_thread


def test_decode_from_an_unreachable_source_fails_before_reserving_anything():
    from transfer import HandshakeError

    def unreachable(calls):
        raise HandshakeError("connection refused")

    w, calls = _decode_worker(unreachable)

    async def run():
        await worker_mod.Worker.decode(w, "r", [1, 2], 3, SamplingParams(), {})

    with pytest.raises(worker_mod.TransferFailed, match="unreachable"):
        asyncio.run(run())
    assert calls == [] and w._confirmations == {}


def test_a_worker_whose_engine_stopped_says_so_on_every_endpoint_the_router_reads():
    """/stats (the router's health poll) and /prefill answer 503 with engine_dead, which
    the router takes as "stop sending here" (a full engine's 503 does not carry it)."""
    from fastapi.testclient import TestClient

    from serving.async_engine import EngineOverloaded

    def stopped():
        raise EngineDead("engine stopped: boom")

    async def prefill(*a, **k):
        stopped()

    worker = SimpleNamespace(role="prefill", engine=SimpleNamespace(check_health=stopped),
                             stats=dict, prefill=prefill)
    client = TestClient(worker_mod.build_app(worker))
    for r in (client.get("/stats"), client.get("/health"),
              client.post("/prefill", json={"request_id": "r", "prompt_token_ids": [1],
                                            "params": {}})):
        assert r.status_code == 503 and r.json() == {"detail": "engine stopped: boom",
                                                     "engine_dead": True}

    async def full(*a, **k):
        raise EngineOverloaded("no free slot")

    worker.engine.check_health, worker.prefill = (lambda: None), full
    assert client.get("/stats").status_code == 200
    r = client.post("/prefill", json={"request_id": "r", "prompt_token_ids": [1], "params": {}})
    assert r.status_code == 503 and "engine_dead" not in r.json()
