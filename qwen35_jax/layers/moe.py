"""Sparse MoE block: softmax router, top-k, always renormalised, plus a shared
expert scaled by a sigmoid gate.

Experts run as two grouped matmuls over the token copies sorted by expert
(never a Python loop over experts), so the work is proportional to the routed
tokens and the program does not grow with the expert count.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from pallas_kernels.grouped_matmul import grouped_matmul
from qwen35_jax.layers.mlp import MLP, linear


class MoE(nnx.Module):
    def __init__(self, hidden: int, num_experts: int, top_k: int, inter: int, shared_inter: int,
                 *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.num_experts, self.top_k, self.inter = num_experts, top_k, inter
        init = nnx.initializers.normal(0.02)
        self.router = linear(hidden, num_experts, rngs, dtype)
        # Fused [gate | up] per expert, stored [E, in, out] for x @ w.
        self.experts_gate_up = nnx.Param(init(rngs.params(), (num_experts, hidden, 2 * inter), dtype))
        self.experts_down = nnx.Param(init(rngs.params(), (num_experts, inter, hidden), dtype))
        self.shared_expert = MLP(hidden, shared_inter, rngs=rngs, dtype=dtype)
        self.shared_expert_gate = linear(hidden, 1, rngs, dtype)

    def route(self, x):
        """Top-k experts and their renormalised weights per token: ([T, k] int32, [T, k])."""
        logits = self.router(x)
        probs = jax.nn.softmax(logits.astype(jnp.float32), axis=-1)
        weights, experts = jax.lax.top_k(probs, self.top_k)
        weights = weights / jnp.sum(weights, axis=-1, keepdims=True)
        return experts, weights.astype(logits.dtype)

    def __call__(self, x):
        t, d = x.shape
        experts, weights = self.route(x)
        flat = experts.reshape(-1)
        order = jnp.argsort(flat, stable=True)
        token_of = order // self.top_k
        group_sizes = jnp.bincount(flat, length=self.num_experts).astype(jnp.int32)
        gate_up = grouped_matmul(x[token_of], self.experts_gate_up[...], group_sizes)
        act = jax.nn.silu(gate_up[:, :self.inter]) * gate_up[:, self.inter:]
        out = grouped_matmul(act, self.experts_down[...], group_sizes)
        out = out * weights.reshape(-1)[order][:, None]
        routed = jnp.zeros((t, d), jnp.float32).at[token_of].add(out.astype(jnp.float32))
        shared = jax.nn.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return (routed + shared.astype(jnp.float32)).astype(x.dtype)
