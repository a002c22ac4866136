"""Descriptor planning: as few descriptors as the layout allows, and malformed items refused."""

import numpy as np
import pytest

from transfer.descriptors import DescriptorError, check_inside, coalesce, plan, validate
from transfer.memory import Region

LOCAL = {"kv": Region("kv", 0x10000, 1 << 20, 0, "DRAM"), "ssm": Region("ssm", 0x900000, 4096, 0, "DRAM")}
REMOTE = {"kv": Region("kv", 0x7000000, 1 << 20, 0, "DRAM"), "ssm": Region("ssm", 0x8000000, 8192, 0, "DRAM")}
B = 1024  # block bytes


def blocks(region, ids):
    return [(region, i * B, B) for i in ids]


def test_coalesce_merges_touching_items_and_counts():
    assert coalesce(blocks("kv", [3, 4, 5, 9, 10])) == [("kv", 3 * B, 3 * B), ("kv", 9 * B, 2 * B)]
    assert len(coalesce(blocks("kv", [7, 1, 2, 0]))) == 2  # order does not matter: 0-2, 7
    assert len(coalesce(blocks("kv", [0, 1]) + blocks("ssm", [2]))) == 2  # never across regions


def test_coalesce_refuses_overlap():
    with pytest.raises(DescriptorError, match="overlap in region 'kv'"):
        coalesce([("kv", 0, 100), ("kv", 50, 100)])


def test_consecutive_blocks_on_both_sides_are_one_descriptor():
    p = plan(blocks("kv", range(10, 20)), LOCAL, blocks("kv", range(40, 50)), REMOTE)
    assert p.count == 1 and p.nbytes == 10 * B
    np.testing.assert_array_equal(p.local, [[0x10000 + 10 * B, 10 * B, 0]])
    np.testing.assert_array_equal(p.remote, [[0x7000000 + 40 * B, 10 * B, 0]])


def test_runs_break_where_either_side_breaks():
    local = blocks("kv", [0, 1, 2, 3, 8, 9])
    remote = blocks("kv", [5, 6, 20, 21, 22, 23])
    p = plan(local, LOCAL, remote, REMOTE)
    # pieces: l0-1<-r5-6, l2-3<-r20-21, l8-9<-r22-23
    assert p.count == 3
    assert sorted(map(tuple, p.remote.tolist())) == sorted(
        [(0x7000000 + 5 * B, 2 * B, 0), (0x7000000 + 20 * B, 2 * B, 0), (0x7000000 + 22 * B, 2 * B, 0)])


def test_sides_may_cut_the_stream_differently():
    # the source pinned one coalesced span, the destination uses separate blocks and a state slot
    remote = [("kv", 0, 4 * B), ("ssm", 4096, 512)]
    local = blocks("kv", [7, 8, 2, 3]) + [("ssm", 1024, 512)]
    p = plan(local, LOCAL, remote, REMOTE)
    assert p.count == 3  # l7-8 <- r0-1, l2-3 <- r2-3, ssm
    assert p.nbytes == 4 * B + 512
    rows = {tuple(r) for r in np.concatenate([p.local, p.remote], axis=1).tolist()}
    assert (0x10000 + 7 * B, 2 * B, 0, 0x7000000, 2 * B, 0) in rows
    assert (0x10000 + 2 * B, 2 * B, 0, 0x7000000 + 2 * B, 2 * B, 0) in rows
    assert (0x900000 + 1024, 512, 0, 0x8000000 + 4096, 512, 0) in rows


def test_empty_transfer_has_no_descriptors():
    p = plan([], LOCAL, [], REMOTE)
    assert p.count == 0 and p.nbytes == 0 and p.local.shape == (0, 3)


@pytest.mark.parametrize("local, remote, message", [
    (blocks("kv", [0]), [("kv", (1 << 20) - 10, B)], r"remote item 0: bytes \[1048566, 1049590\) outside region 'kv'"),
    (blocks("kv", [0]), [("nope", 0, B)], "remote item 0: unknown region 'nope'"),
    ([("kv", -1, B)], blocks("kv", [0]), "local item 0: bytes"),
    ([("kv", 0, 0)], [], "local item 0: bytes"),
    ([("kv", "0", B)], blocks("kv", [0]), r"local item 0: expected \(str, int, int\)"),
    ([("kv", 0)], blocks("kv", [0]), r"local item 0: expected \(region, offset, length\)"),
    (blocks("kv", [0, 1]), blocks("kv", [0]), "local items hold 2048 bytes but remote items 1024"),
    ([("kv", 0, 2 * B), ("kv", B, B)], blocks("kv", [0, 1, 2]), "overlap"),
    # the overlapping destination items read from different source regions
    ([("kv", 0, 2 * B), ("kv", B, 512)], blocks("kv", [0, 1]) + [("ssm", 0, 512)], "overlap in region 'kv'"),
])
def test_malformed_items_are_refused_precisely(local, remote, message):
    with pytest.raises(DescriptorError, match=message):
        plan(local, LOCAL, remote, REMOTE)


def test_random_plans_copy_exactly_the_stream():
    """Against a byte-by-byte map: local stream position i receives remote stream byte i."""
    rng = np.random.default_rng(1)
    regions = {"a": Region("a", 1 << 30, 4096, 0, "DRAM"), "b": Region("b", 2 << 30, 4096, 0, "DRAM")}

    def pieces(total, disjoint):
        out, end = [], {"a": 0, "b": 0}
        while total:
            name, n = "ab"[rng.integers(2)], int(min(total, rng.integers(1, 64)))
            start = end[name] + int(rng.integers(0, 3)) if disjoint else int(rng.integers(0, 4096 - n))
            if start + n > 4096:
                continue
            out.append((name, start, n))
            end[name], total = start + n, total - n
        return out

    def addresses(items):
        return np.concatenate([regions[n].addr + o + np.arange(k) for n, o, k in items])

    for _ in range(100):
        total = int(rng.integers(1, 400))
        local = pieces(total, disjoint=True)
        rng.shuffle(local)
        remote = pieces(total, disjoint=False)
        p = plan(local, regions, remote, regions)
        got = np.concatenate([a + np.arange(k) for a, k, _ in p.local.tolist()])
        src = np.concatenate([a + np.arange(k) for a, k, _ in p.remote.tolist()])
        assert dict(zip(got.tolist(), src.tolist())) == dict(zip(addresses(local).tolist(),
                                                                  addresses(remote).tolist()))
        assert p.count <= len(local) + len(remote)
        # as few as the layout allows: no descriptor continues another on both sides
        ends = {(a + k, b + k) for (a, k, _), (b, _, _) in zip(p.local.tolist(), p.remote.tolist())}
        assert not ends & {(a, b) for (a, _, _), (b, _, _) in zip(p.local.tolist(), p.remote.tolist())}


@pytest.mark.parametrize("region, item", [
    (4096, ("kv", 2**63 - 64, 128)),  # offset + length wraps int64 negative
    (2**31, ("kv", np.int32(2**31 - 64), np.int32(128))),  # int32 items: wraps at 2**31
])
def test_bounds_that_would_wrap_are_refused(region, item):
    """An item far past its region, whose end wraps in fixed-width integers, is refused
    by validation, by the check against what a lease pinned and by planning."""
    regions = {"kv": Region("kv", 0x10000, region, 0, "DRAM")}
    with pytest.raises(DescriptorError, match="remote item 0: bytes .* outside region 'kv'"):
        validate([item], regions, "remote")
    with pytest.raises(DescriptorError, match="outside region"):
        check_inside([item], [("kv", 7 * 64, 2 * 64)], regions)
    with pytest.raises(DescriptorError, match="outside region"):
        plan([("kv", 0, 128)], regions, [item], regions)


def test_a_stream_too_long_to_count_is_refused():
    """Remote items whose lengths add up past 2**63 would wrap their total onto the local
    one's, and the local pieces cut from it would reach far past the local items."""
    local = {"kv": Region("kv", 0x10000, 4096, 0, "DRAM")}
    remote = {"kv": Region("kv", 0x900000, 2**62 + 4096, 0, "DRAM")}
    with pytest.raises(DescriptorError, match=r"2\*\*63 bytes or more"):
        plan([("kv", 0, 128)], local, [("kv", 0, 2**62)] * 4 + [("kv", 0, 128)], remote)
