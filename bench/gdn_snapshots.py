"""GDN prefill with prefix-cache snapshot ends against without, Mosaic GPU and Triton.

    python3 -m bench.gdn_snapshots          # an sm90 GPU

35B-A3B's GDN shapes (Hk 16, Hv 32, dk = dv = 128, bf16), 8192 tokens as 1, 4 and 128
sequences, with as many snapshot ends as the engine gives such a step
(``EngineConfig.snapshots_per_step`` at interval 32, block 64): each sequence's last two
block boundaries (at most four sequences), then every 64 tokens from the start. Prints
each time (``bench.harness.time_jax``) and how far the Mosaic snapshots are from the
Triton ones.
"""
from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from bench.harness import time_jax
from bench.gdn_kernels import _rand_gdn
from pallas_kernels.gdn import gdn_prefill

HK, HV, DK = 16, 32, 128
KERNELS = (("mosaic, no snapshots", "mgpu", False), ("mosaic + snapshots", "mgpu", True),
           ("triton + snapshots", "triton", True))


def snapshot_ends(lens) -> np.ndarray:
    cu = np.concatenate([[0], np.cumsum(lens)])
    n = sum(lens) // (32 * 64) + 2 * min(len(lens), 4)
    ends = set()
    for s in range(min(len(lens), 4)):
        ends |= {int(cu[s + 1]) - 64 if lens[s] > 64 else int(cu[s + 1]), int(cu[s + 1])}
    j = 1
    while len(ends) < n:
        ends.add(64 * j)
        j += 1
    return np.array(sorted(ends)[:n], np.int32)


def main():
    print(jax.__version__, jax.devices()[0].device_kind)
    for lens in ([8192], [2048] * 4, [64] * 128):
        T = sum(lens)
        cu = jnp.asarray(np.concatenate([[0], np.cumsum(lens)]).astype(np.int32))
        q, k, v, g, beta = _rand_gdn(jax.random.key(0), T, HK, HV, DK, DK, jnp.bfloat16)
        ends = jnp.asarray(snapshot_ends(lens))
        snaps = {}
        for name, main_kernel, with_ends in KERNELS:
            e = ends if with_ends else None
            f = jax.jit(lambda c, e, *a, _m=main_kernel: gdn_prefill(
                *a, cu_seqlens=c, use_qk_l2norm=True, snapshot_ends=e, config=dict(main=_m)))
            ms, _ = time_jax(lambda: f(cu, e, q, k, v, g, beta))
            if with_ends:
                snaps[main_kernel] = f(cu, e, q, k, v, g, beta)[2]
            print(f"{len(lens)}x{lens[0]} Hk{HK} Hv{HV} S={len(ends)}: {name:22s} {ms:.3f} ms",
                  flush=True)
        a, b = snaps["mgpu"], snaps["triton"]
        print(f"   mosaic vs triton snapshots: max rel "
              f"{float(jnp.max(jnp.abs(a - b)) / jnp.max(jnp.abs(b))):.2e}", flush=True)


if __name__ == "__main__":
    main()
