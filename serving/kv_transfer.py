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

Between workers, the prefill side pins ``CacheLayout.items`` and sends its
``source_record`` (its layout, the request's blocks and slot) with the lease; the
decode side maps it onto its own blocks and slot with ``pull_items`` and READs
those source items, which the transfer manager checks lie inside the pinned ones.
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
from qwen35_jax.sharding import cache_shardings
from transfer import Region, TransferParamsError
from transfer.memory import allocate_sharded, device_shards, host_regions


# Head parts a layout may split an array into. A split is the size of a mesh's ``tensor``
# axis, which divides the heads it splits (``qwen35_jax.sharding``): a few in practice.
# ``stream_items`` builds parts x blocks x rows items on the engine's thread, and a peer's
# layout of thousands of one-byte parts (``_check_matching`` allows them) would have it
# build hundreds of millions.
MAX_PARTS = 64
# Block and slot ids are int32 in the engine. Below this bound, a unit's byte offset (its
# id times its bytes, at most this side's own by ``_check_matching``) fits in int64.
MAX_ID = 2**31


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

    def to_json(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_json(cls, d) -> "CacheLayout":
        """A peer's layout (``to_json``); ValueError unless it describes whole rows of at
        most ``MAX_PARTS`` parts that all have the same number of copies."""
        fields = [f.name for f in dataclasses.fields(cls)]
        if not isinstance(d, dict) or sorted(d) != sorted(fields):
            raise ValueError(f"a cache layout has the fields {fields}")
        for name in fields:
            value = d[name]
            if name.endswith("_parts"):
                if not (isinstance(value, (list, tuple)) and 0 < len(value) <= MAX_PARTS and all(
                        isinstance(p, (list, tuple)) and p and len(p) == len(value[0])
                        and all(isinstance(r, str) for r in p) for p in value)):
                    raise ValueError(f"layout {name}: expected 1 to {MAX_PARTS} parts of equally "
                                     f"many region names, got {value!r}")
            elif not _is_int(value, 1):
                raise ValueError(f"layout {name}: expected a positive integer, got {value!r}")
        if d["block_bytes"] % d["kv_rows"] or d["ssm_slot_bytes"] % d["ssm_rows"]:
            raise ValueError("layout rows do not divide their blocks or slots")
        return cls(**{k: tuple(map(tuple, v)) if k.endswith("_parts") else v
                      for k, v in d.items()})


def _blocks(layout: CacheLayout, block_ids, num_tokens: int):
    n = -(-num_tokens // layout.block_size)
    if n > len(block_ids):
        raise ValueError(f"{num_tokens} tokens need {n} blocks, the request holds {len(block_ids)}")
    return block_ids[:n]


def stream_items(src: CacheLayout, src_blocks, src_slot: int, dst: CacheLayout, dst_blocks,
                 dst_slot: int, num_tokens: int, skip_blocks: int = 0):
    """Matching ``(source items, destination items)`` that copy a request's first
    ``num_tokens`` tokens of KV, but its first ``skip_blocks`` blocks (the destination
    holds them already: prefix-cache blocks), and its GDN state from ``src``'s layout into
    ``dst``'s, whatever the two head splits (one must divide the other); feed them to
    ``transfer.descriptors.plan``."""
    _check_matching(src, dst)
    src_items, dst_items = [], []
    arrays = ((src.kv_parts, dst.kv_parts, _blocks(src, src_blocks, num_tokens)[skip_blocks:],
               _blocks(dst, dst_blocks, num_tokens)[skip_blocks:], src.block_bytes,
               dst.block_bytes, src.kv_rows),
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


def _check_matching(src: CacheLayout, dst: CacheLayout) -> None:
    """ValueError unless the two layouts cut the same global blocks and slots into the
    same rows (each side's per-part bytes times its parts)."""
    for what, a, b in (
            ("block size", src.block_size, dst.block_size),
            ("KV rows", src.kv_rows, dst.kv_rows), ("state rows", src.ssm_rows, dst.ssm_rows),
            ("KV bytes per block", src.block_bytes * len(src.kv_parts),
             dst.block_bytes * len(dst.kv_parts)),
            ("conv bytes per slot", src.conv_slot_bytes * len(src.conv_parts),
             dst.conv_slot_bytes * len(dst.conv_parts)),
            ("state bytes per slot", src.ssm_slot_bytes * len(src.ssm_parts),
             dst.ssm_slot_bytes * len(dst.ssm_parts))):
        if a != b:
            raise ValueError(f"cache layouts differ in {what}: {a} and {b}")


def _chunks(parts, copy: int, ids, unit_bytes: int, rows: int, f: int):
    """Items of ``ids``' units cut into ``rows`` rows of ``f`` head chunks, ordered chunk,
    unit, row; this side holds ``len(parts)`` parts of ``f // len(parts)`` chunks each.
    Neighbours that touch in one region are one item (a run of consecutive blocks when
    the splits are equal, as in ``CacheLayout.items``), which keeps planning cheap."""
    if not len(ids):  # every block skipped (a block-aligned prompt the destination holds)
        return []
    per = f // len(parts)
    row_bytes = unit_bytes // rows
    if row_bytes % per:
        raise ValueError(f"a row of {row_bytes} bytes does not split into {per} head chunks")
    size = row_bytes // per
    c, i, r = (a.ravel() for a in np.meshgrid(np.arange(f), np.asarray(ids, np.int64),
                                              np.arange(rows), indexing="ij"))
    offsets = i * unit_bytes + r * row_bytes + (c % per) * size
    part = c // per
    starts = np.flatnonzero(np.concatenate(
        ([True], (part[1:] != part[:-1]) | (offsets[1:] != offsets[:-1] + size))))
    lengths = np.diff(np.append(starts, len(offsets))) * size
    names = [parts[p][copy] for p in part[starts].tolist()]
    return list(zip(names, offsets[starts].tolist(), lengths.tolist()))


def source_record(layout: CacheLayout, block_ids, slot: int, num_tokens: int) -> dict:
    """What a puller needs, besides the pinned items, to map a request onto its own layout
    (JSON-able; it travels with the lease): this side's layout and the request's blocks
    holding ``num_tokens`` tokens and slot."""
    return {"layout": layout.to_json(), "slot": int(slot),
            "blocks": [int(b) for b in _blocks(layout, block_ids, num_tokens)]}


def pull_items(record, layout: CacheLayout, block_ids, slot: int, num_tokens: int,
               skip_blocks: int = 0):
    """``(source items, local items)`` that copy the request of a peer's ``source_record``
    into ``block_ids`` and ``slot`` of ``layout``, but the first ``skip_blocks`` blocks
    (``stream_items``); TransferParamsError if the record is
    malformed or does not fit this layout (the transfer manager checks separately that
    the source items lie inside what the lease pinned)."""
    try:
        if not isinstance(record, dict):
            raise ValueError(f"expected a dict, got {type(record).__name__}")
        blocks, src_slot = record.get("blocks"), record.get("slot")
        if not (isinstance(blocks, list) and all(_is_int(b, 0) and b < MAX_ID for b in blocks)
                and _is_int(src_slot, 0) and src_slot < MAX_ID):
            raise ValueError(f"expected 'blocks' (block ids) and 'slot' (a slot id), each "
                             f"below {MAX_ID}")
        return stream_items(CacheLayout.from_json(record.get("layout")), blocks, src_slot,
                            layout, block_ids, slot, num_tokens, skip_blocks)
    # RecursionError: printing a value of a peer's record nested many hundred levels deep
    except (ValueError, OverflowError, RecursionError) as e:
        raise TransferParamsError(f"source cache record: {e}") from None


def _is_int(v, least: int) -> bool:
    return isinstance(v, int) and not isinstance(v, bool) and v >= least


_ARRAYS = ("kv", "conv", "ssm")  # the cache arrays, in region order


def allocate_registered_cache(cfg: Qwen35Config, *, num_blocks: int, block_size: int,
                              num_slots: int, dtype, ssm_dtype=jnp.float32,
                              device: jax.Device | None = None, mesh=None, mtp_layers: int = 0
                              ) -> tuple[HybridCache, list[Region], CacheLayout]:
    """The hybrid cache in memory NIXL can register (``transfer.memory``), its regions and
    its layout: on ``device`` (default the first), or on ``mesh`` laid out by
    ``qwen35_jax.sharding.cache_shardings`` with one region per device shard."""
    if mesh is not None and device is not None:
        raise ValueError("give a device or a mesh, not both")
    shapes = HybridCache.shapes(cfg, num_blocks, block_size, num_slots, mtp_layers)
    dtypes = {"kv": dtype, "conv": dtype, "ssm": ssm_dtype}
    if mesh is None:
        one = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
        shardings = HybridCache(kv=one, conv=one, ssm=one)
    else:
        shardings = cache_shardings(cfg, mesh)
    arrays, regions = {}, {}
    for name in _ARRAYS:
        arrays[name], regions[name] = allocate_sharded(name, shapes[name], dtypes[name],
                                                       getattr(shardings, name))
    cache = HybridCache(**arrays)
    return cache, [r for name in _ARRAYS for r in regions[name]], _layout(cache, regions)


def shard_regions(cache: HybridCache) -> tuple[list[Region], CacheLayout]:
    """Regions and layout of a (possibly sharded) cache that XLA allocated in host memory,
    one region per device shard (an aggregated engine's cache, to hand over in a test).
    DRAM only: XLA's device memory is not IPC-capable (``transfer.memory``); a worker's
    cache comes from ``allocate_registered_cache``."""
    regions = {name: host_regions(name, getattr(cache, name)) for name in _ARRAYS}
    return [r for name in _ARRAYS for r in regions[name]], _layout(cache, regions)


def _layout(cache: HybridCache, regions: dict[str, list[Region]]) -> CacheLayout:
    """The layout of ``cache`` whose arrays' shards, in device-id order, occupy
    ``regions[name]``: per array the bytes of one block or slot in one shard, and its head
    parts (shards of equal index), each the tuple of regions holding a copy."""
    parts, per = {}, {}
    for name in _ARRAYS:
        by_index: dict = {}
        for shard, region in zip(device_shards(getattr(cache, name)), regions[name], strict=True):
            by_index.setdefault(tuple(sl.start or 0 for sl in shard.index), []).append(region.name)
            per[name] = region.nbytes // shard.data.shape[0]
        parts[name] = tuple(tuple(v) for _, v in sorted(by_index.items()))
    g, two, bs = cache.kv.shape[1:4]
    return CacheLayout(per["kv"], per["conv"], per["ssm"], cache.block_size,
                       kv_rows=g * two * bs, ssm_rows=math.prod(cache.ssm.shape[1:3]),
                       kv_parts=parts["kv"], conv_parts=parts["conv"], ssm_parts=parts["ssm"])


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
