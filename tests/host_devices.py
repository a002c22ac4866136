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

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def xla_flags(devices: int = 8) -> str:
    """This process's XLA flags with ``devices`` host devices."""
    return f"{os.environ.get('XLA_FLAGS', '')} --xla_force_host_platform_device_count={devices}"


def start_child(script: str, *args: str) -> subprocess.Popen:
    """Start ``python script *args`` on 8 host devices without waiting for it, so that
    several children can run at once; ``child_result`` collects its records. Its output
    goes to files, not pipes: a child must never block on a pipe nobody reads yet.

    A child compiles at LLVM optimisation level 0: it compiles many programs and runs
    each once or a few times, and compares only results it computed itself, so level 0's
    faster compile is all gain (test_sharding's children: bench/RESULTS.md, "The
    suite")."""
    env = dict(os.environ, XLA_FLAGS=xla_flags() + " --xla_backend_optimization_level=0",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    out, err = tempfile.TemporaryFile("w+"), tempfile.TemporaryFile("w+")
    proc = subprocess.Popen([sys.executable, os.path.abspath(script), *args], env=env, cwd=ROOT,
                            stdout=out, stderr=err)
    proc.out, proc.err = out, err
    return proc


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
