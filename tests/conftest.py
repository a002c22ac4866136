import os
import sys

# The suite runs on CPU; several tests need more than one host device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# JAX's Mosaic GPU interpreter (jax >= 0.11) runs a CTA's warpgroups as concurrent XLA
# CPU computations whose barrier waits hold a thread of XLA's pool, one thread a core
# by default: on a 2-core machine a kernel of three warpgroups deadlocks. XLA sizes
# the pool from NPROC where it is set.
os.environ.setdefault("NPROC", "8")
sys.path.insert(0, os.path.dirname(__file__))
