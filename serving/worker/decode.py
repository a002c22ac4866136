"""The decode worker: claims a request's lease from the prefill worker that pinned it,
READs the pinned bytes into memory of its own, and only then lets the engine schedule
the request, starting after the prompt with the first token already known; so no token
is applied to the GDN state twice.

A request's way through (``DecodeWorker``):

1. ``decode`` (event loop): the ticket's source must be a prefill worker the router
   registered (``register_sources``); nothing else is contacted. The claim (a handshake
   first, with a source new to this worker) runs in an executor thread, so neither the
   loop nor the engine thread waits on a socket. The claim presents the digest of this
   request's prompt and first token, so the source grants only the lease that holds this
   request's state, and answers what it pins.
2. ``admit`` (engine thread, the loop's connector call): the engine queues the request for memory
   (``Engine.add_remote_request``); a decode side that is full queues requests (bounded
   by ``--max-queued-requests``) instead of refusing them, and the claim keeps the lease
   alive meanwhile.
3. ``tick`` (engine thread, between steps): memory reserved for a queued request starts
   its pull, READing exactly the claimed items (``kv_transfer.pull_items``) but the
   prompt blocks this side's prefix cache holds (a follow-up turn pulls only what is
   new, and the state); a landed READ lets the request decode, and its outputs wait
   until the source acks.

A failed or timed-out transfer ends the request with an error, or recomputes the prompt
locally with ``--on-transfer-failure recompute``. A client that disconnects aborts its
request, queued or not. What each request holds on the way (its claim, its pull, the
future its caller awaits) is kept in a ``PullBook`` (``pull_book.py``).
"""

from __future__ import annotations

import asyncio
import logging

from serving.errors import TransferFailed
from serving.kv_transfer import pull_items
from serving.messages import DecodeRequest
from serving.worker.common import WorkerBase, prompt_digest
from serving.worker.pull_book import PullBook
from transfer import ClaimError, HandshakeError, TransferParamsError

log = logging.getLogger("serving.worker")


class DecodeWorker(WorkerBase):
    role = "decode"

    def __init__(self, *args, transfer_timeout: float = 30.0,
                 recompute_on_failure: bool = False, **kw):
        # set before the base starts the engine thread, whose ticks read them
        self.transfer_timeout, self.recompute = transfer_timeout, recompute_on_failure
        self._sources: frozenset[tuple[str, int]] = frozenset()  # registered by the router
        self.book = PullBook()
        super().__init__(*args, **kw)

    def register_sources(self, addresses) -> None:
        """The prefill workers' handshake addresses this worker may pull from (the router
        registers them); replaces the previous set."""
        self._sources = frozenset((str(h), int(p)) for h, p in addresses)

    async def decode(self, req: DecodeRequest):
        """Claim the request's lease, then queue it for memory and a pull. Returns the
        engine's output stream and a future that the caller must await before sending any
        output: it resolves once the source has acked the transfer, or raises
        TransferFailed.

        Decoding starts as soon as the READ has landed, one ack round trip before the
        ack; the outputs wait on the future, so none computed from bytes the source had
        already reused (a "stale" ack) ever leave the worker."""
        request_id, ticket = req.request_id, req.transfer
        prompt, first_token = list(req.prompt_token_ids), req.first_token
        if self.book.is_open(request_id):  # its entry is another request's
            raise ValueError(f"duplicate request id {request_id}")
        if tuple(ticket.address) not in self._sources:
            raise TransferParamsError(f"{ticket.address[0]}:{ticket.address[1]} is not a "
                                      f"prefill worker the router registered")
        params = req.params.params()
        # a full worker refuses before it claims, and holds its place until the add: a
        # claim it then gave up would drop the lease, and the router's retry on another
        # worker would find it freed
        self.engine.reserve_room()
        try:
            claim = await self._claim(ticket, prompt_digest(prompt, first_token))
        except BaseException:
            self.engine.release_room()
            raise
        try:
            confirmed = self.book.open(request_id, claim, asyncio.get_running_loop())
        except ValueError:  # taken meanwhile
            self.engine.release_room()
            self.transfer.release(claim)
            raise
        try:
            stream = await self.engine.add(request_id, prompt, params, reserved=True,
                                           first_token=first_token,
                                           drafts=list(req.draft_token_ids))
        except BaseException:
            # Refused, the engine died, or the caller went away: a claim no pull has taken
            # is ours to give up (an admitted request is aborted by the engine's stream)
            claim = self.book.withdraw(request_id)
            if claim is not None:
                self.transfer.release(claim)
            raise
        return stream, confirmed

    async def _claim(self, ticket, key: str):
        """The claim of ``ticket``'s lease, made in an executor thread (a handshake first,
        with a source new to this worker). A caller that goes away meanwhile cannot stop
        the thread: the claim it makes is given up as it arrives, so the source frees the
        lease now instead of seeing it extended by a claim no one will pull."""
        made = asyncio.get_running_loop().run_in_executor(None, self.transfer.claim, ticket, key)
        try:
            return await asyncio.shield(made)
        except asyncio.CancelledError:
            made.add_done_callback(
                lambda f: f.cancelled() or f.exception() or self.transfer.release(f.result()))
            raise
        except HandshakeError as e:
            raise TransferFailed(f"transfer source unreachable: {e}") from None
        except ClaimError as e:
            if e.kind == "mismatch":  # the request names a lease of another request
                raise TransferParamsError(f"lease {ticket.lease}: {e.detail}") from None
            raise TransferFailed(f"transfer source refused the claim ({e})") from None

    def admit(self, eng, request_id, prompt, params, *, first_token: int,
              drafts: list[int]) -> None:
        """Queue the request for memory (engine thread); ValueError refuses it."""
        self.book.admit(request_id, lambda: eng.add_remote_request(prompt, first_token, params,
                                                                   request_id,
                                                                   drafts=drafts))

    def on_stop(self, error: BaseException) -> None:
        """No pull will be confirmed, and no claim pulled: end them (engine thread)."""
        for claim in self.book.close(error):
            self.transfer.release(claim)

    def _fail(self, eng, request_id: str, error: TransferFailed) -> None:
        """End a request whose transfer cannot go on, and free what it holds."""
        self.engine.fail(request_id, error)
        eng.abort(request_id)
        self.book.confirm(request_id, error)

    def _start_pulls(self, eng) -> None:
        """Pulls into the memory reserved for queued requests now; claims of queued
        requests that were aborted meanwhile are given up."""
        for request_id, blocks, slot, shared, n in eng.reserve_transfers():
            claim = self.book.reserved(request_id)
            if claim is None:  # its caller went away (and released the claim)
                eng.abort(request_id)
                eng.finish_transfer(request_id, ok=False)
                self.book.confirm(request_id, TransferFailed("withdrawn before its pull"))
                continue
            try:
                remote, local = pull_items(claim.meta.get("cache"), self.layout, blocks, slot, n,
                                           skip_blocks=shared)
                self._settle(eng)
                pull_id = self.transfer.pull(claim, local, timeout=self.transfer_timeout,
                                             remote_items=remote)
            except TransferParamsError as e:
                self.transfer.release(claim)
                self._fail(eng, request_id, TransferFailed(f"KV/state transfer refused ({e})"))
                eng.finish_transfer(request_id, ok=False)
                continue
            self.book.pulling(pull_id, request_id)
            self.counters["transfer_cached_tokens"] += shared * self.layout.block_size
        for request_id, claim in self.book.aborted(eng.has_request):
            if claim is not None:
                self.transfer.release(claim)
            self.book.confirm(request_id, TransferFailed("aborted while waiting for memory"))

    def tick(self, eng) -> None:
        """Between steps, on the engine thread: apply what the transfers handed back, then
        start the pulls that memory is free for."""
        completions = self.transfer.collect()
        landed = self.transfer.landed()
        if not self.recompute:  # (a recompute must not follow tokens already computed)
            for request_id in self.book.landed(landed):  # decode may start, unconfirmed
                eng.finish_transfer(request_id, ok=True, confirmed=False)
        for c in completions:
            request_id, started = self.book.completed(c.pull_id)
            if request_id is None:
                continue
            if c.ok:
                self.counters["transfers"] += 1
                self.counters["transfer_bytes"] += c.nbytes
                self.counters["transfer_seconds"] += c.seconds
                self.counters["transfer_ack_seconds"] += c.phases.get("ack", 0.0)
                self.counters["transfer_descriptors"] += c.descriptors
                h = self.transfer_histograms
                h["transfer_time"].observe(c.seconds)
                h["transfer_size"].observe(c.nbytes)
                h["transfer_descs"].observe(c.descriptors)
                if started:
                    eng.confirm_transfer(request_id)
                else:
                    eng.finish_transfer(request_id, ok=True)
                self.book.confirm(request_id)
                continue
            self.counters["transfer_failures"] += 1
            log.error("transfer for %s failed: %s", request_id, c.error)
            if not self.recompute:
                self._fail(eng, request_id, TransferFailed(f"KV/state transfer failed ({c.error})"))
                if started:  # it decoded from landed bytes: the abort freed its memory
                    continue
            else:
                self.book.confirm(request_id)
            # The request's memory is still the transfer's. A READ that has ended: free
            # the memory, or recompute the prompt in it. One that may still land bytes
            # there: the request gives the memory up now (a recompute runs in fresh
            # memory), and the memory stays out of the pools until the READ has ended.
            if c.settled:
                eng.finish_transfer(request_id, ok=False)
            else:
                self.book.drain(c.pull_id, eng.abandon_transfer(request_id))
        for memory in self.book.drained(self.transfer.settled()):  # after their completions
            eng.free_memory(memory)
        self._start_pulls(eng)

    def stats(self) -> dict:
        return {**super().stats(), **self.book.stats()}

