"""On-device sampling: a small program of its own, run after each step's forward pass.

All options are per-row arrays, so one program serves any mix of greedy and sampled
requests; what the rows need at all (a random draw, the sort behind top-k/top-p, the
top-n logprobs) is decided on the host from those arrays (`SamplingArrays.mode`) and
picks one of a few compiled variants (`SAMPLER_MODES`), so an all-greedy batch pays
for an argmax only. Not `lax.cond`: XLA's GPU runtime copies a cond's predicate to the
host and waits for it, so a cond after the forward pass held the host in the dispatch
call until the forward had run, and the next step's launch no longer overlapped the
device (35B-A3B, 128 sequences, one H200: dispatch 26.7 of a 28.8 ms step with the
conds, 5.9 of 24.7 ms without; bench/RESULTS.md, "The host waited on the sampler's
conds").

Randomness: Gumbel-max with noise from a counter-based integer hash of
(seed, token position, vocabulary index). The draw is a pure function of the
request's seed and the token's position, so a request samples the same tokens
whatever it is batched with, and after preemption and recompute it re-draws
exactly the tokens it would have drawn. The hash is a few integer ops per
logit: cheaper to run and much cheaper to compile than threefry keys.
"""

from dataclasses import dataclass
from typing import TYPE_CHECKING, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np

if TYPE_CHECKING:
    from serving.engine.drafter import Verdict


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    temperature: jax.Array  # f32 [N]; 0 = greedy
    top_k: jax.Array  # i32 [N]; <= 0 = off
    top_p: jax.Array  # f32 [N]; 1 = off
    min_p: jax.Array  # f32 [N]; 0 = off
    seed: jax.Array  # u32 [N]
    position: jax.Array  # i32 [N]; position of the token being sampled
    logprobs: jax.Array  # bool [N]; the row wants logprobs (read on the host: `mode`)

    def mode(self) -> "SamplerMode":
        """Which sampler variant these (host) rows need."""
        drawn = self.temperature > 0
        return SamplerMode(draw=bool(drawn.any()),
                           filter=bool((drawn & ((self.top_k > 0) | (self.top_p < 1))).any()),
                           logprobs=bool(self.logprobs.any()))

    @staticmethod
    def host(n: int) -> "SamplingArrays":
        """Greedy padding rows, to be filled in place on the host."""
        return SamplingArrays(np.zeros(n, np.float32), np.zeros(n, np.int32),
                              np.ones(n, np.float32), np.zeros(n, np.float32),
                              np.zeros(n, np.uint32), np.zeros(n, np.int32),
                              np.zeros(n, bool))


class SamplerMode(NamedTuple):
    """A compiled sampler variant: what at least one row of the batch needs."""
    draw: bool  # a random draw (temperature > 0)
    filter: bool  # top-k / top-p among the drawn rows (a sort over the vocabulary)
    logprobs: bool  # the sampled token's logprob and the top-n


SAMPLER_MODES = tuple(SamplerMode(d, f, lp) for d, f in ((False, False), (True, False),
                                                         (True, True))
                      for lp in (False, True))


@dataclass
class SampleResult:
    token: jax.Array  # i32 [N]
    logprob: jax.Array  # f32 [N], of the chosen token under the raw model distribution
    top_ids: jax.Array  # i32 [N, num_top]
    top_logprobs: jax.Array  # f32 [N, num_top]
    # (the last three are zeros unless the mode asked for logprobs)
    verdict: "Verdict | None" = None  # a speculative engine's (drafter.verdict)


jax.tree_util.register_dataclass(SampleResult)


def _filter_top_k_top_p(x, top_k, top_p):
    """Mask logits outside the top-k and outside the top-p nucleus (ties at the
    threshold are kept)."""
    vocab = x.shape[-1]
    xs = -jnp.sort(-x, axis=-1)  # descending
    k = jnp.where(top_k > 0, jnp.minimum(top_k, vocab), vocab)
    kth = jnp.take_along_axis(xs, (k - 1)[:, None], axis=-1)
    xs = jnp.where(jnp.arange(vocab)[None] < k[:, None], xs, -jnp.inf)
    p = jax.nn.softmax(xs, axis=-1)
    before = jnp.cumsum(p, axis=-1) - p  # mass strictly above each rank
    n_keep = jnp.maximum(jnp.sum(before < top_p[:, None], axis=-1), 1)
    pth = jnp.take_along_axis(xs, (n_keep - 1)[:, None], axis=-1)
    return jnp.where(x >= jnp.maximum(kth, pth), x, -jnp.inf)


def _mix32(x):
    """lowbias32 (C. Wellons): a fast, well-mixing 32-bit integer hash."""
    x = x ^ (x >> 16)
    x = x * jnp.uint32(0x7FEB352D)
    x = x ^ (x >> 15)
    x = x * jnp.uint32(0x846CA68B)
    return x ^ (x >> 16)


def _gumbel(seed, position, vocab: int):
    """Gumbel(0, 1) noise [N, vocab], a pure function of (seed, position, index)."""
    row = _mix32(seed.astype(jnp.uint32) * jnp.uint32(0x9E3779B9) + _mix32(position.astype(jnp.uint32)))
    bits = _mix32(_mix32(row[:, None] + jnp.arange(vocab, dtype=jnp.uint32)[None]))
    u = ((bits >> 8).astype(jnp.float32) + 0.5) * (1.0 / (1 << 24))  # in (0, 1)
    return -jnp.log(-jnp.log(u))


def _draw(logits, s: SamplingArrays, filter_: bool):
    """Temperature, top-k/top-p (only if `filter_`), min-p, then a Gumbel-max draw."""
    x = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    if filter_:
        x = _filter_top_k_top_p(x, s.top_k, s.top_p)
    prob = jax.nn.softmax(x, axis=-1)
    x = jnp.where(prob >= s.min_p[:, None] * prob.max(axis=-1, keepdims=True), x, -jnp.inf)
    return jnp.argmax(x + _gumbel(s.seed, s.position, x.shape[-1]), axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingArrays, num_top: int, mode: SamplerMode) -> SampleResult:
    """Tokens for every row (greedy where temperature is 0), under the static `mode`."""
    logits = logits.astype(jnp.float32)
    n = logits.shape[0]
    token = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    if mode.draw:
        token = jnp.where(s.temperature > 0, _draw(logits, s, mode.filter), token)
    if not mode.logprobs:
        zeros = jnp.zeros((n, num_top), jnp.float32)
        return SampleResult(token, jnp.zeros((n,), jnp.float32), zeros.astype(jnp.int32), zeros)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    top_lp, top_ids = jax.lax.top_k(logprobs, num_top) if num_top > 0 else (
        jnp.zeros((n, 0), jnp.float32), jnp.zeros((n, 0), jnp.int32))
    return SampleResult(token, chosen, top_ids.astype(jnp.int32), top_lp)
