"""Compiled step programs over padded buckets: the model's forward pass, then sampling.

A step is two programs (three with a drafter: its draft program follows, drafter.py),
dispatched back to back without waiting: the forward pass (one traced function for both
kinds; the static `is_decode` flag selects the model's recurrent GDN path (decode) or
its chunked path (prefill, which also carries mixed batches)), then the sampler variant
the batch needs (`sampler.SamplerMode`, picked on the host; why not a `lax.cond` inside
one program: sampler.py). Every (is_decode, T, N) forward bucket and every sampler
variant for each bucket's N are lowered, compiled ahead of time (in parallel threads:
XLA compiles release the GIL) and run once at start-up on an all-padding batch, which
writes nothing. Steps call the compiled executables directly, so nothing can silently
retrace; a shape outside the table is compiled on the spot and the compile guard reports
it.

The cache pytree and a per-slot "last sampled token" buffer are donated, so
they are updated in place and keep their device addresses (the transfer layer
registers them once; `check_addresses` verifies it, shard by shard).

On a mesh (a cache allocated with `qwen35_jax.sharding` layouts), the programs
are traced under that mesh and compiled with the parameters', the cache's and
replicated host inputs' shardings fixed on both sides, so a step never
reshards the donated cache and every shard keeps its address.

The last-token buffer is what lets the host run ahead: a decode token that was
sampled by a step still in flight is not known on the host, so the next step
reads it on device from `last_token[slot]` (`from_slot` >= 0) instead of from
the host tokens. Each step writes its sampled tokens there for the sequences
whose chunk reached the end of their known tokens. With drafts the token written is the
one a sequence keeps after its accepted drafts, and a per-slot verdict buffer beside it
(`verdicts`: drafts accepted, drafts made) tells the next step how far the sequence
moved (`drafter.follow`), which the host learns only when it processes the step.
"""

import dataclasses
import re
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm import tqdm

from qwen35_jax.sharding import mesh_of, replicated

from serving.engine.buckets import Buckets
from serving.engine.drafter import follow, keep, verdict, verified_drafts
from serving.engine.sampler import SAMPLER_MODES, SampleResult, SamplingArrays, sample
from serving.engine.scheduler import SchedulerOutput


@jax.tree_util.register_dataclass
@dataclass
class StepInputs:
    """Host-built inputs of one step, padded to a bucket (numpy until dispatched)."""
    tokens: np.ndarray  # i32 [T]
    from_slot: np.ndarray  # i32 [T]: read the token from last_token[slot] when >= 0
    from_draft: np.ndarray  # i32 [T]: read the token from the flat draft buffer when >= 0
    cu_seqlens: np.ndarray  # i32 [N+1]
    start_pos: np.ndarray  # i32 [N]
    slots: np.ndarray  # i32 [N]; num_state_rows = padding
    init_slots: np.ndarray  # i32 [N]: row of the initial GDN state (a snapshot on a hit)
    block_tables: np.ndarray  # i32 [N, M]
    logits_indices: np.ndarray  # i32 [L]: L = N rows, or N * (k + 1) with k drafts (rows_per_seq)
    sample_slot: np.ndarray  # i32 [L]: where to store the sampled token (with drafts, a
    #                          sequence's first row: the one it keeps); num_slots = nowhere
    snapshot_ends: np.ndarray  # i32 [S]: packed token ends of GDN snapshots (prefill only)
    snapshot_slots: np.ndarray  # i32 [S]: their rows; num_state_rows = none
    sampling: SamplingArrays
    # speculative engines (drafter.py): what the sampler's verdict and the draft program read
    verify_index: np.ndarray  # i32 [L]: packed index of the draft a row verifies; -1 = none
    draft_room: np.ndarray  # i32 [N]: positions the blocks hold from the last fed non-draft
    #                         token of a sequence that samples; 0 = no drafts after the step
    after: np.ndarray  # i32 [N]: the token after a chunk that samples nothing; -1 = drawn
    follows: np.ndarray  # i32 [N]: 1 = it continues a step in flight (ScheduledSeq.follows)
    resume_rows: np.ndarray  # i32 [N, k + 1]: its initial state row, by that step's accepted


def _forward(graphdef, treedef, batch_type, k, leaves, cache, last_token, drafts, verdicts,
             x: StepInputs, is_decode: bool):
    """(cache, logits), and with k drafts a sequence (a drafter reads them) the normalised
    hidden state of every token, the tokens the step fed, the draft each logits row
    verifies (-1: none) and how far each sequence moved on the device (`drafter.follow`)."""
    tokens = jnp.where(x.from_slot >= 0, last_token[jnp.maximum(x.from_slot, 0)], x.tokens)
    tokens = jnp.where(x.from_draft >= 0, drafts.reshape(-1)[jnp.maximum(x.from_draft, 0)],
                       tokens)
    start_pos, init_slots = x.start_pos, x.init_slots
    if k:
        delta, made, init_slots = follow(x, verdicts, k)
        start_pos = start_pos + delta
    batch = batch_type(tokens=tokens, cu_seqlens=x.cu_seqlens, start_pos=start_pos,
                       slots=x.slots, block_tables=x.block_tables,
                       logits_indices=x.logits_indices, init_slots=init_slots,
                       snapshot_ends=x.snapshot_ends, snapshot_slots=x.snapshot_slots,
                       is_decode=is_decode)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    if not k:
        logits, cache = model.forward(batch, cache)
        return cache, logits
    h, cache = model.hidden(batch, cache)
    h = model.norm(h)
    drafted = verified_drafts(tokens, x.verify_index, made, k)
    return cache, model.head(h[batch.logits_indices]), h, tokens, drafted, delta


def _sample(num_top, k, logits, last_token, verdicts, sampling: SamplingArrays, sample_slot,
            drafted, draft_room, delta, mode):
    """The sampler; with k drafts a sequence, its `drafter.verdict` too, kept by slot for
    the step after (`drafter.keep`). ``delta``: how far each sequence moved on the device
    (`drafter.follow`)."""
    if not k:
        out = sample(logits, sampling, num_top, mode)
        return last_token.at[sample_slot].set(out.token, mode="drop"), verdicts, out
    sampling = dataclasses.replace(sampling, position=sampling.position + jnp.repeat(delta, k + 1))
    out = sample(logits, sampling, num_top, mode)
    out.verdict = verdict(out.token, drafted, draft_room - delta, k)
    return *keep(out.token, out.verdict, sample_slot, last_token, verdicts, k), out


class Runner:
    def __init__(self, model: nnx.Module, cache, *, num_slots: int, max_blocks_per_seq: int,
                 buckets: Buckets, num_top_logprobs: int, batch_type, num_state_rows=None,
                 snapshots_per_step=lambda t, n: 0, drafter=None, verify_row=None):
        """`num_state_rows`: rows of the cache's state arrays (default `num_slots`; more
        hold prefix-cache snapshots and verify states); `snapshots_per_step(T, N)`: GDN
        snapshots a prefill bucket emits; `drafter` (speculative decoding): its k
        drafts are verified in the step after them, whose programs return k + 1 logits
        rows a sequence (a decode bucket of N sequences holds N (k + 1) tokens and
        keeps the GDN state after each but a sequence's last in row `verify_row(slot,
        r)`), and every program returns its hidden states for the draft program."""
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        self.cache = cache
        self.mesh = mesh_of(jax.tree.leaves(cache)[0])
        rep = None if self.mesh is None else replicated(self.mesh)
        fwd_s, smp_s = {}, {}
        if self.mesh is not None:
            cache_s = jax.tree.map(lambda a: a.sharding, cache)
            fwd_s = dict(in_shardings=([a.sharding for a in self._leaves], cache_s, rep, rep,
                                       rep, rep),
                         out_shardings=(cache_s, rep) + ((rep,) * 4 if drafter else ()))
            smp_s = dict(in_shardings=(rep,) * 8, out_shardings=(rep, rep, rep))
        self.last_token = jnp.zeros((num_slots,), jnp.int32, device=rep)
        self.drafter = drafter
        self.k = drafter.k if drafter else 0
        # the draft buffer of a drafter, else a stand-in the programs never read; each
        # slot's last verdict (accepted, drafts made): `drafter.follow` reads them
        self._no_drafts = jnp.zeros((1, 1), jnp.int32, device=rep)
        self.verdicts = jnp.zeros((2, num_slots if drafter else 1), jnp.int32, device=rep)
        self.verify_row = verify_row
        self.num_slots = num_slots
        self.num_state_rows = num_slots if num_state_rows is None else num_state_rows
        self.snapshots_per_step = snapshots_per_step
        self.max_blocks_per_seq = max_blocks_per_seq
        self.buckets = buckets
        self._fn = jax.jit(partial(_forward, graphdef, treedef, batch_type, self.k),
                           static_argnums=6, donate_argnums=1, **fwd_s)
        self._sample_fn = jax.jit(partial(_sample, num_top_logprobs, self.k), static_argnums=8,
                                  donate_argnums=(1, 2), **smp_s)
        self._programs = {}  # (is_decode, T, N) -> compiled forward pass
        self.rewrites_whole_cache = False  # a program rewrites a whole cache array
        self._samplers = {}  # (N, SamplerMode) -> compiled sampler
        self._addresses = None

    # ---- start-up -------------------------------------------------------

    def warmup(self, compile_threads: int = 8, progress: bool = True) -> float:
        """Compile every bucket, then run each once on an all-padding batch;
        returns seconds. `progress`: a bar on stderr over the programs, each named
        by its bucket as it is lowered and compiled."""
        t0 = time.perf_counter()
        shapes = [self.shape(d, t, n) for d, t, n in self.buckets.all_shapes()]
        rows = sorted({self.rows(n) for _, _, n in shapes})
        samplers = [(n, mode) for n in rows for mode in SAMPLER_MODES]
        names = [f"{'decode' if d else 'prefill'} T={t} N={n}" for d, t, n in shapes]
        names += [f"sampler N={n} {_mode_name(mode)}" for n, mode in samplers]
        bar = tqdm(total=2 * len(names), desc="compiling step programs", unit="step",
                   disable=not progress, leave=False)
        lowered = []
        for shape, name in zip(shapes, names):
            bar.set_postfix_str(f"lowering {name}")
            lowered.append(self._lower(*shape))
            bar.update()
        row = lowered[0].out_info[1]  # logits [N, vocab]: only N differs between buckets
        for (n, mode), name in zip(samplers, names[len(shapes):]):
            bar.set_postfix_str(f"lowering {name}")
            lowered.append(self._lower_sampler(mode, jax.ShapeDtypeStruct((n, row.shape[1]),
                                                                          row.dtype)))
            bar.update()
        programs = [None] * len(lowered)
        if self.drafter is not None:  # one draft program a bucket, beside the forward's
            hidden = {(t, n): lo.out_info[2] for (_, t, n), lo in zip(shapes, lowered)}
            for (t, n), h in hidden.items():
                self.drafter.compile(self.cache.kv, h, self._empty(t, n))
        with ThreadPoolExecutor(compile_threads) as pool:
            done = {pool.submit(lo.compile): i for i, lo in enumerate(lowered)}
            for future in as_completed(done):
                i = done[future]
                programs[i] = future.result()
                bar.set_postfix_str(f"compiled {names[i]}")
                bar.update()
        bar.close()
        self._programs = dict(zip(shapes, programs))
        drafts = self.drafter.programs() if self.drafter is not None else []
        self.rewrites_whole_cache = any(rewrites_whole_cache(p.as_text(), self.cache)
                                        for p in programs[:len(shapes)] + drafts)
        self._samplers = dict(zip(samplers, programs[len(shapes):]))
        logits = {}  # L -> the logits of one padding step with L rows
        for is_decode, t, n in shapes:
            self.cache, logits[self.rows(n)], *_ = self._programs[is_decode, t, n](
                self._leaves, self.cache, self.last_token, self._drafts(), self.verdicts,
                self._empty(t, n, is_decode))
        for n, mode in samplers:
            out = self._run_sampler(self._empty(1, n // (self.k + 1)), mode, logits[n])
        jax.block_until_ready(out)
        self._addresses = self.addresses()
        return time.perf_counter() - t0

    def _lower(self, is_decode: bool, t: int, n: int):
        with jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext():
            return self._fn.lower(self._leaves, self.cache, self.last_token, self._drafts(),
                                  self.verdicts, self._empty(t, n, is_decode), is_decode)

    def _lower_sampler(self, mode, logits: jax.ShapeDtypeStruct):
        x = self._empty(1, logits.shape[0] // (self.k + 1))  # rows: k + 1 a sequence
        with jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext():
            return self._sample_fn.lower(logits, self.last_token, self.verdicts, x.sampling,
                                         x.sample_slot, x.verify_index, x.draft_room,
                                         np.zeros_like(x.draft_room), mode)

    def rows(self, n: int) -> int:
        """Logits rows of a bucket of `n` sequences: k + 1 a sequence in a speculative
        engine (a sequence's last token and its drafts), else one."""
        return n * (self.k + 1)

    def shape(self, is_decode: bool, t: int, n: int) -> tuple[bool, int, int]:
        """The program of bucket (is_decode, T, N): a decode bucket holds k + 1 tokens a
        sequence (its last token and its drafts)."""
        return is_decode, n * (self.k + 1) if is_decode else t, n

    def _drafts(self):
        return self.drafter.drafts if self.drafter is not None else self._no_drafts

    def addresses(self) -> list[int]:
        arrays = jax.tree.leaves((self.cache, self.last_token))
        return [s.data.unsafe_buffer_pointer() for a in arrays for s in a.addressable_shards]

    def swap_cache(self, cache) -> None:
        """Run the same compiled programs on another cache of identical shapes and dtypes
        (bench/decode_step.py compares cache memory kinds this way). Only between steps."""
        old = jax.tree.map(lambda x: (x.shape, x.dtype), self.cache)
        new = jax.tree.map(lambda x: (x.shape, x.dtype), cache)
        if old != new:
            raise ValueError(f"cache of {new} for programs compiled for {old}")
        self.cache = cache
        self._addresses = self.addresses()

    def check_addresses(self) -> None:
        """Raise if a donated buffer moved (the in-place update was not honoured).
        Call only when no step is in flight: it waits for the buffers."""
        now = self.addresses()
        if self._addresses is not None and now != self._addresses:
            raise RuntimeError("cache buffers moved: donation was not applied in place")

    # ---- one step -------------------------------------------------------

    def _empty(self, t: int, n: int, is_decode: bool = True) -> StepInputs:
        s = n * self.k if is_decode else self.snapshots_per_step(t, n)  # decode: verify states
        rows = self.rows(n)
        return StepInputs(
            tokens=np.zeros(t, np.int32), from_slot=np.full(t, -1, np.int32),
            from_draft=np.full(t, -1, np.int32),
            cu_seqlens=np.zeros(n + 1, np.int32), start_pos=np.zeros(n, np.int32),
            slots=np.full(n, self.num_state_rows, np.int32),
            init_slots=np.full(n, self.num_state_rows, np.int32),
            block_tables=np.zeros((n, self.max_blocks_per_seq), np.int32),
            logits_indices=np.zeros(rows, np.int32),
            sample_slot=np.full(rows, self.num_slots, np.int32),
            snapshot_ends=np.zeros(s, np.int32),
            snapshot_slots=np.full(s, self.num_state_rows, np.int32),
            sampling=SamplingArrays.host(rows), verify_index=np.full(rows, -1, np.int32),
            draft_room=np.zeros(n, np.int32), after=np.full(n, -1, np.int32),
            follows=np.zeros(n, np.int32), resume_rows=np.zeros((n, self.k + 1), np.int32))

    def prepare(self, sched: SchedulerOutput) -> StepInputs:
        """The step's inputs. A sequence with drafts feeds its last token, then its drafts
        read from the draft buffer, and gets a logits row for each (row i * (k + 1) + r of
        sequence i); any other gets one row, its last token's."""
        _, t, n = self.shape(sched.is_decode,
                             *self.buckets.pick(sched.is_decode, sched.num_tokens, len(sched.seqs)))
        x = self._empty(t, n, sched.is_decode)
        per_seq = self.rows(1)
        pos = snap = 0
        for i, s in enumerate(sched.seqs):
            req = s.request
            stop = min(s.start + s.num_tokens - s.num_drafts, req.num_known_tokens)
            x.tokens[pos:pos + stop - s.start] = req.token_slice(s.start, stop)
            if stop < s.start + s.num_tokens - s.num_drafts:  # the one token still in flight
                x.from_slot[pos + stop - s.start] = req.slot
            first = pos + s.num_tokens - s.num_drafts  # packed index of the first draft
            if self.k:
                self._verify(x, i, s, first, first - pos)
            if s.draft_tokens is not None:
                x.tokens[first:first + s.num_drafts] = s.draft_tokens
            else:
                x.from_draft[first:first + s.num_drafts] = (req.slot * self.k
                                                            + np.arange(s.num_drafts))
            pos += s.num_tokens
            x.cu_seqlens[i + 1] = pos
            x.start_pos[i] = s.start
            x.slots[i] = req.slot
            x.init_slots[i] = req.slot if s.restore is None else s.restore
            for position, row in s.snapshots:
                x.snapshot_ends[snap] = pos - s.num_tokens + position - s.start
                x.snapshot_slots[snap] = row
                snap += 1
            x.block_tables[i, :len(req.block_ids)] = req.block_ids
            for r in range(s.num_drafts + 1):
                row = i * per_seq + r
                x.logits_indices[row] = first - 1 + r
                if s.sample:
                    p = req.params
                    x.sample_slot[row] = req.slot if r == 0 else self.num_slots
                    x.sampling.temperature[row] = p.temperature
                    x.sampling.top_k[row] = p.top_k
                    x.sampling.top_p[row] = p.top_p
                    x.sampling.min_p[row] = p.min_p
                    x.sampling.seed[row] = req.seed
                    x.sampling.logprobs[row] = p.logprobs is not None
                    x.sampling.position[row] = s.start + s.num_tokens - s.num_drafts + r
        x.cu_seqlens[len(sched.seqs) + 1:] = pos
        return x

    def _verify(self, x: StepInputs, i: int, s, first: int, own: int) -> None:
        """Sequence `i`'s inputs of the verdict and the draft program, `s` having fed `own`
        tokens that are no drafts, then its drafts from packed index `first` (drafter.py)."""
        row = i * self.rows(1)
        x.verify_index[row:row + s.num_drafts] = first + np.arange(s.num_drafts)
        last = s.start + own - 1  # the position of the last of them
        if s.sample:
            x.draft_room[i] = len(s.request.block_ids) * self.drafter.block_size - last
        else:
            x.after[i] = s.request.token_slice(last + 1, last + 2)[0]
        if s.follows is not None:
            x.follows[i] = 1
            slot = s.request.slot
            x.resume_rows[i] = [self.verify_row(slot, a) if a < s.follows else slot
                                for a in range(self.k + 1)]

    def run(self, x: StepInputs, is_decode: bool) -> SampleResult:
        """Dispatch one step (forward pass, sampler, and a drafter's draft program); returns
        the sampler's device arrays without waiting."""
        key = (is_decode, len(x.tokens), len(x.start_pos))
        if key not in self._programs:  # outside the buckets: the compile guard reports it
            self._programs[key] = self._lower(*key).compile()
        self.cache, logits, *extra = self._programs[key](self._leaves, self.cache,
                                                         self.last_token, self._drafts(),
                                                         self.verdicts, x)
        if not extra:
            return self._run_sampler(x, x.sampling.mode(), logits)
        hidden, fed, drafted, delta = extra  # a speculative engine's: the draft program follows
        out = self._run_sampler(x, x.sampling.mode(), logits, drafted, delta)
        kv = self.drafter.run(self.cache.kv, hidden, fed, delta, out, x)
        self.cache = self.cache.replace(kv=kv)
        return out

    def _run_sampler(self, x: StepInputs, mode, logits, drafted=None, delta=None) -> SampleResult:
        key = (len(x.logits_indices), mode)
        if key not in self._samplers:
            aval = jax.ShapeDtypeStruct(logits.shape, logits.dtype)
            self._samplers[key] = self._lower_sampler(mode, aval).compile()
        drafted = x.verify_index if drafted is None else drafted  # all -1 without drafts
        delta = np.zeros_like(x.draft_room) if delta is None else delta
        self.last_token, self.verdicts, out = self._samplers[key](
            logits, self.last_token, self.verdicts, x.sampling, x.sample_slot, drafted,
            x.draft_room, delta)
        return out


def _mode_name(mode) -> str:
    name = ("draw+filter" if mode.filter else "draw") if mode.draw else "greedy"
    return name + ("+logprobs" if mode.logprobs else "")


def rewrites_whole_cache(hlo: str, cache) -> bool:
    """Whether a compiled program writes a cache array's every row, not only the rows it
    updates: it holds a float32 value of a 16-bit cache array's whole (per-shard) shape
    (an update XLA lowered as convert-update-convert over the entire array, as its CPU
    backend does for bfloat16), or copies a whole cache array (an update XLA did not do
    in place: it copies the array out, uses its memory as scratch, and copies it back).
    Readers and writers outside the step stream (NIXL) then see garbage while such a
    program runs."""
    names = {np.dtype(np.float32): "f32", np.dtype(jnp.bfloat16): "bf16",
             np.dtype(np.float16): "f16"}
    for a in jax.tree.leaves(cache):
        dims = ",".join(map(str, a.sharding.shard_shape(a.shape)))
        if a.dtype.itemsize == 2 and f"f32[{dims}]" in hlo:
            return True
        if re.search(rf"= {names.get(np.dtype(a.dtype), '?')}\[{dims}\]\S* copy\(", hlo):
            return True
    return False
