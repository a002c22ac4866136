"""Compile time of the model's step programs for a preset, from abstract inputs only.

No weights are made: the model, cache and batch are shape-only, so the
published sizes compile on a laptop.  Because the layer group is scanned, the
time should not grow with depth; ``--depths`` shows that directly by compiling
the same preset at several layer counts.

    python -m bench.compile --preset 35B-A3B --tokens 8192 --decode-batch 64
"""

from __future__ import annotations

import argparse
import time

import jax
import jax.numpy as jnp
from flax import nnx

from qwen35_jax import get_preset
from qwen35_jax.batch import Batch
from qwen35_jax.cache import HybridCache
from qwen35_jax.loader import abstract_model


def abstract_batch(tokens: int, seqs: int, max_blocks: int, is_decode: bool) -> Batch:
    i32 = lambda *s: jax.ShapeDtypeStruct(s, jnp.int32)  # noqa: E731
    return Batch(tokens=i32(tokens), cu_seqlens=i32(seqs + 1), start_pos=i32(seqs),
                 slots=i32(seqs), block_tables=i32(seqs, max_blocks), logits_indices=i32(seqs),
                 is_decode=is_decode)


def compile_times(cfg, *, tokens: int, seqs: int, decode_batch: int, block_size: int,
                  max_len: int, dtype=jnp.bfloat16) -> dict:
    graphdef, state = nnx.split(abstract_model(cfg, dtype))
    max_blocks = -(-max_len // block_size)
    n_blocks = max(seqs, decode_batch) * max_blocks
    cache = jax.eval_shape(lambda: HybridCache.allocate(
        cfg, num_blocks=n_blocks, block_size=block_size,
        num_slots=max(seqs, decode_batch), dtype=dtype))

    @jax.jit
    def step(state, batch, cache):
        return nnx.merge(graphdef, state).forward(batch, cache)

    out = {}
    for name, batch in (("prefill", abstract_batch(tokens, seqs, max_blocks, False)),
                        ("decode", abstract_batch(decode_batch, decode_batch, max_blocks, True))):
        t0 = time.perf_counter()
        lowered = step.lower(state, batch, cache)
        t1 = time.perf_counter()
        lowered.compile()
        t2 = time.perf_counter()
        out[name] = (t1 - t0, t2 - t1)
    return out


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--preset", default="35B-A3B")
    p.add_argument("--tokens", type=int, default=8192, help="prefill bucket (tokens)")
    p.add_argument("--seqs", type=int, default=8, help="sequences in the prefill bucket")
    p.add_argument("--decode-batch", type=int, default=64)
    p.add_argument("--block-size", type=int, default=64)
    p.add_argument("--max-len", type=int, default=8192)
    p.add_argument("--depths", type=int, nargs="*", default=[],
                   help="also compile the preset with these layer counts")
    a = p.parse_args(argv)
    base = get_preset(a.preset)
    depths = [base.num_hidden_layers] + a.depths
    print(f"backend {jax.default_backend()}, jax {jax.__version__}")
    print(f"{'preset':>10} {'layers':>6} {'program':>8} {'lower s':>8} {'compile s':>10}")
    for d in depths:
        cfg = base.replace(num_hidden_layers=d,
                           layer_types=base.layer_types[:4] * (d // 4))
        times = compile_times(cfg, tokens=a.tokens, seqs=a.seqs, decode_batch=a.decode_batch,
                              block_size=a.block_size, max_len=a.max_len)
        for name, (lo, co) in times.items():
            print(f"{a.preset:>10} {d:>6} {name:>8} {lo:8.2f} {co:10.2f}", flush=True)


if __name__ == "__main__":
    main()
