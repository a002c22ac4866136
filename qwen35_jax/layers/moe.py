"""Sparse MoE block: softmax router, top-k, always renormalised, plus a shared
expert scaled by a sigmoid gate.

Experts run as two grouped matmuls over the token copies sorted by expert
(never a Python loop over experts), so the work is proportional to the routed
tokens and the program does not grow with the expert count.

Expert parallelism: when the step is traced under a mesh whose expert axes
(``qwen35_jax.sharding.expert_axes``) hold more than one device, the experts run
inside ``shard_map``: each device holds ``E / n`` experts, takes every token of
its data shard, computes the copies routed to its own experts (the others sort
past its groups and are masked) and a ``psum`` over the expert axes adds the
partial outputs.  Routing stays outside, so every shard sees the same top-k.  The
single-device path is the same function with all experts local.

Stacked experts: the scanned model (model.py) passes each layer's expert weights as the
whole stack over layers ([..., E, in, out]) with the layer's flat index, and the grouped
matmul reads that layer's experts in place. Slicing a layer out of the stack inside the
scan made XLA copy every layer's experts on every step (half of a 35B-A3B decode step on
an H200: bench/RESULTS.md, "Decode step: profile, then fix").
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallas_kernels.grouped_matmul import grouped_matmul
from qwen35_jax.layers.linear import Linear, project
from qwen35_jax.layers.mlp import MLP
from qwen35_jax.sharding import DATA, axis_size, expert_axes


class MoE(nnx.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int,
                 *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        init = nnx.initializers.normal(0.02)
        self.router = Linear(hidden, num_experts, rngs=rngs, dtype=dtype)
        # Fused [gate | up] per expert, stored [E, in, out] for x @ w (FP8: [E, out, in],
        # quant.quantize_model).
        self.experts_gate_up = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * inter), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (num_experts, inter, hidden), dtype))
        self.shared_expert = MLP(hidden, shared_inter, rngs=rngs, dtype=dtype)
        self.shared_expert_gate = Linear(hidden, 1, rngs=rngs, dtype=dtype)

    def route(self, logits):
        """Top-k experts and their renormalised weights per token, from the router's
        logits: ([T, k] int32, [T, k])."""
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts, weights.astype(logits.dtype)

    def __call__(self, x, layer=None):
        """`layer`: the flat index of this layer in the leading (stacked) dimensions of
        the expert weights; needed only when they are stacked."""
        se = self.shared_expert
        logits, gate, up, shared_logit = project(x, layer, self.router, se.gate_proj,
                                                 se.up_proj, self.shared_expert_gate)
        experts, weights = self.route(logits)
        w_gate_up, w_down = self.experts_gate_up[...], self.experts_down[...]
        if w_down.ndim > 3 and layer is None:
            raise ValueError(f"expert weights stacked as {w_down.shape} need the layer index")
        # FP8 (quant.py): the block scales travel beside the weights, stacked alike
        scales = ((self.experts_gate_up_scale[...], self.experts_down_scale[...])
                  if hasattr(self, "experts_down_scale") else None)
        expert_layer = jnp.asarray(0 if layer is None else layer, jnp.int32)
        mesh = jax.sharding.get_abstract_mesh()
        axes = () if mesh.empty else expert_axes(mesh, self.num_experts)
        if axis_size(mesh, axes) > 1:
            routed = _expert_parallel(mesh, axes, x, experts, weights, w_gate_up, w_down,
                                      scales, expert_layer)
        else:
            routed = _local_experts(x, experts, weights, w_gate_up, w_down, scales, 0,
                                    expert_layer)
        shared = jax.nn.sigmoid(shared_logit) * se.down(gate, up, layer)
        return (routed + shared.astype(jnp.float32)).astype(x.dtype)


def _local_experts(x, experts, weights, w_gate_up, w_down, scales, first, layer):
    """Float32 [T, D] sum of the routed copies that go to experts ``first ..
    first + n_local - 1`` (the weights held here, [..., n_local, in, out], stacked
    over layers in the leading dimensions; this is flat layer `layer`; ``scales``: FP8
    weights' block scales, stacked alike, or None, the FP8 weights then K-major); other
    copies contribute 0."""
    t, d = x.shape
    n_local = w_down.shape[-3]
    flat = lambda a: a.reshape((-1,) + a.shape[-2:])  # noqa: E731
    w_gate_up, w_down = flat(w_gate_up), flat(w_down)
    s_gate_up, s_down = (None, None) if scales is None else map(flat, scales)
    offset = layer * n_local
    top_k = experts.shape[1]
    local = experts.reshape(-1) - first
    mine = (local >= 0) & (local < n_local)
    key = jnp.where(mine, local, n_local)  # foreign copies sort after every local group
    order = jnp.argsort(key, stable=True)
    token_of = order // top_k
    group_sizes = jnp.bincount(key, length=n_local + 1)[:n_local].astype(jnp.int32)
    gate_up = grouped_matmul(x[token_of], w_gate_up, group_sizes, group_offset=offset,
                             scale=s_gate_up, splits=2)
    inter = gate_up.shape[1] // 2
    act = jax.nn.silu(gate_up[:, :inter]) * gate_up[:, inter:]
    out = grouped_matmul(act, w_down, group_sizes, group_offset=offset, scale=s_down)
    # Combine by gathering each token's k copies back (the inverse permutation) and
    # summing them: a gather, ~7x cheaper on the GPU than a scatter-add of the sorted
    # copies into [T, D] (bench/RESULTS.md, MoE combine).
    slot = jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype),
                                               unique_indices=True)
    # Foreign copies' rows were never written (a where, not a product: they may be NaN).
    copies = out[slot].reshape(t, top_k, d).astype(jnp.float32)
    copies = jnp.where(mine.reshape(t, top_k, 1), copies * weights[..., None], 0)
    return jnp.sum(copies, axis=1)


def _expert_parallel(mesh, axes, x, experts, weights, w_gate_up, w_down, scales, layer):
    """``_local_experts`` on each expert shard, summed over the expert axes.

    Tokens stay split along ``data`` (each data shard routes its own tokens) and are
    replicated over the expert axes, so no token moves before the matmuls; the one
    collective is the psum of the [T, D] partial outputs (a reduce-scatter + all-gather
    pair), the equivalent of the all-to-all dispatch and combine when every expert
    shard already holds every token."""
    rows = P(DATA if DATA in mesh.shape else None)
    n_local = w_down.shape[-3] // axis_size(mesh, axes)
    split = P(*(None,) * (w_down.ndim - 3), axes)  # the expert dimension, after the stack's

    def body(x, experts, weights, w_gate_up, w_down, scales, layer):
        first = jax.lax.axis_index(axes) * n_local
        return jax.lax.psum(
            _local_experts(x, experts, weights, w_gate_up, w_down, scales, first, layer),
            axes)

    # No check_vma: the grouped matmul is a Pallas call, whose output types carry no
    # mesh-axis variance (jax 0.11 refuses them inside a checked shard_map), as in
    # `sharding.per_device`; the psum makes the result the same on every expert shard.
    scale_spec = None if scales is None else (split, split)
    return jax.shard_map(body, mesh=mesh,
                         in_specs=(rows, rows, rows, split, split, scale_spec, P()),
                         out_specs=rows, check_vma=False)(x, experts, weights, w_gate_up,
                                                          w_down, scales, layer)
