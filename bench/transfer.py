"""Whole-request KV + GDN state transfers between two processes over NIXL, beside a plain copy.

    python -m bench.transfer [--device cpu|gpu] [--preset 35B-A3B] [--tokens 1024,8192]
                             [--block-size 16] [--iters 10] [--ssm-dtype float32]
                             [--progress-thread auto|on|off]

A source process (the prefill side) and this process (the decode side) each allocate the
cache pools of ``--preset`` as ``transfer`` regions: a block-major KV pool and one slot of
conv and one of recurrent state, in the layout of ``qwen35_jax.cache.HybridCache``. The
source fills its pools with a jitted *donated* update, so a READ that returns the pattern
also proves that the update wrote into the registered memory. For each prompt length the
decode side pulls the request (the prompt's KV blocks plus both state slots) ``--iters``
times, into consecutive blocks ("contiguous", 3 descriptors) and into a shuffled block
list ("fragmented", about one descriptor per block), checks the bytes once, and reports
the median time from ``claim()`` to the source's ack, split into its phases (the claim,
an authenticated HTTP round trip to the source; planning, posting the READ, the READ
itself, the ack), and the time until the bytes are usable (landed: decode starts then,
before the ack). Beside it, in the same run, a plain
copy of the same number of bytes: ``np.copyto`` between host buffers on CPU, a
``jax.device_put`` from the source's GPU to this one on GPU.

On GPU the source uses GPU 0 and this process the last visible GPU (GPU 0 too with
``--same-device``); the run also prints whether the regions' memory is legacy-IPC capable
(what UCX's cuda_ipc needs), beside an XLA-allocated array for contrast.
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import secrets
import statistics
import time

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # two processes share the GPUs

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from qwen35_jax.cache import HybridCache  # noqa: E402
from qwen35_jax.config import get_preset  # noqa: E402
from serving.kv_transfer import CacheLayout  # noqa: E402
from transfer import Agent, TransferManager, allocate  # noqa: E402


def pools(args) -> dict[str, tuple[int, int]]:
    """Region name -> (rows, bytes per row): KV blocks for the longest prompt, one state slot each."""
    cfg = get_preset(args.preset)
    shapes = HybridCache.shapes(cfg, 1, args.block_size, 1)
    bf16, ssm = np.dtype(jnp.bfloat16).itemsize, np.dtype(args.ssm_dtype).itemsize
    blocks = max(math.ceil(t / args.block_size) for t in args.tokens)
    return {"kv": (blocks, math.prod(shapes["kv"]) * bf16),
            "conv": (1, math.prod(shapes["conv"]) * bf16),
            "ssm": (1, math.prod(shapes["ssm"]) * ssm)}


def _pattern(x):
    """Bytes that differ from block to block, so a misplaced block is caught."""
    i = jax.lax.iota(jnp.uint32, x.size).reshape(x.shape)
    return ((i * jnp.uint32(2654435761)) >> 11).astype(jnp.uint8)


pattern = jax.jit(_pattern)
fill = jax.jit(lambda x: x + _pattern(x), donate_argnums=0)  # x is zero: writes the pattern
wipe = jax.jit(jnp.zeros_like, donate_argnums=0, keep_unused=True)  # keep_unused: see transfer.memory


def device(args, index):
    return jax.devices("gpu")[index] if args.device == "gpu" else jax.devices("cpu")[0]


def make_side(args, dev, fill_pattern):
    arrays, regions = {}, []
    for name, (rows, row_bytes) in pools(args).items():
        arrays[name], region = allocate(name, (rows, row_bytes), jnp.uint8, dev)
        if fill_pattern:
            arrays[name] = jax.block_until_ready(fill(arrays[name]))
        regions.append(region)
    compat = {"preset": args.preset, "block_size": args.block_size, "ssm_dtype": args.ssm_dtype,
              "row_bytes": {n: b for n, (_, b) in pools(args).items()}}
    progress = {"auto": None, "on": True, "off": False}[args.progress_thread]
    return arrays, TransferManager(Agent(regions, progress_thread=progress), compat,
                                   secret=args.secret)


def in_place(arrays, manager) -> bool:
    """Whether every array still lives at its registered address (donation kept it there)."""
    regions = manager.agent.regions
    return all(a.unsafe_buffer_pointer() == regions[n].addr for n, a in arrays.items())


def source_main(args, conn):
    # `arrays` own the registered memory (CPU) or view it (GPU): they live until close()
    arrays, manager = make_side(args, device(args, 0), fill_pattern=True)
    conn.send((manager.address, in_place(arrays, manager)))
    while True:
        manager.poll()
        if conn.poll(0.0005):
            command = conn.recv()
            if command is None:
                break
            items, count = command
            conn.send([manager.pin(items) for _ in range(count)])
    manager.close()


def request_items(args, tokens, local_blocks, rows):
    """What the workers pin and pull for such a request (consecutive blocks merged)."""
    layout = CacheLayout(rows["kv"][1], rows["conv"][1], rows["ssm"][1], args.block_size)
    return layout.items(local_blocks, 0, tokens)


def check(arrays, args, tokens, local_blocks) -> bool:
    """The pulled request equals the source's pattern (computed here, on this device)."""
    blocks = math.ceil(tokens / args.block_size)
    ok = bool(jnp.array_equal(arrays["kv"][np.asarray(local_blocks[:blocks])],
                              pattern(arrays["kv"])[:blocks]))
    return ok and all(bool(jnp.array_equal(arrays[n], pattern(arrays[n]))) for n in ("conv", "ssm"))


def plain_copy(args, nbytes, dst_dev) -> float:
    """Median seconds of a plain copy of ``nbytes`` (host memcpy, or GPU 0 to ``dst_dev``)."""
    times = []
    if args.device == "gpu":
        src = jax.block_until_ready(jnp.ones((nbytes,), jnp.uint8, device=device(args, 0)))
        for _ in range(args.iters + 2):
            t = time.perf_counter()
            jax.block_until_ready(jax.device_put(src, dst_dev, may_alias=False))
            times.append(time.perf_counter() - t)
    else:
        src, dst = np.ones(nbytes, np.uint8), np.zeros(nbytes, np.uint8)
        for _ in range(args.iters + 2):
            t = time.perf_counter()
            np.copyto(dst, src)
            times.append(time.perf_counter() - t)
    return statistics.median(times[2:])


def ipc_capable(addr: int) -> bool | None:
    """CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE of a device pointer (None if unknown)."""
    try:
        from cuda.bindings import driver
    except ImportError:
        return None
    attr = driver.CUpointer_attribute.CU_POINTER_ATTRIBUTE_IS_LEGACY_CUDA_IPC_CAPABLE
    err, value = driver.cuPointerGetAttribute(attr, addr)
    return bool(value) if err == driver.CUresult.CUDA_SUCCESS else None


def receive(conn, source):
    """The source's next message; raises if the source process died instead."""
    while not conn.poll(1.0):
        if not source.is_alive():
            raise RuntimeError(f"source process exited with code {source.exitcode}")
    return conn.recv()


def run(args) -> list[dict]:
    ctx = multiprocessing.get_context("spawn")
    conn, child_conn = ctx.Pipe()
    source = ctx.Process(target=source_main, args=(args, child_conn), daemon=True)
    source.start()
    dst_dev = device(args, 0 if args.same_device else -1)
    arrays, manager = make_side(args, dst_dev, fill_pattern=False)
    if args.device == "gpu":
        xla = jnp.zeros((1 << 20,), jnp.uint8, device=dst_dev)
        print(json.dumps({"ipc_capable": {"region kv": ipc_capable(manager.agent.regions["kv"].addr),
                                          "XLA array": ipc_capable(xla.unsafe_buffer_pointer())},
                          "source_device": str(device(args, 0)), "puller_device": str(dst_dev)}),
              flush=True)
    address, source_in_place = receive(conn, source)
    manager.connect(address)
    rows = pools(args)
    rng = np.random.default_rng(0)
    results = []
    try:
        for tokens in args.tokens:
            src_items = request_items(args, tokens, list(range(rows["kv"][0])), rows)
            nbytes = sum(x[2] for x in src_items)
            copy_s = plain_copy(args, nbytes, dst_dev)
            for layout in ("contiguous", "fragmented"):
                local_blocks = list(range(rows["kv"][0]))
                if layout == "fragmented":
                    rng.shuffle(local_blocks)
                local_items = request_items(args, tokens, local_blocks, rows)
                conn.send((src_items, args.iters + 2))
                times, phases, count = [], [], None
                for params in receive(conn, source):
                    t = time.perf_counter()
                    claim = manager.claim(params)
                    claimed = time.perf_counter()
                    pid = manager.pull(claim, local_items, timeout=600)
                    c = manager.wait([pid], 600)[pid]
                    times.append(time.perf_counter() - t)
                    if not c.ok:
                        raise RuntimeError(f"pull failed: {c.error}")
                    count = c.descriptors
                    phases.append({"claim": claimed - t, **c.phases})
                correct = check(arrays, args, tokens, local_blocks)
                for name in arrays:  # wipe, so the next layout's check proves its own pull
                    arrays[name] = jax.block_until_ready(wipe(arrays[name]))
                stayed = source_in_place and in_place(arrays, manager)
                pull_s = statistics.median(times[2:])
                # decode may start once the bytes land (TransferManager.landed), before the ack
                usable_s = statistics.median(ph["claim"] + ph["plan"] + ph["post"] + ph["read"]
                                             for ph in phases[2:])
                results.append({
                    "device": args.device, "same_device": args.same_device, "preset": args.preset,
                    "tokens": tokens, "layout": layout, "bytes": nbytes, "descriptors": count,
                    "correct": correct, "in_place": stayed,
                    "pull_ms": pull_s * 1e3, "pull_GBps": nbytes / pull_s / 1e9,
                    "first_pull_ms": times[0] * 1e3,
                    "phases_ms": {k: statistics.median(ph[k] for ph in phases[2:]) * 1e3
                                  for k in phases[-1]},
                    "copy_ms": copy_s * 1e3, "copy_GBps": nbytes / copy_s / 1e9,
                    "pull_vs_copy": copy_s / pull_s,
                    "usable_ms": usable_s * 1e3, "usable_vs_copy": copy_s / usable_s})
                print(json.dumps(results[-1]), flush=True)
    finally:
        conn.send(None)
        source.join(60)
        manager.close()
    return results


def table(results: list[dict]) -> str:
    lines = ["| tokens | layout | MiB | descriptors | bytes ok, in place | NIXL pull ms (first) "
             "| claim / plan / post / read / ack ms | NIXL GB/s | plain copy ms | copy GB/s | pull / copy "
             "| usable ms (landed) | usable / copy |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in results:
        lines.append(f"| {r['tokens']} | {r['layout']} | {r['bytes'] / 2**20:.1f} | {r['descriptors']} "
                     f"| {r['correct']}, {r['in_place']} | {r['pull_ms']:.2f} ({r['first_pull_ms']:.1f}) "
                     f"| {' / '.join(f'{v:.2f}' for v in r['phases_ms'].values())} "
                     f"| {r['pull_GBps']:.2f} | {r['copy_ms']:.2f} | {r['copy_GBps']:.2f} "
                     f"| {r['pull_vs_copy']:.0%} | {r['usable_ms']:.2f} | {r['usable_vs_copy']:.0%} |")
    return "\n".join(lines)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", choices=("cpu", "gpu"), default="cpu")
    p.add_argument("--preset", default="35B-A3B")
    p.add_argument("--tokens", type=lambda s: [int(x) for x in s.split(",")], default=[1024, 8192])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--ssm-dtype", default="float32")
    p.add_argument("--same-device", action="store_true", help="both processes on GPU 0")
    p.add_argument("--progress-thread", choices=("auto", "on", "off"), default="auto",
                   help="NIXL's progress thread (auto: on for GPU memory, off for host memory)")
    args = p.parse_args(argv)
    args.secret = secrets.token_urlsafe(32)  # both sides' handshake secret for this run
    print(table(run(args)))


if __name__ == "__main__":
    main()
