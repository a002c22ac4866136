"""Qwen35ForCausalLM: embedding, the scanned layer group, final norm, LM head.

The repeating group (``interval-1`` Gated DeltaNet layers, then one gated
attention layer) is built once with stacked parameters and run with
``lax.scan`` (the GDN layers by an inner scan), so the compiled program holds
one copy of each layer type whatever the depth.  The whole hybrid cache rides
in the scan carry and is indexed by layer, which keeps it one set of arrays
that a jitted step updates in place.

The matmul weights are the exception to scanning parameters: the MoE experts and every
``Linear`` kernel stay out of the scanned slices and reach each layer as the whole stack,
with the layer's index (``_split_whole``). A per-layer slice of a stacked parameter
feeding a GEMM or a custom call is a copy inside the loop: for the experts that copy was
every expert of every layer on every step, for the dense kernels every dense weight. The
grouped matmul reads a layer's experts from the stack, ``layer_matmul`` a layer's dense
kernel (at decode sizes; elsewhere it slices, which XLA then copies).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax.batch import Batch, step_meta
from qwen35_jax.cache import HybridCache, SequenceCache
from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.attention import GatedAttention
from qwen35_jax.layers.deltanet import GatedDeltaNet
from qwen35_jax.layers.mlp import MLP
from qwen35_jax.layers.moe import MoE
from qwen35_jax.layers.norms import RMSNorm


def _ffn(cfg: Qwen35Config, rngs, dtype):
    if cfg.is_moe:
        return MoE(cfg.hidden_size, cfg.num_experts, cfg.num_experts_per_tok,
                   cfg.moe_intermediate_size, cfg.shared_expert_intermediate_size,
                   rngs=rngs, dtype=dtype)
    return MLP(cfg.hidden_size, cfg.intermediate_size, rngs=rngs, dtype=dtype)


class GDNDecoderLayer(nnx.Module):
    def __init__(self, cfg, *, rngs, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.linear_attn = GatedDeltaNet(cfg, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = _ffn(cfg, rngs, dtype)

    def __call__(self, h, conv, ssm, layer, meta):
        a, conv, ssm = self.linear_attn(self.input_layernorm(h), conv, ssm, layer, meta)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h), layer), conv, ssm


class AttentionDecoderLayer(nnx.Module):
    def __init__(self, cfg, *, rngs, dtype):
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.self_attn = GatedAttention(cfg, rngs=rngs, dtype=dtype)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.mlp = _ffn(cfg, rngs, dtype)

    def __call__(self, h, kv, layer, meta):
        a, kv = self.self_attn(self.input_layernorm(h), kv, layer, meta)
        h = h + a
        return h + self.mlp(self.post_attention_layernorm(h), layer), kv


def _read_in_place(path, _):
    """The weights a layer indexes in the stack itself: experts and Linear kernels."""
    return path[-1] in ("experts_gate_up", "experts_down", "kernel", "scale",
                        "experts_gate_up_scale", "experts_down_scale")


def _split_whole(stacked: nnx.Module):
    """(graphdef, weights passed whole, the rest) of a stacked module: the rest is what a
    scan slices per layer (see the module docstring)."""
    return nnx.split(stacked, _read_in_place, ...)


def _stack(make, n: int, rngs: nnx.Rngs):
    """Build ``n`` copies of a module with parameters stacked on a new leading axis."""

    @nnx.split_rngs(splits=n)
    @nnx.vmap(in_axes=(0,), out_axes=0)
    def create(r):
        return make(r)

    return create(rngs)


class LayerGroup(nnx.Module):
    """``gdn_per_group`` GDN layers (stacked) followed by one attention layer."""

    def __init__(self, cfg, *, rngs, dtype):
        self.gdn = _stack(lambda r: GDNDecoderLayer(cfg, rngs=r, dtype=dtype), cfg.gdn_per_group, rngs)
        self.attn = AttentionDecoderLayer(cfg, rngs=rngs, dtype=dtype)

    def __call__(self, h, cache: HybridCache, group, meta):
        gdef, whole, gstate = _split_whole(self.gdn)
        p, g, r = cache.conv.shape[:3]
        # GDN state pools viewed as [P, G*R, ...]: layer j of group `group` is row group*R + j.
        conv = cache.conv.reshape((p, g * r) + cache.conv.shape[3:])
        ssm = cache.ssm.reshape((p, g * r) + cache.ssm.shape[3:])

        def gdn_step(carry, xs):
            h, conv, ssm = carry
            j, st = xs
            return nnx.merge(gdef, whole, st)(h, conv, ssm, group * r + j, meta), None

        (h, conv, ssm), _ = jax.lax.scan(gdn_step, (h, conv, ssm),
                                         (jnp.arange(r, dtype=jnp.int32), gstate))
        h, kv = self.attn(h, cache.kv, group, meta)
        return h, HybridCache(kv=kv, conv=conv.reshape(cache.conv.shape),
                              ssm=ssm.reshape(cache.ssm.shape))


class Qwen35ForCausalLM(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.config = cfg
        self.dtype = dtype
        self.embed_tokens = nnx.Embed(cfg.vocab_size, cfg.hidden_size, param_dtype=dtype,
                                      embedding_init=nnx.initializers.normal(0.02), rngs=rngs)
        self.groups = _stack(lambda r: LayerGroup(cfg, rngs=r, dtype=dtype), cfg.num_groups, rngs)
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, dtype=dtype)
        self.lm_head = (None if cfg.tie_word_embeddings else
                        nnx.Linear(cfg.hidden_size, cfg.vocab_size, use_bias=False,
                                   param_dtype=dtype, rngs=rngs))

    def forward(self, batch: Batch, cache: HybridCache):
        """One model step over a ragged batch: logits [L, vocab] (float32) at
        ``batch.logits_indices``, and the cache with this step's KV and GDN state."""
        h, cache = self.hidden(batch, cache)
        return self.logits(h[batch.logits_indices]), cache

    def hidden(self, batch: Batch, cache: HybridCache):
        """The last layer's output for every token ([T, D], before the final norm) and the
        cache with this step's KV and GDN state."""
        meta = step_meta(batch, num_blocks=cache.num_blocks, block_size=cache.block_size)
        h = self.embed_tokens(batch.tokens)
        gdef, whole, gstate = _split_whole(self.groups)

        def group_step(carry, xs):
            h, cache = carry
            i, st = xs
            return nnx.merge(gdef, whole, st)(h, cache, i, meta), None

        (h, cache), _ = jax.lax.scan(
            group_step, (h, cache),
            (jnp.arange(self.config.num_groups, dtype=jnp.int32), gstate))
        return h, cache

    def logits(self, h):
        """Float32 logits of last-layer outputs: the final norm, then the LM head."""
        return self.head(self.norm(h))

    def head(self, h):
        """The LM head (the embedding, when tied) on normalised hidden states, in float32."""
        out = self.embed_tokens.attend(h) if self.lm_head is None else self.lm_head(h)
        return out.astype(jnp.float32)

    def __call__(self, input_ids, cache: SequenceCache | None = None):
        """Logits ``[B, T, vocab]`` for equal-length rows; with ``cache``, the rows continue
        from it and ``(logits, cache)`` is returned.  T == 1 takes the recurrent path."""
        b, t = input_ids.shape
        given = cache is not None
        if not given:
            cache = SequenceCache.allocate(self.config, b, t, dtype=self.dtype)
        logits, hc = self.forward(rows_batch(input_ids, cache), cache.cache)
        logits = logits.reshape(b, t, -1)
        if given:
            return logits, SequenceCache(cache=hc, lengths=cache.lengths + t)
        return logits


def rows_batch(input_ids, cache: SequenceCache) -> Batch:
    """The ragged batch of ``B`` equal-length rows ``[B, T]`` continuing ``cache`` (row b in
    slot b and blocks ``b*M ..``), with every token's logits requested."""
    b, t = input_ids.shape
    m = cache.cache.num_blocks // b
    return Batch(
        tokens=input_ids.reshape(-1).astype(jnp.int32),
        cu_seqlens=jnp.arange(b + 1, dtype=jnp.int32) * t,
        start_pos=cache.lengths,
        slots=jnp.arange(b, dtype=jnp.int32),
        block_tables=jnp.arange(b * m, dtype=jnp.int32).reshape(b, m),
        logits_indices=jnp.arange(b * t, dtype=jnp.int32),
        is_decode=(t == 1))
