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

A cache sharded over a mesh (``qwen35_jax.sharding.cache_specs``) is one region
per device shard: KV blocks and recurrent state split into head *parts* (the
``tensor`` axis), each part held by one or more *copies* (replicas along the
other axes; the conv state is one part with a copy per device).  Between peers
of different head splits (prefill TP2, decode TP1, say) a block's bytes no longer
correspond one for one: ``stream_items`` cuts both sides at the finer split's
head boundaries inside every row (layer x K|V x position for KV, GDN layer for
state), reads one copy of each source part and writes every destination copy;
the descriptor planner then merges what stays contiguous on both sides, so equal
splits cost what unsharded peers cost and unequal ones one descriptor per row.
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
    """Byte geometry of the cache regions: bytes of one block or slot in one region, rows
    per block / slot, and per array its head parts, each a tuple of the regions that hold
    a copy of it (one part and one region, named after the array, when unsharded)."""

    block_bytes: int
    conv_slot_bytes: int
    ssm_slot_bytes: int
    block_size: int
    kv_rows: int = 1  # rows of a block (layer x K|V x position), heads innermost
    ssm_rows: int = 1  # rows of a slot's recurrent state (GDN layers), value heads innermost
    kv_parts: tuple[tuple[str, ...], ...] = (("kv",),)
    conv_parts: tuple[tuple[str, ...], ...] = (("conv",),)
    ssm_parts: tuple[tuple[str, ...], ...] = (("ssm",),)

    def items(self, block_ids, slot: int, num_tokens: int) -> list[tuple[str, int, int]]:
        """The bytes holding the first ``num_tokens`` tokens' KV and the GDN state of ``slot``
        (one copy of every part): what a lease pins. A run of consecutive blocks is one
        item, so a prompt in freshly allocated blocks costs one item per part instead of
        one per block (planning per-block items took 2 ms at 32768 tokens, bench/RESULTS.md)."""
        blocks = np.asarray(_blocks(self, block_ids, num_tokens), np.int64)
        cuts = np.flatnonzero(np.diff(blocks) != 1) + 1
        runs = zip(np.concatenate(([0], cuts)).tolist(), np.concatenate((cuts, [len(blocks)])).tolist())
        runs = [(int(blocks[a]), b - a) for a, b in runs if b > a]
        kv = [(part[0], first * self.block_bytes, count * self.block_bytes)
              for part in self.kv_parts for first, count in runs]
        return kv + [(part[0], slot * size, size) for parts, size in (
            (self.conv_parts, self.conv_slot_bytes), (self.ssm_parts, self.ssm_slot_bytes))
            for part in parts]


def _blocks(layout: CacheLayout, block_ids, num_tokens: int):
    n = -(-num_tokens // layout.block_size)
    if n > len(block_ids):
        raise ValueError(f"{num_tokens} tokens need {n} blocks, the request holds {len(block_ids)}")
    return block_ids[:n]


def stream_items(src: CacheLayout, src_blocks, src_slot: int, dst: CacheLayout, dst_blocks,
                 dst_slot: int, num_tokens: int):
    """Matching ``(source items, destination items)`` that copy a request's first
    ``num_tokens`` tokens of KV and its GDN state from ``src``'s layout into ``dst``'s,
    whatever the two head splits (one must divide the other); feed them to
    ``transfer.descriptors.plan``."""
    src_items, dst_items = [], []
    arrays = ((src.kv_parts, dst.kv_parts, _blocks(src, src_blocks, num_tokens),
               _blocks(dst, dst_blocks, num_tokens), src.block_bytes, dst.block_bytes, src.kv_rows),
              (src.conv_parts, dst.conv_parts, [src_slot], [dst_slot], src.conv_slot_bytes,
               dst.conv_slot_bytes, 1),
              (src.ssm_parts, dst.ssm_parts, [src_slot], [dst_slot], src.ssm_slot_bytes,
               dst.ssm_slot_bytes, src.ssm_rows))
    for s_parts, d_parts, s_ids, d_ids, s_bytes, d_bytes, rows in arrays:
        f = max(len(s_parts), len(d_parts))
        if f % len(s_parts) or f % len(d_parts):
            raise ValueError(f"head splits {len(s_parts)} and {len(d_parts)} do not divide")
        if len(s_parts) == len(d_parts):
            rows = 1  # same split: whole blocks / slots correspond part for part
        for copy in range(len(d_parts[0])):
            src_items += _chunks(s_parts, 0, s_ids, s_bytes, rows, f)
            dst_items += _chunks(d_parts, copy, d_ids, d_bytes, rows, f)
    return src_items, dst_items


def _chunks(parts, copy: int, ids, unit_bytes: int, rows: int, f: int):
    """Items of ``ids``' units cut into ``rows`` rows of ``f`` head chunks, ordered chunk,
    unit, row; this side holds ``len(parts)`` parts of ``f // len(parts)`` chunks each."""
    per = f // len(parts)
    row_bytes = unit_bytes // rows
    size = row_bytes // per
    c, i, r = (a.ravel() for a in np.meshgrid(np.arange(f), np.asarray(ids, np.int64),
                                              np.arange(rows), indexing="ij"))
    offsets = i * unit_bytes + r * row_bytes + (c % per) * size
    names = [parts[p][copy] for p in (c // per).tolist()]
    return list(zip(names, offsets.tolist(), [size] * len(names)))


def shard_regions(cache: HybridCache) -> tuple[list[Region], CacheLayout]:
    """Regions of a (possibly sharded) XLA-allocated host cache, one per device shard, and
    its layout.  DRAM only: on GPU, XLA's memory is not IPC-capable (``transfer.memory``)
    and registered shards must be allocated per device through DLPack instead."""
    regions, parts, per = [], {}, {}
    for name in ("kv", "conv", "ssm"):
        array = getattr(cache, name)
        shards = sorted(array.addressable_shards, key=lambda s: s.device.id)
        by_index: dict = {}
        for d, shard in enumerate(shards):
            region = name if len(shards) == 1 else f"{name}@{d}"
            nbytes = shard.data.nbytes
            regions.append(Region(region, shard.data.unsafe_buffer_pointer(), nbytes, 0, "DRAM",
                                  owner=array))
            key = tuple((sl.start or 0) for sl in shard.index)
            by_index.setdefault(key, []).append(region)
            per[name] = nbytes // shard.data.shape[0]
        parts[name] = tuple(tuple(v) for _, v in sorted(by_index.items()))
    g, two, bs = cache.kv.shape[1:4]
    layout = CacheLayout(per["kv"], per["conv"], per["ssm"], cache.block_size,
                         kv_rows=g * two * bs, ssm_rows=math.prod(cache.ssm.shape[1:3]),
                         kv_parts=parts["kv"], conv_parts=parts["conv"], ssm_parts=parts["ssm"])
    return regions, layout


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
    layout = CacheLayout(per["kv"], per["conv"], per["ssm"], block_size,
                         kv_rows=math.prod(shapes["kv"][1:4]),
                         ssm_rows=math.prod(shapes["ssm"][1:3]))
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
