"""Moves bytes between registered memory regions of two processes over NIXL.

Knows regions, offsets and lengths, never models or requests (it imports nothing from
``qwen35_jax``, ``serving`` or ``pallas_kernels``). Modules, bottom up:

* ``memory``: regions that jitted JAX code updates in place at a fixed address;
* ``descriptors``: items -> as few NIXL descriptors as the layout allows;
* ``agent``: a NIXL agent (UCX) with its regions registered once;
* ``handshake``: side channel for metadata and the compatibility check;
* ``drain``: failed pulls whose READ still runs, held until NIXL ends it;
* ``lease``: the source's leases: bytes pinned until the puller is done with them;
* ``manager``: pin under a lease, pull (READ) with notification, timeouts, failure reports;
* ``progress``: a thread that runs the manager's protocol while its owner is busy.

At start-up, per worker::

    kv, kv_region = allocate("kv", kv_shape, jnp.bfloat16)    # one region per cache pool
    manager = TransferManager(Agent([kv_region, ...]), compat={"model": ..., ...})

then the prefill side ``manager.pin(items, on_free=...)`` and hands the returned params to
the decode side, which calls ``manager.pull(params, its_items)``. A ``ProgressThread(manager,
on_ready)`` on each side answers messages at once; the engine thread calls
``manager.collect()`` (and ``landed()``) between steps. Items are ``(region name, byte
offset, byte length)``.
"""

from transfer.agent import Agent
from transfer.descriptors import DescriptorError, Plan, coalesce, plan
from transfer.handshake import CompatibilityError, HandshakeError, check_compatible
from transfer.manager import (Completion, Faults, TransferError, TransferManager,
                              TransferParamsError)
from transfer.memory import AddressMovedError, Region, allocate, free_bytes, host_view, size_xla_pool
from transfer.progress import ProgressThread

__all__ = [
    "AddressMovedError", "Agent", "CompatibilityError", "Completion", "DescriptorError", "Faults",
    "HandshakeError", "Plan", "ProgressThread", "Region", "TransferError", "TransferManager",
    "TransferParamsError", "allocate", "check_compatible", "coalesce", "free_bytes", "host_view",
    "plan", "size_xla_pool",
]
