"""Where the Mosaic GPU GDN prefill's chunks and snapshots lie (``mgpu.py``): chunks on
the 64-row grid of the packed token axis, cut at sequence boundaries (``block_table``),
per-chunk views of per-token values (``per_block``), and the chunk each snapshot falls
in (``snapshot_table``). Plain JAX or NumPy, so the CPU suite checks them.
"""
from __future__ import annotations

import jax.numpy as jnp
import numpy as np

from .reference import CHUNK, locate_snapshots


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


def per_block(x, tab):
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
