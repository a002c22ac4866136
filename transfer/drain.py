"""Failed pulls whose READ still runs: their destination stays held until NIXL ends it.

After a failed pull (an error, a timeout, a stale ack, a lost peer) the destination bytes
are undefined, and they may not be over yet: NIXL 1.5.1's UCX backend does not stop a READ
whose handle is released (``Agent.release``; ``bench/nixl_release.py`` watches a released
READ land in full), so a READ that outlived its deadline may still land, in memory the
owner would by then have given to another request. The manager reports such a pull at
once, for the client's sake, as a completion with ``settled`` False, and hands its handle
to ``Drains``, which polls it until NIXL says DONE or ERR. Only then does
``TransferManager.settled()`` list the pull: until then the owner must neither reuse nor
free the destination (``serving.worker`` holds the request's blocks and slot).

A drain has no deadline: UCX fails the requests of a peer it finds dead (keepalive), and
until a READ ends its destination may change, so none of it is handed back before; a long
drain is logged every ``DRAIN_WARN`` seconds. A lost peer is removed from the agent only
once its drains have ended, since NIXL answers ERR for a removed peer's READs without
asking UCX.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import Callable, Container, Iterable

from transfer.agent import Agent

log = logging.getLogger(__name__)

DRAIN_WARN = 60.0  # seconds between logs of a failed READ that still runs


@dataclasses.dataclass
class _Drain:
    """A failed pull's READ that NIXL has not ended: its destination stays held."""

    handle: object
    peer: str
    warn_at: float  # when to log that it still runs


class Drains:
    """The failed READs of one manager's pulls, from failure until ``settled()`` lists them.

    ``release`` frees an ended READ's handle (the manager keeps one NIXL refuses, to retry).
    Not thread-safe: the manager calls it under its lock.
    """

    def __init__(self, agent: Agent, release: Callable[[object], None]):
        self._agent = agent
        self._release = release
        self._running: dict[int, _Drain] = {}  # pull id -> its READ, which NIXL has not ended
        self._ended: set[int] = set()  # drained, not yet returned by settled()
        self._handed: set[int] = set()  # whose unsettled completion the owner has received
        self._forget: set[str] = set()  # lost peers to remove once their READs drain

    def __len__(self) -> int:
        return len(self._running)

    def add(self, pull_id: int, handle: object, peer: str) -> None:
        """Pull ``pull_id`` failed while its READ (``handle``, from ``peer``) was in flight."""
        self._running[pull_id] = _Drain(handle, peer, time.monotonic() + DRAIN_WARN)

    def handed(self, pull_ids: Iterable[int]) -> None:
        """``collect()`` returned these pulls' unsettled completions: ``settled()`` may list
        them from now on, so the owner sees a pull fail before it sees it settle."""
        self._handed.update(pull_ids)

    def remove_peer(self, name: str) -> None:
        """Remove lost peer ``name`` from the agent, now or once its READs here have ended:
        NIXL stops asking UCX about a removed peer's READs (they read ERR at once)."""
        if any(d.peer == name for d in self._running.values()):
            self._forget.add(name)
        else:
            self._agent.remove_peer(name)

    def poll(self, now: float, peers: Container[str]) -> None:
        """End the READs that NIXL reports ended, then remove the lost peers left without
        one, unless they are among ``peers`` again (reconnected meanwhile)."""
        for pid, d in list(self._running.items()):
            if self._agent.state(d.handle) == "PROC":
                if now >= d.warn_at:
                    log.warning("the failed READ of pull %d from %s is still in flight; "
                                "its destination stays held", pid, d.peer)
                    d.warn_at = now + DRAIN_WARN
                continue
            del self._running[pid]
            self._release(d.handle)
            self._ended.add(pid)
        for peer in [q for q in self._forget
                     if not any(d.peer == q for d in self._running.values())]:
            self._forget.discard(peer)
            if peer not in peers:
                self._agent.remove_peer(peer)

    @property
    def ready(self) -> bool:
        """Whether ``settled()`` has something to return."""
        return bool(self._ended & self._handed)

    def settled(self) -> list[int]:
        """Pulls whose READ has ended and whose completion the owner has received, once."""
        out = sorted(self._ended & self._handed)
        self._ended.difference_update(out)
        self._handed.difference_update(out)
        return out

    def close(self) -> None:
        """Release the handles of the READs still running (the manager is closing)."""
        for d in self._running.values():
            self._agent.release(d.handle)
        self._running.clear()
