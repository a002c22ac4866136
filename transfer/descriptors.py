"""Turn a transfer's items into as few NIXL descriptors as the layout allows.

A transfer copies a *stream* of bytes: the source items ``(region, offset, length)`` read in
order, into the destination items read in order. The two sides may cut the stream
differently (a source may pin one coalesced span where the destination uses separate
blocks); only the total must agree. ``plan`` splits the stream where either side's item
boundary falls, then merges pieces that are contiguous on *both* sides within one region
pair. Each merged piece becomes one descriptor per side: NIXL's per-descriptor cost
(preparation, posting, one UCX request each) is what dominates many-block transfers, so
the count is reported and asserted by callers. Descriptors never span two regions, since
each is registered separately.

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


def validate(items: Iterable, regions: Mapping[str, Region], side: str) -> list[Item]:
    """Items as ``(name, offset, length)`` tuples, each inside its region; else DescriptorError."""
    out = []
    for i, item in enumerate(items):
        try:
            name, offset, length = item
        except (TypeError, ValueError):
            raise DescriptorError(f"{side} item {i}: expected (region, offset, length), got {item!r}") from None
        if not isinstance(name, str) or not all(_is_int(v) for v in (offset, length)):
            raise DescriptorError(f"{side} item {i}: expected (str, int, int), got {item!r}")
        if name not in regions:
            raise DescriptorError(f"{side} item {i}: unknown region {name!r} (have {sorted(regions)})")
        size = regions[name].nbytes
        if offset < 0 or length <= 0 or offset + length > size:
            raise DescriptorError(
                f"{side} item {i}: bytes [{offset}, {offset + length}) outside region {name!r} of {size} bytes")
        out.append((name, int(offset), int(length)))
    return out


def coalesce(items: Sequence[Item]) -> list[Item]:
    """Merge items that touch within a region (sorted by region and offset); refuse overlaps."""
    out: list[list] = []
    for name, offset, length in sorted(items):
        if out and out[-1][0] == name and offset < out[-1][1] + out[-1][2]:
            raise DescriptorError(f"items overlap in region {name!r} at byte {offset}")
        if out and out[-1][0] == name and out[-1][1] + out[-1][2] == offset:
            out[-1][2] += length
        else:
            out.append([name, offset, length])
    return [tuple(x) for x in out]


def plan(local_items: Sequence[Item], local_regions: Mapping[str, Region],
         remote_items: Sequence[Item], remote_regions: Mapping[str, Region]) -> Plan:
    """Descriptors that copy the remote byte stream onto the local one (see module docstring)."""
    local = validate(local_items, local_regions, "local")
    remote = validate(remote_items, remote_regions, "remote")
    coalesce(local)  # raises if two destination items overlap: the result would be ambiguous
    total_local, total_remote = sum(x[2] for x in local), sum(x[2] for x in remote)
    if total_local != total_remote:
        raise DescriptorError(f"local items hold {total_local} bytes but remote items {total_remote}")
    pieces = sorted(_split(local, remote), key=lambda p: (p[0], p[2], p[3], p[1]))
    merged: list[list] = []
    for lname, loff, rname, roff, n in pieces:
        last = merged[-1] if merged else None
        if (last and last[0] == lname and last[2] == rname
                and last[1] + last[4] == loff and last[3] + last[4] == roff):
            last[4] += n
        else:
            merged.append([lname, loff, rname, roff, n])
    return Plan(_rows(((m[0], m[1], m[4]) for m in merged), local_regions),
                _rows(((m[2], m[3], m[4]) for m in merged), remote_regions), total_local)


def _split(local: list[Item], remote: list[Item]):
    """Walk both streams, yielding (local region, local off, remote region, remote off, length)."""
    li = ri = 0
    lpos = rpos = 0  # bytes consumed of the current item on each side
    while li < len(local):
        lname, loff, llen = local[li]
        rname, roff, rlen = remote[ri]
        n = min(llen - lpos, rlen - rpos)
        yield lname, loff + lpos, rname, roff + rpos, n
        lpos, rpos = lpos + n, rpos + n
        if lpos == llen:
            li, lpos = li + 1, 0
        if rpos == rlen:
            ri, rpos = ri + 1, 0


def _rows(spans: Iterable[Item], regions: Mapping[str, Region]) -> np.ndarray:
    rows = [(regions[name].addr + off, n, regions[name].device_id) for name, off, n in spans]
    return np.array(rows, dtype=np.uint64).reshape(-1, 3)


def _is_int(v) -> bool:
    return isinstance(v, (int, np.integer)) and not isinstance(v, bool)
