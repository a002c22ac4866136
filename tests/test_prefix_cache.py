"""Prefix caching (serving/engine/prefix_cache.py) on the fake model, whose next token
depends on every earlier token through both the paged "KV" and the recurrent state:
a wrong shared block, a stale snapshot or a snapshot of the wrong position changes
the output. Outputs must equal the sequence computed alone; hits must happen where
the design says; every block and snapshot must come back."""

import numpy as np
import pytest

from test_engine_fake import (BLOCK, NUM_BLOCKS, SLOTS, VOCAB, assert_all_free,
                              fill_as_a_transfer, make_engine, reset_and_check)
from test_engine_fake_model import reference_greedy, reference_next
from serving.engine import SamplingParams
from serving.engine.block_pool import BlockPool

GREEDY = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def engine():
    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=24)
    yield eng
    eng.close()


@pytest.fixture(autouse=True)
def restore(engine):
    yield
    reset_and_check(engine)
    check_consistent(engine)


def check_consistent(engine):
    """Every key names a cached block and back; no held block is evictable."""
    p, pool = engine.prefix, engine.blocks
    assert {b: k for k, b in p._block.items()} == p._key
    assert all(pool.is_cached(b) for b in p._key)
    assert all(pool.ref_count(b) == 0 and pool.is_cached(b) for b in pool._evictable)
    assert len(p.rows) <= engine.config.num_prefix_snapshots


def run(engine, prompts, params=GREEDY):
    outs = engine.generate(prompts, params)
    assert [o.token_ids for o in outs] == [reference_greedy(p, params.max_tokens, VOCAB)
                                           for p in prompts]
    return outs


def tokens(n, seed):
    return [int(t) for t in np.random.default_rng(seed).integers(1, VOCAB, n)]


def test_block_pool_keeps_cached_blocks_until_it_needs_them():
    evicted = []
    pool = BlockPool(6, on_evict=evicted.append)
    a = pool.allocate(4)
    for b in a[:3]:
        pool.mark_cached(b)
    pool.free(a)  # a[3] is free; a[0..2] keep their content, the last first in line
    assert pool.num_free == 6 and pool.num_evictable == 3
    pool.touch([a[0]])  # a hit revives a block
    assert pool.ref_count(a[0]) == 1 and pool.num_evictable == 2
    assert sorted(pool.allocate(3)) == [a[3], 4, 5] and not evicted  # free blocks first
    assert pool.allocate(1) == [a[2]] and evicted == [a[2]]  # then the prefix's tail
    assert not pool.is_cached(a[2])
    with pytest.raises(ValueError, match="not cached"):
        pool.touch([a[3]])
    with pytest.raises(MemoryError):
        pool.allocate(2)


@pytest.mark.parametrize("async_scheduling", [True, False])
@pytest.mark.parametrize("budget", [32, 7])
def test_hits_of_none_a_partial_block_and_many_blocks(engine, async_scheduling, budget):
    """A 30-token prompt (7 full blocks of 4 and 2 tokens), then prompts sharing none of
    it, 6 tokens (one block and a partial one), all of it and more, and all of it: each
    starts after the longest cached block boundary that leaves a token to compute, with
    budget 7 at chunk boundaries inside blocks too."""
    engine.config.async_scheduling = async_scheduling
    engine.scheduler.max_num_batched_tokens = budget
    seed = 2 * budget + async_scheduling
    a = tokens(30, seed=seed)
    assert run(engine, [a])[0].num_cached_tokens == 0
    cases = [(tokens(12, seed=seed + 100), 0), (a[:6] + tokens(9, seed=5), 4),
             (a + tokens(5, seed=6), 28), (a, 28), (a[:29], 28), (a[:28], 24)]
    outs = [run(engine, [p])[0] for p, _ in cases]
    assert [o.num_cached_tokens for o in outs] == [want for _, want in cases]


def test_a_prompt_of_whole_blocks_repeated_computes_its_last_block():
    """32 tokens = 8 full blocks: the repeat must compute at least its last token, so it
    restores the snapshot at 28 and recomputes block 7 into a block of its own."""
    eng = make_engine(True, prefix_state_interval=4, num_prefix_snapshots=4)
    try:
        a = tokens(32, seed=3)
        run(eng, [a])
        assert run(eng, [a])[0].num_cached_tokens == 28
        assert run(eng, [a + [5]])[0].num_cached_tokens == 32
        assert_all_free(eng)
    finally:
        eng.close()


def test_a_step_never_takes_one_snapshot_row_twice():
    """Two snapshot rows, and a step whose prompts pass more snapshot points than that
    (a point every block): the step takes at most two, each in a row of its own (a
    third would evict a row this step writes, so two states would land in one row under
    one key). The prompts' follow-ups restore what the rows hold and stay exact."""
    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=2)
    taken, prepare = [], eng.runner.prepare

    def watched(sched):
        taken.append([row for s in sched.seqs for _, row in s.snapshots])
        return prepare(sched)

    eng.runner.prepare = watched
    try:
        prompts = [tokens(12, seed=21), tokens(16, seed=22)]
        run(eng, prompts)
        assert max(map(len, taken)) == 2
        assert all(len(rows) == len(set(rows)) for rows in taken), taken
        outs = run(eng, [p + tokens(3, seed=23) for p in prompts])
        assert sum(o.num_cached_tokens for o in outs) > 0
        assert_all_free(eng)
    finally:
        eng.close()


def test_prompts_computing_one_prefix_in_one_step_share_its_snapshot_row():
    """fcfs: a prompt sent twice at once is computed twice in one step, and both pass
    the same snapshot points; each point takes one row, so every row stays in use (a
    second take of a key lost the row the first took) and later steps still take at most
    one snapshot a row: a follow-up hits what its row holds."""
    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=4,
                      scheduling_policy="fcfs")
    try:
        for seed in range(31, 34):
            p = tokens(13, seed=seed)
            run(eng, [p, p])
        assert len(eng.prefix.rows) == 4
        for seed in range(41, 44):
            a, b = tokens(9, seed=seed), tokens(5, seed=seed + 10)
            run(eng, [a, b])
            assert run(eng, [a[:4] + tokens(7, seed=seed + 20)])[0].num_cached_tokens == 4
        assert_all_free(eng)
    finally:
        eng.close()


def test_landed_bytes_enter_the_prefix_cache_only_once_confirmed():
    """The decode side: a request decodes from a READ that landed before its source
    confirmed the bytes, which may be stale (here another prompt's). None of its blocks
    is registered until `confirm_transfer`: one whose ack said stale (aborted) leaves
    nothing a later request of the same prompt shares, so that one pulls every block and
    decodes the reference; once confirmed, the next one shares them."""
    eng = make_engine(True, prefix_state_interval=2)

    def pull(prompt, fill, confirm):
        rid = eng.add_remote_request(prompt, reference_next(prompt, VOCAB), GREEDY)
        [(_, blocks, slot, shared, _)] = eng.reserve_transfers()
        fill_as_a_transfer(eng, fill, blocks, slot, skip=shared)
        eng.finish_transfer(rid, ok=True, confirmed=False)
        eng.step()  # decodes from the landed bytes
        if confirm:
            eng.confirm_transfer(rid)
        else:
            eng.abort(rid)  # the ack said stale
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        return shared, done.get(rid)

    try:
        p = tokens(20, seed=6)
        assert pull(p, tokens(20, seed=99), confirm=False)[0] == 0
        shared, out = pull(p, p, confirm=True)
        assert shared == 0 and out.token_ids == reference_greedy(p, GREEDY.max_tokens, VOCAB)
        shared, out = pull(p, p, confirm=True)
        assert shared > 0 and out.token_ids == reference_greedy(p, GREEDY.max_tokens, VOCAB)
        eng.fence.wait_all()
        assert_all_free(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("confirmed", [True, False])
def test_a_request_done_before_its_bytes_are_confirmed_caches_them_once_they_are(confirmed):
    """A short answer can end before its source confirms the bytes it decoded from: its
    blocks wait for the word. Confirmed, they enter the prefix cache, so a follow-up
    shares them; stale (aborted), they go back unregistered, and the follow-up pulls
    every block. Either way every block and slot comes back."""
    eng = make_engine(True, prefix_state_interval=2)

    def pull(prompt):
        rid = eng.add_remote_request(prompt, reference_next(prompt, VOCAB), GREEDY)
        [(_, blocks, slot, shared, _)] = eng.reserve_transfers()
        fill_as_a_transfer(eng, blocks=blocks, slot=slot, skip=shared, prompt=prompt)
        return rid, shared

    try:
        p = tokens(20, seed=7)
        rid, _ = pull(p)
        eng.finish_transfer(rid, ok=True, confirmed=False)
        done = {}
        while eng.has_unfinished():
            done.update((o.request_id, o) for o in eng.step() if o.finished)
        assert done[rid].token_ids == reference_greedy(p, GREEDY.max_tokens, VOCAB)
        assert eng.blocks.num_free < NUM_BLOCKS  # held for the source's word
        if confirmed:
            eng.confirm_transfer(rid)
        else:
            eng.abort(rid)  # the ack said stale
        rid2, shared = pull(p)
        assert (shared > 0) == confirmed
        eng.finish_transfer(rid2, ok=True)
        while eng.has_unfinished():
            eng.step()
        eng.fence.wait_all()
        assert_all_free(eng)
    finally:
        eng.close()


def test_a_request_id_waiting_for_its_bytes_word_is_not_taken_again():
    """Its blocks wait under its id: a new request of that id is refused until the word
    comes (else the word would confirm the new request's bytes)."""
    eng = make_engine(True, prefix_state_interval=2)
    try:
        p = tokens(20, seed=8)
        rid = eng.add_remote_request(p, reference_next(p, VOCAB), GREEDY)
        [(_, blocks, slot, shared, _)] = eng.reserve_transfers()
        fill_as_a_transfer(eng, blocks=blocks, slot=slot, skip=shared, prompt=p)
        eng.finish_transfer(rid, ok=True, confirmed=False)
        while eng.has_unfinished():
            eng.step()
        with pytest.raises(ValueError, match="duplicate request id"):
            eng.add_remote_request(p, reference_next(p, VOCAB), GREEDY, request_id=rid)
        eng.confirm_transfer(rid)
        eng.fence.wait_all()
        assert_all_free(eng)
    finally:
        eng.close()


def test_the_second_prompt_off_a_shared_prefix_leaves_a_snapshot_where_they_part():
    """Snapshots every 8 blocks: a prompt of 5 shared blocks and its own tail leaves none
    at block 5, so the second prompt off the same 5 blocks matches them but restores
    nothing; its prefill takes one where it parts from the first, and the third hits
    all 5 blocks."""
    eng = make_engine(True, prefix_state_interval=8, num_prefix_snapshots=6)
    try:
        shared = tokens(20, seed=11)
        outs = [run(eng, [shared + tokens(7, seed=12 + i)])[0] for i in range(3)]
        assert [o.num_cached_tokens for o in outs] == [0, 0, 20]
        assert_all_free(eng)
    finally:
        eng.close()


def test_a_burst_off_a_shared_prefix_hits_all_of_it_after_the_first_step():
    """Three prompts of 7 shared blocks and a tail each, sent at once, snapshots every 8
    blocks: the first fills the first step alone, and its prefill takes a snapshot where
    the two waiting prompts part from it, so both hit all 7 blocks in the next step
    (without it neither hits: the block-7 state would first be taken in that step)."""
    eng = make_engine(True, prefix_state_interval=8, num_prefix_snapshots=6)
    try:
        shared = tokens(28, seed=21)
        outs = run(eng, [shared + tokens(6, seed=22 + i) for i in range(3)])
        assert [o.num_cached_tokens for o in outs] == [0, 28, 28]
        assert_all_free(eng)
    finally:
        eng.close()


def _finish_order(eng, prompts):
    """Add single-token requests in order, step to the end: the prompts' indices in the
    order their (only) token came out, and their outputs."""
    ids = [eng.add_request(p, SamplingParams(max_tokens=1, temperature=0, ignore_eos=True))
           for p in prompts]
    order, outs = [], {}
    while eng.has_unfinished():
        for o in eng.step():
            if o.finished:
                order.append(ids.index(o.request_id))
                outs[o.request_id] = o
    for p, i in zip(prompts, ids):
        assert outs[i].token_ids == reference_greedy(p, 1, VOCAB)
    return order, [outs[i] for i in ids]


@pytest.mark.parametrize("policy,first", [("lpm", 1), ("fcfs", 0)])
def test_a_request_with_a_cached_prefix_goes_ahead_under_lpm(policy, first):
    """A cached 20-token prefix, then a 30-token prompt without a hit and, behind it, the
    prefix plus 6 tokens: under "lpm" the hit (6 tokens to compute) is admitted first and
    has its token a step earlier; under "fcfs" arrival order holds (the whole prompt
    takes the 32-token budget first)."""
    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=8,
                      scheduling_policy=policy)
    try:
        shared = tokens(20, seed=31)
        run(eng, [shared])
        order, outs = _finish_order(eng, [tokens(30, seed=32), shared + tokens(6, seed=33)])
        assert order[0] == first and outs[1].num_cached_tokens == 20
        assert_all_free(eng)
    finally:
        eng.close()


@pytest.mark.parametrize("policy,hits", [("lpm", [0, 8, 8]), ("fcfs", [0, 0, 0])])
def test_prompts_sharing_a_prefix_in_prefill_wait_for_it_under_lpm(policy, hits):
    """Three prompts of 2 shared blocks and a tail each, sent at once, with budget for all
    three in one step: under "lpm" the two that share the first one's prefix, which is
    being computed, wait a step and hit it; under "fcfs" all three compute it."""
    eng = make_engine(True, prefix_state_interval=8, num_prefix_snapshots=6,
                      scheduling_policy=policy)
    try:
        shared = tokens(8, seed=41)
        _, outs = _finish_order(eng, [shared + tokens(2, seed=42 + i) for i in range(3)])
        assert [o.num_cached_tokens for o in outs] == hits
        assert_all_free(eng)
    finally:
        eng.close()


def test_prompts_shorter_than_a_block_are_admitted_together_under_lpm():
    """A prompt shorter than a block has no first block to wait on: six such prompts all
    start in the first step, as under "fcfs"."""
    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=8)
    try:
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        for i in range(6):
            eng.add_request(tokens(BLOCK - 1, seed=60 + i), one)
        eng.step()
        assert len(eng.scheduler.running) == 6 and not eng.scheduler.waiting
        while eng.has_unfinished():
            eng.step()
        assert_all_free(eng)
    finally:
        eng.close()


def test_a_request_passed_over_too_often_goes_first():
    """The bound on waiting under "lpm": each pass that admits a request queued behind a
    waiting one passes that one over once; after MAX_PASSED it is tried first, hit or
    not."""
    from serving.engine.scheduler import MAX_PASSED

    eng = make_engine(True, prefix_state_interval=1, num_prefix_snapshots=8)
    try:
        shared = tokens(20, seed=51)
        run(eng, [shared])
        one = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
        ids = [eng.add_request(p, one) for p in (tokens(30, seed=52), tokens(25, seed=54),
                                                  shared + tokens(6, seed=53))]
        sched = eng.scheduler
        x, z, y = list(sched.waiting)
        assert list(sched._admission_order()) == [y, x, z]
        sched._dequeue([y])  # admitted ahead of both
        assert (x.num_passed, z.num_passed, list(sched.waiting)) == (1, 1, [x, z])
        sched.waiting.append(y)
        z.num_passed = MAX_PASSED
        assert list(sched._admission_order()) == [z, y, x]
        for i in ids:
            eng.abort(i)
        eng.step()
        assert_all_free(eng)
    finally:
        eng.close()


def test_concurrent_sharing_with_preemption_and_aborts(engine):
    """Three system prompts, 60 requests in waves over a pool small enough to preempt, a
    sixth of them aborted at random points: the others are exact, the aborted ones a
    prefix of their reference, and hits are many."""
    rng = np.random.default_rng(4)
    systems = [tokens(int(n), seed=40 + i) for i, n in enumerate((18, 25, 37))]
    engine.scheduler.max_num_batched_tokens = 13
    held = engine.blocks.allocate(NUM_BLOCKS - 30)
    before = engine.metrics()
    sp = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    try:
        ids, want, done, step = [], {}, {}, 0
        abort_at = {}
        while len(ids) < 60 or engine.has_unfinished():
            for _ in range(int(rng.integers(0, 3))):
                if len(ids) < 60:
                    p = systems[int(rng.integers(3))] + tokens(int(rng.integers(1, 12)),
                                                               seed=1000 + len(ids))
                    rid = engine.add_request(p, sp)
                    ids.append(rid)
                    want[rid] = reference_greedy(p, 10, VOCAB)
                    if rng.random() < 0.17:
                        abort_at[rid] = step + int(rng.integers(0, 12))
            for rid, when in abort_at.items():
                if when == step and (o := engine.abort(rid)) is not None:
                    done[rid] = o
            done.update({o.request_id: o for o in engine.step() if o.finished})
            step += 1
    finally:
        engine.fence.wait_all()
        engine.blocks.free(held)
    for rid in ids:
        o = done[rid]
        if o.finish_reason == "abort":
            assert o.token_ids == want[rid][:len(o.token_ids)]
        else:
            assert o.token_ids == want[rid], rid
    after = engine.metrics()
    assert after["num_preemptions"] > before["num_preemptions"]
    hits = after["prefix_cache_hits"] - before["prefix_cache_hits"]
    queries = after["prefix_cache_queries"] - before["prefix_cache_queries"]
    assert hits > 0.4 * queries
    assert sum(done[r].num_cached_tokens > 0 for r in ids) > 30


def test_eviction_under_churn_keeps_outputs_exact(engine):
    """More distinct prefixes than blocks and snapshot rows: old ones are evicted, and a
    prompt whose prefix was partly evicted hits what is left or nothing."""
    ps = [tokens(int(n), seed=200 + i) for i, n in
          enumerate(np.random.default_rng(5).integers(9, 40, 30))]
    run(engine, ps)
    run(engine, ps[::-1])  # the late ones still cached, the early ones evicted
    assert engine.blocks.num_evictable > 0


def test_sampled_outputs_are_cached_for_the_next_turn(engine):
    """A follow-up turn (prompt + the answer + a new message) hits beyond the first prompt,
    since decode steps register the blocks of sampled tokens; its state comes from the
    last snapshot the first turn's prefill took."""
    a = tokens(21, seed=8)
    first = run(engine, [a], SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))[0]
    follow = a + first.token_ids + tokens(3, seed=9)
    assert run(engine, [follow])[0].num_cached_tokens == 20
    assert len(engine.prefix._block) >= (21 + 11) // BLOCK


def test_caching_off_engine_counts_nothing():
    eng = make_engine(False)
    try:
        a = tokens(20, seed=1)
        outs = run(eng, [a, a])
        assert [o.num_cached_tokens for o in outs] == [0, 0]
        assert eng.metrics()["prefix_cache_queries"] == 0
        assert eng.config.num_state_rows == SLOTS
    finally:
        eng.close()


def test_the_burst_bench_reaches_the_most_its_load_allows(capsys):
    """bench.prefix_hits at a small size: 24 prompts of 4 shared prefixes sent at once,
    each prompt a whole step's budget (as the H200 burst's). Under "lpm" every prompt
    but the first of each prefix hits every full block of its prefix in any order, and
    the median request has its token sooner than under "fcfs" (each prefix's followers
    run right after it, the others' whole prompts after them). Under "fcfs", in arrival
    order, the same hits; shuffled, a prompt admitted beside the last chunk of its
    prefix's first prompt hits only the blocks written before that step: a few points
    less, never a collapse."""
    from bench import prefix_hits
    prefix_hits.main(["--num-prompts", "24", "--input-len", "128", "--shared-prefix-len", "115",
                      "--block-size", "4", "--num-blocks", "1024", "--max-num-seqs", "8",
                      "--max-num-batched-tokens", "128", "--prefill-seq-buckets", "2,8",
                      "--prefix-state-interval", "8", "--num-prefix-snapshots", "64",
                      "--orders", "2", "--scheduling-policies", "lpm", "fcfs"])
    lines = capsys.readouterr().out.splitlines()
    most = float(next(line for line in lines if line.startswith("most")).split(": ")[1][:-1])
    runs = {}
    for line in lines:
        if ", lpm: " in line or ", fcfs: " in line:
            head, tail = line.split(": ", 1)
            runs[head] = (float(tail.split("%")[0]), float(tail.split("by step ")[1].split()[0]))
    lpm = [v for k, v in runs.items() if k.endswith("lpm")]
    fcfs = [v for k, v in runs.items() if k.endswith("fcfs")]
    assert len(lpm) == len(fcfs) == 3, runs
    assert all(rate == most for rate, _ in lpm), runs
    assert runs["in arrival order, fcfs"][0] == most, runs
    assert all(most - 5 < rate <= most for rate, _ in fcfs), runs
    # 4 whole prompts and 20 suffixes of ~13 tokens, 128 tokens a step; an output lags a
    # step
    assert all(4 <= step <= 8 for _, step in lpm + fcfs), runs
    assert runs["in arrival order, lpm"][1] < runs["in arrival order, fcfs"][1], runs
