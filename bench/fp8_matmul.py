"""FP8 weight matmuls on the GPU against bf16, in one run: check, then time.

    python -m bench.fp8_matmul [--check-only] [--sweep] [--json FILE]

Check: the stacked-layer matmul (dense 35B-A3B shapes) and the MoE grouped matmul
(expert shapes, a fused [gate | up] of two parts) on FP8 weights with 128 x 128 block
scales (``pallas_kernels.block_fp8``), each backend "auto" takes (the Pallas kernels
stream FP8; the experts are W8A8, K-major: the Mosaic grouped matmul runs FP8 wgmma),
against float64 ``x @ dequantize(q, scale)`` (the experts' rows dequantised from their
e4m3 groups); ||out - ref|| / ||ref|| under 1e-2 (bf16 output rounding ~4e-3), every
entry finite.

Timing, per shape and row count, bf16 and FP8 weights of the same values (the bf16
kernel reads w, the FP8 one q and its scales): the dense shapes inside a layer scan as
``bench.layer_matmul`` times them (per layer = total / LAYERS), the expert shapes as
``bench.grouped_matmul`` does (two layers' experts stacked, uniform routing). Floors:
the weights read once (bf16: 2 bytes an entry; FP8: 1, plus the scales) at the
measured read bandwidth, and for prefill row counts 2 R K N at the bf16 matmul rate.
Where "auto" takes the Mosaic grouped matmul, the Pallas one on the same FP8 operands
is timed beside it ("fp8 pallas"), the alternative the dispatch is chosen against, and
so is the layer's experts dequantised by XLA before the bf16 Mosaic kernel ("fp8
dequantised"), the FP8 path before the FP8 Mosaic kernel.
``--sweep`` adds FP8 tiles of SWEEP for the dense kernel and of EXPERT_SWEEP for the
grouped one at decode row counts.
"""

import argparse
import json

import numpy as np

import jax
import jax.numpy as jnp

from bench import grouped_matmul as gmm_bench
from bench import layer_matmul as dense_bench
from bench.roofline import measure_ceilings
from bench.timing import seconds_per_call
from pallas_kernels import block_fp8
from pallas_kernels.grouped_matmul import grouped_matmul, grouped_matmul_pallas, resolve
from pallas_kernels.grouped_matmul.reference import dequantized_groups
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_pallas

E, TOP_K = gmm_bench.E, gmm_bench.TOP_K
DENSE_ROWS = (16, 64, 128, 256)
EXPERT_ROWS = {"decode16": 16 * TOP_K, "decode64": 64 * TOP_K, "decode128": 128 * TOP_K,
               "decode256": 256 * TOP_K, "prefill8192": 8192 * TOP_K}
SWEEP = [dict(bn=bn, bk=bk, stages=st, warps=4, min_programs=132, max_rows=256)
         for bn, bk, st in ((64, 128, 3), (128, 128, 3), (64, 128, 4), (128, 64, 3))]
EXPERT_SWEEP = [dict(bm=16, bn=bn, bk=bk, warps=4, stages=st) for bn, bk, st in (
    (128, 128, 3), (64, 128, 3), (128, 128, 4), (128, 64, 4), (64, 64, 3))]


def _fp8(w, splits=1):
    q, s = block_fp8.quantize(w, splits)
    return q, s, block_fp8.dequantize(q, s, jnp.bfloat16, splits)


def _err(got, ref):
    got = np.asarray(got, np.float64)
    err = float(np.linalg.norm(got - ref) / np.linalg.norm(ref))
    return err, bool(np.isfinite(got).all() and err < 1e-2)


def check(rng) -> list[dict]:
    out = []
    for name, (k, n) in dense_bench.SHAPES.items():
        w = jax.random.normal(jax.random.key(k + n), (3, k, n), jnp.float32) * 0.05
        q, s, _ = _fp8(w)
        wd = np.asarray(block_fp8.dequantize(q, s, jnp.float32), np.float64)
        for rows in (5, 100, 256, 2048):
            x = jnp.asarray(rng.standard_normal((rows, k)) * 0.5, jnp.bfloat16)
            ref = np.asarray(x, np.float64) @ wd[2]
            got = jax.jit(lambda a, b, c: layer_matmul(a, b, 2, scale=c))(x, q, s)
            err, ok = _err(got, ref)
            out.append(dict(op="dense", shape=name, rows=rows, rel_err=err, ok=ok))
            print(f"check dense {name:12s} rows {rows:5d}: rel err {err:.2e} "
                  f"{'ok' if ok else 'FAIL'}", flush=True)
    for shape, (k, n) in gmm_bench.SHAPES.items():
        splits = 2 if shape == "gate_up" else 1
        for rows in (8, 1000, 16384):
            x, w, sizes = gmm_bench._inputs(rng, rows, k, n, empty=30)
            q, s, _ = _fp8(w.astype(jnp.float32), splits)
            wd = block_fp8.dequantize(q[E:], s[E:], jnp.float32, splits)
            xd = block_fp8.dequantize_rows(*block_fp8.quantize_rows(x), jnp.float32)
            ref = np.asarray(jax.lax.ragged_dot(xd, wd, sizes,
                                                precision=jax.lax.Precision.HIGHEST), np.float64)
            qt, st = block_fp8.k_major(q, s)
            got = jax.jit(lambda a, b, c, g: grouped_matmul(
                a, b, g, group_offset=E, scale=c, splits=splits))(x, qt, st, sizes)
            err, ok = _err(got, ref)
            out.append(dict(op="experts", shape=shape, rows=rows, backend=resolve("auto", rows),
                            rel_err=err, ok=ok))
            print(f"check experts {shape:8s} rows {rows:5d} ({resolve('auto', rows)}): rel err "
                  f"{err:.2e} {'ok' if ok else 'FAIL'}", flush=True)
    return out


def _report(label: str, row: dict) -> None:
    """One timed row: bf16 and FP8 ms, the speed-up, the FP8 floor, the swept tiles."""
    print(f"{label}  bf16 {row['bf16']:.4f} ms  fp8 {row['fp8']:.4f} ms  "
          f"({row['bf16'] / row['fp8']:.2f}x)  fp8 floor {row['floor_fp8_ms']:.4f} ms "
          f"({row['floor_fp8_ms'] / row['fp8']:.0%})"
          + "".join(f"  {v} {row[v]:.4f}" for v in row if v.startswith("fp8 ")), flush=True)


def dense_timings(ceil, sweep) -> list[dict]:
    out = []
    layers = dense_bench.LAYERS
    for name, (k, n) in dense_bench.SHAPES.items():
        w = jax.random.normal(jax.random.key(1), (layers, k, n), jnp.bfloat16) * 0.05
        q, s, wb = _fp8(w)
        variants = [("bf16", lambda x, w_, i: layer_matmul(x, w_, i, backend="pallas"), (wb,)),
                    ("fp8", lambda x, w_, s_, i: layer_matmul(x, w_, i, scale=s_,
                                                              backend="pallas"), (q, s))]
        for cfg in (SWEEP if sweep else ()):
            variants.append(("fp8 bn{bn} bk{bk} st{stages}".format(**cfg),
                             lambda x, w_, s_, i, cfg=cfg: layer_matmul_pallas(
                                 x, [w_], i, [s_], config=cfg)[0], (q, s)))
        floor = {"bf16": k * n * 2 / ceil["read_bytes_per_s"],
                 "fp8": (k * n + s[0].size * 4) / ceil["read_bytes_per_s"]}
        for rows in DENSE_ROWS:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            row = dict(op="dense", shape=name, rows=rows,
                       **{f"floor_{v}_ms": f * 1e3 for v, f in floor.items()})
            for variant, fn, weights in variants:
                def run(x, *ws, fn=fn):
                    def body(acc, i):
                        return acc + jnp.sum(fn(x, *ws, i), dtype=jnp.float32), None
                    return jax.lax.scan(body, jnp.float32(0), jnp.arange(layers))[0]
                try:
                    row[variant] = seconds_per_call(jax.jit(run), x, *weights) / layers * 1e3
                except Exception as e:  # a swept tile that does not fit
                    print(f"{name} rows {rows} {variant}: {type(e).__name__}: {str(e)[:160]}")
            for cfg in (SWEEP if sweep and rows == DENSE_ROWS[1] else ()):  # same products?
                base = layer_matmul(x, q, 1, scale=s, backend="pallas")
                err, ok = _err(layer_matmul_pallas(x, [q], 1, [s], config=cfg)[0],
                               np.asarray(base, np.float64))
                print(f"  agree {cfg}: {err:.1e} {'ok' if ok else 'FAIL'}")
            out.append(row)
            _report(f"dense {name:12s} rows {rows:4d}", row)
    return out


def expert_timings(rng, ceil, sweep) -> list[dict]:
    out = []
    for shape, (k, n) in gmm_bench.SHAPES.items():
        splits = 2 if shape == "gate_up" else 1
        for phase, rows in EXPERT_ROWS.items():
            x, w, sizes = gmm_bench._inputs(rng, rows, k, n)
            q, s, wb = _fp8(w, splits)
            q, s = block_fp8.k_major(q, s)
            touched = int((np.asarray(sizes) > 0).sum())
            act = rows * (k + n) * 2
            mm = 2 * rows * k * n / ceil["matmul_flops_per_s"]
            # FP8 wgmma's dense rate is twice bf16's (sm90); the rows are read as bf16
            floor = {"bf16": max(mm, (touched * k * n * 2 + act) / ceil["read_bytes_per_s"]),
                     "fp8": max(mm / 2, (touched * (k * n + s[0].size * 4) + act)
                                / ceil["read_bytes_per_s"])}
            bf16 = jax.jit(lambda a, b, g: grouped_matmul(a, b, g, group_offset=E))
            fp8 = jax.jit(lambda a, b, c, g: grouped_matmul(a, b, g, group_offset=E, scale=c,
                                                            splits=splits))
            row = dict(op="experts", shape=shape, phase=phase, rows=rows,
                       backend=resolve("auto", rows),
                       bf16=seconds_per_call(bf16, x, wb, sizes) * 1e3,
                       fp8=seconds_per_call(fp8, x, q, s, sizes) * 1e3,
                       **{f"floor_{v}_ms": f * 1e3 for v, f in floor.items()})
            if row["backend"] == "mgpu":  # the alternatives the dispatch was chosen against
                fn = jax.jit(lambda a, b, c, g: grouped_matmul(a, b, g, group_offset=E, scale=c,
                                                               splits=splits, backend="pallas"))
                row["fp8 pallas"] = seconds_per_call(fn, x, q, s, sizes) * 1e3
                err, ok = _err(fn(x, q, s, sizes), np.asarray(fp8(x, q, s, sizes), np.float64))
                print(f"  agree fp8 pallas: {err:.1e} {'ok' if ok else 'FAIL'}")
                fn = jax.jit(lambda a, b, c, g: grouped_matmul(
                    a, dequantized_groups(b, c, E, E, a.dtype, splits), g, backend="mgpu"))
                row["fp8 dequantised"] = seconds_per_call(fn, x, q, s, sizes) * 1e3
            for cfg in (EXPERT_SWEEP if sweep and row["backend"] == "pallas" else ()):
                name = "fp8 bn{bn} bk{bk} st{stages}".format(**cfg)
                fn = jax.jit(lambda a, b, c, g, cfg=cfg: grouped_matmul_pallas(
                    a, b, g, E, c, splits, config=cfg))
                row[name] = seconds_per_call(fn, x, q, s, sizes) * 1e3
                err, ok = _err(fn(x, q, s, sizes), np.asarray(fp8(x, q, s, sizes), np.float64))
                print(f"  agree {name}: {err:.1e} {'ok' if ok else 'FAIL'}")
            out.append(row)
            _report(f"experts {shape:8s} {phase:12s} ({row['backend']})", row)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time the FP8 tiles of SWEEP")
    a = p.parse_args(argv)
    rng = np.random.default_rng(0)
    result = {"device": jax.devices()[0].device_kind, "checks": check(rng)}
    if not a.check_only:
        result["ceilings"] = ceil = measure_ceilings(2 << 30, 8192)
        print(f"read {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s, bf16 matmul "
              f"{ceil['matmul_flops_per_s'] / 1e12:.0f} TFLOP/s", flush=True)
        rows = dense_timings(ceil, a.sweep) + expert_timings(rng, ceil, a.sweep)
        result["timings"] = rows
        print("\n| op | shape | rows | bf16 ms | FP8 ms | speed-up | FP8 floor ms | "
              "FP8 % of floor |")
        print("|---|---|---|---|---|---|---|---|")
        for r in rows:
            print(f"| {r['op']} | {r['shape']} | {r['rows']} | {r['bf16']:.4f} | {r['fp8']:.4f}"
                  f" | {r['bf16'] / r['fp8']:.2f}x | {r['floor_fp8_ms']:.4f} | "
                  f"{r['floor_fp8_ms'] / r['fp8']:.0%} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    if not all(c["ok"] for c in result["checks"]):
        raise SystemExit("FP8 matmul check FAILED")


if __name__ == "__main__":
    main()
