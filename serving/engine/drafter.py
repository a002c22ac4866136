"""MTP drafting: the program a speculative engine runs after each step, and what a verify
step decides: on the device, which drafts are kept and where the next step and the next
draft program start (`verdict`, `keep`, `follow`, `head_inputs`); on the host, the
counts it applies a step later (`Drafter.accept`).

The MTP head (``qwen35_jax.mtp``) at position ``t`` reads the target's normalised hidden
state after token ``t`` and the embedding of token ``t+1``, writes its own KV at ``t``
and predicts token ``t+2``. Right after each step's sampler, with no wait for the host,
the draft program runs the head over every position of the step whose next token is
now known (a prompt chunk's positions; a verify step's accepted positions, the last
one with the token sampled after it), reading the step's hidden states. What the step
kept is decided on the device: the sampler program counts each sequence's accepted
drafts and the drafts it gets next (`verdict`), the draft program derives its inputs
from those counts (`head_inputs`), and the host reads the same counts with the tokens,
a step later (the engine runs ahead: the next step moves by them on the device).
From each decoding sequence's last such position it drafts k tokens: the first from
the head's output there, each further one from the head at the next position, fed the
previous draft and the head's own output in place of the target's hidden state (as
vLLM's MTP proposer does). Drafts are greedy (argmax), and land in a per-slot buffer on
the device that the next verify step reads its tokens from.

The head also runs over sequences the host then finds finished (a stop token among the
accepted ones, or a stale output): it writes only inside their blocks, which the step
fence keeps theirs until the draft program has completed, and their drafts are never read.

The head's KV is the layer after the model's in the hybrid cache's KV pool
(``qwen35_jax.cache``): it lives in the request's blocks, so it is cached with a prefix
and moves with a transfer. A draft position the sequence holds no block for yet is not
drafted (a sequence gets fewer drafts that step): the head never writes outside a
sequence's blocks. Its KV at positions the next verify step rejects is rewritten by the
next draft program, as the target's KV is by the next step.
"""

from __future__ import annotations

from contextlib import nullcontext
from dataclasses import dataclass
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax.batch import Batch, StepMeta, step_meta
from qwen35_jax.sharding import param_shardings, replicated


class DraftInputs(NamedTuple):
    """The inputs of one draft program's head, in the target step's bucket (T, N),
    derived on the device (`head_inputs`)."""
    rows: jax.Array  # i32 [T]: the target step's hidden row of each head position
    tokens: jax.Array  # i32 [T]: the token after each position
    cu_seqlens: jax.Array  # i32 [N+1]
    start_pos: jax.Array  # i32 [N]: position of each sequence's first head token
    block_tables: jax.Array  # i32 [N, M]
    num_drafts: jax.Array  # i32 [N]: drafts to make (0: none)
    slot: jax.Array  # i32 [N]: row of the draft buffer (num_slots: nowhere)


class DraftSource(NamedTuple):
    """What the draft program reads of a step's inputs (``runner.StepInputs``)."""
    cu_seqlens: np.ndarray
    start_pos: np.ndarray
    slots: np.ndarray
    block_tables: np.ndarray
    verify_index: np.ndarray
    after: np.ndarray

    @classmethod
    def of(cls, x) -> "DraftSource":
        return cls(*(getattr(x, f) for f in cls._fields))


@jax.tree_util.register_dataclass
@dataclass
class Verdict:
    """What a step with drafts kept, i32 [N] each (`verdict`)."""
    accepted: jax.Array  # the drafts kept
    num_drafts: jax.Array  # the drafts its draft program makes next
    verified: jax.Array  # the drafts it verified (fed drafts the last draft program made)


def verdict(drawn, drafted, draft_room, k: int) -> Verdict:
    """The drafts of each sequence the step keeps, the leading ones equal to the token
    drawn before each (serving/engine/engine.py says why that keeps the target
    distribution), and the drafts it gets next, as many as its blocks hold after its last
    kept position, at most k. `drawn` [N (k + 1)]: the step's tokens, k + 1 rows a
    sequence; `drafted` [N (k + 1)]: the draft each row verifies (-1: none); `draft_room`
    [N]: positions the sequence's blocks hold from its last fed token that is no draft
    (0: it gets no drafts)."""
    n = draft_room.shape[0]
    match = (drawn == drafted).reshape(n, k + 1)[:, :k].astype(jnp.int32)
    accepted = jnp.sum(jnp.cumprod(match, axis=1), axis=1)
    return Verdict(accepted, jnp.clip(jnp.minimum(k, draft_room - accepted), 0),
                   jnp.sum(drafted.reshape(n, k + 1) >= 0, axis=1))


def keep(drawn, v: Verdict, sample_slot, last_token, verdicts, k: int):
    """(last_token, verdicts): each sampling sequence's `verdict` and the token the next
    step feeds it (the first drawn one that is no accepted draft), kept by slot; a
    sequence's first logits row names its slot (`sample_slot` [N (k + 1)])."""
    n = v.accepted.shape[0]
    slot = sample_slot.reshape(n, k + 1)[:, 0]
    kept = drawn.reshape(n, k + 1)[jnp.arange(n), v.accepted]
    verdicts = verdicts.at[:, slot].set(jnp.stack([v.accepted, v.num_drafts]), mode="drop")
    return last_token.at[slot].set(kept, mode="drop"), verdicts


def follow(x, verdicts, k: int):
    """(delta, made, init_slots), i32 [N], from the step's inputs `x` (runner.StepInputs)
    and the verdicts `keep` stored: for a sequence that continues a step in flight (the
    host schedules it from that step's first token, as if it accepted nothing), the drafts
    that step accepted, by which its start moves, the drafts its draft program made, which
    this step verifies (those it feeds past them are not drafts), and the state row after
    its accepted ones (`x.resume_rows` by accepted count); 0, k and `x.init_slots` for any
    other."""
    slot = jnp.clip(x.slots, 0, verdicts.shape[1] - 1)
    follows = x.follows > 0
    delta = jnp.where(follows, verdicts[0, slot], 0)
    resumed = jnp.take_along_axis(x.resume_rows, delta[:, None], axis=1)[:, 0]
    return (delta, jnp.where(follows, verdicts[1, slot], k),
            jnp.where(follows, resumed, x.init_slots))


def verified_drafts(fed, verify_index, made, k: int):
    """i32 [N (k + 1)]: the draft token each logits row verifies, -1 where it verifies
    none (no draft there, or one past the `made` [N] drafts the last draft program made)."""
    r = jnp.arange(verify_index.shape[0]) % (k + 1)
    real = (verify_index >= 0) & (r < jnp.repeat(made, k + 1))
    return jnp.where(real, fed[jnp.maximum(verify_index, 0)], -1)


def head_inputs(x: DraftSource, fed, drawn, accepted, num_drafts, k: int, num_slots: int
                ) -> DraftInputs:
    """The draft program's inputs, on the device, from the step's inputs `x`, its fed
    tokens [T], drawn tokens and `verdict`: each
    sequence's positions whose next token is known (its fed tokens that are no drafts,
    then the accepted ones), the token after each (the next fed one, then the drawn ones;
    after a chunk that samples nothing, the host's `x.after`), and drafts where
    `num_drafts` says."""
    n, t = x.start_pos.shape[0], fed.shape[0]
    lens = x.cu_seqlens[1:] - x.cu_seqlens[:-1]
    own = lens - jnp.sum(x.verify_index.reshape(n, k + 1) >= 0, axis=1)  # fed, not drafts
    cu = jnp.concatenate([jnp.zeros(1, jnp.int32), jnp.cumsum(own + accepted)]).astype(jnp.int32)
    p = jnp.arange(t, dtype=jnp.int32)
    i = jnp.clip(jnp.searchsorted(cu, p, side="right") - 1, 0, n - 1)
    j = p - cu[i]  # position in the sequence's chunk
    row = x.cu_seqlens[i] + j
    drawn_j = drawn[i * (k + 1) + jnp.clip(j - own[i] + 1, 0, k)]
    token = jnp.where(j < own[i] - 1, fed[jnp.minimum(row + 1, t - 1)],
                      jnp.where(x.after[i] >= 0, x.after[i], drawn_j))
    valid = p < cu[n]
    return DraftInputs(rows=jnp.where(valid, row, 0), tokens=jnp.where(valid, token, 0),
                       cu_seqlens=cu, start_pos=x.start_pos, block_tables=x.block_tables,
                       num_drafts=num_drafts,
                       slot=jnp.where(num_drafts > 0, x.slots, num_slots).astype(jnp.int32))


def _draft(graphdef, treedef, mtp_graphdef, mtp_treedef, num_blocks, block_size, k, num_slots,
           leaves, mtp_leaves, kv, drafts, hidden, fed, delta, drawn, v: Verdict, step):
    """(kv, drafts, done): the head's KV written at the step's known positions, the drafts,
    and a small array of its own the step fence polls (the others are donated onward).
    ``delta``: how far each sequence moved on the device (`follow`)."""
    step = step._replace(start_pos=step.start_pos + delta)
    x = head_inputs(step, fed, drawn, v.accepted, v.num_drafts, k, num_slots)
    model = nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))
    mtp = nnx.merge(mtp_graphdef, jax.tree.unflatten(mtp_treedef, mtp_leaves))
    n = x.start_pos.shape[0]
    zeros = jnp.zeros((n,), jnp.int32)
    batch = Batch(tokens=x.tokens, cu_seqlens=x.cu_seqlens, start_pos=x.start_pos, slots=zeros,
                  block_tables=x.block_tables, logits_indices=zeros)
    meta = step_meta(batch, num_blocks=num_blocks, block_size=block_size)
    layer = model.config.num_groups  # the head's KV layer, after the model's
    out, kv = mtp(hidden[x.rows], model.embed_tokens(x.tokens), kv, meta, layer)
    last = jnp.maximum(x.cu_seqlens[1:] - 1, 0)
    h = out[last]
    token = jnp.argmax(model.head(h), axis=-1).astype(jnp.int32)
    position = x.start_pos + x.cu_seqlens[1:] - x.cu_seqlens[:-1]  # of the draft's input
    made = [token]
    num_drafts, block_tables = x.num_drafts, x.block_tables
    if n == 1:
        # A one-row KV write is a dynamic-update-slice, which XLA fuses into the attention's
        # gather and then copies the whole pool out and back to keep the unwritten pool
        # alive, using the pool's memory as scratch meanwhile (seen on CPU): a transfer
        # reading or landing in the pool then sees garbage. A second row, never written
        # (no drafts), keeps the write a scatter, updated in place.
        pad = lambda a: jnp.concatenate([a, jnp.zeros_like(a)])
        h, token, position = pad(h), pad(token), pad(position)
        num_drafts, block_tables = pad(num_drafts), pad(block_tables)
    for i in range(1, k):
        valid = num_drafts > i
        h, kv = mtp(h, model.embed_tokens(token), kv,
                    _decode_meta(position + i - 1, valid, block_tables, num_blocks, block_size),
                    layer)
        token = jnp.argmax(model.head(h), axis=-1).astype(jnp.int32)
        made.append(token[:n])
    return kv, drafts.at[x.slot].set(jnp.stack(made, axis=1), mode="drop"), made[-1]


def _decode_meta(positions, valid, block_tables, num_blocks, block_size) -> StepMeta:
    """One head token per sequence at `positions`; a sequence not `valid` writes nothing."""
    n = positions.shape[0]
    seq = jnp.arange(n, dtype=jnp.int32)
    blk = jnp.take_along_axis(block_tables, (positions // block_size)[:, None], 1)[:, 0]
    return StepMeta(positions=positions, seq_ids=seq,
                    kv_block_ids=jnp.where(valid, blk, num_blocks),
                    kv_offsets=positions % block_size, block_tables=block_tables,
                    cu_seqlens=jnp.arange(n + 1, dtype=jnp.int32), slots=seq, init_slots=seq,
                    has_state=valid, snapshot_ends=None, snapshot_slots=None, is_decode=True)


class Drafter:
    """The MTP head and the per-slot buffer of drafts; compiles one draft program per
    target bucket, which updates the cache's KV pool in place (donated). On the host it
    applies what a verify step kept (`accept`) and counts as vLLM's
    ``vllm:spec_decode_*`` metrics do."""

    def __init__(self, model, mtp, *, k: int, num_blocks: int, block_size: int,
                 num_slots: int, kv_sharding=None):
        """``kv_sharding``: the KV pool's, when the cache lies on a mesh; the head's
        parameters are then placed by the model's table (qwen35_jax.sharding) and the
        programs compiled with every sharding fixed, as the runner's are."""
        self.mesh = None if kv_sharding is None else kv_sharding.mesh
        rep, jit_s = None, {}
        if self.mesh is not None:
            state = nnx.state(mtp)
            nnx.update(mtp, jax.device_put(state, param_shardings(model.config, state,
                                                                  self.mesh)))
            rep = replicated(self.mesh)
        graphdef, state = nnx.split(model)
        self._leaves, treedef = jax.tree.flatten(state)
        mtp_graphdef, mtp_state = nnx.split(mtp)
        self._mtp_leaves, mtp_treedef = jax.tree.flatten(mtp_state)
        if self.mesh is not None:
            jit_s = dict(in_shardings=([a.sharding for a in self._leaves],
                                       [a.sharding for a in self._mtp_leaves],
                                       kv_sharding, rep, rep, rep, rep, rep, rep, rep),
                         out_shardings=(kv_sharding, rep, rep))
        self.k, self.num_slots, self.block_size = k, num_slots, block_size
        self.drafts = jnp.zeros((num_slots, k), jnp.int32, device=rep)
        self._fn = jax.jit(partial(_draft, graphdef, treedef, mtp_graphdef, mtp_treedef,
                                   num_blocks, block_size, k, num_slots),
                           donate_argnums=(2, 3), **jit_s)
        self._programs = {}
        # verified draft runs, their drafts, the accepted ones, those accepted at each position
        self._counts = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                        "spec_decode_num_accepted_tokens": 0}
        self._accepted_per_position = [0] * k

    def counters(self) -> dict:
        """The ``spec_decode_*`` counters, as `Engine.metrics` reports them."""
        return {**self._counts,
                "spec_decode_num_accepted_tokens_per_pos": list(self._accepted_per_position)}

    def accept(self, req, s, accepted: int, verified: int, verify_row) -> None:
        """Apply the `verdict` of scheduled sequence `s` to `req`: its `accepted` drafts (of
        `verified`) are computed tokens, and its state is the one after them;
        `verify_row(slot, r)` is the state row after the (r + 1)-th token the step fed."""
        for n in range(accepted):
            self._accepted_per_position[n] += 1
        req.num_computed_tokens += accepted
        req.verify_state = verify_row(req.slot, accepted) if accepted < s.num_drafts else None
        c = self._counts
        c["spec_decode_num_drafts"] += 1
        c["spec_decode_num_draft_tokens"] += verified
        c["spec_decode_num_accepted_tokens"] += accepted

    def compile(self, kv, hidden, step) -> None:
        """Compile the program of the bucket of `step` (``runner.StepInputs``) for a KV
        pool like `kv` and hidden states like `hidden`."""
        args = self._args(kv, hidden, step)
        with jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext():
            lowered = self._fn.lower(*args)
        self._programs[_key(step)] = lowered.compile()

    def programs(self) -> list:
        """The compiled draft programs (one a target bucket)."""
        return list(self._programs.values())

    def run(self, kv, hidden, fed, delta, sampled, step):
        """Dispatch the draft program of a step (inputs `step`, fed tokens `fed`, moves
        `delta`, sampler result `sampled` with its verdict) on the KV pool `kv` (donated);
        returns the pool without waiting. The drafts land in `self.drafts`, and
        `self.done` is the marker the step fence polls."""
        key = _key(step)
        if key not in self._programs:
            self.compile(kv, hidden, step)
        kv, self.drafts, self.done = self._programs[key](
            *self._args(kv, hidden, step, fed, delta, sampled))
        return kv

    def _args(self, kv, hidden, step, fed=None, delta=None, sampled=None) -> tuple:
        if sampled is None:  # shapes only, to compile
            t, n, rows = len(step.tokens), len(step.start_pos), len(step.logits_indices)
            fed, drawn = np.zeros(t, np.int32), np.zeros(rows, np.int32)
            delta = np.zeros(n, np.int32)
            v = Verdict(delta, delta, delta)
        else:
            drawn, v = sampled.token, sampled.verdict
        return (self._leaves, self._mtp_leaves, kv, self.drafts, hidden, fed, delta, drawn, v,
                DraftSource.of(step))


def _key(step) -> tuple[int, int]:
    return len(step.tokens), len(step.start_pos)
