"""Fault injection: an `Agent` whose next READs fail, hang or lose their notification.

The manager knows nothing of it: it sees READs that raise as NIXL does for a bad
request, READs NIXL never took (no handle: the pull waits until its deadline, as one
whose completion never comes), and READs whose ``done`` notification went missing.
The manager tests wrap their agents in one; ``fault_worker.py`` runs a worker whose
agent is one, its counters set over HTTP.
"""

from __future__ import annotations


class InjectedFault(RuntimeError):
    """The READ a test asked to fail."""


class FaultyAgent:
    """`agent` with three counters, each the number of next READs it applies to:
    ``fail_next`` raise, ``hang_next`` are never posted, ``lose_notif_next`` carry no
    notification. Everything else is the wrapped agent's."""

    def __init__(self, agent):
        self.agent = agent
        self.fail_next = self.hang_next = self.lose_notif_next = 0

    def __getattr__(self, name):
        return getattr(self.agent, name)

    def read(self, peer: str, local, remote, remote_mem_type: str, message: bytes):
        if self.fail_next > 0:
            self.fail_next -= 1
            raise InjectedFault("injected transfer error")
        if self.hang_next > 0:
            self.hang_next -= 1
            return None, "PROC"
        if self.lose_notif_next > 0:
            self.lose_notif_next -= 1
            message = b""
        return self.agent.read(peer, local, remote, remote_mem_type, message)
