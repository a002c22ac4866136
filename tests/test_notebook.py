"""notebooks/quickstart.ipynb runs top to bottom in a fresh kernel, so it cannot rot: its
cells assert that the engine matches transformers and that the disaggregated pair answers
with the same tokens; any cell that raises fails this test."""

from __future__ import annotations

import os
import re

import nbformat
import psutil
from nbclient import NotebookClient

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_quickstart_notebook_runs():
    nb = nbformat.read(os.path.join(REPO, "notebooks", "quickstart.ipynb"), as_version=4)
    # The kernel runs in the repository root, as a user's would after cloning, with this
    # interpreter ("python3" resolves to sys.executable), so it sees the same installs.
    NotebookClient(nb, kernel_name="python3", timeout=600,
                   resources={"metadata": {"path": REPO}}).execute()
    text = "\n".join(o.get("text", "") for c in nb.cells if c.cell_type == "code"
                     for o in c.outputs)
    assert text.count("greedy tokens equal: True") == 2
    assert "'completion_tokens': 12" in text
    assert "stack exited with code 0" in text
    port = re.search(r"starting the stack on http://127\.0\.0\.1:(\d+)", text).group(1)
    left = [p.info["cmdline"] for p in psutil.process_iter(["cmdline"])
            if p.info["cmdline"] and port in p.info["cmdline"]]
    assert left == []
