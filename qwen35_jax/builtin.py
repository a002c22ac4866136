"""The checkpoints that ship with the package: trained ``tiny-math`` models.

``python -m qwen35_jax.train`` writes them (bench/RESULTS.md records how each was
trained); a name here stands for its directory wherever a checkpoint path is taken
(``--model tiny-math``, ``LLM("tiny-math")``), and that directory is read by the same
loader as any Hugging Face checkpoint.
"""

from __future__ import annotations

import os

CHECKPOINTS = os.path.join(os.path.dirname(os.path.abspath(__file__)), "checkpoints")
NAMES = ("tiny-math", "tiny-math-moe")


def resolve(model):
    """The directory of a built-in checkpoint named ``model``; anything else unchanged."""
    if isinstance(model, str) and model in NAMES:
        return os.path.join(CHECKPOINTS, model)
    return model
