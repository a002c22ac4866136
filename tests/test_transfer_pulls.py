"""The puller's state machine (transfer/pulls.py, ``Pulls``) alone, on a scripted stand-in
for the NIXL agent: what a pull sends its source and when, when it completes and with
what, and a failed READ held until NIXL ends it. The same rules over real transfers:
tests/test_transfer_manager.py, tests/test_transfer_failures.py."""

from __future__ import annotations

import numpy as np

from transfer.descriptors import Plan
from transfer.handshake import Hello
from transfer.memory import Region
from transfer.peers import Peers
from transfer.pulls import PEER_GONE, STALE, TIMEOUT, Pulls
from transfer.ticket import Claim


class _Agent:
    """READs whose NIXL state the test sets (``states[handle]``)."""

    def __init__(self):
        self.states, self.released, self.removed, self.posted = {}, [], [], []

    def add_peer(self, metadata):
        return "src"  # the one peer's metadata names it

    def read(self, peer, local, remote, mem_type, message):
        handle = f"h{len(self.posted)}"
        self.posted.append((peer, message.decode()))
        self.states[handle] = "PROC"
        return handle, "PROC"

    def state(self, handle):
        return self.states[handle]

    def release(self, handle):
        self.released.append(handle)
        return True

    def remove_peer(self, name):
        self.removed.append(name)


def _pulls():
    agent, sent = _Agent(), []
    peers = Peers(agent)
    peers.add(Hello("src", b"metadata of src", {"kv": Region("kv", 0, 1 << 20, 0, "DRAM")}, {}),
              ("127.0.0.1", 9))
    pulls = Pulls(agent, "e1", peers, lambda peer, m: sent.append((peer, m)))
    return pulls, agent, sent, peers


def _plan(n=2):
    rows = np.zeros((n, 3), np.uint64)
    return Plan(rows, rows, 64 * n)


def _claim(lease="s.1", ttl=30.0):
    return Claim("src", lease, ttl, (("kv", 0, 64),), {})


def test_a_held_claim_is_extended_until_pulled_and_a_released_one_is_dropped():
    pulls, _, sent, _ = _pulls()
    kept, given_up = _claim("s.1", ttl=3.0), _claim("s.2", ttl=3.0)
    pulls.hold(kept)
    pulls.hold(given_up)
    pulls.release(given_up)
    assert sent == [("src", "drop s.2")] and pulls.busy
    pulls.advance(now=1e12)  # a third of the TTL later, and more
    assert ("src", "extend s.1") in sent and ("src", "extend s.2") not in sent
    pulls.start(kept, _plan(), started=0.0, timeout=60.0)
    assert not pulls.open  # the pull extends the lease from now on


def test_a_pull_completes_once_its_read_landed_and_the_source_acked_ok():
    pulls, agent, sent, _ = _pulls()
    pid = pulls.start(_claim(), _plan(), started=0.0, timeout=60.0)
    peer, message = agent.posted[0]
    assert peer == "src" and message == f"done s.1 e1.{pid}" and pulls.pending == 1
    agent.states["h0"] = "DONE"
    pulls.advance(now=0.0)
    assert pulls.take_landed() == [pid] and not pulls.take_done()  # landed, not acked
    pulls.on_ack("src", f"e1.{pid}", "ok")
    [c] = pulls.take_done()
    assert c.ok and c.pull_id == pid and c.nbytes == 128 and c.descriptors == 2
    assert agent.released == ["h0"] and pulls.pending == 0 and not pulls.busy


def test_a_stale_ack_fails_the_pull_and_a_read_past_its_deadline_times_out():
    pulls, agent, sent, _ = _pulls()
    stale = pulls.start(_claim("s.1"), _plan(), started=0.0, timeout=60.0)
    agent.states["h0"] = "DONE"
    pulls.advance(now=0.0)
    pulls.on_ack("src", f"e1.{stale}", "stale")
    [c] = pulls.take_done()
    assert c.error.kind == STALE and ("src", "drop s.1") not in sent  # the lease is spent
    pulls.start(_claim("s.2"), _plan(), started=0.0, timeout=0.0)
    pulls.advance(now=1e12)  # past its deadline, its READ still in flight
    [suspect] = pulls.take_suspects()  # the peer is pinged before it is judged
    pulls.judge([suspect], alive={"src": True})
    [c] = pulls.take_done()
    assert c.error.kind == TIMEOUT and not c.settled and ("src", "drop s.2") in sent


def test_a_failed_read_is_settled_only_after_nixl_ends_it_and_the_owner_saw_it_fail():
    pulls, agent, _, _ = _pulls()
    pid = pulls.start(_claim(), _plan(), started=0.0, timeout=0.0)
    pulls.advance(now=1e12)
    pulls.judge(pulls.take_suspects(), alive={"src": False})
    assert pulls.draining == 1 and pulls.settled() == []
    [c] = pulls.take_done()  # the owner sees the failure first
    assert c.error.kind == PEER_GONE and not c.settled
    pulls.advance(now=1e12)
    assert pulls.settled() == []  # NIXL has not ended the READ
    agent.states["h0"] = "ERR"
    pulls.advance(now=1e12)
    assert pulls.settled() == [pid] and pulls.draining == 0 and pulls.settled() == []


def test_a_lost_peer_fails_its_pulls_and_forgets_its_claims():
    pulls, agent, sent, peers = _pulls()
    pulls.hold(_claim("s.1"))
    pid = pulls.start(_claim("s.2"), _plan(), started=0.0, timeout=60.0)
    pulls.peer_lost("src")
    [c] = pulls.take_done()
    assert c.pull_id == pid and c.error.kind == PEER_GONE and not pulls.open
    assert not any(m.startswith("drop") for _, m in sent)  # no one is left to tell
    peers.forget("src")  # the manager forgets it, then its failed READs
    pulls.forget_drains_of("src")  # its READ still runs: removed from the agent after
    assert agent.removed == []
    agent.states["h0"] = "ERR"
    pulls.advance(now=0.0)
    assert agent.removed == ["src"]
