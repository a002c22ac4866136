"""A server process lives as long as its engine: once the engine stops with an error or
hangs (``AsyncEngine.error``), the process exits with ``ENGINE_FAILED_EXIT`` after
``ENGINE_FAILED_GRACE`` seconds, as vLLM's server exits on a dead engine, so that a
supervisor (``python -m serving`` for its workers, an orchestrator for
``python -m serving.api``) restarts it instead of keeping a process that can only answer
503. The grace lets the failed requests' errors reach their clients (or the router)."""

from __future__ import annotations

import logging
import os
import threading
import time

log = logging.getLogger(__name__)

ENGINE_FAILED_EXIT = 3  # the status of a process whose engine stopped (or hung) while serving
ENGINE_FAILED_GRACE = 2.0  # seconds its requests' errors have to reach their clients first


def serve(config, engine) -> None:
    """Run the uvicorn server of ``config`` until the process is stopped (then return), or
    until ``engine`` (an ``AsyncEngine``) fails: then exit the process from the watching
    thread, skipping every orderly shutdown (a hung engine thread never joins, and the
    server's own shutdown would wait for it)."""
    import uvicorn

    server = uvicorn.Server(config)

    def watch():
        while not server.should_exit:
            time.sleep(0.5)
            if engine.error is not None:
                log.error("the engine stopped (%r): exiting in %.0f s", engine.error,
                          ENGINE_FAILED_GRACE)
                time.sleep(ENGINE_FAILED_GRACE)
                logging.shutdown()
                os._exit(ENGINE_FAILED_EXIT)

    threading.Thread(target=watch, name="engine-exit", daemon=True).start()
    server.run()
