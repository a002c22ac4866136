"""XLA's persistent compilation cache: compiled step programs kept on disk across starts.

A server compiles every bucket at start-up (minutes for a large model on a GPU); with the
cache a second start of the same model, flags and JAX version reads them back instead.
The entry key covers the program, its shapes and shardings, the compile options and the
backend, so a changed program never loads a stale one. The compile guard still sees a
program read back (JAX reports it as a backend compile), so a shape that escapes the
buckets while serving is reported either way.
"""

import os

import jax

from serving.flags import DEFAULT_COMPILATION_CACHE


def use_compilation_cache(path: str | None = None) -> None:
    """Keep compiled programs in `path`; None: where JAX is told to already
    (``JAX_COMPILATION_CACHE_DIR``, as the test suite sets for its processes), else
    ``~/.cache/qwen35_jax/xla``; '': no persistent cache."""
    if path == "":
        jax.config.update("jax_enable_compilation_cache", False)
        return
    path = path or jax.config.jax_compilation_cache_dir or DEFAULT_COMPILATION_CACHE
    os.makedirs(path, exist_ok=True)
    jax.config.update("jax_compilation_cache_dir", path)
    # every step program, however quick to compile alone: on a CPU each takes about a
    # second and a server has several
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
