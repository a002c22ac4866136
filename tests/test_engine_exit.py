"""A server process whose engine stops while serving exits (status 3) instead of
answering 503 for good, as vLLM's server does on a dead engine: a worker, so that the
launcher restarts it (``tests/test_parity.py``: the restart of a worker that exits), and
the aggregated server, for its orchestrator. Each is one real tiny process with a route
that crashes its engine (``fault_worker.py``, ``fault_server.py``)."""

import os
import pathlib
import subprocess
import sys
import time

import httpx

from serving import secret as shared_secret
from serving.engine_exit import ENGINE_FAILED_EXIT
from serving.ports import free_port

HERE = pathlib.Path(__file__).parent
TINY = ["--model", "tiny", "--max-num-seqs", "1", "--max-num-batched-tokens", "16",
        "--max-model-len", "32", "--block-size", "16", "--prefill-token-buckets", "16",
        "--prefill-seq-buckets", "1", "--decode-seq-buckets", "1", "--log-level", "warning"]


def _crash_and_wait_for_exit(script: str, flags: list[str], headers: dict, env: dict,
                             route: str = "/debug/crash") -> tuple[int, float]:
    """Start ``script`` with ``flags``, wait for its health, crash its engine (``route``);
    the process's exit status and the seconds from the crash to the exit."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc = subprocess.Popen([sys.executable, str(HERE / script), "--port", str(port), *flags],
                            start_new_session=True, env={**os.environ, **env})
    try:
        end = time.monotonic() + 600
        while True:
            assert proc.poll() is None, "the server died at start-up"
            try:
                if httpx.get(f"{url}/health", timeout=1, headers=headers).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < end, "the server is not ready"
            time.sleep(0.5)
        assert httpx.post(f"{url}{route}", headers=headers, timeout=10).status_code == 200
        t = time.monotonic()
        status = proc.wait(timeout=120)
        return status, time.monotonic() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def test_a_worker_whose_engine_stops_exits_for_its_supervisor():
    secret = shared_secret.generate()
    status, _ = _crash_and_wait_for_exit("fault_worker.py", ["--role", "decode", *TINY],
                                         shared_secret.header(secret),
                                         {shared_secret.ENV: secret})
    assert status == ENGINE_FAILED_EXIT


def test_an_aggregated_server_whose_engine_stops_exits():
    assert _crash_and_wait_for_exit("fault_server.py", TINY, {}, {})[0] == ENGINE_FAILED_EXIT


def test_an_aggregated_server_whose_engine_hangs_exits_within_its_bound():
    """A hung step (past a 2 s iteration timeout) ends the process within seconds: the
    exit does not wait for the server's orderly shutdown, which would wait 30 s for the
    hung engine thread to join."""
    status, seconds = _crash_and_wait_for_exit(
        "fault_server.py", [*TINY, "--engine-iteration-timeout", "2"], {}, {}, "/debug/hang")
    assert status == ENGINE_FAILED_EXIT and seconds < 20


def test_a_server_told_to_stop_does_not_exit_as_failed(monkeypatch):
    """Ctrl-C stops the server, whose shutdown then stops the engine (setting its error):
    that stop is no failure, so the watch neither logs one nor exits with
    ENGINE_FAILED_EXIT; an engine that fails while the server serves still does."""
    import threading
    from types import SimpleNamespace

    from serving import engine_exit
    from serving.errors import EngineDead

    exits = []
    monkeypatch.setattr(engine_exit.os, "_exit", exits.append)
    monkeypatch.setattr(engine_exit, "ENGINE_FAILED_GRACE", 0.0)

    def run_watch(stopping: bool) -> list:
        exits.clear()
        server, engine = SimpleNamespace(should_exit=False), SimpleNamespace(error=None)
        thread = threading.Thread(target=engine_exit.watch, args=(server, engine))
        thread.start()
        server.should_exit = stopping  # the order of a stop: should_exit, then the error
        engine.error = EngineDead("engine shut down")
        if not stopping:
            for _ in range(40):
                if exits:
                    break
                time.sleep(0.05)
            server.should_exit = True  # the patched exit returns: end the watch
        thread.join(timeout=5)
        return list(exits)

    assert run_watch(stopping=True) == []
    assert run_watch(stopping=False) == [ENGINE_FAILED_EXIT]


def test_a_server_that_cannot_bind_its_port_is_no_engine_failure(monkeypatch):
    """uvicorn exits without setting ``should_exit`` when its port is taken; the caller's
    engine shutdown that follows is then no failure either (it was status 3 and an ERROR,
    and the exit cut that shutdown short)."""
    import socket
    from types import SimpleNamespace

    import pytest
    import uvicorn

    from serving import engine_exit
    from serving.errors import EngineDead

    exits = []
    monkeypatch.setattr(engine_exit.os, "_exit", exits.append)
    monkeypatch.setattr(engine_exit, "ENGINE_FAILED_GRACE", 0.0)
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        config = uvicorn.Config(lambda scope, receive, send: None, host="127.0.0.1",
                                port=taken.getsockname()[1], log_level="critical")
        engine = SimpleNamespace(error=None)
        with pytest.raises(SystemExit):
            engine_exit.serve(config, engine)
    engine.error = EngineDead("engine shut down")  # the caller's shutdown, after serve
    time.sleep(1.2)  # the watch looks every 0.5 s
    assert exits == []
