"""Training a Qwen3.5-architecture model and its MTP head on the arithmetic problems.

The loss is next-token cross-entropy on the answer tokens (the working, the ``####``
line and the end-of-sequence token) plus ``mtp_weight`` times the MTP head's
cross-entropy on the token after next, as DeepSeek-V3 and Qwen train their MTP heads.
The model runs under ``default_backend("reference")``: the Pallas kernels have no VJP.

Held-out accuracy is measured teacher-forced: a problem counts when the argmax at every
answer position is the answer's token, which is exactly when greedy decoding reproduces
the whole answer (every greedy step then sees the same prefix).
"""

from __future__ import annotations

import dataclasses
import random
import time

import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx

from pallas_kernels._dispatch import default_backend
from qwen35_jax.batch import step_meta
from qwen35_jax.cache import SequenceCache
from qwen35_jax.model import Qwen35ForCausalLM, rows_batch
from qwen35_jax.mtp import MTP
from qwen35_jax.train import problems

CHAT_FORMAT = "<|im_start|>user\n{q}<|im_end|>\n<|im_start|>assistant\n"


@dataclasses.dataclass
class Settings:
    steps: int = 3000
    batch: int = 256
    seq_len: int = 96
    lr: float = 2e-3
    warmup: int = 200
    weight_decay: float = 0.01
    mtp_weight: float = 0.3
    chat_fraction: float = 0.3  # share of examples framed as a chat (the /v1/chat route)
    seed: int = 0
    eval_every: int = 250
    eval_problems: int = 1024
    max_seconds: float | None = None  # stop early (and say so) past this much training time


def encode(tok, p: problems.Problem, chat: bool) -> tuple[list[int], int]:
    """(token ids of prompt + answer + end token, number of prompt ids): the prompt is
    encoded alone, as the server encodes it."""
    if chat:
        prompt, target = CHAT_FORMAT.format(q=p.question), p.reply + "<|im_end|>"
    else:
        prompt, target = p.prompt, p.completion + "<|endoftext|>"
    a = tok.encode(prompt).ids
    return a + tok.encode(target).ids, len(a)


def batch_arrays(tok, probs, chat_flags, seq_len: int):
    """Token ids [B, T] (padded with id 0) and answer weights [B, T]: weight[t] = 1 where
    token t+1 is an answer token."""
    x = np.zeros((len(probs), seq_len), np.int32)
    w = np.zeros((len(probs), seq_len), np.float32)
    for i, (p, chat) in enumerate(zip(probs, chat_flags)):
        ids, n = encode(tok, p, chat)
        if len(ids) > seq_len:
            raise ValueError(f"an example of {len(ids)} tokens exceeds seq_len {seq_len}")
        x[i, :len(ids)] = ids
        w[i, n - 1:len(ids) - 1] = 1
    return x, w


def _xent(logits, labels):
    return optax.softmax_cross_entropy_with_integer_labels(logits, labels)


def forward(model: Qwen35ForCausalLM, mtp: MTP, x):
    """Logits of the model [B, T, V] and of the MTP head [B, T, V] (position t: token t+2)."""
    b, t = x.shape
    cfg = model.config
    cache = SequenceCache.allocate(cfg, b, t, dtype=model.dtype)
    batch = rows_batch(x, cache)
    h, _ = model.hidden(batch, cache.cache)
    h = model.norm(h)
    emb = model.embed_tokens(x)
    nxt = jnp.concatenate([emb[:, 1:], emb[:, :1]], axis=1).reshape(b * t, -1)
    kv = jnp.zeros(MTP.kv_shape(cfg, cache.cache.num_blocks, cache.cache.block_size),
                   model.dtype)
    meta = step_meta(batch, num_blocks=cache.cache.num_blocks,
                     block_size=cache.cache.block_size)
    hm, _ = mtp(h, nxt, kv, meta)
    return model.head(h).reshape(b, t, -1), model.head(hm).reshape(b, t, -1)


def losses(model, mtp, x, w):
    """(main loss, MTP loss, per-example main correctness [B], MTP token hits and count)."""
    logits, mlogits = forward(model, mtp, x)
    wm = w[:, :-1]
    main = (_xent(logits[:, :-1], x[:, 1:]) * wm).sum() / wm.sum()
    wt = w[:, 1:-1]
    head = (_xent(mlogits[:, :-2], x[:, 2:]) * wt).sum() / wt.sum()
    wrong = (jnp.argmax(logits[:, :-1], -1) != x[:, 1:]) & (wm > 0)
    hits = ((jnp.argmax(mlogits[:, :-2], -1) == x[:, 2:]) & (wt > 0)).sum()
    return main, head, ~wrong.any(axis=1), hits, wt.sum()


class Trained(nnx.Module):
    """The model and its MTP head, optimised together."""

    def __init__(self, cfg, seed: int, dtype=jnp.float32):
        rngs = nnx.Rngs(seed)
        self.model = Qwen35ForCausalLM(cfg, rngs=rngs, dtype=dtype)
        self.mtp = MTP(cfg, rngs=rngs, dtype=dtype)


def train(cfg, tok, s: Settings, log=print):
    """Train from scratch: (model, mtp, history (a dict per evaluation), steps run)."""
    pair = Trained(cfg, s.seed)
    warmup = min(s.warmup, s.steps // 10)
    sched = optax.warmup_cosine_decay_schedule(0.0, s.lr, warmup, s.steps, end_value=s.lr / 100)
    opt = nnx.Optimizer(pair, optax.chain(optax.clip_by_global_norm(1.0),
                                          optax.adamw(sched, weight_decay=s.weight_decay)),
                        wrt=nnx.Param)

    @nnx.jit
    def step(pair, opt, x, w):
        def loss_fn(pair):
            main, head, *_ = losses(pair.model, pair.mtp, x, w)
            return main + s.mtp_weight * head, (main, head)

        (_, (main, head)), grads = nnx.value_and_grad(loss_fn, has_aux=True)(pair)
        opt.update(pair, grads)
        return main, head

    @nnx.jit
    def evaluate(pair, x, w):
        return losses(pair.model, pair.mtp, x, w)

    held = problems.held_out(s.eval_problems)
    ex, ew = batch_arrays(tok, held, [False] * len(held), s.seq_len)
    cx, cw = batch_arrays(tok, held[:256], [True] * 256, s.seq_len)
    rng = random.Random(s.seed)
    history, t0, trained = [], time.perf_counter(), 0
    with default_backend("reference"):
        for i in range(1, s.steps + 1):
            probs = [problems.problem(rng) for _ in range(s.batch)]
            chat = [rng.random() < s.chat_fraction for _ in range(s.batch)]
            x, w = batch_arrays(tok, probs, chat, s.seq_len)
            main, head = step(pair, opt, jnp.asarray(x), jnp.asarray(w))
            trained = i
            elapsed = time.perf_counter() - t0
            out_of_time = s.max_seconds is not None and elapsed > s.max_seconds
            if i % s.eval_every == 0 or i == s.steps or out_of_time:
                _, _, ok, hits, n = evaluate(pair, jnp.asarray(ex), jnp.asarray(ew))
                _, _, cok, _, _ = evaluate(pair, jnp.asarray(cx), jnp.asarray(cw))
                row = dict(step=i, seconds=round(elapsed, 1), loss=float(main),
                           mtp_loss=float(head), exact=float(np.mean(ok)),
                           chat_exact=float(np.mean(cok)), mtp_accuracy=float(hits / n))
                history.append(row)
                log(" ".join(f"{k} {v:.4g}" if isinstance(v, float) else f"{k} {v}"
                             for k, v in row.items()))
            if out_of_time:
                log(f"stopped at step {i} of {s.steps}: past max_seconds {s.max_seconds}")
                break
    return pair.model, pair.mtp, history, trained
