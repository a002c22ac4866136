"""The multi-token-prediction head of Qwen3.5 (``mtp.*`` in the official checkpoints).

From the target model's final hidden state at position ``t`` (after ``model.norm``:
what vLLM's Qwen3.5 model hands its drafter) and the embedding of token ``t+1``, the
head predicts token ``t+2``::

    h' = fc([norm_e(embed(x[t+1])), norm_h(h[t])])      # embedding half first, [D, 2D]
    h'' = one full-attention decoder layer (dense MLP or MoE, as the model)
    logits = lm_head(norm(h''))                          # the model's own LM head

Its attention layer keeps paged KV at the positions of the tokens it reads (``t``): a
layer ``layer`` of a ``[num_blocks, L, 2, block_size, KV, head_dim]`` pool (its own
one-layer pool in training; in serving the layer after the model's in the hybrid
cache, ``qwen35_jax.cache``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from qwen35_jax.batch import StepMeta
from qwen35_jax.config import Qwen35Config
from qwen35_jax.layers.linear import Linear
from qwen35_jax.layers.norms import RMSNorm
from qwen35_jax.model import AttentionDecoderLayer


class MTP(nnx.Module):
    def __init__(self, cfg: Qwen35Config, *, rngs: nnx.Rngs, dtype=jnp.float32):
        d = cfg.hidden_size
        self.pre_fc_norm_embedding = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.pre_fc_norm_hidden = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)
        self.fc = Linear(2 * d, d, rngs=rngs, dtype=dtype)
        self.layer = AttentionDecoderLayer(cfg, rngs=rngs, dtype=dtype)
        self.norm = RMSNorm(d, cfg.rms_norm_eps, dtype=dtype)

    def __call__(self, hidden, next_embeds, kv, meta: StepMeta, layer=0):
        """hidden, next_embeds [T, D] -> (the head's normalised output [T, D], kv); the LM
        head of the model turns the output into logits."""
        x = self.fc(jnp.concatenate([self.pre_fc_norm_embedding(next_embeds),
                                     self.pre_fc_norm_hidden(hidden)], axis=-1))
        h, kv = self.layer(x, kv, layer, meta)
        return self.norm(h), kv

    @staticmethod
    def kv_shape(cfg: Qwen35Config, num_blocks: int, block_size: int) -> tuple[int, ...]:
        return (num_blocks, 1, 2, block_size, cfg.num_key_value_heads, cfg.head_dim)
