"""Where a request's cache lives in registered memory: the bridge from the engine's
blocks and slots to the transfer layer's ``(region, offset, length)`` items.

The hybrid cache is allocated as three registered regions, ``kv``, ``conv`` and
``ssm`` (see ``qwen35_jax.cache`` for why the layouts are block- and slot-major):
a KV block of every attention layer is one contiguous span, and so is a
request's conv or recurrent state of every GDN layer.  A request therefore
travels as its KV blocks (runs of consecutive block ids merge into one
descriptor) plus one span each for conv and recurrent state.

Both sides list items in the same stream order (the prompt's blocks in
sequence order, then conv, then ssm), so the decode side's freshly allocated
blocks receive the prefill side's blocks one for one.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax.cache import HybridCache
from qwen35_jax.config import Qwen35Config
from transfer import Region, allocate


@dataclasses.dataclass(frozen=True)
class CacheLayout:
    """Byte geometry of the three cache regions."""

    block_bytes: int
    conv_slot_bytes: int
    ssm_slot_bytes: int
    block_size: int

    def items(self, block_ids, slot: int, num_tokens: int) -> list[tuple[str, int, int]]:
        """The bytes holding the first ``num_tokens`` tokens' KV and the GDN state of ``slot``."""
        n = -(-num_tokens // self.block_size)
        if n > len(block_ids):
            raise ValueError(f"{num_tokens} tokens need {n} blocks, the request holds {len(block_ids)}")
        kv = [("kv", int(b) * self.block_bytes, self.block_bytes) for b in block_ids[:n]]
        return kv + [("conv", slot * self.conv_slot_bytes, self.conv_slot_bytes),
                     ("ssm", slot * self.ssm_slot_bytes, self.ssm_slot_bytes)]


def allocate_registered_cache(cfg: Qwen35Config, *, num_blocks: int, block_size: int,
                              num_slots: int, dtype, ssm_dtype=jnp.float32,
                              device: jax.Device | None = None
                              ) -> tuple[HybridCache, list[Region], CacheLayout]:
    """The hybrid cache in memory NIXL can register (see ``transfer.memory``)."""
    shapes = HybridCache.shapes(cfg, num_blocks, block_size, num_slots)
    dtypes = {"kv": dtype, "conv": dtype, "ssm": ssm_dtype}
    arrays, regions = {}, []
    for name in ("kv", "conv", "ssm"):
        arrays[name], region = allocate(name, shapes[name], dtypes[name], device)
        regions.append(region)
    per = {n: math.prod(shapes[n][1:]) * np.dtype(dtypes[n]).itemsize for n in shapes}
    layout = CacheLayout(per["kv"], per["conv"], per["ssm"], block_size)
    return HybridCache(**arrays), regions, layout


def compat_record(cfg: Qwen35Config, cache: HybridCache, model_name: str) -> dict:
    """What two workers must agree on before one reads the other's cache: the model, the
    dtypes, the block size and the per-block / per-slot layouts (not the pool sizes)."""
    cfg_digest = hashlib.sha256(json.dumps(dataclasses.asdict(cfg), sort_keys=True,
                                           default=str).encode()).hexdigest()[:16]
    return {
        "model": model_name, "config_sha": cfg_digest, "block_size": cache.block_size,
        "kv": {"dtype": str(cache.kv.dtype), "per_block": list(cache.kv.shape[1:])},
        "conv": {"dtype": str(cache.conv.dtype), "per_slot": list(cache.conv.shape[1:])},
        "ssm": {"dtype": str(cache.ssm.dtype), "per_slot": list(cache.ssm.shape[1:])},
    }
