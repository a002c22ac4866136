"""MTP drafting: the program a speculative engine runs after each step, and the host side
of a verify step (which drafts are kept, what the next draft program runs over).

The MTP head (``qwen35_jax.mtp``) at position ``t`` reads the target's normalised hidden
state after token ``t`` and the embedding of token ``t+1``, writes its own KV at ``t``
and predicts token ``t+2``. After a step, once the host knows which tokens it kept,
the draft program runs the head over every position of the step whose next token is
now known (a prompt chunk's positions; a verify step's accepted positions, the last
one with the token sampled after it), reading the step's hidden states. From each
decoding sequence's last such position it drafts k tokens: the first from the head's
output there, each further one from the head at the next position, fed the previous
draft and the head's own output in place of the target's hidden state (as vLLM's MTP
proposer does). Drafts are greedy (argmax), and land in a per-slot buffer on the
device that the next verify step reads its tokens from.

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

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax.batch import Batch, StepMeta, step_meta
from qwen35_jax.sharding import param_shardings, replicated
from serving.engine.request import Status


@jax.tree_util.register_dataclass
@dataclass
class DraftInputs:
    """Host-built inputs of one draft program, in the target step's bucket (T, N)."""
    rows: np.ndarray  # i32 [T]: the target step's hidden row of each head position
    tokens: np.ndarray  # i32 [T]: the token after each position
    cu_seqlens: np.ndarray  # i32 [N+1]
    start_pos: np.ndarray  # i32 [N]: position of each sequence's first head token
    block_tables: np.ndarray  # i32 [N, M]
    num_drafts: np.ndarray  # i32 [N]: drafts to make (0: none)
    slot: np.ndarray  # i32 [N]: row of the draft buffer (num_slots: nowhere)


def _draft(graphdef, treedef, mtp_graphdef, mtp_treedef, num_blocks, block_size, k,
           leaves, mtp_leaves, kv, drafts, hidden, x: DraftInputs):
    """(kv, drafts): the head's KV written at the step's known positions, the drafts."""
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
    return kv, drafts.at[x.slot].set(jnp.stack(made, axis=1), mode="drop")


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
    decides which drafts a verify step keeps (`accept`), builds the next draft program's
    inputs (`inputs`) and counts as vLLM's ``vllm:spec_decode_*`` metrics do."""

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
                                       kv_sharding, rep, rep, rep),
                         out_shardings=(kv_sharding, rep))
        self.k, self.num_slots = k, num_slots
        self.drafts = jnp.zeros((num_slots, k), jnp.int32, device=rep)
        self._fn = jax.jit(partial(_draft, graphdef, treedef, mtp_graphdef, mtp_treedef,
                                   num_blocks, block_size, k), donate_argnums=(2, 3), **jit_s)
        self._programs = {}
        # verified draft runs, their drafts, the accepted ones, those accepted at each position
        self._counts = {"spec_decode_num_drafts": 0, "spec_decode_num_draft_tokens": 0,
                        "spec_decode_num_accepted_tokens": 0}
        self._accepted_per_position = [0] * k

    def counters(self) -> dict:
        """The ``spec_decode_*`` counters, as `Engine.metrics` reports them."""
        return {**self._counts,
                "spec_decode_num_accepted_tokens_per_pos": list(self._accepted_per_position)}

    def accept(self, req, s, drawn, drafts, verify_row) -> int:
        """The drafts of scheduled sequence `s` kept: the leading ones that equal the token
        drawn before each (serving/engine/engine.py says why that keeps the target
        distribution). Rewinds `req` to the state after them; `verify_row(slot, r)` is the
        state row after the (r + 1)-th token the verify step fed."""
        n = 0
        while n < s.num_drafts and drawn[n] == drafts[n]:
            self._accepted_per_position[n] += 1
            n += 1
        req.num_computed_tokens = s.start + 1 + n
        req.verify_state = verify_row(req.slot, n) if n < s.num_drafts else None
        c = self._counts
        c["spec_decode_num_drafts"] += 1
        c["spec_decode_num_draft_tokens"] += s.num_drafts
        c["spec_decode_num_accepted_tokens"] += n
        return n

    def inputs(self, sched, x, accepted: list[int], live: list[bool], block_size: int
               ) -> DraftInputs | None:
        """The draft program's inputs after step `sched` (inputs `x`, `accepted` drafts a
        sequence): the step's positions whose next token is now known, for its `live`
        sequences (requests still running, and held ones it finished: a prefill worker's
        drafts after the first token); those whose step reached their last known token get
        drafts (as many as their blocks hold), and each request's `num_drafts` is set to
        what it gets. None if no position is known."""
        d = self.empty(len(x.tokens), len(x.start_pos), x.block_tables.shape[1])
        pos = 0
        for i, s in enumerate(sched.seqs):
            req = s.request
            d.cu_seqlens[i + 1] = pos
            if not live[i] or (not req.is_finished and req.status is not Status.RUNNING):
                continue
            fed = s.num_tokens - s.num_drafts + accepted[i]
            m = min(fed, req.num_known_tokens - 1 - s.start)
            d.rows[pos:pos + m] = x.cu_seqlens[i] + np.arange(m)
            d.tokens[pos:pos + m] = req.token_slice(s.start + 1, s.start + 1 + m)
            pos += m
            d.cu_seqlens[i + 1] = pos
            d.start_pos[i] = s.start
            d.block_tables[i] = x.block_tables[i]
            req.num_drafts = 0
            if s.sample and m > 0:
                last = s.start + m - 1  # the head's last position: drafts go after it
                req.num_drafts = min(self.k, len(req.block_ids) * block_size - last)
                d.num_drafts[i] = req.num_drafts
                d.slot[i] = req.slot
        d.cu_seqlens[len(sched.seqs) + 1:] = pos
        return d if pos else None

    def compile(self, t: int, n: int, max_blocks: int, kv, hidden) -> None:
        """Compile the program of bucket (T, N) for a KV pool like `kv` and hidden states
        like `hidden`."""
        x = self.empty(t, n, max_blocks)
        with jax.set_mesh(self.mesh) if self.mesh is not None else nullcontext():
            lowered = self._fn.lower(self._leaves, self._mtp_leaves, kv, self.drafts, hidden, x)
        self._programs[t, n] = lowered.compile()

    def empty(self, t: int, n: int, max_blocks: int) -> DraftInputs:
        """All padding: no head token, no draft."""
        return DraftInputs(rows=np.zeros(t, np.int32), tokens=np.zeros(t, np.int32),
                           cu_seqlens=np.zeros(n + 1, np.int32), start_pos=np.zeros(n, np.int32),
                           block_tables=np.zeros((n, max_blocks), np.int32),
                           num_drafts=np.zeros(n, np.int32),
                           slot=np.full(n, self.num_slots, np.int32))

    def programs(self) -> list:
        """The compiled draft programs (one a target bucket)."""
        return list(self._programs.values())

    def run(self, kv, hidden, x: DraftInputs):
        """Dispatch the draft program on the KV pool `kv` (donated); returns the pool
        and the draft buffer (device arrays) without waiting."""
        key = (len(x.rows), len(x.start_pos))
        if key not in self._programs:
            self.compile(*key, x.block_tables.shape[1], kv, hidden)
        kv, self.drafts = self._programs[key](self._leaves, self._mtp_leaves, kv,
                                              self.drafts, hidden, x)
        return kv, self.drafts
