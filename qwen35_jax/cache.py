"""The hybrid cache: paged KV for full-attention layers, a slot pool for GDN state.

Layouts are chosen for the transfer layer: the KV pool is block-major
``[num_blocks, G, 2, block_size, KV, head_dim]`` (one block of every attention
layer is one contiguous region) and the state pools are slot-major
``[num_slots, G, R, ...]`` (one request's conv or recurrent state of every GDN
layer is one region).  A request therefore moves with one descriptor per run
of consecutive blocks plus two for its state. With speculative decoding the KV pool
holds one layer more, after the model's: the MTP head's (``qwen35_jax.mtp``), so its
KV lives in the request's blocks and moves, is cached and freed with them.
"""

from __future__ import annotations

import math

import jax.numpy as jnp
import numpy as np
from flax import struct

from qwen35_jax.config import Qwen35Config


@struct.dataclass
class HybridCache:
    kv: jnp.ndarray  # [num_blocks, G (+1: the MTP head's), 2, block_size, KV, head_dim]
    conv: jnp.ndarray  # [num_slots, G, R, K-1, conv_dim]
    ssm: jnp.ndarray  # [num_slots, G, R, Hv, dk, dv]

    @property
    def num_blocks(self) -> int:
        return self.kv.shape[0]

    @property
    def block_size(self) -> int:
        return self.kv.shape[3]

    @property
    def num_slots(self) -> int:
        return self.ssm.shape[0]

    @property
    def block_nbytes(self) -> int:
        """Bytes of one KV block (every attention layer), over all devices."""
        return self.kv.nbytes // self.num_blocks

    @property
    def slot_nbytes(self) -> int:
        """Bytes of one state slot (conv + recurrent, every GDN layer), over all devices."""
        return (self.conv.nbytes + self.ssm.nbytes) // self.num_slots

    @staticmethod
    def shapes(cfg: Qwen35Config, num_blocks: int, block_size: int, num_slots: int,
               mtp_layers: int = 0):
        g, r = cfg.num_groups, cfg.gdn_per_group
        return dict(
            kv=(num_blocks, g + mtp_layers, 2, block_size, cfg.num_key_value_heads,
                cfg.head_dim),
            conv=(num_slots, g, r, cfg.linear_conv_kernel_dim - 1, cfg.conv_dim),
            ssm=(num_slots, g, r, cfg.linear_num_value_heads, cfg.linear_key_head_dim,
                 cfg.linear_value_head_dim))

    @classmethod
    def allocate(cls, cfg: Qwen35Config, *, num_blocks: int, block_size: int, num_slots: int,
                 dtype=jnp.bfloat16, ssm_dtype=jnp.float32, mtp_layers: int = 0
                 ) -> "HybridCache":
        """Allocate once; steps update these arrays in place (donated)."""
        s = cls.shapes(cfg, num_blocks, block_size, num_slots, mtp_layers)
        return cls(kv=jnp.zeros(s["kv"], dtype), conv=jnp.zeros(s["conv"], dtype),
                   ssm=jnp.zeros(s["ssm"], ssm_dtype))

    @staticmethod
    def bytes_per_block(cfg: Qwen35Config, block_size: int, dtype=jnp.bfloat16,
                        mtp_layers: int = 0) -> int:
        shape = HybridCache.shapes(cfg, 1, block_size, 1, mtp_layers)["kv"]
        return math.prod(shape) * np.dtype(dtype).itemsize

    @staticmethod
    def bytes_per_slot(cfg: Qwen35Config, dtype=jnp.bfloat16, ssm_dtype=jnp.float32) -> int:
        s = HybridCache.shapes(cfg, 1, 1, 1)
        return (math.prod(s["conv"]) * np.dtype(dtype).itemsize
                + math.prod(s["ssm"]) * np.dtype(ssm_dtype).itemsize)


@struct.dataclass
class SequenceCache:
    """A hybrid cache for a fixed batch of rows (the convenience ``model(ids, cache=...)``
    path): row b owns slot b and blocks ``b*M .. b*M+M-1``; ``lengths`` counts its tokens."""

    cache: HybridCache
    lengths: jnp.ndarray  # int32 [B]

    @classmethod
    def allocate(cls, cfg: Qwen35Config, batch: int, max_len: int, *, block_size: int = 16,
                 dtype=jnp.float32, ssm_dtype=jnp.float32) -> "SequenceCache":
        m = -(-max_len // block_size)
        return cls(cache=HybridCache.allocate(cfg, num_blocks=batch * m, block_size=block_size,
                                              num_slots=batch, dtype=dtype, ssm_dtype=ssm_dtype),
                   lengths=jnp.zeros((batch,), jnp.int32))

    @property
    def max_len(self) -> int:
        return self.cache.num_blocks // self.cache.num_slots * self.cache.block_size
