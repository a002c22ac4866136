"""``bench.kernels`` gives its figures on the GPU only, where a broken benchmark costs
device time. Its dry run (tiny shapes, the kernels in Pallas interpret mode) keeps the
benchmark's own code working between device calls."""
import collections
import json
import subprocess
import sys


def test_decode_configs_are_checked_then_timed(tmp_path):
    """--decode-configs times each config on every shape and state width, each checked
    against the reference first."""
    cfg = {"programs_per_sm": 2, "stages": 3}
    subprocess.run([sys.executable, "-m", "bench.kernels", "--tiny", "--backend", "interpret",
                    "--parts", "decode", "--no-fla", "--decode-configs", json.dumps([None, cfg]),
                    "--out", str(tmp_path)], check=True, capture_output=True, timeout=600)
    r = json.loads((tmp_path / "bench.json").read_text())
    assert not r["errors"]
    labels = ["ours pallas default", "ours pallas " + json.dumps(cfg, separators=(",", ":"))]
    rows = {(row["shape"], row["impl"]) for row in r["rows"] if row["kind"] == "decode"}
    shapes = {shape for shape, _ in rows}
    assert len(shapes) == 4  # two batch shapes x two state widths
    assert {(s, lab) for s in shapes for lab in labels} <= rows
    checked = {c["name"] for c in r["checks"] if c["ok"]}
    assert len(r["checks"]) == len(checked) == 16  # o and pool, per shape and config
    assert all(f"{s} {lab} {part}" in checked for s in shapes for lab in labels
               for part in ("o", "pool"))


def test_prefill_rows_packed_and_batched_as_fla(tmp_path):
    """Sequences of one length are timed packed (cu_seqlens) and batched as FLA is
    called (no cu_seqlens), the batched output checked against the packed one first."""
    subprocess.run([sys.executable, "-m", "bench.kernels", "--tiny", "--backend", "interpret",
                    "--parts", "prefill", "--no-fla", "--out", str(tmp_path)],
                   check=True, capture_output=True, timeout=600)
    r = json.loads((tmp_path / "bench.json").read_text())
    assert not r["errors"]
    assert r["checks"] and all(c["ok"] for c in r["checks"])
    impls = collections.defaultdict(set)
    for row in r["rows"]:
        impls[row["shape"]].add(row["impl"])
    batched = "ours, batched as FLA (no cu_seqlens)"
    # the tiny shapes: one of mixed lengths (packed only), one of equal lengths (both)
    assert [batched in i for i in impls.values()] == [False, True]
    assert all("ours pallas default" in i for i in impls.values())
    for part in ("o", "state"):
        assert any(c["name"].endswith(f"{batched} vs packed {part}") for c in r["checks"])


def test_last_call_lists_one_calls_kernels_with_the_gaps_before_them():
    """Two calls of three kernels (start, duration in us; the trace's are in ns): the
    second call's kernels, each with the idle time since the previous kernel ended."""
    from bench.profile import last_call
    us = [(0, 10, "a"), (12, 5, "fusion_1"), (20, 30, "b"),
          (53, 10, "a"), (66, 5, "fusion_2"), (75, 30, "b")]
    events = [(t * 1000, d * 1000, name) for t, d, name in us]
    lines = last_call(events, 2).splitlines()[2:]
    cells = [[c.strip(" `") for c in ln.strip("|").split("|")] for ln in lines]
    assert [c[0] for c in cells] == ["a", "fusion#", "b"]
    assert [float(c[1]) for c in cells] == [3.0, 3.0, 4.0]
    assert [float(c[2]) for c in cells] == [10.0, 5.0, 30.0]
