"""The source side of a pull: bytes pinned under leases until the puller is done with them.

A lease holds a request's bytes (its ``items``) for one puller. The owner describes them
too (``meta``: for a worker, its cache layout and the request's blocks and slot), and
the source hands both to the first authenticated agent that *claims* the lease over the
handshake channel with the lease's ``key`` (for a worker, a digest of the tokens whose
state the bytes hold, so only a claimant continuing that request gets them; a claim with
another key is refused and leaves the lease as it was); the puller derives what it reads
from that answer alone, never from what a client sent it. From the claim on, the lease answers only its claimant: a
``done``, ``extend`` or ``drop`` from any other agent is refused. A READ is one-sided
(NIXL reads the source's memory without the source's code running), so the source
cannot inspect one; what keeps a READ inside its lease is that only agents holding the
workers' shared secret ever learn the source's metadata (``transfer.handshake``), and
that their manager checks every descriptor against the claimed items before posting
(``TransferManager.pull``).

A lease ends when its claimant says ``done`` (its READ has landed), when the claimant
``drop``s it (its pull failed or was given up), when its TTL passes without an
``extend``, when the owner unpins it, or, unclaimed, when the owner learns that no
puller will claim it (``abandon``). Ending a lease queues it; the owner gets the
bytes back (``on_free``) from ``TransferManager.collect()`` on its own thread, never
while the manager's lock is held.

A ``done`` is answered "ok" only if the lease was still held when it arrived, or if the
same pull (claimant and tag) had already ended it and is repeating itself: so "ok" proves
that the bytes stayed pinned for the whole READ, and any other pull of a spent lease
(reused parameters) is told "stale" (``transfer.manager`` describes the protocol).
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import logging
import re
import time
from typing import Callable, Iterator

log = logging.getLogger(__name__)

ID = re.compile(r"[0-9a-f]+\.[0-9]+")  # the names ``Leases.pin`` gives: <epoch>.<n>
REMEMBERED = 65536  # ended leases remembered, to re-ack a repeated "done" of the same pull


class ClaimError(RuntimeError):
    """A claim the source cannot grant: ``kind`` is "stale" (the lease is not held: never
    made, expired or already ended), "claimed" (another agent holds the claim) or
    "mismatch" (the claim's key is not the lease's)."""

    def __init__(self, kind: str, detail: str):
        self.kind, self.detail = kind, detail
        super().__init__(f"{kind}: {detail}")


@dataclasses.dataclass
class Lease:
    ttl: float
    expires: float
    on_free: Callable[[str, str], None] | None
    items: list  # (region, offset, length): the bytes pinned
    meta: dict  # the owner's description of them, for the claimant
    key: str | None  # what a claim must present
    claimant: str | None = None

    def run_on_free(self, lease: str, reason: str) -> None:
        """Give the bytes back to the owner; its bug must not stall the other leases."""
        if self.on_free is not None:
            try:
                self.on_free(lease, reason)
            except Exception:
                log.exception("on_free callback for lease %s failed", lease)


class Leases:
    """The leases one manager holds, named ``<epoch>.<n>`` (the epoch tells a restarted
    source's leases from its predecessor's). Not thread-safe: the manager calls it under
    its lock."""

    def __init__(self, epoch: str):
        self._epoch = epoch
        self._ids = itertools.count()
        self._held: dict[str, Lease] = {}
        self._ended: collections.OrderedDict[str, tuple[str, str]] = collections.OrderedDict()
        self.freed: list[tuple[str, Lease, str]] = []  # ended, on_free not yet run: (lease, held, reason)

    def __len__(self) -> int:
        return len(self._held)

    def __iter__(self) -> Iterator[str]:
        return iter(list(self._held))

    def pin(self, ttl: float, on_free: Callable[[str, str], None] | None, items: list,
            meta: dict, key: str | None = None) -> str:
        lease = f"{self._epoch}.{next(self._ids)}"
        self._held[lease] = Lease(ttl, time.monotonic() + ttl, on_free, items, meta, key)
        return lease

    def claim(self, lease: str, agent: str, now: float, key: str | None = None) -> Lease:
        """Bind ``lease`` to ``agent`` (again, for the same agent) and push its expiry out
        by one TTL; ClaimError if it is not held, its key is not ``key`` or another agent
        claimed it."""
        held = self._held.get(lease)
        if held is None:
            raise ClaimError("stale", f"lease {lease} is not held (expired, ended or unknown)")
        if held.key != key:
            raise ClaimError("mismatch", f"lease {lease} holds the state of another request")
        if held.claimant not in (None, agent):
            raise ClaimError("claimed", f"lease {lease} is claimed by another agent")
        held.claimant = agent
        held.expires = max(held.expires, now + held.ttl)
        return held

    def _claimed_by(self, lease: str, agent: str, what: str) -> Lease | None:
        """The held lease if ``agent`` claimed it; a message from anyone else is refused."""
        held = self._held.get(lease)
        if held is not None and held.claimant != agent:
            log.warning("refused %r of lease %s from %s, which has not claimed it", what, lease,
                        agent)
            return None
        return held

    def pop(self, lease: str) -> Lease | None:
        """End ``lease`` without queueing it: the caller runs its ``on_free``."""
        return self._held.pop(lease, None)

    def free(self, lease: str, reason: str) -> None:
        """End ``lease`` if held; its ``on_free`` waits in ``freed`` for the owner."""
        held = self._held.pop(lease, None)
        if held is not None:
            self.freed.append((lease, held, reason))

    def done(self, lease: str, puller: str, tag: str) -> bool:
        """The claimant's READ (pull ``tag``) landed: end the lease. Whether the bytes were
        pinned for the whole READ ("ok") or not ("stale"); a puller that has not claimed
        the lease is answered "stale" and changes nothing."""
        if lease in self._held:
            if self._claimed_by(lease, puller, "done") is None:
                return False
            self.free(lease, "done")
            self._ended[lease] = (puller, tag)
            if len(self._ended) > REMEMBERED:
                self._ended.popitem(last=False)
            return True
        return self._ended.get(lease) == (puller, tag)

    def extend(self, lease: str, puller: str, now: float) -> None:
        """The claimant is still at it: push the expiry out by one TTL, on this clock."""
        held = self._claimed_by(lease, puller, "extend")
        if held is not None:
            held.expires = max(held.expires, now + held.ttl)

    def drop(self, lease: str, puller: str) -> None:
        """The claimant gave up: end the lease now rather than at its expiry."""
        if self._claimed_by(lease, puller, "drop") is not None:
            self.free(lease, "dropped")

    def abandon(self, lease: str) -> bool:
        """No puller will claim ``lease`` (the owner learnt so): end it now unless an agent
        claimed it, whose ``done`` or ``drop`` ends it instead. Whether it ended."""
        held = self._held.get(lease)
        if held is None or held.claimant is not None:
            return False
        self.free(lease, "abandoned")
        return True

    def free_claimed_by(self, agent: str, reason: str) -> None:
        """End every lease ``agent`` claimed (the owner learnt that it is gone)."""
        for lease in [k for k, v in self._held.items() if v.claimant == agent]:
            self.free(lease, reason)

    def take_freed(self) -> list[tuple[str, Lease, str]]:
        """The leases ended since the last call, for the owner to run their ``on_free``."""
        out, self.freed = self.freed, []
        return out

    def expire(self, now: float) -> None:
        for lease in [k for k, v in self._held.items() if v.expires <= now]:
            self.free(lease, "expired")
