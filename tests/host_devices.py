"""Run a test module as a child process with 8 CPU host devices, reading its JSON records.

A process fixes its device count when JAX starts, and the suite's own process has one
device; tests that need a mesh therefore run their module as a script in a child started
with ``--xla_force_host_platform_device_count=8``, which prints one JSON record per line,
each with a ``key``."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def child_records(script: str, *args: str, timeout: float = 600) -> dict[str, dict]:
    """``python script *args`` on 8 host devices; its records by key."""
    env = dict(os.environ, XLA_FLAGS="--xla_force_host_platform_device_count=8",
               JAX_PLATFORMS="cpu", PYTHONPATH=ROOT)
    proc = subprocess.run([sys.executable, os.path.abspath(script), *args], env=env, cwd=ROOT,
                          capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return {r["key"]: r for r in map(json.loads, proc.stdout.splitlines())}
