"""Turn a transfer's items into as few NIXL descriptors as the layout allows.

A transfer copies a *stream* of bytes: the source items ``(region, offset, length)`` read in
order, into the destination items read in order. The two sides may cut the stream
differently (a source may pin one coalesced span where the destination uses separate
blocks); only the total must agree. ``plan`` splits the stream where either side's item
boundary falls, then merges pieces that are contiguous on *both* sides within one region
pair. Each merged piece becomes one descriptor per side: NIXL's per-descriptor cost
(preparation, posting, one UCX request each; 10 to 14 µs a descriptor on H200) is what
dominates many-block transfers, so the count is reported and asserted by callers.
Descriptors never span two regions, since each is registered separately.

A request names thousands of blocks, and planning runs on the engine's thread for every
transfer, so the work is done on NumPy columns rather than per item in Python (a
per-item version took several milliseconds for a 32k-token request).

Everything is validated before anything is posted, so malformed items raise
``DescriptorError`` and disturb nothing.
"""

from __future__ import annotations

import dataclasses
from typing import Iterable, Mapping, Sequence

import numpy as np

from transfer.memory import Region

Item = tuple[str, int, int]  # (region name, byte offset, byte length)


class DescriptorError(ValueError):
    """Items that do not describe valid bytes of the given regions."""


@dataclasses.dataclass(frozen=True)
class Plan:
    """Matching descriptor lists for both sides (Nx3 uint64 rows: address, length, device id)."""

    local: np.ndarray
    remote: np.ndarray
    nbytes: int

    @property
    def count(self) -> int:
        """Descriptors per side."""
        return len(self.local)


@dataclasses.dataclass(frozen=True)
class _Columns:
    """Validated items as arrays: region index (into ``names``), offset, length. Each item
    lies inside its region, whose size is below 2**63, so ``offset + length`` never wraps."""

    names: list[str]
    region: np.ndarray
    offset: np.ndarray
    length: np.ndarray


def validate(items: Iterable, regions: Mapping[str, Region], side: str) -> list[Item]:
    """Items as ``(name, offset, length)`` tuples, each inside its region; else DescriptorError."""
    c = _columns(list(items), regions, side)
    return [(c.names[r], o, n) for r, o, n in zip(c.region.tolist(), c.offset.tolist(), c.length.tolist())]


def _columns(items: list, regions: Mapping[str, Region], side: str) -> _Columns:
    names = list(regions)
    if not items:
        empty = np.zeros(0, np.int64)
        return _Columns(names, empty, empty, empty)
    index = {name: i for i, name in enumerate(names)}
    try:
        if not all(len(x) == 3 for x in items):
            _explain(items, regions, side)
        keys, offsets, lengths = zip(*items)
        region = np.array([index.get(k, -1) for k in keys], np.int64)
        offset, length = np.array(offsets), np.array(lengths)
    except (TypeError, ValueError):
        _explain(items, regions, side)
    # ndim: an offset or length given as a list would otherwise be flattened in
    if offset.dtype.kind != "i" or length.dtype.kind != "i" or offset.ndim != 1 or length.ndim != 1:
        _explain(items, regions, side)
    offset, length = offset.astype(np.int64), length.astype(np.int64)
    sizes = np.array([regions[n].nbytes for n in names], np.int64)
    # one test for every bound (each NumPy call costs microseconds, and planning is on the
    # path of every pull); the slow path names the first bad item. ``offset + length``
    # of a bad item could wrap; ``sizes - length`` cannot where the test decides (sizes
    # are in [0, 2**63), lengths positive)
    if ((region < 0) | (offset < 0) | (length <= 0) | (offset > sizes[region] - length)).any():
        _explain(items, regions, side)
    return _Columns(names, region, offset, length)


def _explain(items: list, regions: Mapping[str, Region], side: str):
    """Raise DescriptorError for the first bad item (the slow path, for a precise message)."""
    for i, item in enumerate(items):
        try:
            name, offset, length = item
        except (TypeError, ValueError):
            raise DescriptorError(f"{side} item {i}: expected (region, offset, length), got {item!r}") from None
        if not isinstance(name, str) or not all(_is_int(v) for v in (offset, length)):
            raise DescriptorError(f"{side} item {i}: expected (str, int, int), got {item!r}")
        if name not in regions:
            raise DescriptorError(f"{side} item {i}: unknown region {name!r} (have {sorted(regions)})")
        offset, length, size = int(offset), int(length), regions[name].nbytes  # exact, unlike NumPy's
        if offset < 0 or length <= 0 or offset + length > size:
            raise DescriptorError(
                f"{side} item {i}: bytes [{offset}, {offset + length}) outside region {name!r} of {size} bytes")
    raise DescriptorError(f"{side} items: malformed")  # e.g. a mix NumPy cannot hold in one array


def coalesce(items: Sequence[Item]) -> list[Item]:
    """Merge items that touch within a region (sorted by region and offset); refuse overlaps."""
    names = sorted({name for name, _, _ in items})
    c = _columns(list(items), {n: Region(n, 0, 1 << 62, 0, "DRAM") for n in names}, "item")
    region, offset, length = _merge_runs([c.region], [c.offset], c.length, [c.names])
    return [(names[r], o, n) for r, o, n in zip(region[0].tolist(), offset[0].tolist(), length.tolist())]


def check_inside(items: Sequence[Item], bounds: Sequence[Item],
                 regions: Mapping[str, Region]) -> None:
    """Raise DescriptorError for the first of ``items`` whose bytes are not inside one of
    ``bounds``' ranges (bounds that touch in a region count as one range; overlapping ones
    do not merge, which can only refuse more): a puller reading sub-ranges of what a
    lease pinned must not reach past it."""
    c = _columns(list(items), regions, "remote")
    b = _columns(list(bounds), regions, "pinned")
    (breg,), (boff,), blen = _merge_runs([b.region], [b.offset], b.length, [b.names],
                                         overlap_ok=True)
    inside = np.zeros(len(c.length), bool)
    for r in np.unique(c.region):
        mine, theirs = c.region == r, breg == r
        if not theirs.any():
            continue
        starts, ends = boff[theirs], boff[theirs] + blen[theirs]
        j = np.searchsorted(starts, c.offset[mine], "right") - 1
        end = c.offset[mine] + c.length[mine]
        inside[mine] = (j >= 0) & (end <= ends[np.maximum(j, 0)])
    bad = np.flatnonzero(~inside)
    if len(bad):
        i = int(bad[0])
        raise DescriptorError(f"remote item {i}: bytes [{c.offset[i]}, {c.offset[i] + c.length[i]}) "
                              f"of region {c.names[c.region[i]]!r} are not pinned")


def plan(local_items: Sequence[Item], local_regions: Mapping[str, Region],
         remote_items: Sequence[Item], remote_regions: Mapping[str, Region]) -> Plan:
    """Descriptors that copy the remote byte stream onto the local one (see module docstring)."""
    local = _columns(list(local_items), local_regions, "local")
    remote = _columns(list(remote_items), remote_regions, "remote")
    lend, rend = np.cumsum(local.length), np.cumsum(remote.length)
    # lengths are positive, so a stream of 2**63 bytes or more wraps an end negative
    if (lend < 0).any() or (rend < 0).any():
        raise DescriptorError("items hold 2**63 bytes or more")
    total_local, total_remote = int(lend[-1:].sum()), int(rend[-1:].sum())
    if total_local != total_remote:
        raise DescriptorError(f"local items hold {total_local} bytes but remote items {total_remote}")
    # split the stream at every item boundary of either side
    lstart, rstart = lend - local.length, rend - remote.length
    cuts = np.union1d(lstart, rstart)
    sizes = np.concatenate((cuts[1:], [total_local])) - cuts
    li = np.searchsorted(lstart, cuts, "right") - 1
    ri = np.searchsorted(rstart, cuts, "right") - 1
    lreg, loff = local.region[li], local.offset[li] + cuts - lstart[li]
    rreg, roff = remote.region[ri], remote.offset[ri] + cuts - rstart[ri]
    # destination pieces that overlap would make the result ambiguous (they overlap iff
    # the destination items do: the pieces cut them up)
    (lreg, rreg), (loff, roff), sizes = _merge_runs(
        [lreg, rreg], [loff, roff], sizes, [local.names, remote.names])
    return Plan(_rows(lreg, loff, sizes, local.names, local_regions),
                _rows(rreg, roff, sizes, remote.names, remote_regions), total_local)


def _merge_runs(regions: list[np.ndarray], offsets: list[np.ndarray], length: np.ndarray,
                names: list[list[str]], overlap_ok: bool = False):
    """Sort pieces by the first side's region, then offset; merge neighbours that are
    contiguous on every side within the same regions. (Pieces that merge are contiguous on
    the first side, so they are neighbours in its order unless they overlap there.)

    Raises DescriptorError if pieces overlap on the first side (unless ``overlap_ok``).
    """
    if len(length) == 0:
        return regions, offsets, length
    order = np.lexsort((offsets[0], regions[0]))
    regions = [r[order] for r in regions]
    offsets = [o[order] for o in offsets]
    length = length[order]
    ends = offsets[0][:-1] + length[:-1]
    same = regions[0][1:] == regions[0][:-1]
    if not overlap_ok:
        bad = np.flatnonzero(same & (offsets[0][1:] < ends))
        if len(bad):
            j = bad[0] + 1
            raise DescriptorError(
                f"items overlap in region {names[0][regions[0][j]]!r} at byte {offsets[0][j]}")
    joins = same & (offsets[0][1:] == ends)
    for r, o in zip(regions[1:], offsets[1:]):
        joins &= (r[1:] == r[:-1]) & (o[1:] == o[:-1] + length[:-1])
    starts = np.flatnonzero(np.concatenate(([True], ~joins)))
    return ([r[starts] for r in regions], [o[starts] for o in offsets],
            np.add.reduceat(length, starts))


def _rows(region: np.ndarray, offset: np.ndarray, length: np.ndarray, names: list[str],
          regions: Mapping[str, Region]) -> np.ndarray:
    rows = np.empty((len(length), 3), np.uint64)
    rows[:, 0] = np.array([regions[n].addr for n in names], np.uint64)[region] + offset.astype(np.uint64)
    rows[:, 1] = length
    rows[:, 2] = np.array([regions[n].device_id for n in names], np.uint64)[region]
    return rows


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)
