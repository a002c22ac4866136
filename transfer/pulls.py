"""The puller's side of the pull protocol (``transfer.manager`` describes the protocol):
claims not yet pulled, pulls in flight and what they hand back.

A pull goes: queued (the first pull to a peer goes alone) -> posted (a NIXL READ that
carries ``done``) -> read done (``landed()``) -> acked "ok" (complete) or "stale"; or
failed at any point: an error, its deadline, or its peer lost. A failed pull whose READ
NIXL is still running drains (``transfer.drain``) and completes with ``settled`` False.
An error or timeout with a peer that may be gone is a *suspect*: the manager pings the
peer outside its lock and ``judge`` concludes it as "peer_gone" or as it was.

Every method runs under the manager's lock (``TransferManager._lock``), which also
serialises every NIXL call; none blocks.
"""

from __future__ import annotations

import dataclasses
import itertools
import time
from typing import Callable

from transfer import descriptors
from transfer.agent import Agent, PeerDisconnected
from transfer.drain import Drains
from transfer.peers import Peers
from transfer.ticket import Claim

ERROR, TIMEOUT, PEER_GONE, STALE = "error", "timeout", "peer_gone", "stale"
RESEND = 0.25  # seconds between repeats of an unacknowledged "done"


class TransferError(RuntimeError):
    """Why a pull failed: ``kind`` is one of "error", "timeout", "peer_gone", "stale"."""

    def __init__(self, kind: str, detail: str):
        self.kind, self.detail = kind, detail
        super().__init__(f"{kind}: {detail}")


@dataclasses.dataclass(frozen=True)
class Completion:
    """The end of a pull: ``error`` is None on success; sizes describe the READ."""

    pull_id: int
    lease: str
    error: TransferError | None
    nbytes: int
    descriptors: int
    seconds: float
    # Where ``seconds`` went, for benchmarks and metrics: "plan" (the handshake if the
    # source was new, and descriptor planning),
    # "post" (NIXL initialize + post of the READ), "read" (until NIXL reported the READ
    # done, as seen by poll()), "ack" (from then until the source's ack).
    phases: dict = dataclasses.field(default_factory=dict)
    # False: a failed pull whose READ may still write into the destination; the pull
    # id appears in ``TransferManager.settled()`` once it cannot
    settled: bool = True

    @property
    def ok(self) -> bool:
        return self.error is None


@dataclasses.dataclass
class _Pull:
    id: int
    peer: str
    lease: str
    plan: descriptors.Plan
    ttl: float
    started: float
    deadline: float
    next_extend: float
    handle: object = None  # NIXL transfer handle while the READ is in flight (None: none
    # was posted, or NIXL took none: the pull then waits for its deadline)
    read_done: bool = False
    tag: str = ""  # names this pull in "done" and "ack" messages
    next_done: float = 0.0  # when to repeat "done" if the source has not acked
    ack: str | None = None
    settled: bool = True  # False while its failed READ drains
    queued: bool = False  # held back until the first pull on a fresh connection completes
    marks: dict = dataclasses.field(default_factory=dict)  # phase -> monotonic time it ended


@dataclasses.dataclass
class _Open:
    """A claim not yet pulled: extended every third of its TTL until pulled or released."""

    claim: Claim
    next_extend: float


class Pulls:
    def __init__(self, agent: Agent, epoch: str, peers: Peers,
                 send: Callable[[str, str], None]):
        """``peers`` are the manager's (``transfer.peers``); ``send(peer, message)``
        notifies a peer."""
        self.agent, self._epoch, self._send = agent, epoch, send
        self._peers = peers
        self._ids = itertools.count()
        self.pulls: dict[int, _Pull] = {}
        self.open: dict[tuple[str, str], _Open] = {}  # (agent, lease) -> a claim not yet pulled
        self._zombies: list = []  # handles NIXL would not release yet
        self.done: list[Completion] = []  # completed, not yet returned by the manager
        self.suspects: list[tuple[_Pull, str, str, bool]] = []  # (pull, kind, detail, notify)
        self.landed: list[int] = []  # pulls whose READ finished, not yet returned
        self.drains = Drains(agent, self._release)  # failed pulls whose READ NIXL has not ended
        self._proven: set[str] = set()  # peers with a completed pull: connection fully set up

    # ---- claims --------------------------------------------------------------------------

    def hold(self, claim: Claim) -> None:
        """A new claim: extended until it is pulled or released."""
        self.open[(claim.agent, claim.lease)] = _Open(claim, time.monotonic() + claim.ttl / 3)

    def release(self, claim: Claim) -> None:
        """Give up a claim never pulled: the source frees the lease now."""
        if self.open.pop((claim.agent, claim.lease), None) is not None and \
                claim.agent in self._peers:
            self._send(claim.agent, f"drop {claim.lease}")

    def being_pulled(self, claim: Claim) -> bool:
        return any(p.lease == claim.lease and p.peer == claim.agent for p in self.pulls.values())

    # ---- pulls ---------------------------------------------------------------------------

    def start(self, claim: Claim, plan: descriptors.Plan, started: float,
              timeout: float) -> int:
        self.open.pop((claim.agent, claim.lease), None)
        now = time.monotonic()
        # the first extend goes out at once: the lease may be most of a TTL old already
        # (a router retrying a busy decode worker), and the next only a third of one later
        p = _Pull(next(self._ids), claim.agent, claim.lease, plan, claim.ttl, started,
                  now + timeout, now, marks={"plan": now})
        p.tag = f"{self._epoch}.{p.id}"
        self.pulls[p.id] = p
        if claim.agent not in self._proven and self._in_flight(claim.agent, but=p):
            # A burst of READs on a connection still being set up loses notifications and
            # READ completions on CPU/UCX: the first pull to a peer goes alone, the rest
            # follow once one has completed.
            p.queued = True
        else:
            self._post(p)
        return p.id

    def failed_at_once(self, claim: Claim, error: TransferError) -> int:
        self.open.pop((claim.agent, claim.lease), None)
        pull_id = next(self._ids)
        self.done.append(Completion(pull_id, claim.lease, error, 0, 0, 0.0))
        return pull_id

    def _in_flight(self, peer: str, but: _Pull) -> bool:
        return any(q.peer == peer and q is not but and not q.queued for q in self.pulls.values())

    def _post(self, p: _Pull) -> None:
        msg = f"done {p.lease} {p.tag}".encode()
        if p.plan.count == 0:  # nothing to read (say, a full prefix hit): just tell the source
            self._send(p.peer, msg.decode())
            p.read_done = True
            self.landed.append(p.id)
            return
        peer_mem = next(iter(self._peers.get(p.peer).regions.values())).mem_type  # one a peer
        try:
            p.handle, state = self.agent.read(p.peer, p.plan.local, p.plan.remote, peer_mem, msg)
        except PeerDisconnected as e:
            self._fail(p, PEER_GONE, str(e))
            return
        except Exception as e:  # NIXL raises its own types for unknown peers, bad descriptors, ...
            self._fail(p, ERROR, f"posting READ failed: {e}")
            return
        p.marks["post"] = time.monotonic()
        self._on_state(p, state)

    def _on_state(self, p: _Pull, state: str) -> None:
        if state == "DONE":
            self.agent.release(p.handle)
            p.handle, p.read_done = None, True
            self.landed.append(p.id)
            p.marks["read"] = time.monotonic()
            p.next_done = p.marks["read"] + RESEND
            self._maybe_complete(p)
        elif state == "ERR":
            self._fail(p, ERROR, "NIXL reported a transfer error")

    def on_ack(self, sender: str, tag: str, verdict: str) -> None:
        """The source's answer to a pull's ``done``; acks of earlier pulls are ignored."""
        for p in self.pulls.values():
            if p.peer == sender and p.tag == tag:
                p.ack = verdict
                self._maybe_complete(p)
                break

    def _maybe_complete(self, p: _Pull) -> None:
        if p.ack == "stale":
            self._fail(p, STALE, f"lease {p.lease} was freed by the source before the READ ended",
                       notify=False)
        elif p.read_done and p.ack == "ok":
            self._finish(p, None)

    def _fail(self, p: _Pull, kind: str, detail: str, notify: bool = True,
              state: str | None = None) -> None:
        """An error or timeout is reported as peer_gone if the peer no longer answers: a
        forgotten peer at once, one with an address once the manager has pinged it
        (``suspects``). A READ still in flight goes on draining (``transfer.drain``);
        ``state`` is its state if the caller has just asked NIXL."""
        if p.handle is not None:
            if (state or self.agent.state(p.handle)) == "PROC":
                self.drains.add(p.id, p.handle, p.peer)
                p.settled = False
            else:
                self._release(p.handle)
        p.handle = None
        self.pulls.pop(p.id, None)
        if kind in (ERROR, TIMEOUT):
            if p.peer not in self._peers:
                kind, detail = PEER_GONE, f"{detail}; peer {p.peer} no longer answers"
            elif self._peers.address(p.peer) is not None:
                self.suspects.append((p, kind, detail, notify))
                return
        self._conclude(p, kind, detail, notify)

    def judge(self, suspects: list, alive: dict[str, bool]) -> None:
        """Conclude failed pulls whose peers were pinged (``alive``: peer -> answered)."""
        for p, kind, detail, notify in suspects:
            if not alive[p.peer]:
                kind, detail = PEER_GONE, f"{detail}; peer {p.peer} no longer answers"
            self._conclude(p, kind, detail, notify)

    def _conclude(self, p: _Pull, kind: str, detail: str, notify: bool) -> None:
        if notify and kind != PEER_GONE and p.peer in self._peers:
            self._send(p.peer, f"drop {p.lease}")
        self._finish(p, TransferError(kind, detail))

    def _finish(self, p: _Pull, error: TransferError | None) -> None:
        self.pulls.pop(p.id, None)
        if error is None:
            self._proven.add(p.peer)
        end = time.monotonic()
        phases, last = {}, p.started
        for name in ("plan", "post", "read"):
            if name in p.marks:
                phases[name], last = p.marks[name] - last, p.marks[name]
        if error is None:
            phases["ack"] = end - last
        self.done.append(Completion(p.id, p.lease, error, p.plan.nbytes, p.plan.count,
                                    end - p.started, phases, p.settled))

    def peer_lost(self, name: str) -> None:
        """Fail the pulls from ``name`` and forget its claims (pulled later, they fail at
        once: the peer is gone)."""
        for p in [p for p in self.pulls.values() if p.peer == name]:
            self._fail(p, PEER_GONE, f"peer {name} declared lost", notify=False)
        for key in [k for k in self.open if k[0] == name]:
            del self.open[key]
        self._proven.discard(name)

    def forget_drains_of(self, name: str) -> None:
        """The owner forgot peer ``name``: its failed READs no longer keep it (``drain``)."""
        self.drains.remove_peer(name)

    # ---- what the owner takes --------------------------------------------------------------

    @property
    def pending(self) -> int:
        """Pulls not yet completed (those being judged included)."""
        return len(self.pulls) + len(self.suspects)

    @property
    def busy(self) -> bool:
        """Whether a pull, a claim not yet pulled or a failed READ is open."""
        return bool(self.pulls or self.open or self.suspects or self.drains)

    @property
    def ready(self) -> bool:
        """Whether the owner has completions, landed READs or settled drains to take."""
        return bool(self.done or self.landed or self.drains.ready)

    @property
    def draining(self) -> int:
        """Failed READs still in flight."""
        return len(self.drains)

    def take_suspects(self) -> list:
        """Failed pulls whose peer must be pinged before they are judged (``judge``)."""
        out, self.suspects = self.suspects, []
        return out

    def take_done(self) -> list[Completion]:
        """The completions since the last call; the failed ones whose READ still runs are
        handed to the drains, which ``settled`` then reports."""
        out, self.done = self.done, []
        self.drains.handed(c.pull_id for c in out if not c.settled)
        return out

    def put_back(self, completions: list[Completion]) -> None:
        """Completions taken but not wanted (``TransferManager.wait``): first in line again."""
        self.done[:0] = completions

    def take_landed(self) -> list[int]:
        out, self.landed = self.landed, []
        return out

    def settled(self) -> list[int]:
        return self.drains.settled()

    # ---- progress ------------------------------------------------------------------------

    def advance(self, now: float) -> None:
        """Check READs and deadlines, extend leases of pulls and open claims, repeat
        unacknowledged ``done``s, post queued pulls, retry refused releases, drain."""
        for p in list(self.pulls.values()):
            state = None
            if p.handle is not None:
                state = self.agent.state(p.handle)
                self._on_state(p, state)
            if p.id not in self.pulls:
                continue
            if now >= p.deadline:
                stage = "the source's ack" if p.read_done else "the READ"
                self._fail(p, TIMEOUT, f"no completion within the deadline (waiting for {stage})",
                           state=state)
            elif now >= p.next_extend and not p.read_done:
                self._send(p.peer, f"extend {p.lease}")
                p.next_extend = now + p.ttl / 3
            elif p.read_done and p.ack is None and now >= p.next_done:
                self._send(p.peer, f"done {p.lease} {p.tag}")
                p.next_done = now + RESEND
        for o in self.open.values():  # claims waiting to be pulled keep their leases
            if now >= o.next_extend:
                self._send(o.claim.agent, f"extend {o.claim.lease}")
                o.next_extend = now + o.claim.ttl / 3
        for p in [p for p in self.pulls.values() if p.queued]:
            if p.peer in self._proven or not self._in_flight(p.peer, but=p):
                p.queued = False
                self._post(p)
        self._zombies = [h for h in self._zombies if not self.agent.release(h)]
        self.drains.poll(now, self._peers)

    def _release(self, handle) -> None:
        """Free a transfer handle; one NIXL refuses is retried every ``advance``."""
        if not self.agent.release(handle):
            self._zombies.append(handle)

    def close(self) -> None:
        """Cancel the pulls in flight (reported by no one)."""
        for p in list(self.pulls.values()):
            if p.handle is not None:
                self.agent.release(p.handle)
        self.drains.close()
        self.pulls.clear()
