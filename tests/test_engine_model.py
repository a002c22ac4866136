"""Acceptance tests of the engine with the real model (tiny preset, random
weights, CPU): batched serving must reproduce each prompt run alone through
`model(input_ids)`, token for token, whatever the scheduling does."""

import functools
import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import qwen35_jax
from serving import LLM, SamplingParams
from serving.engine.buckets import Buckets

MAX_TOKENS, REF_LEN = 12, 64
GREEDY = SamplingParams(max_tokens=MAX_TOKENS, temperature=0, ignore_eos=True)
NUM_BLOCKS, NUM_SLOTS = 64, 8


def init_random(name):
    return qwen35_jax.init_random(qwen35_jax.get_preset(name), seed=0, dtype=jnp.float32)


@pytest.fixture(scope="module")
def model():
    return init_random("tiny")


@pytest.fixture(scope="module")
def llm(model, reference):
    # Built after the reference, so that its compiles are not counted as serving compiles.
    llm = LLM(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              block_size=8, num_blocks=NUM_BLOCKS, max_logprobs=4,
              buckets=Buckets(prefill_tokens=(16, 64), prefill_seqs=(2, 8), decode_seqs=(4, 8)))
    yield llm
    llm.engine.close()


@pytest.fixture(scope="module")
def prompts():
    rng = np.random.default_rng(0)
    return [[int(x) for x in rng.integers(2, 512, rng.integers(1, REF_LEN - MAX_TOKENS))]
            for _ in range(24)]


@pytest.fixture(scope="module")
def reference(model, prompts):
    return [greedy_alone(model, p, MAX_TOKENS, REF_LEN) for p in prompts]


def greedy_alone(model, prompt, max_tokens, length):
    """Greedy tokens of one prompt alone: a full forward of the sequence so far
    (right-padded to one length: the model is causal), argmax at its last token."""
    graphdef, state = nnx.split(model)
    fwd = _forward(graphdef)
    seq = list(prompt)
    for _ in range(max_tokens):
        ids = np.zeros((1, length), np.int32)
        ids[0, :len(seq)] = seq
        seq.append(int(np.asarray(fwd(state, ids))[len(seq) - 1].argmax()))
    return seq[len(prompt):]


@functools.cache
def _forward(graphdef):
    return jax.jit(lambda s, ids: nnx.merge(graphdef, s)(ids)[0])


@pytest.fixture(autouse=True)
def restore(llm):
    yield
    eng = llm.engine
    eng.config.async_scheduling = True
    eng.scheduler.max_num_batched_tokens = 64
    assert not eng.has_unfinished()
    eng.fence.wait_all()
    assert eng.blocks.num_free == NUM_BLOCKS and eng.slots.num_free == NUM_SLOTS
    assert not eng.requests
    assert eng.metrics()["serving_compiles"] == 0  # nothing compiled after warm-up


@pytest.mark.parametrize("async_scheduling", [True, False])
def test_batched_greedy_equals_alone(llm, prompts, reference, async_scheduling):
    llm.engine.config.async_scheduling = async_scheduling
    outs = llm.generate(prompts, GREEDY)
    assert [o.token_ids for o in outs] == reference
    assert llm.engine.metrics()["num_preemptions"] == 0


def test_preemption_and_chunk_boundaries_equal_uninterrupted(llm, prompts, reference):
    eng = llm.engine
    held = eng.blocks.allocate(NUM_BLOCKS - 12)  # shrink the pool: forces preemption
    eng.scheduler.max_num_batched_tokens = 7  # odd, block-unaligned prefill chunks
    before = eng.scheduler.num_preemptions
    try:
        outs = llm.generate(prompts, GREEDY)
    finally:
        eng.fence.wait_all()
        eng.blocks.free(held)
    assert eng.scheduler.num_preemptions > before
    assert [o.token_ids for o in outs] == reference


def test_aborts_leave_others_exact(llm, prompts, reference):
    eng = llm.engine
    rng = np.random.default_rng(1)
    ids = [eng.add_request(p, GREEDY) for p in prompts]
    abort_at = {ids[i]: int(rng.integers(0, 25)) for i in range(0, 24, 3)}
    done, step = {}, 0
    while eng.has_unfinished():
        for rid, when in abort_at.items():
            if when == step and (o := eng.abort(rid)) is not None:
                done[rid] = o
        done.update({o.request_id: o for o in eng.step() if o.finished})
        step += 1
    for rid, ref in zip(ids, reference):
        o = done[rid]
        if o.finish_reason == "abort":
            assert rid in abort_at and o.token_ids == ref[:len(o.token_ids)]
        else:
            assert o.token_ids == ref


def test_seeded_sampling_repeats(llm, prompts):
    sp = SamplingParams(max_tokens=10, temperature=0.9, top_k=50, top_p=0.95, seed=7, logprobs=3)
    a = llm.generate(prompts[:6], sp)
    llm.engine.config.async_scheduling = False
    b = llm.generate(prompts[5::-1], sp)[::-1]  # other order, other batching, sync
    assert [o.token_ids for o in a] == [o.token_ids for o in b]
    for o in a:
        assert len(o.logprobs) == len(o.token_ids)
        assert all(t in lp and len(lp) in (3, 4) for t, lp in zip(o.token_ids, o.logprobs))
    c = llm.generate(prompts[:1], SamplingParams(max_tokens=10, temperature=0.9, seed=8))
    assert c[0].token_ids != a[0].token_ids


@pytest.mark.parametrize("option", [dict(top_k=1), dict(min_p=1.0), dict(top_p=1e-6)])
def test_a_filter_that_keeps_one_token_samples_the_greedy_tokens(llm, prompts, reference,
                                                                  option):
    """At temperature 1 the random model's tokens are draws from a wide distribution
    (without a filter the seeded draws leave the greedy tokens); top_k=1, min_p=1 (only
    tokens as likely as the most likely one) or a tiny top_p keep the argmax alone, so
    the draws are the greedy tokens. An option the engine dropped would fail here."""
    def draw(**kw):
        sp = SamplingParams(max_tokens=MAX_TOKENS, temperature=1.0, seed=3, ignore_eos=True,
                            **kw)
        return [o.token_ids for o in llm.generate(prompts[:6], sp)]

    assert draw(**option) == reference[:6]
    assert draw() != reference[:6]


def test_500_random_requests_no_compile_all_memory_back(llm):
    """Random lengths, sampling options, stop ids, logprobs and aborts, async
    toggled at random; the restore fixture then asserts every block and slot is
    back and no compile happened after warm-up."""
    eng = llm.engine
    rng = np.random.default_rng(2)
    live, added, finished = [], 0, 0
    while added < 500 or eng.has_unfinished():
        for _ in range(int(rng.integers(0, 5))):
            if added < 500:
                sp = SamplingParams(
                    max_tokens=int(rng.integers(1, 8)), temperature=float(rng.choice([0, 1.0])),
                    top_k=int(rng.choice([0, 20])), top_p=float(rng.choice([1.0, 0.8])),
                    min_p=float(rng.choice([0, 0.05])), stop_token_ids=[int(rng.integers(512))],
                    logprobs=int(rng.choice([0, 4])) if rng.random() < 0.3 else None)
                prompt = [int(x) for x in rng.integers(2, 512, rng.integers(1, 48))]
                live.append(eng.add_request(prompt, sp))
                added += 1
        if live and rng.random() < 0.1:
            eng.abort(live.pop(int(rng.integers(len(live)))))
        eng.config.async_scheduling = bool(rng.random() < 0.8)
        finished += sum(o.finished for o in eng.step())
    assert finished > 400
    eng.runner.check_addresses()  # the donated cache never moved


@pytest.fixture(scope="module")
def shared(model):
    """Prompts sharing one of two system prefixes (17 and 30 tokens), and a repeat."""
    rng = np.random.default_rng(5)
    heads = [[int(x) for x in rng.integers(2, 512, n)] for n in (17, 30)]
    ps = [heads[i % 2] + [int(x) for x in rng.integers(2, 512, rng.integers(1, 20))]
          for i in range(10)]
    ps.append(list(ps[1]))
    return ps, [greedy_alone(model, p, MAX_TOKENS, REF_LEN) for p in ps]


def test_prefix_caching_is_token_identical(model, shared):
    """Caching on (snapshots at every block) in float32: the same greedy tokens as each
    prompt alone, first in arrival waves (hits of whole shared blocks), then with odd
    chunk boundaries, a pool small enough to preempt and aborts."""
    ps, refs = shared
    llm = LLM(model, max_num_seqs=8, max_num_batched_tokens=64, max_model_len=128,
              block_size=8, num_blocks=NUM_BLOCKS, enable_prefix_caching=True,
              prefix_state_interval=1, num_prefix_snapshots=64,
              buckets=Buckets(prefill_tokens=(16, 64), prefill_seqs=(2, 8), decode_seqs=(4, 8)))
    eng = llm.engine
    try:
        first = llm.generate(ps[:2], GREEDY)
        outs = first + llm.generate(ps[2:], GREEDY)
        assert [o.token_ids for o in outs] == refs
        assert [o.num_cached_tokens for o in outs[2:4]] == [16, 24]
        assert outs[-1].num_cached_tokens == 8 * ((len(ps[1]) - 1) // 8)
        held = eng.blocks.allocate(NUM_BLOCKS - 14)
        eng.scheduler.max_num_batched_tokens = 7
        before = eng.scheduler.num_preemptions
        ids = [eng.add_request(p, GREEDY) for p in ps]
        done, step = {}, 0
        while eng.has_unfinished():
            if step == 5:
                done[ids[3]] = eng.abort(ids[3])
            done.update({o.request_id: o for o in eng.step() if o.finished})
            step += 1
        eng.fence.wait_all()
        eng.blocks.free(held)
        assert eng.scheduler.num_preemptions > before
        for rid, ref in zip(ids, refs):
            n = len(done[rid].token_ids)
            assert done[rid].token_ids == ref[:n] and (n == MAX_TOKENS or rid == ids[3])
        m = eng.metrics()
        assert m["prefix_cache_hits"] > 0.3 * m["prefix_cache_queries"]
        assert m["serving_compiles"] == 0 and eng.blocks.num_free == NUM_BLOCKS
    finally:
        eng.close()


def test_moe_preset_batched_equals_alone():
    """The MoE preset through the same engine (a smaller set)."""
    model = init_random("tiny-moe")
    rng = np.random.default_rng(3)
    ps = [[int(x) for x in rng.integers(2, 512, rng.integers(1, 30))] for _ in range(6)]
    refs = [greedy_alone(model, p, 6, 40) for p in ps]
    llm = LLM(model, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=64, block_size=8,
              num_blocks=32, buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(4,),
                                             decode_seqs=(4,)))
    outs = llm.generate(ps, SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    assert [o.token_ids for o in outs] == refs
    assert llm.engine.metrics()["serving_compiles"] == 0
    llm.engine.close()


class CharTokenizer:
    def encode(self, text):
        return [ord(c) for c in text]

    def decode(self, ids):
        return "".join(chr(32 + t % 90) for t in ids)


def test_llm_from_preset_name_with_string_prompts():
    """The reference pads to REF_LEN, the length the module's reference compiled (the
    same preset has the same graph, so the forward pass is not compiled again)."""
    llm = LLM("tiny", tokenizer=CharTokenizer(), max_num_seqs=2, max_num_batched_tokens=32,
              max_model_len=64, block_size=8, num_blocks=16,
              buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(2,), decode_seqs=(2,)))
    out = llm.generate("hello", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))[0]
    assert out.token_ids == greedy_alone(llm.model, [ord(c) for c in "hello"], 4, REF_LEN)
    assert out.text == CharTokenizer().decode(out.token_ids)
    llm.engine.close()


def test_string_prompt_needs_tokenizer(llm):
    with pytest.raises(ValueError, match="tokenizer"):
        llm.generate("hello")


def test_prompts_as_numpy_are_token_ids_and_other_values_are_refused(llm):
    sp = SamplingParams(max_tokens=3, temperature=0, ignore_eos=True)
    want = [o.token_ids for o in llm.generate([[5, 6, 7], [8, 9]], sp)]
    assert [o.token_ids for o in llm.generate(np.array([5, 6, 7]), sp)] == want[:1]
    assert [o.token_ids for o in llm.generate([np.array([5, 6, 7]), [np.int64(8), 9]], sp)] == want
    with pytest.raises(ValueError, match="a list of token ids"):
        llm.generate([[5, 6.5]], sp)


def test_offline_bench_runs_on_cpu(tmp_path):
    from bench.offline import main

    r = main(["--preset", "tiny", "--num-prompts", "8", "--input-len", "24", "--output-len", "8",
              "--range-ratio", "0.5", "--max-num-seqs", "4", "--max-num-batched-tokens", "64",
              "--num-blocks", "64", "--block-size", "8", "--prefill-token-buckets", "64",
              "--prefill-seq-buckets", "4", "--decode-seq-buckets", "4",
              "--json", str(tmp_path / "r.json")])
    w = r["runs"][0]
    assert w["total_output_tokens"] >= 8 and w["output_throughput"] > 0 and w["ttft_ms"]["p99"] > 0
    assert w["serving_compiles"] == 0 and 0 <= w["host_idle_share"] < 1
    # every dispatched step has its recorded shape and its completion stamp
    assert w["roofline"]["phases"]["all"]["steps"] == w["steps"] > 0
    assert (tmp_path / "r.json").exists()


def test_decode_step_bench_runs_on_cpu(tmp_path):
    """Both cache kinds under both host loops, on the same compiled programs; every case
    decodes (the registered cache is a plain XLA array on CPU, so this checks the swap and
    the loops, not a speed), and no program copies a whole cache pool."""
    from bench.decode_step import main

    [r] = main(["--seqs", "2", "--steps", "4", "--prompt-len", "16", "--max-model-len", "128",
                "--block-size", "16", "--json", str(tmp_path / "d.json")])
    assert [(x["cache"], x["loop"]) for x in r["rows"]] == [
        ("xla", "engine"), ("xla", "async"), ("registered", "engine"), ("registered", "async")]
    assert all(np.isfinite(x["step_ms"]) for x in r["rows"])
    # every program updates the pools in place: no copy of a whole cache array
    assert r["whole_cache_copies"] and not any(r["whole_cache_copies"].values())
    assert json.loads((tmp_path / "d.json").read_text())[0]["rows"] == r["rows"]


def test_decode_step_bench_times_bf16_and_fp8_weights_in_one_process():
    """``--quantizations none fp8``: one model after the other, the chosen case and a
    prefill step each, on weights of the two formats, each step beside a floor counted
    in its own weights' bytes."""
    from bench.decode_step import main

    plain, fp8 = main(["--seqs", "2", "--steps", "2", "--prompt-len", "16", "--max-model-len",
                       "128", "--block-size", "16", "--quantizations", "none", "fp8",
                       "--cases", "xla+engine", "--prefill-len", "32"])
    assert (plain["quantization"], fp8["quantization"]) == ("none", "fp8")
    for r in (plain, fp8):
        assert [(x["cache"], x["loop"], x["quantization"]) for x in r["rows"]] == [
            ("xla", "engine", r["quantization"])]
        assert np.isfinite(r["rows"][0]["step_ms"]) and r["prefill_ms"] > 0
        assert 0 < r["rows"][0]["weights_floor_ms"] < r["rows"][0]["floor_ms"] < np.inf
    assert fp8["rows"][0]["weights_floor_ms"] < plain["rows"][0]["weights_floor_ms"]
