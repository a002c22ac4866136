"""On-device sampling, traced into the step programs.

All options are per-row arrays, so one compiled program serves any mix of
greedy and sampled requests. The random draw, and inside it the sort needed by
top-k/top-p, run under `lax.cond`: an all-greedy batch pays for an argmax only.
So do the top-n logprobs, a top-k over the vocabulary, paid only when a row asks (a
radix sort of 1.7 ms, most likely this top-k, showed in every 35B-A3B decode step at 64
sequences on an H200: bench/RESULTS.md, issue 8; not timed apart).

Randomness: Gumbel-max with noise from a counter-based integer hash of
(seed, token position, vocabulary index). The draw is a pure function of the
request's seed and the token's position, so a request samples the same tokens
whatever it is batched with, and after preemption and recompute it re-draws
exactly the tokens it would have drawn. The hash is a few integer ops per
logit: cheaper to run and much cheaper to compile than threefry keys.
"""

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np


@jax.tree_util.register_dataclass
@dataclass
class SamplingArrays:
    temperature: jax.Array  # f32 [N]; 0 = greedy
    top_k: jax.Array  # i32 [N]; <= 0 = off
    top_p: jax.Array  # f32 [N]; 1 = off
    min_p: jax.Array  # f32 [N]; 0 = off
    seed: jax.Array  # u32 [N]
    position: jax.Array  # i32 [N]; position of the token being sampled
    logprobs: jax.Array  # bool [N]; the row wants its top-n logprobs

    @staticmethod
    def host(n: int) -> "SamplingArrays":
        """Greedy padding rows, to be filled in place on the host."""
        return SamplingArrays(np.zeros(n, np.float32), np.zeros(n, np.int32),
                              np.ones(n, np.float32), np.zeros(n, np.float32),
                              np.zeros(n, np.uint32), np.zeros(n, np.int32),
                              np.zeros(n, bool))


@dataclass
class SampleResult:
    token: jax.Array  # i32 [N]
    logprob: jax.Array  # f32 [N], of the chosen token under the raw model distribution
    top_ids: jax.Array  # i32 [N, num_top]
    top_logprobs: jax.Array  # f32 [N, num_top]


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


def _draw(logits, s: SamplingArrays):
    """Temperature, top-k/top-p (sorting only if some row asks), min-p, then a
    Gumbel-max draw. Skipped entirely for all-greedy batches."""
    x = logits / jnp.where(s.temperature > 0, s.temperature, 1.0)[:, None]
    needs_sort = jnp.any((s.top_k > 0) | (s.top_p < 1))
    x = jax.lax.cond(needs_sort, _filter_top_k_top_p, lambda x, k, p: x, x, s.top_k, s.top_p)
    prob = jax.nn.softmax(x, axis=-1)
    x = jnp.where(prob >= s.min_p[:, None] * prob.max(axis=-1, keepdims=True), x, -jnp.inf)
    return jnp.argmax(x + _gumbel(s.seed, s.position, x.shape[-1]), axis=-1).astype(jnp.int32)


def sample(logits: jax.Array, s: SamplingArrays, num_top: int) -> SampleResult:
    logits = logits.astype(jnp.float32)
    logprobs = jax.nn.log_softmax(logits, axis=-1)
    greedy = jnp.argmax(logits, axis=-1).astype(jnp.int32)
    sampled = s.temperature > 0
    token = jax.lax.cond(jnp.any(sampled), _draw, lambda x, s: greedy, logits, s)
    token = jnp.where(sampled, token, greedy)
    chosen = jnp.take_along_axis(logprobs, token[:, None], axis=-1)[:, 0]
    n = logits.shape[0]
    none = lambda lp: (jnp.zeros((n, num_top), jnp.float32), jnp.zeros((n, num_top), jnp.int32))
    top_lp, top_ids = (jax.lax.cond(jnp.any(s.logprobs), lambda lp: tuple(jax.lax.top_k(lp, num_top)),
                                    none, logprobs) if num_top > 0 else none(logprobs))
    return SampleResult(token, chosen, top_ids.astype(jnp.int32), top_lp)
