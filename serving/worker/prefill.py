"""The prefill worker: computes a prompt, samples the first token and, if the request goes
on, pins the prompt's KV blocks and GDN state under a lease for a decode worker.

The lease describes what it pins (``meta``): this side's cache layout and the request's
blocks and slot (``kv_transfer.source_record``); its key is a digest of the prompt and
first token whose state it holds (``common.prompt_digest``), so only a decode worker continuing
this very request can claim it, and it reads only these bytes. The memory is freed when
the claimant's READ notification arrives, when the claimant drops the lease, when the
lease expires, when the router reports the claimant gone (``peer_lost``), or, unclaimed,
when the router reports that no decode worker will pull it (``abandon``).
"""

from __future__ import annotations

import dataclasses
import logging

from serving.kv_transfer import source_record
from serving.messages import PrefillRequest, PrefillResult
from serving.worker.common import WorkerBase, prompt_digest
from transfer import Ticket

log = logging.getLogger("serving.worker")


class PrefillWorker(WorkerBase):
    role = "prefill"

    async def prefill(self, req: PrefillRequest) -> PrefillResult:
        """Prompt -> first token, plus the ticket of its pinned cache when the request
        continues."""
        request_id, prompt, params = req.request_id, list(req.prompt_token_ids), req.params.params()
        first = dataclasses.replace(params, max_tokens=1)
        # a caller gone before its admission settled leaves no hold behind, and touches
        # nothing of a request it does not own (a duplicate id, refused)
        stream = await self.engine.add(request_id, prompt, first,
                                       on_cancel=lambda eng: eng.discard(request_id))
        out = None
        try:
            async for out in stream:
                pass
            goes_on = out.finish_reason == "length" and params.max_tokens > 1
            # built before the pin: a result that cannot be sent (a NaN logprob) pins
            # nothing, and its memory is discarded with the request
            result = PrefillResult(token_ids=list(out.token_ids), logprobs=out.logprobs,
                                   finish_reason=None if goes_on else out.finish_reason,
                                   stop_reason=out.stop_reason,
                                   num_cached_tokens=out.num_cached_tokens,
                                   queue_seconds=out.metrics.get("queue_s", 0.0))
        except BaseException:
            await self.engine.call(lambda eng: eng.discard(request_id))
            raise
        if not goes_on:
            await self.engine.call(lambda eng: eng.release(request_id))
            return result
        ticket, drafts = await self.engine.call(
            lambda eng: self._pin(eng, request_id, prompt, out.token_ids[-1]))
        return result.model_copy(update={"transfer": ticket, "draft_token_ids": drafts})

    def admit(self, eng, request_id, prompt, params) -> None:
        """A prompt to compute: its memory is held when it finishes, for a lease."""
        eng.add_request(prompt, params, request_id, hold_on_finish=True)

    def _pin(self, eng, request_id: str, prompt: list[int], first_token: int
             ) -> tuple[Ticket, list[int]]:
        """(the lease's ticket, the drafts after the first token). The drafts are read
        first: the program that made them also wrote the MTP head's KV into the blocks
        the lease pins, so once they are on the host a READ finds that KV written."""
        drafts = eng.drafts(request_id)
        blocks, slot = eng.held_memory(request_id)
        n = len(prompt)
        items = self.layout.items(blocks, slot, n)

        def on_free(lease: str, reason: str) -> None:
            if reason == "expired":
                self.counters["leases_expired"] += 1
                log.warning("lease %s of %s expired before a decode worker pulled it",
                            lease, request_id)
            eng.release(request_id)

        try:
            self._settle(eng)
            return self.transfer.pin(
                items, on_free=on_free, key=prompt_digest(prompt, first_token),
                meta={"cache": source_record(self.layout, blocks, slot, n)}), drafts
        except Exception:
            eng.release(request_id)
            raise

    def peer_lost(self, agent: str) -> None:
        """A decode worker's agent is gone (the router says so): free the leases it
        claimed now rather than at their expiry; their memory returns at the next tick."""
        self.transfer.peer_lost(agent)
        self.engine.wake()

    def abandon(self, lease: str) -> bool:
        """The router gave the request under ``lease`` up before a decode worker accepted
        it: free the lease now unless one claimed it (whose abort or pull ends it);
        its memory returns at the next tick. Whether it ended."""
        freed = self.transfer.abandon(lease)
        self.engine.wake()
        return freed

    def tick(self, eng) -> None:
        self.transfer.collect()  # runs on_free: leases' memory back to the pools
