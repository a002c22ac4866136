"""Greedy tokens and decode step time of one engine per mesh shape, against one device.

    python -m bench.sharded_step --preset 35B-A3B --meshes single ep2 tp2 --seqs 16 64

On two GPUs, the preset's shapes split EP2 (experts over both devices, the
rest replicated) and TP2 (heads, FFN columns and experts over both) must give the
single device's greedy tokens, and the decode step time of each is recorded beside the
single device's.  Per mesh, in order, one engine at a time (random weights of the same
seed, so every mesh holds the same values; the previous engine is freed first, which
lets one H200 hold the 35B-A3B weights alone):

* the compiled programs are read (``bench.hlo``) for collectives that reshard a cache
  array and copies that rebuild a device's cache shard: there should be none, as the
  kernels run per device on their shards (``qwen35_jax.sharding.per_device``) and the
  donated pools are updated in place (``Runner.check_addresses`` is asserted too);
* ``--prompts`` greedy requests of ``--prompt-len`` random tokens run for ``--tokens``
  tokens, compared with the first mesh's (a figure, not an assertion: bf16 sums split
  over devices run in another order and may flip a near-tie late);
* the decode step time at each ``--seqs``, as ``bench.decode_step`` measures it (a run
  of 1 + ``--steps`` tokens less a run of 1 token, over ``--steps``, median of three).

It prints a markdown table (mesh, seqs, decode step ms, ratio to the first mesh, greedy
tokens identical).  CPU dry run (float32), with the Pallas kernel bodies in interpret
mode run per device as the GPU runs them:

    XLA_FLAGS=--xla_force_host_platform_device_count=2 python -m bench.sharded_step \\
        --preset tiny-moe --backend interpret --seqs 2 4 --prompts 4 --prompt-len 16 \\
        --tokens 4 --steps 2

(On a two-core host with two host devices the pure-JAX reference backend hangs: both
devices' GDN prefill call LAPACK's triangular solve at once, and each waits for work
it queued on XLA's two-thread pool, which the other holds.  Three or more host
devices, or the interpret backend, avoid it.)
"""

import argparse
import gc
import json
import time

import jax
import jax.numpy as jnp
import numpy as np

from bench.hlo import cache_moves
from bench.timing import decode_step_seconds, run_sync
from pallas_kernels import default_backend
import qwen35_jax
from qwen35_jax.sharding import MeshShape, make_mesh
from serving import LLM, SamplingParams
from serving.engine.buckets import Buckets
from serving.llm import default_dtype


def mesh_sizes(spec: str) -> dict:
    """Engine keyword arguments of a ``--meshes`` entry: "single", or e.g. "ep2", "tp2",
    "ep2,tp2" (engines have no data axis: data parallelism is one engine per rank)."""
    if spec == "single":
        return {}
    shape = MeshShape.parse(spec)
    if shape.dp != 1:
        raise ValueError(f"{spec}: an engine's mesh has no data axis")
    return {"ep": shape.ep, "tp": shape.tp}


def agreement(got: list, want: list) -> dict:
    """How many completions are identical, and where the first differing one diverges."""
    differ = [i for i, (a, b) in enumerate(zip(got, want)) if a != b]
    first = None
    if differ:
        a, b = got[differ[0]], want[differ[0]]
        n = min(len(a), len(b))
        first = {"request": differ[0],
                 "token": next((j for j in range(n) if a[j] != b[j]), n)}
    return {"identical": len(want) - len(differ), "total": len(want), "first_difference": first}


def model_for(preset: str, spec: str, a):
    """The preset's name, or with ``--layers`` a model of its shapes cut to that many
    layers (random weights of the same seed), created in the mesh's layout."""
    if not a.layers:
        return preset
    cfg = qwen35_jax.get_preset(preset)
    period = cfg.full_attention_interval
    cfg = cfg.replace(num_hidden_layers=a.layers,
                      layer_types=cfg.layer_types[:period] * (a.layers // period))
    sizes = mesh_sizes(spec)
    mesh = make_mesh(MeshShape(**sizes)) if sizes else None
    dtype = jnp.dtype(a.dtype) if a.dtype else default_dtype()
    return qwen35_jax.init_random(cfg, seed=0, dtype=dtype, mesh=mesh)


def measure(preset: str, spec: str, a, prompts: list, timing_prompts: dict) -> dict:
    """One engine on mesh ``spec``: program check, greedy tokens, decode step times."""
    seqs = max(a.seqs)
    tokens = max(a.prompt_len, 64) * seqs
    t0 = time.perf_counter()
    llm = LLM(model_for(preset, spec, a), **mesh_sizes(spec),
              dtype=a.dtype and jnp.dtype(a.dtype),
              max_num_seqs=seqs, max_num_batched_tokens=tokens,
              max_model_len=a.max_model_len, block_size=a.block_size,
              num_blocks=seqs * -(-a.max_model_len // a.block_size), max_logprobs=0,
              buckets=Buckets((tokens,), (seqs,), tuple(sorted(set(a.seqs)))))
    engine = llm.engine
    ready_s = time.perf_counter() - t0
    moves = {f"{'decode' if d else 'prefill'} {t}x{n}":
             cache_moves(p.as_text(), engine.runner.cache)
             for (d, t, n), p in engine.runner._programs.items()}
    bad = {k: v for k, v in moves.items() if v["resharded"] or v["copied"]}
    print(f"[{spec}] ready in {ready_s:.0f} s; cache moved by the programs: {bad or 'never'}",
          flush=True)
    greedy = SamplingParams(max_tokens=a.tokens, temperature=0.0, ignore_eos=True)
    out = engine.generate(prompts, [greedy] * len(prompts))
    steps = {n: 1e3 * decode_step_seconds(run_sync, engine, timing_prompts[n], a.steps)
             for n in a.seqs}
    engine.runner.check_addresses()  # raises if a donated cache shard moved
    for n, ms in steps.items():
        print(f"[{spec}] seqs {n:>4}  decode step {ms:8.2f} ms", flush=True)
    free(engine)
    return {"mesh": spec, "ready_s": ready_s, "cache_moves": moves, "step_ms": steps,
            "tokens": [o.token_ids for o in out]}


def free(engine) -> None:
    """Delete the engine's weights and cache now, whoever still refers to them: the next
    mesh's weights need the memory (35B-A3B fills most of one H200)."""
    r = engine.runner
    for x in jax.tree.leaves((r._leaves, r.cache, r.last_token)):
        x.delete()
    gc.collect()


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(prog="python -m bench.sharded_step", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--preset", default="tiny-moe")
    p.add_argument("--meshes", nargs="+", default=["single", "ep2", "tp2"],
                   help="the first is the reference for tokens and step times")
    p.add_argument("--seqs", type=int, nargs="+", default=[16, 64])
    p.add_argument("--steps", type=int, default=32)
    p.add_argument("--prompts", type=int, default=16, help="greedy requests compared")
    p.add_argument("--prompt-len", type=int, default=64)
    p.add_argument("--tokens", type=int, default=32, help="greedy tokens per request")
    p.add_argument("--max-model-len", type=int, default=1024)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="weights and cache (default: bfloat16 on GPU, float32 on CPU); "
                        "float32 (with IEEE float32 matmuls: XLA's GPU default is TF32) "
                        "tells a real difference between meshes from rounding")
    p.add_argument("--layers", type=int, default=0,
                   help="cut the preset to this many layers, two attention intervals or "
                        "more (with one, the layer scan runs once and XLA copies the state "
                        "pool instead of updating it in place): float32 35B-A3B shapes fit "
                        "one H200 that way")
    p.add_argument("--backend", default="auto",
                   help="what the kernels' 'auto' stands for (pallas_kernels.default_backend)")
    p.add_argument("--json", default=None)
    a = p.parse_args(argv)
    if a.prompts > max(a.seqs):
        p.error("--prompts must fit one batch (at most max --seqs)")
    period = qwen35_jax.get_preset(a.preset).full_attention_interval
    if a.layers and (a.layers % period or a.layers < 2 * period):
        p.error(f"--layers must be a multiple of {period}, at least {2 * period}")

    rng = np.random.default_rng(0)
    prompts = [rng.integers(3, 500, a.prompt_len).tolist() for _ in range(a.prompts)]
    timing_prompts = {n: [rng.integers(3, 500, a.prompt_len).tolist() for _ in range(n)]
                      for n in a.seqs}
    runs = []
    # float32 compares meshes: XLA's float32 GEMMs default to TF32 on the GPU, whose
    # rounding differs with the split enough to change greedy tokens (bench/RESULTS.md,
    # sharded workers); IEEE products leave only the order of the sums
    precision = "highest" if a.dtype == "float32" else None
    with default_backend(a.backend), jax.default_matmul_precision(precision):
        for spec in a.meshes:
            runs.append(measure(a.preset, spec, a, prompts, timing_prompts))
    ref = runs[0]
    rows = []
    print("| mesh | seqs | decode step ms | vs " + ref["mesh"] + " | greedy identical |\n"
          "|---|---|---|---|---|")
    for r in runs:
        r["greedy"] = agreement(r["tokens"], ref["tokens"])
        g = r["greedy"]
        same = f"{g['identical']}/{g['total']}" + (
            f" (first difference: request {g['first_difference']['request']}, token "
            f"{g['first_difference']['token']})" if g["first_difference"] else "")
        for n, ms in r["step_ms"].items():
            rows.append({"mesh": r["mesh"], "seqs": n, "step_ms": ms,
                         "ratio": ms / ref["step_ms"][n], "greedy": g})
            print(f"| {r['mesh']} | {n} | {ms:.2f} | {ms / ref['step_ms'][n]:.2f}x | {same} |")
    result = {"preset": a.preset, "layers": a.layers or None,
              "device": jax.devices()[0].device_kind,
              "devices": jax.device_count(), "backend": a.backend, "rows": rows,
              "runs": [{k: v for k, v in r.items() if k != "tokens"} for r in runs]}
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=1)
    return result


if __name__ == "__main__":
    main()
