"""Worker bookkeeping without processes or NIXL: ``DecodeWorker``'s claims, queue and
ticks and ``PrefillWorker.prefill``, on a fake-model engine and stand-ins for the
transfer manager (tests/test_worker_app.py: their HTTP API; tests/test_disagg.py runs
real workers)."""
import asyncio
import collections
import threading
from types import SimpleNamespace

import pytest
from test_engine_fake_model import FakeBatch, FakeCache, FakeModel, reference_next

from serving.async_engine import AsyncEngine
from serving.engine.connector import EngineConnector
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets
from serving.errors import EngineDead, TransferFailed
from serving.kv_transfer import CacheLayout, source_record
from serving.messages import DecodeRequest, Sampling
from serving.worker import DecodeWorker, PrefillWorker
from serving.worker.common import prompt_digest
from serving.worker.pull_book import PullBook
from transfer import Claim, HandshakeError, Ticket, TransferParamsError
from transfer.manager import Completion, TransferError

VOCAB, BLOCK, NUM_BLOCKS, SLOTS = 97, 4, 64, 4
LAYOUT = CacheLayout(block_bytes=64, conv_slot_bytes=16, ssm_slot_bytes=32, block_size=BLOCK)
SOURCE = ("127.0.0.1", 9999)
SECRET = "the workers' shared secret, test"


def _engine():
    cfg = EngineConfig(max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64,
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, num_slots=SLOTS,
                       eos_token_ids=(0,),
                       buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(4,), decode_seqs=(4,)))
    return Engine(FakeModel(VOCAB), FakeCache.allocate(NUM_BLOCKS, BLOCK, SLOTS), cfg,
                  batch_type=FakeBatch)


class Transfers:
    """A stand-in for the transfer manager: what the next tick collects, and a record of
    the claims made, pulled and released."""

    def __init__(self, claim=None):
        self.landed_ids, self.completions, self.settled_ids = [], [], []
        self.claims, self.pulled, self.released = [], [], []
        self._claim = claim

    def claim(self, ticket, key):
        self.claims.append((ticket.lease, key, threading.get_ident()))
        return self._claim(ticket)

    def pull(self, claim, local, timeout, remote_items):
        self.pulled.append((claim, remote_items, local))
        return 100 + len(self.pulled)

    def release(self, claim):
        self.released.append(claim)

    def collect(self):
        out, self.completions = self.completions, []
        return out

    def landed(self):
        out, self.landed_ids = self.landed_ids, []
        return out

    def settled(self):
        out, self.settled_ids = self.settled_ids, []
        return out


def _decode_worker(eng, transfer=None, engine=None):
    """A DecodeWorker around ``eng`` without cache regions, agent or threads of its own."""
    w = DecodeWorker.__new__(DecodeWorker)
    w.transfer_timeout, w.recompute, w.sharded, w.layout = 5.0, False, False, LAYOUT
    w._sources, w.book = frozenset({SOURCE}), PullBook()
    w.counters = collections.Counter()
    w.transfer = transfer or Transfers()
    w.engine = engine or SimpleNamespace(fail=lambda r, e: w.failed.append(r))
    w.failed = []
    return w


def _claim_for(prompt, src_blocks=(7, 8, 9), lease="abc.1"):
    return Claim("prefill-x", lease, 30.0, (), {
        "cache": source_record(LAYOUT, list(src_blocks), 2, len(prompt))})


def _with_a_pull(pull_id):
    """An engine holding one remote request whose pull is ``pull_id``, a decode worker
    around it, and the confirmations it resolved."""
    eng = _engine()
    prompt = [5, 6, 7, 8, 9, 10]
    rid = eng.add_remote_request(prompt, reference_next(prompt, VOCAB),
                                 SamplingParams(max_tokens=8, temperature=0))
    eng.reserve_transfers()
    w = _decode_worker(eng)
    w.book.pulling(pull_id, rid)
    confirmed = []
    w.book.confirm = lambda r, e=None: confirmed.append((r, e))
    return eng, rid, w, confirmed


@pytest.mark.parametrize("landed", [False, True])
def test_failed_pull_frees_the_request_at_once(landed):
    """A pull that fails (before or after its READ landed) ends the request with the
    error and returns its blocks and slot: it never decodes from unwritten memory."""
    eng, rid, w, confirmed = _with_a_pull(7)
    w.transfer.landed_ids = [7] if landed else []
    w.tick(eng)  # the READ landed (or not yet)
    w.transfer.completions = [Completion(7, "lease", TransferError("error", "injected"), 0, 0, 0.0)]
    w.tick(eng)
    assert w.failed == [rid] and confirmed[0][0] == rid
    assert isinstance(confirmed[0][1], TransferFailed)
    assert rid not in eng.requests and not eng.has_unfinished()
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS and eng.slots.num_free == SLOTS
    eng.close()


def test_failed_pull_whose_read_runs_on_holds_its_memory_until_the_read_ends():
    """NIXL's UCX backend does not stop a released READ: a pull that timed out with its
    READ in flight (``settled`` False) fails the request at once, but its blocks and slot
    stay out of the pools, where the READ may still write, until ``settled()`` lists it."""
    eng, rid, w, confirmed = _with_a_pull(7)
    w.transfer.completions = [
        Completion(7, "lease", TransferError("timeout", "deadline"), 0, 0, 0.0, settled=False)]
    w.tick(eng)
    assert w.failed == [rid] and isinstance(confirmed[0][1], TransferFailed)
    for settled, freed in (([], False), ([7], True)):  # still in flight, then ended
        w.transfer.settled_ids = settled
        w.tick(eng)
        eng.fence.wait_all()
        assert (eng.blocks.num_free == NUM_BLOCKS) == freed
        assert (eng.slots.num_free == SLOTS) == freed
    assert rid not in eng.requests and not eng.has_unfinished() and not w.book.draining
    eng.close()


def test_recompute_does_not_wait_for_a_read_that_runs_on():
    """With ``--on-transfer-failure recompute``, a pull that timed out with its READ in
    flight recomputes the prompt at once, in fresh memory: the request finishes with
    the right tokens while the READ still writes into the memory it gave up, which
    stays out of the pools until ``settled()`` lists the pull."""
    import jax
    import numpy as np
    from test_engine_fake_model import reference_greedy

    eng, rid, w, confirmed = _with_a_pull(7)
    w.recompute = True
    prompt = eng.requests[rid].prompt_token_ids
    old_blocks, old_slot = list(eng.requests[rid].block_ids), eng.requests[rid].slot
    w.transfer.completions = [
        Completion(7, "lease", TransferError("timeout", "deadline"), 0, 0, 0.0, settled=False)]
    w.tick(eng)
    assert w.failed == [] and confirmed == [(rid, None)] and 7 in w.book.draining
    late_read = jax.jit(lambda c: type(c)(c.kv.at[np.asarray(old_blocks)].set(-5),
                                          c.ssm.at[old_slot].set(-5)), donate_argnums=0)
    done, used = {}, set()
    for _ in range(100):  # the READ has not ended: settled() stays empty
        if not eng.has_unfinished():
            break
        if rid in eng.requests and eng.requests[rid].block_ids:
            used |= set(eng.requests[rid].block_ids) | {eng.requests[rid].slot + 1000}
        eng.runner.cache = late_read(eng.runner.cache)  # its bytes keep landing
        done.update({o.request_id: o for o in eng.step() if o.finished})
        w.tick(eng)
    assert done[rid].token_ids == reference_greedy(prompt, 8, VOCAB)
    assert not used & (set(old_blocks) | {old_slot + 1000})
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS - len(old_blocks) and eng.slots.num_free == SLOTS - 1
    w.transfer.settled_ids = [7]  # the READ ended
    w.tick(eng)
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS and eng.slots.num_free == SLOTS and not w.book.draining
    eng.close()


def _request(prompt, first, request_id="r", address=SOURCE, lease="abc.1", **params):
    return DecodeRequest(request_id=request_id, prompt_token_ids=prompt, first_token=first,
                         params=Sampling(**{"max_tokens": 8, "temperature": 0.0, **params}),
                         transfer=Ticket(agent="prefill-x", address=address, lease=lease,
                                         ttl=30.0), channel="c1")


def _serving_decode_worker(claim, max_queued=1024):
    """A decode worker whose engine thread runs (its ticks included) over a fake model."""
    eng = _engine()
    transfers = Transfers(claim)
    w = _decode_worker(eng, transfers)
    w.engine = AsyncEngine(eng, max_queued_requests=max_queued, connector=w)
    return eng, w, transfers


def test_decode_claims_off_the_loop_and_the_engine_thread_then_pulls_the_claimed_bytes():
    """The claim (a socket round trip, a handshake first with a new source) runs in an
    executor thread; the pull reads the source's own blocks and slot, from the claim."""
    prompt = [5, 6, 7, 8, 9, 10]
    first = reference_next(prompt, VOCAB)
    eng, w, transfers = _serving_decode_worker(lambda t: _claim_for(prompt))

    async def run():
        stream, confirmed = await w.decode(_request(prompt, first))
        for _ in range(200):
            if transfers.pulled:
                break
            await asyncio.sleep(0.01)
        await stream.aclose()
        return threading.get_ident()

    try:
        loop_thread = asyncio.run(run())
    finally:
        w.engine.shutdown()
    [(lease, key, thread)] = transfers.claims
    assert lease == "abc.1" and key == prompt_digest(prompt, first)
    assert thread not in (loop_thread, w.engine._thread.ident)
    [(claim, remote, local)] = transfers.pulled
    assert claim.lease == "abc.1"
    assert remote[0] == ("kv", 7 * LAYOUT.block_bytes, 2 * LAYOUT.block_bytes)  # blocks 7-8
    assert ("ssm", 2 * LAYOUT.ssm_slot_bytes, LAYOUT.ssm_slot_bytes) in remote  # slot 2


def _refused(w, request, error, match):
    """``w.decode(request)`` raises ``error`` (matching ``match``); the engine thread is
    stopped after."""
    try:
        with pytest.raises(error, match=match):
            asyncio.run(w.decode(request))
    finally:
        w.engine.shutdown()


def test_decode_contacts_no_source_the_router_did_not_register():
    """A ticket naming another address (a forged one, say) is refused before anything is
    contacted or reserved."""
    prompt = [5, 6, 7]
    eng, w, transfers = _serving_decode_worker(lambda t: pytest.fail("contacted"))

    _refused(w, _request(prompt, 3, address=("10.0.0.1", 80)), TransferParamsError,
             "not a prefill worker the router registered")
    assert transfers.claims == [] and len(w.book) == 0 and not eng.requests


def test_a_full_decode_worker_refuses_before_it_claims():
    """Its queue is full: it answers 503 without claiming the lease, which stays the
    source's for the router to send to another decode worker (a claim given up would
    have dropped it)."""
    from serving.errors import EngineOverloaded

    eng, w, transfers = _serving_decode_worker(lambda t: pytest.fail("claimed"), max_queued=0)

    _refused(w, _request([5, 6, 7], 3), EngineOverloaded, "max_queued_requests=0")
    assert transfers.claims == [] and transfers.released == [] and len(w.book) == 0


def test_a_lease_of_another_request_is_refused_as_the_clients_mistake():
    """The source refuses a claim whose key (this request's prompt and first token) is not
    its lease's, and leaves that lease to its own request: a 400 here, nothing reserved."""
    from transfer import ClaimError

    def mismatch(ticket):
        raise ClaimError("mismatch", f"lease {ticket.lease} holds the state of another request")

    eng, w, transfers = _serving_decode_worker(mismatch)

    _refused(w, _request([5, 6, 7], 3), TransferParamsError, "another request")
    assert transfers.released == [] and transfers.pulled == [] and not eng.requests


def test_decode_from_an_unreachable_source_fails_before_reserving_anything():
    def unreachable(ticket):
        raise HandshakeError("connection refused")

    eng, w, transfers = _serving_decode_worker(unreachable)

    _refused(w, _request([1, 2], 3), TransferFailed, "unreachable")
    assert len(w.book) == 0 and not eng.requests


def test_a_full_decode_side_queues_requests_and_an_aborted_one_gives_its_claim_back():
    """More requests than slots: the rest wait for memory (their claims keep the leases)
    rather than being refused; one whose client goes away while it waits gives its claim
    back and never gets memory."""
    prompts = [[5 + i, 6, 7, 8] for i in range(SLOTS + 2)]
    claims = {f"abc.{i}": _claim_for(p, lease=f"abc.{i}") for i, p in enumerate(prompts)}
    eng, w, transfers = _serving_decode_worker(lambda t: claims[t.lease])

    async def run():
        streams = [(await w.decode(_request(p, reference_next(p, VOCAB), request_id=f"r{i}",
                                            lease=f"abc.{i}")))[0]
                   for i, p in enumerate(prompts)]
        for _ in range(200):
            if len(transfers.pulled) == SLOTS and w.book.queued == {f"r{SLOTS}", f"r{SLOTS + 1}"}:
                break
            await asyncio.sleep(0.01)
        queued = await w.engine.call(lambda e: e.metrics()["num_waiting"])
        await streams[SLOTS].aclose()  # its client went away while it waited
        for _ in range(200):
            if transfers.released:
                break
            await asyncio.sleep(0.01)
        released = list(transfers.released)
        for s in streams:
            await s.aclose()
        return queued, released

    try:
        queued, released = asyncio.run(run())
    finally:
        w.engine.shutdown()
    assert len(transfers.pulled) == SLOTS and queued == 2
    assert released == [claims[f"abc.{SLOTS}"]]
    assert not w.book.is_open(f"r{SLOTS}")


def test_a_request_withdrawn_after_admission_is_confirmed_failed_when_its_memory_comes():
    """Its caller went away after admission and released the claim, and the engine
    reserved its memory before the abort landed: no pull starts, the request is aborted
    and its caller's future ends with an error rather than staying open for ever."""
    eng = SimpleNamespace(reserve_transfers=lambda: [("r", [1], 0, 0, 4)], aborted=[],
                          finished=[], has_request=lambda r: True)
    eng.abort = eng.aborted.append
    eng.finish_transfer = lambda r, ok: eng.finished.append((r, ok))
    w = _decode_worker(eng)
    loop = asyncio.new_event_loop()
    confirmed = w.book.open("r", "r's claim", loop)
    w.book.admit("r", lambda: None)
    assert w.book.withdraw("r") == "r's claim"
    w._start_pulls(eng)
    loop.run_until_complete(asyncio.sleep(0))
    assert eng.aborted == ["r"] and eng.finished == [("r", False)]
    assert isinstance(confirmed.exception(), TransferFailed) and len(w.book) == 0
    assert w.transfer.pulled == []
    loop.close()


def test_confirmation_wait_ends_when_the_engine_dies():
    """Only the engine thread resolves a pull's confirmation: if it stops, the waiting
    request gets EngineDead instead of hanging, and unpulled claims are given back."""
    eng = _engine()

    def lost():
        raise RuntimeError("device lost")

    eng.step = lost
    w = _decode_worker(eng)
    w.book.claims["q"] = "a claim"  # queued, not pulled

    async def run():
        fut = w.book.open("r", "r's claim", asyncio.get_running_loop())
        plain = EngineConnector()  # admits a local request (whose step dies) ...
        plain.on_stop = w.on_stop  # ... and stops as the decode worker does
        aeng = AsyncEngine(eng, connector=plain)
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
    assert sorted(w.transfer.released) == ["a claim", "r's claim"] and len(w.book) == 0
    eng.close()


def test_duplicate_request_id_on_decode_leaves_the_first_alone():
    w = _decode_worker(_engine())
    loop = asyncio.new_event_loop()
    first = w.book.open("r", "the first's claim", loop)

    with pytest.raises(ValueError, match="duplicate request id r"):
        asyncio.run(w.decode(_request([1, 2], 3)))
    assert w.book.claims == {"r": "the first's claim"} and not first.done()
    assert w.transfer.claims == [] and w.transfer.released == []
    loop.close()


def test_prefill_cancelled_during_admission_releases_its_hold():
    """A prefill request is held after it finishes (for its lease); one whose caller
    went away while it was being admitted must not stay held."""
    from serving.messages import PrefillRequest

    eng = _engine()
    aeng = AsyncEngine(eng)
    w = PrefillWorker.__new__(PrefillWorker)
    w.engine = aeng

    async def run():
        task = asyncio.ensure_future(w.prefill(PrefillRequest(
            request_id="p1", prompt_token_ids=[5, 6, 7, 8],
            params=Sampling(max_tokens=4, temperature=0.0))))
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


def test_decodes_claiming_at_once_past_a_full_queue_give_no_claim_up():
    """Two /decode calls for a queue of one place: the second is refused before it
    claims (503), as one alone would be. Had both claimed, the add after the claim would
    refuse the second and its claim, given up, would drop the lease the router's retry
    on another worker needs."""
    import time

    from serving.errors import EngineOverloaded

    prompts = [[5, 6, 7, 8], [9, 10, 11, 12]]
    claims = {f"abc.{i}": _claim_for(p, lease=f"abc.{i}") for i, p in enumerate(prompts)}

    def slow_claim(ticket):  # both calls are past the room check while the first claims
        time.sleep(0.2)
        return claims[ticket.lease]

    eng, w, transfers = _serving_decode_worker(slow_claim, max_queued=1)

    async def run():
        got = await asyncio.gather(*(w.decode(_request(p, reference_next(p, VOCAB),
                                                       request_id=f"r{i}", lease=f"abc.{i}"))
                                     for i, p in enumerate(prompts)), return_exceptions=True)
        for g in got:
            if not isinstance(g, BaseException):
                await g[0].aclose()
        return got

    try:
        got = asyncio.run(run())
    finally:
        w.engine.shutdown()
    assert not isinstance(got[0], BaseException) and isinstance(got[1], EngineOverloaded)
    assert [lease for lease, _, _ in transfers.claims] == ["abc.0"]
    assert transfers.released == [] and w.engine.num_queued() == 0


def test_a_decode_cancelled_while_it_claims_gives_the_claim_up():
    """The caller goes away while the claim runs in its thread: the claim is given up as
    it arrives (the source frees the lease now), instead of being held and extended with
    no one to pull it; the place it reserved in the queue is free again."""
    import time

    prompt = [5, 6, 7, 8]
    claim = _claim_for(prompt)

    def slow_claim(ticket):  # still running when the caller goes away
        time.sleep(1.0)
        return claim

    eng, w, transfers = _serving_decode_worker(slow_claim)

    async def run():
        task = asyncio.ensure_future(w.decode(_request(prompt, reference_next(prompt, VOCAB))))
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(300):
            if transfers.released:
                break
            await asyncio.sleep(0.01)

    try:
        asyncio.run(run())
    finally:
        w.engine.shutdown()
    assert transfers.released == [claim] and len(w.book) == 0
    assert w.engine.num_queued() == 0 and not eng.requests


def test_a_cancelled_duplicate_prefill_leaves_the_held_request_alone():
    """A second /prefill with the id of a request whose memory a lease pins, cancelled
    while its admission is pending (the engine refuses it as a duplicate): the first
    request keeps its memory, which a decode worker may be reading."""
    from serving.messages import PrefillRequest

    class Pins:  # the transfer manager's source side, as the prefill worker uses it
        def pin(self, items, on_free, key, meta):
            return Ticket(agent="prefill-x", address=SOURCE, lease="abc.1", ttl=30.0)

        def collect(self):
            return []

    eng = _engine()
    w = PrefillWorker.__new__(PrefillWorker)
    w.layout, w.sharded, w.counters, w.transfer = LAYOUT, False, collections.Counter(), Pins()
    w.engine = aeng = AsyncEngine(eng, connector=w)
    req = PrefillRequest(request_id="p1", prompt_token_ids=[5, 6, 7, 8, 9, 10],
                         params=Sampling(max_tokens=4, temperature=0.0))

    async def run():
        assert (await w.prefill(req)).transfer is not None  # held under its lease
        held = await aeng.call(lambda e: e.held_memory("p1"))
        task = asyncio.ensure_future(w.prefill(req))
        await asyncio.sleep(0)  # its add is queued; the task waits for the admission
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        for _ in range(20):  # steps for a wrong abort or release to land in
            await asyncio.sleep(0.01)
        await aeng.call(lambda e: e.fence.wait_all())
        return held, await aeng.call(lambda e: (e.held_memory("p1"), e.blocks.num_free))

    try:
        held, (still, free) = asyncio.run(run())
    finally:
        aeng.shutdown()
        eng.close()
    assert still == held and free == NUM_BLOCKS - len(held[0])


def test_a_call_sent_as_the_engine_thread_dies_ends_with_engine_dead():
    """The thread dies between a call's health check and its command (and empties the
    inbox on its way out): the call ends with EngineDead instead of waiting for ever."""
    eng = _engine()
    aeng = AsyncEngine(eng)
    healthy = aeng.check_health

    def healthy_then_the_thread_dies():
        healthy()

        def lost(engine):
            raise RuntimeError("device lost")

        aeng.connector.tick = lost
        aeng.wake()
        aeng._thread.join(5)

    aeng.check_health = healthy_then_the_thread_dies

    async def run():
        return await asyncio.wait_for(aeng.call(lambda e: "ran"), 3)

    try:
        with pytest.raises(EngineDead, match="device lost"):
            asyncio.run(run())
    finally:
        aeng.shutdown()
        eng.close()


def test_a_prefill_whose_result_cannot_be_sent_pins_nothing_and_frees_its_memory(monkeypatch):
    """The first token's result fails its own checks (a NaN logprob, say): no lease is
    pinned for it, and the memory held for that lease goes back to the pools."""
    from serving.messages import PrefillRequest
    from serving.worker import prefill as prefill_module

    def unsendable(**fields):
        raise ValueError("logprobs: a NaN")

    monkeypatch.setattr(prefill_module, "PrefillResult", unsendable)
    eng = _engine()
    w = PrefillWorker.__new__(PrefillWorker)
    w.transfer = SimpleNamespace(pin=lambda *a, **k: pytest.fail("pinned"), collect=list)
    w.engine = aeng = AsyncEngine(eng, connector=w)
    req = PrefillRequest(request_id="p1", prompt_token_ids=[5, 6, 7, 8, 9, 10],
                         params=Sampling(max_tokens=4, temperature=0.0))

    async def run():
        with pytest.raises(ValueError, match="NaN"):
            await w.prefill(req)
        await aeng.call(lambda e: e.fence.wait_all())
        return await aeng.call(lambda e: (list(e.requests), e.blocks.num_free, e.slots.num_free))

    try:
        assert asyncio.run(run()) == ([], NUM_BLOCKS, SLOTS)
    finally:
        aeng.shutdown()
        eng.close()
