"""The source side of a pull: bytes pinned under leases until the puller is done with them.

A lease holds a request's bytes for a puller. It ends when the puller says ``done`` (its
READ has landed), when the puller ``drop``s it (its pull failed), when its TTL passes
without an ``extend`` from the puller, or when the owner unpins it. Ending a lease
queues it; the owner gets the bytes back (``on_free``) from ``TransferManager.collect()``
on its own thread, never while the manager's lock is held.

A ``done`` is answered "ok" only if the lease was still held when it arrived, or if the
same pull (puller and tag) had already ended it and is repeating itself: so "ok" proves
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


@dataclasses.dataclass
class Lease:
    ttl: float
    expires: float
    on_free: Callable[[str, str], None] | None

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

    def pin(self, ttl: float, on_free: Callable[[str, str], None] | None) -> str:
        lease = f"{self._epoch}.{next(self._ids)}"
        self._held[lease] = Lease(ttl, time.monotonic() + ttl, on_free)
        return lease

    def pop(self, lease: str) -> Lease | None:
        """End ``lease`` without queueing it: the caller runs its ``on_free``."""
        return self._held.pop(lease, None)

    def free(self, lease: str, reason: str) -> None:
        """End ``lease`` if held; its ``on_free`` waits in ``freed`` for the owner."""
        held = self._held.pop(lease, None)
        if held is not None:
            self.freed.append((lease, held, reason))

    def done(self, lease: str, puller: str, tag: str) -> bool:
        """The puller's READ (pull ``tag``) landed: end the lease. Whether the bytes were
        pinned for the whole READ ("ok") or not ("stale")."""
        if lease in self._held:
            self.free(lease, "done")
            self._ended[lease] = (puller, tag)
            if len(self._ended) > REMEMBERED:
                self._ended.popitem(last=False)
            return True
        return self._ended.get(lease) == (puller, tag)

    def extend(self, lease: str, now: float) -> None:
        """The puller is still at it: push the expiry out by one TTL, on this clock."""
        held = self._held.get(lease)
        if held is not None:
            held.expires = max(held.expires, now + held.ttl)

    def take_freed(self) -> list[tuple[str, Lease, str]]:
        """The leases ended since the last call, for the owner to run their ``on_free``."""
        out, self.freed = self.freed, []
        return out

    def expire(self, now: float) -> None:
        for lease in [k for k, v in self._held.items() if v.expires <= now]:
            self.free(lease, "expired")
