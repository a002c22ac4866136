"""What a worker of either role holds: an engine whose cache lives in registered memory,
a NIXL agent over that memory, its transfer manager and the thread that runs the
transfer protocol.

Threads: the engine thread owns the engine and the transfer manager's owner side: it
pins, pulls and, in its tick between steps, collects what the transfers hand back (freed
leases, landed READs, completions), since each of those changes the engine. A
``transfer.ProgressThread`` runs the protocol meanwhile and wakes the engine thread when it
leaves something to collect, so a prefill worker acks the decode side's ``done`` at once
even in the middle of a long prefill step, and the lease's blocks go back to the pools at
the next tick, through the step fence.
"""

from __future__ import annotations

import hashlib
import logging
import math
import uuid

import jax
import jax.numpy as jnp
import numpy as np

from serving.async_engine import AsyncEngine
from serving.bucket_counts import (TRANSFER_BYTES, TRANSFER_DESCRIPTORS, TRANSFER_SECONDS,
                                   BucketCounts)
from serving.engine import Engine, EngineConfig
from serving.engine.capacity import cache_dtype, plan_capacity
from serving.engine.connector import EngineConnector
from serving.kv_transfer import allocate_registered_cache, compat_record
from serving.llm import model_config
from transfer import Agent, ProgressThread, TransferManager, free_bytes
from transfer.agent import LOOPBACK

log = logging.getLogger("serving.worker")


def prompt_digest(prompt: list[int], first_token: int) -> str:
    """What a lease's state holds: the prompt, then the first token to feed."""
    data = np.asarray([*prompt, first_token], np.int64).tobytes()
    return hashlib.sha256(data).hexdigest()


class WorkerBase(EngineConnector):
    """The engine, cache regions, agent and transfer manager of one role's worker, and
    the engine loop's connector (serving/engine/connector.py): the subclasses add what
    their role does (``PrefillWorker``, ``DecodeWorker``): how a request is admitted, what
    the loop's tick does with the transfers. ``agent_type`` builds the NIXL agent from
    the regions (`transfer.Agent`; the tests pass one that injects faults). ``mtp``: the
    model's MTP head, for speculative decoding (``config``'s k): the prefill side drafts
    after the first token, the decode side verifies those drafts and drafts on."""

    role: str

    def __init__(self, model, config: EngineConfig, *, model_name: str, dtype, secret: str,
                 lease_ttl: float = 30.0, host: str = "127.0.0.1",
                 transfer_port: int = 0, transfer_interface: str = LOOPBACK, tokenizer=None,
                 max_queued_requests: int = 1024, agent_type=Agent, mtp=None,
                 iteration_timeout: float = 120.0):
        self.model_name = model_name
        cfg, mesh = model.config, config.mesh()
        self.sharded = mesh is not None
        # The budget is one device's (plan_capacity sizes a device's shard of a block or
        # slot): the least any of the engine's devices has free beside XLA's pool.
        free = [free_bytes(d) for d in (mesh.devices.flat if self.sharded else jax.devices()[:1])]
        self.capacity = plan_capacity(cfg, config, dtype, mesh=mesh,
                                      budget_bytes=None if None in free else min(free))
        cache, regions, self.layout = allocate_registered_cache(
            cfg, num_blocks=config.num_blocks, block_size=config.block_size,
            num_slots=config.num_state_rows, dtype=cache_dtype(dtype),
            ssm_dtype=jnp.dtype(config.ssm_dtype),
            mesh=mesh, mtp_layers=config.mtp_layers)
        self.compat = compat_record(cfg, cache, model_name)
        self.regions = {r.name: r for r in regions}
        # the tokenizer checks stop strings, on both sides: the first token can end one
        engine = Engine(model, cache, config, tokenizer=tokenizer, batch_type=_batch_type(),
                        mtp=mtp)
        if engine.rewrites_whole_cache:
            log.warning("a compiled program rewrites a whole cache array "
                        "(serving.engine.runner.rewrites_whole_cache): a transfer that "
                        "overlaps it can read or leave garbage")
        # unique across restarts: a peer keeps a known name's metadata, so a restarted
        # worker must not come back under its old one (an object id can repeat)
        self.agent = agent_type(regions, name=f"{self.role}-{uuid.uuid4().hex}",
                                net_devices=transfer_interface)
        self.transfer = TransferManager(self.agent, self.compat, secret=secret, host=host,
                                        port=transfer_port, lease_ttl=lease_ttl)
        # transfer_ack_seconds: of transfer_seconds, the time from the READ's landing to the
        # source's ack, during which the request's outputs are held
        self.counters = {"transfers": 0, "transfer_bytes": 0, "transfer_seconds": 0.0,
                         "transfer_ack_seconds": 0.0, "transfer_descriptors": 0,
                         "transfer_failures": 0, "leases_expired": 0,
                         # prompt tokens a pull skipped: this side's prefix cache held them
                         "transfer_cached_tokens": 0}
        # per transfer, as vLLM's NIXL histograms
        self.transfer_histograms = {"transfer_time": BucketCounts(TRANSFER_SECONDS),
                                    "transfer_size": BucketCounts(TRANSFER_BYTES),
                                    "transfer_descs": BucketCounts(TRANSFER_DESCRIPTORS)}
        self.engine = AsyncEngine(engine, max_queued_requests=max_queued_requests,
                                  connector=self, iteration_timeout=iteration_timeout)
        self.progress = ProgressThread(self.transfer, on_ready=self.engine.wake)

    def _settle(self, eng: Engine) -> None:
        """Before NIXL touches the cache: on a mesh, wait until every device has finished
        the steps dispatched so far.  The engine takes a step as done once it has read the
        step's tokens, and on a mesh that does not prove every device has finished writing
        its cache shard (on CPU, a third of TP2 steps are still writing then, whether
        the tokens of one device or of every device were read): the prompt's KV on the source, or on the
        destination a stale step's writes into blocks and a slot just freed and reserved
        for the transfer.  NIXL is ordered with none of it (transfer/memory.py).  One
        device: reading the tokens proves the step done, and nothing waits."""
        if self.sharded:
            eng.wait_for_cache()

    def stats(self) -> dict:
        return {**self.engine.stats(), **self.counters,
                **{k: h.state() for k, h in self.transfer_histograms.items()},
                "leases": self.transfer.leases,
                "pending_pulls": self.transfer.pending, "draining_pulls": self.transfer.draining,
                "agent": self.agent.name, "transfer_address": list(self.transfer.address)}

    def info(self) -> dict:
        return {"role": self.role, "model": self.model_name, "agent": self.agent.name,
                "transfer_address": list(self.transfer.address), "compat": self.compat,
                "max_model_len": self.engine.max_model_len,
                "max_logprobs": self.engine.max_logprobs, "capacity": self.capacity}

    def shutdown(self) -> None:
        self.engine.shutdown()
        self.progress.stop()
        self.transfer.close()


def param_bytes(model: str, dtype: str, ep: int = 1, tp: int = 1,
                hf_overrides: dict | None = None, quantization: str | None = None) -> int:
    """Bytes of the model's weights that one device of the engine's ``(1, ep, tp)`` mesh
    holds, from the shapes and ``qwen35_jax.sharding``'s table (nothing is allocated and
    no device is asked: JAX's GPU client must not start before ``size_xla_pool``)."""
    from flax import nnx

    import qwen35_jax
    from qwen35_jax.sharding import AXES, param_shardings

    cfg = model_config(model, hf_overrides, quantization)
    state = nnx.state(qwen35_jax.abstract_model(cfg, jnp.dtype(dtype)))
    shardings = param_shardings(cfg, state, jax.sharding.AbstractMesh((1, ep, tp), AXES))
    return sum(math.prod(s.shard_shape(x.shape)) * x.dtype.itemsize
               for x, s in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True))


def _batch_type():
    from qwen35_jax.batch import Batch

    return Batch
