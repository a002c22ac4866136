"""`python -m serving`: the whole disaggregated stack in one command.

    python -m serving --model tiny                     # CPU, the small built-in model
    python -m serving --model /ckpt/Qwen3.5-35B-A3B --prefill-workers 1 --decode-workers 1

Starts the prefill and decode workers (``python -m serving.worker``) as child
processes (on a machine with GPUs, each on its own: worker i, prefill workers
first, sees GPU i mod the GPU count), waits until each has compiled its
programs and answers, then serves the OpenAI API on ``--port`` through the router.  Ctrl-C (or SIGTERM) stops the
server and every worker.  Engine flags are those of ``python -m serving.api``;
they and the transfer flags of ``python -m serving.worker`` (``--lease-ttl``,
``--transfer-timeout``, ``--on-transfer-failure``, ``--transfer-interface``) are passed
to every worker, and ``--prefill-args`` / ``--decode-args`` add flags for one role (its
own batch limits or mesh, say). Every flag is checked here, before any process starts:
a mistyped one fails at once. ``--data-parallel-size N`` starts N workers of each role
(unless ``--prefill-workers`` / ``--decode-workers`` say otherwise); ``--worker-base-port
P`` puts worker i on HTTP port P + 2i and its transfer handshake on P + 2i + 1 (default:
free ports).

The router and the workers share a secret generated here for this start and handed to
the workers in their environment (``serving.secret``), never on a command line; clients
authenticate with ``--api-key`` (or ``VLLM_API_KEY``), which the workers never see.

A worker that dies is restarted on its port, up to ``--max-worker-restarts`` times in
all (each logged); past that, or with 0, the launcher stops everything and exits with
status 1, for a supervisor (systemd, Kubernetes) to act on.
"""

from __future__ import annotations

import argparse
import logging
import os
import shlex
import signal
import subprocess
import sys
import time

import threading

import httpx
import tenacity

from serving import secret as shared_secret
from serving.flags import API_FLAGS, API_SWITCHES, add_worker_flags, server_parser
from serving.ports import free_port

log = logging.getLogger("serving")
GRACE_SECONDS = 5  # uvicorn waits this long for open streams on shutdown


# Flags of the launcher alone: the aggregated server (``python -m serving.api``) has none.
LAUNCHER_FLAGS = frozenset({"--prefill-workers", "--decode-workers", "--prefill-args",
                            "--decode-args", "--max-worker-restarts", "--data-parallel-size",
                            "-dp", "--worker-base-port"})


def without_flags(argv: list[str], names, switches=frozenset()) -> list[str]:
    """`argv` without the flags in `names` and their values (``--f v`` or ``--f=v``), and
    without the flags in `switches`, which take none."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
            continue
        if a in switches:
            continue
        if a.split("=", 1)[0] in names:
            skip = "=" not in a
            continue
        out.append(a)
    return out


def worker_flags(args, argv: list[str]) -> list[str]:
    """The engine flags given on our command line, passed through to the workers."""
    return without_flags(argv, LAUNCHER_FLAGS | API_FLAGS | {
        "--port", "--host", "--startup-timeout"}, switches=API_SWITCHES)


def gpus() -> list[str]:
    """The GPUs this process may use, found without starting CUDA (the router needs none):
    ``CUDA_VISIBLE_DEVICES`` when set, else the NVIDIA driver's device list."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    if visible is not None:
        return [d.strip() for d in visible.split(",") if d.strip()]
    try:
        return [str(i) for i in range(len(os.listdir("/proc/driver/nvidia/gpus")))]
    except OSError:
        return []


class Workers:
    """The worker processes: worker i sees only GPU i mod the GPU count
    (``CUDA_VISIBLE_DEVICES``; NIXL still reaches a peer's memory on another GPU, since CUDA
    opens IPC handles of devices a process does not see), and the shared secret in its
    environment."""

    def __init__(self, args, flags: list[str], secret: str):
        self.procs: dict[str, subprocess.Popen] = {}
        self.commands: dict[str, tuple[list[str], dict]] = {}
        self.urls: dict[str, list[str]] = {"prefill": [], "decode": []}
        devices = gpus()
        for role, n in (("prefill", args.prefill_workers), ("decode", args.decode_workers)):
            for _ in range(n):
                ports = ["--port", str(free_port())]
                if args.worker_base_port is not None:
                    base = args.worker_base_port + 2 * len(self.commands)
                    ports = ["--port", str(base), "--transfer-port", str(base + 1)]
                port = int(ports[1])
                cmd = [sys.executable, "-m", "serving.worker", "--role", role, *flags, *ports,
                       *shlex.split(getattr(args, f"{role}_args"))]
                env = {**os.environ, shared_secret.ENV: secret}
                env.pop(shared_secret.ENV_FILE, None)
                if devices:
                    env["CUDA_VISIBLE_DEVICES"] = devices[len(self.commands) % len(devices)]
                url = f"http://127.0.0.1:{port}"
                self.commands[url] = (cmd, env)
                self.urls[role].append(url)
                self.start(url)

    def start(self, url: str) -> None:
        cmd, env = self.commands[url]
        self.procs[url] = subprocess.Popen(cmd, start_new_session=True, env=env)

    def stop(self) -> None:
        stop(list(self.procs.values()))


class NotReady(Exception):
    """Servers that do not answer /health with 200 yet."""


def wait_ready(procs, urls, timeout: float, headers: dict | None = None) -> None:
    """Poll each server's /health every half second until all answer 200; SystemExit if
    one's process exits meanwhile or `timeout` seconds pass. One client for all polls: a
    client per poll builds an SSL context each time, which kept a core busy for the
    whole start-up of a CPU stack while the workers compiled."""
    pending = dict(zip(urls, procs))

    def poll(client: httpx.Client) -> None:
        for url, proc in list(pending.items()):
            if proc.poll() is not None:
                raise SystemExit(f"{url}: {' '.join(proc.args)} exited with code "
                                 f"{proc.returncode} during start-up")
            try:
                if client.get(f"{url}/health").status_code == 200:
                    del pending[url]
            except httpx.TransportError:
                pass
        if pending:
            raise NotReady(sorted(pending))

    try:
        with httpx.Client(timeout=1.0, headers=headers) as client:
            tenacity.Retrying(stop=tenacity.stop_after_delay(timeout),
                              wait=tenacity.wait_fixed(0.5),
                              retry=tenacity.retry_if_exception_type(NotReady),
                              reraise=True)(poll, client)
    except NotReady as e:
        raise SystemExit(f"not ready after {timeout:.0f} s: {e}") from None


def stop(procs: list[subprocess.Popen]) -> None:
    for p in procs:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    for p in procs:
        try:
            p.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def supervise(workers: Workers, max_restarts: int, on_give_up, stopping: threading.Event,
              interval: float = 0.5) -> None:
    """Restart workers that exit, on their ports, until ``max_restarts`` restarts in all
    have been spent; then call ``on_give_up(message)`` and return. Runs until
    ``stopping`` is set (on its own thread)."""
    restarts = 0
    while not stopping.wait(interval):
        for url, proc in list(workers.procs.items()):
            code = proc.poll()
            if code is None or stopping.is_set():
                continue
            if restarts >= max_restarts:
                on_give_up(f"worker {url} exited with code {code}; {restarts} of "
                           f"--max-worker-restarts {max_restarts} restarts spent")
                return
            restarts += 1
            log.error("worker %s exited with code %s: restarting it (restart %d of %d)",
                      url, code, restarts, max_restarts)
            workers.start(url)


def parser() -> argparse.ArgumentParser:
    p = add_worker_flags(server_parser("python -m serving", __doc__))
    p.add_argument("--prefill-workers", type=int, default=None, help="default: 1, or -dp")
    p.add_argument("--decode-workers", type=int, default=None, help="default: 1, or -dp")
    p.add_argument("--data-parallel-size", "-dp", type=int, default=1,
                   help="workers of each role (vLLM's data-parallel replicas)")
    p.add_argument("--worker-base-port", type=int, default=None, metavar="PORT",
                   help="worker i: HTTP on PORT + 2i, transfer handshake on PORT + 2i + 1")
    p.add_argument("--startup-timeout", type=float, default=900.0)
    p.add_argument("--prefill-args", default="",
                   help="flags for the prefill workers only, after the shared ones (which "
                        "they override), e.g. '--tp 2 --max-num-seqs 8'")
    p.add_argument("--decode-args", default="", help="the same for the decode workers")
    p.add_argument("--max-worker-restarts", type=int, default=3,
                   help="restarts of workers that died, in all, before the launcher stops "
                        "and exits with status 1 (0: exit at the first death)")
    return p


def parse(argv: list[str]) -> argparse.Namespace:
    """The launcher's flags, and the per-role ones checked as a worker would (argparse
    exits with status 2 and the flag's name on the first mistake)."""
    p = parser()
    args = p.parse_args(argv)
    role_parser = add_worker_flags(server_parser("--prefill-args / --decode-args"))
    for role in ("prefill", "decode"):
        role_parser.parse_args(shlex.split(getattr(args, f"{role}_args")))
        if getattr(args, f"{role}_workers") is None:
            setattr(args, f"{role}_workers", args.data_parallel_size)
    return args


def main(argv=None) -> None:
    argv = list(sys.argv[1:] if argv is None else argv)
    args = parse(argv)  # before the heavy imports: --help and bad flags answer at once
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s router %(levelname)s %(name)s: %(message)s")
    logging.getLogger("httpx").setLevel(logging.WARNING)  # one line per worker poll otherwise
    model = args.model or args.model_tag
    if not model:
        raise SystemExit("give a model: a checkpoint directory or a preset name")
    secret = shared_secret.generate()
    workers = Workers(args, worker_flags(args, argv), secret)
    prefill, decode = workers.urls["prefill"], workers.urls["decode"]
    # A SIGTERM to us stops the workers too, like Ctrl-C does.
    signal.signal(signal.SIGTERM, lambda *_: (_ for _ in ()).throw(KeyboardInterrupt()))
    stopping, failure = threading.Event(), []
    try:
        # Imported once the workers are starting: their start-up overlaps these ~6 s of
        # CPU (JAX, transformers, torch) instead of waiting for them.
        import uvicorn

        from serving.api.app import build_app
        from serving.api.server import api_key, model_root, server_options, uvicorn_config
        from serving.api.text import Tokenizer, find_tokenizer
        from serving.router import Router

        log.info("starting %d prefill and %d decode workers", len(prefill), len(decode))
        wait_ready(list(workers.procs.values()), prefill + decode, args.startup_timeout,
                   shared_secret.header(secret))
        router = Router.from_workers(prefill, decode, secret=secret)
        tokenizer = Tokenizer(find_tokenizer(model, args.tokenizer))
        app = build_app(router, tokenizer, args.served_model_name or model,
                        model_path=model_root(model), api_key=api_key(args),
                        max_request_bytes=args.max_request_bytes,
                        options=server_options(args, model))
        log.info("serving %s on http://%s:%d (prefill %s, decode %s)", model, args.host,
                 args.port, prefill, decode)
        # Open streams must not hold a Ctrl-C or SIGTERM hostage: after the grace period
        # uvicorn closes them, and their requests are aborted.
        server = uvicorn.Server(uvicorn_config(app, args, log_level="warning",
                                               timeout_graceful_shutdown=GRACE_SECONDS))

        def give_up(message: str) -> None:
            log.error("%s: stopping", message)
            failure.append(message)
            server.should_exit = True

        threading.Thread(target=supervise, args=(workers, args.max_worker_restarts, give_up,
                                                 stopping), daemon=True).start()
        server.run()
    except KeyboardInterrupt:
        pass
    finally:
        stopping.set()
        workers.stop()
    if failure:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
