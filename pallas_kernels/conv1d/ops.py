"""Public causal conv1d ops with backend dispatch."""
from __future__ import annotations

import jax.numpy as jnp

from .._dispatch import resolve
from . import reference as _ref


def causal_conv1d_prefill(x, weight, *, cu_seqlens, initial_state=None,
                          activation="silu", snapshot_ends=None, backend="auto",
                          config=None):
    """Depthwise causal conv over packed sequences.

    x [T,C]; weight [C,K] (tap j multiplies x[t-(K-1)+j]); cu_seqlens int32
    [N+1]; initial_state [N,K-1,C] (previous K-1 inputs, oldest first; None =
    zeros).  Returns (y [T,C] in x.dtype, computed in fp32, padding tokens past
    cu[N] -> 0; final_state [N,K-1,C] in x.dtype = last K-1 inputs of each
    sequence, drawing on initial_state for short sequences).

    snapshot_ends (int32 [S]): as ``gdn_prefill``'s; adds a third output [S,K-1,C] in
    x.dtype, the conv state after the tokens before each end (zero for an end inside
    no sequence).  It is a gather of inputs, the same for every backend.
    """
    b = resolve("conv1d_prefill", backend)
    if b in ("reference", "recurrent"):
        y, final = _ref.causal_conv1d_prefill_reference(
            x, weight, cu_seqlens=cu_seqlens, initial_state=initial_state,
            activation=activation)
    else:
        from .pallas_triton import causal_conv1d_prefill_pallas
        y, final = causal_conv1d_prefill_pallas(
            x, weight, cu_seqlens=cu_seqlens, initial_state=initial_state,
            activation=activation, interpret=(b == "interpret"), config=config)
    if snapshot_ends is None:
        return y, final
    from ..gdn.reference import locate_snapshots
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    seq, ok = locate_snapshots(cu, x.shape[0], snapshot_ends)
    states = _ref.conv1d_states_at(x, cu, initial_state, weight.shape[1], snapshot_ends, seq)
    return y, final, jnp.where(ok[:, None, None], states, 0)


def causal_conv1d_update(x, weight, state_pool, slots, *, out_slots=None, activation="silu",
                         backend="auto", config=None):
    """One token per sequence; state_pool [P,K-1,C]; slots int32 [N]: the row each
    sequence's state is read from, out of range = padding row (pool untouched, y 0);
    out_slots int32 [N] (default ``slots``): the row the shifted state is written to,
    none where out of range.  Rows written must not be rows another sequence reads.
    Returns (y [N,C], pool)."""
    out_slots = slots if out_slots is None else out_slots
    b = resolve("conv1d_update", backend)
    if b in ("reference", "recurrent"):
        return _ref.causal_conv1d_update_reference(x, weight, state_pool, slots, out_slots,
                                                   activation=activation)
    from .pallas_triton import causal_conv1d_update_pallas
    return causal_conv1d_update_pallas(x, weight, state_pool, slots, out_slots,
                                       activation=activation,
                                       interpret=(b == "interpret"), config=config)
