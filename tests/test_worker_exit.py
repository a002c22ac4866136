"""A worker whose engine stops while serving exits (status 3) instead of answering 503
for good, so that the launcher restarts it (``tests/test_parity.py``: the restart of a
worker that exits). One real decode worker process (``fault_worker.py``, tiny)."""

import os
import pathlib
import subprocess
import sys
import time

import httpx

from serving import secret as shared_secret
from serving.ports import free_port
from serving.worker.__main__ import ENGINE_FAILED_EXIT

FAULT_WORKER = str(pathlib.Path(__file__).with_name("fault_worker.py"))


def test_a_worker_whose_engine_stops_exits_for_its_supervisor():
    secret = shared_secret.generate()
    auth = shared_secret.header(secret)
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [sys.executable, FAULT_WORKER, "--role", "decode", "--port", str(port), "--model",
         "tiny", "--max-num-seqs", "1", "--max-num-batched-tokens", "16", "--max-model-len",
         "32", "--block-size", "16", "--prefill-token-buckets", "16", "--prefill-seq-buckets",
         "1", "--decode-seq-buckets", "1", "--log-level", "warning"],
        start_new_session=True, env={**os.environ, shared_secret.ENV: secret})
    try:
        end = time.monotonic() + 600
        while True:
            assert proc.poll() is None, "the worker died at start-up"
            try:
                if httpx.get(f"{url}/health", timeout=1, headers=auth).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the worker is not ready"
            time.sleep(0.5)
        assert httpx.post(f"{url}/debug/crash", headers=auth, timeout=10).status_code == 200
        assert proc.wait(timeout=120) == ENGINE_FAILED_EXIT
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
