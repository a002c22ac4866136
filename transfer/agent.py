"""One NIXL agent (UCX backend) that owns a fixed set of registered regions.

Regions are registered once, when the agent is made: registration pins memory and builds
UCX keys, far too slow to repeat per request, and the addresses never change (see
``transfer.memory``). All regions of an agent share one memory type (DRAM on CPU, VRAM on
GPU) so that every transfer is one NIXL request. On GPU, create the agent (and post
transfers) on a thread whose current CUDA device is the regions' one; the constructor makes
it current for its own thread.

The agent runs in NIXL's STRICT thread-sync mode, so calls from several threads are safe:
the NIXL agent then takes one mutex around every call into its backends, and the UCX
backend runs its worker in UCX's SERIALIZED mode (NIXL's ``src/core/sync.h`` and
``makeMtType`` in ``src/plugins/ucx/ucx_utils.cpp``). ``TransferManager`` calls it from its
owner thread and its progress thread, one call at a time under its own lock; a thread that
calls it binds itself first (``bind_thread``).

UCX's TCP transport listens on every network device it is allowed; an agent allows only
``net_devices`` (UCX's ``UCX_NET_DEVICES``: loopback unless the owner names another, such
as the RDMA device or interface a multi-host deployment transfers over), so a worker's
memory is not offered on an external interface by default. Shared memory and CUDA IPC are
not network devices and stay available between processes of one host.
"""

from __future__ import annotations

import logging
import os
import uuid
from typing import Sequence

import numpy as np
from nixl._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t, nixl_xfer_handle
from nixl._bindings import nixlRemoteDisconnectError

from transfer.memory import Region, make_current

log = logging.getLogger(__name__)

LOOPBACK = "lo"


class PeerDisconnected(RuntimeError):
    """NIXL knows the peer's connection is gone (its process died or it removed us)."""


class Agent:
    """A NIXL agent with ``regions`` registered on the UCX backend."""

    def __init__(self, regions: Sequence[Region], name: str | None = None, num_threads: int = 0,
                 progress_thread: bool | None = None, net_devices: str = LOOPBACK):
        if not regions:
            raise ValueError("an agent needs at least one region")
        names = [r.name for r in regions]
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate region names: {names}")
        mem_types = {r.mem_type for r in regions}
        if len(mem_types) != 1:
            raise ValueError(f"regions of one agent must share a memory type, got {sorted(mem_types)}")
        self.mem_type = mem_types.pop()
        self.regions = {r.name: r for r in regions}
        self.bind_thread()  # before UCX starts
        self.name = name or f"transfer-{uuid.uuid4().hex}"
        # NIXL's progress thread spins (its Python API fixes the delay at 0): on CPU it took
        # ~10 % of a core per idle agent. Without it UCX advances only inside our NIXL
        # calls, so both sides must call ``TransferManager.progress()`` regularly, also
        # when idle (a peer may READ at any time); the workers' ``transfer.progress``
        # threads do, every millisecond while a lease or pull is open, and DRAM READs
        # complete as fast as with the thread. On GPU a READ does not complete without
        # the thread (bench/RESULTS.md, "Transfer"), so VRAM agents keep it by default.
        if progress_thread is None:
            progress_thread = self.mem_type == "VRAM"
        if self.mem_type == "VRAM":
            # UCX's cuda_ipc offers zero-copy GET (our READ) only where NVML reports active
            # NVLinks on GPU 0 (``uct_cuda_ipc_iface_get_max_get_zcopy``); elsewhere, e.g.
            # prefill and decode processes on one H200, the READ falls back to software
            # emulation over TCP at 0.5 GB/s. Forced on, the same READ runs at copy speed
            # (bench/RESULTS.md, "Transfer", one H200). UCX reads it when the agent's context
            # starts; a value already in the environment wins.
            os.environ.setdefault("UCX_CUDA_IPC_ENABLE_GET_ZCOPY", "y")
        given = os.environ.get("UCX_NET_DEVICES")
        if given not in (None, net_devices):
            log.warning("UCX_NET_DEVICES=%s in the environment is replaced by %s (name the "
                        "devices to transfer over with the workers' --transfer-interface)",
                        given, net_devices)
        os.environ["UCX_NET_DEVICES"] = net_devices  # read when the agent's UCX context starts
        config = nixl_agent_config(enable_prog_thread=progress_thread, num_threads=num_threads,
                                   backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._nixl = nixl_agent(self.name, config)
        if "UCX" not in self._nixl.backends:
            raise RuntimeError("NIXL's UCX backend is unavailable")
        self._registered = self._nixl.register_memory(
            [(r.addr, r.nbytes, r.device_id, "") for r in regions], self.mem_type, backends=["UCX"])

    def bind_thread(self) -> None:
        """Make the regions' CUDA device current in the calling thread (no-op for DRAM);
        call it in every thread that uses the agent, before its first call there. UCX
        chooses GPU transports per thread: without a current context it leaves out cuda_ipc."""
        make_current(next(iter(self.regions.values())))

    def metadata(self) -> bytes:
        """Everything a peer needs to reach this agent's registered memory."""
        return self._nixl.get_agent_metadata()

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer's metadata and open the connection now; returns its agent name.

        Opening it here rather than inside the first transfer matters: notifications were
        lost when many READs started on a connection still being set up (CPU/UCX)."""
        name = self._nixl.add_remote_agent(metadata)
        self._nixl.make_connection(name)
        return name.decode() if isinstance(name, bytes) else name

    def remove_peer(self, name: str) -> None:
        self._nixl.remove_remote_agent(name)

    def read(self, peer: str, local: np.ndarray, remote: np.ndarray, remote_mem_type: str,
             notif: bytes) -> tuple[nixl_xfer_handle, str]:
        """Post one READ of ``remote`` (peer's Nx3 descriptors) into ``local``.

        NIXL sends ``notif`` to the peer once the data has arrived. Returns the handle and
        the first state: "DONE", "PROC" or "ERR". Raises PeerDisconnected if the peer is gone.
        """
        try:
            handle = self._nixl.initialize_xfer(
                "READ", self._nixl.get_xfer_descs(local, self.mem_type),
                self._nixl.get_xfer_descs(remote, remote_mem_type), peer, notif)
        except nixlRemoteDisconnectError as e:
            raise PeerDisconnected(f"peer {peer} disconnected: {e}") from None
        try:
            return handle, self._nixl.transfer(handle)
        except nixlRemoteDisconnectError as e:
            self.release(handle)
            raise PeerDisconnected(f"peer {peer} disconnected: {e}") from None
        except Exception:
            self.release(handle)
            raise

    def state(self, handle: nixl_xfer_handle) -> str:
        """"DONE", "PROC" or "ERR" (also when NIXL raises, e.g. for a vanished peer)."""
        try:
            return self._nixl.check_xfer_state(handle)
        except Exception as e:  # NIXL raises backend-specific types
            log.warning("transfer state check failed: %r", e)
            return "ERR"

    def release(self, handle: nixl_xfer_handle) -> bool:
        """Free a transfer handle; False if NIXL refused. NIXL's API promises to cancel
        an active transfer or refuse, but its UCX backend (1.5.1) does neither: it frees
        the request and the READ runs on, so its bytes may still land afterwards (UCX
        cancels only tag receives; NIXL issues ai-dynamo/nixl#2067, #2044)."""
        try:
            handle.release()
            return True
        except Exception as e:  # NIXL raises backend-specific types
            log.warning("could not release transfer handle %r: %s", handle, e)
            return False

    def notify(self, peer: str, message: bytes) -> None:
        self._nixl.send_notif(peer, message)

    def notifications(self) -> dict[str, list[bytes]]:
        """New notifications since the last call, by sender agent name."""
        return self._nixl.get_new_notifs()

    def close(self) -> None:
        """Deregister the regions; the agent must not be used afterwards."""
        if self._registered is not None:
            self._nixl.deregister_memory(self._registered, backends=["UCX"])
            self._registered = None
