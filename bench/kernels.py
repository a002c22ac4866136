"""Benchmark + on-GPU correctness for the GDN / conv1d kernels, and the command
that also runs the paged-attention part: the driver over one module per kernel family
(bench/gdn_kernels.py, bench/conv_kernels.py, bench/attention_kernels.py with ``--parts
attention``), all on bench/harness.py.

    python -m bench.kernels [--quick] [--parts check,prefill,decode,conv,attention]
                            [--variants] [--profile] [--prefill-configs JSON]
                            [--decode-configs JSON] [--no-fla]
                            [--prefill-shapes 1x8192,1x32768,16x4096]
                            [--out DIR]

Order: environment, ceilings (copy bandwidth, bf16 matmul, measured here),
float64-oracle checks of every Pallas kernel on the GPU (with the test suite's
``gpu``-marked tests), then for each shape
our kernel and FLA (``fla.ops.gated_delta_rule``) on the same inputs: a
correctness comparison first, then the timings.  Prefill shapes of one sequence
length are timed twice: packed with cu_seqlens (the serving path) and batched as FLA
is called, without cu_seqlens.  JAX timings: median over
reps of (n back-to-back calls / n), n chosen so a sample lasts >= 20 ms; FLA:
``triton.testing.do_bench`` median.  Results are printed as a table and
written as JSON to --out (default $OUT or ./out).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

from bench import harness  # first: it sets the allocator's environment before jax starts
from bench import conv_kernels, gdn_kernels
from bench.harness import RESULTS, ceilings, log, save, summary

import numpy as np

import jax

from pallas_kernels.tuning import gpu_arch


def gpu_tests():
    """The suite's tests of the kernels only a GPU runs (``pytest -m gpu``), here, natively;
    their verdict joins the checks. Only the files that hold such tests are collected: the
    others import what a GPU image need not have (the API client, the notebook runner)."""
    import glob

    import pytest

    repo = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    files = [f for f in sorted(glob.glob(os.path.join(repo, "tests", "test_*.py")))
             if "pytest.mark.gpu" in open(f).read()]
    log("== the test suite's gpu-marked tests:", ", ".join(map(os.path.basename, files)), "==")
    code = pytest.main(["-q", "-m", "gpu", "-p", "no:cacheprovider", *files])
    RESULTS["checks"].append(dict(name="pytest -m gpu tests", rel_err=float(code), tol=0.0,
                                  ok=code == 0))
    log(f"  pytest -m gpu tests: exit {int(code)} ({'ok' if code == 0 else 'FAIL'})")




def small_checks():
    log("== float64-oracle checks on the GPU (backend=pallas) ==")
    rng = np.random.default_rng(int(time.time()))
    key = jax.random.key(int(rng.integers(1 << 30)))
    gdn_kernels.gdn_checks(rng, key)
    conv_kernels.conv_checks(rng)
    save()


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--parts", default="check,prefill,decode,conv")
    ap.add_argument("--variants", action="store_true")
    ap.add_argument("--prefill-configs", type=json.loads, default=None,
                    help='JSON list of prefill configs to check and time (null = default)')
    ap.add_argument("--decode-configs", type=json.loads, default=None,
                    help='JSON list of decode configs to check and time on every shape and '
                         'state width (null = default; each a partial tuning entry, e.g. '
                         '{"programs_per_sm": 2, "stages": 3})')
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--prefill-shapes", default=None,
                    help="comma-separated prefill shape names to time (1x8192, 1x32768, "
                         "16x4096); default all")
    ap.add_argument("--profile", action="store_true",
                    help="per-kernel device time: prefill, of each config --variants "
                         "times; decode, of the default config beside a pool-sized copy")
    ap.add_argument("--out", default=os.environ.get("OUT", "out"))
    ap.add_argument("--backend", default="pallas", help="interpret: CPU dry run")
    ap.add_argument("--tiny", action="store_true", help="tiny shapes (CPU dry run)")
    a = ap.parse_args(argv)
    harness.BACKEND, harness.TINY, harness.PROFILE = a.backend, a.tiny, a.profile
    if a.prefill_configs is not None:
        gdn_kernels.PREFILL_CFGS = a.prefill_configs
    gdn_kernels.DECODE_CFGS = a.decode_configs
    harness.OUTDIR = a.out
    os.makedirs(a.out, exist_ok=True)
    parts = a.parts.split(",")
    log(f"jax {jax.__version__}, devices {jax.devices()}, arch {gpu_arch()}, "
        f"date {time.strftime('%Y-%m-%d %H:%M:%S', time.gmtime())} UTC")
    RESULTS["env"] = dict(jax=jax.__version__, devices=str(jax.devices()), arch=gpu_arch(),
                          argv=sys.argv)
    try:
        import triton
        import torch
        log(f"torch {torch.__version__}, triton {triton.__version__}")
    except Exception as e:  # noqa: BLE001
        log("torch/triton import:", e)
    ceilings(a.quick)
    if "check" in parts:
        small_checks()
        gpu_tests()
    if "prefill" in parts:
        gdn_kernels.prefill_bench(a.quick, a.variants, not a.no_fla,
                      a.prefill_shapes.split(",") if a.prefill_shapes else None)
    if "decode" in parts:
        gdn_kernels.decode_bench(a.quick, a.variants, not a.no_fla)
    if "conv" in parts:
        conv_kernels.conv_bench(a.quick)
    if "attention" in parts:
        from bench.attention_kernels import attention_bench, attention_checks

        attention_checks()
        attention_bench(a.variants)
    summary()
    save()


if __name__ == "__main__":
    main()
