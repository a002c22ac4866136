"""A real uvicorn server over the tiny preset, for the API tests.

Built through the same flags as `python -m serving.api`, with two small step
programs (a 32-token prefill for 8 sequences, a decode for 8) so it compiles
in well under a minute on a CPU; longer prompts are prefilled in chunks. `shared()` gives
every test module of a session the same server, so it compiles once.
"""

import atexit
import threading
import time
from dataclasses import dataclass

import uvicorn

from serving.api.server import build, parser, uvicorn_config
from serving.ports import free_port

MAX_MODEL_LEN, MAX_NUM_SEQS, NUM_BLOCKS, MAX_LOGPROBS = 256, 8, 128, 5
FLAGS = ["--model", "tiny", "--max-model-len", str(MAX_MODEL_LEN),
         "--max-num-seqs", str(MAX_NUM_SEQS), "--max-num-batched-tokens", "32",
         "--num-blocks", str(NUM_BLOCKS), "--max-logprobs", str(MAX_LOGPROBS),
         "--prefill-token-buckets", "32", "--prefill-seq-buckets", str(MAX_NUM_SEQS),
         "--decode-seq-buckets", str(MAX_NUM_SEQS)]


@dataclass
class Running:
    url: str  # http://127.0.0.1:PORT
    engine: object  # serving.async_engine.AsyncEngine
    server: uvicorn.Server
    thread: threading.Thread

    def wait_idle(self, timeout: float = 10.0) -> dict:
        """Wait until nothing runs and every block and slot is back; the stats."""
        deadline = time.monotonic() + timeout
        while True:
            s = self.engine.stats()
            if (s["num_running"] == 0 and s["num_waiting"] == 0
                    and s["free_blocks"] == s["num_blocks"] and s["free_slots"] == s["num_slots"]):
                return s
            if time.monotonic() > deadline:
                raise AssertionError(f"engine not idle with full pools after {timeout} s: {s}")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


def start(extra_flags=()) -> Running:
    port = free_port()
    args = parser().parse_args(FLAGS + list(extra_flags) + ["--port", str(port)])
    app, engine = build(args)
    server = uvicorn.Server(uvicorn_config(app, args, log_level="warning"))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if time.monotonic() > deadline or not thread.is_alive():
            raise RuntimeError("uvicorn did not start")
        time.sleep(0.05)
    return Running(f"http://127.0.0.1:{port}", engine, server, thread)


_shared: list[Running] = []


def shared() -> Running:
    if not _shared:
        _shared.append(start())
        atexit.register(_shared[0].stop)
    return _shared[0]
