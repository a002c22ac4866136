"""Disaggregated workers on meshes, with real worker processes and real NIXL transfers
(CPU, DRAM, 8 host devices per worker).

A prefill worker split TP2 (``--tp 2``: KV heads and GDN value heads in two parts)
hands each request's KV blocks and GDN state to a decode worker split EP2 (one head
part, a copy on each of two devices) and to an unsharded one: the decode side reads
the parts of rows its own split needs (``serving.kv_transfer.pull_items``).  Every
greedy request must give the single-device aggregated engine's tokens (same preset
and seed), and the pools must return to full. (What the decode side reads comes from
the lease's own description, answered to its claim; that reads stay inside the pinned
bytes is test_transfer_manager's.)

Without workers, in a child process with 8 host devices (this file as a script): the
worker's registered cache on a mesh has the engine's shardings and layout, and the XLA
pool a worker caps on GPU counts the weights one device of its mesh holds.
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys

import pytest
from host_devices import child_records, xla_flags
from test_disagg import SECRET, Stack, bucket_flags, pools_full, prompts, run_all

from serving.engine import SamplingParams
from serving.engine.buckets import Buckets
from serving import secret as shared_secret
from serving.router import Router
from serving.ports import free_port

LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 128, "max_model_len": 256,
          "block_size": 16, "num_blocks": 128}
# The workers' shape buckets; the reference engine compiles the same ones (``reference``).
BUCKETS = Buckets(prefill_tokens=(128,), prefill_seqs=(8,), decode_seqs=(8,))
FLAGS = ["--model", "tiny-moe", *bucket_flags(BUCKETS),
         "--max-logprobs", "0", "--transfer-timeout", "40", "--lease-ttl", "60",
         "--log-level", "warning",
         *(f for k, v in LIMITS.items() for f in (f"--{k.replace('_', '-')}", str(v)))]
MESHES = [("prefill", ["--tp", "2"]), ("decode", ["--ep", "2"]), ("decode", [])]


class MeshStack(Stack):
    """``test_disagg.Stack`` with the tiny-moe flags and a mesh per worker (``MESHES``);
    the workers start together (their programs differ: the session's cache holds none of them)."""

    def __init__(self, workers):
        self.procs, self.urls, self.mesh = {}, {"prefill": [], "decode": []}, {}
        self.env = {**os.environ, "XLA_FLAGS": xla_flags(), "JAX_PLATFORMS": "cpu",
                    shared_secret.ENV: SECRET}
        for role, mesh in workers:
            self.mesh[self.start(role, mesh)] = " ".join(mesh) or "single device"
        self.wait()

    def start(self, role, mesh):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        self.procs[url] = subprocess.Popen(
            [sys.executable, "-m", "serving.worker", "--role", role, "--port", str(port),
             *FLAGS, *mesh], start_new_session=True, env=self.env)
        self.urls[role].append(url)
        return url


@pytest.fixture(scope="module")
def stack():
    s = MeshStack(MESHES)
    yield s
    s.close()


@pytest.fixture(scope="module")
def reference():
    """Aggregated engine on one device, same preset and seed: the oracle for greedy tokens.
    It compiles the workers' buckets, not the default ones (as test_disagg's reference):
    that greedy tokens do not depend on the bucket a step is padded to is
    test_engine_model's assertion."""
    from serving.llm import LLM

    return LLM("tiny-moe", **LIMITS, buckets=BUCKETS)


def test_greedy_tokens_across_meshes_equal_single_device(stack, reference, record_property):
    params = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)
    batch = prompts(6, seed=4)  # 1 to 145 tokens
    want = [o.token_ids for o in reference.generate(batch, params)]
    per_request = {}
    for d in stack.urls["decode"]:
        outs = asyncio.run(run_all(Router(stack.urls["prefill"], [d], secret=SECRET,
                                          max_model_len=256, max_logprobs=0), batch, params))
        errors = [o for o in outs if isinstance(o, BaseException)]
        assert not errors, (stack.mesh[d], errors[:3])
        assert [o.token_ids for o in outs] == want, stack.mesh[d]
        s = stack.stats(d)
        assert s["transfers"] == len(batch) and s["transfer_failures"] == 0, s
        per_request[stack.mesh[d]] = s["transfer_descriptors"] / s["transfers"]
    record_property("descriptors_per_request", per_request)
    print(f"descriptors per request, prefill --tp 2 -> decode: {per_request}")
    # TP2 -> one head part cuts every KV and state row in two; EP2 writes both copies
    assert per_request["--ep 2"] == 2 * per_request["single device"], per_request
    assert pools_full(stack, stack.urls["prefill"] + stack.urls["decode"]) is True


# ---- the registered cache on a mesh (8 host devices, in a child process) ---------------

CACHE_MESHES = {"tp2": (1, 2), "ep2": (2, 1), "ep2,tp2": (2, 2)}  # (ep, tp)


# The session starts the child ahead, at the lowest CPU priority, while earlier modules
# run (conftest, ``host_devices.Ahead``); the fixture takes it over.
AHEAD_CHILDREN = [()]


@pytest.fixture(scope="module")
def cache_records():
    return child_records(__file__)


@pytest.mark.parametrize("mesh", list(CACHE_MESHES))
def test_registered_cache_on_a_mesh_is_the_engines_layout(cache_records, mesh):
    """``allocate_registered_cache(mesh=...)``, the worker's one call, lays the cache out as
    the engine's own (``allocate_cache``) and registers it as ``shard_regions`` would."""
    r = cache_records[mesh]
    assert r["same_shardings"] and r["same_layout"], r
    ep, tp = CACHE_MESHES[mesh]
    assert r["regions"] == 3 * ep * tp and r["kv_parts"] == tp  # tiny-moe's 2 KV heads split


@pytest.mark.parametrize("mesh", list(CACHE_MESHES))
def test_pool_is_sized_for_one_devices_weights(cache_records, mesh):
    """The XLA pool cap (``size_xla_pool``) counts the weights one device of the mesh holds."""
    r = cache_records[mesh]
    assert r["param_bytes"] == r["device_param_bytes"] < r["single_param_bytes"], r


def _cache_child() -> None:
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from serving.engine import EngineConfig
    from serving.engine.capacity import allocate_cache
    from serving.kv_transfer import allocate_registered_cache, shard_regions
    from serving.llm import load_model, model_config
    from serving.worker.common import param_bytes

    cfg = model_config("tiny-moe")
    for key, (ep, tp) in CACHE_MESHES.items():
        config = EngineConfig(num_blocks=8, block_size=16, max_num_seqs=4, ep=ep, tp=tp)
        mesh = config.mesh()
        cache, regions, layout = allocate_registered_cache(
            cfg, num_blocks=8, block_size=16, num_slots=4, dtype=jnp.float32, mesh=mesh)
        xla = allocate_cache(cfg, config, jnp.float32, mesh)
        _, xla_layout = shard_regions(xla)
        model = load_model("tiny-moe", jnp.float32, 0, mesh)
        held = {d: 0 for d in mesh.devices.flat}
        for leaf in jax.tree.leaves(nnx.state(model)):
            for shard in leaf.addressable_shards:
                held[shard.device] += shard.data.nbytes
        print(json.dumps(dict(
            key=key, regions=len(regions), kv_parts=len(layout.kv_parts),
            same_shardings=all(getattr(cache, k).sharding == getattr(xla, k).sharding
                               for k in ("kv", "conv", "ssm")),
            same_layout=layout == xla_layout,
            param_bytes=param_bytes("tiny-moe", "float32", ep, tp),
            device_param_bytes=max(held.values()),
            single_param_bytes=param_bytes("tiny-moe", "float32"))), flush=True)


if __name__ == "__main__":
    _cache_child()
