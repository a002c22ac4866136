"""Does releasing a NIXL READ stop it? A probe of the behaviour ``transfer.drain``
depends on: it posts one READ of many descriptors between two agents in this process
(DRAM), releases the handle at once, and counts the destination bytes that land
afterwards. With NIXL 1.5.1's UCX backend they keep landing (bench/RESULTS.md,
"Releasing a READ does not stop it"), which is why a failed pull's destination stays
held until NIXL reports the READ ended (``TransferManager.settled``).

    UCX_TLS=tcp python -m bench.nixl_release [--mib 512] [--no-progress-thread]

Over shared memory (UCX's default for two agents on one host) the READ usually ends
inside the post call, leaving nothing to race; ``UCX_TLS=tcp`` makes it take long enough.
"""
from __future__ import annotations

import argparse
import time

import numpy as np


def main(argv=None) -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--mib", type=int, default=512, help="bytes to READ, in MiB")
    ap.add_argument("--chunk-mib", type=int, default=4, help="bytes a descriptor, in MiB")
    ap.add_argument("--no-progress-thread", action="store_true",
                    help="the reading agent without NIXL's progress thread")
    ap.add_argument("--watch", type=float, default=4.0, help="seconds to watch after release")
    a = ap.parse_args(argv)
    from nixl._api import nixl_agent, nixl_agent_config

    n, chunk = a.mib << 20, a.chunk_mib << 20
    src, dst = np.full(n, 0xAB, np.uint8), np.zeros(n, np.uint8)
    source = nixl_agent("source", nixl_agent_config(enable_prog_thread=True, backends=["UCX"]))
    reader = nixl_agent("reader", nixl_agent_config(
        enable_prog_thread=not a.no_progress_thread, backends=["UCX"]))
    source.register_memory(source.get_reg_descs([(src.ctypes.data, n, 0, "")], "DRAM"))
    reader.register_memory(reader.get_reg_descs([(dst.ctypes.data, n, 0, "")], "DRAM"))
    reader.add_remote_agent(source.get_agent_metadata())
    source.add_remote_agent(reader.get_agent_metadata())
    descs = lambda base: np.array([(base + o, chunk, 0) for o in range(0, n, chunk)], np.uint64)
    handle = reader.initialize_xfer("READ", reader.get_xfer_descs(descs(dst.ctypes.data), "DRAM"),
                                    reader.get_xfer_descs(descs(src.ctypes.data), "DRAM"),
                                    "source", b"done")
    posted = reader.transfer(handle)
    state = reader.check_xfer_state(handle)
    at_post = int(np.count_nonzero(dst))
    t0 = time.perf_counter()
    try:
        handle.release()
        released = "ok"
    except Exception as e:  # NIXL raises its own types
        released = repr(e)
    print(f"{n >> 20} MiB in {n // chunk} descriptors; post: {posted}, state: {state}, "
          f"release: {released} ({(time.perf_counter() - t0) * 1e3:.2f} ms)")
    print("| after release (ms) | bytes landed |\n|---|---|")
    print(f"| before release | {at_post} |")
    end, landed, shown = time.monotonic() + a.watch, -1, 0.0
    while time.monotonic() < end and landed < n:
        reader.get_new_notifs()  # a NIXL call: drives UCX when there is no progress thread
        landed, ms = int(np.count_nonzero(dst)), (time.perf_counter() - t0) * 1e3
        if ms >= shown + 200 or landed == n:  # a row every 0.2 s, and the last
            print(f"| {ms:.0f} | {landed} |")
            shown = ms
        time.sleep(0.01)
    print(f"notifications at the source: {source.get_new_notifs()}")


if __name__ == "__main__":
    main()
