"""Sizes the hybrid cache and allocates it once.

KV grows with every token; GDN state is a fixed record per request. So the
split is: `num_slots` state slots (one per sequence that may run, default
`max_num_seqs`) and the prefix cache's snapshot rows (`num_prefix_snapshots`), and
every remaining byte of the budget for KV blocks, capped
at what `max_num_seqs` sequences of `max_model_len` tokens could ever use. The
budget is `memory_utilization` of the device's memory limit minus what is in
use after the weights are loaded; the rest is left for activations of the
largest bucket. On CPU (no memory stats) `num_blocks` must be given.

On a mesh the budget is one device's, and a block or slot costs that device
its shard: the KV heads and GDN value heads split over `tensor` when they
divide (see `qwen35_jax.sharding.cache_specs`).
"""

import logging
import math
from functools import partial

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from serving.engine.config import EngineConfig

log = logging.getLogger(__name__)


def cache_dtype(dtype):
    """The KV and conv-state dtype for weights of ``dtype``: the same, except float32 for
    16-bit weights on a CPU. XLA's CPU backend cannot update a 16-bit array in place: it
    converts the whole array to float32, updates it and converts it back, so every step
    rewrites the whole cache, and its buffer holds other values in between; a transfer
    into or out of the cache while a step runs then reads or leaves garbage (seen as wrong
    answers of concurrent bfloat16 requests, disaggregated). ``Runner`` checks every
    compiled step for such a rewrite (``rewrites_whole_cache``)."""
    dtype = jnp.dtype(dtype)
    if dtype.itemsize == 2 and jax.default_backend() == "cpu":
        return jnp.dtype(jnp.float32)
    return dtype


def plan_capacity(model_cfg, config: EngineConfig, dtype, memory_stats: dict | None = None,
                  mesh=None, budget_bytes: int | None = None) -> dict:
    """Fills `config.num_blocks` if unset; returns the split as a report (bytes per
    device). `memory_stats` defaults to the first device's (`bytes_limit`, `bytes_in_use`);
    `budget_bytes` replaces the budget they imply (a cache outside XLA's pool, whose
    owner sized that pool to leave room for activations: transfer/memory.py)."""
    from qwen35_jax.cache import HybridCache

    ssm_dtype = jnp.dtype(config.ssm_dtype)
    dtype = cache_dtype(dtype)
    split = _splits(model_cfg, mesh)
    block_bytes = HybridCache.bytes_per_block(model_cfg, config.block_size, dtype,
                                              config.mtp_layers) // split.kv
    s = HybridCache.shapes(model_cfg, 1, 1, 1)
    slot_bytes = (math.prod(s["conv"]) * jnp.dtype(dtype).itemsize // split.conv
                  + math.prod(s["ssm"]) * ssm_dtype.itemsize // split.ssm)
    rows = config.num_state_rows
    report = {"block_bytes": block_bytes, "slot_bytes": slot_bytes, "num_slots": config.num_slots,
              "num_prefix_snapshots": config.num_prefix_snapshots}
    if config.num_blocks is None:
        budget = budget_bytes
        if budget is None:
            stats = memory_stats or jax.devices()[0].memory_stats()
            if not stats or "bytes_limit" not in stats:
                raise ValueError("this device reports no memory statistics: set num_blocks")
            budget = int(stats["bytes_limit"] * config.memory_utilization) - stats["bytes_in_use"]
            report.update(device_limit_bytes=stats["bytes_limit"],
                          in_use_bytes=stats["bytes_in_use"])
        useful = config.max_num_seqs * config.max_blocks_per_seq
        config.num_blocks = min(useful, (budget - rows * slot_bytes) // block_bytes)
        if config.num_blocks < config.max_blocks_per_seq:
            raise ValueError(f"{budget / 2**30:.1f} GiB free leaves {config.num_blocks} KV blocks, "
                             f"fewer than one sequence of max_model_len needs")
        report.update(budget_bytes=budget)
    report.update(num_blocks=config.num_blocks, kv_bytes=config.num_blocks * block_bytes,
                  state_bytes=rows * slot_bytes,
                  kv_tokens=config.num_blocks * config.block_size)
    log.info("cache: %d KV blocks (%.2f GiB, %d tokens) + %d state slots and %d prefix "
             "snapshots (%.2f GiB)", config.num_blocks, report["kv_bytes"] / 2**30,
             report["kv_tokens"], config.num_slots, config.num_prefix_snapshots,
             report["state_bytes"] / 2**30)
    return report


def _splits(model_cfg, mesh):
    """Per cache array, how many devices share one block's or slot's bytes."""
    from qwen35_jax.cache import HybridCache
    from qwen35_jax.sharding import axis_size, cache_specs

    if mesh is None:
        return HybridCache(kv=1, conv=1, ssm=1)
    return jax.tree.map(lambda spec: axis_size(mesh, [a for a in spec[1:] if a]),
                        cache_specs(model_cfg, mesh), is_leaf=lambda x: isinstance(x, P))


def allocate_cache(model_cfg, config: EngineConfig, dtype, mesh=None):
    """The zeroed cache, created directly in its sharded layout on ``mesh``."""
    from qwen35_jax.cache import HybridCache
    from qwen35_jax.sharding import cache_shardings

    make = partial(HybridCache.allocate, model_cfg, num_blocks=config.num_blocks,
                   block_size=config.block_size, num_slots=config.num_state_rows,
                   dtype=cache_dtype(dtype), ssm_dtype=jnp.dtype(config.ssm_dtype),
                   mtp_layers=config.mtp_layers)
    if mesh is None:
        return make()
    return jax.jit(make, out_shardings=cache_shardings(model_cfg, mesh))()
