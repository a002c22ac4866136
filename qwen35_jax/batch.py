"""The ragged batch a model step runs on, and the per-token metadata derived from it.

One layout serves prompts, continued prompt chunks and decode: sequences are
packed back to back (``cu_seqlens``), each with the number of its tokens already
in the cache (``start_pos``), its GDN state slot and its KV block table.  Shapes
are static per bucket; padding tokens sit past ``cu_seqlens[-1]`` and padding
sequences have length 0 and a slot past the pool, so their writes are dropped.

Prefix caching adds two things.  A sequence's initial GDN state is read from
``init_slots`` (its own slot, or a snapshot row when a prompt continues a cached
prefix) and written to ``slots``.  A step stores the GDN state after the tokens
before each packed index in ``snapshot_ends`` into the state row ``snapshot_slots``
names (a row past the pool: none): a prefill step in the same chunk walk, a decode
step (a verify step's, with drafts) after each of its tokens.
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import struct


@struct.dataclass
class Batch:
    tokens: jnp.ndarray  # int32 [T]
    cu_seqlens: jnp.ndarray  # int32 [N+1]
    start_pos: jnp.ndarray  # int32 [N]: tokens of the sequence already cached
    slots: jnp.ndarray  # int32 [N]: GDN state slot; >= num_slots for a padding sequence
    block_tables: jnp.ndarray  # int32 [N, M]
    logits_indices: jnp.ndarray  # int32 [L]: tokens whose logits are returned
    init_slots: jnp.ndarray | None = None  # int32 [N]: initial-state row (default: slots)
    snapshot_ends: jnp.ndarray | None = None  # int32 [S]: packed exclusive token ends
    snapshot_slots: jnp.ndarray | None = None  # int32 [S]: state row of each snapshot
    # decode programs (static): every sequence continues its context from its own state
    # (read from init_slots) with one token, or with a verify step's few (T > N: the
    # tokens packed, the state after each but the last into the snapshot rows)
    is_decode: bool = struct.field(pytree_node=False, default=False)


@struct.dataclass
class StepMeta:
    """Per-token views of a Batch, computed once per step on device."""

    positions: jnp.ndarray  # [T] absolute position of each token
    seq_ids: jnp.ndarray  # [T] its sequence (clipped to a valid index for padding)
    kv_block_ids: jnp.ndarray  # [T] block its K/V goes to (num_blocks for padding: dropped)
    kv_offsets: jnp.ndarray  # [T] offset inside that block
    block_tables: jnp.ndarray
    cu_seqlens: jnp.ndarray
    slots: jnp.ndarray
    init_slots: jnp.ndarray  # [N] row of the initial state
    has_state: jnp.ndarray  # [N] bool: continue from the init_slots row's state
    snapshot_ends: jnp.ndarray | None  # [S] or None: no snapshots
    snapshot_slots: jnp.ndarray | None
    is_decode: bool = struct.field(pytree_node=False, default=False)


def step_meta(batch: Batch, *, num_blocks: int, block_size: int) -> StepMeta:
    t = batch.tokens.shape[0]
    n = batch.slots.shape[0]
    tok = jnp.arange(t, dtype=jnp.int32)
    if batch.is_decode and t == n:  # one token a sequence
        seq = tok
        valid = batch.cu_seqlens[1:] > batch.cu_seqlens[:-1]
    else:
        # compare_all: one fused kernel (the default searchsorted is a loop of kernels on GPU)
        seq = jnp.searchsorted(batch.cu_seqlens[1:], tok, side="right",
                               method="compare_all").astype(jnp.int32)
        valid = tok < batch.cu_seqlens[-1]
        seq = jnp.minimum(seq, n - 1)
    positions = batch.start_pos[seq] + tok - batch.cu_seqlens[seq]
    positions = jnp.where(valid, positions, 0)
    blk = jnp.take_along_axis(batch.block_tables[seq], (positions // block_size)[:, None], 1)[:, 0]
    return StepMeta(
        positions=positions, seq_ids=seq,
        kv_block_ids=jnp.where(valid, blk, num_blocks), kv_offsets=positions % block_size,
        block_tables=batch.block_tables, cu_seqlens=batch.cu_seqlens, slots=batch.slots,
        init_slots=batch.slots if batch.init_slots is None else batch.init_slots,
        has_state=batch.start_pos > 0, snapshot_ends=_nonempty(batch.snapshot_ends),
        snapshot_slots=_nonempty(batch.snapshot_slots), is_decode=batch.is_decode)


def _nonempty(a):
    return None if a is None or a.shape[0] == 0 else a
