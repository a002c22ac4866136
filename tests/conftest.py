import atexit
import os
import shutil
import sys
import tempfile

# The suite runs on CPU; several tests need more than one host device.
os.environ.setdefault("JAX_PLATFORMS", "cpu")

# This process and every JAX process the tests start (workers, launchers, the sharding
# checks, the notebook's kernel) share one persistent compilation cache, new for the
# session, holding every program however short its compile: a program compiled once, by
# any of them, is loaded wherever it comes again. Set before ``import jax``, which reads
# it. A program loaded from the cache still emits JAX's backend-compile event, so the
# compile guard counts it as before.
_CACHE = tempfile.mkdtemp(prefix="jax-cache-")
os.environ.update(JAX_COMPILATION_CACHE_DIR=_CACHE, JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS="0")
atexit.register(shutil.rmtree, _CACHE, ignore_errors=True)

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


def pytest_collection_finish(session):
    """Start the host-device children of the collected modules that name them
    (``AHEAD_CHILDREN``: argument tuples of the module run as a script) ahead, in the order
    the modules run, at the lowest CPU priority (``host_devices.Ahead``)."""
    if session.config.option.collectonly or "PYTEST_XDIST_WORKER" in os.environ:
        return  # (an xdist worker collects every module but runs only some)
    from host_devices import AHEAD

    jobs, seen = [], set()
    for item in session.items:
        module = getattr(item, "module", None)
        if module is None or module.__name__ in seen:
            continue
        seen.add(module.__name__)
        jobs += [(module.__file__, tuple(args)) for args in getattr(module, "AHEAD_CHILDREN", ())]
    AHEAD.submit(jobs)


def pytest_sessionfinish(session):
    from host_devices import AHEAD

    AHEAD.close()
