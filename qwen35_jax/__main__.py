"""Greedy generation straight through the model (no serving engine), for a quick look.

    python -m qwen35_jax --preset tiny --prompt-len 32 --max-tokens 16
    python -m qwen35_jax --checkpoint /path/to/Qwen3.5-0.8B --prompt-ids 1 2 3
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax import get_preset
from qwen35_jax.cache import SequenceCache
from qwen35_jax.loader import from_pretrained, init_random


@nnx.jit
def _step(model, ids, cache):
    logits, cache = model(ids, cache)
    return jnp.argmax(logits[:, -1], axis=-1).astype(jnp.int32), cache


def generate(model, prompt: np.ndarray, max_tokens: int) -> np.ndarray:
    """Greedy continuation of ``prompt [B, T]``: the prompt in one step, then one token a step."""
    b, t = prompt.shape
    cache = SequenceCache.allocate(model.config, b, t + max_tokens, dtype=model.dtype)
    tok, cache = _step(model, jnp.asarray(prompt, jnp.int32), cache)
    out = [tok]
    for _ in range(max_tokens - 1):
        tok, cache = _step(model, tok[:, None], cache)
        out.append(tok)
    return np.stack([np.asarray(o) for o in out], axis=1)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--preset", default="tiny", help="random weights of a built-in config")
    src.add_argument("--checkpoint", help="a Hugging Face Qwen3.5 checkpoint directory")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--prompt-ids", type=int, nargs="*")
    p.add_argument("--prompt-len", type=int, default=32, help="random prompt length")
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--seed", type=int, default=0)
    a = p.parse_args(argv)
    dtype = jnp.dtype(a.dtype)
    if a.checkpoint:
        model = from_pretrained(a.checkpoint, dtype=dtype)
    else:
        model = init_random(get_preset(a.preset), seed=a.seed, dtype=dtype)
    cfg = model.config
    prompt = (np.array([a.prompt_ids]) if a.prompt_ids else
              np.random.default_rng(a.seed).integers(0, cfg.vocab_size, (1, a.prompt_len)))
    t0 = time.perf_counter()
    tokens = generate(model, prompt, a.max_tokens)
    dt = time.perf_counter() - t0
    print(f"{cfg.name}: {cfg.num_hidden_layers} layers, {jax.default_backend()}, "
          f"{dt:.2f} s including compilation")
    print("prompt:", prompt[0].tolist())
    print("output:", tokens[0].tolist())


if __name__ == "__main__":
    main()
