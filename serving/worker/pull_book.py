"""The decode worker's book of requests between the router's ``DecodeRequest`` and the
source's ack: which claim each holds, which wait for memory, which pull is whose, and the
future each caller awaits before it sends any output.

Two threads write it. The event loop opens an entry (``open``) and, when the engine
refuses the request or its caller goes away first, withdraws it (``withdraw``); the
engine thread does everything else between steps (``serving/worker/decode.py``). A claim
belongs to whichever thread pops it from ``claims``, and that thread alone releases it or
pulls it; so a claim is released or pulled exactly once, and never leaks to its lease's
expiry. Every entry ends in ``confirm``, which resolves its future on the caller's loop.
Nothing here touches the engine or the transfer manager: the worker does, with what the
book hands back.
"""

from __future__ import annotations

import asyncio

from serving.async_engine import post
from transfer import Claim


class PullBook:
    def __init__(self):
        self.claims: dict[str, Claim] = {}  # request id -> its claim, until pulled or given up
        self.queued: set[str] = set()  # admitted, waiting for memory (engine thread)
        self.pulls: dict[int, str] = {}  # pull id -> request id (engine thread)
        self.started: set[int] = set()  # pulls whose request decodes before the ack
        # failed pulls whose READ may still write into the memory their request gave up
        # (Engine.abandon_transfer): pull id -> (blocks, slot), freed once the READ ended
        self.draining: dict[int, tuple[list[int], int | None]] = {}
        self._confirmations: dict[str, tuple[asyncio.Future, asyncio.AbstractEventLoop]] = {}

    def __len__(self) -> int:
        """Requests in the book: not yet confirmed, or holding a claim."""
        return len(self._confirmations.keys() | self.claims.keys())

    def is_open(self, request_id: str) -> bool:
        return request_id in self._confirmations or request_id in self.claims

    def open(self, request_id: str, claim: Claim,
             loop: asyncio.AbstractEventLoop) -> asyncio.Future:
        """Enter a claimed request (event loop); the future its caller awaits. ValueError if
        the id is already in the book: the caller releases its claim."""
        if self.is_open(request_id):
            raise ValueError(f"duplicate request id {request_id}")
        confirmed = loop.create_future()
        self._confirmations[request_id] = (confirmed, loop)
        self.claims[request_id] = claim
        return confirmed

    def withdraw(self, request_id: str) -> Claim | None:
        """The engine refused the request, or its caller went away (event loop): its claim
        if no pull has taken it, for the caller to release now. A request the engine
        admitted keeps its entry (the engine aborts it and the tick ends it), as does one
        whose pull has started (its completion ends it)."""
        claim = self.claims.pop(request_id, None)
        if claim is not None and request_id not in self.queued:
            self._confirmations.pop(request_id, None)
        return claim

    def admit(self, request_id: str, add) -> None:
        """The engine thread admits the request: ``add()`` (the engine's admission, which
        raises to refuse it), then it waits for memory. ValueError if it was withdrawn."""
        if request_id not in self.claims:
            raise ValueError(f"request {request_id} was withdrawn")
        add()
        self.queued.add(request_id)

    def reserved(self, request_id: str) -> Claim | None:
        """Memory is reserved for a queued request (engine thread): its claim, now the
        caller's to pull; None if it was withdrawn meanwhile."""
        self.queued.discard(request_id)
        return self.claims.pop(request_id, None)

    def aborted(self, live) -> list[tuple[str, Claim | None]]:
        """Queued requests the engine no longer has (``live(request_id)`` False: aborted
        while waiting for memory), out of the book's queue with their claims, for the
        caller to release and confirm."""
        gone = [r for r in self.queued if not live(r)]
        self.queued.difference_update(gone)
        return [(r, self.claims.pop(r, None)) for r in gone]

    def pulling(self, pull_id: int, request_id: str) -> None:
        self.pulls[pull_id] = request_id

    def landed(self, pull_ids) -> list[str]:
        """The requests whose READs landed (``pull_ids``) and that now decode before the
        ack; each once."""
        out = []
        for pull_id in pull_ids:
            if pull_id in self.pulls and pull_id not in self.started:
                self.started.add(pull_id)
                out.append(self.pulls[pull_id])
        return out

    def completed(self, pull_id: int) -> tuple[str | None, bool]:
        """A pull completed: (its request, or None if not this book's; whether it decoded
        before the ack)."""
        started = pull_id in self.started
        self.started.discard(pull_id)
        return self.pulls.pop(pull_id, None), started

    def drain(self, pull_id: int, memory) -> None:
        self.draining[pull_id] = memory

    def drained(self, pull_ids) -> list:
        """The memory of the failed pulls whose READs have now ended, to free."""
        return [m for m in (self.draining.pop(p, None) for p in pull_ids) if m is not None]

    def confirm(self, request_id: str, error: BaseException | None = None) -> None:
        """Resolve the request's future on its loop, with ``error`` if given; its entry
        ends. Every request ends here."""
        entry = self._confirmations.pop(request_id, None)
        if entry is None:
            return
        future, loop = entry

        def resolve():
            if not future.done():
                future.set_result(None) if error is None else future.set_exception(error)

        post(loop, resolve)

    def close(self, error: BaseException) -> list[Claim]:
        """The engine stopped: every request ends with ``error``; the claims still in the
        book, for the caller to release."""
        for request_id in list(self._confirmations):
            self.confirm(request_id, error)
        claims = [c for c in (self.claims.pop(r, None) for r in list(self.claims)) if c]
        return claims

    def stats(self) -> dict:
        return {"pending_pulls": len(self.pulls), "draining_pulls": len(self.draining),
                "queued_transfers": len(self.queued)}
