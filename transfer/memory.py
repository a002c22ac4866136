"""Regions: memory that NIXL reads at a fixed address while jitted JAX code updates it in place.

NIXL registers a region once, at start-up, by address. The engine's compiled steps update
the same memory step after step with ``jax.jit(..., donate_argnums=...)``. A region is
therefore usable only if (a) the transport reaches it at full speed and (b) a donated
update writes its output into the very same bytes, so the registered address never goes
stale. What keeps (b) true differs between backends (measured with jax 0.10.2 on CPU;
jax 0.11.2 on H200, see ``../shared/reference/anchors.md``):

* **CPU (DRAM).** An XLA-allocated array (``jnp.zeros``) keeps its
  ``unsafe_buffer_pointer()`` under donation, step after step, for every leaf of a donated
  pytree whose output has the input's shape and dtype. A buffer imported zero-copy through
  DLPack (from NumPy, say) does *not*: XLA's CPU client does not reuse a foreign buffer
  for a donated output, so the first donated step silently moves the array to fresh
  XLA-owned memory and the external memory is never written again. Regions on CPU are
  therefore plain XLA arrays; their host memory is ordinary DRAM that UCX registers.
* **GPU (VRAM).** XLA allocates through the CUDA virtual-memory API, which UCX's cuda_ipc
  transport does not export: reading such memory from another process falls back to TCP,
  about 800x slower than NVLink. Memory from a plain ``cudaMalloc`` is IPC-capable. A region
  on GPU is a ``cudaMalloc``'d buffer (allocated through PyTorch here, the DLPack producer
  present in the GPU image) imported zero-copy with ``jax.dlpack.from_dlpack``; on GPU a
  donated jitted update writes into that same memory. Measured with ``bench.transfer`` on
  2xH200 (jax 0.11.2, torch 2.11): such a region is legacy-IPC capable while an XLA array
  is not, UCX picks ``cuda_ipc`` zero-copy for the READ, and donated updates kept every
  region at its address in both processes. The producer's tensor is kept alive in
  ``Region.owner`` because JAX does not own the memory. An array sharded over several
  GPUs (``allocate_sharded``) is one such buffer per device, of the shard's shape,
  assembled with ``jax.make_array_from_single_device_arrays``: one region per device.

Either way the caller must (0) keep the live array (the latest donated output) referenced
while the region is registered: on CPU it is what owns the memory; (1) donate the region's
array in *every* step that updates it, and jit such steps with ``keep_unused=True`` when
the output may not read the input (a reset, say): otherwise ``jax.jit`` prunes the unused
argument, nothing is donated, and the output silently lands in new memory (seen on CPU);
(2) hold no zero-copy NumPy view (``np.asarray(array)``) of it across a step: on CPU such
an external reference makes XLA copy instead of donate; and (3) finish in-flight steps
(``block_until_ready``) before NIXL reads or writes the bytes: NIXL is not ordered with
XLA's streams. ``Region.check`` tells whether an array still lives at the registered
address, so an engine can assert (1) and (2) cheaply.
"""

from __future__ import annotations

import ctypes
import dataclasses
import math
import os
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np


class AddressMovedError(RuntimeError):
    """An array no longer lives at its region's registered address (an update was not donated)."""


@dataclasses.dataclass(frozen=True)
class Region:
    """A contiguous span of registered memory: what NIXL and peers know about a cache buffer.

    ``owner`` keeps the memory alive while the region is in use and never travels to peers:
    on GPU the producer's tensor; on CPU the first JAX array, which owns the memory until
    its first donation hands it to the output (from then on the engine's live array does).
    """

    name: str
    addr: int
    nbytes: int
    device_id: int
    mem_type: str  # "DRAM" or "VRAM", NIXL's names
    owner: Any = dataclasses.field(default=None, compare=False, repr=False)

    def to_json(self) -> dict:
        """The public description a peer needs to address this region."""
        return {"addr": self.addr, "nbytes": self.nbytes, "device_id": self.device_id,
                "mem_type": self.mem_type}

    @classmethod
    def from_json(cls, name: str, d: dict) -> "Region":
        return cls(name, int(d["addr"]), int(d["nbytes"]), int(d["device_id"]), str(d["mem_type"]))

    def check(self, array: jax.Array) -> None:
        """Raise AddressMovedError unless ``array`` still occupies this region."""
        ptr = array.unsafe_buffer_pointer()
        if ptr != self.addr:
            raise AddressMovedError(
                f"region {self.name!r}: array moved from {self.addr:#x} to {ptr:#x}; "
                "every update of a registered cache must donate it")


def allocate(name: str, shape: tuple[int, ...], dtype, device: jax.Device | None = None
             ) -> tuple[jax.Array, Region]:
    """A zeroed JAX array of ``shape``/``dtype`` on ``device`` plus the region it occupies
    (``allocate_sharded`` on one device)."""
    sharding = jax.sharding.SingleDeviceSharding(device or jax.devices()[0])
    array, (region,) = allocate_sharded(name, shape, dtype, sharding)
    return array, region


def allocate_sharded(name: str, shape: tuple[int, ...], dtype, sharding: jax.sharding.Sharding
                     ) -> tuple[jax.Array, list[Region]]:
    """A zeroed JAX array of global ``shape``/``dtype`` laid out by ``sharding``, plus one
    region per addressable device shard, in device-id order, named ``name`` when there is
    one shard and ``name@<i>`` (i-th in that order) otherwise.  A shard that several devices
    hold (replicated along a mesh axis) is a region on each of them.

    CPU: an XLA-allocated array created in that layout; its shards are ordinary DRAM.
    GPU: per device, cudaMalloc'd memory of the shard's shape imported through DLPack,
    assembled into the global array without a copy (checked)."""
    shape = tuple(shape)
    devices = sorted(sharding.addressable_devices, key=lambda d: d.id)
    shard_shape = sharding.shard_shape(shape)
    nbytes = math.prod(shard_shape) * np.dtype(dtype).itemsize
    if nbytes == 0:
        raise ValueError(f"region {name!r}: empty shard {shard_shape} of {shape}")
    platforms = {d.platform for d in devices}
    if platforms == {"cpu"}:
        array = jax.block_until_ready(jnp.zeros(shape, dtype, device=sharding))
        return array, host_regions(name, array)
    if platforms == {"gpu"}:
        pieces = [_allocate_cuda(n, shard_shape, dtype, d, nbytes)
                  for n, d in zip(_region_names(name, len(devices)), devices)]
        array = jax.make_array_from_single_device_arrays(shape, sharding, [a for a, _ in pieces])
        regions = [r for _, r in pieces]
        for region, shard in zip(regions, device_shards(array), strict=True):
            ptr = shard.data.unsafe_buffer_pointer()
            if ptr != region.addr or shard.device.local_hardware_id != region.device_id:
                raise RuntimeError(
                    f"region {region.name!r}: assembling the sharded array moved the shard from "
                    f"{region.addr:#x} on GPU {region.device_id} to {ptr:#x} on "
                    f"{shard.device}; its registered memory would never be written")
        return array, regions
    raise NotImplementedError(f"no region allocator for platforms {sorted(platforms)}")


def device_shards(array: jax.Array) -> list:
    """The array's addressable shards in device-id order (the order of its regions)."""
    return sorted(array.addressable_shards, key=lambda s: s.device.id)


def host_regions(name: str, array: jax.Array) -> list[Region]:
    """The regions of an XLA-allocated host (CPU) array's shards, named and ordered as
    ``allocate_sharded`` does; ``owner`` is the array."""
    shards = device_shards(array)
    if {s.device.platform for s in shards} != {"cpu"}:
        raise ValueError(f"region {name!r}: XLA's device memory is not registrable "
                         "(transfer.memory); allocate it with allocate_sharded")
    return [Region(n, s.data.unsafe_buffer_pointer(), s.data.nbytes, 0, "DRAM", owner=array)
            for n, s in zip(_region_names(name, len(shards)), shards)]


def _region_names(name: str, count: int) -> list[str]:
    return [name] if count == 1 else [f"{name}@{i}" for i in range(count)]


def size_xla_pool(param_bytes: int, utilization: float) -> int | None:
    """On a GPU, before JAX starts: cap XLA's memory pool at ``param_bytes`` (the weights
    one device holds) plus the share ``1 - utilization`` of the device (activations,
    compiled programs' scratch), so that the regions, allocated beside the pool, get the
    rest. Returns the device's total bytes, or None without a GPU.

    XLA's pool never shrinks, and grown on demand while the weights were created it kept
    all but 11 GiB of an H200 (bench/RESULTS.md, "First light"), so an uncapped pool keeps
    memory the cache needs. Sets ``XLA_PYTHON_CLIENT_MEM_FRACTION``; a value already in
    the environment wins."""
    import torch

    if not torch.cuda.is_available():
        return None
    _, total = torch.cuda.mem_get_info(0)
    fraction = min(0.95, (param_bytes + (1 - utilization) * total) / total)
    os.environ.setdefault("XLA_PYTHON_CLIENT_MEM_FRACTION", f"{fraction:.4f}")
    return total


def free_bytes(device: jax.Device, margin: int = 1 << 30) -> int | None:
    """What a region may still take on ``device``: its free memory less ``margin`` (for
    CUDA contexts and NIXL) on GPU, where regions live beside XLA's pool; None on CPU
    (regions are XLA arrays there: ask XLA, or size the cache explicitly)."""
    if device.platform != "gpu":
        return None
    import torch

    free, _ = torch.cuda.mem_get_info(device.local_hardware_id)
    return free - margin


def _allocate_cuda(name, shape, dtype, device, nbytes):
    import torch  # only the GPU path needs it; the GPU image has it

    torch_device = torch.device("cuda", device.local_hardware_id)
    owner = torch.zeros(nbytes, dtype=torch.uint8, device=torch_device)
    torch.cuda.synchronize(torch_device)  # zeroing runs on torch's stream, not JAX's
    typed = owner.view(getattr(torch, np.dtype(dtype).name)).view(shape)
    with torch.cuda.device(torch_device):  # torch exports only from its current device
        array = jax.dlpack.from_dlpack(typed)
    addr = owner.data_ptr()
    if array.unsafe_buffer_pointer() != addr or array.devices() != {device}:
        raise RuntimeError(f"region {name!r}: DLPack import copied the buffer instead of sharing it")
    return array, Region(name, addr, nbytes, device.local_hardware_id, "VRAM", owner=owner)


def make_current(region: Region) -> None:
    """Make a VRAM region's CUDA device current in this thread (no-op for DRAM).

    UCX picks its transports per thread: with no current CUDA context it leaves out
    cuda_ipc, and reads between GPUs fall back to slow paths.
    """
    if region.mem_type == "VRAM":
        import torch

        torch.cuda.set_device(region.device_id)


def host_view(region: Region) -> np.ndarray:
    """The region's bytes as a writable uint8 NumPy view (DRAM only; for tests and benchmarks).

    Writing through it bypasses XLA: only do so with no step in flight.
    """
    if region.mem_type != "DRAM":
        raise ValueError(f"region {region.name!r} is {region.mem_type}, not host memory")
    return np.ctypeslib.as_array((ctypes.c_uint8 * region.nbytes).from_address(region.addr))
