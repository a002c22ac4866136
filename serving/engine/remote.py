"""The engine's side of disaggregated serving: requests whose memory a transfer fills
(the decode side) or hands out (the prefill side), as `Engine` methods.

A decode worker queues a request whose prompt was computed elsewhere
(`add_remote_request`), takes the memory reserved for it (`reserve_transfers`), lets a
transfer fill it and reports the end (`finish_transfer`, or `abandon_transfer` then
`free_memory` for a READ that may still be writing). A prefill worker adds requests
with ``hold_on_finish`` (`Engine.add_request`), pins what a finished one holds
(`held_memory`) and ends the hold when the lease ends (`release`, or `discard` for one
no one took). Memory reaches the pools through the scheduler, behind the step fence, as
every release does (engine.py, race freedom A); a transfer that reads or writes the
cache without the step stream first waits for it (`wait_for_cache`).
"""

import dataclasses
import time
from typing import NamedTuple

import jax
import numpy as np

from serving.engine.sampling_params import SamplingParams
from serving.engine.stop import check_stop


class Reservation(NamedTuple):
    """Memory of a remote request for its transfer: its blocks and slot, for a prompt of
    `num_prompt_tokens`. The first `shared_blocks` blocks hold the start of its prompt
    already (prefix-cache blocks, shared read-only): the transfer must skip them."""
    request_id: str
    block_ids: list[int]
    slot: int
    shared_blocks: int
    num_prompt_tokens: int


class RemoteMemory:
    """`Engine`'s transfer methods (a mixin: they use the engine's requests, scheduler
    and runner)."""

    def add_remote_request(self, prompt_token_ids: list[int], first_token: int,
                           params: SamplingParams | None = None,
                           request_id: str | None = None, *, drafts=()) -> str:
        """Queue a request whose prompt was computed elsewhere, to wait for memory that
        a transfer fills: `reserve_transfers` hands out its blocks and slot. ValueError
        if `first_token` (the token the prefill side sampled) is no token or already
        ends the request. The request is not scheduled until `finish_transfer`.
        `drafts`: the prefill side's drafts after the first token, which its first step
        verifies (at most k; ignored without speculative decoding)."""
        if not self._is_token(first_token):
            raise ValueError(f"first token {first_token!r} is not a token id of the vocabulary "
                             f"(size {self.vocab_size})")
        bad = next((t for t in drafts if not self._is_token(t)), None)
        if bad is not None or len(drafts) > self.config.num_speculative_tokens > 0:
            raise ValueError(f"drafts {list(drafts)!r}: at most "
                             f"{self.config.num_speculative_tokens} token ids of the vocabulary")
        req = self._new_request(prompt_token_ids, params, request_id)
        # a request its first token already ends would never be reported by a step
        reason, _ = check_stop(dataclasses.replace(req, output_token_ids=[first_token]),
                               self.config, self.tokenizer)
        if reason is not None:
            del self.requests[req.request_id]
            raise ValueError(f"first token {first_token} already ends the request "
                             f"({reason}): nothing to decode")
        self.scheduler.queue_transfer(req)
        self._append_token(req, first_token, None, time.perf_counter())
        if self.drafter is not None and drafts:
            req.host_drafts = [int(t) for t in drafts]
            req.num_drafts = len(req.host_drafts)
        return req.request_id

    def reserve_transfers(self) -> list[Reservation]:
        """The memory reserved now for queued remote requests, in arrival order, for their
        transfers to fill (all but the first `shared_blocks` blocks: see `Reservation`)."""
        return [Reservation(r.request_id, list(r.block_ids), r.slot, r.num_registered_blocks,
                            r.num_prompt_tokens)
                for r in self.scheduler.reserve_transfers()]

    def finish_transfer(self, request_id: str, ok: bool = True, confirmed: bool = True) -> None:
        """The transfer into the request's memory completed (ok) or failed (the
        prompt is then recomputed locally, in the same memory). `confirmed` False: its
        bytes landed but the source has yet to confirm them (`confirm_transfer`): the
        request decodes, and none of its blocks enters the prefix cache until then."""
        req = self.requests[request_id]
        self.scheduler.end_transfer(req, ok, confirmed)
        if req.is_finished:
            self.requests.pop(request_id, None)

    def confirm_transfer(self, request_id: str) -> None:
        """The source confirmed the landed bytes of a request `finish_transfer` started
        unconfirmed; one that finished meanwhile has its blocks cached now."""
        req = self.requests.get(request_id) or self.scheduler.unconfirmed.get(request_id)
        if req is not None:
            self.scheduler.confirm_transfer(req)

    def abandon_transfer(self, request_id: str) -> tuple[list[int], int | None]:
        """The transfer into the request's memory failed and may still be writing it:
        the request (unless aborted) recomputes its prompt in fresh memory. Returns the
        old memory, for `free_memory` once the transfer has ended."""
        req = self.requests[request_id]
        memory = self.scheduler.abandon_transfer(req)
        if req.is_finished:
            self.requests.pop(request_id, None)
        return memory

    def free_memory(self, memory: tuple[list[int], int | None]) -> None:
        """Return memory that `abandon_transfer` handed out to the pools."""
        self.scheduler.free_memory(*memory)

    def release(self, request_id: str) -> None:
        """End the hold on a finished request's memory (`hold_on_finish`)."""
        req = self.requests.pop(request_id)
        self.scheduler.release(req)

    def held_memory(self, request_id: str) -> tuple[list[int], int]:
        """The blocks and slot a finished request holds (`hold_on_finish`): what a lease
        pins for a transfer to read."""
        req = self.requests[request_id]
        if not (req.is_finished and req.hold_on_finish):
            raise ValueError(f"request {request_id} holds no finished request's memory")
        return list(req.block_ids), req.slot

    def drafts(self, request_id: str) -> list[int]:
        """The drafts a finished held request (`hold_on_finish`) got after its last token
        (none without speculative decoding): read from the device, so the draft program
        that made them, and wrote the MTP head's KV in its blocks, has completed."""
        req = self.requests[request_id]
        if not (req.is_finished and req.hold_on_finish):
            raise ValueError(f"request {request_id} is no finished held request")
        if self.drafter is None or not req.num_drafts:
            return []
        return np.asarray(self.drafter.drafts[req.slot, :req.num_drafts]).tolist()

    def has_request(self, request_id: str) -> bool:
        """Whether the engine knows the request: unfinished, or finished and held."""
        return request_id in self.requests

    @property
    def rewrites_whole_cache(self) -> bool:
        """Whether a compiled program (a step or a draft program) writes every row of a
        cache array, not only the rows it updates (`runner.rewrites_whole_cache`): a
        reader or writer outside the step stream must then not overlap it."""
        return self.runner.rewrites_whole_cache

    def wait_for_cache(self) -> None:
        """Block until every program dispatched so far has finished writing the cache, on
        every device: what a transfer that reads or writes it without the step stream
        waits for (`serving.worker.common.WorkerBase._settle`)."""
        jax.block_until_ready(self.runner.cache)

    def discard(self, request_id: str) -> None:
        """End a held request (`hold_on_finish`), running or finished, and its hold: for
        one whose caller went away before anyone took its memory. Unknown ids are
        ignored. Not for a request a transfer is filling: its memory is the transfer's
        until `finish_transfer` or `abandon_transfer`."""
        req = self.requests.get(request_id)
        if req is None:
            return
        if not req.is_finished:
            self.abort(request_id)
        if request_id in self.requests:
            self.release(request_id)
