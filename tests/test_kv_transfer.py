"""Where a request's cache lies in the registered regions (`serving.kv_transfer`): what a
lease pins, and the stream order both sides list their items in (the prompt's blocks in
sequence order, then conv state, then recurrent state), so that each destination item
receives its own source item."""

import dataclasses

import pytest

from serving.kv_transfer import (MAX_PARTS, CacheLayout, pull_items, source_record,
                                 stream_items)
from transfer import TransferParamsError

LAYOUT = CacheLayout(block_bytes=100, conv_slot_bytes=30, ssm_slot_bytes=70, block_size=4)


def test_a_lease_pins_runs_of_blocks_then_the_state_of_the_slot():
    assert LAYOUT.items([5, 6, 7, 9, 2], slot=2, num_tokens=17) == [
        ("kv", 500, 300), ("kv", 900, 100), ("kv", 200, 100), ("conv", 60, 30),
        ("ssm", 140, 70)]
    assert LAYOUT.items([5, 6, 7, 9, 2], slot=2, num_tokens=8) == [
        ("kv", 500, 200), ("conv", 60, 30), ("ssm", 140, 70)]  # only the blocks in use
    with pytest.raises(ValueError, match="need 3 blocks"):
        LAYOUT.items([5, 6], slot=0, num_tokens=9)


def _stream(items, unit=10):
    """The items' bytes in stream order, as (region, offset) of each `unit` bytes: what
    the descriptor planner pairs up (runs of blocks merge into one item on each side)."""
    return [(region, offset + i) for region, offset, length in items
            for i in range(0, length, unit)]


def _pairs(*spans, unit=10):
    """(source, destination) byte pairs of (region, source offset, destination offset,
    length) spans."""
    return [((region, s + i), (region, d + i)) for region, s, d, length in spans
            for i in range(0, length, unit)]


def test_each_destination_byte_is_its_source_byte_in_stream_order():
    src, dst = stream_items(LAYOUT, [5, 6, 7, 9], 2, LAYOUT, [1, 2, 3, 4], 0, num_tokens=14)
    assert list(zip(_stream(src), _stream(dst), strict=True)) == _pairs(
        ("kv", 500, 100, 100), ("kv", 600, 200, 100), ("kv", 700, 300, 100),
        ("kv", 900, 400, 100), ("conv", 60, 0, 30), ("ssm", 140, 0, 70))
    # blocks the destination holds already (its prefix cache) are skipped, the state is not
    src, dst = stream_items(LAYOUT, [5, 6, 7, 9], 2, LAYOUT, [1, 2, 3, 4], 0, num_tokens=14,
                            skip_blocks=2)
    assert list(zip(_stream(src), _stream(dst), strict=True)) == _pairs(
        ("kv", 700, 300, 100), ("kv", 900, 400, 100), ("conv", 60, 0, 30),
        ("ssm", 140, 0, 70))
    # a block-aligned prompt whose every block the destination holds: the state alone
    src, dst = stream_items(LAYOUT, [5, 6], 2, LAYOUT, [1, 2], 0, num_tokens=8, skip_blocks=2)
    assert list(zip(_stream(src), _stream(dst), strict=True)) == _pairs(
        ("conv", 60, 0, 30), ("ssm", 140, 0, 70))


def test_the_decode_side_reads_what_the_source_recorded():
    record = source_record(LAYOUT, [5, 6, 7], 2, 10)
    src, dst = pull_items(record, LAYOUT, [8, 9, 10], 1, 10)
    assert list(zip(_stream(src), _stream(dst), strict=True)) == _pairs(
        ("kv", 500, 800, 300), ("conv", 60, 30, 30), ("ssm", 140, 70, 70))


def _deep(levels):
    value = ["kv"]
    for _ in range(levels):
        value = [value]
    return value


@pytest.mark.parametrize("change", [
    {"blocks": [2**63, 6, 7]},  # no int64 holds it
    {"blocks": [2**57 - 1, 6, 7]},  # its byte offset, id x 100, wraps int64
    {"blocks": [2**31, 6, 7]},  # past the engine's int32 ids
    {"slot": 2**31},
    {"layout": {**LAYOUT.to_json(), "kv_parts": _deep(5000)}},  # too deep to print
])
def test_a_record_out_of_bounds_is_refused_as_transfer_params(change):
    """A peer's record is refused with TransferParamsError, the one exception the decode
    worker expects from it (any other would end its engine thread), before any byte
    offset is computed from it."""
    record = {**source_record(LAYOUT, [5, 6, 7], 2, 10), **change}
    with pytest.raises(TransferParamsError, match="source cache record"):
        pull_items(record, LAYOUT, [8, 9, 10], 1, 10)


def test_a_head_split_finer_than_max_parts_is_refused():
    """Each part of a source's split costs ``_chunks`` blocks x rows items on the engine
    thread: a split of more than MAX_PARTS is refused, one of MAX_PARTS is read."""
    mine = CacheLayout(block_bytes=MAX_PARTS * 2 * 16, conv_slot_bytes=30, ssm_slot_bytes=70,
                       block_size=4, kv_rows=16)

    def record(parts):
        theirs = dataclasses.replace(mine, block_bytes=mine.block_bytes // parts,
                                     kv_parts=tuple((f"kv@{i}",) for i in range(parts)))
        return source_record(theirs, [5, 6, 7], 2, 10)

    src, dst = pull_items(record(MAX_PARTS), mine, [8, 9, 10], 1, 10)
    # each source part a run of blocks; locally a chunk of every row of every block
    assert len(src) == MAX_PARTS + 2 and len(dst) == MAX_PARTS * 3 * 16 + 2
    with pytest.raises(TransferParamsError, match=f"expected 1 to {MAX_PARTS} parts"):
        pull_items(record(2 * MAX_PARTS), mine, [8, 9, 10], 1, 10)
