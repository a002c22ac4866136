"""Moves bytes between registered memory regions of two processes over NIXL.

Knows regions, offsets and lengths, never models or requests (it imports nothing from
``qwen35_jax``, ``serving`` or ``pallas_kernels``). Modules, bottom up:

* ``memory``: regions that jitted JAX code updates in place at a fixed address;
* ``descriptors``: items -> as few NIXL descriptors as the layout allows;
* ``agent``: a NIXL agent (UCX) with its regions registered once;
* ``handshake``: side channel for metadata, the compatibility check and claims, behind
  the workers' shared secret;
* ``peers``: the agents a manager has shaken hands with, and where the dialled ones
  listen;
* ``drain``: failed pulls whose READ still runs, held until NIXL ends it;
* ``lease``: the source's leases: bytes pinned until their claimant is done with them;
* ``ticket``: what a source hands a puller, what claiming it returns, and the plan of
  a pull of that claim;
* ``pulls``: the puller's state machine: claims not yet pulled, pulls in flight, their
  completions;
* ``manager``: the endpoint: pin under a lease, claim, pull (READ) with notification,
  timeouts, failure reports, one lock over both sides and every NIXL call;
* ``progress``: a thread that runs the manager's protocol while its owner is busy;

At start-up, per worker::

    kv, kv_region = allocate("kv", kv_shape, jnp.bfloat16)    # one region per cache pool
    manager = TransferManager(Agent([kv_region, ...]), compat={"model": ...}, secret=secret)

then the prefill side ``manager.pin(items, on_free=..., meta=...)`` and hands the returned
ticket to the decode side, which calls ``manager.claim(ticket)`` (what the lease pinned,
from the source itself) and ``manager.pull(claim, its_items)``. A ``ProgressThread(manager,
on_ready)`` on each side answers messages at once; the engine thread calls
``manager.collect()`` (and ``landed()``) between steps. Items are ``(region name, byte
offset, byte length)``.
"""

from transfer.agent import Agent
from transfer.descriptors import DescriptorError, Plan, coalesce, plan
from transfer.handshake import CompatibilityError, HandshakeError, check_compatible
from transfer.lease import ClaimError
from transfer.manager import (Completion, TransferError, TransferManager,
                              TransferParamsError)
from transfer.memory import AddressMovedError, Region, allocate, free_bytes, host_view, size_xla_pool
from transfer.progress import ProgressThread
from transfer.ticket import Claim, Ticket

__all__ = [
    "AddressMovedError", "Agent", "Claim", "ClaimError", "CompatibilityError", "Completion", "DescriptorError",
    "HandshakeError", "Plan", "ProgressThread", "Region", "TransferError", "TransferManager",
    "Ticket", "TransferParamsError", "allocate", "check_compatible", "coalesce", "free_bytes", "host_view",
    "plan", "size_xla_pool",
]
