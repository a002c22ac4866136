"""Continuous batching with chunked prefill, preemption by recompute, aborts.

Every step gets a token budget (`max_num_batched_tokens`). Running requests
are served first (single-token decodes before prefill chunks, so a long prompt
cannot starve decodes), then waiting requests are admitted in order, and a
request that does not fit blocks everyone behind it. The order is arrival
("fcfs"), or with a prefix cache ("lpm", SGLang's policy of that name) the
longest cached prefix first among the first `LOOKAHEAD` waiting requests,
arrival order among equals: a burst of prompts off a few shared prefixes then
runs each prefix's followers (short suffixes) as soon as the step that cached
the prefix has been scheduled, ahead of other prefixes' whole prompts. A request
passed over in `MAX_PASSED` scheduling passes goes back to the front (a preempted
one at once, as under "fcfs"), so none waits without bound: the one wait that
outlasts it is for a prefix another request is computing, which ends when that
prompt's last chunk is scheduled. A prompt longer than the remaining budget is cut into
chunks; the next chunk continues from the KV blocks and the GDN slot.

When a running request needs a block and none is free, the most recently
admitted request is preempted: its memory is released (through the fence) and
it goes back to the head of the queue to be recomputed from its prompt plus
the tokens it has already generated. Before preempting, the scheduler waits
for memory that is only held back by the fence, so fenced releases never cause
preemption thrashing (cf. vLLM PR #49675).

With a prefix cache (prefix_cache.py), a request being admitted starts after its
longest cached prefix: it shares those blocks and restores its GDN state from a
snapshot row. Each step registers the full blocks it writes and takes the
snapshots its prefill chunks pass, as many as the step's bucket holds.

A step is a decode step (`is_decode`) when every scheduled request feeds
one token that continues existing context, with its drafts if it has any, from
its own slot or the state a verify step left it; otherwise it runs through the
prefill program, which also carries single-token decodes and verifies (mixed
batch).
"""

import itertools
import time
from collections import deque
from dataclasses import dataclass, field

from serving.engine.block_pool import BlockPool
from serving.engine.fence import StepFence
from serving.engine.prefix_cache import PrefixCache
from serving.engine.request import Request, Status
from serving.engine.state_pool import SlotPool
from serving.engine.transfer_queue import TransferQueue


# "lpm" order: the waiting requests ranked each pass, and the passes a request may be
# passed over in before it goes first again (a bursty load passes a whole prompt over
# while the followers of the prefixes before it run: ~10 passes in bench.prefix_hits's
# burst; 4 would put the whole prompts back in arrival order, and lose the gain)
LOOKAHEAD = 256
MAX_PASSED = 16


@dataclass
class ScheduledSeq:
    request: Request
    start: int  # tokens already in the cache (start_pos)
    num_tokens: int  # tokens fed this step
    sample: bool  # the chunk reaches the end of the known tokens: its logits are used
    epoch: int
    restore: int | None = None  # row of the initial GDN state (a prefix hit, a verify state)
    snapshots: list[tuple[int, int]] = field(default_factory=list)  # (position, row)
    num_drafts: int = 0  # the last of the num_tokens are drafts to verify
    draft_tokens: list[int] | None = None  # those drafts, when the host knows them
    # it continues a step in flight that samples, which verified these drafts (None: it
    # continues known tokens): its start and initial state move, on the device, by the
    # drafts that step accepts
    follows: int | None = None


@dataclass
class SchedulerOutput:
    seqs: list[ScheduledSeq]
    is_decode: bool

    @property
    def num_tokens(self) -> int:
        return sum(s.num_tokens for s in self.seqs)


class Scheduler(TransferQueue):
    def __init__(self, *, max_num_seqs: int, max_num_batched_tokens: int, max_model_len: int,
                 block_size: int, blocks: BlockPool, slots: SlotPool, fence: StepFence,
                 prefix: PrefixCache | None = None, longest_prefix_first: bool = False,
                 num_speculative_tokens: int = 0, verify_row=None):
        """`num_speculative_tokens` k: a decoding request with drafts
        (`Request.num_drafts`: what its last draft program made, or k while the step
        that runs it is in flight) feeds its last token and up to k drafts, and its GDN
        state after each fed token but the last is kept in row `verify_row(slot, r)` (r
        < k), so the engine can resume from the state after the accepted ones."""
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.block_size = block_size
        self.blocks = blocks
        self.slots = slots
        self.fence = fence
        self.prefix = prefix
        self.longest_prefix_first = longest_prefix_first and prefix is not None
        self.k = num_speculative_tokens
        self.verify_row = verify_row
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []  # admission order
        self.transferring: dict[str, Request] = {}
        # finished requests that decoded from landed bytes their source has yet to
        # confirm: their blocks wait for its word, then enter the prefix cache
        # (`confirm_transfer`) or go back unregistered (`drop_unconfirmed`)
        self.unconfirmed: dict[str, Request] = {}
        # requests computed elsewhere, waiting (in arrival order) for memory to be
        # transferred into: they hold none, so they wait instead of being refused
        self.queued_transfers: deque[Request] = deque()
        self.num_preemptions = 0

    # ---- queue management -------------------------------------------------

    def add(self, req: Request) -> None:
        self.waiting.append(req)

    def has_work(self) -> bool:
        """Requests not finished: waiting, running, or waiting for or being filled by a
        transfer."""
        return bool(self.waiting or self.running or self.transferring or self.queued_transfers)

    def has_steps(self) -> bool:
        """Requests a step can advance (one a transfer is filling waits for its end)."""
        return bool(self.waiting or self.running)

    def finish(self, req: Request, reason: str, stop_reason=None) -> None:
        """Finish or abort `req` in any state; its memory goes back through the
        fence, unless it is held for a transfer lease or still being filled by
        a transfer (then `end_transfer` releases it)."""
        if req.is_finished:
            return
        if req.status is Status.WAITING:
            self.waiting.remove(req)
        elif req.status is Status.QUEUED_FOR_TRANSFER:
            self.queued_transfers.remove(req)
        elif req.status is Status.RUNNING:
            self.running.remove(req)
            if self.prefix is not None:
                # blocks whose last token a step in flight wrote, unknown when it was
                # scheduled and known now: registered before the memory goes back
                self.prefix.stage_blocks(req, req.num_computed_tokens)
                self.prefix.commit()
        req.finish_reason, req.stop_reason = reason, stop_reason
        transferring = req.status is Status.WAITING_FOR_TRANSFER
        req.status = Status.FINISHED
        req.epoch += 1
        if req.transfer_unconfirmed and reason != "abort" and self.prefix is not None:
            # a short answer can end before its source's word: its blocks wait for it
            # to be cached (no hit needs its slot: a transfer brings the state)
            self.unconfirmed[req.request_id] = req
            self.free_memory([], req.slot)
            req.slot = None
        elif not (req.hold_on_finish or transferring):
            self.release(req)

    def release(self, req: Request) -> None:
        """Return a request's blocks and slot once in-flight steps are done."""
        blocks, slot = req.block_ids, req.slot
        req.block_ids, req.slot = [], None
        self.free_memory(blocks, slot)

    def free_memory(self, blocks: list[int], slot: int | None) -> None:
        """Return blocks and a slot that no request holds once in-flight steps are done."""

        def give_back():
            self.blocks.free(blocks)
            if slot is not None:
                self.slots.free(slot)

        if blocks or slot is not None:
            self.fence.defer(give_back)

    # ---- the step -------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        budget = self.max_num_batched_tokens
        seqs: list[ScheduledSeq] = []
        scheduled: set[int] = set()
        preempted = False
        work = [(r, self._remaining(r)) for r in self.running]
        for req, left in [w for w in work if w[1] == 1] + [w for w in work if w[1] > 1]:
            if req.status is not Status.RUNNING:  # preempted earlier in this pass
                continue
            n = min(left, budget)
            if n <= 0:
                break
            drafts = self._drafts(req, budget) if left == 1 else 0
            n += drafts
            while not self._grow(req, req.num_computed_tokens + n + self._unverified(req),
                                 may_wait=True):
                victim = next((r for r in reversed(self.running)
                               if id(r) not in scheduled and r is not req), req)
                self._preempt(victim)
                preempted = True
                if victim is req:
                    break
            if req.status is Status.RUNNING:
                restore = None if req.in_flight is not None else req.verify_state
                seqs.append(self._take(req, n, restore, drafts))
                scheduled.add(id(req))
                budget -= n
        def room() -> bool:
            return (budget > 0 and self.slots.num_free > 0
                    and len(self.running) + len(self.transferring) < self.max_num_seqs)

        admitting = not preempted and bool(self.waiting) and room()
        order = self._admission_order() if admitting else []
        admitted = []
        computing = self._prefixes_in_prefill() if admitting else None
        for req in order:
            if not room():
                break
            if computing and self._first_key(req) in computing:
                continue  # its prefix is being computed: it hits it once that is done
            restore = self._restore_prefix(req)
            n = min(self._remaining(req), budget)
            if not self._grow(req, req.num_computed_tokens + n, may_wait=False):
                self._unshare(req)
                break
            admitted.append(req)
            req.num_passed = 0
            if self.prefix is not None:
                self.prefix.count(req.num_tokens, req.num_computed_tokens)
            if req.num_cached_tokens is None:  # its first admission
                req.num_cached_tokens = req.num_computed_tokens
                req.scheduled_time = time.perf_counter()
            req.slot = self.slots.allocate()
            req.status = Status.RUNNING
            self.running.append(req)
            seqs.append(self._take(req, n, restore))
            budget -= n
            key = self._first_key(req) if computing is not None else None
            if key is not None and not req.num_cached_tokens:  # computes its prefix
                computing.add(key)
        self._dequeue(admitted)
        is_decode = bool(seqs) and all(
            s.num_tokens - s.num_drafts == 1 and s.start > 0
            and s.restore in (None, s.request.verify_state) for s in seqs)
        out = SchedulerOutput(seqs, is_decode)
        if self.prefix is not None:
            self._register(out)
        return out

    # ---- admission order -------------------------------------------------

    def _admission_order(self):
        """Waiting requests in the order this pass tries to admit them (module
        docstring): arrival, or "lpm": those passed over `MAX_PASSED` times first, in
        arrival order, then the first `LOOKAHEAD` by cached prefix, longest first."""
        if not self.longest_prefix_first or len(self.waiting) < 2:
            return iter(self.waiting)
        head = list(itertools.islice(self.waiting, LOOKAHEAD))
        overdue = [r for r in head if r.num_passed >= MAX_PASSED]
        rest = sorted((r for r in head if r.num_passed < MAX_PASSED),
                      key=lambda r: -self.prefix.cached_tokens(r))
        return itertools.chain(overdue, rest, itertools.islice(self.waiting, LOOKAHEAD, None))

    def _prefixes_in_prefill(self) -> set[bytes] | None:
        """"lpm": the first-block keys of the running requests that computed their prompt
        from its start when first admitted (no hit) and whose prompt blocks are not all
        cached yet (a step scheduled in this pass caches them only for the next pass). A
        waiting request that starts with one of them waits until they are, then hits
        them all, instead of computing the same prefix beside it; the wait ends when that
        prompt's last chunk is scheduled, whatever `MAX_PASSED` says. A transfer whose
        bytes landed unconfirmed computes no prefix (its blocks are cached once it is
        confirmed), so nothing waits for it. None under "fcfs"."""
        if not self.longest_prefix_first:
            return None
        return {self._first_key(r) for r in self.running if not r.num_cached_tokens
                and not r.transfer_unconfirmed
                and r.num_registered_blocks < r.num_prompt_tokens // self.block_size} - {None}

    def _first_key(self, req: Request) -> bytes | None:
        keys = self.prefix.keys(req, self.block_size)
        return keys[0] if keys else None

    def _dequeue(self, admitted: list[Request]) -> None:
        """Take the admitted requests off the queue; each request that stays and was
        ahead of one of them has been passed over once more."""
        if not admitted:
            return
        if all(a is w for a, w in zip(admitted, self.waiting)):  # in queue order
            for _ in admitted:
                self.waiting.popleft()
            return
        taken = {id(r) for r in admitted}
        last = max(i for i, r in enumerate(self.waiting) if id(r) in taken)
        for i, r in enumerate(self.waiting):
            if i < last and id(r) not in taken:
                r.num_passed += 1
        self.waiting = deque(r for r in self.waiting if id(r) not in taken)

    # ---- prefix caching -------------------------------------------------

    def _restore_prefix(self, req: Request) -> int | None:
        """Start a request being admitted after its longest cached prefix: it holds the
        shared blocks and computes from there; returns the snapshot row to restore."""
        if self.prefix is None:
            return None
        blocks, row = self.prefix.match(req)
        req.block_ids = blocks
        req.num_registered_blocks = len(blocks)
        req.num_computed_tokens = len(blocks) * self.block_size
        return row

    def _unshare(self, req: Request) -> None:
        """Undo `_restore_prefix` for a request that stays waiting (no step read them)."""
        if req.block_ids:
            self.blocks.free(req.block_ids)
        req.block_ids, req.num_computed_tokens, req.num_registered_blocks = [], 0, 0

    def _register(self, out: SchedulerOutput) -> None:
        """Register the blocks the step fills and pick the snapshots its prefill chunks
        take (as many as its bucket holds and no more than there are snapshot rows, so no
        take evicts a row this step writes: each request's best point first, then each
        one's second, and so on; `PrefixCache.snapshot_points` orders them)."""
        p = self.prefix
        for s in out.seqs:
            p.stage_blocks(s.request, s.start + s.num_tokens)
        if not out.is_decode:
            points = [(rank, i, pos) for i, s in enumerate(out.seqs)
                      for rank, pos in enumerate(p.snapshot_points(s.request, s.start,
                                                                   s.num_tokens, self.waiting))]
            room = min(p.per_step(out.num_tokens, len(out.seqs)), p.rows.n)
            for _, i, pos in sorted(points):
                if room == 0:
                    break
                s = out.seqs[i]
                row = p.snapshot_row(s.request, pos)
                if row is not None:
                    s.snapshots.append((pos, row))
                    room -= 1
        p.commit()

    def _remaining(self, req: Request) -> int:
        """Tokens `req` can be fed now: zero once its last sample is in flight, or its
        length could reach max_model_len by the drafts a step in flight accepts."""
        if (req.num_generated >= req.params.max_tokens
                or req.num_tokens + self._unverified(req) >= self.max_model_len):
            return 0
        return req.num_tokens - req.num_computed_tokens

    def _unverified(self, req: Request) -> int:
        """Drafts of `req`'s step in flight: tokens it may have beyond what the host counts."""
        return req.in_flight.num_drafts if req.in_flight is not None else 0

    def _drafts(self, req: Request, budget: int) -> int:
        """Drafts a decoding request feeds this step: what it has, within its token limits
        and the step's budget."""
        return max(0, min(req.num_drafts, budget - 1,
                          req.params.max_tokens - req.num_generated - 1,
                          self.max_model_len - req.num_tokens - self._unverified(req) - 1))

    def _take(self, req: Request, n: int, restore: int | None = None,
              drafts: int = 0) -> ScheduledSeq:
        """Schedule `n` tokens of `req`, the last `drafts` of them drafts: counted as
        rejected until the engine learns how many it accepts. A step that samples is the
        request's `in_flight` one until processed; one scheduled while another is in
        flight starts where the host's count says and moves on the device (`follows`)."""
        start = req.num_computed_tokens
        req.num_computed_tokens += n - drafts
        sample = req.num_computed_tokens == req.num_tokens
        s = ScheduledSeq(req, start, n, sample, req.epoch, restore, num_drafts=drafts)
        if req.in_flight is not None:
            s.follows = req.in_flight.num_drafts
        if sample:
            req.num_pending += 1
            req.in_flight = s
            if self.k:  # what its draft program makes, at most: known when processed
                req.num_drafts = self.k
        if req.host_drafts is not None and drafts:
            s.draft_tokens = req.host_drafts[:drafts]
        req.host_drafts = None
        s.snapshots = [(start + 1 + r, self.verify_row(req.slot, r)) for r in range(drafts)]
        return s

    def _blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    def _grow(self, req: Request, num_tokens: int, may_wait: bool) -> bool:
        need = self._blocks_for(num_tokens) - len(req.block_ids)
        if need <= 0:
            return True
        if need > self.blocks.num_free and may_wait and self.fence.num_pending:
            self.fence.wait_all()
        if need > self.blocks.num_free:
            return False
        req.block_ids += self.blocks.allocate(need)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self.release(req)
        req.num_pending = 0  # a sample still in flight is dropped (epoch below)
        req.epoch += 1
        req.num_preemptions += 1
        self._requeue(req)
        self.num_preemptions += 1

    def _requeue(self, req: Request) -> None:
        """Back to the head of the queue, holding no memory, to compute its prompt
        again from the start (under "lpm" as one passed over too often: first)."""
        req.num_computed_tokens = 0
        req.num_drafts, req.verify_state, req.host_drafts, req.in_flight = 0, None, None, None
        req.num_passed = MAX_PASSED
        req.status = Status.WAITING
        self.waiting.appendleft(req)
