"""Paged attention in plain JAX: the CPU path and the oracle for GPU kernels.

The cache is block-major, ``kv[num_blocks, L, 2, block_size, KV, head_dim]``, so
that one block of every layer is one contiguous region (one transfer
descriptor per run of blocks).  Layer ``layer`` is selected by a traced index,
which lets a ``lax.scan`` over layers carry the whole cache and update it in
place.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_kv(kv, layer, k, v, block_ids, offsets):
    """Store new keys/values ``k, v [T, KV, hd]`` at (block, offset) of ``layer``.

    Padding tokens carry ``block_ids >= num_blocks`` and are dropped, so a
    padded step never writes a block it does not own.
    """
    kv = kv.at[block_ids, layer, 0, offsets].set(k.astype(kv.dtype), mode="drop")
    return kv.at[block_ids, layer, 1, offsets].set(v.astype(kv.dtype), mode="drop")


def paged_attention_reference(q, kv, layer, block_tables, seq_ids, positions, *, scale):
    """Causal attention of packed queries over their sequences' paged keys.

    q: [T, H, hd]; block_tables: [N, M]; seq_ids, positions: [T] (sequence of
    each query token, clipped to a valid index, and its absolute position).
    A query at position p sees keys at positions 0..p of its own sequence.
    Returns [T, H, hd] in q's dtype; softmax in float32.
    """
    t, h, hd = q.shape
    n, m = block_tables.shape
    bs, kvh = kv.shape[3], kv.shape[4]
    seq_kv = kv[block_tables, layer]  # [N, M, 2, bs, KV, hd]
    keys = seq_kv[:, :, 0].reshape(n, m * bs, kvh, hd)
    vals = seq_kv[:, :, 1].reshape(n, m * bs, kvh, hd)
    qg = q.reshape(t, kvh, h // kvh, hd).astype(jnp.float32)
    k_tok = keys[seq_ids].astype(jnp.float32)  # [T, L, KV, hd]
    v_tok = vals[seq_ids].astype(jnp.float32)
    scores = jnp.einsum("tkgd,tlkd->tkgl", qg, k_tok,
                        precision=jax.lax.Precision.HIGHEST) * scale
    visible = jnp.arange(m * bs)[None, :] <= positions[:, None]  # [T, L]
    scores = jnp.where(visible[:, None, None, :], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1)
    # HF's eager attention casts the probabilities to the activation dtype
    # before the value product.
    probs = probs.astype(q.dtype).astype(jnp.float32)
    out = jnp.einsum("tkgl,tlkd->tkgd", probs, v_tok, precision=jax.lax.Precision.HIGHEST)
    return out.reshape(t, h, hd).astype(q.dtype)
