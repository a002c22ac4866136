"""Pure-JAX references for the short causal depthwise conv1d before GDN.

x [T, C] packed tokens; weight [C, K]: tap j multiplies x[t - (K-1) + j].
Conv state per sequence: the previous K-1 inputs, oldest first, [K-1, C].
"""
from __future__ import annotations

import jax
import jax.numpy as jnp


def _act(y, activation):
    if activation is None:
        return y
    if activation in ("silu", "swish"):
        return y * jax.nn.sigmoid(y)
    raise ValueError(f"unsupported activation {activation!r}")


def token_positions(cu, T):
    """pos [T] = t - cu[seq(t)] for tokens inside a sequence, -1 for padding
    (t >= cu[N]); seq [T] (clipped to N-1)."""
    N = cu.shape[0] - 1
    t = jnp.arange(T, dtype=jnp.int32)
    # compare_all: one fused kernel (the default searchsorted is a loop of kernels on GPU)
    seq = jnp.searchsorted(cu[1:], t, side="right", method="compare_all").astype(jnp.int32)
    seq = jnp.minimum(seq, N - 1)
    valid = (t < cu[N]) & (t >= cu[0])
    pos = jnp.where(valid, t - cu[:-1][seq], -1)
    return pos.astype(jnp.int32), seq


def conv1d_final_state(x, cu, initial_state, K):
    """Last K-1 inputs of each sequence [N, K-1, C] (drawing on initial_state
    when the sequence is shorter than K-1)."""
    N = cu.shape[0] - 1
    return conv1d_states_at(x, cu, initial_state, K, cu[1:], jnp.arange(N, dtype=jnp.int32))


def conv1d_states_at(x, cu, initial_state, K, ends, seq):
    """The conv state after the tokens of sequence seq[s] before packed index ends[s]:
    its last K-1 inputs there [S, K-1, C], drawing on the sequence's initial_state
    where fewer than K-1 of its tokens precede the end."""
    T, C = x.shape
    i = jnp.arange(K - 1, dtype=jnp.int32)
    rel = (ends - cu[:-1][seq])[:, None] - (K - 1) + i[None, :]  # relative to sequence start
    from_x = x[jnp.clip(cu[:-1][seq][:, None] + rel, 0, max(T - 1, 0))]
    if initial_state is None:
        from_init = jnp.zeros(rel.shape + (C,), x.dtype)
    else:
        from_init = jnp.take_along_axis(
            initial_state.astype(x.dtype)[seq],
            jnp.clip(K - 1 + rel, 0, K - 2)[:, :, None], axis=1)
    return jnp.where((rel >= 0)[..., None], from_x, from_init)


def causal_conv1d_prefill_reference(x, weight, *, cu_seqlens, initial_state=None,
                                    activation="silu"):
    T, C = x.shape
    K = weight.shape[1]
    cu = jnp.asarray(cu_seqlens).astype(jnp.int32)
    N = cu.shape[0] - 1
    pos, seq = token_positions(cu, T)
    xf = x.astype(jnp.float32)
    wf = weight.astype(jnp.float32)
    init = (jnp.zeros((N, K - 1, C), jnp.float32) if initial_state is None
            else initial_state.astype(jnp.float32))
    t = jnp.arange(T, dtype=jnp.int32)
    acc = jnp.zeros((T, C), jnp.float32)
    for j in range(K):
        src = t - (K - 1) + j
        in_seq = pos >= (K - 1 - j)
        xv = xf[jnp.clip(src, 0, T - 1)]
        iv = init[seq, jnp.clip(pos + j, 0, K - 2)]
        val = jnp.where(in_seq[:, None], xv, jnp.where((pos >= 0)[:, None], iv, 0.0))
        acc = acc + val * wf[:, j][None, :]
    y = _act(acc, activation)
    y = jnp.where((pos >= 0)[:, None], y, 0.0).astype(x.dtype)
    fin = conv1d_final_state(x, cu, initial_state, K)
    return y, fin


def causal_conv1d_update_reference(x, weight, state_pool, slots, out_slots=None, *,
                                   activation="silu"):
    """``ops.causal_conv1d_update``'s contract, in jnp."""
    P = state_pool.shape[0]
    slots = slots.astype(jnp.int32)
    valid = (slots >= 0) & (slots < P)
    sc = jnp.where(valid, slots, 0)
    st = state_pool[sc]  # [N, K-1, C]
    win = jnp.concatenate([st.astype(jnp.float32), x.astype(jnp.float32)[:, None, :]], 1)
    y = jnp.einsum("nkc,ck->nc", win, weight.astype(jnp.float32))
    y = _act(y, activation)
    y = jnp.where(valid[:, None], y, 0.0).astype(x.dtype)
    new = jnp.concatenate([st[:, 1:], x.astype(state_pool.dtype)[:, None, :]], 1)
    out_slots = slots if out_slots is None else out_slots.astype(jnp.int32)
    pool = state_pool.at[jnp.where(valid & (out_slots >= 0), out_slots, P)].set(new, mode="drop")
    return y, pool
