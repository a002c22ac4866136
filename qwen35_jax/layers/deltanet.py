"""Gated DeltaNet (the ``linear_attention`` layers).

Separate ``in_proj_qkv / z / b / a`` projections; a causal depthwise conv with
SiLU over ``[q | k | v]``; value head ``h`` reads key head ``h // (Hv/Hk)``;
L2-normalised q/k; ``beta = sigmoid(b)``; ``g = -exp(A_log)·softplus(a + dt_bias)``
in float32; gated RMSNorm on the output.  The delta rule and the conv run
through ``pallas_kernels`` (chunked for prompts; recurrent in a decode step: one
token a sequence, or a verify step's few, the conv a launch a position and the delta
rule one launch that carries each state across them, each position's state stored in
a row of its own), reading and writing each sequence's state in the slot pool.  A prefill step
with snapshot ends (prefix caching, see ``batch.py``) also scatters the states
the kernels emit there into their rows.

On a mesh the kernels run per device (``sharding.per_device``): the delta rule on
the device's value heads (``tensor``, as the recurrent state pool is split), with
the key heads they read; the conv on every channel, as its pool and the qkv
projection are replicated.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallas_kernels import causal_conv1d_prefill, causal_conv1d_update, gdn_decode, gdn_prefill
from qwen35_jax.layers.linear import Linear, project
from qwen35_jax.layers.norms import GatedRMSNorm
from qwen35_jax.sharding import head_axis, per_device


class GatedDeltaNet(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d = cfg.hidden_size
        self.hk, self.hv = cfg.linear_num_key_heads, cfg.linear_num_value_heads
        self.dk, self.dv = cfg.linear_key_head_dim, cfg.linear_value_head_dim
        conv_dim, hv = cfg.conv_dim, self.hv
        self.in_proj_qkv = Linear(d, conv_dim, rngs=rngs, dtype=dtype)
        self.in_proj_z = Linear(d, hv * self.dv, rngs=rngs, dtype=dtype)
        self.in_proj_b = Linear(d, hv, rngs=rngs, dtype=dtype)
        self.in_proj_a = Linear(d, hv, rngs=rngs, dtype=dtype)
        self.conv1d = nnx.Param(
            nnx.initializers.normal(0.5)(rngs.params(), (conv_dim, cfg.linear_conv_kernel_dim), dtype))
        # Decay parameters stay float32 whatever the model dtype: g is computed in float32.
        self.A_log = nnx.Param(jnp.log(jax.random.uniform(rngs.params(), (hv,), jnp.float32, 1.0, 16.0)))
        self.dt_bias = nnx.Param(jnp.ones((hv,), jnp.float32))
        self.norm = GatedRMSNorm(self.dv, cfg.rms_norm_eps, dtype=dtype)
        self.out_proj = Linear(hv * self.dv, d, rngs=rngs, dtype=dtype)

    def __call__(self, x, conv_pool, ssm_pool, layer, meta):
        """x: [T, D] normed hidden.  conv_pool [P, L, K-1, C] and ssm_pool [P, L, Hv, dk, dv]
        hold every GDN layer's state per slot; ``layer`` (traced) picks this one."""
        t = x.shape[0]
        mixed, z, b, a = project(x, layer, self.in_proj_qkv, self.in_proj_z, self.in_proj_b,
                                 self.in_proj_a)
        w = self.conv1d[...]
        whole = (P(),) * 4
        if meta.is_decode:
            plan = _decode_plan(meta, t, conv_pool.shape[0])
            update = per_device(lambda x, w, pool, idx, out: causal_conv1d_update(
                x, w, pool, idx, out_slots=out, activation="silu"), whole + (P(),),
                (P(), P()))

            def conv(x, pool, idx, out):
                y, pool = update(x, w, pool, idx, out)
                return (y,), pool
            (mixed,), conv_pool = _per_position(plan, conv, (mixed,), conv_pool, layer)
        else:
            init = _gather_state(conv_pool, meta, layer)
            ends = () if meta.snapshot_ends is None else (meta.snapshot_ends,)
            prefill = per_device(lambda x, w, cu, init, *ends: causal_conv1d_prefill(
                x, w, cu_seqlens=cu, initial_state=init, activation="silu",
                snapshot_ends=ends[0] if ends else None),
                whole + (P(),) * len(ends), (P(),) * (2 + len(ends)))
            mixed, final, *snaps = prefill(mixed, w, meta.cu_seqlens, init, *ends)
            conv_pool = _store(conv_pool, layer, meta, final, snaps)
        qk = self.hk * self.dk
        q = mixed[:, :qk].reshape(t, self.hk, self.dk)
        k = mixed[:, qk:2 * qk].reshape(t, self.hk, self.dk)
        v = mixed[:, 2 * qk:].reshape(t, self.hv, self.dv)
        z = z.reshape(t, self.hv, self.dv)
        beta = jax.nn.sigmoid(b)
        a = a.astype(jnp.float32)
        g = -jnp.exp(self.A_log[...]) * jax.nn.softplus(a + self.dt_bias[...])
        mesh = jax.sharding.get_abstract_mesh()
        split = head_axis(mesh, self.hv)
        if split is not None and head_axis(mesh, self.hk) is None:
            # value heads split where key heads cannot be: give each value head its own key
            q, k = (jnp.repeat(y, self.hv // self.hk, axis=1) for y in (q, k))
        heads, per_head, state = P(None, split, None), P(None, split), P(None, split, None, None)
        specs = (heads, heads, heads, per_head, per_head, state, P())
        if meta.is_decode and plan[0][0] is None:  # one token a sequence
            decode = per_device(lambda *a: gdn_decode(*a[:7], out_slots=a[7],
                                                      use_qk_l2norm=True),
                                specs + (P(),), (heads, state))

            def rule(q, k, v, g, beta, pool, idx, out):
                o, pool = decode(q, k, v, g, beta, pool, idx, out)
                return (o,), pool
            (o,), ssm_pool = _per_position(plan, rule, (q, k, v, g, beta), ssm_pool, layer)
        elif meta.is_decode:  # a verify step's tokens: the state read once, stored after each
            o, ssm_pool = _verify(plan, (q, k, v, g, beta), ssm_pool, layer, split, meta)
        else:
            init = _gather_state(ssm_pool, meta, layer).astype(jnp.float32)
            ends = () if meta.snapshot_ends is None else (meta.snapshot_ends,)
            prefill = per_device(_gdn_prefill, specs + (P(),) * len(ends),
                                 (heads, state) + (state,) * len(ends))
            o, final, *snaps = prefill(q, k, v, g, beta, init, meta.cu_seqlens, *ends)
            ssm_pool = _store(ssm_pool, layer, meta, final, snaps)
        o = self.norm(o, z).reshape(t, self.hv * self.dv)
        return self.out_proj(o, layer), conv_pool, ssm_pool


def _gdn_prefill(q, k, v, g, beta, init, cu_seqlens, *ends):
    """``gdn_prefill`` on one packed row: q, k, v [T, H, d]; g, beta [T, Hv]; returns
    (o, final) and the snapshots at ``ends[0]`` when given."""
    o, *states = gdn_prefill(q[None], k[None], v[None], g[None], beta[None],
                             initial_state=init, cu_seqlens=cu_seqlens, use_qk_l2norm=True,
                             snapshot_ends=ends[0] if ends else None)
    return (o[0], *states)


def _store(pool, layer, meta, final, snaps):
    """Write each sequence's final state to its slot and the snapshots to their rows."""
    pool = pool.at[meta.slots, layer].set(final.astype(pool.dtype), mode="drop")
    if snaps:
        pool = pool.at[meta.snapshot_slots, layer].set(snaps[0].astype(pool.dtype), mode="drop")
    return pool


def _gather_state(pool, meta, layer):
    """Initial state of each sequence: its init_slots row's state if it has cached tokens,
    else zeros (slots are never zeroed in memory: a fresh sequence simply does not read
    them)."""
    state = pool.at[meta.init_slots, layer].get(mode="fill", fill_value=0)
    keep = meta.has_state.reshape((-1,) + (1,) * (state.ndim - 1))
    return jnp.where(keep, state, jnp.zeros_like(state))


def _decode_plan(meta, t: int, p: int):
    """A decode step's GDN work, per position r of its sequences' tokens (one, or a
    verify step's few): the packed row of each sequence's r-th token (``t``: none), the
    state row it reads (``init_slots``, then the row the previous position wrote; ``p``,
    past the pool: none) and the row it writes (after a sequence's last token its slot;
    after any other, the snapshot row whose end is just past that token)."""
    n = meta.slots.shape[0]
    if t == n:  # one token a sequence, in its own row
        return [(None, meta.init_slots, meta.slots)]
    cu = meta.cu_seqlens
    lens = cu[1:] - cu[:-1]
    read, plan = meta.init_slots, []
    for r in range(t // n):
        row = cu[:-1] + r
        live = r < lens
        snap = jnp.full((n,), p, jnp.int32)
        if meta.snapshot_ends is not None:
            kept = meta.snapshot_ends[None, :] == row[:, None] + 1  # [N, S]
            snap = jnp.where(kept.any(1), meta.snapshot_slots[jnp.argmax(kept, 1)], p)
        write = jnp.where(r == lens - 1, meta.slots, jnp.where(live, snap, p))
        plan.append((jnp.where(live, row, t), jnp.where(live, read, p), write))
        read = write
    return plan


def _verify(plan, xs, pool, layer, split, meta):
    """The delta rule over a verify step's tokens in one launch (``gdn_decode`` with R
    positions): each sequence's state read once from the first position's row, written
    after each token to the row ``plan`` names for it. (o [T, Hv, dv], pool)."""
    p, l = pool.shape[:2]
    rows = jnp.stack([r for r, _, _ in plan], axis=1)  # [N, R]; T: no token
    writes = jnp.stack([w for _, _, w in plan], axis=1)
    idx, out = (jnp.where((r >= 0) & (r < p), r * l + layer, p * l)
                for r in (plan[0][1], writes))
    lengths = meta.cu_seqlens[1:] - meta.cu_seqlens[:-1]
    heads, per_head = P(None, None, split, None), P(None, None, split)
    decode = per_device(lambda q, k, v, g, beta, pool, idx, out, lengths: gdn_decode(
        q, k, v, g, beta, pool, idx, out_slots=out, lengths=lengths, use_qk_l2norm=True),
        (heads, heads, heads, per_head, per_head, P(None, split, None, None), P(), P(), P()),
        (heads, P(None, split, None, None)))
    ins = [x.at[rows].get(mode="fill", fill_value=0) for x in xs]
    flat = pool.reshape((p * l,) + pool.shape[2:])
    o, flat = decode(*ins, flat, idx, out, lengths)
    o = jnp.zeros((xs[0].shape[0],) + o.shape[2:], o.dtype).at[rows].set(o, mode="drop")
    return o, flat.reshape(pool.shape)


def _per_position(plan, step, xs, pool, layer):
    """Run ``step(*inputs, flat_pool, read, write) -> (outputs, flat_pool)``, a decode kernel
    over one token a sequence, at each position of ``plan`` on this layer's rows of
    ``pool`` ``[P, L, ...]``: each position's rows of ``xs`` ([T, ...] each) in, its
    outputs scattered back to those rows. (outputs, pool)."""
    p, l = pool.shape[:2]
    flat = pool.reshape((p * l,) + pool.shape[2:])
    outs = None
    for rows, read, write in plan:
        idx, out = (jnp.where((r >= 0) & (r < p), r * l + layer, p * l) for r in (read, write))
        if rows is None:
            outs, flat = step(*xs, flat, idx, out)
            continue
        ys, flat = step(*(x.at[rows].get(mode="fill", fill_value=0) for x in xs), flat, idx,
                        out)
        if outs is None:
            outs = [jnp.zeros((xs[0].shape[0],) + y.shape[1:], y.dtype) for y in ys]
        outs = [o.at[rows].set(y, mode="drop") for o, y in zip(outs, ys)]
    return tuple(outs), flat.reshape(pool.shape)
