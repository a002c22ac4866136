"""Engine tests against the fake model (test_engine_fake_model.py): every scheduling
path must give exactly the tokens of the sequence computed alone."""

from types import SimpleNamespace

import jax
import numpy as np
import pytest

from test_engine_fake_model import FakeBatch, FakeCache, FakeModel, reference_greedy, reference_next
from serving.engine import Engine, EngineConfig, SamplingParams
from serving.engine.buckets import Buckets

VOCAB = 101
NUM_BLOCKS, BLOCK, SLOTS = 48, 4, 8


def make_engine(prefix_caching: bool, **kw) -> Engine:
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, num_slots=SLOTS,
                       max_logprobs=3, eos_token_ids=(0,),
                       buckets=Buckets(prefill_tokens=(16, 32), prefill_seqs=(2, 8),
                                       decode_seqs=(4, 8)),
                       enable_prefix_caching=prefix_caching, **kw)
    return Engine(FakeModel(VOCAB), FakeCache.allocate(NUM_BLOCKS, BLOCK, cfg.num_state_rows),
                  cfg, batch_type=FakeBatch)


@pytest.fixture(scope="module", params=[False, True], ids=["prefix-off", "prefix-on"])
def engine(request):
    """Every test runs with prefix caching off and on (interval 2 blocks): outputs must
    not change, memory must come back either way."""
    eng = make_engine(request.param, prefix_state_interval=2)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def restore(engine):
    yield
    reset_and_check(engine)


def reset_and_check(engine):
    engine.config.async_scheduling = True
    engine.scheduler.max_num_batched_tokens = 32
    assert_all_free(engine)


def assert_all_free(engine):
    assert not engine.has_unfinished()
    engine.fence.wait_all()
    assert engine.blocks.num_free == NUM_BLOCKS
    assert engine.slots.num_free == SLOTS
    assert not engine.requests
    assert engine.metrics()["serving_compiles"] == 0


def prompts(n, seed, lo=1, hi=60):
    rng = np.random.default_rng(seed)
    return [[int(t) for t in rng.integers(1, VOCAB, rng.integers(lo, hi))] for _ in range(n)]


GREEDY = SamplingParams(max_tokens=24, temperature=0, ignore_eos=True)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget", [32, 7])
def test_batched_greedy_equals_alone(engine, async_scheduling, budget):
    """24 prompts, mixed lengths; with budget 7 every prompt is cut at odd,
    block-unaligned chunk boundaries. The pool is small, so requests are also
    preempted and recomputed."""
    engine.config.async_scheduling = async_scheduling
    engine.scheduler.max_num_batched_tokens = budget
    ps = prompts(24, seed=budget)
    before = engine.scheduler.num_preemptions
    outs = engine.generate(ps, GREEDY)
    for o, p in zip(outs, ps):
        assert o.token_ids == reference_greedy(p, 24, VOCAB), o.request_id
        assert o.finish_reason == "length"
    assert engine.scheduler.num_preemptions > before  # the pool forced preemption


def test_remote_request_ended_by_its_first_token_is_refused(engine):
    """No step would ever report a request its first token already ends (EOS here,
    max_tokens 1 below): refused at admission, its memory back at once."""
    p = prompts(1, seed=7)[0]
    with pytest.raises(ValueError, match="already ends the request"):
        engine.add_remote_request(p, 0, SamplingParams(max_tokens=24, temperature=0))  # EOS
    with pytest.raises(ValueError, match="already ends the request"):
        engine.add_remote_request(p, 5, SamplingParams(max_tokens=1, temperature=0))
    assert not engine.requests and engine.blocks.num_free == NUM_BLOCKS


@pytest.mark.parametrize("bad", [VOCAB, -1, 2**40, 1.0, True])
def test_token_ids_outside_the_vocabulary_are_refused_at_admission(engine, bad):
    """An id the embedding has no row for (or one that would overflow int32 inside a
    step serving other requests) is refused before it reaches the scheduler."""
    with pytest.raises(ValueError, match="not a token id of the vocabulary"):
        engine.add_request([3, bad, 4], GREEDY)
    with pytest.raises(ValueError, match="not a token id of the vocabulary"):
        engine.add_remote_request([3, 4], bad, GREEDY)
    assert not engine.requests
    out = engine.generate([[3, 4]], GREEDY)  # and the engine serves on
    assert out[0].token_ids == reference_greedy([3, 4], 24, VOCAB)


def test_remote_requests_beyond_capacity_wait_for_memory_in_arrival_order(engine):
    """Requests computed elsewhere are queued, not refused, while memory is short: each
    gets its blocks and slot as memory frees, first come first served, and one aborted
    while it waits holds nothing."""
    ps = prompts(SLOTS + 3, seed=11, lo=5, hi=8)
    ids = [engine.add_remote_request(p, reference_next(p, VOCAB), GREEDY) for p in ps]
    reserved = [r.request_id for r in engine.reserve_transfers()]
    assert reserved == ids[:SLOTS]  # a slot each: the rest wait
    assert engine.metrics()["num_waiting"] == 3
    engine.abort(ids[SLOTS])  # gone while queued: never gets memory
    for rid in reserved:
        engine.finish_transfer(rid, ok=False)  # recompute them, as a failed pull would
    done, later = {}, []
    while engine.has_unfinished():
        for r, *_ in engine.reserve_transfers():
            later.append(r)
            engine.finish_transfer(r, ok=False)
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert later == ids[SLOTS + 1:]
    for rid, p in zip(ids, ps):
        if rid != ids[SLOTS]:
            assert done[rid].token_ids == reference_greedy(p, 24, VOCAB)


def test_eos_stop_ids_and_logprobs(engine):
    p = prompts(1, seed=3)[0]
    ref = reference_greedy(p, 30, VOCAB)
    stop_at = ref[5]
    first = ref.index(stop_at)
    o = engine.generate([p], SamplingParams(max_tokens=30, temperature=0, stop_token_ids=[stop_at],
                                            logprobs=2))[0]
    assert o.token_ids == ref[:first + 1] and o.stop_reason == stop_at
    assert len(o.logprobs) == len(o.token_ids)
    for tok, lp in zip(o.token_ids, o.logprobs):
        assert max(lp, key=lp.get) == tok and len(lp) == 2  # chosen is the top-1
    o = engine.generate([p], SamplingParams(max_tokens=30, temperature=0))[0]  # EOS = 0
    assert 0 not in o.token_ids[:-1] and (o.token_ids[-1] == 0 or len(o.token_ids) == 30)


def test_seeded_sampling_reproducible_and_batch_independent(engine):
    ps = prompts(6, seed=4)
    sp = SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=1234)
    a = [o.token_ids for o in engine.generate(ps, sp)]
    engine.config.async_scheduling = False
    b = [o.token_ids for o in engine.generate(ps[::-1], sp)][::-1]
    assert a == b
    c = engine.generate(ps[:1], SamplingParams(max_tokens=16, temperature=1.0, top_p=0.9, seed=99))
    assert c[0].token_ids != a[0]


def test_aborts_at_any_point(engine):
    ps = prompts(16, seed=5)
    rng = np.random.default_rng(5)
    ids = [engine.add_request(p, GREEDY) for p in ps]
    abort_at = {i: int(rng.integers(0, 30)) for i in ids[::2]}
    done, step = {}, 0
    while engine.has_unfinished():
        for rid, when in abort_at.items():
            if when == step:
                out = engine.abort(rid)
                if out is not None:
                    done[rid] = out
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
        step += 1
    for rid, p in zip(ids, ps):
        o = done[rid]
        ref = reference_greedy(p, 24, VOCAB)
        if rid in abort_at and o.finish_reason == "abort":
            assert o.token_ids == ref[:len(o.token_ids)]
        else:
            assert o.token_ids == ref


def fill_as_a_transfer(engine, prompt, blocks, slot, skip=0):
    """Write a prompt's KV into `blocks` after the first `skip` and its state into `slot`,
    outside the step programs, as a transfer would."""
    h = 0
    for x in prompt:
        h = (h * 31 + x) % 1_000_003
    kv = np.full((len(blocks) * BLOCK,), 5, np.int32)
    kv[:len(prompt)] = prompt
    fill = jax.jit(lambda c, b, v, s, hv: FakeCache(c.kv.at[b].set(v), c.ssm.at[s].set(hv)),
                   donate_argnums=0)
    engine.runner.cache = fill(engine.runner.cache, np.asarray(blocks[skip:], np.int32),
                               kv.reshape(-1, BLOCK)[skip:], slot, h)


def test_an_unconfirmed_transfer_holds_no_waiting_request_back(engine):
    """lpm keeps a request waiting while another computes the prefix it would hit; a
    transfer whose bytes landed unconfirmed computes none, so a request sharing its
    first block is admitted at the next step, not after the transfer's whole decode."""
    p = prompts(1, seed=8, lo=3 * BLOCK)[0][:3 * BLOCK]
    rid = engine.add_remote_request(p, reference_next(p, VOCAB), GREEDY)
    [(_, blocks, slot, shared, _)] = engine.reserve_transfers()
    fill_as_a_transfer(engine, p, blocks, slot, skip=shared)
    engine.finish_transfer(rid, ok=True, confirmed=False)
    other = engine.add_request(p[:BLOCK] + [50, 51, 52], SamplingParams(max_tokens=2))
    engine.step()
    assert engine.requests[other].num_computed_tokens > 0
    engine.confirm_transfer(rid)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid].token_ids == reference_greedy(p, 24, VOCAB)


def test_an_answer_done_before_its_bytes_word_holds_blocks_only_to_cache_them(engine):
    """A request that finishes before its source confirms the landed bytes keeps its
    blocks for the word only where a prefix cache would take them; without one they go
    back at once (holding them would only take memory from running requests)."""
    p = prompts(1, seed=9, lo=20)[0]
    rid = engine.add_remote_request(p, reference_next(p, VOCAB), GREEDY)
    [(_, blocks, slot, shared, _)] = engine.reserve_transfers()
    fill_as_a_transfer(engine, p, blocks, slot, skip=shared)
    engine.finish_transfer(rid, ok=True, confirmed=False)
    while engine.has_unfinished():
        engine.step()
    engine.fence.wait_all()
    assert (engine.blocks.num_free < NUM_BLOCKS) == (engine.prefix is not None)
    engine.confirm_transfer(rid)
    assert_all_free(engine)


def test_transfer_target_filled_then_decoded(engine):
    """The disaggregated decode side: reserve memory, fill it outside the step
    programs (as a transfer would), then decode from it. With prefix caching the same
    prompt again finds its blocks cached on this side: the transfer fills the rest."""
    p = prompts(1, seed=6, lo=20)[0]
    first = reference_next(p, VOCAB)
    rid = engine.add_remote_request(p, first, GREEDY)
    [(_, blocks, slot, shared, _)] = engine.reserve_transfers()
    assert shared == 0
    engine.step()  # nothing runs for it while the transfer is pending
    assert engine.requests[rid].num_computed_tokens == 0
    fill_as_a_transfer(engine, p, blocks, slot)
    engine.finish_transfer(rid, ok=True)
    done = {}
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid].token_ids == reference_greedy(p, 24, VOCAB)

    rid3 = engine.add_remote_request(p, first, GREEDY)
    [(_, blocks3, slot3, shared, _)] = engine.reserve_transfers()
    assert shared == (len(p) // BLOCK if engine.prefix else 0)
    assert blocks3[:shared] == blocks[:shared]
    fill_as_a_transfer(engine, p, blocks3, slot3, skip=shared)
    engine.finish_transfer(rid3, ok=True)
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid3].token_ids == reference_greedy(p, 24, VOCAB)

    rid2 = engine.add_remote_request(p, first, GREEDY)  # a failed transfer: recompute
    assert [r.request_id for r in engine.reserve_transfers()] == [rid2]
    engine.finish_transfer(rid2, ok=False)
    while engine.has_unfinished():
        done.update({o.request_id: o for o in engine.step() if o.finished})
    assert done[rid2].token_ids == reference_greedy(p, 24, VOCAB)


def test_500_random_requests_fenced_and_all_memory_returned(engine):
    """Random lengths, sampling options, aborts and incoming transfers. After
    every step: no block or slot that a not-yet-completed step may write is in
    a free pool (race A), nor reserved for a transfer in progress (race B).
    At the end every block and slot is back, and nothing compiled."""
    runner, fence = engine.runner, engine.fence
    used = {}  # step seq -> (blocks, slots) it may write
    run = runner.run

    def recording_run(x, is_decode):
        out = run(x, is_decode)
        blocks, slots = set(), set()
        for i in range(len(x.start_pos)):
            n = int(x.cu_seqlens[i + 1] - x.cu_seqlens[i])
            if n:
                end = int(x.start_pos[i]) + n
                blocks.update(int(b) for b in x.block_tables[i, :-(-end // BLOCK)])
                slots.add(int(x.slots[i]))
        used[fence.dispatched + 1] = (blocks, slots)
        return out

    runner.run = recording_run
    try:
        rng = np.random.default_rng(7)
        live, queued, transfers, n_added, n_done = [], [], {}, 0, 0
        # memory a failed transfer's READ may still write: (blocks, slots, memory, the
        # last step dispatched before it was given up)
        draining = []
        while n_added < 500 or engine.has_unfinished():
            for _ in range(int(rng.integers(0, 4))):
                if n_added < 500:
                    sp = SamplingParams(max_tokens=int(rng.integers(1, 20)),
                                        temperature=float(rng.choice([0, 0.8])),
                                        top_k=int(rng.choice([0, 5])), seed=int(rng.integers(99)))
                    p = prompts(1, seed=n_added, hi=50)[0]
                    if rng.random() < 0.1:
                        first = reference_next(p, VOCAB)
                        if sp.max_tokens == 1 or first == 0:  # ends at once: refused
                            with pytest.raises(ValueError, match="already ends"):
                                engine.add_remote_request(p, first, sp)
                        else:
                            queued.append(engine.add_remote_request(p, first, sp))
                    else:
                        live.append(engine.add_request(p, sp))
                    n_added += 1
            if live and rng.random() < 0.15:
                engine.abort(live.pop(int(rng.integers(len(live)))))
            if queued and rng.random() < 0.05:  # a client gone while its request waits
                engine.abort(queued.pop(int(rng.integers(len(queued)))))
            for rid, blocks, slot, *_ in engine.reserve_transfers():  # memory for queued ones
                queued.remove(rid)
                transfers[rid] = (set(blocks), {slot})
            for rid in [r for r in transfers if rng.random() < 0.2]:
                del transfers[rid]
                if rng.random() < 0.5:  # "transfer failed": the prompt is recomputed locally
                    engine.finish_transfer(rid, ok=False)
                    continue
                # failed with its READ still running: the request (aborted, or recomputed
                # in fresh memory) gives the memory up until the READ ends
                if rng.random() < 0.3:
                    engine.abort(rid)
                memory = engine.abandon_transfer(rid)
                draining.append((set(memory[0]), {memory[1]}, memory, fence.dispatched))
            for d in [d for d in draining if rng.random() < 0.2]:  # the READ ended
                draining.remove(d)
                engine.free_memory(d[2])
            engine.config.async_scheduling = bool(rng.random() < 0.8)
            for o in engine.step():
                n_done += o.finished
            free_blocks = engine.blocks.free_ids()
            free_slots = set(engine.slots._free)
            for seq, (blocks, slots) in used.items():
                if seq > fence.completed:
                    assert not blocks & free_blocks and not slots & free_slots, seq
                    for t_blocks, t_slots in transfers.values():
                        assert not blocks & t_blocks and not slots & t_slots, seq
            for d_blocks, d_slots, _, since in draining:  # no later step, no free pool
                assert not d_blocks & free_blocks and not d_slots & free_slots
                assert all(not blocks & d_blocks and not slots & d_slots
                           for seq, (blocks, slots) in used.items() if seq > since)
    finally:
        runner.run = run
    for d in draining:
        engine.free_memory(d[2])
    assert n_done > 300
    assert_all_free(engine)


def test_async_keeps_one_step_in_flight(engine):
    """With async scheduling, step() returns with the step it dispatched still
    queued on the device (its outputs are processed by the next call)."""
    engine.add_request(prompts(1, seed=10)[0], GREEDY)
    depths = []
    while engine.has_unfinished():
        engine.step()
        depths.append(len(engine._inflight))
    assert max(depths) == 1 and depths.count(1) >= 20


def test_compile_during_serving_is_counted(engine):
    """The guard behind every `serving_compiles == 0` assertion does fire."""
    before, buckets = engine.compiles.serving_compiles, engine.runner.buckets
    engine.runner.buckets = Buckets(prefill_tokens=(24,), prefill_seqs=(3,), decode_seqs=(5,))
    try:
        out = engine.generate([[1, 2, 3]], SamplingParams(max_tokens=2, temperature=0))
    finally:
        engine.runner.buckets = buckets
    assert out[0].token_ids == reference_greedy([1, 2, 3], 2, VOCAB)
    # one prefill and one decode shape, each a forward pass and a greedy sampler
    assert engine.compiles.serving_compiles == before + 4
    engine.compiles.serving_compiles = before


class CharTokenizer:
    """Token t is the letter chr(97 + t % 26)."""
    def encode(self, text):
        return [ord(c) - 97 for c in text]

    def decode(self, ids):
        return "".join(chr(97 + t % 26) for t in ids)


def test_stop_strings(engine):
    engine.tokenizer = tok = CharTokenizer()
    try:
        p = prompts(1, seed=8)[0]
        full = tok.decode(reference_greedy(p, 24, VOCAB))
        stop = full[9:11]
        cut = full.find(stop)
        o = engine.generate([p], SamplingParams(max_tokens=24, temperature=0, stop=[stop]))[0]
        assert o.finish_reason == "stop" and o.stop_reason == stop
        assert o.text == full[:cut] and len(o.token_ids) == cut + len(stop)
        o = engine.generate([p], SamplingParams(max_tokens=24, temperature=0, stop=stop,
                                                include_stop_str_in_output=True))[0]
        assert o.text == full[:cut + len(stop)]
    finally:
        engine.tokenizer = None


def test_hold_on_finish_keeps_memory_until_released(engine):
    """The prefill side of disaggregation: a finished request's blocks and slot
    stay pinned (a transfer reads them) until the lease is released."""
    p = prompts(1, seed=9, lo=20)[0]
    with pytest.raises(ValueError):
        engine.add_request(p, GREEDY, hold_on_finish=True)
    rid = engine.add_request(p, SamplingParams(max_tokens=1, temperature=0), hold_on_finish=True)
    while engine.has_unfinished():
        engine.step()
    engine.fence.wait_all()
    req = engine.requests[rid]
    assert req.is_finished and req.slot is not None
    assert req.output_token_ids == [reference_next(p, VOCAB)]
    assert engine.blocks.num_free == NUM_BLOCKS - len(req.block_ids)
    assert engine.slots.num_free == SLOTS - 1
    m = engine.metrics()  # the memory gauges count the held blocks and slot
    assert m["kv_bytes_in_use"] == len(req.block_ids) * BLOCK * 4  # int32 per position
    assert m["state_bytes_in_use"] == 4
    engine.release(rid)


def test_generate_refuses_a_params_list_of_another_length(engine):
    with pytest.raises(ValueError, match="3 prompts but 1 SamplingParams"):
        engine.generate([[5, 6], [7, 8], [9, 10]], [SamplingParams(max_tokens=2)])
    assert not engine.has_unfinished()


def test_max_logprobs_over_the_vocabulary_is_refused_at_construction():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, num_slots=SLOTS,
                       max_logprobs=VOCAB + 1,
                       buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(8,), decode_seqs=(8,)))
    with pytest.raises(ValueError, match=f"max_logprobs {VOCAB + 1} is over"):  # not JAX's top_k
        Engine(FakeModel(VOCAB), FakeCache.allocate(NUM_BLOCKS, BLOCK, cfg.num_state_rows), cfg,
               batch_type=FakeBatch)


def test_max_model_len_past_the_models_positions_is_refused_at_construction():
    cfg = EngineConfig(max_num_seqs=8, max_num_batched_tokens=32, max_model_len=96,
                       block_size=BLOCK, num_blocks=NUM_BLOCKS, num_slots=SLOTS,
                       buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(8,), decode_seqs=(8,)))
    model = FakeModel(VOCAB)
    model.config = SimpleNamespace(vocab_size=VOCAB, max_position_embeddings=64)
    with pytest.raises(ValueError, match="max_model_len 96 is over the model's "
                                         "max_position_embeddings 64"):
        Engine(model, FakeCache.allocate(NUM_BLOCKS, BLOCK, cfg.num_state_rows), cfg,
               batch_type=FakeBatch)


def test_swap_cache_keeps_programs_and_refuses_other_shapes(engine):
    """The same compiled programs on a fresh cache of the same avals (bench/decode_step.py)
    give the same tokens without a compile; a cache of another shape is refused."""
    ps = prompts(3, seed=21)
    before = [o.token_ids for o in engine.generate(ps, GREEDY)]
    old = engine.runner.cache
    rows = engine.config.num_state_rows
    with pytest.raises(ValueError, match="compiled for"):
        engine.swap_cache(FakeCache.allocate(NUM_BLOCKS + 1, BLOCK, rows))
    engine.swap_cache(FakeCache.allocate(NUM_BLOCKS, BLOCK, rows))
    try:
        assert [o.token_ids for o in engine.generate(ps, GREEDY)] == before
        assert before == [reference_greedy(p, 24, VOCAB) for p in ps]
    finally:
        engine.swap_cache(old)
