"""MoE grouped matmul on the GPU: check both kernels, then time them against each other.

    python -m bench.grouped_matmul [--check-only] [--json FILE]

Check: `grouped_matmul(..., backend=b)` for b in mgpu, pallas (bf16, default tiles) against
`jax.lax.ragged_dot` on float32 copies of the same inputs, for row counts below one
tile, ragged and whole, with empty experts, the weights stacked over two layers and
the second layer's experts named by `group_offset`; ||out - ref|| / ||ref|| must stay
under 1e-2 (bf16 output rounding is ~4e-3) and every row must be finite.

Timing: the 35B-A3B expert shapes (2048 -> 1024 gate/up, 512 -> 2048 down, 256
experts, top-8) at decode (16 to 256 sequences) and prefill (512 to 8192 tokens) row
counts, weights stacked over two layers as the scanned model passes them: "mgpu" (our
Mosaic GPU kernel, default tiles) and "pallas" (the Pallas Triton kernel per tile in
PALLAS_TILES) read the stack in place; the peer in the same run is JAX's own Mosaic GPU
kernel (``ragged_dot_mgpu``, same tiles), which takes one layer's weights: "jax mgpu"
slices the layer out first, "jax mgpu, no slice" is given the layer alone. Routing drawn
uniformly, as random weights route. Each time is the median over samples of (10
back-to-back calls / 10) after a warm-up, beside its floor: the touched experts'
weights + activations over the read bandwidth, and 2 R K N over the bf16 matmul rate,
both measured here first.
"""

import argparse
import json

import numpy as np

import jax
import jax.numpy as jnp

from bench.roofline import measure_ceilings
from bench.timing import seconds_per_call
from pallas_kernels.grouped_matmul import (
    grouped_matmul, grouped_matmul_mgpu, grouped_matmul_pallas, mgpu_tiles, padded_call)
from pallas_kernels.tuning import grouped_matmul_config

E, TOP_K, LAYERS = 256, 8, 2
SHAPES = {"gate_up": (2048, 1024), "down": (512, 2048)}
ROWS = {"decode16": 16 * TOP_K, "decode64": 64 * TOP_K, "decode128": 128 * TOP_K,
        "decode256": 256 * TOP_K, "prefill512": 512 * TOP_K, "prefill2048": 2048 * TOP_K,
        "prefill8192": 8192 * TOP_K}
PALLAS_TILES = [dict(bm=bm, bn=bn, bk=bk, warps=w, stages=s) for bm, bn, bk, w, s in (
    (16, 128, 64, 4, 3), (16, 64, 64, 4, 3), (16, 256, 64, 4, 3), (16, 128, 128, 4, 3),
    (16, 128, 64, 4, 4), (16, 128, 64, 2, 3), (32, 128, 64, 4, 3), (64, 128, 64, 4, 3))]
MGPU_SWEEP = [dict(block_m=bm, block_n=bn, block_k=bk, max_concurrent_steps=st)
              for bm, bn, bk, st in ((64, 128, 64, 4), (128, 128, 64, 4), (64, 256, 64, 5),
                                     (128, 128, 64, 3), (64, 256, 128, 2))]


def _inputs(rng, rows, k, n, empty=0):
    """bf16 x [rows, k], w [LAYERS * E, k, n] (experts of LAYERS layers) and group sizes
    summing to rows; `empty` experts get no rows."""
    p = np.ones(E)
    p[rng.choice(E, empty, replace=False)] = 0
    sizes = rng.multinomial(rows, p / p.sum()).astype(np.int32)
    kx, kw = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (LAYERS * E, k, n), jnp.bfloat16) * 0.05).astype(jnp.bfloat16)
    return x, w, jnp.asarray(sizes)


def check(rng) -> list[dict]:
    out = []
    for rows, (k, n), empty in ((8, SHAPES["gate_up"], 0), (100, SHAPES["down"], 40),
                                (512, SHAPES["gate_up"], 30), (1000, SHAPES["down"], 0),
                                (4096, SHAPES["gate_up"], 100)):
        x, w, sizes = _inputs(rng, rows, k, n, empty)
        ref = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w[E:].astype(jnp.float32),
                                            sizes, precision=jax.lax.Precision.HIGHEST),
                         np.float64)
        for backend in ("mgpu", "pallas"):
            got = np.asarray(jax.jit(lambda a, b, g, be=backend: grouped_matmul(
                a, b, g, group_offset=E, backend=be))(x, w, sizes), np.float64)
            err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
            ok = bool(np.isfinite(got).all() and err < 1e-2)
            out.append(dict(backend=backend, rows=rows, k=k, n=n, empty=empty, rel_err=err,
                            ok=ok))
            print(f"check {backend:6s} rows {rows:5d} {k}->{n} empty {empty:3d}: rel err "
                  f"{err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return out


def _jax_mgpu(x, w, group_sizes, group_offset, **tiles):
    """JAX's Mosaic GPU grouped matmul (the peer) in ``padded_call``'s signature."""
    from jax.experimental.pallas.ops.gpu import ragged_dot_mgpu

    w = jax.lax.dynamic_slice_in_dim(w, group_offset, group_sizes.shape[0], 0)
    return ragged_dot_mgpu.ragged_dot(x, w, group_sizes=group_sizes, grid_block_n=1, **tiles)


def _variants(x, w):
    """(name, jitted fn of (x, w, sizes)) for each way timed, the defaults first."""
    tiles = mgpu_tiles(x, w[:E])
    yield "mgpu", jax.jit(lambda a, b, g: grouped_matmul(a, b, g, group_offset=E,
                                                         backend="mgpu"))
    yield "jax mgpu", jax.jit(lambda a, b, g: padded_call(_jax_mgpu, a, b, g, E, tiles))
    yield "jax mgpu, no slice", jax.jit(
        lambda a, b, g: padded_call(_jax_mgpu, a, b[E:], g, 0, tiles))
    for t in MGPU_SWEEP:
        if t != tiles:
            name = "mgpu " + "x".join(str(v) for v in t.values())
            yield name, jax.jit(lambda a, b, g, t=t: padded_call(grouped_matmul_mgpu, a, b, g,
                                                                 E, t))
    for t in PALLAS_TILES:
        name = "pallas " + "x".join(str(t[f]) for f in ("bm", "bn", "bk", "warps", "stages"))
        if t == grouped_matmul_config(x.shape[0]):
            name += " (default)"
        yield name, jax.jit(lambda a, b, g, t=t: grouped_matmul_pallas(a, b, g, E, config=t))


def timings(rng, ceil, phases) -> list[dict]:
    out = []
    for shape, (k, n) in SHAPES.items():
        for phase in phases:
            rows = ROWS[phase]
            x, w, sizes = _inputs(rng, rows, k, n)
            touched = int((np.asarray(sizes) > 0).sum())
            floor = max(2 * rows * k * n / ceil["matmul_flops_per_s"],
                        (touched * k * n + rows * (k + n)) * 2 / ceil["read_bytes_per_s"])
            for name, fn in _variants(x, w):
                try:
                    s = seconds_per_call(fn, x, w, sizes)
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    print(f"{shape} {phase} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = dict(shape=shape, phase=phase, rows=rows, variant=name, ms=s * 1e3,
                           floor_ms=floor * 1e3, tflops=2 * rows * k * n / s / 1e12)
                out.append(row)
                print(f"{shape:8s} {phase:12s} {name:28s} {s * 1e3:8.3f} ms  floor "
                      f"{floor * 1e3:.3f} ms  {row['tflops']:.0f} TFLOP/s", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--check-only", action="store_true", help="the check, without the timings")
    p.add_argument("--phases", nargs="+", choices=list(ROWS), default=list(ROWS),
                   help="row counts to time (default: all)")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind, "checks": check(rng)}
    if a.check_only:
        if not all(c["ok"] for c in result["checks"]):
            raise SystemExit("grouped matmul check FAILED")
        return
    result["ceilings"] = ceil = measure_ceilings(2 << 30, 8192)
    print(f"read {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    result["timings"] = timings(rng, ceil, a.phases)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print("\n| shape | rows | variant (pallas: bm x bn x bk x warps x stages) | ms | floor ms "
          "| TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in result["timings"]:
        print(f"| {r['shape']} | {r['rows']} | {r['variant']} | {r['ms']:.3f} | "
              f"{r['floor_ms']:.3f} | {r['tflops']:.0f} |")
    if not all(c["ok"] for c in result["checks"]):
        raise SystemExit("grouped matmul check FAILED")


if __name__ == "__main__":
    main()
