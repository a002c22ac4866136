"""Host cost of ``BlockPool`` calls at 65,536 blocks in three pool states, optionally
beside the pool of an earlier commit on the same call sequence in the same process.

    python -m bench.block_pool [--blocks 65536] [--against COMMIT]

States: "churn" (1500 requests of 1-63 blocks, 700 of them freed at random); "seqs"
(256 sequences take 200 blocks each one block at a time in turn, every second one then
finishes: ~12,600 free runs of one length); "alternating" (every second block free).
Per state: mean µs of 2000 ``allocate(1)``, of freeing them, of 20 ``allocate(512)``
and of freeing those.
"""
from __future__ import annotations

import argparse
import subprocess
import time
import types

import numpy as np

from serving.engine.block_pool import BlockPool


def churn(cls, n):
    rng = np.random.default_rng(0)
    pool, held = cls(n), []
    for _ in range(1500):
        held.append(pool.allocate(int(rng.integers(1, 64))))
    for i in rng.permutation(len(held))[:700]:
        pool.free(held[i])
    return pool


def seqs(cls, n):
    pool, held = cls(n), [[] for _ in range(256)]
    for _ in range(200):
        for h in held:
            h += pool.allocate(1)
    for h in held[::2]:
        pool.free(h)
    return pool


def alternating(cls, n):
    pool = cls(n)
    pool.free(pool.allocate(n)[::2])
    return pool


def _mean_us(f, reps):
    t0 = time.perf_counter()
    out = [f() for _ in range(reps)]
    return (time.perf_counter() - t0) / reps * 1e6, out


def measure(cls, state, n) -> list[float]:
    pool = state(cls, n)
    a, small = _mean_us(lambda: pool.allocate(1), 2000)
    f, _ = _mean_us(lambda: pool.free(small.pop()), 2000)
    b, big = _mean_us(lambda: pool.allocate(512), 20)
    bf, _ = _mean_us(lambda: pool.free(big.pop()), 20)
    return [a, f, b, bf]


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--blocks", type=int, default=65536)
    p.add_argument("--against", help="a commit whose serving/engine/block_pool.py to time too")
    a = p.parse_args(argv)
    pools = {"now": BlockPool}
    if a.against:
        src = subprocess.check_output(
            ["git", "show", f"{a.against}:serving/engine/block_pool.py"], text=True)
        old = types.ModuleType("block_pool_then")
        exec(src, old.__dict__)  # noqa: S102 -- our own file at an earlier commit
        pools = {a.against: old.BlockPool, **pools}
    print("| state | pool | allocate(1) µs | free(1) µs | allocate(512) µs | free(512) µs |")
    print("|---|---|---|---|---|---|")
    for state in (churn, seqs, alternating):
        for name, cls in pools.items():
            cells = " | ".join(f"{x:.1f}" for x in measure(cls, state, a.blocks))
            print(f"| {state.__name__} | {name} | {cells} |", flush=True)


if __name__ == "__main__":
    main()
