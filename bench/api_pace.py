"""How many token events the API server's loop and the load generator carry, without a
model: a stand-in engine that gives every running request one token a step, every
`--step-ms`, behind the real ``AsyncEngine`` and app (a child process), driven by
``bench.load.run_level`` as ``bench.disagg`` drives a server.

    python -m bench.api_pace --step-ms 40 20 10 --concurrency 256 --num-prompts 512

Each row puts the run beside its floor: the stand-in's own pace (every request its
`--output-len` steps, `concurrency` at a time) and reports the CPU seconds each process
spent, so a row far above its floor names the side that fell behind: the server (its
loop or the engine thread, one GIL) or the client (bench/RESULTS.md, "The load
generator's own pace").
"""

from __future__ import annotations

import argparse
import asyncio
import math
import os
import subprocess
import sys
import time
from types import SimpleNamespace

import numpy as np

from bench.load import dataset, run_level
from serving.engine import RequestOutput

# token ids the built-in tokenizer decodes to single letters, so every token streams as text
LETTERS = list(range(35, 61))


class PacedEngine:
    """The ``Engine`` methods ``AsyncEngine`` calls: each step (``step_s``, slept as a
    device step is waited for, in ``waits`` parts, after each of which the host works
    ``host_s`` a running request, spread over the parts: Python holding the GIL) admits
    waiting requests up to ``max_num_seqs`` and gives every running one its next token."""

    def __init__(self, step_s: float, max_num_seqs: int, waits: int = 1, host_s: float = 0.0):
        self.step_s, self.max_num_seqs = step_s, max_num_seqs
        self.waits, self.host_s = waits, host_s
        self.step_time = 0.0  # the steps' wall time, host work and GIL waits included
        self.config = SimpleNamespace(max_model_len=1 << 20, max_logprobs=0, num_blocks=1,
                                      num_slots=1)
        self.waiting: list = []
        self.running: dict[str, tuple] = {}
        self.steps = 0

    def add_request(self, prompt, params, request_id, **_):
        self.waiting.append((request_id, list(prompt), params.max_tokens, []))
        return request_id

    def abort(self, request_id):
        """The request's last output (finish "abort"), or None if it had ended."""
        r = self.running.pop(request_id, None)
        if r is None:
            r = next((w for w in self.waiting if w[0] == request_id), None)
            self.waiting = [w for w in self.waiting if w[0] != request_id]
        if r is None:
            return None
        rid, prompt, _, tokens = r
        return RequestOutput(rid, prompt, tokens, [], True, finish_reason="abort")

    def has_steps(self):
        return bool(self.running or self.waiting)

    def step(self):
        start = time.perf_counter()
        for _ in range(self.waits):
            time.sleep(self.step_s / self.waits)
            end = time.perf_counter() + self.host_s * len(self.running) / self.waits
            while time.perf_counter() < end:
                pass
        self.step_time += time.perf_counter() - start
        self.steps += 1
        free = self.max_num_seqs - len(self.running)
        for r in self.waiting[:free]:
            self.running[r[0]] = r
        self.waiting = self.waiting[free:]
        outs = []
        for rid, prompt, n, tokens in list(self.running.values()):
            tokens.append(LETTERS[len(tokens) % len(LETTERS)])
            done = len(tokens) >= n
            if done:
                del self.running[rid]
            outs.append(RequestOutput(rid, prompt, tokens, tokens[-1:], done,
                                      finish_reason="length" if done else None))
        return outs

    def metrics(self):
        return {"num_running": len(self.running), "num_waiting": len(self.waiting),
                "free_blocks": 1, "free_slots": 1, "kv_cache_usage": 0.0,
                "kv_bytes_in_use": 0, "state_bytes_in_use": 0, "num_preemptions": 0,
                "serving_compiles": 0, "prefix_cache_queries": 0, "prefix_cache_hits": 0,
                "device_busy_s": self.step_time, "device_steps": self.steps}

    def close(self):
        pass


def serve(port: int, args) -> None:
    import uvicorn

    from serving.api.app import build_app
    from serving.api.text import BUILTIN_TOKENIZER, Tokenizer
    from serving.async_engine import AsyncEngine

    engine = AsyncEngine(PacedEngine(args.step_ms[0] / 1e3, args.concurrency, args.waits,
                                     args.host_us / 1e6))
    if args.gil_switch_ms is not None:  # in place of AsyncEngine's
        sys.setswitchinterval(args.gil_switch_ms / 1e3)
    app = build_app(engine, Tokenizer(BUILTIN_TOKENIZER), "paced")
    uvicorn.run(app, host="127.0.0.1", port=port, log_level="warning")


def cpu_seconds(pid: int) -> float:
    """User plus system CPU seconds of a live process (Linux)."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def one_level(args, step_ms: float) -> dict:
    from serving.__main__ import wait_ready
    from serving.ports import free_port

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    stand_in = ["--step-ms", str(step_ms), "--concurrency", str(args.concurrency), "--waits",
                str(args.waits), "--host-us", str(args.host_us)]
    if args.gil_switch_ms is not None:
        stand_in += ["--gil-switch-ms", str(args.gil_switch_ms)]
    server = subprocess.Popen([sys.executable, "-m", "bench.api_pace", "--serve", str(port),
                               *stand_in])
    try:
        wait_ready([server], [url], 120)
        data = [(p, args.output_len) for p, _ in dataset(
            args.num_prompts, args.input_len, args.output_len, 0.0, "vllm", 500, seed=[1, 0])]
        server_cpu, client_cpu = cpu_seconds(server.pid), time.process_time()
        results, duration, counters = asyncio.run(run_level(url, "paced", data,
                                                            args.concurrency, True, ""))
        server_cpu = cpu_seconds(server.pid) - server_cpu
        client_cpu = time.process_time() - client_cpu
    finally:
        server.terminate()
        server.wait()
    ok = [r for r in results if r.ok]
    errors = sorted({r.error for r in results if not r.ok})
    ttft = np.array([r.ttft for r in ok] or [np.nan])  # nan: no request succeeded
    itl = np.array([t for r in ok for t in r.itl] or [np.nan])
    floor = math.ceil(args.num_prompts / args.concurrency) * args.output_len * step_ms / 1e3
    tokens = sum(r.output_tokens for r in results)
    busy, steps = (counters.get(f"qwen35:device_{k}_total{{aggregated}}", 0.0)
                   for k in ("busy_seconds", "steps"))
    return dict(ok=f"{len(ok)}/{len(results)}", errors=errors, step_ms=step_ms,
                mean_step_ms=busy / steps * 1e3 if steps else float("nan"),
                offered=args.concurrency / step_ms * 1e3, tokens=tokens / duration,
                duration=duration, floor=floor, ttft=ttft.mean(), ttft99=np.percentile(ttft, 99),
                itl=np.median(itl) * 1e3, itl99=np.percentile(itl, 99) * 1e3,
                server_cpu=server_cpu, client_cpu=client_cpu)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[40.0, 20.0])
    p.add_argument("--concurrency", type=int, default=256, help="also the stand-in's batch")
    p.add_argument("--num-prompts", type=int, default=512)
    p.add_argument("--input-len", type=int, default=1024)
    p.add_argument("--output-len", type=int, default=128)
    p.add_argument("--waits", type=int, default=1, help="device waits a stand-in step")
    p.add_argument("--host-us", type=float, default=0.0,
                   help="the stand-in's host work (Python, GIL held) per running request a step")
    p.add_argument("--gil-switch-ms", type=float, default=None,
                   help="the server's GIL switch interval (default: AsyncEngine's)")
    p.add_argument("--serve", type=int, metavar="PORT", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.serve is not None:
        return serve(args.serve, args)
    print(f"{os.cpu_count()} CPUs; {args.num_prompts} requests of {args.input_len} + "
          f"{args.output_len} tokens, {args.concurrency} at a time")
    switch = "AsyncEngine's" if args.gil_switch_ms is None else f"{args.gil_switch_ms:g} ms"
    print(f"stand-in: {args.waits} waits a step, {args.host_us:g} us of host work a request; "
          f"GIL switch interval {switch}")
    print("| step ms | ok | token events offered /s | delivered /s | duration s (floor) | "
          "stand-in step ms | TTFT mean / p99 s | ITL med / p99 ms | server CPU s | "
          "client CPU s |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for step_ms in args.step_ms:
        r = one_level(args, step_ms)
        print(f"| {r['step_ms']:g} | {r['ok']} | {r['offered']:,.0f} | {r['tokens']:,.0f} | "
              f"{r['duration']:.2f} ({r['floor']:.2f}) | {r['mean_step_ms']:.1f} | "
              f"{r['ttft']:.2f} / {r['ttft99']:.2f} | "
              f"{r['itl']:.1f} / {r['itl99']:.1f} | {r['server_cpu']:.1f} | "
              f"{r['client_cpu']:.1f} |", flush=True)
        for e in r["errors"]:
            print("  failed:", e)


if __name__ == "__main__":
    main()
