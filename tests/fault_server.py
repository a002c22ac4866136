"""``python tests/fault_server.py``: ``python -m serving.api`` (same flags, same
``main``) whose app has one more route, ``POST /debug/crash``: the engine's next step
raises (its engine thread stops)."""

import serving.api.server as server

_build = server.build


def build(args):
    app, engine = _build(args)

    @app.post("/debug/crash")
    async def crash():
        def step():
            raise RuntimeError("injected engine crash")
        engine.engine.step = step
        engine.engine.has_steps = lambda: True
        engine.wake()
        return {"ok": True}

    return app, engine


if __name__ == "__main__":
    from serving.api.__main__ import main

    server.build = build
    main()
