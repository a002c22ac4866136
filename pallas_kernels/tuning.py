"""Per-architecture tile / pipeline tables for the Pallas GPU kernels.

Keys are CUDA compute-capability families: "sm90" (Hopper: H100/H200),
"sm100" (Blackwell B200/B300/GB200).  A new architecture needs a table entry,
not new kernel code.  "default" covers anything else (and CPU interpret mode,
where the values only set the tiling the interpreter walks).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

# GDN chunked prefill: bv = V tile of the state kept per program (state tile
# [dk, bv] fp32), warps / stages for the intra-chunk and main kernels (gdn/pallas_triton.py:
# the 64x64 inverse by doubling on two 32x32 blocks, w and u written in the input dtype;
# tf32 products for 16-bit inputs, IEEE fp32 for float32 inputs).
# main: "triton" (the Pallas Triton launches above) or "mgpu" (gdn/mgpu.py: Mosaic GPU
# intra and sequential launches, wgmma + TMA, sm90, 16-bit inputs; bv_mgpu its V tile,
# 128 bytes of the input dtype; pair_mgpu_from: the (sequence x value head) count from
# which a CTA of the sequential launch walks both V tiles of a head, None for never).
_PREFILL_BASE = dict(bv=32, intra_warps=4, intra_stages=2, main_warps=4, main_stages=2,
                     main="triton", bv_mgpu=64, pair_mgpu_from=None)
GDN_PREFILL = {
    # H200: the Mosaic GPU pair is faster than the best Triton pair (bv 32) at
    # 1x8192 Hk16 Hv64 (bench/RESULTS.md, "GDN kernels": prefill); the
    # Triton launches serve float32 inputs, other head sizes and interpret mode.
    # H100, Hk16 dk = dv = 128: a CTA walking both V tiles of a head takes the
    # sequential launch 25-31 % under a CTA per V tile from 128 (sequence x head)
    # chains (2x4096 Hv64 to 16x4096 Hv64, 16x4096 Hv32), and 36-46 % over it at
    # 32 and 64 (1x8192 Hv32, Hv64), where a CTA per V tile leaves fewer SMs idle
    "sm90": dict(_PREFILL_BASE, main="mgpu", pair_mgpu_from=128),
    # Blackwell: unmeasured; the Hopper entry without the wgmma kernels
    "sm100": dict(_PREFILL_BASE),
    "default": dict(_PREFILL_BASE),
}

# GDN decode: state tile [dk, bv] per program, by the state's bytes per element; mma:
# the two sums over dk as one tensor-core product (16-bit states only); programs_per_sm:
# a grid of that many programs an SM, each looping over its rows so that Triton
# prefetches the next row's tile (None: a program a row).
# H200 (bench/RESULTS.md, "GDN kernels": decode): fp32 states take bv 64 / 4 warps, the best
# tile, at 83-85 % of a pool-sized copy, where the row loop gains nothing; bf16 states
# take the product (transposed, the update packed) at bv 128 / 4 warps, ahead of bv 64
# and 8 warps, and the row loop at 3 programs an SM with 2 stages, 83-90 % of the copy
_DECODE = {4: dict(bv=64, warps=4, stages=2, mma=False, programs_per_sm=None),
           2: dict(bv=128, warps=4, stages=2, mma=True, programs_per_sm=3)}
GDN_DECODE = {"sm90": _DECODE, "sm100": _DECODE, "default": _DECODE}

# causal conv1d: token block bt x channel block bc.
CONV1D = {
    "sm90": dict(bt=32, bc=256, warps=4, stages=2, update_bc=512),
    "sm100": dict(bt=32, bc=256, warps=4, stages=2, update_bc=512),
    "default": dict(bt=32, bc=256, warps=4, stages=2, update_bc=512),
}

# Paged attention (pallas_kernels/attention/pallas_triton.py).  prefill: bm query
# rows per program (tokens x the GQA group padded to a power of two), bk keys
# per inner step.  decode: one token per program, the group padded to 16 rows;
# the key range is split over programs until there are about min_programs of
# them (at most max_splits per row), or exactly "splits" if given.  "f32":
# overrides for float32 inputs, whose tiles take twice the shared memory
# (hd 256: a 64-key fp32 K or V tile is 64 KB, four of them exceed the 228 KB).
_ATTN_PREFILL = dict(bm=128, bk=64, warps=8, stages=3, f32=dict(bm=64, bk=32, stages=2))
_ATTN_DECODE = dict(bk=64, warps=4, stages=2, min_programs=264, max_splits=16,
                    f32=dict(bk=32))
ATTENTION = {
    # H200 (bench/RESULTS.md, "Paged attention"): prefill at 3 stages is the best tile
    # (~305 TFLOP/s at 1x8192); decode keeps bk 64: bk 32 with 3-4 stages gains 10-15 %
    # on long contexts but is 2x slower at 64 sequences of 1024 tokens
    "sm90": dict(prefill=dict(_ATTN_PREFILL), decode=dict(_ATTN_DECODE)),
    # Blackwell: unmeasured; the Hopper entry
    "sm100": dict(prefill=dict(_ATTN_PREFILL), decode=dict(_ATTN_DECODE)),
    # CPU interpret mode: small tiles so the tests walk several key tiles
    "default": dict(prefill=dict(bm=32, bk=16, warps=4, stages=2),
                    decode=dict(bk=16, warps=4, stages=2, min_programs=8, max_splits=4)),
}

# MoE grouped matmul (pallas_kernels/grouped_matmul/pallas_triton.py): "tiles" per
# routed-row count (bm rows x bn columns per program, bk of K per inner step; "fp8":
# what W8A8 operands change), for rows up to each bound; "auto" takes the Mosaic GPU kernel (grouped_matmul/mgpu.py, wgmma:
# sm90 only) above "mgpu_above" rows, None for never.
_GMM_DECODE = dict(bm=16, bn=128, bk=64, warps=4, stages=3)
_GMM_MID = dict(bm=64, bn=128, bk=64, warps=4, stages=3)
GROUPED_MATMUL = {
    # H200 (bench/RESULTS.md, the Mosaic grouped matmul): 16-row tiles are within 10 % of the
    # best tile up to 2048 rows (256 sequences x top-8) and ahead of Mosaic there;
    # 64-row tiles from 4096 rows; the Mosaic kernel, reading the layer stack in place,
    # is faster above 8192 rows (2.2x at 65536)
    # W8A8: 128-deep e4m3 steps take 18-26 % less time than 64-deep ones at 16-256
    # sequences (H100, bench/RESULTS.md, the W8A8 experts)
    "sm90": dict(tiles=((2048, _GMM_DECODE), (None, _GMM_MID)), mgpu_above=8192,
                 fp8=dict(bk=128)),
    # Blackwell: unmeasured; the Hopper entry without the wgmma kernel
    "sm100": dict(tiles=((2048, _GMM_DECODE), (None, _GMM_MID)), mgpu_above=None),
    # CPU interpret mode: small tiles so the tests walk several row and K tiles
    "default": dict(tiles=((None, dict(bm=16, bn=16, bk=16, warps=4, stages=2)),),
                    mgpu_above=None),
}


# Stacked-layer matmul x @ w[layer] (pallas_kernels/layer_matmul): bn columns per
# program, bk of K per inner step, K split until there are min_programs programs;
# "auto" takes it up to max_rows rows (all rows live in one program's accumulator:
# 256 x 64 float32 is 128 registers a thread at 4 warps).
_LAYER_MM_GPU = dict(bn=64, bk=64, warps=4, stages=3, min_programs=132, max_rows=256)
LAYER_MATMUL = {
    # H200 (bench/RESULTS.md, dense weights read in place): no other tile is more than 8 %
    # faster (in_proj_qkv, 16 to 128 rows); at 256 rows the small shared-expert shapes
    # run faster sliced, the large ones in place.
    "sm90": dict(_LAYER_MM_GPU),
    "sm100": dict(_LAYER_MM_GPU),
    # CPU interpret mode: small tiles so the tests walk several column tiles and splits
    "default": dict(bn=16, bk=16, warps=4, stages=2, min_programs=8, max_rows=256),
}


@functools.lru_cache(maxsize=None)
def _first_gpu():
    try:
        devs = [d for d in jax.devices() if d.platform == "gpu"]
    except Exception:
        return None
    return devs[0] if devs else None


def gpu_arch() -> str | None:
    """'sm90', 'sm100', 'sm<cc>' for other NVIDIA GPUs, or None without one."""
    dev = _first_gpu()
    if dev is None:
        return None
    cc = getattr(dev, "compute_capability", None)
    if cc is None:
        return "sm_unknown"
    major, _, minor = str(cc).partition(".")
    return f"sm{major}{minor or '0'}"


def gpu_sm_count() -> int | None:
    """The first GPU's streaming multiprocessors, or None without one."""
    return getattr(_first_gpu(), "core_count", None)


def _family(arch):
    if arch is None:
        return "default"
    if arch.startswith("sm90"):
        return "sm90"
    if arch.startswith("sm10"):
        return "sm100"
    return "default"


def gdn_prefill_config(dv, arch=None):
    return GDN_PREFILL[_family(arch or gpu_arch())]


def gdn_decode_config(dv, state_dtype=jnp.float32, arch=None):
    table = GDN_DECODE[_family(arch or gpu_arch())]
    return table[min(jnp.dtype(state_dtype).itemsize, 4)]


def conv1d_config(arch=None):
    return CONV1D[_family(arch or gpu_arch())]


def attention_config(is_decode, dtype, arch=None):
    cfg = dict(ATTENTION[_family(arch or gpu_arch())]["decode" if is_decode else "prefill"])
    f32 = cfg.pop("f32", {})
    if jnp.dtype(dtype) == jnp.float32:
        cfg.update(f32)
    return cfg


def grouped_matmul_config(rows: int, fp8: bool = False, arch=None) -> dict:
    """The Pallas grouped matmul's tiles for `rows` routed rows (``fp8``: W8A8 operands)."""
    entry = GROUPED_MATMUL[_family(arch or gpu_arch())]
    for bound, tiles in entry["tiles"]:
        if bound is None or rows <= bound:
            return dict(tiles, **entry.get("fp8", {})) if fp8 else tiles
    raise AssertionError("every tile table ends with an unbounded entry")


def grouped_matmul_prefers_mgpu(rows: int, arch=None) -> bool:
    """Whether the Mosaic GPU kernel beats the Pallas one at `rows` routed rows."""
    above = GROUPED_MATMUL[_family(arch or gpu_arch())]["mgpu_above"]
    return above is not None and rows > above


def layer_matmul_config(arch=None) -> dict:
    """The stacked-layer matmul's tiles on this platform."""
    return LAYER_MATMUL[_family(arch or gpu_arch())]
