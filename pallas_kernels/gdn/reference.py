"""Pure-JAX references for the gated delta rule (GDN).

Conventions (FLA layout, state [K, V]):

    S_t = exp(g_t) S_{t-1}
    S_t = S_t + k_t (beta_t (v_t - S_t^T k_t))^T
    o_t = S_t^T (scale * q_t)

q, k: [B, T, Hk, dk]; v: [B, T, Hv, dv]; g, beta: [B, T, Hv]; value head h
reads key head h // (Hv // Hk).  States [N, Hv, dk, dv] float32.

Everything inside is float32 with HIGHEST matmul precision.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

CHUNK = 64
_HI = lax.Precision.HIGHEST


def l2norm(x, eps=1e-6):
    x = x.astype(jnp.float32)
    return x * lax.rsqrt(jnp.sum(x * x, axis=-1, keepdims=True) + eps)


def _prep_qk(q, k, scale, use_qk_l2norm):
    q = q.astype(jnp.float32)
    k = k.astype(jnp.float32)
    if use_qk_l2norm:
        q = l2norm(q)
        k = l2norm(k)
    return q * scale, k


def _default_scale(scale, dk):
    return float(dk) ** -0.5 if scale is None else scale


def _check_shapes(q, k, v, g, beta):
    B, T, Hk, dk = q.shape
    if k.shape != q.shape:
        raise ValueError(f"k shape {k.shape} != q shape {q.shape}")
    if v.shape[:2] != (B, T):
        raise ValueError(f"v shape {v.shape} incompatible with q {q.shape}")
    Hv = v.shape[2]
    if Hv % Hk:
        raise ValueError(f"Hv={Hv} must be a multiple of Hk={Hk}")
    if g.shape != (B, T, Hv) or beta.shape != (B, T, Hv):
        raise ValueError(f"g {g.shape} / beta {beta.shape} must be {(B, T, Hv)}")
    return B, T, Hk, Hv, dk, v.shape[3]


def normalize_cu_seqlens(B, T, cu_seqlens):
    """Returns (cu int32 [N+1], N); without cu_seqlens each batch row is one sequence
    of length T (packed as B*T tokens), and cu is a NumPy array, so that the chunk
    tables can be built at trace time (``mgpu_tables.block_table``) or folded by XLA."""
    if cu_seqlens is None:
        return np.arange(B + 1, dtype=np.int32) * T, B
    if B != 1:
        raise ValueError("with cu_seqlens the batch dimension must be 1")
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    return cu, cu.shape[0] - 1


# ----------------------------------------------------------------------------
# chunk table for varlen inputs (static sizes, traced values)
# ----------------------------------------------------------------------------
def chunk_table(cu, total_tokens, chunk=CHUNK, breaks=None):
    """Builds a table of chunks that never cross a sequence boundary (nor, with
    `breaks`, a snapshot end: see ``snapshot_chunk_table``).

    cu: int32 [N+1] (traced).  Returns a dict of int32 arrays of static length
    C_max = ceil(total_tokens / chunk) + N:
      seq   [C_max] sequence id (N for unused entries)
      start [C_max] first token of the chunk
      length[C_max] number of valid tokens (0 for unused entries)
      first [C_max] bool, chunk is its sequence's first
      last  [C_max] bool, chunk is its sequence's last
      seq_first_chunk [N] index of each sequence's first chunk
      seq_nchunks [N]
      emit  [C_max] row of `breaks` whose state this chunk ends at, else -1
    Tokens at index >= cu[N] or beyond total_tokens are never covered.
    """
    if breaks is not None:
        return snapshot_chunk_table(cu, total_tokens, chunk, breaks)
    N = cu.shape[0] - 1
    c_max = -(-total_tokens // chunk) + N
    cu = jnp.minimum(cu, total_tokens)
    lens = jnp.maximum(cu[1:] - cu[:-1], 0)
    nch = (lens + chunk - 1) // chunk
    off_incl = jnp.cumsum(nch)
    off = off_incl - nch
    total = off_incl[-1] if N > 0 else jnp.int32(0)
    c = jnp.arange(c_max, dtype=jnp.int32)
    # compare_all: one fused kernel (the default searchsorted is a loop of kernels on GPU,
    # and this runs in every GDN layer of a prefill step)
    seq = jnp.searchsorted(off_incl, c, side="right", method="compare_all").astype(jnp.int32)
    valid = c < total
    seq_c = jnp.minimum(seq, N - 1)
    local = c - off[seq_c]
    start = cu[:-1][seq_c] + chunk * local
    length = jnp.clip(cu[1:][seq_c] - start, 0, chunk)
    length = jnp.where(valid, length, 0)
    start = jnp.where(valid, start, 0)
    return dict(
        seq=jnp.where(valid, seq_c, N).astype(jnp.int32),
        start=start.astype(jnp.int32),
        length=length.astype(jnp.int32),
        first=valid & (local == 0),
        last=valid & (local == nch[seq_c] - 1),
        seq_first_chunk=off.astype(jnp.int32),
        seq_nchunks=nch.astype(jnp.int32),
        emit=jnp.full((c_max,), -1, jnp.int32),
        c_max=c_max,
    )


def locate_snapshots(cu, total_tokens, ends):
    """Each snapshot end's sequence [S] and whether it is one: a packed token index e
    (exclusive: the state after tokens [cu[n], e)) with cu[n] < e <= cu[n+1]."""
    N = cu.shape[0] - 1
    e = jnp.asarray(ends).astype(jnp.int32)
    seq = jnp.searchsorted(cu[1:], e - 1, side="right", method="compare_all")
    seq = jnp.clip(seq, 0, N - 1).astype(jnp.int32)
    ok = (e > cu[:-1][seq]) & (e <= cu[1:][seq]) & (e <= total_tokens)
    return seq, ok


def distinct_snapshot_ends(ends):
    """(ends with every repeat moved into no sequence, first [S]: the index of each
    end's first occurrence). A walk that stores its state into one row per chunk end
    (the references, the Triton kernel) runs on the distinct ends and returns
    ``snaps[first]``, so an end asked for twice (a verify row and a prefix snapshot at
    one position) fills both rows. 0 is in no sequence (``locate_snapshots``)."""
    e = jnp.asarray(ends).astype(jnp.int32)
    i = jnp.arange(e.shape[0], dtype=jnp.int32)
    if e.shape[0] == 0:
        return e, i
    order = jnp.argsort(e, stable=True).astype(jnp.int32)
    es = e[order]
    starts = jnp.concatenate([jnp.ones((1,), bool), es[1:] != es[:-1]])
    run = lax.cummax(jnp.where(starts, i, 0))  # sorted position of each run's first
    first = jnp.zeros_like(i).at[order].set(order[run])
    return jnp.where(first == i, e, 0), first


def snapshot_chunk_table(cu, total_tokens, chunk, breaks):
    """``chunk_table`` whose chunks also end at every snapshot end in `breaks` (int32
    [S], packed exclusive token ends; see ``locate_snapshots``; others are ignored), so
    the state a prefill carries from chunk to chunk passes through each snapshot and
    a kernel emits it where ``emit`` says, in the same walk: the sequences are cut
    into segments at the ends, each segment chunked as a sequence, and a sequence's
    chunks stay consecutive in the table. C_max = ceil(total / chunk) + N + S."""
    N = cu.shape[0] - 1
    S = breaks.shape[0]
    e = jnp.asarray(breaks).astype(jnp.int32)
    _, ok = locate_snapshots(cu, total_tokens, e)
    bounds = jnp.sort(jnp.concatenate([cu, jnp.where(ok, e, cu[N])]))  # [N+1+S]
    seg = chunk_table(bounds, total_tokens, chunk)  # segments as sequences
    c_max = seg["c_max"]
    valid = seg["length"] > 0
    sid = jnp.minimum(seg["seq"], N + S - 1)
    seg_start, seg_end = bounds[:-1][sid], bounds[1:][sid]
    # the sequence holding a segment: the last whose start is at or before it
    seq_of_seg = jnp.searchsorted(cu[1:], bounds[:-1], side="right", method="compare_all")
    seq_of_seg = jnp.minimum(seq_of_seg, N - 1).astype(jnp.int32)
    seq = seq_of_seg[sid]
    at_end = jnp.full((total_tokens + 1,), -1, jnp.int32).at[
        jnp.where(ok, e, total_tokens + 1)].set(jnp.arange(S, dtype=jnp.int32), mode="drop")
    chunk_end = seg["start"] + seg["length"]
    emit = jnp.where(valid & seg["last"], at_end[jnp.minimum(chunk_end, total_tokens)], -1)
    nch = jax.ops.segment_sum(seg["seq_nchunks"], seq_of_seg, num_segments=N)
    return dict(
        seq=jnp.where(valid, seq, N).astype(jnp.int32),
        start=seg["start"], length=seg["length"],
        first=seg["first"] & (seg_start == cu[:-1][seq]),
        last=seg["last"] & (seg_end == cu[1:][seq]),
        seq_first_chunk=(jnp.cumsum(nch) - nch).astype(jnp.int32),
        seq_nchunks=nch.astype(jnp.int32),
        emit=emit.astype(jnp.int32),
        c_max=c_max,
    )


# ----------------------------------------------------------------------------
# token-by-token reference
# ----------------------------------------------------------------------------
def gdn_recurrent_reference(q, k, v, g, beta, *, scale=None, initial_state=None,
                            cu_seqlens=None, output_final_state=True,
                            use_qk_l2norm=False, snapshot_ends=None):
    """Token-by-token lax.scan over the packed tokens (fp32)."""
    B, T, Hk, Hv, dk, dv = _check_shapes(q, k, v, g, beta)
    scale = _default_scale(scale, dk)
    r = Hv // Hk
    cu, N = normalize_cu_seqlens(B, T, cu_seqlens)
    TT = B * T
    qf, kf = _prep_qk(q.reshape(TT, Hk, dk), k.reshape(TT, Hk, dk), scale,
                      use_qk_l2norm)
    qf = jnp.repeat(qf, r, axis=1)
    kf = jnp.repeat(kf, r, axis=1)
    vf = v.reshape(TT, Hv, dv).astype(jnp.float32)
    gf = g.reshape(TT, Hv).astype(jnp.float32)
    bf = beta.reshape(TT, Hv).astype(jnp.float32)
    if initial_state is None:
        init = jnp.zeros((N, Hv, dk, dv), jnp.float32)
    else:
        init = initial_state.astype(jnp.float32)
    t = jnp.arange(TT, dtype=jnp.int32)
    seq = jnp.searchsorted(cu[1:], t, side="right").astype(jnp.int32)
    valid = (t < cu[-1]) & (t >= cu[0])
    seq_c = jnp.minimum(seq, N - 1)
    is_first = valid & (t == cu[:-1][seq_c])
    is_last = valid & (t == cu[1:][seq_c] - 1)

    S_snap = 0 if snapshot_ends is None else snapshot_ends.shape[0]
    emit = jnp.full((TT,), -1, jnp.int32)
    first = None
    if snapshot_ends is not None:
        ends, first = distinct_snapshot_ends(snapshot_ends)
        _, ok = locate_snapshots(cu, TT, ends)
        emit = emit.at[jnp.where(ok, ends - 1, TT)].set(
            jnp.arange(S_snap, dtype=jnp.int32), mode="drop")

    def step(carry, xs):
        S, finals, snaps = carry
        qt, kt, vt, gt, bt, sq, va, fi, la, em = xs
        S = jnp.where(fi, init[sq], S)
        Sd = S * jnp.exp(gt)[:, None, None]
        kv = jnp.einsum("hkv,hk->hv", Sd, kt, precision=_HI)
        vn = bt[:, None] * (vt - kv)
        Sn = Sd + kt[:, :, None] * vn[:, None, :]
        o = jnp.einsum("hkv,hk->hv", Sn, qt, precision=_HI)
        S = jnp.where(va, Sn, S)
        o = jnp.where(va, o, 0.0)
        finals = lax.cond(la, lambda f: f.at[sq].set(S), lambda f: f, finals)
        if S_snap:
            snaps = snaps.at[em].set(S, mode="drop")  # em = S_snap (no snapshot): dropped
        return (S, finals, snaps), o

    S0 = jnp.zeros((Hv, dk, dv), jnp.float32)
    snaps0 = jnp.zeros((S_snap, Hv, dk, dv), jnp.float32)
    (_, finals, snaps), o = lax.scan(
        step, (S0, init, snaps0),
        (qf, kf, vf, gf, bf, seq_c, valid, is_first, is_last, jnp.where(emit < 0, S_snap, emit)))
    o = o.reshape(B, T, Hv, dv).astype(v.dtype)
    return _with_snapshots(o, finals if output_final_state else None, snaps, first)


def _with_snapshots(o, final, snaps, first):
    """The outputs, with the snapshots of repeated ends filled from their first
    (``distinct_snapshot_ends``) when snapshots were asked for."""
    return (o, final) if first is None else (o, final, snaps[first])


# ----------------------------------------------------------------------------
# chunked (WY / UT) reference
# ----------------------------------------------------------------------------
def _intra_chunk(kc, bc, gc, mask):
    """kc [C,L,H,dk] fp32 (already expanded to value heads); bc, gc [C,L,H];
    mask [C,L].  Returns gamma [C,L,H], T [C,H,L,L] = (I + A)^-1 with
    A_ij = beta_i k_i.k_j exp(gamma_i - gamma_j) for i > j."""
    L = kc.shape[1]
    gc = jnp.where(mask[..., None], gc, 0.0)
    bc = jnp.where(mask[..., None], bc, 0.0)
    gam = jnp.cumsum(gc, axis=1)
    kk = jnp.einsum("cihd,cjhd->chij", kc, kc, precision=_HI)
    gam_h = jnp.moveaxis(gam, 2, 1)  # [C,H,L]
    diff = gam_h[:, :, :, None] - gam_h[:, :, None, :]
    strict = jnp.tril(jnp.ones((L, L), bool), -1)
    decay = jnp.exp(jnp.where(strict, diff, -jnp.inf))
    A = kk * decay * jnp.moveaxis(bc, 2, 1)[:, :, :, None]
    eye = jnp.eye(L, dtype=jnp.float32)
    Tm = jax.scipy.linalg.solve_triangular(
        eye + A, jnp.broadcast_to(eye, A.shape), lower=True, unit_diagonal=True)
    return gam, bc, Tm


def gdn_chunked_reference(q, k, v, g, beta, *, scale=None, initial_state=None,
                          cu_seqlens=None, output_final_state=True,
                          use_qk_l2norm=False, chunk=CHUNK, snapshot_ends=None):
    """Chunked WY/UT reference: chunk table (never crossing sequences nor snapshot
    ends), the intra-chunk parts batched over chunks, lax.scan over chunks for the
    state, which is also written out where the table's ``emit`` says."""
    B, T, Hk, Hv, dk, dv = _check_shapes(q, k, v, g, beta)
    scale = _default_scale(scale, dk)
    r = Hv // Hk
    cu, N = normalize_cu_seqlens(B, T, cu_seqlens)
    TT = B * T
    first = None
    if snapshot_ends is not None:
        snapshot_ends, first = distinct_snapshot_ends(snapshot_ends)
    tab = chunk_table(cu, TT, chunk, snapshot_ends)
    C = tab["c_max"]
    L = chunk
    S_snap = 0 if snapshot_ends is None else snapshot_ends.shape[0]
    pos = jnp.arange(L, dtype=jnp.int32)
    mask = pos[None, :] < tab["length"][:, None]  # [C,L]
    idx = jnp.where(mask, tab["start"][:, None] + pos[None, :], TT)  # TT = dummy

    def gather(x):
        x = x.reshape((TT,) + x.shape[2:])
        x = jnp.concatenate([x, jnp.zeros((1,) + x.shape[1:], x.dtype)], 0)
        return x[idx]

    qc, kc = _prep_qk(gather(q), gather(k), scale, use_qk_l2norm)  # [C,L,Hk,dk]
    qc = jnp.repeat(qc, r, axis=2)
    kc = jnp.repeat(kc, r, axis=2)
    vc = gather(v).astype(jnp.float32)
    gc = gather(g).astype(jnp.float32)
    bc = gather(beta).astype(jnp.float32)
    gam, bc, Tm = _intra_chunk(kc, bc, gc, mask)
    eg = jnp.exp(gam)  # [C,L,H]
    # W = T diag(beta e^gamma) K ; U = T diag(beta) V
    W = jnp.einsum("chij,cjhd->cihd", Tm, kc * (bc * eg)[..., None], precision=_HI)
    U = jnp.einsum("chij,cjhd->cihd", Tm, vc * bc[..., None], precision=_HI)
    gl = gam[:, -1, :]  # [C,H] (masked g = 0 so the last row is the chunk total)
    kdec = kc * jnp.exp(gl[:, None, :] - gam)[..., None]  # e^{gC - g_i} k_i
    qg = qc * eg[..., None]
    causal = jnp.tril(jnp.ones((L, L), bool))
    gam_h = jnp.moveaxis(gam, 2, 1)
    pdec = jnp.exp(jnp.where(causal, gam_h[:, :, :, None] - gam_h[:, :, None, :], -jnp.inf))
    P = jnp.einsum("cihd,cjhd->chij", qc, kc, precision=_HI) * pdec  # [C,H,L,L]

    if initial_state is None:
        init = jnp.zeros((N, Hv, dk, dv), jnp.float32)
    else:
        init = initial_state.astype(jnp.float32)

    def step(carry, xs):
        S, finals, snaps = carry
        Wc, Uc, qgc, Pc, kdc, glc, sq, fi, la, em = xs
        S = jnp.where(fi, init[jnp.minimum(sq, N - 1)], S)
        vn = Uc - jnp.einsum("ihd,hdv->ihv", Wc, S, precision=_HI)
        o = (jnp.einsum("ihd,hdv->ihv", qgc, S, precision=_HI)
             + jnp.einsum("hij,jhv->ihv", Pc, vn, precision=_HI))
        S = (jnp.exp(glc)[:, None, None] * S
             + jnp.einsum("ihd,ihv->hdv", kdc, vn, precision=_HI))
        finals = lax.cond(la, lambda f: f.at[sq].set(S), lambda f: f, finals)
        if S_snap:
            snaps = snaps.at[em].set(S, mode="drop")  # em = S_snap (no snapshot): dropped
        return (S, finals, snaps), o

    S0 = jnp.zeros((Hv, dk, dv), jnp.float32)
    snaps0 = jnp.zeros((S_snap, Hv, dk, dv), jnp.float32)
    emit = jnp.where(tab["emit"] < 0, S_snap, tab["emit"])
    (_, finals, snaps), oc = lax.scan(
        step, (S0, init, snaps0),
        (W, U, qg, P, kdec, gl, tab["seq"], tab["first"], tab["last"], emit))
    out = jnp.zeros((TT + 1, Hv, dv), jnp.float32).at[idx.reshape(-1)].set(
        oc.reshape(C * L, Hv, dv), mode="drop")
    o = out[:TT].reshape(B, T, Hv, dv).astype(v.dtype)
    return _with_snapshots(o, finals if output_final_state else None, snaps, first)


# ----------------------------------------------------------------------------
# decode reference
# ----------------------------------------------------------------------------
def gdn_decode_reference(q, k, v, g, beta, state_pool, slots, out_slots=None, lengths=None,
                         *, scale=None, use_qk_l2norm=False):
    """``ops.gdn_decode``'s contract in jnp: one token a sequence (q [N,Hk,dk], out_slots
    [N]) or up to R (q [N,R,Hk,dk], out_slots [N,R], ``lengths`` [N]), the state rounded
    to the pool's dtype after each token as the kernel stores it."""
    one = q.ndim == 3
    if one:
        q, k, v, g, beta = (x[:, None] for x in (q, k, v, g, beta))
        out_slots = None if out_slots is None else out_slots[:, None]
    N, R, Hk, dk = q.shape
    Hv = v.shape[2]
    P = state_pool.shape[0]
    scale = _default_scale(scale, dk)
    qf, kf = _prep_qk(q, k, scale, use_qk_l2norm)
    qf = jnp.repeat(qf, Hv // Hk, axis=2)
    kf = jnp.repeat(kf, Hv // Hk, axis=2)
    slots = slots.astype(jnp.int32)
    valid = (slots >= 0) & (slots < P)
    out_slots = slots[:, None] if out_slots is None else out_slots.astype(jnp.int32)
    lengths = jnp.ones((N,), jnp.int32) if lengths is None else lengths.astype(jnp.int32)
    S = state_pool[jnp.where(valid, slots, 0)].astype(jnp.float32)  # [N,Hv,dk,dv]
    pool, outs = state_pool, []
    for r in range(R):
        live = valid & (r < lengths)
        S = S * jnp.exp(g[:, r].astype(jnp.float32))[:, :, None, None]
        kv = jnp.einsum("nhkv,nhk->nhv", S, kf[:, r], precision=_HI)
        vn = beta[:, r].astype(jnp.float32)[:, :, None] * (v[:, r].astype(jnp.float32) - kv)
        S = S + kf[:, r, ..., None] * vn[:, :, None, :]
        o = jnp.einsum("nhkv,nhk->nhv", S, qf[:, r], precision=_HI)
        outs.append(jnp.where(live[:, None, None], o, 0.0).astype(v.dtype))
        stored = S.astype(state_pool.dtype)
        widx = jnp.where(live & (out_slots[:, r] >= 0), out_slots[:, r], P)  # >= P: dropped
        pool = pool.at[widx].set(stored, mode="drop")
        S = stored.astype(jnp.float32)  # the next token continues from the stored state
    o = jnp.stack(outs, axis=1)
    return (o[:, 0] if one else o), pool
