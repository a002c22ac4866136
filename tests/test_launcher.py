"""The README's main command: ``python -m serving`` starts the disaggregated stack, serves
the OpenAI API through the router, and with ``--max-worker-restarts 0`` stops everything
and exits with status 1 when a worker dies (here with bench.disagg's CPU engine limits,
whose programs test_bench_disagg has cached). Restarts and SIGTERM: test_parity."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

# CPU_ENGINE_FLAGS: test_bench_disagg's programs, in the session's cache
from bench.disagg import CPU_ENGINE_FLAGS, server_role
from serving.ports import free_port


@pytest.fixture(scope="module")
def server():
    port = free_port()
    proc = subprocess.Popen(
        [sys.executable, "-m", "serving", "--model", "tiny", "--port", str(port),
         *CPU_ENGINE_FLAGS, "--on-transfer-failure", "recompute", "--log-level", "warning",
         "--max-worker-restarts", "0"],
        start_new_session=True)
    url = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while True:
        assert proc.poll() is None, "python -m serving exited during start-up"
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                break
        except httpx.TransportError:
            pass
        assert time.monotonic() < end, "stack not ready"
        time.sleep(0.5)
    yield proc, url
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)


def test_completion_and_chat_through_the_router(server):
    proc, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    out = client.completions.create(model="tiny", prompt="hello world", max_tokens=8,
                                    temperature=0, extra_body={"ignore_eos": True})
    assert out.usage.completion_tokens == 8 and out.choices[0].finish_reason == "length"
    again = client.completions.create(model="tiny", prompt="hello world", max_tokens=8,
                                      temperature=0, extra_body={"ignore_eos": True})
    assert again.choices[0].text == out.choices[0].text
    chunks = list(client.chat.completions.create(
        model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=5,
        stream=True, stream_options={"include_usage": True}))
    assert chunks[-1].usage.completion_tokens >= 1
    assert server_role(url) == "disaggregated"  # what bench.disagg --base-url labels it
    # The router reads the workers' counters on its 1 s health poll.
    end = time.monotonic() + 30
    while True:
        samples = {s.name: s.value for family in text_string_to_metric_families(
            httpx.get(f"{url}/metrics").text) for s in family.samples}
        if samples["vllm:kv_transfers_total"] >= 3 or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert samples["vllm:kv_transfers_total"] == 3, samples
    assert samples["vllm:kv_transfer_failures_total"] == 0
    ack = samples["vllm:kv_transfer_ack_seconds_total"]  # part of the transfers' time
    assert 0 < ack <= samples["vllm:kv_transfer_seconds_total"], samples
    # one run of consecutive KV blocks + the conv slot + the recurrent slot
    assert samples["vllm:kv_transfer_descriptors_total"] == 3 * 3
    assert samples["vllm:num_requests_running"] == 0


def test_stop_strings_through_the_router(server):
    """Both workers check stop strings (the prefill worker's first token can end one):
    the text ends where the stop string starts, as the aggregated server cuts it."""
    proc, url = server
    client = openai.OpenAI(base_url=f"{url}/v1", api_key="none")
    ask = dict(model="tiny", prompt="hello there", max_tokens=12, temperature=0,
               extra_body={"ignore_eos": True})
    text = client.completions.create(**ask).choices[0].text
    stop = text[len(text) // 2:len(text) // 2 + 2]
    out = client.completions.create(**ask, stop=[stop])
    assert out.choices[0].finish_reason == "stop"
    assert out.choices[0].text == text[:text.find(stop)]


def test_role_args_reach_only_their_role(monkeypatch):
    """Shared engine flags reach every worker; --prefill-args / --decode-args only their
    role, after the shared ones (argparse: the later flag wins); launcher flags none."""
    import serving.__main__ as launcher

    argv = ["--model", "tiny", "--port", "8000", "--max-num-seqs", "4", "--decode-workers", "2",
            "--prefill-args", "--max-num-seqs 8 --tp 2", "--decode-args=--ep 2"]
    args, _ = launcher.parser().parse_known_args(argv)
    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen",
                        lambda cmd, **kw: started.append((cmd, kw.get("env", {}))) or object())
    monkeypatch.setattr(launcher, "gpus", lambda: ["0", "1"])
    workers = launcher.Workers(args, launcher.worker_flags(args, argv), "s" * 32)
    assert len(workers.urls["prefill"]) == 1 and len(workers.urls["decode"]) == 2
    tails = [cmd[cmd.index("--port") + 2:] for cmd, _ in started]
    assert tails == [["--model", "tiny", "--max-num-seqs", "4", "--max-num-seqs", "8", "--tp", "2"],
                     ["--model", "tiny", "--max-num-seqs", "4", "--ep", "2"],
                     ["--model", "tiny", "--max-num-seqs", "4", "--ep", "2"]]
    assert [cmd[cmd.index("--role") + 1] for cmd, _ in started] == ["prefill", "decode", "decode"]
    # one GPU each, round robin over the two; the secret in the environment only
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in started] == ["0", "1", "0"]
    assert all(env["QWEN35_JAX_SECRET"] == "s" * 32 for _, env in started)
    assert not any("s" * 32 in " ".join(cmd) for cmd, _ in started)
    # what an aggregated server beside the stack gets (bench.disagg --compare-aggregated)
    assert launcher.without_flags(argv, launcher.LAUNCHER_FLAGS) == [
        "--model", "tiny", "--port", "8000", "--max-num-seqs", "4"]


def test_the_api_key_and_restart_flags_stay_with_the_launcher():
    import serving.__main__ as launcher

    argv = ["--model", "tiny", "--api-key", "k", "--max-worker-restarts", "2",
            "--max-queued-requests", "7"]
    args, _ = launcher.parser().parse_known_args(argv)
    assert launcher.worker_flags(args, argv) == ["--model", "tiny", "--max-queued-requests", "7"]


def test_supervise_restarts_dead_workers_until_its_budget_is_spent():
    import threading

    import serving.__main__ as launcher

    class Proc:
        def __init__(self, code=None):
            self.code = code

        def poll(self):
            return self.code

    workers = launcher.Workers.__new__(launcher.Workers)
    workers.procs = {"a": Proc(1), "b": Proc()}
    started, gave_up, stopping = [], [], threading.Event()

    def start(url):
        started.append(url)
        workers.procs[url] = Proc(1 if len(started) < 2 else None)  # dies once more
        if len(started) == 2:
            stopping.set()  # end the first run here: "a" lives now

    workers.start = start
    launcher.supervise(workers, 2, lambda m: (gave_up.append(m), stopping.set()), stopping,
                       interval=0.01)
    assert started == ["a", "a"] and gave_up == []  # both restarts used; "a" now lives
    workers.procs["b"] = Proc(9)
    stopping.clear()
    launcher.supervise(workers, 0, lambda m: (gave_up.append(m), stopping.set()), stopping,
                       interval=0.01)
    assert len(gave_up) == 1 and "worker b exited with code 9" in gave_up[0]


def test_a_dead_worker_ends_the_launcher_with_status_1(server):
    """Last in this module: with --max-worker-restarts 0 the launcher does not restart a
    worker that died: it stops the other one and exits with status 1, as a supervisor
    (systemd, Kubernetes) expects, instead of serving on half a stack."""
    proc, url = server
    children = psutil.Process(proc.pid).children(recursive=True)
    [decode] = [c for c in children if "--role decode" in " ".join(c.cmdline())]
    decode.kill()
    assert proc.wait(timeout=60) == 1
    gone, alive = psutil.wait_procs(children, timeout=30)
    assert not alive, [c.cmdline() for c in alive]
