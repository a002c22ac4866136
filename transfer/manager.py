"""The pull protocol: a source pins bytes under a lease, a puller READs them and says so.

Source side (prefill)::

    ticket = mgr.pin(items, on_free=callback, meta={...})  # a Ticket; travels to the puller
    ...                                          # call mgr.poll() regularly
    # callback(lease_id, reason) runs from poll() or collect(): "done", "expired",
    # "dropped" (the puller gave up), or from unpin(lease, reason)

Puller side (decode)::

    claim = mgr.claim(ticket)                    # blocking: asks the source what it pinned
    pull_id = mgr.pull(claim, local_items, timeout=10.0)  # READs the pinned items
    # or, remote_items=[...]: ranges inside the pinned items, in the order of local_items
    # (mgr.release(claim) gives up a claim never pulled)
    for c in mgr.poll(): ...                     # Completion: ok, or error.kind
                                                 # "error" | "timeout" | "peer_gone" | "stale"
                                                 # (or collect(), see Threading below)
    mgr.landed()                                 # pulls whose bytes are in place, ack pending:
                                                 # usable, but nothing derived may escape yet

The claim is an authenticated HTTP round trip to the source's handshake endpoint
(``transfer.handshake``): the source binds the lease to the claiming agent and answers the
items it pinned and the owner's ``meta``, so a puller reads what the source pinned and
nothing a client named (``transfer.lease``). A claim not yet pulled is extended like a
pending pull, so a puller may hold one while it waits for memory. The other messages ride
on NIXL notifications (UCX active messages), and the source honours them only from the
lease's claimant:

* the READ carries ``done <lease> <tag>``, the tag naming this one pull; NIXL delivers it
  only after the data has landed. A READ's notification can be lost (seen on CPU/UCX when
  many READs start right after a peer connects), so a puller whose READ is done but
  unacknowledged repeats ``done`` by a plain notification every ``RESEND`` seconds;
* the source answers ``ack <lease> <tag> ok`` if the lease was still pinned when ``done``
  arrived, or ``ack <lease> <tag> stale`` if it had already been freed. It remembers which
  (puller, tag) freed each recent lease, so a repeated ``done`` of *that* pull is acked
  "ok" again while any other pull of a spent lease (reused params) gets "stale". A lease
  leaves the pinned set under the manager's lock, each ``progress()`` handles
  notifications before expiring leases, and the owner gets the bytes back (``on_free``)
  only afterwards, so "ok" proves the bytes stayed pinned for the whole READ. Only then
  is a pull complete: a lease that expired under a slow READ is reported as ``stale``
  instead of silently serving reused blocks (vLLM's failure mode);
* while a pull is pending the puller sends ``extend <lease>`` when it starts and every
  third of the lease's TTL; the source pushes the expiry out by one TTL, measured on
  its own clock;
* a pull that fails sends ``drop <lease>`` so the source frees at once instead of at expiry.

Failures arrive as completions within the pull's timeout (plus one poll): a NIXL error
("error", or "peer_gone" when the peer's side channel no longer answers), a deadline
("timeout"), a freed lease ("stale"), or ``peer_lost()`` called by the owner
("peer_gone"). After a failed pull the destination bytes are undefined, and a READ still
in flight may go on writing them: such a pull completes with ``settled`` False, and
``settled()`` lists it once NIXL has ended the READ (``transfer.drain`` says why).
A ticket that names an agent that is not (or no longer) the peer at its address, or an
incompatible peer, is refused by ``claim()`` with ``TransferParamsError``, and a lease the
source no longer holds (or another agent claimed) with ``ClaimError``; items outside the
claimed ones are refused by ``pull()`` with ``TransferParamsError``; nothing is posted.

Threading: ``poll()`` is two halves, so that a source answers ``done`` at once even while
its owner is busy (a worker's engine thread, inside a prefill step of hundreds of ms):

* ``progress()`` does the protocol: it loads pullers that connected, handles notifications
  (acks ``done``, extends, drops), checks READs, resends, expires leases, fails pulls past
  their deadline. It never calls the owner's code: a lease it frees is queued. It may run
  on any thread, and usually runs on a ``transfer.progress.ProgressThread``;
* ``collect()`` belongs to the owner's thread: it runs the queued ``on_free`` callbacks
  (which give memory back to an engine that only its own thread may touch) and returns the
  completions; ``landed()`` and ``settled()`` likewise.

``pin``, ``unpin``, ``pull``, ``release`` and ``peer_lost`` belong to the owner as well;
``claim`` and ``connect`` block on sockets and may run on any thread. All
state is guarded by one lock, and every NIXL call is made under it, so calls into the agent
never overlap; NIXL's STRICT mode would serialise them anyway (``transfer.agent``). The
handshake thread only queues the pullers it accepted, and ``progress()`` loads their
metadata, on a thread whose CUDA device is current (``Agent.bind_thread``): on GPU, UCX
picks its transports per thread.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import queue
import threading
import time
import uuid
from typing import Callable, Iterable, Sequence

from transfer import descriptors
from transfer.agent import Agent, PeerDisconnected
from transfer.drain import Drains
from transfer.handshake import (Address, CompatibilityError, HandshakeError, HandshakeServer, Hello,
                                claim as claim_lease, exchange, ping)
from transfer.lease import Leases
from transfer.ticket import Claim, Ticket

log = logging.getLogger(__name__)

ERROR, TIMEOUT, PEER_GONE, STALE = "error", "timeout", "peer_gone", "stale"
RESEND = 0.25  # seconds between repeats of an unacknowledged "done"
# Seconds between polls while a READ into VRAM is in flight: a whole request lands in about
# a millisecond over cuda_ipc, and a 0.5 ms poll put a ~0.6 ms floor under every READ
# (bench/RESULTS.md, "Transfer"). DRAM READs take tens of ms; they poll every 0.5 to 1 ms.
POLL_VRAM_PULL = 0.0001


class TransferParamsError(ValueError):
    """Transfer parameters that cannot be honoured; nothing was posted."""


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


class TransferManager:
    """Leases, pulls and the handshake endpoint of one agent.

    ``compat`` is this side's compatibility record (see ``transfer.handshake``); ``secret``
    the workers' shared secret, which the endpoint requires of every peer and this side
    presents to others; the endpoint serves on ``host:port`` (0: any free port) from
    construction until ``close()``;
    ``lease_ttl`` is the default lease lifetime in seconds (``transfer.faults`` wraps the
    agent to inject failures).
    ``opened`` is set whenever the owner pins or pulls, so a progress thread that idles
    between polls can wake up at once (``transfer.progress``).
    """

    def __init__(self, agent: Agent, compat: dict, *, secret: str, host: str = "127.0.0.1",
                 port: int = 0, lease_ttl: float = 30.0):
        self.agent = agent
        self._secret = secret
        self.lease_ttl = lease_ttl
        self._hello = Hello(agent.name, agent.metadata(), agent.regions, compat)
        self._incoming: queue.SimpleQueue[Hello] = queue.SimpleQueue()  # accepted by the server
        self._peers: dict[str, Hello] = {}
        self._addresses: dict[str, Address] = {}
        self._epoch = uuid.uuid4().hex[:8]
        self._pull_ids = itertools.count()
        self._leases = Leases(self._epoch)  # the source side
        self._pulls: dict[int, _Pull] = {}
        self._open: dict[tuple[str, str], _Open] = {}  # (agent, lease) -> a claim not yet pulled
        self._zombies: list = []  # handles NIXL would not release yet
        self._done: list[Completion] = []  # completed but not yet returned by collect()
        # failed pulls whose kind waits on a ping of their peer, which progress() sends
        # outside the lock (up to 0.2 s): (pull, kind, detail, notify)
        self._suspects: list[tuple[_Pull, str, str, bool]] = []
        self._landed: list[int] = []  # pulls whose READ finished, not yet returned by landed()
        self._drains = Drains(agent, self._release)  # failed pulls whose READ NIXL has not ended
        self._proven: set[str] = set()  # peers with a completed pull: connection fully set up
        self._lock = threading.Lock()  # guards all of the above and every NIXL call
        self.opened = threading.Event()
        self._server = HandshakeServer(self._hello, self._incoming.put, secret=secret,
                                       on_claim=self._grant, host=host, port=port)

    # ---- peers ---------------------------------------------------------------------------

    @property
    def address(self) -> Address:
        """Where peers reach this manager's handshake endpoint."""
        return self._server.address

    def connect(self, address: Address, timeout: float = 5.0) -> str:
        """Handshake with the manager at ``address``; returns its agent name.

        Raises CompatibilityError on a mismatched peer, HandshakeError if unreachable.
        May run on any thread (the decode worker calls it from an executor so that a slow
        handshake does not hold its event loop); the thread binds itself first, since UCX
        picks a connection's transports by the calling thread's CUDA device.
        """
        peer = exchange(tuple(address), self._hello, self._secret, timeout)  # unlocked
        self.agent.bind_thread()
        with self._lock:
            self._add_peer(peer)
            self._addresses[peer.agent] = tuple(address)
        return peer.agent

    def _add_peer(self, peer: Hello) -> None:
        if peer.agent not in self._peers:
            self.agent.add_peer(peer.metadata)
            self._peers[peer.agent] = peer

    def peer_lost(self, name: str) -> None:
        """The owner learnt that peer ``name`` is gone: fail its pulls, free the leases it
        claimed (their ``on_free`` runs from ``collect()``, reason "peer_gone") and forget
        it."""
        with self._lock:
            self._leases.free_claimed_by(name, PEER_GONE)
            for p in [p for p in self._pulls.values() if p.peer == name]:
                self._fail(p, PEER_GONE, f"peer {name} declared lost", notify=False)
            for key in [k for k in self._open if k[0] == name]:
                del self._open[key]  # pulled later, they fail at once: the peer is gone
            known = self._peers.pop(name, None)
            self._addresses.pop(name, None)
            self._proven.discard(name)
            if known is not None:
                self._drains.remove_peer(name)

    # ---- source side ---------------------------------------------------------------------

    def pin(self, items: Iterable, on_free: Callable[[str, str], None] | None = None,
            ttl: float | None = None, meta: dict | None = None,
            key: str | None = None) -> Ticket:
        """Hold ``items`` (``(region, offset, length)``, in stream order) under a new lease.

        Returns the ticket a puller claims the lease with; a claim that presents ``key``
        is answered ``items`` and ``meta`` (JSON-able: what the puller needs to map the
        items onto its own memory).
        ``on_free(lease_id, reason)`` runs exactly once, on the owner's thread, from
        ``collect()`` (or ``poll()``, or ``unpin``), when the bytes may be reused.
        """
        items = descriptors.validate(items, self.agent.regions, "pinned")
        ttl = self.lease_ttl if ttl is None else float(ttl)
        with self._lock:
            lease = self._leases.pin(ttl, on_free, [list(x) for x in items], dict(meta or {}),
                                     key)
        self.opened.set()
        return Ticket(agent=self.agent.name, address=self.address, lease=lease, ttl=ttl)

    def _grant(self, lease: str, agent: str, key: str | None) -> dict:
        """A claim from ``agent`` (the handshake server's thread): bind the lease to it and
        answer what the lease pins; ClaimError if it cannot have it."""
        with self._lock:
            held = self._leases.claim(lease, agent, time.monotonic(), key)
            return {"items": held.items, "meta": held.meta, "ttl": held.ttl}

    def unpin(self, lease: str, reason: str = "released") -> bool:
        """Free a lease now (request aborted, say); False if it was no longer held."""
        with self._lock:
            held = self._leases.pop(lease)
        if held is not None:
            held.run_on_free(lease, reason)
        return held is not None

    @property
    def leases(self) -> int:
        """Leases currently pinned (a lease freed by ``progress()`` no longer counts, though
        its ``on_free`` may still be waiting for ``collect()``)."""
        return len(self._leases)

    # ---- puller side ---------------------------------------------------------------------

    def claim(self, ticket: Ticket, key: str | None = None, timeout: float = 5.0) -> Claim:
        """Claim the lease of ``ticket``, whose key is ``key``, from its source: what it
        pinned, for ``pull``.

        Shakes hands first with a source this manager does not know (a socket round trip
        each, up to ``timeout``; any thread, but not one that must not block). Raises
        TransferParamsError for a stale or incompatible source (or one whose answer does
        not describe its own regions), ClaimError if the source refuses the claim and
        HandshakeError if it cannot be reached.
        """
        peer = self._resolve(ticket.agent, ticket.address)
        answer = claim_lease(ticket.address, self._secret, ticket.lease, self.agent.name, key,
                             timeout)
        try:
            if not (isinstance(answer, dict) and isinstance(answer.get("meta"), dict)
                    and isinstance(answer.get("items"), list)
                    and isinstance(answer.get("ttl"), (int, float)) and answer["ttl"] > 0):
                raise descriptors.DescriptorError(f"malformed claim answer {str(answer)[:200]}")
            items = tuple(descriptors.validate(answer["items"], peer.regions, "claimed"))
        except descriptors.DescriptorError as e:
            raise TransferParamsError(f"source {ticket.agent}: {e}") from None
        claim = Claim(ticket.agent, ticket.lease, float(answer["ttl"]), items, answer["meta"])
        with self._lock:
            self._open[(claim.agent, claim.lease)] = _Open(claim, time.monotonic() + claim.ttl / 3)
        self.opened.set()
        return claim

    def release(self, claim: Claim) -> None:
        """Give up a claim that will not be pulled: the source frees the lease now."""
        with self._lock:
            if self._open.pop((claim.agent, claim.lease), None) is not None and \
                    claim.agent in self._peers:
                self._send(claim.agent, f"drop {claim.lease}")

    def pull(self, claim: Claim, local_items: Sequence, timeout: float = 10.0,
             remote_items: Sequence | None = None) -> int:
        """Start READing a claimed lease's bytes into ``local_items``; returns the pull id
        that its completion (``collect()``) and ``landed()`` report.

        The bytes read are the claimed items in stream order, or ``remote_items``: byte
        ranges inside the claimed ones, in the order the puller needs (a peer whose cache
        is split differently reads parts of rows, and some of them more than once).
        Raises TransferParamsError (nothing posted) for local items outside this agent's
        regions, remote items outside the claimed ones, or a claim already pulled; a
        source lost since the claim is reported as a "peer_gone" completion instead.
        """
        started = time.monotonic()
        with self._lock:  # only the owner adds pulls: the answer holds until _start below
            if any(p.lease == claim.lease and p.peer == claim.agent for p in self._pulls.values()):
                raise TransferParamsError(f"lease {claim.lease!r} of {claim.agent} is already "
                                          f"being pulled")
            peer = self._peers.get(claim.agent)
            if peer is None:
                self._open.pop((claim.agent, claim.lease), None)
                return self._failed_at_once(claim.lease, TransferError(
                    PEER_GONE, f"source {claim.agent} was lost since the claim"))
        try:  # planning reads only this pull's arguments and immutable region tables: unlocked
            if remote_items is None:
                remote_items = claim.items
            else:
                descriptors.check_inside(remote_items, claim.items, peer.regions)
            plan = descriptors.plan(local_items, self.agent.regions, remote_items, peer.regions)
        except descriptors.DescriptorError as e:
            raise TransferParamsError(str(e)) from None
        with self._lock:
            self._open.pop((claim.agent, claim.lease), None)
            pull_id = self._start(claim.agent, claim.lease, plan, claim.ttl, started, timeout)
        self.opened.set()
        return pull_id

    def _start(self, agent: str, lease: str, plan: descriptors.Plan, ttl: float, started: float,
               timeout: float) -> int:
        now = time.monotonic()
        # the first extend goes out at once: the lease may be most of a TTL old already
        # (a router retrying a busy decode worker), and the next only a third of one later
        p = _Pull(next(self._pull_ids), agent, lease, plan, ttl, started, now + timeout,
                  now, marks={"plan": now})
        p.tag = f"{self._epoch}.{p.id}"
        self._pulls[p.id] = p
        if agent not in self._proven and self._in_flight(agent, but=p):
            # A burst of READs on a connection still being set up lost notifications and
            # READ completions on CPU/UCX (2 of 7 runs of 32 concurrent requests): the
            # first pull to a peer goes alone, the rest follow once one has completed.
            p.queued = True
        else:
            self._post(p)
        return p.id

    def _in_flight(self, peer: str, but: _Pull) -> bool:
        return any(q.peer == peer and q is not but and not q.queued for q in self._pulls.values())

    def _failed_at_once(self, lease: str, error: TransferError) -> int:
        pull_id = next(self._pull_ids)
        self._done.append(Completion(pull_id, lease, error, 0, 0, 0.0))
        return pull_id

    def _resolve(self, agent: str, address: Address) -> Hello:
        with self._lock:
            peer = self._peers.get(agent)
        if peer is not None:
            return peer
        try:
            found = self.connect(address)
        except CompatibilityError as e:
            raise TransferParamsError(str(e)) from None
        if found != agent:
            raise TransferParamsError(f"stale params: {address[0]}:{address[1]} is now agent {found!r}, "
                                      f"not {agent!r} (the source restarted)")
        with self._lock:
            return self._peers[agent]

    def _post(self, p: _Pull) -> None:
        msg = f"done {p.lease} {p.tag}".encode()
        if p.plan.count == 0:  # nothing to read (say, a full prefix hit): just tell the source
            self._send(p.peer, msg.decode())
            p.read_done = True
            self._landed.append(p.id)
            return
        peer_mem = next(iter(self._peers[p.peer].regions.values())).mem_type  # one type per agent
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
            self._landed.append(p.id)
            p.marks["read"] = time.monotonic()
            p.next_done = p.marks["read"] + RESEND
            self._maybe_complete(p)
        elif state == "ERR":
            self._fail(p, ERROR, "NIXL reported a transfer error")

    def _maybe_complete(self, p: _Pull) -> None:
        if p.ack == "stale":
            self._fail(p, STALE, f"lease {p.lease} was freed by the source before the READ ended",
                       notify=False)
        elif p.read_done and p.ack == "ok":
            self._finish(p, None)

    def _fail(self, p: _Pull, kind: str, detail: str, notify: bool = True,
              state: str | None = None) -> None:
        """An error or timeout is reported as peer_gone if the peer no longer answers: a
        forgotten peer at once, one with an address after progress() has pinged it. A
        READ still in flight goes on draining (``transfer.drain``); ``state`` is its
        state if the caller has just asked NIXL."""
        if p.handle is not None:
            if (state or self.agent.state(p.handle)) == "PROC":
                self._drains.add(p.id, p.handle, p.peer)
                p.settled = False
            else:
                self._release(p.handle)
        p.handle = None
        self._pulls.pop(p.id, None)
        if kind in (ERROR, TIMEOUT):
            if p.peer not in self._peers:
                kind, detail = PEER_GONE, f"{detail}; peer {p.peer} no longer answers"
            elif self._addresses.get(p.peer) is not None:
                self._suspects.append((p, kind, detail, notify))
                return
        self._conclude(p, kind, detail, notify)

    def _conclude(self, p: _Pull, kind: str, detail: str, notify: bool) -> None:
        if notify and kind != PEER_GONE and p.peer in self._peers:
            self._send(p.peer, f"drop {p.lease}")
        self._finish(p, TransferError(kind, detail))

    def _judge(self, suspects: list, addresses: dict) -> None:
        """Ping the peers of failed pulls without holding the lock (another thread's
        pin, pull or progress would wait up to 0.2 s a ping), then conclude them."""
        alive = {peer: address is not None and ping(address, timeout=0.2)  # None: forgotten
                 for peer, address in addresses.items()}
        with self._lock:
            for p, kind, detail, notify in suspects:
                if not alive[p.peer]:
                    kind, detail = PEER_GONE, f"{detail}; peer {p.peer} no longer answers"
                self._conclude(p, kind, detail, notify)

    def _finish(self, p: _Pull, error: TransferError | None) -> None:
        self._pulls.pop(p.id, None)
        if error is None:
            self._proven.add(p.peer)
        end = time.monotonic()
        phases, last = {}, p.started
        for name in ("plan", "post", "read"):
            if name in p.marks:
                phases[name], last = p.marks[name] - last, p.marks[name]
        if error is None:
            phases["ack"] = end - last
        self._done.append(Completion(p.id, p.lease, error, p.plan.nbytes, p.plan.count,
                                     end - p.started, phases, p.settled))

    @property
    def pending(self) -> int:
        """Pulls not yet completed."""
        return len(self._pulls) + len(self._suspects)

    def pull_poll(self, default: float) -> float:
        """Seconds between polls while a READ is in flight: ``POLL_VRAM_PULL`` into VRAM,
        else ``default``."""
        return POLL_VRAM_PULL if self.agent.mem_type == "VRAM" else default

    @property
    def busy(self) -> bool:
        """Whether a lease or a pull is open, so a message may be due any moment (or a
        failed READ is draining)."""
        return bool(self._leases or self._pulls or self._open or self._suspects or self._drains)

    # ---- progress ------------------------------------------------------------------------

    def poll(self) -> list[Completion]:
        """``progress()`` then ``collect()``: for an owner that drives the manager itself."""
        self.progress()
        return self.collect()

    def progress(self) -> bool:
        """Advance the protocol once; any thread. Returns whether ``collect()`` or
        ``landed()`` now have something for the owner."""
        with self._lock:
            self._progress()
            suspects, self._suspects = self._suspects, []
            if not suspects:  # the usual case: one lock scope a call
                return self._ready()
            addresses = {p.peer: self._addresses.get(p.peer) for p, *_ in suspects}
        self._judge(suspects, addresses)
        with self._lock:
            return self._ready()

    def _ready(self) -> bool:
        return bool(self._done or self._landed or self._leases.freed or self._drains.ready)

    def collect(self) -> list[Completion]:
        """Owner's thread: run the ``on_free`` callbacks of leases that ``progress()`` freed,
        then return the pulls completed since the last call."""
        with self._lock:
            freed = self._leases.take_freed()
            done, self._done = self._done, []
            self._drains.handed(c.pull_id for c in done if not c.settled)
        for lease, held, reason in freed:
            held.run_on_free(lease, reason)
        return done

    def _progress(self) -> None:
        while not self._incoming.empty():  # pullers that connected to us: needed for acks
            self._add_peer(self._incoming.get())
        now = time.monotonic()
        for sender, messages in self.agent.notifications().items():
            for m in messages:
                self._on_message(sender, m, now)
        for p in list(self._pulls.values()):
            state = None
            if p.handle is not None:
                state = self.agent.state(p.handle)
                self._on_state(p, state)
            if p.id not in self._pulls:
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
        for o in self._open.values():  # claims waiting to be pulled keep their leases
            if now >= o.next_extend:
                self._send(o.claim.agent, f"extend {o.claim.lease}")
                o.next_extend = now + o.claim.ttl / 3
        for p in [p for p in self._pulls.values() if p.queued]:
            if p.peer in self._proven or not self._in_flight(p.peer, but=p):
                p.queued = False
                self._post(p)
        self._leases.expire(now)
        self._zombies = [h for h in self._zombies if not self.agent.release(h)]
        self._drains.poll(now, self._peers)

    def _release(self, handle) -> None:
        """Free a transfer handle; one NIXL refuses is retried every ``progress()``."""
        if not self.agent.release(handle):
            self._zombies.append(handle)

    def settled(self) -> list[int]:
        """Failed pulls, completed with ``settled`` False and already returned by
        ``collect()``, whose READ has ended since: their destination may now be reused
        or freed."""
        with self._lock:
            return self._drains.settled()

    @property
    def draining(self) -> int:
        """Failed READs still in flight."""
        return len(self._drains)

    def landed(self) -> list[int]:
        """Pulls whose READ has finished since the last call (the bytes are in place).

        The pull is not complete until the source acks: a puller may start using the bytes
        now but must not let anything derived from them escape before ``collect()`` reports
        the pull ok, since a "stale" ack means the source reused them during the READ.
        """
        with self._lock:
            out, self._landed = self._landed, []
        return out

    def wait(self, pull_ids: Iterable[int], timeout: float) -> dict[int, Completion]:
        """Poll until all ``pull_ids`` complete or ``timeout`` passes; others stay for poll()."""
        want, got, later = set(pull_ids), {}, []
        end = time.monotonic() + timeout
        while want - got.keys() and time.monotonic() < end:
            for c in self.poll():
                if c.pull_id in want:
                    got[c.pull_id] = c
                else:
                    later.append(c)
            time.sleep(self.pull_poll(0.0005))
        with self._lock:
            self._done[:0] = later
        return got

    def _on_message(self, sender: str, message: bytes, now: float) -> None:
        parts = message.decode(errors="replace").split()
        kind, lease = (parts + ["", ""])[:2]
        if kind == "done" and len(parts) == 3:
            ok = self._leases.done(lease, sender, parts[2])
            self._send(sender, f"ack {lease} {parts[2]} {'ok' if ok else 'stale'}")
        elif kind == "extend":
            self._leases.extend(lease, sender, now)
        elif kind == "drop":
            self._leases.drop(lease, sender)
        elif kind == "ack" and len(parts) == 4:
            for p in self._pulls.values():
                if p.peer == sender and p.tag == parts[2]:  # acks of earlier pulls are ignored
                    p.ack = parts[3]
                    self._maybe_complete(p)
                    break
        elif kind not in ("extend", "ack", "done"):
            log.warning("ignoring unknown notification %r from %s", message[:100], sender)

    def _send(self, peer: str, message: str) -> None:
        try:
            self.agent.notify(peer, message.encode())
        except Exception as e:  # the peer may be gone; its pulls or leases time out on their own
            log.warning("notification %r to %s failed: %r", message, peer, e)

    def close(self) -> None:
        """Stop serving, cancel pulls (reported by no one), release the agent's registrations.
        Stop any progress thread first: the agent must not be used afterwards."""
        self._server.close()
        with self._lock:
            for p in list(self._pulls.values()):
                if p.handle is not None:
                    self.agent.release(p.handle)
            self._drains.close()
            self._pulls.clear()
            self.agent.close()
