"""The decode side's transfers, as the scheduler sees them: requests whose prompt KV
and GDN state another worker computed wait in arrival order for memory
(`queue_transfer`, `reserve_transfers`), hold it while a transfer fills it
(`begin_transfer` .. `end_transfer`, or `abandon_transfer` when the bytes may still
land), and, with a prefix cache, a finished one keeps its blocks until the source
confirms them (`confirm_transfer`, `drop_unconfirmed`).

`TransferQueue` is the `Scheduler`'s half for this: it works on the scheduler's pools
and queues (`blocks`, `slots`, `prefix`, `running`, `transferring`, `unconfirmed`,
`queued_transfers`, which `Scheduler.__init__` creates) and requeues through it.
"""

from serving.engine.request import Request, Status


class TransferQueue:
    def queue_transfer(self, req: Request) -> None:
        """Queue a request whose prompt KV and GDN state a transfer will write, until
        `reserve_transfers` finds it memory."""
        req.status = Status.QUEUED_FOR_TRANSFER
        self.queued_transfers.append(req)

    def reserve_transfers(self) -> list[Request]:
        """Reserve memory for queued transfers, in arrival order while there is room
        (the first that does not fit blocks the rest, as for waiting requests)."""
        reserved = []
        while self.queued_transfers and self.begin_transfer(self.queued_transfers[0]):
            reserved.append(self.queued_transfers.popleft())
        return reserved

    def begin_transfer(self, req: Request) -> bool:
        """Reserve blocks and a slot for a request whose prompt KV and GDN state
        will be written by a transfer. The memory comes from the pool, which
        only ever holds memory that no dispatched step can still write, and the
        request is not scheduled until `end_transfer`, so no step touches the
        memory while the transfer fills it. With a prefix cache the prompt's first blocks
        may be cached ones, shared read-only: the transfer skips them
        (`num_registered_blocks` of them). False if there is no room now."""
        if self.slots.num_free == 0:
            return False
        if len(self.running) + len(self.transferring) >= self.max_num_seqs:
            return False
        # blocks of the prompt cached here are shared, and the transfer skips them
        shared = [] if self.prefix is None else self.prefix.match_blocks(req, req.num_prompt_tokens)
        need = self._blocks_for(req.num_prompt_tokens) - len(shared)
        if self.blocks.num_free < need:
            if shared:
                self.blocks.free(shared)
            return False
        req.slot = self.slots.allocate()
        req.block_ids = shared + self.blocks.allocate(need)
        req.num_registered_blocks = len(shared)
        req.status = Status.WAITING_FOR_TRANSFER
        self.transferring[req.request_id] = req
        return True

    def end_transfer(self, req: Request, ok: bool, confirmed: bool = True) -> None:
        """The transfer into `req`'s memory has completed (or failed); `confirmed` False:
        its bytes landed, and the source's word that they were not stale is still to come
        (`confirm_transfer`), so the request may decode but registers no block."""
        del self.transferring[req.request_id]
        req.transfer_unconfirmed = ok and not confirmed
        if req.is_finished:  # aborted while the transfer was writing
            self.release(req)
            return
        if not ok and req.num_registered_blocks:
            # shared blocks are never written: recompute in fresh memory (after the
            # prefix cache's hit, as any admission)
            self.release(req)
            self._requeue(req)
            return
        # On failure the prompt is recomputed in the same memory: start_pos 0
        # never reads the slot and the KV is rewritten, so nothing is zeroed.
        req.num_computed_tokens = req.num_prompt_tokens if ok else 0
        req.status = Status.RUNNING
        self.running.append(req)

    def confirm_transfer(self, req: Request) -> None:
        """The source confirmed the bytes `req` decodes from: its blocks register from
        its next step on, or now if it has finished (then they go back, cached)."""
        req.transfer_unconfirmed = False
        if self.unconfirmed.pop(req.request_id, None) is req:  # (held only with a prefix cache)
            self.prefix.stage_blocks(req, req.num_computed_tokens)
            self.prefix.commit()
            self.release(req)

    def drop_unconfirmed(self, request_id: str) -> None:
        """A finished request's unconfirmed bytes will not be confirmed (stale, or its
        source gone): its blocks go back unregistered."""
        req = self.unconfirmed.pop(request_id, None)
        if req is not None:
            self.release(req)

    def abandon_transfer(self, req: Request) -> tuple[list[int], int | None]:
        """The transfer into `req`'s memory failed, and its bytes may still land
        there (NIXL does not stop a released READ). The request gives that memory
        up at once and, unless aborted, goes back to the head of the queue to
        recompute its prompt in fresh memory, as a preempted request does, so it
        waits for no transfer. Returns the memory, for `free_memory` once
        nothing can write it any more."""
        del self.transferring[req.request_id]
        memory = req.block_ids, req.slot
        req.block_ids, req.slot = [], None
        if not req.is_finished:
            self._requeue(req)
        return memory
