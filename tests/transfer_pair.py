"""Two transfer managers in one process over real NIXL (UCX, DRAM), and the helpers the
transfer tests share: a source whose regions hold random bytes, a puller, and ways to
drive them. The fixtures are imported by the test modules that use them."""

import time

import jax.numpy as jnp
import numpy as np
import pytest

from serving.kv_transfer import CacheLayout
from faulty_agent import FaultyAgent
from transfer import Agent, TransferManager, allocate, host_view

BLOCK, BLOCKS, SLOT, SLOTS, CONV = 4096, 64, 2048, 4, 512
# the regions above as a cache's blocks and slots (rows only matter between unequal splits)
LAYOUT = CacheLayout(BLOCK, CONV, SLOT, block_size=16, kv_rows=8, ssm_rows=4)
COMPAT = {"model": "test", "block_bytes": BLOCK, "slot_bytes": SLOT}
SECRET = "a secret of the test managers"


def make_manager(compat=COMPAT, port=0, seed=None, secret=SECRET):
    _, kv = allocate("kv", (BLOCKS, BLOCK), jnp.uint8)
    _, conv = allocate("conv", (SLOTS, CONV), jnp.uint8)
    _, ssm = allocate("ssm", (SLOTS, SLOT), jnp.uint8)
    if seed is not None:
        rng = np.random.default_rng(seed)
        for r in (kv, conv, ssm):
            host_view(r)[:] = rng.integers(0, 256, r.nbytes, dtype=np.uint8)
    # the agent counts faults to inject (faulty_agent.py): the tests set them
    return TransferManager(FaultyAgent(Agent([kv, conv, ssm])), compat, port=port,
                           secret=secret)


def pull(puller, ticket, *args, **kw):
    """Claim ``ticket``'s lease (again, for a pull of the same puller), then pull it."""
    return puller.pull(puller.claim(ticket), *args, **kw)


def blocks(ids):
    return [("kv", i * BLOCK, BLOCK) for i in ids]


def slot(i):
    return [("ssm", i * SLOT, SLOT)]


def view(manager, name):
    return host_view(manager.agent.regions[name])


@pytest.fixture(scope="module")
def pair():
    source, puller = make_manager(seed=1), make_manager()
    yield source, puller
    puller.close()
    source.close()


@pytest.fixture
def source(pair):
    yield pair[0]
    for lease in list(pair[0]._leases):
        pair[0].unpin(lease)


@pytest.fixture
def puller(pair):
    yield pair[1]
    drive(pair[1], until=lambda done: pair[1].pending == 0)


def drive(*managers, until, timeout=20.0):
    """Poll every manager until ``until(completions)``; completions by pull id."""
    done = {}
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        for m in managers:
            done.update((c.pull_id, c) for c in m.poll())
        if until(done):
            return done
        time.sleep(0.001)
    raise AssertionError(f"condition not reached in {timeout} s; completions so far: {done}")


def poll_until(manager, stop):
    while not stop.is_set():
        manager.poll()
        time.sleep(0.001)


def freed_log():
    log = []
    return log, lambda lease, reason: log.append((lease, reason))
