"""MoE grouped matmul on the GPU: check the Mosaic GPU path, then time its tiles.

    python -m bench.grouped_matmul [--check-only] [--json FILE]

Check: `grouped_matmul(..., backend="mgpu")` (bf16, default tiles) against `jax.lax.ragged_dot`
on float32 copies of the same inputs, for row counts below one tile, ragged
and whole, with empty experts; ||out - ref|| / ||ref|| must stay under 1e-2
(bf16 output rounding is ~4e-3) and every row must be finite.

Timing: the 35B-A3B expert shapes (2048 -> 1024 gate/up, 512 -> 2048 down, 256
experts, top-8) at decode (64 and 256 sequences) and prefill (2048 tokens) row
counts, for each tile in TILES; routing drawn uniformly, as random weights
route. Each time is the median over samples of (10 back-to-back calls / 10)
after a warm-up, beside its floor: the touched experts' weights + activations
over the copy bandwidth, and 2 R K N over the bf16 matmul rate, both measured
here first.
"""

import argparse
import json

import numpy as np

import jax
import jax.numpy as jnp

from bench.timing import seconds_per_call
from pallas_kernels.grouped_matmul import grouped_matmul, mgpu_kernel, mgpu_tiles, padded_call

E, TOP_K = 256, 8
SHAPES = {"gate_up": (2048, 1024), "down": (512, 2048)}
ROWS = {"decode64": 64 * TOP_K, "decode256": 256 * TOP_K, "prefill2048": 2048 * TOP_K}
TILES = [dict(block_m=bm, block_n=bn, block_k=64, max_concurrent_steps=s, grid_block_n=1)
         for bm, bn, s in ((64, 128, 4), (128, 128, 4), (128, 128, 6), (64, 256, 4))]


def _inputs(rng, rows, k, n, empty=0):
    """bf16 x [rows, k], w [E, k, n] and group sizes summing to rows; `empty`
    experts get no rows."""
    p = np.ones(E)
    p[rng.choice(E, empty, replace=False)] = 0
    sizes = rng.multinomial(rows, p / p.sum()).astype(np.int32)
    kx, kw = jax.random.split(jax.random.key(int(rng.integers(2**31))))
    x = jax.random.normal(kx, (rows, k), jnp.bfloat16)
    w = (jax.random.normal(kw, (E, k, n), jnp.bfloat16) * 0.05).astype(jnp.bfloat16)
    return x, w, jnp.asarray(sizes)


def check(rng) -> list[dict]:
    out = []
    for rows, (k, n), empty in ((8, SHAPES["gate_up"], 0), (100, SHAPES["down"], 40),
                                (512, SHAPES["gate_up"], 30), (1000, SHAPES["down"], 0),
                                (4096, SHAPES["gate_up"], 100)):
        x, w, sizes = _inputs(rng, rows, k, n, empty)
        got = np.asarray(jax.jit(lambda a, b, g: grouped_matmul(a, b, g, backend="mgpu"))(
            x, w, sizes), np.float64)
        ref = np.asarray(jax.lax.ragged_dot(x.astype(jnp.float32), w.astype(jnp.float32), sizes,
                                            precision=jax.lax.Precision.HIGHEST), np.float64)
        err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
        ok = bool(np.isfinite(got).all() and err < 1e-2)
        t = mgpu_tiles(x, w)
        tiles = f"{t['block_m']}x{t['block_n']}x{t['block_k']}x{t['max_concurrent_steps']}"
        out.append(dict(rows=rows, k=k, n=n, empty=empty, tiles=tiles, rel_err=err, ok=ok))
        print(f"check rows {rows:5d} {k}->{n} empty {empty:3d} tiles {tiles}: rel err {err:.2e} "
              f"{'ok' if ok else 'FAIL'}", flush=True)
    return out


def ceilings() -> dict:
    x = jax.random.normal(jax.random.key(1), (1 << 30,), jnp.bfloat16)
    copy = 2 * x.nbytes / seconds_per_call(jax.jit(lambda v: v + 1), x)
    a, b = (jax.random.normal(jax.random.key(i), (8192, 8192), jnp.bfloat16) for i in (2, 3))
    rate = 2 * 8192 ** 3 / seconds_per_call(jax.jit(lambda p, q: p @ q), a, b)
    return {"copy_bytes_per_s": copy, "matmul_flops_per_s": rate}


def timings(rng, ceil) -> list[dict]:
    out = []
    for shape, (k, n) in SHAPES.items():
        for phase, rows in ROWS.items():
            x, w, sizes = _inputs(rng, rows, k, n)
            touched = int((np.asarray(sizes) > 0).sum())
            floor = max(2 * rows * k * n / ceil["matmul_flops_per_s"],
                        (touched * k * n + rows * (k + n)) * 2 / ceil["copy_bytes_per_s"])
            for tiles in TILES:
                name = "x".join(str(tiles[t]) for t in ("block_m", "block_n", "block_k",
                                                         "max_concurrent_steps"))
                try:
                    fn = jax.jit(lambda a, b, g, t=tiles: padded_call(mgpu_kernel(), a, b, g, t))
                    s = seconds_per_call(fn, x, w, sizes)
                except Exception as e:  # a tile that does not fit (shared memory, registers)
                    print(f"{shape} {phase} {name}: {type(e).__name__}: {str(e)[:200]}", flush=True)
                    continue
                row = dict(shape=shape, phase=phase, rows=rows, tiles=name, ms=s * 1e3,
                           floor_ms=floor * 1e3, tflops=2 * rows * k * n / s / 1e12,
                           default=tiles == mgpu_tiles(x, w))
                out.append(row)
                print(f"{shape:8s} {phase:12s} {name:14s} {s * 1e3:8.3f} ms  floor "
                      f"{floor * 1e3:.3f} ms  {row['tflops']:.0f} TFLOP/s", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--check-only", action="store_true", help="the check, without the timings")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind, "checks": check(rng)}
    if a.check_only:
        if not all(c["ok"] for c in result["checks"]):
            raise SystemExit("grouped matmul check FAILED")
        return
    result["ceilings"] = ceil = ceilings()
    print(f"copy {ceil['copy_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
          f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
    result["timings"] = timings(rng, ceil)
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    print("\n| shape | rows | tiles (m x n x k x stages) | ms | floor ms | TFLOP/s |")
    print("|---|---|---|---|---|---|")
    for r in result["timings"]:
        print(f"| {r['shape']} | {r['rows']} | {r['tiles']}{' (default)' if r['default'] else ''} "
              f"| {r['ms']:.3f} | {r['floor_ms']:.3f} | {r['tflops']:.0f} |")
    if not all(c["ok"] for c in result["checks"]):
        raise SystemExit("grouped matmul check FAILED")


if __name__ == "__main__":
    main()
