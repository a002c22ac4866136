"""Pallas (Triton-flavoured) prefill kernel bodies for the gated delta rule.

The same bodies run on an NVIDIA GPU through the Pallas Triton backend
(`pl.pallas_call(..., compiler_params=plt.CompilerParams(...))`) and on the CPU
in interpret mode (`interpret=True`), which is how the CPU test suite checks
them.

Prefill is two launches (tiles chosen by ``tuning.GDN_PREFILL``):

1. ``_intra32_kernel``, grid (chunk, value head), fully parallel over the chunk
   table: chunk-local cumulative gate gamma, the strictly lower matrix
   A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j) (i > j) and T = (I + A)^-1 by
   recursive doubling on its two 32x32 diagonal blocks (``_doubling_inverse``)
   plus T_ba = -T_bb A_ba T_aa; products in tf32 for 16-bit inputs, IEEE fp32 for
   float32 inputs.  It writes w = M (e^gamma K) and u = M V, M = T diag(beta), in
   the input dtype.
2. ``_main_kernel``, grid (sequence, value head, V tile): one program walks its
   sequence's chunks keeping the fp32 state tile [dk, BV] in registers:
      Vd = u - w S
      O  = scale (e^gamma * (Q S) + ((Q K^T) . e^{gamma_i - gamma_j} [i >= j]) Vd)
      S  = e^{gamma_C} S + (e^{gamma_C - gamma} * K)^T Vd
   (the v_new = T diag(beta) (V - e^gamma K S) form of FlashInfer / FlashQLA).
   The last sequence's programs also zero the padding rows past cu[N].

On sm90, 16-bit inputs take the Mosaic GPU pair in ``mgpu.py`` instead (config
main="mgpu", the table's default there): the same two launches with wgmma and TMA.

The decode kernel is in ``pallas_triton_decode.py``.

Out-of-bounds dynamic slices clamp in interpret mode, so the wrappers pad the
token axis by one chunk there (on the GPU, masked loads/stores never touch
memory past the end).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

try:  # Pallas Triton backend (deprecated from jax 0.11, still shipped)
    from jax.experimental.pallas import triton as plt
except Exception:  # pragma: no cover
    plt = None

from . import mgpu
from .reference import (CHUNK, chunk_table, distinct_snapshot_ends, locate_snapshots,
                        normalize_cu_seqlens, _check_shapes, _default_scale)

_HI = lax.Precision.HIGHEST


def _load(ref, mask=None, other=None):
    if plt is not None:
        return plt.load(ref, mask=mask, other=other)
    return ref[...]


def _store(ref, val, mask=None):
    if plt is not None:
        plt.store(ref, val, mask=mask)
    else:  # pragma: no cover
        ref[...] = val


def _mm(a, b, *, ta=False, tb=False, mm_dtype=jnp.float32):
    """2-D matmul, fp32 accumulation.  mm_dtype bf16 -> tensor-core operands;
    float32 -> IEEE fp32."""
    a = a.astype(mm_dtype)
    b = b.astype(mm_dtype)
    prec = _HI if mm_dtype == jnp.float32 else None
    dn = (((0 if ta else 1,), (1 if tb else 0,)), ((), ()))
    return lax.dot_general(a, b, dn, precision=prec,
                           preferred_element_type=jnp.float32)


def _compiler_params(num_warps, num_stages):
    if plt is None:
        return None
    return plt.CompilerParams(num_warps=num_warps, num_stages=num_stages)


def _rsqrt_norm(x):
    return x * lax.rsqrt(jnp.sum(x * x, axis=1, keepdims=True) + 1e-6)


# ----------------------------------------------------------------------------
# prefill kernel 1: intra-chunk inverse
# ----------------------------------------------------------------------------
def _inv_prec(mm_dtype):
    # 16-bit inputs: tf32 tensor-core products for the inverse; fp32 inputs: IEEE
    return _HI if mm_dtype == jnp.float32 else lax.Precision.DEFAULT


def _doubling_inverse(A, ri, ci, prec):
    """(I + A)^-1 for strictly lower A [n, n] (n a power of two) by recursive doubling
    of the diagonal blocks: D_s = T's block-diagonal part in s-row blocks, B_s = A's
    part below the diagonal inside each 2s block, D_2s = D_s - D_s B_s D_s (T_ba =
    -T_bb A_ba T_aa); B_s D_s is computed as A D_s kept on B_s's blocks (D_s is block
    diagonal), as the Mosaic GPU intra kernel (gdn/mgpu_intra.py) does. Its products have
    moderate entries, where the product form (I+N)(I+N^2)(I+N^4)..., N = -A, builds
    powers of A with entries ~1e7 for keys sharing a direction and loses every digit to
    cancellation (bench/RESULTS.md)."""
    dn = (((1,), (0,)), ((), ()))
    mm = lambda a, b: lax.dot_general(a, b, dn, precision=prec,
                                      preferred_element_type=jnp.float32)
    D = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(ri // 2 == ci // 2, A, 0.0)
    blk = 2
    while blk < A.shape[0]:
        Y = jnp.where((ri // (2 * blk) == ci // (2 * blk)) & (ri // blk != ci // blk),
                      mm(A, D), 0.0)
        D = D - mm(D, Y)
        blk *= 2
    return D


def _intra32_kernel(start_ref, len_ref, k_ref, v_ref, g_ref, b_ref, w_ref, u_ref, gam_ref, *,
                    ratio, use_l2, mm_dtype):
    """Intra-chunk part with the 64x64 inverse split in two 32-row blocks:
    T_aa, T_bb by recursive doubling on 32x32 (``_doubling_inverse``), then
    T_ba = -T_bb A_ba T_aa; writes w = M (e^gamma * K) [64,dk] and u = M V [64,dv]."""
    c = pl.program_id(0)
    h = pl.program_id(1)
    hk = h // ratio
    H = CHUNK // 2
    start = start_ref[c]
    n = len_ref[c]
    dk = k_ref.shape[-1]
    rk = lax.broadcasted_iota(jnp.int32, (H, dk), 0)
    pos = lax.broadcasted_iota(jnp.int32, (H,), 0)

    def load_half(off):
        km = (rk + off) < n
        k = _load(k_ref.at[pl.ds(start + off, H), hk, :], mask=km, other=0.0).astype(jnp.float32)
        if use_l2:
            k = _rsqrt_norm(k)
        vm = (pos + off) < n
        g = _load(g_ref.at[pl.ds(start + off, H), h], mask=vm, other=0.0).astype(jnp.float32)
        b = _load(b_ref.at[pl.ds(start + off, H), h], mask=vm, other=0.0).astype(jnp.float32)
        return k, jnp.where(vm, g, 0.0), jnp.where(vm, b, 0.0)

    ka, ga, ba = load_half(0)
    kb, gb, bb = load_half(H)
    gam_a = jnp.cumsum(ga, axis=0)
    gam_b = jnp.cumsum(gb, axis=0) + jnp.sum(ga)
    ri = lax.broadcasted_iota(jnp.int32, (H, H), 0)
    ci = lax.broadcasted_iota(jnp.int32, (H, H), 1)
    strict = ri > ci

    def diag_block(k, gam, b):
        kk = _mm(k, k, tb=True, mm_dtype=mm_dtype)
        d = jnp.where(strict, gam[:, None] - gam[None, :], 0.0)
        return jnp.where(strict, kk * jnp.exp(d) * b[:, None], 0.0)

    A_aa = diag_block(ka, gam_a, ba)
    A_bb = diag_block(kb, gam_b, bb)
    A_ba = _mm(kb, ka, tb=True, mm_dtype=mm_dtype) * jnp.exp(
        gam_b[:, None] - gam_a[None, :]) * bb[:, None]
    prec = _inv_prec(mm_dtype)
    T_aa = _doubling_inverse(A_aa, ri, ci, prec)
    T_bb = _doubling_inverse(A_bb, ri, ci, prec)
    dn = (((1,), (0,)), ((), ()))
    mmp = lambda a, b: lax.dot_general(a, b, dn, precision=prec,
                                       preferred_element_type=jnp.float32)
    T_ba = -mmp(T_bb, mmp(A_ba, T_aa))
    M_aa = T_aa * ba[None, :]
    M_ba = T_ba * ba[None, :]
    M_bb = T_bb * bb[None, :]
    dv = v_ref.shape[-1]
    rv = lax.broadcasted_iota(jnp.int32, (H, dv), 0)
    va = _load(v_ref.at[pl.ds(start, H), h, :], mask=rv < n, other=0.0)
    vb = _load(v_ref.at[pl.ds(start + H, H), h, :], mask=(rv + H) < n, other=0.0)
    kga = ka * jnp.exp(gam_a)[:, None]
    kgb = kb * jnp.exp(gam_b)[:, None]
    mm = functools.partial(_mm, mm_dtype=mm_dtype)
    d = w_ref.dtype
    w_ref[c, h, pl.ds(0, H), :] = mm(M_aa, kga).astype(d)
    w_ref[c, h, pl.ds(H, H), :] = (mm(M_ba, kga) + mm(M_bb, kgb)).astype(d)
    u_ref[c, h, pl.ds(0, H), :] = mm(M_aa, va).astype(d)
    u_ref[c, h, pl.ds(H, H), :] = (mm(M_ba, va) + mm(M_bb, vb)).astype(d)
    gam_ref[c, h, pl.ds(0, H)] = gam_a
    gam_ref[c, h, pl.ds(H, H)] = gam_b


# ----------------------------------------------------------------------------
# prefill kernel 2: sequential state pass + output
# ----------------------------------------------------------------------------
def _main_kernel(cu_ref, sfirst_ref, snch_ref, start_ref, len_ref, emit_ref,
                 q_ref, k_ref, u_ref, w_ref, gam_ref, init_ref,
                 o_ref, fin_ref, *snap_ref, ratio, use_l2, scale, mm_dtype, bv,
                 has_init, n_seq, total_rows):
    """u_ref = u [C,Hv,64,dv], w_ref = w [C,Hv,64,dk] (the intra launch's).
    With snapshots (snap_ref [S,Hv,dk,dv]), the state after a chunk whose ``emit`` is
    a row is stored there too: the walk passes every snapshot end (the chunk table
    ends chunks at them), so no second pass computes them."""
    s = pl.program_id(0)
    h = pl.program_id(1)
    iv = pl.program_id(2)
    hk = h // ratio
    L = CHUNK
    dk = q_ref.shape[-1]
    v0 = iv * bv
    if has_init:
        S0 = init_ref[s, h, :, pl.ds(v0, bv)].astype(jnp.float32)
    else:
        S0 = jnp.zeros((dk, bv), jnp.float32)
    c0 = sfirst_ref[s]
    nc = snch_ref[s]
    rows_k = lax.broadcasted_iota(jnp.int32, (L, dk), 0)
    rows_v = lax.broadcasted_iota(jnp.int32, (L, bv), 0)
    pos = lax.broadcasted_iota(jnp.int32, (L,), 0)
    ri = lax.broadcasted_iota(jnp.int32, (L, L), 0)
    ci = lax.broadcasted_iota(jnp.int32, (L, L), 1)
    causal = ri >= ci

    def body(c, S):
        start = start_ref[c]
        n = len_ref[c]
        km = rows_k < n
        vm = rows_v < n
        q = _load(q_ref.at[pl.ds(start, L), hk, :], mask=km, other=0.0).astype(jnp.float32)
        k = _load(k_ref.at[pl.ds(start, L), hk, :], mask=km, other=0.0).astype(jnp.float32)
        if use_l2:
            q = _rsqrt_norm(q)
            k = _rsqrt_norm(k)
        q = q * scale
        gam = gam_ref[c, h, :]
        eg = jnp.exp(gam)
        gl = jnp.sum(jnp.where(pos == L - 1, gam, 0.0))
        u = u_ref[c, h, :, pl.ds(v0, bv)].astype(jnp.float32)
        vd = u - _mm(w_ref[c, h, :, :], S, mm_dtype=mm_dtype)
        qs = _mm(q, S, mm_dtype=mm_dtype)
        qk = _mm(q, k, tb=True, mm_dtype=mm_dtype)
        p = jnp.where(causal, qk * jnp.exp(jnp.where(causal, gam[:, None] - gam[None, :], 0.0)), 0.0)
        o = eg[:, None] * qs + _mm(p, vd, mm_dtype=mm_dtype)
        _store(o_ref.at[pl.ds(start, L), h, pl.ds(v0, bv)], o.astype(o_ref.dtype), mask=vm)
        kd = k * jnp.exp(gl - gam)[:, None]
        S = jnp.exp(gl) * S + _mm(kd, vd, ta=True, mm_dtype=mm_dtype)
        if snap_ref:
            row = emit_ref[c]

            @pl.when(row >= 0)
            def _():
                snap_ref[0][jnp.maximum(row, 0), h, :, pl.ds(v0, bv)] = S
        return S

    S = lax.fori_loop(c0, c0 + nc, body, S0)
    fin_ref[s, h, :, pl.ds(v0, bv)] = S

    # the last sequence's programs zero the padding rows [cu[N], total_rows)
    @pl.when(s == n_seq - 1)
    def _():
        pad0 = cu_ref[n_seq]
        npad = (total_rows - pad0 + L - 1) // L

        def zbody(i, carry):
            st = pad0 + i * L
            m = rows_v < (total_rows - st)
            _store(o_ref.at[pl.ds(st, L), h, pl.ds(v0, bv)],
                   jnp.zeros((L, bv), o_ref.dtype), mask=m)
            return carry

        lax.fori_loop(0, npad, zbody, 0)


def _pad_rows(x, n):
    return jnp.concatenate([x, jnp.zeros((n,) + x.shape[1:], x.dtype)], 0)


# config keys that only the Triton kernels read
_TRITON_KEYS = {"bv", "intra_warps", "intra_stages", "main_warps", "main_stages"}


def gdn_prefill_pallas(q, k, v, g, beta, *, scale=None, initial_state=None,
                       cu_seqlens=None, output_final_state=True,
                       use_qk_l2norm=False, snapshot_ends=None, interpret=False,
                       config=None, _only_intra=False):
    """Pallas prefill.  Same interface / semantics as ``gdn_prefill``.
    (_only_intra: stop after the first launch; for timing the parts.)"""
    from ..tuning import gdn_prefill_config
    B, T, Hk, Hv, dk, dv = _check_shapes(q, k, v, g, beta)
    scale = _default_scale(scale, dk)
    cfg = dict(gdn_prefill_config(dv))
    if config:
        if "main" not in config and set(config) & _TRITON_KEYS and cfg["main"] != "triton":
            raise ValueError(f"config {config} sets keys of the Triton kernels while this "
                             f"platform's default is main={cfg['main']!r}: add "
                             f"main='triton'")
        unknown = set(config) - set(cfg)
        if unknown:
            raise ValueError(f"unknown GDN prefill config keys {sorted(unknown)}")
        cfg.update(config)
    bv = min(cfg["bv"], dv)
    if dv % bv:
        bv = dv
    cu, N = normalize_cu_seqlens(B, T, cu_seqlens)
    TT = B * T
    qf = q.reshape(TT, Hk, dk)
    kf = k.reshape(TT, Hk, dk)
    vf = v.reshape(TT, Hv, dv)
    gf = g.reshape(TT, Hv).astype(jnp.float32)
    bf = beta.reshape(TT, Hv).astype(jnp.float32)
    # The Mosaic GPU kernels (gdn/mgpu.py) take 16-bit operands of whole 64-element
    # tiles on the GPU, and unit keys (their inverse runs in float16); float32 inputs
    # (IEEE fp32 products), other head sizes, keys not normalised here and interpret
    # mode keep the Triton ones.
    if (cfg["main"] == "mgpu" and not interpret and use_qk_l2norm
            and mgpu.takes(q, k, v, cfg["bv_mgpu"])):
        v_tiles = mgpu.v_tiles_for(N, Hv, dv, cfg["bv_mgpu"], cfg["pair_mgpu_from"],
                                   snapshot_ends is not None)
        out = mgpu.gdn_prefill_mgpu(qf, kf, vf, gf, bf, cu, initial_state, scale=scale,
                                    bv=cfg["bv_mgpu"], snapshot_ends=snapshot_ends,
                                    only_intra=_only_intra, v_tiles=v_tiles)
        if _only_intra:
            return out
        o, fin, *snaps = out
        return (o.reshape(B, T, Hv, dv), (fin if output_final_state else None), *snaps)
    first = None
    if snapshot_ends is not None:  # the walk stores one row per chunk end
        snapshot_ends, first = distinct_snapshot_ends(snapshot_ends)
    tab = chunk_table(cu, TT, CHUNK, snapshot_ends)
    C = tab["c_max"]
    n_snap = 0 if snapshot_ends is None else snapshot_ends.shape[0]
    rows = TT
    if interpret:  # dynamic slices clamp in interpret mode: pad by a chunk
        qf, kf, vf, gf, bf = (_pad_rows(x, CHUNK) for x in (qf, kf, vf, gf, bf))
        rows = TT + CHUNK
    mm_dtype = jnp.float32 if q.dtype == jnp.float32 else jnp.bfloat16
    ratio = Hv // Hk

    intra = pl.pallas_call(
        functools.partial(_intra32_kernel, ratio=ratio, use_l2=use_qk_l2norm,
                          mm_dtype=mm_dtype),
        out_shape=(jax.ShapeDtypeStruct((C, Hv, CHUNK, dk), mm_dtype),
                   jax.ShapeDtypeStruct((C, Hv, CHUNK, dv), mm_dtype),
                   jax.ShapeDtypeStruct((C, Hv, CHUNK), jnp.float32)),
        grid=(C, Hv),
        compiler_params=_compiler_params(cfg["intra_warps"], cfg["intra_stages"]),
        interpret=interpret,
        name="gdn_intra32",
    )(tab["start"], tab["length"], kf, vf, gf, bf)
    w, u, gam = intra
    if _only_intra:
        return intra
    has_init = initial_state is not None
    init = (initial_state.astype(jnp.float32) if has_init
            else jnp.zeros((1, 1, 1, 1), jnp.float32))
    snap_shape = (jax.ShapeDtypeStruct((n_snap, Hv, dk, dv), jnp.float32),) if n_snap else ()
    o, fin, *snaps = pl.pallas_call(
        functools.partial(_main_kernel, ratio=ratio, use_l2=use_qk_l2norm,
                          scale=float(scale), mm_dtype=mm_dtype, bv=bv,
                          has_init=has_init, n_seq=N, total_rows=TT),
        out_shape=(jax.ShapeDtypeStruct((rows, Hv, dv), v.dtype),
                   jax.ShapeDtypeStruct((N, Hv, dk, dv), jnp.float32)) + snap_shape,
        grid=(N, Hv, dv // bv),
        compiler_params=_compiler_params(cfg["main_warps"], cfg["main_stages"]),
        interpret=interpret,
        name="gdn_chunk_main",
    )(cu, tab["seq_first_chunk"], tab["seq_nchunks"], tab["start"], tab["length"],
      tab["emit"], qf, kf, u, w, gam, init)
    o = o[:TT].reshape(B, T, Hv, dv)
    fin = fin if output_final_state else None
    if snapshot_ends is None:
        return o, fin
    # rows no chunk emits (ends outside every sequence) are zero, as the references'
    _, ok = locate_snapshots(cu, TT, snapshot_ends)
    return o, fin, jnp.where(ok[:, None, None, None], snaps[0], 0.0)[first]
