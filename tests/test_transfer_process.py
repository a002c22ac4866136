"""The pull protocol between two real processes over NIXL (UCX, DRAM), checked byte for byte."""

import multiprocessing
import os
import queue

import jax.numpy as jnp
import numpy as np
import pytest

from transfer import Agent, TransferManager, allocate, host_view

BLOCK, BLOCKS, SLOT, SLOTS = 64 << 10, 128, 256 << 10, 4
COMPAT = {"model": "test", "block_bytes": BLOCK, "slot_bytes": SLOT}
SEED = 7
SECRET = "the processes' shared secret"


def make_manager(seed=None):
    arrays, regions = zip(allocate("kv", (BLOCKS, BLOCK), jnp.uint8),
                          allocate("ssm", (SLOTS, SLOT), jnp.uint8))
    if seed is not None:
        for r, data in zip(regions, pattern(seed)):
            host_view(r)[:] = data
    return TransferManager(Agent(list(regions)), COMPAT, secret=SECRET)


def pattern(seed):
    rng = np.random.default_rng(seed)
    return (rng.integers(0, 256, BLOCKS * BLOCK, dtype=np.uint8),
            rng.integers(0, 256, SLOTS * SLOT, dtype=np.uint8))


def source_process(commands, replies):
    """A source that pins on command and reports every freed lease."""
    manager = make_manager(SEED)
    replies.put(("ready", manager.address))
    while True:
        manager.poll()
        try:
            command = commands.get(timeout=0.001)
        except queue.Empty:
            continue
        if command[0] == "pin":
            replies.put(("params", manager.pin(
                command[1], ttl=command[2], on_free=lambda lease, why: replies.put(("freed", lease, why)))))
        elif command[0] == "die":
            os._exit(1)
        else:
            break
    manager.close()


class Source:
    def __init__(self):
        ctx = multiprocessing.get_context("spawn")
        self.commands, self.replies = ctx.Queue(), ctx.Queue()
        self.process = ctx.Process(target=source_process, args=(self.commands, self.replies), daemon=True)
        self.process.start()
        self.address = self.expect("ready")[1]

    def expect(self, kind):
        reply = self.replies.get(timeout=60)
        assert reply[0] == kind, reply
        return reply

    def pin(self, items, ttl=30.0):
        self.commands.put(("pin", items, ttl))
        return self.expect("params")[1]

    def stop(self):
        if self.process.is_alive():
            self.commands.put(("stop",))
            self.process.join(30)


def blocks(ids):
    return [("kv", i * BLOCK, BLOCK) for i in ids]


def wait(manager, ids, timeout=30.0):
    done = manager.wait(ids, timeout)
    assert done.keys() == set(ids), f"pulls {set(ids) - done.keys()} did not complete"
    return done


@pytest.fixture(scope="module")
def puller():
    manager = make_manager()
    yield manager
    manager.close()


@pytest.fixture(scope="module")
def source():
    process = Source()
    yield process
    process.stop()


def test_pulls_between_processes_copy_bytes_and_free_leases(puller, source):
    kv, ssm = pattern(SEED)
    requests = [  # (source blocks, source slot, local blocks, local slot)
        (list(range(0, 64)), 1, list(range(64, 128)), 0),  # 4 MiB of consecutive blocks
        ([70, 71, 90, 5], 3, [0, 1, 2, 3], 2),
        ([100], 0, [40], 3),
    ]
    params = [source.pin(blocks(b) + [("ssm", s * SLOT, SLOT)]) for b, s, _, _ in requests]
    ids = [puller.pull(puller.claim(p), blocks(lb) + [("ssm", ls * SLOT, SLOT)])
           for p, (_, _, lb, ls) in zip(params, requests)]
    done = wait(puller, ids)
    assert [done[i].error for i in ids] == [None] * 3
    assert [done[i].descriptors for i in ids] == [2, 4, 2]  # runs 70-71, 90, 5; the slot
    local_kv = host_view(puller.agent.regions["kv"]).reshape(BLOCKS, BLOCK)
    local_ssm = host_view(puller.agent.regions["ssm"]).reshape(SLOTS, SLOT)
    for src_blocks, src_slot, dst_blocks, dst_slot in requests:
        np.testing.assert_array_equal(local_kv[dst_blocks], kv.reshape(BLOCKS, BLOCK)[src_blocks])
        np.testing.assert_array_equal(local_ssm[dst_slot], ssm.reshape(SLOTS, SLOT)[src_slot])
    freed = {source.expect("freed")[1:] for _ in params}
    assert freed == {(p.lease, "done") for p in params}


def test_unpulled_lease_expires_in_the_source_process(source):
    params = source.pin(blocks([0]), ttl=0.2)
    assert source.expect("freed")[1:] == (params.lease, "expired")


def test_dead_source_process_is_reported_as_peer_gone(puller, source):
    """Last in this module: it kills the shared source process."""
    claim = puller.claim(source.pin(blocks([1, 2])))
    source.commands.put(("die",))
    source.process.join(30)
    pid = puller.pull(claim, blocks([1, 2]), timeout=10.0)
    assert wait(puller, [pid])[pid].error.kind == "peer_gone"
    assert puller.pending == 0
