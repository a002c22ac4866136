"""Histogram counts that add up across processes.

A worker observes per-step and per-transfer values, but `/metrics` is served by the
router: each worker keeps `BucketCounts` and reports their `state()` in its `/stats`,
the router adds the states of all workers (`add`), and the metrics collector renders the
sum as one Prometheus histogram.
"""

from __future__ import annotations

import bisect

# vLLM's buckets for the same quantities
ITERATION_TOKENS = (1, 8, 16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384)
TRANSFER_SECONDS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.2, 0.3, 0.5, 0.75, 1.0, 5.0)
TRANSFER_BYTES = tuple(2 ** i for i in range(10, 36, 2))  # 1 KiB .. 32 GiB
TRANSFER_DESCRIPTORS = (1, 2, 4, 8, 16, 32, 64, 128, 256, 512, 1024, 4096, 16384)


class BucketCounts:
    def __init__(self, bounds):
        self.bounds = tuple(bounds)
        self.counts = [0] * (len(self.bounds) + 1)  # the last: above every bound
        self.sum = 0.0

    def observe(self, value: float) -> None:
        self.counts[bisect.bisect_left(self.bounds, value)] += 1
        self.sum += value

    def state(self) -> dict:
        return {"bounds": list(self.bounds), "counts": list(self.counts), "sum": self.sum}


def add(states: list[dict | None]) -> dict | None:
    """The sum of `state()`s of equal bounds (None: nothing to add)."""
    states = [s for s in states if s]
    if not states:
        return None
    bounds = states[0]["bounds"]
    if any(s["bounds"] != bounds for s in states):
        raise ValueError("histograms with different bounds do not add")
    return {"bounds": bounds, "counts": [sum(c) for c in zip(*(s["counts"] for s in states))],
            "sum": sum(s["sum"] for s in states)}


def cumulative(state: dict) -> list[tuple[str, int]]:
    """Prometheus `le` buckets of a state: (bound, observations at or below it)."""
    out, total = [], 0
    for bound, count in zip([*state["bounds"], float("inf")], state["counts"]):
        total += count
        out.append(("+Inf" if bound == float("inf") else repr(float(bound)), total))
    return out
