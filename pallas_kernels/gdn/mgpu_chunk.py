"""The sequential launch of the Mosaic GPU GDN prefill (``mgpu.py``): each (sequence,
value head) chain of chunk states, its state tile in wgmma registers, over three
warpgroups (``chunk_pass_mgpu``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._mgpu import approx_math_params, load, mma, store_rows, wgmma_transforms, zero_rows_outside
from .reference import CHUNK


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
                    zero_rows_outside(k_c, lo, hi)
                    zero_rows_outside(v_s.at[slot], lo, hi)

                plgpu.barrier_arrive(zeroed.at[slot])

                @pl.when(i >= 2)  # wg 1 is done with chunk i - 2's S and Vd
                def _():
                    plgpu.barrier_wait(s_free.at[slot])

                s_s.at[slot][...] = S.astype(dt)
                plgpu.commit_smem()
                ks = pl.run_scoped(functools.partial(mma, pairs=((k_c, s_s.at[slot]),)),
                                   plgpu.ACC((CHUNK, bw)))[0]
                g_r = load(g_c, row_vec)
                vin = load(v_s.at[slot], wg).astype(jnp.float32)
                w_c[...] = (vin - rows(jnp.exp(g_r)) * ks).astype(dt)
                plgpu.commit_smem()
                vd = pl.run_scoped(functools.partial(mma, pairs=((m_s.at[slot], w_c),)),
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
                    functools.partial(mma, pairs=((q_c, k_s.at[slot].transpose((1, 0))),)),
                    plgpu.ACC((CHUNK, CHUNK)))[0]
                g_r, g_col = load(g_c, row_vec), load(g_c, col_vec)
                diff = (lax.broadcast_in_dim(g_r, (CHUNK, CHUNK), [0])
                        - lax.broadcast_in_dim(g_col, (CHUNK, CHUNK), [1]))
                # P stays in registers: a wgmma's left operand may (no SMEM store)
                p = jnp.where(causal, qk * jnp.exp(jnp.where(causal, diff, 0.0)),
                              0.0).astype(dt)
                plgpu.barrier_wait(ready.at[slot])
                qs, pv = pl.run_scoped(
                    functools.partial(mma, pairs=((q_c, s_s.at[slot]), (p, vd_s.at[slot]))),
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
        compiler_params=approx_math_params(),
    )
    args = (cu, seq_first, seq_nchunks, q, k, v, m, gam) + ((init,) if has_init else ())
    if n_snap:
        args += tuple(snaps[name] for name in ("lo", "hi", "r", "row", "gamma"))
    return kernel(*args)
