"""Grouped matmul: the reference and the Pallas kernel body (interpret mode) against a
float64 per-row oracle; the Mosaic GPU kernel's tile table, walked on CPU the way the
kernel walks it; and the padding contract around that kernel, checked with a stand-in
that enforces its input rules and leaves unowned rows unwritten (NaN). The GPU kernels
run only on sm90; bench/grouped_matmul.py checks them there before timing."""

import numpy as np
import pytest

import jax
import jax.numpy as jnp

from pallas_kernels.grouped_matmul import (
    grouped_matmul, grouped_matmul_reference, mgpu_tiles, padded_call, resolve, tile_table)


def _oracle(x, w, sizes, offset=0):
    x, w = np.asarray(x, np.float64), np.asarray(w, np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    out = np.zeros((x.shape[0], w.shape[2]))
    for r, g in enumerate(group):
        out[r] = x[r] @ w[offset + g]
    return out


def _case(rng, rows, experts, k, n, empty=()):
    """Group sizes summing to `rows`, with the groups in `empty` left empty."""
    weights = rng.random(experts)
    weights[list(empty)] = 0
    sizes = rng.multinomial(rows, weights / weights.sum()).astype(np.int32)
    x = rng.standard_normal((rows, k)).astype(np.float32)
    w = rng.standard_normal((experts, k, n)).astype(np.float32)
    return x, w, sizes


def _stand_in(lhs, rhs, group_sizes, group_offset, *, block_m, block_n, block_k,
              max_concurrent_steps):
    """The Mosaic kernel's contract: whole row tiles of at least one tile, K and N
    tile multiples; rows past sum(group_sizes) are not written (NaN here)."""
    m, k = lhs.shape
    assert m >= block_m and m % block_m == 0, (m, block_m)
    assert k % block_k == 0 and rhs.shape[2] % block_n == 0
    assert max_concurrent_steps >= 2
    out = grouped_matmul_reference(lhs, rhs, group_sizes, group_offset)
    owned = jnp.arange(m)[:, None] < jnp.sum(group_sizes)
    return jnp.where(owned, out, jnp.nan)


def _walk_tiles(x, w, sizes, offset, block_m):
    """What the Mosaic kernel does with its tile table, in float64: for each live tile,
    rows [block * block_m + lo, + size) times w[group], written in power-of-two row
    runs, largest first, as its TMA stores are. Unwritten rows stay NaN."""
    table = np.asarray(tile_table(jnp.asarray(sizes), offset, x.shape[0], block_m))
    assert table.shape == (4, -(-x.shape[0] // block_m) + len(sizes) - 1)
    out = np.full((x.shape[0], w.shape[2]), np.nan)
    for group, block, lo, size in table.T:
        assert 0 <= lo and lo + size <= block_m, (block, lo, size)
        row = block * block_m + lo
        for j in reversed(range(int(np.log2(block_m)) + 1)):
            if size & (1 << j):
                assert np.isnan(out[row:row + (1 << j)]).all(), "a row written twice"
                out[row:row + (1 << j)] = x[row:row + (1 << j)] @ w[group]
                row += 1 << j
    return out


@pytest.mark.parametrize("rows,experts,empty", [(64, 4, ()), (200, 8, (0, 3, 7)),
                                                 (1000, 64, tuple(range(0, 64, 3))),
                                                 (256, 16, tuple(range(1, 16)))])
def test_tile_table_covers_each_row_once_with_its_group(rows, experts, empty):
    """Every owned row lies in exactly one live tile, multiplied by its own group's
    weights (offset into a stack of 2 layers); padding rows past the groups are never
    written; live tiles come first and the rest have no rows."""
    rng = np.random.default_rng(rows)
    owned = rows - 5
    x, _, sizes = _case(rng, owned, experts, 8, 8, empty=empty)
    x = np.concatenate([x, rng.standard_normal((5, 8))])
    x = np.pad(x, ((0, -rows % 64), (0, 0)))
    w = rng.standard_normal((2 * experts, 8, 8))
    out = _walk_tiles(x, w, sizes, experts, 64)
    ref = _oracle(x[:owned], w, sizes, experts)
    assert np.isfinite(out[:owned]).all() and np.isnan(out[owned:]).all()
    np.testing.assert_allclose(out[:owned], ref, rtol=1e-12, atol=1e-12)
    size = np.asarray(tile_table(jnp.asarray(sizes), experts, x.shape[0], 64))[3]
    live = int((size > 0).sum())
    assert (size[:live] > 0).all() and (size[live:] == 0).all()


def test_reference_matches_oracle_with_empty_groups():
    rng = np.random.default_rng(0)
    x, w, sizes = _case(rng, 37, 6, 16, 24, empty=(0, 3))
    out = grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes))
    ref = _oracle(x, w, sizes)
    assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < 1e-5


@pytest.mark.parametrize("rows", [8, 64, 100, 192])
def test_padding_to_row_tiles_returns_every_row(rows):
    """Decode-size row counts (below one tile) and ragged ones are padded to whole
    tiles; every returned row is written and right, padding rows are cut off."""
    rng = np.random.default_rng(rows)
    x, w, sizes = _case(rng, rows, 8, 128, 128, empty=(1, 5))
    w = np.concatenate([rng.standard_normal(w.shape).astype(np.float32), w])  # 2 layers
    tiles = dict(block_m=64, block_n=128, block_k=64, max_concurrent_steps=4)
    out = np.asarray(padded_call(_stand_in, jnp.asarray(x), jnp.asarray(w),
                                 jnp.asarray(sizes), 8, tiles))
    assert out.shape == (rows, 128) and np.isfinite(out).all()
    ref = _oracle(x, w, sizes, 8)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5


def test_expert_combine_masks_foreign_copies(monkeypatch):
    """Expert-parallel shard holding experts 2..3 of 4: the grouped matmuls leave the
    rows of copies routed elsewhere unwritten (NaN here, as the GPU kernels leave them);
    the combine must drop them, not multiply them by zero."""
    from qwen35_jax.layers import moe

    def leaves_foreign_rows_nan(x, w, group_sizes, *, group_offset=0, scale=None, splits=1):
        out = grouped_matmul_reference(x, w, group_sizes, group_offset, scale, splits)
        return jnp.where(jnp.arange(x.shape[0])[:, None] < jnp.sum(group_sizes), out, jnp.nan)

    monkeypatch.setattr(moe, "grouped_matmul", leaves_foreign_rows_nan)
    rng = np.random.default_rng(7)
    t, d, inter, k = 6, 8, 4, 2
    x = rng.standard_normal((t, d)).astype(np.float32)
    experts = np.array([[0, 2], [3, 1], [2, 3], [1, 0], [3, 2], [0, 1]], np.int32)
    weights = rng.random((t, k)).astype(np.float32)
    w_gate_up = rng.standard_normal((2, d, 2 * inter)).astype(np.float32)  # experts 2, 3
    w_down = rng.standard_normal((2, inter, d)).astype(np.float32)
    out = np.asarray(moe._local_experts(jnp.asarray(x), jnp.asarray(experts),
                                        jnp.asarray(weights), jnp.asarray(w_gate_up),
                                        jnp.asarray(w_down), None, 2, 0))
    ref = np.zeros((t, d))
    for i in range(t):
        for j in range(k):
            if experts[i, j] >= 2:
                e = experts[i, j] - 2
                h = x[i].astype(np.float64) @ w_gate_up[e]
                act = h[:inter] / (1 + np.exp(-h[:inter])) * h[inter:]
                ref[i] += weights[i, j] * (act @ w_down[e])
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, ref, rtol=1e-4, atol=1e-5)


def test_tiles_follow_the_operands():
    w = jnp.zeros((4, 2048, 1024), jnp.bfloat16)
    assert mgpu_tiles(jnp.zeros((8, 2048), jnp.bfloat16), w)["block_n"] == 256
    narrow = jnp.zeros((4, 2048, 384), jnp.bfloat16)  # a multiple of 128, not of 256
    assert mgpu_tiles(jnp.zeros((8, 2048), jnp.bfloat16), narrow)["block_n"] == 128
    assert mgpu_tiles(jnp.zeros((8, 2048), jnp.float32), w.astype(jnp.float32)) is None
    assert mgpu_tiles(jnp.zeros((8, 2000), jnp.bfloat16),
                      jnp.zeros((4, 2000, 1024), jnp.bfloat16)) is None


@pytest.mark.parametrize("dtype,bound", [(jnp.float32, 1e-5), (jnp.bfloat16, 1e-2)])
@pytest.mark.parametrize("rows", [1, 16, 37, 90])
def test_pallas_body_reads_one_layer_of_a_stack(rows, dtype, bound):
    """The Pallas kernel body in interpret mode, on weights stacked over 3 layers: every
    layer's offset, empty experts, groups longer than one row tile (16 rows, 16-wide K
    and N tiles on CPU); rows past the groups are left alone, NaN never passes."""
    rng = np.random.default_rng(rows)
    experts, layers = 6, 3
    x = rng.standard_normal((rows, 32)).astype(np.float32)
    owned = rows - 3 if rows > 3 else rows  # the last rows belong to no group
    sizes = rng.multinomial(owned, np.r_[0.3, 0, 0.2, 0.2, 0, 0.3]).astype(np.int32)
    w = rng.standard_normal((layers * experts, 32, 48)).astype(np.float32)
    xd, wd = jnp.asarray(x, dtype), jnp.asarray(w, dtype)
    fn = jax.jit(lambda a, b, g, o: grouped_matmul(a, b, g, group_offset=o, backend="interpret"))
    for layer in range(layers):
        out = np.asarray(fn(xd, wd, jnp.asarray(sizes), layer * experts), np.float64)[:owned]
        ref = _oracle(np.asarray(xd, np.float64), np.asarray(wd, np.float64), sizes,
                      layer * experts)[:owned]
        assert np.isfinite(out).all()
        assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < bound, layer


def test_reference_reads_one_layer_of_a_stack():
    rng = np.random.default_rng(3)
    x, _, sizes = _case(rng, 29, 4, 8, 8, empty=(2,))
    w = rng.standard_normal((12, 8, 8)).astype(np.float32)
    out = grouped_matmul_reference(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes), 8)
    ref = _oracle(x, w, sizes, 8)
    assert np.linalg.norm(np.asarray(out) - ref) / np.linalg.norm(ref) < 1e-5


def test_dispatch_on_cpu_is_the_reference():
    assert resolve("auto") == "reference" and resolve("mgpu") == "mgpu"
    assert resolve("auto", rows=10**6) == "reference" and resolve("pallas") == "pallas"
    with pytest.raises(ValueError):
        resolve("triton")
    rng = np.random.default_rng(1)
    x, w, sizes = _case(rng, 40, 4, 32, 16)
    out = np.asarray(grouped_matmul(jnp.asarray(x), jnp.asarray(w), jnp.asarray(sizes)))
    ref = _oracle(x, w, sizes)
    assert np.linalg.norm(out - ref) / np.linalg.norm(ref) < 1e-5
