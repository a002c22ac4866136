"""Prefill and decode workers: one engine each, its cache in registered memory, a NIXL
transfer endpoint, and a small HTTP API for the router (``python -m serving.worker``).

* ``common``: what both roles hold (engine, cache regions, agent, transfer manager);
* ``prefill``: prompt -> first token, then the prompt's cache pinned under a lease;
* ``decode``: claim a lease, READ it into memory of its own, decode;
* ``app``: the HTTP API, behind the workers' shared secret;
* ``__main__``: the command line.

With ``--ep``/``--tp`` the engine runs on a mesh and its cache is one registered region
per device shard (``kv_transfer.allocate_registered_cache``); prefill and decode workers
may be split differently (prefill TP2, decode EP2, say): the lease's description carries
the prefill side's cache layout and the request's blocks and slot
(``kv_transfer.source_record``), and the decode side reads the parts of rows its own split
needs (``kv_transfer.pull_items``), checked to lie inside the pinned bytes. On GPU every
device's shard is cudaMalloc'd memory imported through DLPack
(``transfer.memory.allocate_sharded``), which cuda_ipc reaches; on CPU it is XLA's own
host memory.

Imported on first use, so that ``python -m serving.worker --help`` answers before JAX loads.
"""

import importlib

__all__ = ["DecodeWorker", "PrefillWorker", "build_app"]
_HOME = {"DecodeWorker": "decode", "PrefillWorker": "prefill", "build_app": "app"}


def __getattr__(name):
    if name in _HOME:
        return getattr(importlib.import_module(f"serving.worker.{_HOME[name]}"), name)
    raise AttributeError(name)
