"""The OpenAI-compatible server over the aggregated engine (`python -m serving.api`):
from parsed flags (serving/flags.py) to the app and its engine.
"""

import json
import logging
import os

import jax

from qwen35_jax import builtin
from serving.api.app import build_app
from serving.api.prepare import SAMPLING_DEFAULTS, ServerOptions
from serving.api.text import Tokenizer, find_tokenizer
from serving.async_engine import AsyncEngine
from serving.engine import SamplingParams
from serving.flags import engine_kwargs, server_parser
from serving.llm import LLM

log = logging.getLogger(__name__)


def parser():
    from serving.api.__main__ import __doc__ as usage
    return server_parser("python -m serving.api", usage)


def server_options(args, model: str) -> ServerOptions:
    """The request and reply options of the flags, with the sampling defaults of
    ``--generation-config``."""
    if args.enable_auto_tool_choice and not args.tool_call_parser:
        raise SystemExit("--enable-auto-tool-choice needs --tool-call-parser")
    where = {"auto": builtin.resolve(model), "vllm": None}.get(args.generation_config,
                                                                args.generation_config)
    defaults = {}
    path = where and os.path.join(where, "generation_config.json")
    if path and os.path.isfile(path):
        with open(path) as f:
            config = json.load(f)
        defaults = {k: config[k] for k in SAMPLING_DEFAULTS if k in config}
        try:
            SamplingParams(**defaults)
        except (TypeError, ValueError) as e:
            raise SystemExit(f"{path}: sampling defaults {defaults}: {e}") from None
        if defaults:
            log.info("sampling defaults from %s: %s", path, defaults)
    elif args.generation_config not in ("auto", "vllm"):
        raise SystemExit(f"--generation-config: no generation_config.json in "
                         f"{args.generation_config}")
    return ServerOptions(reasoning_parser=args.reasoning_parser,
                         tool_call_parser=args.tool_call_parser,
                         auto_tool_choice=args.enable_auto_tool_choice,
                         sampling_defaults=defaults, stream_interval=args.stream_interval)


def build(args) -> tuple:
    """(app, async engine) for parsed flags; the engine compiles here."""
    model = args.model or args.model_tag
    if not model:
        raise SystemExit("give a model: a checkpoint directory or a preset name")
    tokenizer = Tokenizer(find_tokenizer(model, args.tokenizer))
    dtype = {"bfloat16": jax.numpy.bfloat16, "float32": jax.numpy.float32}.get(args.dtype)
    llm = LLM(model, tokenizer=tokenizer, dtype=dtype, seed=args.seed,
              hf_overrides=args.hf_overrides, quantization=args.quantization,
              compilation_cache_dir=args.compilation_cache_dir, **engine_kwargs(args))
    engine = AsyncEngine(llm.engine, max_queued_requests=args.max_queued_requests,
                         iteration_timeout=args.engine_iteration_timeout)
    app = build_app(engine, tokenizer, args.served_model_name or model,
                    model_path=model_root(model), api_key=api_key(args),
                    max_request_bytes=args.max_request_bytes,
                    options=server_options(args, model))
    return app, engine


def model_root(model: str) -> str:
    """`/v1/models`' `root`: the checkpoint directory's absolute path, else the preset."""
    path = builtin.resolve(model)
    return os.path.abspath(path) if os.path.isdir(path) else model


def api_key(args) -> str | None:
    """``--api-key``, else ``VLLM_API_KEY`` from the environment (vLLM's two ways)."""
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def uvicorn_config(app, args, **kw):
    """The HTTP server's settings from the flags: where it listens, its log level, how
    long an idle client connection stays open (``--timeout-keep-alive``); ``kw``
    overrides or adds uvicorn settings."""
    import uvicorn

    return uvicorn.Config(app, **{"host": args.host, "port": args.port,
                                  "log_level": args.log_level,
                                  "timeout_keep_alive": args.timeout_keep_alive, **kw})


def main(args) -> None:
    """Serve until stopped, for flags parsed by `parser()`; the process exits when its
    engine fails (``serving.engine_exit``)."""
    from serving.engine_exit import serve

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, engine = build(args)
    log.info("serving %s on http://%s:%d", args.served_model_name or args.model or args.model_tag,
             args.host, args.port)
    serve(uvicorn_config(app, args), engine)
