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

import logging
import queue
import threading
import time
import uuid
from typing import Callable, Iterable, Sequence

from transfer import descriptors
from transfer.agent import Agent
from transfer.handshake import (Address, CompatibilityError, HandshakeError,
                                HandshakeServer, Hello, claim as claim_lease, exchange, ping)
from transfer.lease import Leases
from transfer.peers import Peers
from transfer.pulls import PEER_GONE, Completion, Pulls, TransferError
from transfer.ticket import Claim, Ticket

log = logging.getLogger(__name__)

# Seconds between polls while a READ into VRAM is in flight: a whole request lands in about
# a millisecond over cuda_ipc, and a 0.5 ms poll put a ~0.6 ms floor under every READ
# (bench/RESULTS.md, "Transfer"). DRAM READs take tens of ms; they poll every 0.5 to 1 ms.
POLL_VRAM_PULL = 0.0001


class TransferParamsError(ValueError):
    """Transfer parameters that cannot be honoured; nothing was posted."""


class TransferManager:
    """Leases, pulls and the handshake endpoint of one agent.

    ``compat`` is this side's compatibility record (see ``transfer.handshake``); ``secret``
    the workers' shared secret, which the endpoint requires of every peer and this side
    presents to others; the endpoint serves on ``host:port`` (0: any free port) from
    construction until ``close()``;
    ``lease_ttl`` is the default lease lifetime in seconds. ``agent`` is anything with
    `transfer.Agent`'s methods (the tests wrap one to inject failures).
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
        self._peers = Peers(agent)
        epoch = uuid.uuid4().hex[:8]
        self._leases = Leases(epoch)  # the source side
        self._pulls = Pulls(agent, epoch, self._peers, self._send)  # the puller's
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
            self._peers.add(peer, address)
        return peer.agent

    def peer_lost(self, name: str) -> None:
        """The owner learnt that peer ``name`` is gone: fail its pulls, free the leases it
        claimed (their ``on_free`` runs from ``collect()``, reason "peer_gone") and forget
        it."""
        with self._lock:
            self._leases.free_claimed_by(name, PEER_GONE)
            self._pulls.peer_lost(name)
            if self._peers.forget(name):
                self._pulls.forget_drains_of(name)

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

    def abandon(self, lease: str) -> bool:
        """No puller will claim ``lease``: free it unless one has (its claimant ends it);
        its ``on_free`` runs from ``collect()``, reason "abandoned". Whether it ended."""
        with self._lock:
            return self._leases.abandon(lease)

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
            claim = Claim.from_answer(ticket, answer, peer.regions)
        except descriptors.DescriptorError as e:
            raise TransferParamsError(f"source {ticket.agent}: {e}") from None
        with self._lock:
            self._pulls.hold(claim)
        self.opened.set()
        return claim

    def release(self, claim: Claim) -> None:
        """Give up a claim that will not be pulled: the source frees the lease now."""
        with self._lock:
            self._pulls.release(claim)

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
        with self._lock:  # only the owner adds pulls: the answer holds until start below
            if self._pulls.being_pulled(claim):
                raise TransferParamsError(f"lease {claim.lease!r} of {claim.agent} is already "
                                          f"being pulled")
            peer = self._peers.get(claim.agent)
            if peer is None:
                return self._pulls.failed_at_once(claim, TransferError(
                    PEER_GONE, f"source {claim.agent} was lost since the claim"))
        try:  # planning reads only this pull's arguments and immutable region tables: unlocked
            plan = claim.plan(local_items, self.agent.regions, peer.regions, remote_items)
        except descriptors.DescriptorError as e:
            raise TransferParamsError(str(e)) from None
        with self._lock:
            pull_id = self._pulls.start(claim, plan, started, timeout)
        self.opened.set()
        return pull_id

    def _resolve(self, agent: str, address: Address) -> Hello:
        """The hello of the source a ticket names: ``agent``, which must listen at
        ``address`` (where the claim goes), since the READ goes to ``agent``'s memory.
        TransferParamsError if it does not: a ticket passes through untrusted hands. A
        peer dialled before is known by the address it was dialled at; any other (one
        that only connected to this side) is asked at ``address`` by a handshake."""
        address = tuple(address)
        with self._lock:
            peer, known = self._peers.get(agent), self._peers.address(agent)
        if known is not None:
            if known != address:
                raise TransferParamsError(
                    f"agent {agent!r} listens at {known[0]}:{known[1]}, not at the ticket's "
                    f"{address[0]}:{address[1]}")
            return peer
        try:
            found = self.connect(address)
        except CompatibilityError as e:
            raise TransferParamsError(str(e)) from None
        if found != agent:
            raise TransferParamsError(f"stale params: {address[0]}:{address[1]} is now agent {found!r}, "
                                      f"not {agent!r} (the source restarted)")
        with self._lock:
            peer = self._peers.get(agent)
        if peer is None:  # declared lost since the handshake
            raise HandshakeError(f"source {agent} was lost during the handshake")
        return peer

    @property
    def pending(self) -> int:
        """Pulls not yet completed."""
        return self._pulls.pending

    def pull_poll(self, default: float) -> float:
        """Seconds between polls while a READ is in flight: ``POLL_VRAM_PULL`` into VRAM,
        else ``default``."""
        return POLL_VRAM_PULL if self.agent.mem_type == "VRAM" else default

    @property
    def busy(self) -> bool:
        """Whether a lease or a pull is open, so a message may be due any moment (or a
        failed READ is draining)."""
        return bool(self._leases) or self._pulls.busy

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
            suspects = self._pulls.take_suspects()
            if not suspects:  # the usual case: one lock scope a call
                return self._ready()
            addresses = {p.peer: self._peers.address(p.peer) for p, *_ in suspects}
        # failed pulls whose peer may be gone: pinged without the lock (another thread's
        # pin, pull or progress would wait up to 0.2 s a ping)
        alive = {peer: address is not None and ping(address, timeout=0.2)  # None: forgotten
                 for peer, address in addresses.items()}
        with self._lock:
            self._pulls.judge(suspects, alive)
            return self._ready()

    def _ready(self) -> bool:
        return bool(self._leases.freed) or self._pulls.ready

    def collect(self) -> list[Completion]:
        """Owner's thread: run the ``on_free`` callbacks of leases that ``progress()`` freed,
        then return the pulls completed since the last call."""
        with self._lock:
            freed = self._leases.take_freed()
            done = self._pulls.take_done()
        for lease, held, reason in freed:
            held.run_on_free(lease, reason)
        return done

    def _progress(self) -> None:
        while not self._incoming.empty():  # pullers that connected to us: needed for acks
            hello = self._incoming.get()
            try:
                self._peers.add(hello)
            except HandshakeError as e:
                self._server.forget(hello.agent)  # its claims are refused from now on
                log.warning("refused a puller's hello: %s", e)
        now = time.monotonic()
        for sender, messages in self.agent.notifications().items():
            for m in messages:
                self._on_message(sender, m, now)
        self._pulls.advance(now)
        self._leases.expire(now)

    def settled(self) -> list[int]:
        """Failed pulls, completed with ``settled`` False and already returned by
        ``collect()``, whose READ has ended since: their destination may now be reused
        or freed."""
        with self._lock:
            return self._pulls.settled()

    @property
    def draining(self) -> int:
        """Failed READs still in flight."""
        return self._pulls.draining

    def landed(self) -> list[int]:
        """Pulls whose READ has finished since the last call (the bytes are in place).

        The pull is not complete until the source acks: a puller may start using the bytes
        now but must not let anything derived from them escape before ``collect()`` reports
        the pull ok, since a "stale" ack means the source reused them during the READ.
        """
        with self._lock:
            return self._pulls.take_landed()

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
            self._pulls.put_back(later)
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
            self._pulls.on_ack(sender, parts[2], parts[3])
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
            self._pulls.close()
            self.agent.close()
