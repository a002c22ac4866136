"""Unit tests of the engine's host-side pieces: pools, fence, scheduler, buckets, sampler."""

import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from serving.engine.block_pool import BlockPool
from serving.engine.buckets import Buckets
from serving.engine.fence import StepFence
from serving.engine.request import Request, Status
from serving.engine.sampler import SAMPLER_MODES, SamplerMode, SamplingArrays, sample
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.state_pool import SlotPool


class Marker:
    """Stands in for a step's output array."""
    def __init__(self):
        self.ready = False

    def is_ready(self):
        return self.ready

    def block_until_ready(self):
        self.ready = True


def test_block_pool_ref_counts():
    pool = BlockPool(4)
    a = pool.allocate(3)
    assert pool.num_free == 1
    pool.incref(a[:1])
    pool.free(a)
    assert pool.num_free == 3 and pool.ref_count(a[0]) == 1
    pool.free(a[:1])
    assert pool.num_free == 4
    with pytest.raises(ValueError):
        pool.free(a[:1])
    with pytest.raises(MemoryError):
        pool.allocate(5)
    assert pool.num_free == 4  # all or nothing


def test_slot_pool():
    pool = SlotPool(2)
    s = pool.allocate()
    pool.incref(s)
    pool.free(s)
    assert pool.num_free == 1
    pool.free(s)
    assert pool.num_free == 2 and pool.allocate() == s  # most recently freed reused first
    with pytest.raises(ValueError):
        pool.free(1 - s)


def test_fence_defers_until_every_dispatched_step_completed():
    fence, released = StepFence(), []
    fence.defer(lambda: released.append("idle"))  # nothing in flight: immediate
    m1, m2 = Marker(), Marker()
    fence.on_dispatch(m1)
    fence.on_dispatch(m2)
    fence.defer(lambda: released.append("a"))
    m1.ready = True
    fence.poll()
    assert released == ["idle"]  # step 2 still running
    fence.on_dispatch(Marker())  # step 3, dispatched after the release: irrelevant to it
    m2.ready = True
    fence.poll()
    assert released == ["idle", "a"]
    fence.defer(lambda: released.append("b"))
    fence.mark_completed(2)
    assert released[-1] == "a"
    fence.wait_all()
    assert released[-1] == "b" and fence.num_pending == 0


def make_scheduler(num_blocks=8, num_slots=4, max_num_seqs=4, budget=16, block_size=4):
    fence = StepFence()
    s = Scheduler(max_num_seqs=max_num_seqs, max_num_batched_tokens=budget, max_model_len=64,
                  block_size=block_size, blocks=BlockPool(num_blocks), slots=SlotPool(num_slots),
                  fence=fence)
    return s, fence


def req(i, n, max_tokens=8):
    return Request(f"r{i}", list(range(1, n + 1)), SamplingParams(max_tokens=max_tokens), seed=i)


def test_scheduler_chunks_and_fcfs():
    s, _ = make_scheduler(budget=10)
    a, b = req(0, 14), req(1, 3)
    s.add(a), s.add(b)
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_tokens, x.sample) for x in out.seqs] == \
        [("r0", 0, 10, False)]  # b waits behind a's first chunk: FCFS
    out = s.schedule()
    assert [(x.request.request_id, x.start, x.num_tokens, x.sample) for x in out.seqs] == \
        [("r0", 10, 4, True), ("r1", 0, 3, True)]
    assert a.num_pending == 1 and not out.is_decode
    # Both samples in flight: the next step feeds them as single-token decodes.
    out = s.schedule()
    assert out.is_decode and [x.num_tokens for x in out.seqs] == [1, 1]


def test_scheduler_preempts_latest_and_waits_for_fence_first():
    s, fence = make_scheduler(num_blocks=4, budget=32)
    a, b = req(0, 8), req(1, 8)
    s.add(a), s.add(b)
    s.schedule()  # 2 + 2 blocks: pool empty
    fence.on_dispatch(Marker())
    for r in (a, b):  # their samples arrive
        r.num_pending -= 1
        r.output_token_ids.append(5)
    out = s.schedule()  # a needs a 3rd block: b (latest) is preempted
    assert [x.request for x in out.seqs] == [a]
    assert b.status is Status.WAITING and b.num_computed_tokens == 0 and s.waiting[0] is b
    assert s.num_preemptions == 1 and b.epoch == 1
    assert fence.num_pending == 0  # the scheduler waited for the fence rather than preempt more
    assert s.blocks.num_free == 1


def test_scheduler_abort_and_transfer_reservation():
    s, fence = make_scheduler()
    a = req(0, 5)
    assert s.begin_transfer(a)
    assert a.status is Status.WAITING_FOR_TRANSFER and len(a.block_ids) == 2
    assert s.schedule().seqs == []  # never scheduled while being filled
    s.finish(a, "abort")  # aborted mid-transfer: memory still held by the transfer
    assert s.blocks.num_free == 6 and s.slots.num_free == 3
    s.end_transfer(a, ok=True)
    assert s.blocks.num_free == 8 and s.slots.num_free == 4
    b = req(1, 5)
    assert s.begin_transfer(b)
    s.end_transfer(b, ok=True)
    assert b.status is Status.RUNNING and b.num_computed_tokens == 5


def test_buckets_cover_every_pick():
    bk = Buckets(prefill_tokens=(16, 40), prefill_seqs=(1, 2, 4, 8, 16, 32, 48), decode_seqs=(8, 48))
    shapes = set(bk.all_shapes())
    for tokens in range(1, 41):
        for seqs in range(1, min(tokens, 48) + 1):
            t, n = bk.pick(False, tokens, seqs)
            assert (False, t, n) in shapes
    assert bk.pick(True, 9, 9) == (48, 48)


def test_sampler_filters_and_seeds():
    f = jax.jit(sample, static_argnums=(2, 3))
    logits = jnp.log(jnp.array([[0.2, 0.3, 0.5]] * 4096))
    s = SamplingArrays.host(4096)
    s.temperature[:], s.seed[:], s.position[:] = 1, 5, np.arange(4096)
    freq = lambda: np.bincount(np.asarray(f(logits, s, 2, s.mode()).token), minlength=3) / 4096
    np.testing.assert_allclose(freq(), [0.2, 0.3, 0.5], atol=0.03)
    s.top_p[:] = 0.6
    np.testing.assert_allclose(freq(), [0, 0.375, 0.625], atol=0.03)
    s.top_p[:], s.top_k[:] = 1, 1
    np.testing.assert_allclose(freq(), [0, 0, 1])
    s.top_k[:], s.min_p[:] = 0, 0.5
    np.testing.assert_allclose(freq(), [0, 0.375, 0.625], atol=0.03)
    s.temperature[:], s.logprobs[:] = 0, True
    r = f(logits, s, 2, s.mode())
    assert (np.asarray(r.token) == 2).all()
    np.testing.assert_allclose(np.asarray(r.logprob), np.log(0.5), rtol=1e-5)
    np.testing.assert_array_equal(np.asarray(r.top_ids)[0], [2, 1])


def test_sampler_mode_is_what_the_rows_need_and_changes_no_token():
    """The host picks the cheapest compiled variant that serves every row; each row's
    token (and, where asked, logprobs) is what the variant with everything on gives."""
    rng = np.random.default_rng(3)
    n, vocab = 64, 50
    logits = jnp.asarray(rng.normal(size=(n, vocab)) * 3, jnp.float32)
    f = jax.jit(sample, static_argnums=(2, 3))
    full = SamplerMode(draw=True, filter=True, logprobs=True)
    seen = set()
    for trial in range(12):
        s = SamplingArrays.host(n)
        s.seed[:], s.position[:] = rng.integers(1 << 30, size=n), rng.integers(1000, size=n)
        drawn = rng.random(n) < [0, 0.5, 1][trial % 3]
        s.temperature[drawn] = rng.uniform(0.5, 1.5, drawn.sum())
        if trial % 2:
            s.top_k[rng.random(n) < 0.3] = 5
            s.top_p[rng.random(n) < 0.3] = 0.7
        s.logprobs[:] = rng.random(n) < (0.2 if trial % 4 < 2 else 0)
        mode = s.mode()
        seen.add(mode)
        assert mode.draw == bool(drawn.any())
        assert mode.filter == bool((drawn & ((s.top_k > 0) | (s.top_p < 1))).any())
        assert mode.logprobs == bool(s.logprobs.any())
        got, want = f(logits, s, 3, mode), f(logits, s, 3, full)
        np.testing.assert_array_equal(np.asarray(got.token), np.asarray(want.token))
        if mode.logprobs:
            np.testing.assert_array_equal(np.asarray(got.top_ids), np.asarray(want.top_ids))
            np.testing.assert_allclose(np.asarray(got.logprob), np.asarray(want.logprob))
    assert seen == set(SAMPLER_MODES)  # every compiled variant was checked


def test_capacity_split_from_memory_stats():
    from qwen35_jax import get_preset
    from qwen35_jax.cache import HybridCache
    from serving.engine.capacity import cache_dtype, plan_capacity
    from serving.engine.config import EngineConfig

    cfg = get_preset("35B-A3B")
    c = EngineConfig(max_num_seqs=64, max_model_len=8192, block_size=16, memory_utilization=0.9)
    gib = 2**30
    r = plan_capacity(cfg, c, jnp.bfloat16, {"bytes_limit": 140 * gib, "bytes_in_use": 120 * gib})
    kept = cache_dtype(jnp.bfloat16)  # bfloat16 on accelerators, float32 on a CPU
    block = HybridCache.bytes_per_block(cfg, 16, kept)
    slot = HybridCache.bytes_per_slot(cfg, kept, jnp.float32)
    assert r["num_slots"] == 64 and r["state_bytes"] == 64 * slot
    assert c.num_blocks == r["num_blocks"] == (int(140 * gib * 0.9) - 120 * gib - 64 * slot) // block
    assert r["kv_bytes"] + r["state_bytes"] <= r["budget_bytes"]
    c = EngineConfig(max_num_seqs=4, max_model_len=256, block_size=16)
    plan_capacity(cfg, c, jnp.bfloat16, {"bytes_limit": 140 * gib, "bytes_in_use": 0})
    assert c.num_blocks == 4 * 16  # capped at what max_num_seqs sequences can use


def test_block_pool_hands_out_consecutive_runs_after_churn():
    pool = BlockPool(16)
    reqs = [pool.allocate(3) for _ in range(5)]  # 0-2, 3-5, ..., 12-14; 15 free
    pool.free(reqs[1])
    pool.free(reqs[3])  # free: 3-5, 9-11, 15
    pool.free(reqs[0][1:2])  # and 1
    assert pool.allocate(3) == [3, 4, 5]  # the lowest run that fits, not 1 + 3-4
    assert pool.allocate(1) == [1]
    assert pool.allocate(4) == [9, 10, 11, 15]  # no run of 4: the longest runs first
    assert pool.num_free == 0


def test_block_pool_failed_free_changes_nothing():
    pool = BlockPool(8)
    a = pool.allocate(2)
    with pytest.raises(ValueError, match="double free of block 5"):
        pool.free([a[0], 5])  # 5 is not held: a[0] must stay held too
    assert pool.num_free == 6 and pool.ref_count(a[0]) == 1
    assert pool.free_ids() == set(range(8)) - set(a)
    pool.incref(a[:1])
    pool.free([a[0], a[0], a[1]])  # both owners of a[0] at once
    assert pool.num_free == 8 and pool.free_ids() == set(range(8))
    with pytest.raises(ValueError):
        pool.incref([0])


def _runs(ids):
    return 1 + sum(b != a + 1 for a, b in zip(ids, ids[1:]))


def test_block_pool_best_fit_then_fewest_runs():
    pool = BlockPool(16)
    held = pool.allocate(16)
    pool.free([0, 2] + held[4:9] + held[10:13])  # free runs: 0 | 2 | 4-8 | 10-12
    assert pool.allocate(3) == [10, 11, 12]  # the shortest run that holds 3, not 4-6
    got = pool.allocate(6)  # no run of 6: 4-8 and one more, not the lowest 0, 2, 4-7
    assert sorted(got) == [0, 4, 5, 6, 7, 8] and _runs(got) == 2
    assert pool.allocate(1) == [2]
    assert pool.num_free == 0


def test_block_pool_runs_under_random_churn():
    """Every allocation is as few runs as the free blocks allow at that moment."""
    rng = np.random.default_rng(0)
    pool, held = BlockPool(256), []
    for _ in range(400):
        if held and (pool.num_free < 40 or rng.random() < 0.5):
            pool.free(held.pop(rng.integers(len(held))))
            continue
        n = int(rng.integers(1, 40))
        free = sorted(pool.free_ids())
        cuts = [i for i in range(1, len(free)) if free[i] != free[i - 1] + 1]
        lengths = sorted(np.diff([0] + cuts + [len(free)]).tolist(), reverse=True)
        fewest = int(np.searchsorted(np.cumsum(lengths), n)) + 1
        ids = pool.allocate(n)
        assert len(set(ids)) == n and _runs(ids) == fewest
        assert set(ids) <= set(free)  # only free blocks handed out
        held.append(ids)
        assert pool.free_ids() == set(range(256)) - {b for h in held for b in h}
        assert pool.num_free == len(pool.free_ids())


def test_idle_timer_counts_device_busy_and_idle_time():
    """Busy: from a step's dispatch (or the previous step's end) to its end; idle: from a
    step's end to a late next dispatch. Only lower bounds: sleeps last at least as asked."""
    from serving.engine.idle_timer import IdleTimer

    class Step:  # a dispatched step that takes `s` seconds on the "device"
        def __init__(self, s):
            self.s = s

        def block_until_ready(self):
            time.sleep(self.s)

    timer = IdleTimer()

    def wait_for(steps):
        while timer.counters()["device_steps"] < steps:
            time.sleep(0.005)

    timer.on_dispatch(0, time.perf_counter(), Step(0.05))
    timer.on_dispatch(1, time.perf_counter(), Step(0.05))  # queued behind step 0: no gap
    wait_for(2)
    time.sleep(0.1)  # the host is late for step 2
    timer.on_dispatch(2, time.perf_counter(), Step(0.05))
    wait_for(3)
    c = timer.counters()
    assert c["device_steps"] == 3 and len(timer.timeline()) == 3
    assert c["device_busy_s"] >= 0.15 and c["device_idle_s"] >= 0.1
    assert c["busy_span_s"] == c["device_busy_s"] + c["device_idle_s"]
    assert c["host_idle_share"] == c["device_idle_s"] / c["busy_span_s"]


def test_cpu_defaults_fill_only_what_is_unset():
    """On a CPU (this suite's platform) `LLM()` and the servers take small limits for the
    fields left unset: three programs, blocks for every sequence at full length."""
    from serving.llm import CPU_LIMITS, engine_defaults

    assert jax.default_backend() == "cpu"
    assert engine_defaults({}) == {**CPU_LIMITS, "num_blocks": 8 * 64,
                                   "buckets": Buckets((32, 64), (8,), (8,))}
    kw = engine_defaults({"max_num_seqs": 2, "max_model_len": 100, "block_size": 8})
    assert kw["max_num_batched_tokens"] == 64 and kw["num_blocks"] == 2 * 13
    assert kw["buckets"] == Buckets((32, 64), (2,), (2,))
    given = Buckets((16,), (1,), (1,))
    assert engine_defaults({"buckets": given, "num_blocks": 5})["buckets"] is given


def test_the_model_bounds_max_model_len_unless_it_is_given():
    """As vLLM: an unset max_model_len is cut to the model's trained positions; one
    given past them reaches the engine, which refuses it (test_engine_fake)."""
    from qwen35_jax import get_preset
    from serving.engine.config import EngineConfig
    from serving.llm import adopt_model_limits

    model_cfg = get_preset("tiny").replace(max_position_embeddings=512, eos_token_ids=(7,))
    config = EngineConfig(max_model_len=1024)
    adopt_model_limits(config, model_cfg, {})
    assert config.max_model_len == 512 and config.eos_token_ids == (7,)
    config = EngineConfig(max_model_len=1024, eos_token_ids=(3,))
    adopt_model_limits(config, model_cfg, {"max_model_len": 1024, "eos_token_ids": (3,)})
    assert config.max_model_len == 1024 and config.eos_token_ids == (3,)


def test_compiled_programs_go_to_the_persistent_cache(tmp_path):
    """In a fresh process (JAX reads the cache directory once per process)."""
    import os
    import subprocess
    import sys

    probe = ("import jax, jax.numpy as jnp, sys\n"
             "from serving.engine.compilation_cache import use_compilation_cache\n"
             "use_compilation_cache(sys.argv[1])\n"
             "jax.jit(lambda x: jnp.cos(x) * 3.25 + 1.5).lower(jnp.ones(7)).compile()\n")
    r = subprocess.run([sys.executable, "-c", probe, str(tmp_path / "xla")],
                       capture_output=True, text=True, timeout=120,
                       env={**os.environ, "JAX_PLATFORMS": "cpu"})
    assert r.returncode == 0, r.stderr[-2000:]
    assert any((tmp_path / "xla").iterdir())  # an entry, however quick the compile


@pytest.mark.parametrize("kw, match", [
    (dict(temperature=float("nan")), "temperature"),  # ran as greedy
    (dict(temperature=float("inf")), "temperature"),  # drew uniformly
    (dict(max_tokens=2.5), "max_tokens"),  # gave 3 tokens
    (dict(max_tokens=float("nan")), "max_tokens"),  # ran to max_model_len
    (dict(stop=["a"] * 65), "stop"),  # every stop string is searched after every token
    (dict(stop="a" * 1025), "stop"),
    (dict(stop_token_ids=[1] * 1025), "stop_token_ids"),
])
def test_sampling_params_refuse_what_a_step_cannot_honour(kw, match):
    with pytest.raises(ValueError, match=f"^{match}"):
        SamplingParams(**kw)


@pytest.mark.parametrize("kw, match", [
    (dict(max_num_batched_tokens=0), "max_num_batched_tokens"),  # admitted nothing, for ever
    (dict(block_size=0), "block_size"),
    (dict(max_model_len=-1), "max_model_len"),
    (dict(num_blocks=0), "num_blocks"),
    (dict(max_logprobs=-1), "max_logprobs"),
])
def test_engine_config_refuses_sizes_no_engine_can_run(kw, match):
    from serving.engine import EngineConfig

    with pytest.raises(ValueError, match=f"^{match}"):
        EngineConfig(**kw)
