"""Where device time goes: run a callable under ``jax.profiler``, read the trace back
with ``jax.profiler.ProfileData`` and sum each device's kernel time by kernel name.

    rows = kernel_times(lambda: engine.generate(prompts, params), "/tmp/trace")

``difference(a, b, n)`` gives (a - b) / n per kernel: ``bench.decode_step`` traces a run
of 1 + n tokens and a run of 1 token, so the prefill and start-up cancel and what is left
is one decode step's kernels. ``busy`` beside the wall time tells a device-bound step
(busy close to the wall time) from a host-bound one (gaps between kernels).

On CPU the trace has no device plane: the result is empty and the caller says so.
"""

import glob
import os
import re
import tempfile
import time

_DIGITS = re.compile(r"(?<=[._])\d+|_\d+$")


def kernel_group(name: str) -> str:
    """A kernel's name without the instance numbers XLA appends (``fusion_12`` and
    ``fusion_7`` are one row), cut to a readable length."""
    return _DIGITS.sub("#", name)[:90]


def _device_events(path: str):
    """(kernel name, start ns, duration ns) of every kernel on every device stream."""
    import jax

    data = jax.profiler.ProfileData.from_file(path)
    for plane in data.planes:
        if not plane.name.startswith("/device:"):
            continue
        for line in plane.lines:
            if not line.name.startswith("Stream"):
                continue  # derived lines ("XLA Ops", "XLA Modules") repeat the kernels
            for ev in line.events:
                yield ev.name, ev.start_ns, ev.duration_ns


def _busy_ns(intervals) -> float:
    """Length of the union of [start, start + duration) intervals."""
    total, end = 0.0, float("-inf")
    for start, dur in sorted(intervals):
        if start + dur <= end:
            continue
        total += start + dur - max(start, end)
        end = start + dur
    return total


def kernel_times(fn, logdir: str | None = None) -> dict:
    """Trace one call of `fn`; returns wall seconds, device-busy seconds and, per kernel
    group, calls and seconds (summed over devices)."""
    import jax

    logdir = logdir or tempfile.mkdtemp(prefix="trace-")
    before = set(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True))
    jax.profiler.start_trace(logdir)
    t0 = time.perf_counter()
    try:
        fn()
    finally:
        wall = time.perf_counter() - t0
        jax.profiler.stop_trace()
    new = set(glob.glob(os.path.join(logdir, "**", "*.xplane.pb"), recursive=True)) - before
    kernels: dict[str, list] = {}
    events = []
    for path in new:
        for name, start, dur in _device_events(path):
            row = kernels.setdefault(kernel_group(name), [0, 0.0])
            row[0] += 1
            row[1] += dur * 1e-9
            events.append((start, dur, name))
    events.sort()
    return {"wall_s": wall, "busy_s": _busy_ns([e[:2] for e in events]) * 1e-9,
            "kernels": {k: {"calls": c, "s": s} for k, (c, s) in kernels.items()},
            "events": events}


def last_call(events, n_calls: int) -> str:
    """Markdown: the kernels of the last of `n_calls` identical calls in start order,
    each with the idle time before it on the device (the first: since the call
    before). Tells launch gaps that sit between particular kernels from even ones.
    Only meaningful for one device and one stream, where the calls do not overlap."""
    k = len(events) // max(n_calls, 1)
    if not k:
        return ""
    lines = ["| kernel | gap before, us | us |", "|---|---|---|"]
    prev_end = events[-k - 1][0] + events[-k - 1][1] if len(events) > k else events[-k][0]
    for start, dur, name in events[-k:]:
        lines.append(f"| `{kernel_group(name)}` | {(start - prev_end) / 1e3:.1f} | {dur / 1e3:.1f} |")
        prev_end = max(prev_end, start + dur)
    return "\n".join(lines)


def difference(a: dict, b: dict, n: int) -> dict:
    """(a - b) / n for wall, busy and every kernel group: the cost of what `a` ran and
    `b` did not, per unit."""
    names = set(a["kernels"]) | set(b["kernels"])
    zero = {"calls": 0, "s": 0.0}
    kernels = {k: {f: (a["kernels"].get(k, zero)[f] - b["kernels"].get(k, zero)[f]) / n
                   for f in ("calls", "s")} for k in names}
    return {"wall_s": (a["wall_s"] - b["wall_s"]) / n, "busy_s": (a["busy_s"] - b["busy_s"]) / n,
            "kernels": kernels}


def table(result: dict, top: int = 25) -> str:
    """Markdown: the `top` kernel groups by time, their share of the busy time, and the
    wall and busy totals."""
    busy = result["busy_s"] or float("nan")
    rows = sorted(result["kernels"].items(), key=lambda kv: -kv[1]["s"])
    lines = [f"wall {1e3 * result['wall_s']:.2f} ms, device busy {1e3 * result['busy_s']:.2f} ms "
             f"({result['busy_s'] / result['wall_s']:.0%} of wall)" if result["wall_s"] else "",
             "| kernel | calls | ms | share of busy |", "|---|---|---|---|"]
    for name, r in rows[:top]:
        lines.append(f"| `{name}` | {r['calls']:.1f} | {1e3 * r['s']:.3f} | {r['s'] / busy:.1%} |")
    rest = sum(r["s"] for _, r in rows[top:])
    if rest:
        lines.append(f"| ({len(rows) - top} more) | | {1e3 * rest:.3f} | {rest / busy:.1%} |")
    return "\n".join(lines)
