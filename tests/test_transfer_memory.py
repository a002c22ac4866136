"""Regions keep their address under donated jitted updates (CPU), so NIXL registrations
stay valid: single arrays, and arrays sharded over a mesh (one region per device shard)."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from host_devices import child_records

from transfer.memory import AddressMovedError, allocate, host_view


def _step(cache, i, x):
    kv = jax.lax.dynamic_update_slice(cache["kv"], jnp.full((1, 256), x, cache["kv"].dtype), (i, 0))
    return {"kv": kv, "ssm": cache["ssm"] * 2 + 1}, kv.sum()


def test_allocate_gives_array_at_region_address():
    array, region = allocate("kv", (16, 256), jnp.bfloat16)
    assert region.addr == array.unsafe_buffer_pointer()
    assert region.nbytes == 16 * 256 * 2 and region.mem_type == "DRAM" and region.device_id == 0
    assert not host_view(region).any()
    region.check(array)


def test_donated_updates_stay_in_place_and_are_visible_at_the_address():
    kv, kv_region = allocate("kv", (16, 256), jnp.bfloat16)
    ssm, ssm_region = allocate("ssm", (4, 64), jnp.float32)
    cache = {"kv": kv, "ssm": ssm}
    step = jax.jit(_step, donate_argnums=0)
    for i in range(4):
        cache, _ = step(cache, i, 3.0)
        kv_region.check(cache["kv"])
        ssm_region.check(cache["ssm"])
    jax.block_until_ready(cache)
    ssm_bytes = host_view(ssm_region).view(np.float32).reshape(4, 64)
    np.testing.assert_array_equal(ssm_bytes, np.full((4, 64), 15.0))  # 0 -> 1 -> 3 -> 7 -> 15
    assert (host_view(kv_region).view(jnp.bfloat16).reshape(16, 256)[:4] == 3).all()


def test_update_without_donation_moves_and_check_says_so():
    array, region = allocate("kv", (8, 256), jnp.float32)
    moved, _ = jax.jit(_step)({"kv": array, "ssm": jnp.zeros(1)}, 0, 1.0)
    with pytest.raises(AddressMovedError, match="donate"):
        region.check(moved["kv"])


def test_update_ignoring_its_input_needs_keep_unused():
    """jax.jit prunes an unused argument, so nothing is donated unless keep_unused=True."""
    array, region = allocate("kv", (8, 256), jnp.uint8)
    array = jax.jit(lambda a: jnp.ones_like(a), donate_argnums=0, keep_unused=True)(array)
    region.check(array)
    array = jax.jit(lambda a: jnp.ones_like(a), donate_argnums=0)(array)
    with pytest.raises(AddressMovedError):
        region.check(array)


def test_a_live_numpy_view_prevents_donation():
    array, region = allocate("kv", (8, 256), jnp.float32)
    view = np.asarray(array)  # zero-copy on CPU: an external reference to the buffer
    moved = jax.jit(lambda a: a + 1, donate_argnums=0)(array)
    with pytest.raises(AddressMovedError):
        region.check(moved)
    assert not view.any()


def test_cpu_does_not_donate_into_dlpack_imported_memory():
    """The finding behind XLA-allocated regions on CPU (see transfer.memory's docstring)."""
    raw = np.zeros((1 << 16) + 64, np.uint8)
    start = (-raw.ctypes.data) % 64  # XLA imports 64-byte aligned host memory without copying
    external = raw[start:start + (1 << 16)]
    array = jax.dlpack.from_dlpack(external)
    assert array.unsafe_buffer_pointer() == external.ctypes.data
    array = jax.jit(lambda a: a + 1, donate_argnums=0)(array)
    jax.block_until_ready(array)
    assert array.unsafe_buffer_pointer() != external.ctypes.data
    assert not external.any()  # the update never reached the external memory


# ---- sharded arrays (8 host devices, in a child process) ------------------------------
#
# The CPU backend's device count is fixed when JAX starts and this session's JAX is up,
# so the sharded checks run in a child started with 8 host devices (this file as a
# script, as tests/test_sharding.py does); it prints one JSON record per mesh.

SHARDED_MESHES = {"tp2": (1, 2), "ep2": (2, 1), "ep2,tp2": (2, 2)}  # (expert, tensor)


# The session starts the child ahead, at the lowest CPU priority, while earlier modules
# run (conftest, ``host_devices.Ahead``); the fixture takes it over.
AHEAD_CHILDREN = [()]


@pytest.fixture(scope="module")
def sharded_records():
    return child_records(__file__, timeout=300)


@pytest.mark.parametrize("mesh", list(SHARDED_MESHES))
def test_sharded_regions_are_the_shards(sharded_records, mesh):
    """One region per device, named and sized as its shard, at the shard's address; a
    shard held by several devices (replicated along ``expert``) is a region on each."""
    r = sharded_records[mesh]
    ep, tp = SHARDED_MESHES[mesh]
    n = ep * tp
    assert r["names"]["kv"] == (["kv"] if n == 1 else [f"kv@{i}" for i in range(n)])
    assert r["nbytes"]["kv"] == [16 * 256 * 4 // tp] * n  # split over tensor, copied over expert
    assert r["nbytes"]["ssm"] == [4 * 64 * 4] * n  # replicated: a whole copy per device
    assert r["at_shard"] and r["distinct"]


@pytest.mark.parametrize("mesh", list(SHARDED_MESHES))
def test_donated_sharded_updates_keep_every_shard_in_place(sharded_records, mesh):
    r = sharded_records[mesh]
    assert r["in_place"] == [True, True], r  # two donated steps, every region checked
    assert r["values_at_addresses"], r  # the updates landed in the registered bytes


@pytest.mark.parametrize("mesh", list(SHARDED_MESHES))
def test_check_catches_a_moved_shard(sharded_records, mesh):
    assert sharded_records[mesh]["moved_caught"] is True


def _sharded_child() -> None:
    from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

    from transfer.memory import allocate_sharded, device_shards

    for key, (ep, tp) in SHARDED_MESHES.items():
        mesh = Mesh(np.asarray(jax.devices()[:ep * tp]).reshape(ep, tp), ("expert", "tensor"))
        shardings = {"kv": NamedSharding(mesh, P(None, "tensor")), "ssm": NamedSharding(mesh, P())}
        cache, regions = {}, {}
        cache["kv"], regions["kv"] = allocate_sharded("kv", (16, 256), jnp.float32, shardings["kv"])
        cache["ssm"], regions["ssm"] = allocate_sharded("ssm", (4, 64), jnp.float32,
                                                        shardings["ssm"])
        record = {"key": key, "names": {k: [r.name for r in v] for k, v in regions.items()},
                  "nbytes": {k: [r.nbytes for r in v] for k, v in regions.items()}}
        record["at_shard"] = all(
            r.addr == s.data.unsafe_buffer_pointer() and r.nbytes == s.data.nbytes
            and r.mem_type == "DRAM" and r.owner is cache[k]
            for k in cache for r, s in zip(regions[k], device_shards(cache[k]), strict=True))
        addrs = [r.addr for v in regions.values() for r in v]
        record["distinct"] = len(set(addrs)) == len(addrs)

        def in_place(c):
            try:
                for k in c:
                    for r, s in zip(regions[k], device_shards(c[k]), strict=True):
                        r.check(s.data)
                return True
            except AddressMovedError:
                return False

        step = jax.jit(_step, donate_argnums=0, out_shardings=(shardings, None))
        record["in_place"] = []
        for i in range(2):
            cache, _ = step(cache, i, 3.0)
            jax.block_until_ready(cache)
            record["in_place"].append(in_place(cache))
        kv_ok = all((host_view(r).view(np.float32).reshape(16, -1)[:2] == 3).all()
                    and not host_view(r).view(np.float32).reshape(16, -1)[2:].any()
                    for r in regions["kv"])
        ssm_ok = all((host_view(r).view(np.float32) == 3).all() for r in regions["ssm"])
        record["values_at_addresses"] = bool(kv_ok and ssm_ok)  # ssm: 0 -> 1 -> 3
        moved, _ = jax.jit(_step, out_shardings=(shardings, None))(cache, 0, 1.0)  # no donation
        record["moved_caught"] = not in_place(moved) and in_place(cache)
        print(json.dumps(record), flush=True)


if __name__ == "__main__":
    _sharded_child()
