"""Stacked-layer matmul on the GPU: check the Pallas kernel, then time it inside a layer
scan against what the scan did before (slice the layer, then XLA's GEMM).

    python -m bench.layer_matmul [--check-only] [--sweep] [--json FILE]

Check: ``layer_matmuls(..., backend="pallas")`` against float32 ``x @ w[layer]`` in float64
for row counts off a power of two and every dense shape below alone, and for each
projection group of GROUPS in one launch; ||out - ref|| / ||ref|| under 1e-2 (bf16
output rounding ~4e-3), every entry finite.

Timing: the 35B-A3B dense shapes (GDN in_proj_qkv / in_proj_z / out_proj, attention
q_proj / o_proj, shared-expert gate / up / down) at decode row counts, weights stacked
over LAYERS layers; each variant is a ``lax.scan`` over the layers computing x @ w[i]
(summed, so nothing is dead), per layer = total / LAYERS: "pallas" reads each layer in
place, "reference" slices it (XLA materialises the slice inside the loop) and runs XLA's
GEMM; ``--sweep`` adds the Pallas kernel with each tile setting of SWEEP. The projection
groups (the Linears the model runs on one x) are timed the same way: in one launch
(``layer_matmuls``) against a launch a weight. Floor: one read of the layer's weights at
the measured read bandwidth.
"""

import argparse
import json

import numpy as np

import jax
import jax.numpy as jnp

from bench.roofline import measure_ceilings
from bench.timing import seconds_per_call
from pallas_kernels.layer_matmul import layer_matmul, layer_matmul_pallas, layer_matmuls
from pallas_kernels.tuning import layer_matmul_config

LAYERS = 30
SHAPES = {"in_proj_qkv": (2048, 8192), "in_proj_z": (2048, 4096), "out_proj": (4096, 2048),
          "q_proj": (2048, 8192), "shared_gate": (2048, 512), "shared_down": (512, 2048)}
ROWS = (16, 64, 128, 256)
# The 35B-A3B projections of one x (qwen35_jax.layers: ``project``), K -> each N; the
# shared-expert gate (1 column) fits no tile and is sliced beside them.
GROUPS = {"gdn qkv+z+b+a": (2048, (8192, 4096, 32, 32)), "attn q+k+v": (2048, (8192, 512, 512)),
          "router+shared gate+up": (2048, (256, 512, 512))}
SWEEP = [dict(bn=bn, bk=bk, stages=st, warps=w, min_programs=p, max_rows=256)
         for bn, bk, st, w, p in ((64, 64, 3, 4, 132), (128, 64, 3, 4, 132), (64, 128, 3, 4, 132),
                                  (32, 128, 4, 4, 132), (64, 64, 4, 4, 264), (64, 64, 3, 8, 132),
                                  (128, 128, 3, 8, 264))]


def _agreement(x, ws, got, layer) -> tuple[float, bool]:
    """The largest ||out - ref|| / ||ref|| over the products ``got`` of x and each
    ``w[layer]`` (ref in float64), and whether it is under 1e-2 with every entry finite."""
    errs, finite = [], True
    for w, g in zip(ws, got):
        g = np.asarray(g, np.float64)
        ref = np.asarray(x, np.float64) @ np.asarray(w[layer], np.float64)
        errs.append(float(np.linalg.norm(g - ref) / np.linalg.norm(ref)))
        finite = finite and bool(np.isfinite(g).all())
    return max(errs), finite and max(errs) < 1e-2


def check(rng) -> list[dict]:
    out = []
    cases = [(f"{name:12s}", name, rows, k, (n,)) for name, (k, n) in SHAPES.items()
             for rows in (5, 100, 256)]
    cases += [(f"{name} (one launch)", name, 100, k, ns) for name, (k, ns) in GROUPS.items()]
    for label, name, rows, k, ns in cases:
        x = jnp.asarray(rng.standard_normal((rows, k)) * 0.5, jnp.bfloat16)
        ws = [jnp.asarray(rng.standard_normal((3, k, n)) * 0.05, jnp.bfloat16) for n in ns]
        got = jax.jit(lambda a, b: layer_matmuls(a, b, 2, backend="pallas"))(x, ws)
        err, ok = _agreement(x, ws, got, 2)
        out.append(dict(shape=name, rows=rows, rel_err=err, ok=ok))
        print(f"check {label} rows {rows:4d}: rel err {err:.2e} {'ok' if ok else 'FAIL'}",
              flush=True)
    return out


def _scan(matmul):
    """A jitted scan over the stack's layers of ``matmul(x, w, i)``, summed."""
    def run(x, w):
        def body(acc, i):
            return acc + jnp.sum(matmul(x, w, i), dtype=jnp.float32), None
        layers = (w[0] if isinstance(w, list) else w).shape[0]
        return jax.lax.scan(body, jnp.float32(0), jnp.arange(layers))[0]
    return jax.jit(run)


def _variants(sweep):
    """(name, matmul) timed per shape: both backends, then the tiles of SWEEP."""
    yield "pallas", lambda x, w, i: layer_matmul(x, w, i, backend="pallas")
    yield "reference", lambda x, w, i: layer_matmul(x, w, i, backend="reference")
    for cfg in (SWEEP if sweep else ()):
        if cfg == layer_matmul_config():
            continue  # timed above as "pallas"
        name = "bn{bn} bk{bk} st{stages} w{warps} p{min_programs}".format(**cfg)
        yield name, lambda x, w, i, cfg=cfg: layer_matmul_pallas(x, [w], i, config=cfg)[0]


def timings(ceil, sweep=False) -> list[dict]:
    out = []
    for name, (k, n) in SHAPES.items():
        w = jax.random.normal(jax.random.key(1), (LAYERS, k, n), jnp.bfloat16) * 0.05
        floor = k * n * 2 / ceil["read_bytes_per_s"]
        for rows in ROWS:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            row = dict(shape=name, rows=rows, floor_ms=floor * 1e3)
            for variant, matmul in _variants(sweep):
                try:
                    row[variant] = seconds_per_call(_scan(matmul), x, w) / LAYERS * 1e3
                except Exception as e:  # a swept tile that does not fit (shared memory)
                    if not variant.startswith("bn"):
                        raise
                    print(f"{name} rows {rows} {variant}: {type(e).__name__}: {str(e)[:160]}",
                          flush=True)
            if sweep:
                print(f"{name:12s} rows {rows:4d} sweep: " + ", ".join(
                    f"{v} {row[v]:.4f}" for v in row if v.startswith("bn")), flush=True)
            out.append(row)
            print(f"{name:12s} rows {rows:4d}  pallas {row['pallas']:.4f} ms  xla (slice + "
                  f"GEMM) {row['reference']:.4f} ms  floor {floor * 1e3:.4f} ms  "
                  f"({floor * 1e3 / row['pallas']:.0%} of floor)", flush=True)
    return out


def group_timings(ceil) -> list[dict]:
    """Each projection group in one launch against a launch a weight, per layer."""
    out = []
    for name, (k, ns) in GROUPS.items():
        ws = [jax.random.normal(jax.random.key(j), (LAYERS, k, n), jnp.bfloat16) * 0.05
              for j, n in enumerate(ns)]
        floor = k * sum(ns) * 2 / ceil["read_bytes_per_s"]
        variants = {
            "one launch": lambda x, w, i: sum(jnp.sum(o, dtype=jnp.float32) for o in
                                              layer_matmuls(x, w, i, backend="pallas")),
            "a launch each": lambda x, w, i: sum(
                jnp.sum(layer_matmul(x, wj, i, backend="pallas"), dtype=jnp.float32)
                for wj in w)}
        for rows in ROWS:
            x = jax.random.normal(jax.random.key(rows), (rows, k), jnp.bfloat16)
            row = dict(group=name, rows=rows, floor_ms=floor * 1e3)
            for variant, fn in variants.items():
                row[variant] = seconds_per_call(_scan(fn), x, ws) / LAYERS * 1e3
            out.append(row)
            print(f"{name:22s} rows {rows:4d}  one launch {row['one launch']:.4f} ms  a launch "
                  f"each {row['a launch each']:.4f} ms  floor {floor * 1e3:.4f} ms", flush=True)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--json", default=None)
    p.add_argument("--check-only", action="store_true")
    p.add_argument("--sweep", action="store_true", help="also time the tiles of SWEEP")
    a = p.parse_args(argv)
    result = {"device": jax.devices()[0].device_kind,
              "checks": check(np.random.default_rng(0))}
    if not a.check_only:
        result["ceilings"] = ceil = measure_ceilings(2 << 30, 8192)
        print(f"read {ceil['read_bytes_per_s'] / 1e12:.2f} TB/s", flush=True)
        result["timings"] = timings(ceil, a.sweep)
        print("\n| shape | K -> N | rows | pallas ms | xla (slice + GEMM) ms | floor ms |")
        print("|---|---|---|---|---|---|")
        for r in result["timings"]:
            k, n = SHAPES[r["shape"]]
            print(f"| {r['shape']} | {k} -> {n} | {r['rows']} | {r['pallas']:.4f} | "
                  f"{r['reference']:.4f} | {r['floor_ms']:.4f} |")
        result["groups"] = group_timings(ceil)
        print("\n| projections | rows | one launch ms | a launch each ms | floor ms |")
        print("|---|---|---|---|---|")
        for r in result["groups"]:
            print(f"| {r['group']} | {r['rows']} | {r['one launch']:.4f} | "
                  f"{r['a launch each']:.4f} | {r['floor_ms']:.4f} |")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(result, f, indent=2)
    if not all(c["ok"] for c in result["checks"]):
        raise SystemExit("layer matmul check FAILED")


if __name__ == "__main__":
    main()
