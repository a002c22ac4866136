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

This module is the op's entry (``gdn_prefill_mgpu``) and what the dispatch asks of it
(``takes``, ``v_tiles_for``); the sequential launch lives in ``mgpu_chunk.py``, the
intra launch in ``mgpu_intra.py``, their tables in ``mgpu_tables.py``.
"""
from __future__ import annotations

import jax.numpy as jnp

from .mgpu_chunk import chunk_pass_mgpu, takes
from .mgpu_intra import intra_mgpu
from .mgpu_tables import block_table, per_block, snapshot_table
from .reference import l2norm

__all__ = ["gdn_prefill_mgpu", "takes", "v_tiles_for"]  # what the dispatch (pallas_triton) calls

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
    gam = jnp.cumsum(per_block(g, tab), axis=-1)
    m = intra_mgpu(tab["start"], tab["lo"], tab["hi"], k, gam, per_block(beta, tab),
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
