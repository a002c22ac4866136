"""Gated full attention: per-head ``[q | gate]`` projection, (1+w) q/k norms,
partial RoPE, GQA over the paged KV cache, ``sigmoid(gate)`` on the output.

On a mesh the attention kernel runs per device (``sharding.per_device``) on the KV
heads of the device's cache shard and their query heads; where the KV heads do not
divide over ``tensor`` (the cache is then replicated) every device runs all heads.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from pallas_kernels.attention import paged_attention, write_kv
from qwen35_jax.layers.linear import Linear, project
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.layers.rope import apply_partial_rope
from qwen35_jax.sharding import head_axis, per_device


class GatedAttention(nnx.Module):
    def __init__(self, cfg, *, rngs: nnx.Rngs, dtype=jnp.float32):
        h, kv, hd, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, cfg.hidden_size
        self.heads, self.kv_heads, self.head_dim = h, kv, hd
        self.rotary_dim, self.theta = cfg.rotary_dim, cfg.rope_theta
        self.q_proj = Linear(d, 2 * h * hd, rngs=rngs, dtype=dtype)
        self.k_proj = Linear(d, kv * hd, rngs=rngs, dtype=dtype)
        self.v_proj = Linear(d, kv * hd, rngs=rngs, dtype=dtype)
        self.o_proj = Linear(h * hd, d, rngs=rngs, dtype=dtype)
        self.q_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)
        self.k_norm = RMSNorm(hd, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, x, kv_cache, layer, meta):
        """x: [T, D] normed hidden; returns ([T, D], kv_cache with this step's K/V stored)."""
        t = x.shape[0]
        qg, k, v = project(x, layer, self.q_proj, self.k_proj, self.v_proj)
        qg = qg.reshape(t, self.heads, 2 * self.head_dim)
        q, gate = qg[..., :self.head_dim], qg[..., self.head_dim:]
        k = k.reshape(t, self.kv_heads, self.head_dim)
        v = v.reshape(t, self.kv_heads, self.head_dim)
        rope = dict(rotary_dim=self.rotary_dim, theta=self.theta)
        q = apply_partial_rope(self.q_norm(q), meta.positions, **rope)
        k = apply_partial_rope(self.k_norm(k), meta.positions, **rope)
        kv_cache = write_kv(kv_cache, layer, k, v, meta.kv_block_ids, meta.kv_offsets)
        split = head_axis(jax.sharding.get_abstract_mesh(), self.kv_heads)
        heads = P(None, split, None)

        def attend(q, kv, layer, block_tables, seq_ids, positions, cu_seqlens):
            return paged_attention(q, kv, layer, block_tables, seq_ids, positions,
                                   scale=self.head_dim ** -0.5, cu_seqlens=cu_seqlens,
                                   is_decode=meta.is_decode)

        o = per_device(attend, (heads, P(None, None, None, None, split, None)) + (P(),) * 5,
                       heads)(q, kv_cache, layer, meta.block_tables, meta.seq_ids,
                              meta.positions, meta.cu_seqlens)
        o = o.reshape(t, self.heads * self.head_dim) * jax.nn.sigmoid(gate.reshape(t, -1))
        return self.o_proj(o, layer), kv_cache
