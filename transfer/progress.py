"""A thread that keeps a ``TransferManager``'s protocol moving while its owner is busy.

Why: the owner of a manager in a worker is the engine thread, which is inside a device
step most of the time (an 8192-token prefill step takes 250 to 330 ms on an H200). A
source that handled the puller's ``done`` only between steps held every ack, and with it
the request's first outputs on the decode side, for up to a whole step (~300 ms READ to ack
on 2×H200, against ~1 ms for the READ itself). With NIXL's progress thread off (DRAM
agents, ``transfer.agent``), UCX also advanced only between steps.

So this thread calls ``manager.progress()``: every ``busy`` seconds while a lease or pull is
open (every ``manager.pull_poll(busy)`` seconds while a READ is in flight), otherwise
every ``idle`` seconds (UCX must still advance: a peer may READ at any time) or as soon
as the owner pins or pulls (``manager.opened``). Whenever ``progress()``
leaves something for the owner (completions, landed READs, freed leases, settled
READs) it calls
``on_ready()``, which wakes the owner to ``collect()`` it between its steps.

Why this is safe: ``progress()`` touches only the manager's own state, under its lock,
and never runs the owner's code; it does not free memory, it only queues freed leases for
``collect()`` on the owner's thread (``transfer.manager``, "Threading"). The NIXL agent
accepts calls from this thread (STRICT mode, ``transfer.agent``), and the thread binds to
the agent's device before its first call.
"""

from __future__ import annotations

import logging
import threading
from typing import Callable

from transfer.manager import TransferManager

log = logging.getLogger(__name__)


class ProgressThread:
    """Runs ``manager.progress()`` until ``stop()``; stop it before ``manager.close()``."""

    def __init__(self, manager: TransferManager, on_ready: Callable[[], None], *,
                 busy: float = 0.001, idle: float = 0.02):
        self._manager, self._on_ready = manager, on_ready
        self._busy, self._idle = busy, idle
        self._pulling = manager.pull_poll(busy)
        self._stopping = False
        self._thread = threading.Thread(target=self._run, name="transfer-progress", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        m = self._manager
        m.agent.bind_thread()
        while not self._stopping:
            m.opened.clear()  # before progress(): a pin or pull after it wakes the wait below
            try:
                if m.progress():
                    self._on_ready()
            except Exception:  # a bug here must not stop every later ack and completion
                log.exception("transfer progress failed")
            m.opened.wait(self._pulling if m.pending else self._busy if m.busy else self._idle)

    def stop(self) -> None:
        self._stopping = True
        self._manager.opened.set()
        self._thread.join(timeout=10)
