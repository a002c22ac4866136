"""The intra launch of the Mosaic GPU GDN prefill (``mgpu.py``): each chunk's
M = T diag(beta), T inverted by recursive doubling (``intra_mgpu``).
"""
from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax import lax

from .._mgpu import approx_math_params, load, mma, wgmma_transforms, zero_rows_outside
from .reference import CHUNK


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
                zero_rows_outside(k_s, lo, hi)

            kk = pl.run_scoped(functools.partial(mma, pairs=((k_s, k_s.transpose((1, 0))),)),
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
                y = pl.run_scoped(functools.partial(mma, pairs=((a_sm, d_sm),)),
                                  plgpu.ACC((CHUNK, CHUNK)))[0]
                # Y = B D: A D's entries in B's blocks (A's below the diagonal inside
                # each 2*blk block), as D is block diagonal
                y_sm[...] = jnp.where((ri // (2 * blk) == ci // (2 * blk))
                                      & (ri // blk != ci // blk), y, 0.0).astype(f16)
                plgpu.commit_smem()
                dd = dd - pl.run_scoped(functools.partial(mma, pairs=((d_sm, y_sm),)),
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
        compiler_params=approx_math_params(),
    )(start, lo, hi, k, gam, beta)
