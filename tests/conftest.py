import os
import sys

# The suite runs on CPU; several tests need more than one host device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402  (importing jax starts no backend: the pool below is not sized yet)

if jax.__version_info__ >= (0, 11):
    # JAX's Mosaic GPU interpreter (jax >= 0.11 only) runs a CTA's warpgroups as
    # concurrent XLA CPU computations whose barrier waits hold a thread of XLA's pool,
    # one thread a core by default: on a 2-core machine a kernel of three warpgroups
    # deadlocks. XLA sizes the pool from NPROC where it is set. Not set otherwise: a
    # wider pool also splits CPU reductions differently (a notebook's float32 logits
    # moved 1e-4 -> 1.6e-4 with it).
    os.environ.setdefault("NPROC", "8")
sys.path.insert(0, os.path.dirname(__file__))
