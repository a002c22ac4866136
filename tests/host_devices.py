"""Run a test module as a child process with 8 CPU host devices, reading its JSON records.

A process fixes its device count when JAX starts, and the suite's own process has one
device; tests that need a mesh therefore run their module as a script in a child started
with ``--xla_force_host_platform_device_count=8``, which prints one JSON record per line,
each with a ``key``."""

import json
import os
import subprocess
import sys
import tempfile
import threading

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def xla_flags(devices: int = 8, environ=None) -> str:
    """The XLA flags of ``environ`` (this process's by default) with ``devices`` host
    devices."""
    base = (os.environ if environ is None else environ).get("XLA_FLAGS", "")
    return f"{base} --xla_force_host_platform_device_count={devices}"


def start_child(script: str, *args: str) -> subprocess.Popen:
    """Start ``python script *args`` on 8 host devices without waiting for it, so that
    several children can run at once; ``child_result`` collects its records. Its output
    goes to files, not pipes: a child must never block on a pipe nobody reads yet.

    A child compiles at LLVM optimisation level 0: it compiles many programs and runs
    each once or a few times, and compares only results it computed itself, so level 0's
    faster compile is all gain (test_sharding's children: bench/RESULTS.md, "The
    suite").

    A child the session started ahead (``AHEAD``: a module's ``AHEAD_CHILDREN``) is
    handed over, running or done, instead of a new one."""
    return AHEAD.take(script, args) or _start(script, args, dict(os.environ))


def _start(script: str, args: tuple[str, ...], environ: dict, nice: int = 0) -> subprocess.Popen:
    env = dict(environ, XLA_FLAGS=xla_flags(environ=environ) + " --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    niced = ["nice", "-n", str(nice)] if nice else []  # nice execs python: proc.pid is its pid
    proc = subprocess.Popen([*niced, sys.executable, os.path.abspath(script), *args], env=env,
                            cwd=ROOT, stdout=out, stderr=err)
    proc.out, proc.err = out, err
    return proc


class Ahead:
    """Children started ahead of the tests that read them, at the lowest CPU priority
    (nice 19), ``at_once`` at a time.

    The suite keeps the 2-core machine's cores busy 1.5 of 2 on average: the modules
    that run in this process (tracing, lowering, stepping tiny engines) leave the second
    core idle much of the time. The host-device children (a few hundred CPU-seconds of
    compiling, test_sharding's seven most of it) compute only records that they compare
    themselves, whenever they run, so the conftest queues them here when the session's
    tests are collected (``submit``, in the order their modules will run): they take the
    idle core while the modules before theirs run, and yield it to any other process at
    once (nice 19). A module's fixture then takes its children (``take``: running or
    done; one still queued is started then, at normal priority, as before) and reads
    their records as it always did. At most ``at_once`` run ahead, which bounds the
    memory they hold beside the suite's (~1.5 GiB each)."""

    def __init__(self, at_once: int = 2):
        self.at_once = at_once
        self.queued: list[tuple[str, tuple[str, ...]]] = []
        self.started: dict[tuple[str, tuple[str, ...]], subprocess.Popen] = {}
        self.environ: dict = {}
        self.cond = threading.Condition()
        self.thread: threading.Thread | None = None
        self.closed = False

    def submit(self, jobs: list[tuple[str, tuple[str, ...]]]) -> None:
        """Queue ``(script, args)`` children; ``os.environ`` as it is now is theirs (a
        test's monkeypatched variables later are not)."""
        with self.cond:
            self.environ = dict(os.environ)
            self.queued += [(os.path.abspath(script), tuple(args)) for script, args in jobs]
            if (self.thread is None or not self.thread.is_alive()) and self.queued:
                self.thread = threading.Thread(target=self._run, name="host-devices-ahead",
                                               daemon=True)
                self.thread.start()
            self.cond.notify_all()

    def _run(self) -> None:
        with self.cond:
            while not self.closed and self.queued:
                running = sum(p.poll() is None for p in self.started.values())
                if running >= self.at_once:
                    self.cond.wait(timeout=1.0)
                    continue
                key = self.queued.pop(0)
                self.started[key] = _start(*key, self.environ, nice=19)

    def take(self, script: str, args: tuple[str, ...]) -> subprocess.Popen | None:
        """The child of ``script args`` started ahead (now its caller's), else None, which
        also drops it from the queue: the caller starts it."""
        key = (os.path.abspath(script), tuple(args))
        with self.cond:
            if key in self.queued:
                self.queued.remove(key)
            proc = self.started.pop(key, None)
            self.cond.notify_all()
            return proc

    def close(self) -> None:
        """Stop starting children, and kill those nobody took."""
        with self.cond:
            self.closed, self.queued = True, []
            procs, self.started = list(self.started.values()), {}
            self.cond.notify_all()
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
            proc.wait()


AHEAD = Ahead()


def child_result(proc: subprocess.Popen, timeout: float = 600) -> dict[str, dict]:
    """Wait for a child of ``start_child``; its records by key."""
    try:
        proc.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        raise
    proc.out.seek(0)
    proc.err.seek(0)
    assert proc.returncode == 0, proc.err.read()[-4000:]
    return {r["key"]: r for r in map(json.loads, proc.out.read().splitlines())}


def child_records(script: str, *args: str, timeout: float = 600) -> dict[str, dict]:
    """``python script *args`` on 8 host devices; its records by key."""
    return child_result(start_child(script, *args), timeout)
