"""``python -m bench.accuracy`` in bfloat16 on the trained model: the disaggregated stack
scores exactly what the aggregated server scores, with token-identical greedy answers
(a trained model has no near-ties to excuse a difference; float32: test_parity)."""

from __future__ import annotations

import json
import subprocess
import sys

from serving.ports import free_port


def test_bf16_disaggregated_answers_are_the_aggregated_ones(tmp_path):
    subprocess.run([sys.executable, "-m", "bench.accuracy", "--model", "tiny-math",
                    "--dtypes", "bfloat16", "--layouts", "aggregated", "disaggregated",
                    "--num-problems", "32", "--concurrency", "4", "--port", str(free_port()),
                    "--result-dir", str(tmp_path)], check=True, timeout=900)
    agg, disagg = json.loads((tmp_path / "accuracy.json").read_text())
    assert (agg["layout"], disagg["layout"]) == ("aggregated", "disaggregated")
    assert agg["exact"] >= 0.9
    assert disagg["correct"] == agg["correct"]
    assert disagg["agreement"]["identical"] == disagg["agreement"]["of"] == 32, disagg["agreement"]
