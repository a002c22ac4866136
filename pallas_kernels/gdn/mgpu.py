"""Mosaic GPU (sm90: wgmma + TMA) chunked GDN prefill: an intra launch and a
sequential launch, as the Pallas Triton pair (``pallas_triton``) but with explicit
wgmma, TMA and SMEM.

The Triton sequential launch is latency-bound: about 8 us per 64-token chunk against
1 us of tensor-core work (bench/RESULTS.md), because each chunk's loads sit on the state
chain and Triton's small dots convert layouts through shared memory. Here one CTA per
(sequence, value head, V tile; or both V tiles of the head where the launch has chains
enough to fill the SMs) keeps the fp32 state tile in wgmma registers, and splits
its work over three warpgroups so that only the state's own chain is sequential
(``chunk_pass_mgpu``): one loads each chunk's q, k, v tile, M = T diag(beta) and gamma by
TMA into a two-slot ring, one runs the chain (K S; Vd = M (V - e^gamma K S); S' =
e^{gamma_C} S + K^T V' with V' = e^{gamma_C - gamma} Vd) and one the chunk's output (P =
Q K^T . decay, then e^gamma Q S + P Vd and its store), which the chain never waits on.
A whole chunk's output is one TMA store, a partial one goes by the power-of-two ladder.

TMA addresses a tiled SMEM buffer's rows in whole tiles, so a chunk cannot start at
an arbitrary token. Chunks here live on the 64-row grid of the packed token axis
(``block_table``): a sequence's chunk is one grid block, cut to the rows [lo, hi) that
belong to it (only a sequence's first and last chunks are cut). Rows outside [lo, hi)
are read (another sequence's tokens, padding, or TMA's zero fill past the end): a cut
chunk's k and v rows there are zeroed in SMEM before use (0 * NaN is NaN: another
request's non-finite values must not reach this one), beta and g are 0 there, so M's
rows and columns there vanish and Vd's rows there are 0; their output rows are not
stored.
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from .._mgpu import load, store_rows, wgmma_transforms
from .reference import CHUNK, l2norm, locate_snapshots


def block_table(cu, total_tokens: int):
    """Chunks on the 64-row grid, never crossing a sequence boundary. cu int32 [N+1].
    Returns int32 arrays: per entry the block's first token ``start`` (a multiple of
    64) and the sequence's rows in it [lo, hi) (0, 0 for unused entries); per sequence
    ``seq_first_chunk`` and ``seq_nchunks``; ``cu`` clamped to the token count, as the
    table read it.

    A traced cu gives the static length C = ceil(T / 64) + N (each sequence adds at
    most one block it shares) and XLA computes the table on every call. A NumPy cu
    (``gdn_prefill`` without cu_seqlens, FLA's batched form) gives the table here, as
    constants with only the used entries. On the GPU that took the table's fusions out
    but not the device time: three tiny broadcast and multiply fusions took
    their place (bench/RESULTS.md, prefill run 11)."""
    xp = np if isinstance(cu, np.ndarray) else jnp
    n_seq = cu.shape[0] - 1
    c_max = -(-total_tokens // CHUNK) + n_seq
    cu = xp.minimum(cu.astype(np.int32), total_tokens)
    s0, s1 = cu[:-1], cu[1:]
    nch = xp.where(s1 > s0, (s1 + CHUNK - 1) // CHUNK - s0 // CHUNK, 0)
    ends = xp.cumsum(nch).astype(np.int32)
    first = ends - nch
    if xp is np:
        c_max = max(int(ends[-1]), 1)
    c = xp.arange(c_max, dtype=np.int32)
    # compare_all: one fused kernel (the default is a loop of kernels on the GPU)
    kw = {} if xp is np else {"method": "compare_all"}
    seq = xp.minimum(xp.searchsorted(ends, c, side="right", **kw), n_seq - 1)
    live = c < ends[-1]
    start = (s0[seq] // CHUNK + c - first[seq]) * CHUNK
    lo = xp.where(live, xp.maximum(s0[seq] - start, 0), 0)
    hi = xp.where(live, xp.minimum(s1[seq] - start, CHUNK), 0)
    tab = dict(start=xp.where(live, start, 0), lo=lo, hi=hi, seq_first_chunk=first,
               seq_nchunks=nch, cu=cu)
    return {k: v.astype(np.int32) for k, v in tab.items()}


def _per_block(x, tab):
    """x [T, H] as [C, H, 64] on each entry's block, 0 outside its rows [lo, hi). A
    constant table of whole blocks that tile x in order is a reshape."""
    if isinstance(tab["start"], np.ndarray):
        C = tab["start"].shape[0]
        if (C * CHUNK == x.shape[0] and np.all(tab["lo"] == 0) and np.all(tab["hi"] == CHUNK)
                and np.array_equal(tab["start"], np.arange(C) * CHUNK)):
            return x.reshape(C, CHUNK, x.shape[1]).transpose(0, 2, 1)
    pos = jnp.arange(CHUNK, dtype=jnp.int32)
    idx = jnp.minimum(tab["start"][:, None] + pos, x.shape[0] - 1)
    keep = (pos >= tab["lo"][:, None]) & (pos < tab["hi"][:, None])
    return jnp.where(keep[..., None], x[idx], 0.0).transpose(0, 2, 1)


def snapshot_table(tab, gam, ends):
    """Where the sequential launch emits each snapshot (``gdn_prefill``'s
    ``snapshot_ends``: packed exclusive token ends e). The state after token e - 1 is
    the state after r = e - 64 * ((e - 1) // 64) rows of the grid block holding that
    token, so the snapshots are sorted by that block's ``block_table`` entry and each
    entry gets the range [lo, hi) of them it passes; per sorted snapshot, ``r``, its
    output ``row`` (its index in `ends`) and ``gamma`` [S, Hv], the block's cumulative
    gate at row r - 1. Ends in no sequence (``ok`` false) sort past every entry."""
    C = tab["start"].shape[0]
    ends = jnp.asarray(ends, jnp.int32)
    cu = jnp.asarray(tab["cu"])
    seq, ok = locate_snapshots(cu, cu[-1], ends)
    blk = (ends - 1) // CHUNK
    c = jnp.asarray(tab["seq_first_chunk"])[seq] + blk - cu[seq] // CHUNK
    c = jnp.where(ok, c, C).astype(jnp.int32)
    order = jnp.argsort(c, stable=True).astype(jnp.int32)
    cs = c[order]
    entries = jnp.arange(C, dtype=jnp.int32)
    r = jnp.where(ok, ends - blk * CHUNK, CHUNK)[order].astype(jnp.int32)
    # compare_all: one fused kernel (the default is a loop of kernels with host syncs)
    find = lambda side: jnp.searchsorted(cs, entries, side=side, method="compare_all")
    return dict(lo=find("left").astype(jnp.int32), hi=find("right").astype(jnp.int32),
                r=r, row=order,
                gamma=gam[jnp.minimum(cs, C - 1), :, r - 1].astype(jnp.float32), ok=ok)


def takes(q, k, v, bv: int) -> bool:
    """Whether these kernels take q, k [.., dk] and v [.., dv]: one 16-bit dtype; dk
    and dv multiples of the V tile bv, itself 128 bytes (every wgmma operand row here
    is one 128-byte swizzle row; at bv 32, 64-byte rows, the sequential launch passed
    the interpreter but hit a misaligned address on the GPU: bench/RESULTS.md, prefill
    run 6); dk at most 128 (the sequential launch's SMEM, ~201 KB at dk 128, exceeds
    the 227 KB limit from dk 192)."""
    dk, dv = q.shape[-1], v.shape[-1]
    return (q.dtype == k.dtype == v.dtype and q.dtype in (jnp.bfloat16, jnp.float16)
            and bv * q.dtype.itemsize == 128 and dk % bv == 0 and dv % bv == 0
            and dk <= 128)


def v_tiles_for(n_seq: int, Hv: int, dv: int, bv: int, pair_from: int | None,
                snapshots: bool) -> int:
    """V tiles a CTA of the sequential launch walks: both (2) when the launch has at
    least ``pair_from`` (sequence, value head) chains, so one CTA an SM still leaves
    no SM idle, and no snapshots are asked for (their fp32 buffer shares the S ring's
    bytes there); else one (a CTA per V tile: twice the CTAs)."""
    if (snapshots or pair_from is None or dv % (2 * bv) or dv // bv != 2
            or n_seq * Hv < pair_from):
        return 1
    return 2


def gdn_prefill_mgpu(q, k, v, g, beta, cu, initial_state, *, scale: float, bv: int,
                     snapshot_ends=None, only_intra: bool = False, v_tiles: int = 1):
    """Packed prefill (``gdn_prefill``'s semantics with ``use_qk_l2norm``: the intra
    launch's float16 inverse needs unit keys) on the two Mosaic GPU launches.
    q, k [T, Hk, dk], v [T, Hv, dv] in one 16-bit dtype; g, beta [T, Hv] float32.
    Returns (o [T, Hv, dv], final state [N, Hv, dk, dv] float32), and with
    snapshot_ends [S] the states there [S, Hv, dk, dv] float32 (zero for ends in no
    sequence); only_intra: the intra launch's (M, gamma), for timing it alone;
    v_tiles: V tiles of bv a CTA of the sequential launch walks (1, or 2 = dv // bv
    without snapshot_ends: see ``chunk_pass_mgpu``)."""
    T = q.shape[0]
    # once here, not once per V tile in the sequential launch
    q, k = (l2norm(x.astype(jnp.float32)).astype(x.dtype) for x in (q, k))
    pad = -T % 8  # TMA tiles the token axis of q, k, v and o by 8 rows
    if pad:
        q, k, v = (jnp.pad(x, ((0, pad), (0, 0), (0, 0))) for x in (q, k, v))
    tab = block_table(cu, T)
    gam = jnp.cumsum(_per_block(g, tab), axis=-1)
    m = intra_mgpu(tab["start"], tab["lo"], tab["hi"], k, gam, _per_block(beta, tab),
                   ratio=v.shape[1] // k.shape[1])
    if only_intra:
        return m, gam
    init = None if initial_state is None else initial_state.astype(jnp.float32)
    snaps = None if snapshot_ends is None else snapshot_table(tab, gam, snapshot_ends)
    out = chunk_pass_mgpu(tab["cu"], tab["seq_first_chunk"], tab["seq_nchunks"], q, k, v,
                          m, gam, init, snaps, ratio=v.shape[1] // k.shape[1], bv=bv,
                          scale=scale, nv=v_tiles)
    if snaps is None:
        return out[0][:T], out[1]
    o, fin, states = out
    return o[:T], fin, jnp.where(snaps["ok"][:, None, None, None], states, 0.0)


def chunk_pass_mgpu(cu, seq_first, seq_nchunks, q, k, v, m, gam, init, snaps=None, *,
                    ratio: int, bv: int, scale: float, nv: int = 1):
    """The sequential launch. q, k [T, Hk, dk] and v [T, Hv, dv] (16-bit, one dtype, T
    a multiple of 8); m [C, Hv, 64, 64] (q's dtype) and gam [C, Hv, 64] float32 per
    ``block_table`` entry; init [N, Hv, dk, dv] float32 or None; snaps a
    ``snapshot_table`` or None. Returns (o [T, Hv, dv] in v's dtype, rows at or past
    cu[N] zero; final state [N, Hv, dk, dv] float32), and with snaps the states
    [S, Hv, dk, dv] float32 at its rows (rows of ends in no sequence unwritten).

    One CTA per (sequence, value head, nv V tiles of bv), three warpgroups. Only the
    state's chain is sequential, so one warpgroup runs nothing else; a chunk's output
    waits for nothing that the next chunk needs, so another warpgroup computes it
    beside the chain (one warpgroup doing both spent 2.8 us a chunk against 0.7 us of
    tensor-core work: bench/RESULTS.md, prefill run 6):

      * state (wg 0): S -> SMEM, K S, W = V - e^gamma K S, Vd = M W, then S' =
        e^{gamma_C} S + K^T V' with V' = e^{gamma_C - gamma} Vd;
      * output (wg 1): P = (Q K^T) . e^{gamma_i - gamma_j} [i >= j] as soon as the
        chunk's inputs are ready, then, once wg 0 has written S and Vd, o = e^gamma Q
        S + P Vd and its store;
      * memory (wg 2): the TMA loads of q, k, v, M and gamma into a two-slot ring,
        a slot refilled once both others are done with it.

    S and Vd go through two SMEM slots of their own, so wg 0 runs up to two chunks
    ahead of wg 1.

    nv = 2: a CTA walks both V tiles of a (sequence, head) as one slice of bw = 2 bv
    columns, so q, k, M, gamma, their loads and P are shared by the two, and each
    product is one wgmma of N = bw, reading its left operand once. The state is 128
    registers a thread, so wg 0 takes the update in place (the accumulator
    initialised with e^{gamma_C} S), W and V' are written over the chunk's v slice,
    the fp32 state buffer shares its bytes with the S ring (used only before the
    first chunk and after the last) and the two output buffers share theirs: ~225 KB
    of SMEM. No snapshots there.

    A snapshot after r rows of a chunk (nv = 1) is e^{gamma_{r-1}} S + K^T V'' with
    V'' = e^{gamma_{r-1} - gamma} Vd on rows below r and 0 from r on (Vd's rows below r
    depend on no later row: M is lower triangular): wg 0 computes it between Vd and the
    update, through the W buffer, and stores it by TMA from the state buffer, so a
    chunk without one does no more than before."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    T, _, dk = q.shape
    _, Hv, dv = v.shape
    n_seq = cu.shape[0] - 1
    dt = q.dtype
    item = jnp.dtype(dt).itemsize
    if not takes(q, k, v, bv):
        raise ValueError(f"q, k, v ({q.dtype}, {k.dtype}, {v.dtype}), dk={dk}, dv={dv} "
                         f"and bv={bv} are not shapes these kernels take (see takes)")
    has_init = init is not None
    n_snap = 0 if snaps is None else snaps["r"].shape[0]
    if nv not in (1, 2) or dv % (nv * bv) or (nv > 1 and n_snap):
        raise ValueError(f"nv={nv} V tiles a CTA: 1, or 2 dividing dv={dv} by bv={bv}, "
                         f"without snapshots")
    pair = nv > 1
    bw = nv * bv  # the CTA's V slice
    wg = plgpu.Layout.WGMMA
    row_vec, col_vec = wg.reduce(1), wg.reduce(0)
    tr = wgmma_transforms(bv, item)  # 128 B swizzle rows for every wgmma operand

    def gdn_chunk_mgpu(cu_g, first_g, nch_g, q_g, k_g, v_g, m_g, gam_g, *rest):
        if has_init:
            init_g, *rest = rest
        if n_snap:
            snlo_g, snhi_g, snr_g, snrow_g, sng_g, *rest = rest
        o_g, fin_g, *rest = rest
        if n_snap:
            snap_g, *rest = rest
        if pair:
            (q_s, k_s, v_s, m_s, g_s, s_union, vd_s, o_union,
             loaded, zeroed, ready, consumed, s_free, init_bar) = rest
            s_s, f_s = s_union
            o_t, o_s = o_union
            w_s = None  # W and V' go over the v slice
        else:
            (q_s, k_s, v_s, m_s, g_s, s_s, vd_s, w_s, o_t, o_s, f_s,
             loaded, zeroed, ready, consumed, s_free, init_bar) = rest
        role = lax.axis_index("wg")
        s = lax.axis_index("s")
        h = lax.axis_index("h")
        v0 = lax.axis_index("v") * bw
        hk = h // ratio
        # every scalar this CTA needs, read once: a GMEM read on the chunk chain costs
        # a memory latency per chunk. Chunk i of sequence s is grid block b0 + i.
        c0, nc = first_g[s], nch_g[s]
        seq_start, seq_end = cu_g[s], cu_g[s + 1]
        b0 = seq_start // CHUNK
        rows = lambda x: lax.broadcast_in_dim(x, (CHUNK, bw), [0])

        def bounds(i):
            st = (b0 + i) * CHUNK
            lo = jnp.maximum(seq_start - st, 0)
            hi = jnp.minimum(seq_end - st, CHUNK)
            return st, lo, hi, (lo == 0) & (hi == CHUNK)

        @pl.when(role == 2)
        def _memory():
            plgpu.set_max_registers(40, action="decrease")

            @pl.loop(0, nc)
            def _(i):
                slot = lax.rem(i, 2)

                @pl.when(i >= 2)
                def _():
                    plgpu.barrier_wait(consumed.at[slot])

                st, c, b = (b0 + i) * CHUNK, c0 + i, loaded.at[slot]
                plgpu.copy_gmem_to_smem(q_g.at[pl.ds(st, CHUNK), hk], q_s.at[slot], b)
                plgpu.copy_gmem_to_smem(k_g.at[pl.ds(st, CHUNK), hk], k_s.at[slot], b)
                plgpu.copy_gmem_to_smem(v_g.at[pl.ds(st, CHUNK), h, pl.ds(v0, bw)],
                                        v_s.at[slot], b)
                plgpu.copy_gmem_to_smem(m_g.at[c, h], m_s.at[slot], b)
                plgpu.copy_gmem_to_smem(gam_g.at[c, h], g_s.at[slot], b)

            # every arrival observed before the barriers go (the last two chunks')
            @pl.loop(jnp.maximum(nc - 2, 0), nc)
            def _(i):
                plgpu.barrier_wait(consumed.at[lax.rem(i, 2)])

        @pl.when(role == 0)
        def _state():
            plgpu.set_max_registers(240 if pair else 232, action="increase")
            if has_init:
                plgpu.copy_gmem_to_smem(init_g.at[s, h, :, pl.ds(v0, bw)], f_s, init_bar)
                plgpu.barrier_wait(init_bar)
                S0 = load(f_s, wg, optimized=False)
                if pair:  # every thread's reads of f_s before any write of the S ring
                    plgpu.commit_smem()
            else:
                S0 = plgpu.layout_cast(jnp.zeros((dk, bw), jnp.float32), wg)

            if n_snap:
                r_iota = plgpu.broadcasted_iota(jnp.int32, (CHUNK, bv), 0, layout=wg)

            def emit_snapshots(c, S, vd, k_c, g_r):
                """The states after the rows of entry c that its snapshots end at."""
                @pl.loop(snlo_g[c], snhi_g[c])
                def _(j):
                    r, g_e = snr_g[j], sng_g[j, h]
                    keep = r_iota < r
                    decay = jnp.exp(jnp.where(keep, g_e - rows(g_r), 0.0))
                    w_s[...] = jnp.where(keep, decay * vd, 0.0).astype(dt)  # V''
                    plgpu.commit_smem()

                    def at_r(acc):
                        plgpu.wgmma(acc, k_c.transpose((1, 0)), w_s)
                        plgpu.wgmma_wait(0)
                        return acc[...] + jnp.exp(g_e) * S

                    snap = pl.run_scoped(at_r, plgpu.ACC((dk, bv)))
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last one left f_s
                    f_s[...] = snap
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(f_s, snap_g.at[snrow_g[j], h, :, pl.ds(v0, bv)])

            def chunk(i, S):
                slot = lax.rem(i, 2)
                _, lo, hi, whole = bounds(i)
                k_c, g_c = k_s.at[slot], g_s.at[slot]
                w_c = v_s.at[slot] if pair else w_s  # W, then V' (only wg 0 reads v)
                plgpu.barrier_wait(loaded.at[slot])

                @pl.when(~whole)  # before wg 1 reads k: 0 * NaN is NaN
                def _():
                    _zero_rows_outside(k_c, lo, hi)
                    _zero_rows_outside(v_s.at[slot], lo, hi)

                plgpu.barrier_arrive(zeroed.at[slot])

                @pl.when(i >= 2)  # wg 1 is done with chunk i - 2's S and Vd
                def _():
                    plgpu.barrier_wait(s_free.at[slot])

                s_s.at[slot][...] = S.astype(dt)
                plgpu.commit_smem()
                ks = pl.run_scoped(functools.partial(_mma, pairs=((k_c, s_s.at[slot]),)),
                                   plgpu.ACC((CHUNK, bw)))[0]
                g_r = load(g_c, row_vec)
                vin = load(v_s.at[slot], wg).astype(jnp.float32)
                w_c[...] = (vin - rows(jnp.exp(g_r)) * ks).astype(dt)
                plgpu.commit_smem()
                vd = pl.run_scoped(functools.partial(_mma, pairs=((m_s.at[slot], w_c),)),
                                   plgpu.ACC((CHUNK, bw)))[0]
                vd_s.at[slot][...] = vd.astype(dt)
                if n_snap:
                    emit_snapshots(c0 + i, S, vd, k_c, g_r)
                g_last = g_c[CHUNK - 1]
                w_c[...] = (rows(jnp.exp(g_last - g_r)) * vd).astype(dt)  # V'
                plgpu.commit_smem()
                plgpu.barrier_arrive(ready.at[slot])

                if pair:  # in place: the state's registers are the accumulator
                    def update(acc):
                        plgpu.wgmma(acc, k_c.transpose((1, 0)), w_c)
                        plgpu.wgmma_wait(0)

                    S = pl.run_state(update)(plgpu.ACC.init(jnp.exp(g_last) * S))
                else:
                    def update(kv_acc):
                        plgpu.wgmma(kv_acc, k_c.transpose((1, 0)), w_c)
                        s_part = jnp.exp(g_last) * S
                        plgpu.wgmma_wait(0)
                        return s_part + kv_acc[...]

                    S = pl.run_scoped(update, plgpu.ACC((dk, bw)))
                plgpu.barrier_arrive(consumed.at[slot])
                return S

            S = lax.fori_loop(0, nc, chunk, S0)

            @pl.loop(jnp.maximum(nc - 2, 0), nc)  # wg 1's last two chunks
            def _(i):
                plgpu.barrier_wait(s_free.at[lax.rem(i, 2)])

            if n_snap:
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # the last snapshot left
            f_s[...] = S
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(f_s, fin_g.at[s, h, :, pl.ds(v0, bw)])
            plgpu.wait_smem_to_gmem(0)

        @pl.when(role == 1)
        def _output():
            plgpu.set_max_registers(224 if pair else 232, action="increase")
            ri = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
            ci = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
            causal = ri >= ci

            @pl.loop(0, nc)
            def _(i):
                slot = lax.rem(i, 2)
                st, lo, hi, whole = bounds(i)
                q_c, g_c = q_s.at[slot], g_s.at[slot]
                plgpu.barrier_wait(loaded.at[slot])
                plgpu.barrier_wait(zeroed.at[slot])
                qk = pl.run_scoped(
                    functools.partial(_mma, pairs=((q_c, k_s.at[slot].transpose((1, 0))),)),
                    plgpu.ACC((CHUNK, CHUNK)))[0]
                g_r, g_col = load(g_c, row_vec), load(g_c, col_vec)
                diff = (lax.broadcast_in_dim(g_r, (CHUNK, CHUNK), [0])
                        - lax.broadcast_in_dim(g_col, (CHUNK, CHUNK), [1]))
                # P stays in registers: a wgmma's left operand may (no SMEM store)
                p = jnp.where(causal, qk * jnp.exp(jnp.where(causal, diff, 0.0)),
                              0.0).astype(dt)
                plgpu.barrier_wait(ready.at[slot])
                qs, pv = pl.run_scoped(
                    functools.partial(_mma, pairs=((q_c, s_s.at[slot]), (p, vd_s.at[slot]))),
                    plgpu.ACC((CHUNK, bw)), plgpu.ACC((CHUNK, bw)))
                plgpu.barrier_arrive(s_free.at[slot])
                plgpu.barrier_arrive(consumed.at[slot])
                o = ((rows(jnp.exp(g_r)) * qs + pv) * scale).astype(o_g.dtype)
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # last chunk's rows left

                @pl.when(whole)  # one store from swizzled SMEM
                def _():
                    o_t[...] = o
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(o_t, o_g.at[pl.ds(st, CHUNK), h, pl.ds(v0, bw)])

                @pl.when(~whole)  # a sequence's first or last rows: the power-of-two ladder
                def _():
                    o_s[...] = o
                    plgpu.commit_smem()
                    store_rows(o_s, lambda r, n: o_g.at[pl.ds(st + r, n), h, pl.ds(v0, bw)],
                               lo, hi - lo, CHUNK)

            # the last sequence's CTAs zero the padding rows [cu[N], T)
            @pl.when(s == n_seq - 1)
            def _():
                pad0 = cu_g[n_seq]
                plgpu.wait_smem_to_gmem(0, wait_read_only=True)
                o_s[...] = jnp.zeros((CHUNK, bw), o_s.dtype)
                plgpu.commit_smem()

                @pl.loop(0, (T - pad0 + CHUNK - 1) // CHUNK)
                def _(j):
                    st = pad0 + j * CHUNK
                    store_rows(o_s, lambda r, n: o_g.at[pl.ds(st + r, n), h, pl.ds(v0, bw)],
                               0, jnp.minimum(T - st, CHUNK), CHUNK)

            plgpu.wait_smem_to_gmem(0)

    buffers = [
        plgpu.SMEM((2, CHUNK, dk), dt, transforms=tr),        # q
        plgpu.SMEM((2, CHUNK, dk), dt, transforms=tr),        # k
        plgpu.SMEM((2, CHUNK, bw), dt, transforms=tr),        # v slice (nv 2: then W, V')
        plgpu.SMEM((2, CHUNK, CHUNK), dt, transforms=tr),     # M
        plgpu.SMEM((2, CHUNK), jnp.float32),                  # gamma
    ]
    s_ring = plgpu.SMEM((2, dk, bw), dt, transforms=tr)       # S, 16-bit copy
    vd_ring = plgpu.SMEM((2, CHUNK, bw), dt, transforms=tr)   # Vd
    f_buf = plgpu.SMEM((dk, bw), jnp.float32)                 # state in / out
    o_tiled = plgpu.SMEM((CHUNK, bw), v.dtype, transforms=tr)  # output, whole chunk
    o_rows = plgpu.SMEM((CHUNK, bw), v.dtype)                 # output, cut chunk
    if pair:
        buffers += [plgpu.RefUnion(s_ring, f_buf), vd_ring, plgpu.RefUnion(o_tiled, o_rows)]
    else:
        buffers += [s_ring, vd_ring, plgpu.SMEM((CHUNK, bw), dt, transforms=tr),  # W, V'
                    o_tiled, o_rows, f_buf]
    scratch = buffers + [
        plgpu.Barrier(num_arrivals=5, num_barriers=2),        # loaded: a chunk's five copies
        plgpu.Barrier(num_barriers=2),                        # zeroed: k, v safe to read
        plgpu.Barrier(num_barriers=2),                        # ready: S and Vd in SMEM
        plgpu.Barrier(num_arrivals=2, num_barriers=2),        # consumed: slot refillable
        plgpu.Barrier(num_barriers=2),                        # s_free: S, Vd slot reusable
        plgpu.Barrier(),                                      # the initial state
    ]
    snap_out = (jax.ShapeDtypeStruct((n_snap, Hv, dk, dv), jnp.float32),) if n_snap else ()
    kernel = plgpu.kernel(
        gdn_chunk_mgpu,
        out_type=(jax.ShapeDtypeStruct((T, Hv, dv), v.dtype),
                  jax.ShapeDtypeStruct((n_seq, Hv, dk, dv), jnp.float32)) + snap_out,
        scratch_types=scratch,
        grid=(n_seq, Hv, dv // (nv * bv)),
        grid_names=("s", "h", "v"),
        num_threads=3,
        thread_name="wg",
        compiler_params=_compiler_params(),
    )
    args = (cu, seq_first, seq_nchunks, q, k, v, m, gam) + ((init,) if has_init else ())
    if n_snap:
        args += tuple(snaps[name] for name in ("lo", "hi", "r", "row", "gamma"))
    return kernel(*args)


def intra_mgpu(start, lo, hi, k, gam, beta, *, ratio: int):
    """The intra launch: M = T diag(beta) per ``block_table`` entry and value head,
    T = (I + A)^-1, A_ij = beta_i k_i.k_j e^{gamma_i - gamma_j} (i > j). k [T, Hk, dk]
    16-bit (L2-normalised where the op asks); gam, beta [C, Hv, 64] float32 on each
    entry's block (gamma the chunk-local cumulative gate; beta 0 and gamma constant
    outside the entry's rows). Returns M [C, Hv, 64, 64] in k's dtype; unused entries
    (hi = 0) are not written (no sequence reads them).

    T by recursive doubling of its diagonal blocks (``pallas_triton._doubling_inverse``,
    where the CPU tests check it): with D_s the block-diagonal part of T in blocks of
    s rows and B_s the part of A below the diagonal inside each 2s block, D_2s = D_s -
    D_s (B_s D_s), s = 1, 2, ..., 32. B_s D_s is A D_s kept on B_s's blocks, so A goes
    to SMEM once and each step masks a product instead of storing a masked A: one
    SMEM store less a step and A out of the registers (168 -> 122 registers, 4 CTAs an
    SM instead of 3: bench/RESULTS.md, prefill run 14). D stays float32 in registers;
    the wgmma operands A, D and Y = B D are float16: tf32's 10-bit mantissa at twice
    tf32's rate and half its SMEM, and a 16-bit wgmma reads row-major right operands,
    so no transposes are carried (bench/RESULTS.md, prefill run 6). float16's range
    needs unit keys: then |A_ij| <= beta_i, and with beta <= 2 T's entries stayed under
    ~2 in simulation; keys of norm 5 overflow it. So ``gdn_prefill_mgpu`` always
    normalises q and k, and the dispatch takes it only for ops that ask for that
    (``use_qk_l2norm``, as the model does)."""
    from jax.experimental import pallas as pl
    from jax.experimental.pallas import mosaic_gpu as plgpu

    _, _, dk = k.shape
    C, Hv, _ = gam.shape
    dt, f16 = k.dtype, jnp.float16
    wg = plgpu.Layout.WGMMA
    row_vec, col_vec = wg.reduce(1), wg.reduce(0)
    tr16 = wgmma_transforms(CHUNK, 2)
    full = lambda x: lax.broadcast_in_dim(x, (CHUNK, CHUNK), [0])
    cols = lambda x: lax.broadcast_in_dim(x, (CHUNK, CHUNK), [1])

    def gdn_intra_mgpu(start_g, lo_g, hi_g, k_g, gam_g, beta_g, m_g, k_s, g_s, b_s, a_sm,
                       d_sm, y_sm, m_s, bar):
        c = lax.axis_index("c")
        h = lax.axis_index("h")

        @pl.when(hi_g[c] > 0)
        def _():
            plgpu.copy_gmem_to_smem(k_g.at[pl.ds(start_g[c], CHUNK), h // ratio], k_s,
                                    bar.at[0])
            plgpu.copy_gmem_to_smem(gam_g.at[c, h], g_s, bar.at[1])
            plgpu.copy_gmem_to_smem(beta_g.at[c, h], b_s, bar.at[2])
            for i in range(3):
                plgpu.barrier_wait(bar.at[i])
            lo, hi = lo_g[c], hi_g[c]

            @pl.when((lo > 0) | (hi < CHUNK))
            def _():
                _zero_rows_outside(k_s, lo, hi)

            kk = pl.run_scoped(functools.partial(_mma, pairs=((k_s, k_s.transpose((1, 0))),)),
                               plgpu.ACC((CHUNK, CHUNK)))[0]
            ri = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 0, layout=wg)
            ci = plgpu.broadcasted_iota(jnp.int32, (CHUNK, CHUNK), 1, layout=wg)
            g_r, g_c = load(g_s, row_vec), load(g_s, col_vec)
            b_r = load(b_s, row_vec)
            below = ri > ci  # the exponent is <= 0 where kept
            a = jnp.where(below, kk * full(b_r) * jnp.exp(jnp.where(below, full(g_r) - cols(g_c),
                                                                    0.0)), 0.0)
            # D_2 = I - (A's 2x2 sub-diagonal)
            dd = jnp.where(ri == ci, 1.0, 0.0) - jnp.where(ri // 2 == ci // 2, a, 0.0)
            a_sm[...] = a.astype(f16)  # once; A leaves the registers
            for blk in (2, 4, 8, 16, 32):
                d_sm[...] = dd.astype(f16)
                plgpu.commit_smem()
                y = pl.run_scoped(functools.partial(_mma, pairs=((a_sm, d_sm),)),
                                  plgpu.ACC((CHUNK, CHUNK)))[0]
                # Y = B D: A D's entries in B's blocks (A's below the diagonal inside
                # each 2*blk block), as D is block diagonal
                y_sm[...] = jnp.where((ri // (2 * blk) == ci // (2 * blk))
                                      & (ri // blk != ci // blk), y, 0.0).astype(f16)
                plgpu.commit_smem()
                dd = dd - pl.run_scoped(functools.partial(_mma, pairs=((d_sm, y_sm),)),
                                        plgpu.ACC((CHUNK, CHUNK)))[0]
            m_s[...] = (dd * cols(load(b_s, col_vec))).astype(dt)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(m_s, m_g.at[c, h])
            plgpu.wait_smem_to_gmem(0)

    return plgpu.kernel(
        gdn_intra_mgpu,
        out_type=jax.ShapeDtypeStruct((C, Hv, CHUNK, CHUNK), dt),
        scratch_types=[
            plgpu.SMEM((CHUNK, dk), dt, transforms=tr16),        # k
            plgpu.SMEM((CHUNK,), jnp.float32),                   # gamma
            plgpu.SMEM((CHUNK,), jnp.float32),                   # beta
            *(plgpu.SMEM((CHUNK, CHUNK), f16, transforms=tr16),) * 3,  # A, D, Y
            plgpu.SMEM((CHUNK, CHUNK), dt, transforms=tr16),     # M
            plgpu.Barrier(num_barriers=3),
        ],
        grid=(C, Hv),
        grid_names=("c", "h"),
        compiler_params=_compiler_params(),
    )(start, lo, hi, k, gam, beta)


def _compiler_params():
    """Both launches: lane semantics, and the fast (approximate) exp. Every exponent
    here is a gate difference <= 0 whose result multiplies 16-bit operands, so the
    approximation's ~2 ulp of float32 vanish under their rounding (outputs moved by
    3e-5 relative, against 1e-2 for bf16 itself), and the exps are a large share of
    each warpgroup's instructions: at 1x8192 Hk16 Hv64 the sequential launch went
    0.249 -> 0.225 ms and the intra launch 0.153 -> 0.147 (bench/RESULTS.md, prefill
    run 8)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    return plgpu.CompilerParams(approx_math=True,
                                lowering_semantics=plgpu.LoweringSemantics.Lane)


def _mma(*accs, pairs):
    """accs[i] = x_i y_i, one wgmma group; y_i in SMEM, x_i in SMEM or in registers
    (a 16-bit array in the WGMMA layout)."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    for acc, (x, y) in zip(accs, pairs):
        plgpu.wgmma(acc, x, y)
    plgpu.wgmma_wait(0)
    return [acc[...] for acc in accs]


def _zero_rows_outside(ref, lo, hi):
    """Zero the rows of a 64-row SMEM tile outside [lo, hi), in place."""
    from jax.experimental.pallas import mosaic_gpu as plgpu
    wg = plgpu.Layout.WGMMA
    r = plgpu.broadcasted_iota(jnp.int32, ref.shape, 0, layout=wg)
    x = load(ref, wg)
    ref[...] = jnp.where((r >= lo) & (r < hi), x, 0)
    plgpu.commit_smem()
