"""The pull protocol between two managers in one process, over real NIXL (UCX, DRAM): a
puller claims what a source pinned, READs it and says so (tests/test_transfer_leases.py: the
source's side; tests/test_transfer_failures.py: what goes wrong)."""

import threading

import numpy as np
import pytest

from serving.kv_transfer import pull_items, source_record
from transfer import Agent, ProgressThread, Region
# pair, source and puller are pytest fixtures (module-scoped pair of managers)
from transfer_pair import (BLOCK, BLOCKS, SLOT, CONV, LAYOUT, pair, make_manager, pull,
                           blocks, slot, view, source, puller, drive, poll_until,
                           freed_log)


def test_pull_copies_bytes_with_few_descriptors_and_frees_the_lease(source, puller):
    log, on_free = freed_log()
    params = source.pin(blocks([5, 6, 7, 20]) + slot(2), on_free=on_free)
    pid = pull(puller, params, blocks([0, 1, 2, 9]) + slot(0))
    done = drive(source, puller, until=lambda d: pid in d and log)
    c = done[pid]
    assert c.ok, c.error
    assert c.descriptors == 3  # blocks 5-7 -> 0-2, block 20 -> 9, the slot
    assert c.nbytes == 4 * BLOCK + SLOT
    src, dst = view(source, "kv"), view(puller, "kv")
    np.testing.assert_array_equal(dst[:3 * BLOCK], src[5 * BLOCK:8 * BLOCK])
    np.testing.assert_array_equal(dst[9 * BLOCK:10 * BLOCK], src[20 * BLOCK:21 * BLOCK])
    np.testing.assert_array_equal(view(puller, "ssm")[:SLOT], view(source, "ssm")[2 * SLOT:3 * SLOT])
    assert log == [(params.lease, "done")] and source.leases == 0


def test_many_concurrent_pulls_all_complete(source, puller):
    log, on_free = freed_log()
    params = [source.pin(blocks([i]), on_free=on_free) for i in range(16)]
    ids = [pull(puller, p, blocks([63 - i])) for i, p in enumerate(params)]
    done = drive(source, puller, until=lambda d: set(ids) <= d.keys() and len(log) == 16)
    assert all(done[i].ok for i in ids)
    src, dst = view(source, "kv").reshape(BLOCKS, BLOCK), view(puller, "kv").reshape(BLOCKS, BLOCK)
    np.testing.assert_array_equal(dst[48:][::-1], src[:16])
    assert source.leases == 0


def test_empty_lease_is_acknowledged_without_a_read(source, puller):
    log, on_free = freed_log()
    pid = pull(puller, source.pin([], on_free=on_free), [])
    done = drive(source, puller, until=lambda d: pid in d and log)
    assert done[pid].ok and done[pid].descriptors == 0 and log[0][1] == "done"


def test_remote_items_inside_the_pinned_ranges_are_read_in_their_order(source, puller):
    params = source.pin(blocks([5, 6]) + blocks([7]) + slot(2))
    # across the touching items of blocks 5 to 7, a re-read, and part of the slot
    remote = [("kv", 5 * BLOCK + 100, 2 * BLOCK), ("ssm", 2 * SLOT + 8, 16), ("kv", 5 * BLOCK, 100)]
    pid = pull(puller, params, [("kv", 40 * BLOCK, 2 * BLOCK + 116)], remote_items=remote)
    assert drive(source, puller, until=lambda d: pid in d)[pid].ok
    src, ssm = view(source, "kv"), view(source, "ssm")
    want = np.concatenate([src[5 * BLOCK + 100:7 * BLOCK + 100], ssm[2 * SLOT + 8:2 * SLOT + 24],
                           src[5 * BLOCK:5 * BLOCK + 100]])
    np.testing.assert_array_equal(view(puller, "kv")[40 * BLOCK:40 * BLOCK + len(want)], want)


def test_equal_layouts_cost_what_the_pinned_items_cost():
    """The decode worker maps a request with ``kv_transfer.pull_items`` and reads explicit
    remote items; between equal (unsharded) layouts that must post as many descriptors as
    reading the pinned items themselves, and copy the same bytes."""
    source, puller = make_manager(seed=4), make_manager()
    try:
        src_blocks, n = [5, 6, 7, 20, 21], 70  # five blocks, in two runs
        pinned = source.pin(LAYOUT.items(src_blocks, 2, n))
        plain = pull(puller, pinned, LAYOUT.items([30, 31, 32, 33, 40], 0, n))
        mapped_blocks = [50, 51, 52, 53, 60]
        remote, local = pull_items(source_record(LAYOUT, src_blocks, 2, n), LAYOUT,
                                   mapped_blocks, 1, n)
        mapped = pull(puller, source.pin(LAYOUT.items(src_blocks, 2, n)), local,
                             remote_items=remote)
        done = drive(source, puller, until=lambda d: {plain, mapped} <= d.keys())
        assert done[plain].ok and done[mapped].ok
        assert done[mapped].descriptors == done[plain].descriptors == 5  # 3 KV + conv + ssm
        for name, size, a, b in (("kv", BLOCK, [30, 31, 32, 33, 40], mapped_blocks),
                                 ("conv", CONV, [0], [1]), ("ssm", SLOT, [0], [1])):
            got = view(puller, name).reshape(-1, size)
            np.testing.assert_array_equal(got[a], got[b])
        np.testing.assert_array_equal(view(puller, "kv").reshape(-1, BLOCK)[mapped_blocks],
                                      view(source, "kv").reshape(-1, BLOCK)[src_blocks])
    finally:
        puller.close()
        source.close()


def test_wait_returns_only_its_pulls_and_keeps_the_rest_for_poll(source, puller):
    first = pull(puller, source.pin(blocks([50])), blocks([50]))
    second = pull(puller, source.pin(blocks([51])), blocks([51]))
    stop = threading.Event()
    acker = threading.Thread(target=poll_until, args=(source, stop))  # the source's owner thread
    acker.start()
    try:
        got = puller.wait([second], timeout=20)
        assert got.keys() == {second} and got[second].ok
        assert drive(puller, until=lambda d: first in d)[first].ok  # not lost if it ended during wait
    finally:
        stop.set()
        acker.join()


def test_progress_thread_acks_while_the_owner_is_busy_and_on_free_waits_for_collect(source,
                                                                                     puller):
    """The source's owner does not poll during the pull (as if inside a long engine step):
    its progress thread acks the puller's "done" at once, tells the owner there is something
    to collect, and leaves the lease's on_free to the owner's collect(), on its own thread."""
    log, ready = [], threading.Event()
    params = source.pin(blocks([30]), on_free=lambda lease, why: log.append(
        (lease, why, threading.current_thread())))
    progress = ProgressThread(source, on_ready=ready.set)
    try:
        pid = pull(puller, params, blocks([30]))
        assert drive(puller, until=lambda d: pid in d)[pid].ok  # acked: nothing else polls source
        assert ready.wait(5) and source.leases == 0 and log == []
    finally:
        progress.stop()
    assert source.collect() == [] and log == [(params.lease, "done", threading.current_thread())]


@pytest.mark.parametrize("regions, message", [
    ([], "at least one region"),
    ([Region("a", 4096, 64, 0, "DRAM"), Region("a", 8192, 64, 0, "DRAM")], "duplicate region names"),
    ([Region("a", 4096, 64, 0, "DRAM"), Region("b", 8192, 64, 0, "VRAM")], "share a memory type"),
])
def test_agent_refuses_bad_region_sets(regions, message):
    with pytest.raises(ValueError, match=message):
        Agent(regions)


def test_landed_reports_bytes_in_place_but_only_the_ack_makes_a_pull_ok(source, puller):
    puller.landed()  # drain what earlier tests left
    params = source.pin(blocks([4]))
    good = pull(puller, params, blocks([4]))
    done = drive(source, puller, until=lambda d: good in d)
    assert done[good].ok and puller.landed() == [good]

    freed = source.pin(blocks([5]))
    claim = puller.claim(freed)
    source.unpin(freed.lease)
    stale = puller.pull(claim, blocks([5]))
    c = drive(source, puller, until=lambda d: stale in d)[stale]
    assert puller.landed() == [stale] and c.error.kind == "stale"  # landed, yet refused

    puller.agent.hang_next = 1
    hung = pull(puller, source.pin(blocks([6])), blocks([6]), timeout=0.5)
    c = drive(source, puller, until=lambda d: hung in d)[hung]
    assert c.error.kind == "timeout" and puller.landed() == []


def test_first_pull_to_a_fresh_peer_goes_alone_then_the_rest_follow():
    """A burst on a connection still being set up lost messages (CPU/UCX), so pulls to a
    peer that has never completed one wait for the first; all complete, bytes intact."""
    source, puller = make_manager(seed=3), make_manager()
    try:
        params = [source.pin(blocks([i])) for i in range(4)]
        ids = [pull(puller, p, blocks([10 + i])) for i, p in enumerate(params)]
        assert [puller._pulls.pulls[i].queued for i in ids] == [False, True, True, True]
        done = drive(source, puller, until=lambda d: set(ids) <= d.keys())
        assert all(done[i].ok for i in ids)
        src, dst = view(source, "kv").reshape(BLOCKS, BLOCK), view(puller, "kv").reshape(BLOCKS, BLOCK)
        np.testing.assert_array_equal(dst[10:14], src[:4])
        later = [pull(puller, source.pin(blocks([i])), blocks([20 + i])) for i in range(2)]
        drive(source, puller, until=lambda d: set(later) <= d.keys())
    finally:
        puller.close()
        source.close()
