"""XLA's persistent compilation cache: compiled step programs kept on disk across starts.

A server compiles every bucket at start-up (minutes for a large model on a GPU); with the
cache a second start of the same model, flags and JAX version reads them back instead.
The entry key covers the program, its shapes and shardings, the compile options and the
backend, so a changed program never loads a stale one. The compile guard still sees a
program read back (JAX reports it as a backend compile), so a shape that escapes the
buckets while serving is reported either way.
"""

import logging
import os

import jax

log = logging.getLogger(__name__)


def use_compilation_cache(path: str | None) -> None:
    """Keep compiled programs in `path` (None or '': no persistent cache)."""
    if not path:
        return
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # every step program, however quick to compile alone: on a CPU each takes about a
    # second and a server has several
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
