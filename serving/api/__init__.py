"""OpenAI-compatible HTTP server (FastAPI): `python -m serving.api --model tiny`.

`build_app(backend, tokenizer, model_name)` makes the app over any `Backend`
(backend.py): the aggregated engine through `serving.async_engine.AsyncEngine`
today, a router over disaggregated prefill/decode workers later.
"""

from serving.api.app import build_app
from serving.api.backend import Backend

__all__ = ["Backend", "build_app"]
