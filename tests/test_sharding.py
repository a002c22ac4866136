"""Sharded execution on 8 CPU host devices equals the single-device run.

The device count of the CPU backend is fixed when JAX starts, and the test
session's JAX is already up, so the checks run in a child process started with
``--xla_force_host_platform_device_count=8`` (this file, run as a script); it
prints one JSON record per check and the tests here assert on them.

Per mesh: the model's prefill (12 tokens per row, two rows) then one decode step
continuing from the cache, jitted with the parameters and cache placed by
``qwen35_jax.sharding`` and traced under the mesh, against the same weights on one
device.  The compiled program is also read (``bench.hlo``): no all-gather, all-to-all
or collective-permute may rebuild a split parameter or (without ``data``, whose paged
gathers are global) a cache array or a view of one.
A checkpoint loaded onto a mesh holds the same values as on one device, in the
table's layout.  The serving checks run greedy requests on engines
(``LLM("tiny-moe", ...)``): aggregated on EP2xTP2, and disaggregated with the
prefill on one mesh and the decode on another, the request's cache handed over by
the planned descriptors; every run must give the single-device engine's tokens.

The kernel path: the same forward checks with the Pallas kernel bodies in interpret
mode (``pallas_kernels.default_backend``), where each kernel must run per device
(inside ``shard_map``, as on the GPU, whose custom calls the partitioner cannot split),
and a TP2 engine on those kernels must give the single-device engine's greedy tokens
with its donated cache shards never moving.
"""

from __future__ import annotations

import json
import sys

import pytest
from host_devices import child_result, start_child

# Each axis alone where it splits something new (tp2 on both FFN kinds, ep4), then each
# pair; a pair also checks each of its axes (dp2 and ep2 alone split nothing the others leave whole).
MODEL_MESHES = {
    "tiny": ["tp2", "dp2,tp2"],
    "tiny-moe": ["ep4", "tp2", "dp2,ep2", "ep2,tp2"],
    # FP8 weights (--quantization fp8): block scales beside the split experts and kernels
    "tiny-moe:fp8": ["ep2,tp2"],
}
# Heads split (TP2, as the sharded workers run on two GPUs) beside the expert split, and
# TP4, where
# tiny-moe's 2 KV heads and 2 GDN key heads do not divide: every device runs all attention
# heads, and each GDN value head gets its own copy of its key head.
KERNEL_MESHES = ["tp2", "ep2,tp2", "tp4"]
# Float32 reductions split over shards are summed in another order; over 8 layers and a
# decode step that moves logits by a few float32 ulps of their largest magnitude. FP8
# experts quantise their rows (W8A8): an entry that such a difference moves across an
# e4m3 rounding boundary moves by one e4m3 step, so their logits get 4x the room.
RTOL = 5e-5
RTOL_FP8 = 2e-4


CHILDREN = {("forward", name): ("forward", name, *meshes) for name, meshes in MODEL_MESHES.items()}
CHILDREN |= {("kernels",): ("kernels", "tiny-moe", *KERNEL_MESHES), ("serving",): ("serving",),
             ("load",): ("load",), ("speculative",): ("speculative",)}
# The session starts them ahead, at the lowest CPU priority, while earlier modules run
# (conftest, ``host_devices.Ahead``); ``children`` takes them over.
AHEAD_CHILDREN = list(CHILDREN.values())


@pytest.fixture(scope="module")
def children():
    """Every child process of this module: those the session started ahead (conftest,
    ``AHEAD_CHILDREN``), running or done, and the rest started together on first use.

    Each child spends minutes tracing and compiling, mostly on one core, while this
    process only waits; started one after another (one per fixture, as they were) they
    leave the other cores idle. Started at once, they overlap; each test still reads only
    its own child's records, which are the same whatever runs beside them and whenever
    they run.

    They share the session's persistent compilation cache (conftest), as they compile
    many of the same programs: tiny-moe's single-device initialiser (forward and kernel
    children) and TP2 one (kernel and serving children), the serving child's prefill and
    decode engines of one mesh (the same programs twice), the samplers of the serving and
    the kernel engines. A program compiled once is loaded wherever it comes again, not
    compiled; which child compiles it depends on timing only, and the executable loaded is
    the one compiled (an entry read while another child still writes it does not load, and
    JAX compiles the program instead). Each with a cache of its own (nothing shared), the
    seven took 463 CPU-seconds (kernels 117, serving 115, speculative 92, forward tiny-moe
    69, tiny-moe:fp8 37, tiny 33, load 19; 2026-12-07, 2-core CI machine)."""
    started = {key: start_child(__file__, *args) for key, args in CHILDREN.items()}
    yield lambda key: child_result(started[key], timeout=1800)
    for proc in started.values():
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.fixture(scope="module")
def forward_records(children):
    return {name: children(("forward", name)) for name in MODEL_MESHES}


@pytest.mark.parametrize("name,mesh", [(n, m) for n, ms in MODEL_MESHES.items() for m in ms])
def test_sharded_logits_equal_single_device(forward_records, name, mesh):
    r = forward_records[name][mesh]
    rtol = RTOL_FP8 if name.endswith(":fp8") else RTOL
    assert r["prefill_rel_err"] <= rtol and r["decode_rel_err"] <= rtol, r
    assert r["same_argmax"], r


@pytest.mark.parametrize("name,mesh", [(n, m) for n, ms in MODEL_MESHES.items() for m in ms])
def test_compiled_step_keeps_weights_and_cache_split(forward_records, name, mesh):
    r = forward_records[name][mesh]
    assert r["split_params"] > 0, r
    assert r["gathered_params"] == [], r
    if "dp" not in mesh:
        assert r["gathered_cache"] == [], r


@pytest.fixture(scope="module")
def kernel_records(children):
    return children(("kernels",))


@pytest.mark.parametrize("mesh", KERNEL_MESHES)
def test_kernels_run_per_device_and_equal_single_device(kernel_records, mesh):
    r = kernel_records[mesh]
    assert r["prefill_rel_err"] <= RTOL and r["decode_rel_err"] <= RTOL, r
    assert r["same_argmax"], r
    # prefill and decode: conv, GDN, attention (at least one call each)
    assert r["kernels"] == r["kernels_per_device"] >= 6, r


@pytest.mark.parametrize("mesh", KERNEL_MESHES)
def test_compiled_kernel_step_keeps_weights_and_cache_split(kernel_records, mesh):
    r = kernel_records[mesh]
    assert r["gathered_params"] == [] and r["gathered_cache"] == [], r


def test_engine_on_kernels_matches_single_device_in_place(kernel_records):
    r = kernel_records["engine"]
    assert r["sharded"] == r["single"], r
    assert r["addresses_kept"], r


@pytest.fixture(scope="module")
def serving_records(children):
    return children(("serving",))


def test_engine_on_mesh_matches_single_device(serving_records):
    r = serving_records["engine"]
    assert r["sharded"] == r["single"], r
    # the engines' sharded initialisers made the single-device engine's weights
    assert r["init_mismatched"] == {"tp=2": [], "ep=2,tp=2": []}, r
    assert r["cache_specs"]["kv"][4] == "tensor" and r["param_spec_experts"][1] == [
        "expert", "tensor"], r


def test_disaggregated_across_mesh_shapes_matches_single_device(serving_records):
    records = {k: r for k, r in serving_records.items() if "->" in k}
    assert len(records) == 4
    for r in records.values():
        assert r["tokens"] == serving_records["engine"]["single"], r
    # Equal splits cost what unsharded peers cost, per part; unequal ones cut every row.
    same, base = records["tp=2->tp=2"]["descriptors"], records["single->single"]["descriptors"]
    assert same == [2 * n for n in base], records
    assert all(n > 2 * b for n, b in zip(records["tp=2->single"]["descriptors"], base)), records


def test_mesh_spec_and_head_aligned_fallbacks():
    from jax.sharding import AbstractMesh
    from jax.sharding import PartitionSpec as P

    from qwen35_jax import get_preset
    from qwen35_jax.sharding import AXES, MeshShape, cache_specs, expert_axes, param_spec

    assert MeshShape.parse("dp2, ep=4") == MeshShape(dp=2, ep=4, tp=1)
    with pytest.raises(ValueError):
        MeshShape.parse("tp2,tp4")
    cfg = get_preset("tiny-moe")  # 4 heads, 2 KV heads, 4 GDN value heads, 8 experts
    mesh = AbstractMesh((1, 4, 4), AXES)
    q_proj, k_proj = (f"groups.attn.self_attn.{n}.kernel" for n in ("q_proj", "k_proj"))
    assert param_spec(cfg, q_proj, 3, mesh) == P(None, None, "tensor")
    assert param_spec(cfg, k_proj, 3, mesh) == P(None, None, None)  # 2 KV heads, 4 devices
    assert cache_specs(cfg, mesh).kv[4] is None and cache_specs(cfg, mesh).ssm[3] == "tensor"
    assert expert_axes(mesh, 8) == ("expert",)  # 8 experts over 16 devices: expert axis only
    assert expert_axes(AbstractMesh((1, 2, 2), AXES), 8) == ("expert", "tensor")
    assert expert_axes(AbstractMesh((1, 3, 1), AXES), 8) == ()
    assert param_spec(cfg, "groups.gdn.mlp.experts_down", 5, mesh) == P(
        None, None, ("expert",), None, None)


def test_speculative_decoding_on_a_mesh_keeps_outputs(children):
    """MTP drafting on EP2xTP2 (the trained tiny-math-moe and its head): every request
    gets the single-device engine's tokens without drafts, the trained head's drafts
    are accepted, and the head's experts are split as the model's are."""
    r = children(("speculative",))["speculative"]
    assert r["sharded"] == r["single"], r
    assert r["acceptance_length"] > 1.5, r
    assert r["head_experts_spec"][0] == ["expert", "tensor"], r


def test_checkpoint_loads_straight_into_the_mesh(children):
    r = children(("load",))["load"]
    assert r["mismatched"] == [] and r["misplaced"] == [], r
    assert r["split"] > 0, r


# ---- the child process ----------------------------------------------------------------

def _kernel_calls(jaxpr, per_device=False) -> tuple[int, int]:
    """(Pallas calls in ``jaxpr`` and its sub-jaxprs, those of them inside a shard_map)."""
    total = inside = 0
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "pallas_call":
            total, inside = total + 1, inside + per_device
            continue
        for v in eqn.params.values():
            for sub in v if isinstance(v, (tuple, list)) else (v,):
                sub = getattr(sub, "jaxpr", sub)
                if hasattr(sub, "eqns"):
                    t, i = _kernel_calls(sub, per_device or eqn.primitive.name == "shard_map")
                    total, inside = total + t, inside + i
    return total, inside


def _forward_child(name: str, meshes: list[str], backend: str = "auto") -> None:
    """One record per mesh; ``backend`` is what the kernels' "auto" stands for."""
    import jax
    import jax.numpy as jnp
    import numpy as np
    from flax import nnx

    import qwen35_jax
    from bench.hlo import RESHARDING, pool_views, produced_by
    from pallas_kernels import default_backend
    from qwen35_jax import sharding as S
    from qwen35_jax.cache import HybridCache, SequenceCache

    from qwen35_jax import quant

    preset, _, quantization = name.partition(":")
    cfg = qwen35_jax.get_preset(preset)
    if quantization == "fp8":
        cfg = cfg.replace(fp8_modules=quant.applicable(quant.DEFAULT, cfg.is_moe))
    ids = jax.random.randint(jax.random.key(1), (2, 12), 0, cfg.vocab_size)

    def run(model, ids, cache):
        logits, cache = model(ids, cache)
        step, _ = model(ids[:, -1:], cache)
        return logits, step

    def fresh_cache():
        return SequenceCache.allocate(cfg, 2, 32)

    base = qwen35_jax.init_random(cfg, seed=0, dtype=jnp.float32)
    with default_backend(backend):
        ref = jax.jit(run)(base, ids, fresh_cache())
    ref = [np.asarray(a) for a in ref]
    graphdef, state = nnx.split(base)
    for spec in meshes:
        mesh = S.make_mesh(S.MeshShape.parse(spec))
        # The same weights placed on the mesh (an initialiser compiled for each mesh cost
        # ~8 s a mesh; the engines of the kernel and serving children start sharded ones).
        model = nnx.merge(graphdef, jax.device_put(state, S.param_shardings(cfg, state, mesh)))
        cache = jax.device_put(fresh_cache(), SequenceCache(
            cache=S.cache_shardings(cfg, mesh), lengths=S.replicated(mesh)))
        rows = jax.device_put(ids, jax.sharding.NamedSharding(mesh, jax.sharding.PartitionSpec(
            S.DATA)))
        with jax.set_mesh(mesh), default_backend(backend):
            traced = jax.jit(run).trace(model, rows, cache)  # one trace: compiled and counted
            compiled = traced.lower().compile()
            kernels = _kernel_calls(traced.jaxpr.jaxpr)
        out = [np.asarray(a) for a in compiled(model, rows, cache)]
        rel = [float(np.abs(a - b).max() / np.abs(a).max()) for a, b in zip(ref, out)]
        # Split matrices, whole and per layer (split vectors are too small to tell from
        # activations by shape).
        split = set()
        for path, v in nnx.to_flat_state(nnx.state(model)):
            lead = 2 if path[:2] == ("groups", "gdn") else 1 if path[0] == "groups" else 0
            if v[...].sharding.shard_shape(v.shape) != v.shape and len(v.shape) - lead >= 2:
                split |= {tuple(v.shape), tuple(v.shape[lead:])}
        cache_shapes = pool_views(HybridCache.shapes(
            cfg, cache.cache.num_blocks, cache.cache.block_size, cache.cache.num_slots))
        hlo = compiled.as_text()
        print(json.dumps(dict(
            key=spec, prefill_rel_err=rel[0], decode_rel_err=rel[1],
            same_argmax=bool((ref[0].argmax(-1) == out[0].argmax(-1)).all()
                             and (ref[1].argmax(-1) == out[1].argmax(-1)).all()),
            split_params=len(split), gathered_params=produced_by(hlo, RESHARDING, split),
            gathered_cache=produced_by(hlo, RESHARDING, cache_shapes), kernels=kernels[0],
            kernels_per_device=kernels[1])), flush=True)


def _kernels_child(name: str, meshes: list[str]) -> None:
    """The forward records on the Pallas bodies (interpret mode); then greedy tokens of
    a TP2 engine on them against the single-device engine's, and whether its donated
    cache kept every shard's address."""
    from pallas_kernels import default_backend
    from serving import LLM, SamplingParams

    _forward_child(name, meshes, backend="interpret")
    greedy, tokens = SamplingParams(max_tokens=4, temperature=0), {}
    with default_backend("interpret"):
        for key, sizes in (("single", {}), ("sharded", {"tp": 2})):
            llm = LLM(name, **sizes, **_engine_options())
            tokens[key] = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    try:
        llm.engine.runner.check_addresses()
        kept = True
    except RuntimeError:
        kept = False
    print(json.dumps(dict(key="engine", **tokens, addresses_kept=kept)), flush=True)


PROMPTS = [[5, 9, 13, 2, 7], [3, 3, 8, 21, 34, 55, 89, 144, 11, 6, 1, 2, 3, 4, 5, 6, 7, 8],
           [400, 17]]


def _engine_options() -> dict:
    from serving.engine.buckets import Buckets

    return dict(num_blocks=64, max_num_seqs=4, max_num_batched_tokens=32, max_model_len=128,
                buckets=Buckets(prefill_tokens=(32,), prefill_seqs=(4,), decode_seqs=(4,)))


def _serving_child() -> None:
    """Greedy tokens of the single-device engine; then prefill on one mesh, hand each
    request's blocks and slot over by the descriptors ``stream_items`` and the planner
    give (copied as a NIXL READ would, address to address: CPU shards are host memory),
    decode on another mesh; last, the EP2xTP2 engine serving the prompts by itself."""
    import ctypes

    from qwen35_jax import sharding as S
    from serving import LLM, SamplingParams
    from serving.kv_transfer import shard_regions, stream_items
    from transfer.descriptors import plan

    greedy, options = SamplingParams(max_tokens=8, temperature=0), _engine_options()
    llms = {}

    def engine(role, spec):
        if (role, spec) not in llms:
            sizes = {k: int(v) for k, v in (p.split("=") for p in spec.split(",") if p)}
            llms[role, spec] = LLM("tiny-moe", **sizes, **options)
        return llms[role, spec].engine

    single = [o.token_ids for o in engine("prefill", "").generate(PROMPTS, greedy)]
    for src_spec, dst_spec in (("", ""), ("tp=2", "tp=2"), ("tp=2", ""), ("", "ep=2,tp=2")):
        pre, dec = engine("prefill", src_spec), engine("decode", dst_spec)
        counts, ids = [], []
        for prompt in PROMPTS:
            rid = pre.add_request(prompt, SamplingParams(max_tokens=1, temperature=0),
                                  hold_on_finish=True)
            while pre.has_unfinished():
                pre.step()
            req = pre.requests[rid]
            did = dec.add_remote_request(prompt, req.output_token_ids[0], greedy)
            [(_, blocks, slot, *_)] = dec.reserve_transfers()
            src_regions, src_layout = shard_regions(pre.runner.cache)
            dst_regions, dst_layout = shard_regions(dec.runner.cache)
            src_items, dst_items = stream_items(src_layout, req.block_ids, req.slot, dst_layout,
                                                blocks, slot, len(prompt))
            p = plan(dst_items, {r.name: r for r in dst_regions},
                     src_items, {r.name: r for r in src_regions})
            for (dst, n, _), (src, _, _) in zip(p.local.tolist(), p.remote.tolist()):
                ctypes.memmove(dst, src, n)
            pre.release(rid)
            dec.finish_transfer(did)
            counts.append(p.count)
            ids.append(did)
        done = {}
        while dec.has_unfinished():
            done.update((o.request_id, o.token_ids) for o in dec.step() if o.finished)
        print(json.dumps(dict(key=f"{src_spec or 'single'}->{dst_spec or 'single'}",
                              tokens=[done[i] for i in ids], descriptors=counts)), flush=True)
    llm = llms["decode", "ep=2,tp=2"]
    sharded = [o.token_ids for o in llm.generate(PROMPTS, greedy)]
    init_mismatched = {spec: _differing(llms[role, spec].model, llms["prefill", ""].model)
                       for role, spec in (("prefill", "tp=2"), ("decode", "ep=2,tp=2"))}
    cache = llm.engine.runner.cache
    experts = llm.model.groups.attn.mlp.experts_gate_up[...].sharding.spec
    print(json.dumps(dict(
        key="engine", single=single, sharded=sharded, init_mismatched=init_mismatched,
        cache_specs={k: list(getattr(cache, k).sharding.spec) for k in ("kv", "conv", "ssm")},
        param_spec_experts=[list(a) if isinstance(a, tuple) else a for a in experts],
        mesh=dict(S.mesh_of(cache.kv).shape))), flush=True)


def _differing(model, ref) -> list[str]:
    """Names of ``model``'s parameters whose values differ from ``ref``'s (any placement)."""
    import numpy as np
    from flax import nnx

    want = dict(nnx.to_flat_state(nnx.state(ref)))
    return [".".join(map(str, k)) for k, v in nnx.to_flat_state(nnx.state(model))
            if not np.array_equal(np.asarray(v[...]), np.asarray(want[k][...]))]


def _load_child() -> None:
    import tempfile

    import jax.numpy as jnp
    from flax import nnx

    import qwen35_jax
    from checkpoints import save_official
    from hf_reference import hf_model
    from qwen35_jax import sharding as S

    cfg = qwen35_jax.get_preset("tiny-moe")
    mesh = S.make_mesh(S.MeshShape(ep=2, tp=2))
    with tempfile.TemporaryDirectory() as path:
        save_official(hf_model(cfg, seed=7), path)
        ref = qwen35_jax.from_pretrained(path, jnp.float32, progress=False)
        got = qwen35_jax.from_pretrained(path, jnp.float32, progress=False, mesh=mesh)
    want = dict(nnx.to_flat_state(S.param_shardings(cfg, nnx.state(got), mesh)))
    mismatched, misplaced, split = _differing(got, ref), [], 0
    for k, v in nnx.to_flat_state(nnx.state(got)):
        a = v[...]
        if not a.sharding.is_equivalent_to(want[k], a.ndim):
            misplaced.append(".".join(map(str, k)))
        split += a.sharding.shard_shape(a.shape) != a.shape
    print(json.dumps(dict(key="load", mismatched=mismatched, misplaced=misplaced, split=split)),
          flush=True)


def _speculative_child() -> None:
    """Greedy answers to held-out problems: the single-device engine without drafts, then
    the EP2xTP2 engine drafting two tokens a step."""
    from transformers import AutoTokenizer

    from qwen35_jax import builtin
    from qwen35_jax.train import problems
    from serving import LLM, SamplingParams

    tok = AutoTokenizer.from_pretrained(builtin.resolve("tiny-math-moe"))
    prompts = [tok.encode(p.prompt) for p in problems.held_out(4)]
    greedy = SamplingParams(max_tokens=24, temperature=0)
    options = dict(max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256)
    single = [o.token_ids for o in LLM("tiny-math-moe", **options).generate(prompts, greedy)]
    llm = LLM("tiny-math-moe", ep=2, tp=2, **options,
              speculative_config={"method": "mtp", "num_speculative_tokens": 2})
    sharded = [o.token_ids for o in llm.generate(prompts, greedy)]
    m = llm.metrics()
    experts = next(a for a in llm.engine.drafter._mtp_leaves  # the head's, on the mesh
                   if a.ndim == 3 and a.shape[0] == llm.model.config.num_experts).sharding.spec
    print(json.dumps(dict(
        key="speculative", single=single, sharded=sharded,
        acceptance_length=1 + m["spec_decode_num_accepted_tokens"] / max(
            m["spec_decode_num_drafts"], 1),
        head_experts_spec=[list(a) if isinstance(a, tuple) else a for a in experts])),
        flush=True)


if __name__ == "__main__":
    {"forward": lambda: _forward_child(sys.argv[2], sys.argv[3:]),
     "kernels": lambda: _kernels_child(sys.argv[2], sys.argv[3:]), "serving": _serving_child,
     "load": _load_child, "speculative": _speculative_child}[sys.argv[1]]()
