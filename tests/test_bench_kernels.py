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
    assert any(c["name"].endswith(f"{batched} vs packed o") for c in r["checks"])
