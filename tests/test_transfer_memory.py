"""Regions keep their address under donated jitted updates (CPU), so NIXL registrations stay valid."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

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
