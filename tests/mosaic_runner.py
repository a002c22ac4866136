"""Where the Mosaic GPU kernels' tests run: natively on an sm90 GPU, or in JAX's Mosaic
GPU interpreter, which ships from jax 0.11. With an older jax on the CPU (the CI's
0.10.2) there is neither, so those tests (marked ``gpu``) skip here and run on the GPU
(``python -m bench.kernels --parts check``, ``pytest -m gpu``)."""
from __future__ import annotations

import contextlib

import pytest

import jax

from pallas_kernels.tuning import gpu_arch


def runner():
    """A context that runs Mosaic GPU kernels here, or None."""
    if gpu_arch() == "sm90":
        return contextlib.nullcontext()
    if jax.__version_info__ < (0, 11):
        return None
    from jax.experimental.pallas import mosaic_gpu as plgpu
    mesh = jax.sharding.AbstractMesh((), (), abstract_device=jax.sharding.AbstractDevice(
        device_kind="NVIDIA H100 80GB HBM3", platform="gpu", num_cores=8))
    stack = contextlib.ExitStack()
    stack.enter_context(jax.sharding.use_abstract_mesh(mesh))
    stack.enter_context(plgpu.force_gpu_interpret_mode(plgpu.InterpretGPUParams()))
    return stack


def need_runner():
    """``runner()``, or skip the test where there is none."""
    r = runner()
    if r is None:
        pytest.skip("needs an sm90 GPU or jax >= 0.11 (Mosaic GPU interpreter); "
                    "python -m bench.kernels --parts check runs it on the GPU")
    return r
