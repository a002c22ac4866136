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
from serving.flags import API_FLAGS, API_SWITCHES
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
        if samples["vllm:nixl_xfer_time_seconds_count"] >= 3 or time.monotonic() > end:
            break
        time.sleep(0.5)
    assert samples["vllm:nixl_xfer_time_seconds_count"] == 3, samples
    assert samples["vllm:nixl_num_failed_transfers_total"] == 0
    ack = samples["qwen35:kv_transfer_ack_seconds_total"]  # part of the transfers' time
    assert 0 < ack <= samples["vllm:nixl_xfer_time_seconds_sum"], samples
    # one run of consecutive KV blocks + the conv slot + the recurrent slot
    assert samples["vllm:nixl_num_descriptors_sum"] == 3 * 3
    assert samples["vllm:nixl_bytes_transferred_count"] == 3
    assert samples["vllm:nixl_num_kv_expired_reqs_total"] == 0
    assert samples["vllm:num_requests_running"] == 0
    # per-request histograms at the router (the queue time is the prefill worker's), and
    # the tokens per step of both workers' engines
    assert samples["vllm:request_queue_time_seconds_count"] >= 3
    assert samples["vllm:request_decode_time_seconds_count"] >= 3
    assert samples["vllm:iteration_tokens_total_count"] >= 2 * 3


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


def _started(monkeypatch, argv):
    """The worker command lines (and environments) the launcher would start for `argv`."""
    import serving.__main__ as launcher

    args = launcher.parse(argv)
    started = []
    monkeypatch.setattr(launcher.subprocess, "Popen",
                        lambda cmd, **kw: started.append((cmd, kw.get("env", {}))) or object())
    monkeypatch.setattr(launcher, "gpus", lambda: ["0", "1"])
    workers = launcher.Workers(args, launcher.worker_flags(args, argv), "s" * 32)
    return workers, started


def test_role_args_reach_only_their_role(monkeypatch):
    """Shared engine flags reach every worker; --prefill-args / --decode-args only their
    role, after the shared ones (argparse: the later flag wins); launcher flags none."""
    import serving.__main__ as launcher

    argv = ["--model", "tiny", "--port", "8000", "--max-num-seqs", "4", "--decode-workers", "2",
            "--prefill-args", "--max-num-seqs 8 --tp 2", "--decode-args=--ep 2"]
    workers, started = _started(monkeypatch, argv)
    assert len(workers.urls["prefill"]) == 1 and len(workers.urls["decode"]) == 2
    shared = [cmd[cmd.index("--role") + 2:cmd.index("--port")] for cmd, _ in started]
    assert shared == [["--model", "tiny", "--max-num-seqs", "4"]] * 3
    tails = [cmd[cmd.index("--port") + 2:] for cmd, _ in started]
    assert tails == [["--max-num-seqs", "8", "--tp", "2"], ["--ep", "2"], ["--ep", "2"]]
    assert [cmd[cmd.index("--role") + 1] for cmd, _ in started] == ["prefill", "decode", "decode"]
    # one GPU each, round robin over the two; the secret in the environment only
    assert [env["CUDA_VISIBLE_DEVICES"] for _, env in started] == ["0", "1", "0"]
    assert all(env["QWEN35_JAX_SECRET"] == "s" * 32 for _, env in started)
    assert not any("s" * 32 in " ".join(cmd) for cmd, _ in started)
    # what an aggregated server beside the stack gets (bench.disagg --compare-aggregated)
    assert launcher.without_flags(argv, launcher.LAUNCHER_FLAGS) == [
        "--model", "tiny", "--port", "8000", "--max-num-seqs", "4"]


def test_data_parallel_size_and_chosen_worker_ports(monkeypatch):
    """-dp N starts N workers of each role unless a role's count is given; with
    --worker-base-port P worker i listens on P + 2i and shakes hands on P + 2i + 1."""
    workers, started = _started(monkeypatch, ["--model", "tiny", "-dp", "2",
                                              "--decode-workers", "1",
                                              "--worker-base-port", "9100"])
    assert len(workers.urls["prefill"]) == 2 and len(workers.urls["decode"]) == 1
    ports = [(cmd[cmd.index("--port") + 1], cmd[cmd.index("--transfer-port") + 1])
             for cmd, _ in started]
    assert ports == [("9100", "9101"), ("9102", "9103"), ("9104", "9105")]
    assert workers.urls["decode"] == ["http://127.0.0.1:9104"]


def test_the_api_key_and_restart_flags_stay_with_the_launcher():
    import serving.__main__ as launcher

    argv = ["--model", "tiny", "--api-key", "k", "--max-worker-restarts", "2",
            "--enable-auto-tool-choice", "--tool-call-parser", "hermes",
            "--max-queued-requests", "7", "--stream-interval", "4", "--timeout-keep-alive", "30"]
    args = launcher.parse(argv)
    assert launcher.worker_flags(args, argv) == ["--model", "tiny", "--max-queued-requests", "7"]


@pytest.mark.parametrize("argv, message", [
    (["--model", "tiny", "--bogus"], "unrecognized arguments: --bogus"),
    (["--model", "tiny", "--max-num-seqs", "4x"], "invalid int value: '4x'"),
    (["--model", "tiny", "--decode-args", "--lease-ttl 1 --nope"], "unrecognized arguments: --nope"),
])
def test_a_bad_flag_fails_at_once_before_any_worker_starts(argv, message):
    r = subprocess.run([sys.executable, "-m", "serving", *argv], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr


@pytest.mark.parametrize("module", ["serving", "serving.api", "serving.worker"])
def test_help_answers_without_importing_jax(module):
    probe = ("import runpy, sys\n"
             f"sys.argv = ['{module}', '--help']\n"
             "try:\n"
             f"    runpy.run_module('{module}', run_name='__main__', alter_sys=True)\n"
             "except SystemExit as e:\n"
             "    assert e.code == 0, e.code\n"
             "print('JAX' if 'jax' in sys.modules else 'no JAX')\n")
    r = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "--max-num-seqs" in r.stdout and r.stdout.strip().endswith("no JAX"), r.stdout[-300:]
    # a worker lists no flag of the OpenAI layer, which the launcher keeps from it
    api_only = ["--api-key", "--served-model-name", *sorted(API_FLAGS | API_SWITCHES)]
    listed = [f for f in api_only if f in r.stdout]
    assert listed == ([] if module == "serving.worker" else api_only), listed


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
