"""``python tests/fault_server.py``: ``python -m serving.api`` (same flags, same
``main``) whose app has two more routes: ``POST /debug/crash``, the engine's next step
raises (its engine thread stops); ``POST /debug/hang``, its next step never returns."""

import threading

import serving.api.server as server

_build = server.build


def build(args):
    app, engine = _build(args)

    def next_step(step):
        engine.engine.step = step
        engine.engine.has_steps = lambda: True
        engine.wake()
        return {"ok": True}

    @app.post("/debug/crash")
    async def crash():
        def step():
            raise RuntimeError("injected engine crash")
        return next_step(step)

    @app.post("/debug/hang")
    async def hang():
        return next_step(lambda: threading.Event().wait())

    return app, engine


if __name__ == "__main__":
    from serving.api.__main__ import main

    server.build = build
    main()
