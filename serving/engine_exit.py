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
    threading.Thread(target=watch, args=(server, engine), name="engine-exit",
                     daemon=True).start()
    try:
        server.run()
    finally:  # however it ended (a signal, a port it could not bind), the engine's
        server.should_exit = True  # shutdown that follows is no failure


def watch(server, engine) -> None:
    """Exit the process once ``engine`` fails while ``server`` serves. The engine is shut
    down (which sets ``engine.error`` too) only after ``should_exit`` is set: by uvicorn
    on a signal, before its lifespan shutdown; by ``serve`` once ``run`` returns or
    raises, before its caller's shutdown. So an error read before ``should_exit`` is a
    failure, not the stop."""
    while not server.should_exit:
        time.sleep(0.5)
        error = engine.error
        if error is not None and not server.should_exit:
            log.error("the engine stopped (%r): exiting in %.0f s", error, ENGINE_FAILED_GRACE)
            time.sleep(ENGINE_FAILED_GRACE)
            logging.shutdown()
            os._exit(ENGINE_FAILED_EXIT)
