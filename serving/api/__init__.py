"""OpenAI-compatible HTTP server (FastAPI): `python -m serving.api --model tiny`.

`build_app(backend, tokenizer, model_name)` makes the app over any `Backend`
(backend.py): the aggregated engine through `serving.async_engine.AsyncEngine`,
or the router over disaggregated prefill/decode workers. Imported on first use,
so that the command-line entry points answer `--help` before JAX loads.
"""

__all__ = ["Backend", "build_app"]


def __getattr__(name):
    if name == "build_app":
        from serving.api.app import build_app
        return build_app
    if name == "Backend":
        from serving.api.backend import Backend
        return Backend
    raise AttributeError(name)
