"""The engine: the host loop that schedules, dispatches and processes steps.

Async scheduling (the default) keeps one step in flight while the host works:

    step k:  schedule S_k  ->  dispatch S_k  ->  fetch outputs of S_{k-1} and process them

so the device starts S_k as soon as S_{k-1} ends, while the host is still
reading S_{k-1}'s tokens, checking stop conditions and building S_{k+1}.
Tokens sampled by S_{k-1} are fed to S_k on device (runner.py), so the
scheduler only needs token *counts*, which it knows. With async off, each step
is processed right after its dispatch.

Race freedom, by construction:
  A. Memory released by the host (finish, abort, preemption) goes back to the
     pools only after every already-dispatched step has completed (StepFence).
     A step that still holds a finished request therefore never writes memory
     that has been handed to someone else, be it a new request or a transfer.
  B. No step ever zeroes or writes memory outside the sequences it carries:
     fresh sequences start from a zero state without reading their slot, and
     padding rows write nothing. Memory that a transfer fills is reserved from
     the pool (so no in-flight step can touch it, by A), and its request is not
     scheduled until the transfer is reported complete (`finish_transfer`).
Stale outputs (a request finished, aborted or preempted while a step holding
it was in flight) are recognised by the request's epoch and dropped.

Speculative decoding (`num_speculative_tokens` k, drafter.py) runs ahead the same way. A
step is: schedule (a decoding request feeds its last token and its drafts), dispatch the
forward pass, the sampler (which also decides what is accepted, `drafter.verdict`) and
the draft program over what was accepted. How many drafts a verify step accepts decides
where the next step starts, and the host learns it one step late; so the scheduler
counts a verify step's drafts as rejected until then, and a step scheduled while the
one before it is in flight (`ScheduledSeq.follows`) moves on the device by that step's
accepted count: its start, positions and initial GDN state (`drafter.follow`), and
it verifies only the drafts that step's draft program made. Its blocks also cover the
positions the drafts in flight may add. A row's token is drawn as without
drafts (the sampler's draw is a function of the request's seed and the position), and
the drafts are accepted while each equals the token drawn before it; the first token
that differs from its draft ends the run and is kept. For greedy drafts this is
rejection sampling (accept a draft d with probability p(d), else draw from p without d),
so the output keeps the target distribution, and every request gets the tokens it gets
without drafts, greedy or seeded. The GDN state after the accepted tokens is the verify
step's state after that token (`EngineConfig.verify_row`), which the next step starts
from; KV written at rejected positions lies past the request's length and is rewritten.
A verify step of decoding requests only runs the decode program (runner.py: k + 1
tokens a sequence), the GDN recurrence writing the state after each token.
"""

import logging
import time
from collections import deque

import jax
import numpy as np

from qwen35_jax.sharding import mesh_of
from serving.bucket_counts import ITERATION_TOKENS, BucketCounts
from serving.engine.block_pool import BlockPool
from serving.engine.compile_guard import CompileCounter
from serving.engine.config import EngineConfig
from serving.engine.drafter import Drafter
from serving.engine.fence import StepFence
from serving.engine.idle_timer import IdleTimer
from serving.engine.outputs import RequestOutput
from serving.engine.prefix_cache import PrefixCache, SnapshotRows, model_identity
from serving.engine.remote import RemoteMemory
from serving.engine.request import Request
from serving.engine.runner import Runner
from serving.engine.sampling_params import SamplingParams
from serving.engine.scheduler import Scheduler
from serving.engine.state_pool import SlotPool
from serving.engine.stop import check_stop, text_token_ids

log = logging.getLogger(__name__)


class Engine(RemoteMemory):
    def __init__(self, model, cache, config: EngineConfig, *, tokenizer=None, batch_type=None,
                 mtp=None):
        """`cache` must be allocated for `config.num_blocks` blocks of
        `config.block_size` positions and `config.num_state_rows` state rows (see
        capacity.py). `batch_type` is the model's Batch class, by default
        qwen35_jax's; tests pass a stand-in model with its own. `mtp`: the model's MTP
        head (qwen35_jax.mtp), which speculative decoding drafts with."""
        if batch_type is None:
            from qwen35_jax.batch import Batch as batch_type
        c = self.config = config
        if (c.buckets.prefill_tokens[-1] < c.max_num_batched_tokens
                or min(c.buckets.prefill_seqs[-1], c.buckets.decode_seqs[-1]) < c.max_num_seqs):
            raise ValueError(f"buckets {c.buckets} do not cover max_num_batched_tokens "
                             f"{c.max_num_batched_tokens} and max_num_seqs {c.max_num_seqs}")
        if c.max_blocks_per_seq > c.num_blocks:
            raise ValueError(f"max_model_len {c.max_model_len} needs {c.max_blocks_per_seq} "
                             f"blocks, the cache has {c.num_blocks}")
        trained = getattr(model.config, "max_position_embeddings", None)
        if trained is not None and c.max_model_len > trained:
            raise ValueError(f"max_model_len {c.max_model_len} is over the model's "
                             f"max_position_embeddings {trained}: positions past it were "
                             "never trained")
        self.tokenizer = tokenizer
        self.vocab_size = model.config.vocab_size  # token ids outside it are refused
        if c.max_logprobs > self.vocab_size:
            raise ValueError(f"max_logprobs {c.max_logprobs} is over the vocabulary's "
                             f"{self.vocab_size} tokens")
        self.blocks = BlockPool(c.num_blocks)
        self.slots = SlotPool(c.num_slots)
        self.fence = StepFence()
        self.prefix = None
        if c.enable_prefix_caching:
            dtype = jax.tree.leaves(cache)[0].dtype
            self.prefix = PrefixCache(
                self.blocks, block_size=c.block_size, interval=c.prefix_state_interval,
                rows=SnapshotRows(c.num_slots, c.num_prefix_snapshots),
                per_step=lambda t, n: c.snapshots_per_step(*c.buckets.pick(False, t, n)),
                identity=model_identity(repr(model.config), str(dtype)))
            self.blocks.on_evict = self.prefix.on_evict
        self.scheduler = Scheduler(
            max_num_seqs=c.max_num_seqs, max_num_batched_tokens=c.max_num_batched_tokens,
            max_model_len=c.max_model_len, block_size=c.block_size,
            blocks=self.blocks, slots=self.slots, fence=self.fence, prefix=self.prefix,
            longest_prefix_first=c.scheduling_policy == "lpm",
            num_speculative_tokens=c.num_speculative_tokens, verify_row=c.verify_row)
        self.drafter = None
        if c.num_speculative_tokens:
            if mtp is None:
                raise ValueError("speculative decoding (method mtp) needs the model's MTP head: "
                                 "this checkpoint has no mtp.* tensors")
            if cache.kv.shape[1] != model.config.num_groups + c.mtp_layers:
                raise ValueError("speculative decoding needs a cache with the MTP head's KV "
                                 "layer (EngineConfig.mtp_layers)")
            self.drafter = Drafter(model, mtp, k=c.num_speculative_tokens,
                                   num_blocks=c.num_blocks, block_size=c.block_size,
                                   num_slots=c.num_slots,
                                   kv_sharding=cache.kv.sharding if mesh_of(cache.kv) else None)
        self.compiles = CompileCounter()
        self.runner = Runner(model, cache, num_slots=c.num_slots,
                             max_blocks_per_seq=c.max_blocks_per_seq, buckets=c.buckets,
                             num_top_logprobs=c.max_logprobs, batch_type=batch_type,
                             num_state_rows=c.num_state_rows,
                             snapshots_per_step=c.states_per_step, drafter=self.drafter,
                             verify_row=c.verify_row)
        with self.compiles.phase("warmup"):
            self.warmup_seconds = self.runner.warmup()
        log.info("engine ready: %d programs compiled in %.1f s, %d blocks x %d tokens, %d slots",
                 len(c.buckets.all_shapes()), self.warmup_seconds, c.num_blocks, c.block_size,
                 c.num_slots)
        self._block_bytes, self._slot_bytes = cache.block_nbytes, cache.slot_nbytes
        self.requests: dict[str, Request] = {}
        self._inflight: deque = deque()  # (seq, SchedulerOutput, SampleResult)
        self._rng = np.random.default_rng(c.seed)
        self._next_id = 0
        self.idle_timer = IdleTimer() if c.track_device_idle else None
        self.stats = {"steps": 0, "decode_steps": 0, "prefill_steps": 0,
                      "scheduled_tokens": 0, "padded_tokens": 0}
        self.iteration_tokens = BucketCounts(ITERATION_TOKENS)  # tokens per step

    # ---- requests -------------------------------------------------------

    def add_request(self, prompt_token_ids: list[int], params: SamplingParams | None = None,
                    request_id: str | None = None, *, hold_on_finish: bool = False) -> str:
        """Queue a request. `hold_on_finish` keeps its blocks and slot after it
        finishes (for a transfer lease) until `release(request_id)`."""
        req = self._new_request(prompt_token_ids, params, request_id)
        if hold_on_finish and req.params.max_tokens != 1:
            # With more than one token, an async step may still extend the
            # request's state past its last token when it finishes on a stop
            # condition, so the held state would not be the reported one.
            del self.requests[req.request_id]
            raise ValueError("hold_on_finish is for prefill-only requests (max_tokens=1)")
        req.hold_on_finish = hold_on_finish
        self.scheduler.add(req)
        return req.request_id

    def abort(self, request_id: str) -> RequestOutput | None:
        """End a request; one that has finished, decoding from bytes its source has not
        confirmed, gives its blocks back unregistered (``Scheduler.drop_unconfirmed``)."""
        req = self.requests.get(request_id)
        if req is None or req.is_finished:
            self.scheduler.drop_unconfirmed(request_id)
            return None
        self.scheduler.finish(req, "abort")
        return self._finished(req)

    def swap_cache(self, cache) -> None:
        """Run the same compiled programs on another cache of the same shapes and dtypes
        (`Runner.swap_cache`), with no request in flight; cached prefixes are forgotten,
        their content being in the old cache."""
        if self.has_unfinished():
            raise RuntimeError("swap_cache with requests in flight")
        for request_id in list(self.scheduler.unconfirmed):  # their bytes are the old cache's
            self.scheduler.drop_unconfirmed(request_id)
        if self.prefix is not None:
            self.prefix.clear()
        self.runner.swap_cache(cache)

    def has_unfinished(self) -> bool:
        return self.scheduler.has_work() or bool(self._inflight)

    def has_steps(self) -> bool:
        """Whether `step` has anything to do: requests it can advance or steps in
        flight. Requests that transfers are filling are unfinished but not steps: a
        host loop waits for their transfers instead of stepping (spinning) meanwhile."""
        return self.scheduler.has_steps() or bool(self._inflight)

    # ---- the loop -------------------------------------------------------

    def step(self) -> list[RequestOutput]:
        """Run one iteration; returns outputs of requests that got tokens or finished."""
        with self.compiles.phase("serving"):
            return self._step()

    def _step(self) -> list[RequestOutput]:
        self.fence.poll()
        sched = self.scheduler.schedule()
        if sched.seqs:
            x = self.runner.prepare(sched)
            t = time.perf_counter()
            out = self.runner.run(x, sched.is_decode)
            seq = self.fence.on_dispatch(out.token)
            if self.drafter is not None:  # the draft program, dispatched after the sampler
                self.fence.on_dispatch(self.drafter.done)
            if self.idle_timer:
                self.idle_timer.on_dispatch(seq, t, out.token)
            self._inflight.append((seq, sched, out))
            self._count(sched, x)
        run_ahead = self.config.async_scheduling
        keep = 1 if (run_ahead and sched.seqs) else 0
        outputs: list[RequestOutput] = []
        while len(self._inflight) > keep:
            outputs += self._process(*self._inflight.popleft())
        if not self._inflight:
            self.runner.check_addresses()
        return outputs

    def generate(self, prompts: list[list[int]],
                 params: SamplingParams | list[SamplingParams] | None = None) -> list[RequestOutput]:
        """Run prompts to completion; outputs in prompt order."""
        if not isinstance(params, list):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} SamplingParams")
        ids = [self.add_request(p, sp) for p, sp in zip(prompts, params)]
        done: dict[str, RequestOutput] = {}
        while self.has_unfinished():
            for o in self.step():
                if o.finished:
                    done[o.request_id] = o
        return [done[i] for i in ids]

    def metrics(self) -> dict:
        m = dict(self.stats)
        m.update(serving_compiles=self.compiles.serving_compiles,
                 warmup_compiles=self.compiles.warmup_compiles,
                 warmup_seconds=self.warmup_seconds,
                 num_preemptions=self.scheduler.num_preemptions,
                 num_running=len(self.scheduler.running),
                 num_waiting=len(self.scheduler.waiting) + len(self.scheduler.queued_transfers),
                 free_blocks=self.blocks.num_free, free_slots=self.slots.num_free,
                 kv_cache_usage=1 - self.blocks.num_free / self.blocks.num_blocks,
                 kv_bytes_in_use=(self.blocks.num_blocks - self.blocks.num_free)
                 * self._block_bytes,
                 state_bytes_in_use=(self.slots.num_slots - self.slots.num_free)
                 * self._slot_bytes,
                 prefix_cache_queries=self.prefix.queries if self.prefix else 0,
                 prefix_cache_hits=self.prefix.hits if self.prefix else 0,
                 cached_blocks=self.blocks.num_evictable,
                 prefix_snapshots=len(self.prefix.rows) if self.prefix else 0,
                 iteration_tokens=self.iteration_tokens.state(),
                 **(self.drafter.counters() if self.drafter is not None else {}))
        if self.idle_timer:
            m.update(self.idle_timer.counters())
        return m

    def close(self) -> None:
        self.compiles.close()

    # ---- internals ------------------------------------------------------

    def _new_request(self, prompt, params, request_id) -> Request:
        params = params or SamplingParams()
        prompt = self._token_ids(prompt)
        if not prompt:
            raise ValueError("empty prompt")
        if len(prompt) >= self.config.max_model_len:
            raise ValueError(f"prompt of {len(prompt)} tokens leaves no room under "
                             f"max_model_len {self.config.max_model_len}")
        if (params.logprobs or 0) > self.config.max_logprobs:
            raise ValueError(f"logprobs {params.logprobs} > max_logprobs {self.config.max_logprobs}")
        if params.stop and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer")
        if request_id is None:
            request_id, self._next_id = f"req-{self._next_id}", self._next_id + 1
        if request_id in self.requests or request_id in self.scheduler.unconfirmed:
            raise ValueError(f"duplicate request id {request_id}")
        seed = params.seed if params.seed is not None else int(self._rng.integers(2**31))
        req = Request(request_id, prompt, params, seed)
        self.requests[request_id] = req
        return req

    def _token_ids(self, prompt) -> list[int]:
        """The prompt as a list of ints; ValueError naming its first entry that is no token
        id. A list of Python ints (what the servers pass) is checked in bulk by NumPy: one
        by one, a 32k-token prompt held the engine thread for ~9 ms."""
        if all(type(t) is int for t in prompt):
            try:
                ids = np.fromiter(prompt, np.int64, len(prompt))
            except OverflowError:  # beyond int64: the loop below names it
                ids = None
            if ids is not None and (not ids.size or (ids.min() >= 0 and ids.max() < self.vocab_size)):
                return list(prompt)
        bad = next((t for t in prompt if not self._is_token(t)), None)
        if bad is not None:
            raise ValueError(f"prompt token {bad!r} is not a token id of the vocabulary "
                             f"(size {self.vocab_size})")
        return [int(t) for t in prompt]

    def _is_token(self, t) -> bool:
        """Whether `t` is a token id: anything else would overflow or index out of the
        embedding inside a step that serves other requests too."""
        return isinstance(t, (int, np.integer)) and not isinstance(t, bool) \
            and 0 <= t < self.vocab_size

    def _count(self, sched, x) -> None:
        s = self.stats
        s["steps"] += 1
        s["decode_steps" if sched.is_decode else "prefill_steps"] += 1
        s["scheduled_tokens"] += sched.num_tokens
        self.iteration_tokens.observe(sched.num_tokens)
        s["padded_tokens"] += len(x.tokens)

    def _process(self, seq: int, sched, out) -> list[RequestOutput]:
        tokens = np.asarray(out.token)  # waits for this step only
        self.fence.mark_completed(seq)
        want_lp = any(s.sample and s.request.params.logprobs is not None for s in sched.seqs)
        if want_lp:
            lp, top_ids, top_lp = (np.asarray(a) for a in (out.logprob, out.top_ids, out.top_logprobs))
        if self.drafter is not None:
            v = out.verdict
            accepted, num_drafts, verified = (np.asarray(a) for a in (v.accepted, v.num_drafts,
                                                                      v.verified))
        per_seq = self.runner.rows(1)
        now = time.perf_counter()
        outputs = []
        for i, s in enumerate(sched.seqs):
            req = s.request
            if not s.sample or s.epoch != req.epoch:
                continue  # a chunk that samples nothing, or a stale output
            req.num_pending -= 1
            base, kept = i * per_seq, 0
            if s.num_drafts:
                kept = int(accepted[i])
                self.drafter.accept(req, s, kept, int(verified[i]), self.config.verify_row)
            else:  # its state after the step is in its slot, whatever it restored from
                req.verify_state = None
            last = req.in_flight is s  # no later step of req is in flight
            if last:
                req.in_flight = None
            new = []
            for row in range(base, base + kept + 1):
                n = req.params.logprobs
                logprobs = None
                if n is not None:
                    logprobs = {int(t): float(v) for t, v in zip(top_ids[row, :n], top_lp[row, :n])}
                    logprobs[int(tokens[row])] = float(lp[row])
                new.append(int(tokens[row]))
                self._append_token(req, new[-1], logprobs, now)
                if req.is_finished:
                    break
            if self.drafter is not None and last and (
                    not req.is_finished or (req.hold_on_finish and req.finish_reason != "abort")):
                req.num_drafts = int(num_drafts[i])  # what the draft program made it
            if req.is_finished:
                outputs.append(self._finished(req, new))
            else:
                outputs.append(self._output(req, new))
        return outputs

    def _append_token(self, req: Request, token: int, logprobs, now: float) -> None:
        req.output_token_ids.append(token)
        if logprobs is not None:
            req.logprobs.append(logprobs)
        if req.first_token_time is None:
            req.first_token_time = now
        reason, stop_reason = check_stop(req, self.config, self.tokenizer)
        if reason is not None:
            self.scheduler.finish(req, reason, stop_reason)

    def _finished(self, req: Request, new=()) -> RequestOutput:
        req.finish_time = time.perf_counter()
        if not (req.hold_on_finish or req.request_id in self.scheduler.transferring):
            self.requests.pop(req.request_id, None)
        if self.tokenizer is not None and not isinstance(req.stop_reason, str):
            req.output_text = self.tokenizer.decode(text_token_ids(
                req.output_token_ids, req.finish_reason, req.stop_reason, req.params))
        return self._output(req, list(new))

    def _output(self, req: Request, new: list[int]) -> RequestOutput:
        return RequestOutput(
            request_id=req.request_id, prompt_token_ids=req.prompt_token_ids,
            token_ids=req.output_token_ids, new_token_ids=new, finished=req.is_finished,
            finish_reason=req.finish_reason, stop_reason=req.stop_reason,
            text=req.output_text if req.is_finished and self.tokenizer is not None else None,
            logprobs=req.logprobs if req.params.logprobs is not None else None,
            num_preemptions=req.num_preemptions, num_cached_tokens=req.num_cached_tokens or 0,
            metrics={"arrival": req.arrival_time, "first_token": req.first_token_time,
                     "finish": req.finish_time,
                     **({} if req.scheduled_time is None else
                        {"queue_s": req.scheduled_time - req.arrival_time})})
