"""`python -m serving.api`: the OpenAI-compatible server over the aggregated engine.

    python -m serving.api --model tiny --port 8000        # built-in small model, CPU is fine
    python -m serving.api /ckpt/Qwen3.5-0.8B --served-model-name qwen

Flags follow `vllm serve` where it has one. Every program is compiled at
start-up over the step buckets, so start-up time grows with their number; on
a CPU the unset limits default to small values (8 sequences, 64-token steps,
1024-token context, three programs) to keep start-up near half a minute.
"""

import argparse
import json
import logging
import os

import jax

from qwen35_jax import builtin
from serving.api.app import build_app
from serving.api.prepare import SAMPLING_DEFAULTS, ChatOptions
from serving.api.text import Tokenizer, find_tokenizer
from serving.api.tool_parsers import PARSERS
from serving.async_engine import AsyncEngine
from serving.body_limit import DEFAULT_MAX_BYTES
from serving.engine.buckets import Buckets

log = logging.getLogger(__name__)

# On a CPU, long prefill programs are slow (seconds per step for the tiny model
# at 256 tokens), so prompts are prefilled in chunks of at most 64 tokens.
_CPU_DEFAULTS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024}


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("want a JSON object of config fields")
    return value


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m serving.api", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("model_tag", nargs="?", help="same as --model")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (tiny, tiny-moe, ...)")
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's tokenizer.json, "
                   "or the built-in one for the tiny presets")
    p.add_argument("--served-model-name", default=None, help="default: --model")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--hf-overrides", type=_json_object, default=None, metavar="JSON",
                   help="HF config fields over a preset's (random weights), as vLLM's: "
                        "'{\"num_hidden_layers\": 20}' keeps 35B-A3B's shapes at half its depth")
    p.add_argument("--quantization", "-q", default=None, choices=["fp8"],
                   help="fp8: the layer matmuls' weights in FP8 e4m3 with 128x128 block "
                        "scales, quantised on load (an FP8 checkpoint is FP8 without it)")
    p.add_argument("--dtype", default=None, choices=["bfloat16", "float32"],
                   help="default: bfloat16 on accelerators, float32 on CPU")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--max-model-len", type=int, default=None)
    p.add_argument("--max-num-seqs", type=int, default=None)
    p.add_argument("--max-num-batched-tokens", type=int, default=None)
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--num-blocks", type=int, default=None,
                   help="KV blocks; default: sized from device memory (on CPU: enough for "
                        "max-num-seqs full-length sequences)")
    p.add_argument("--gpu-memory-utilization", type=float, default=0.85)
    p.add_argument("--max-logprobs", type=int, default=20)
    p.add_argument("--max-queued-requests", type=int, default=1024,
                   help="requests waiting beyond this are answered 503")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer <key>' on the /v1 routes (401 "
                        "otherwise), as vllm serve does; default: the environment's "
                        "VLLM_API_KEY, else no key")
    p.add_argument("--max-request-bytes", type=int, default=DEFAULT_MAX_BYTES,
                   help="request bodies over this many bytes are refused (413) unread")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="share cached prompt prefixes: KV blocks and GDN state snapshots "
                        "(serving/engine/prefix_cache.py)")
    p.add_argument("--prefix-state-interval", type=int, default=32, metavar="BLOCKS",
                   help="take a GDN state snapshot every this many blocks of a prefill (and "
                        "at the prompt's end)")
    p.add_argument("--num-prefix-snapshots", type=int, default=None,
                   help="state rows for snapshots, counted in the cache budget "
                        "(default: max-num-seqs)")
    p.add_argument("--prefill-token-buckets", type=_ints, default=None, metavar="T1,T2,...")
    p.add_argument("--prefill-seq-buckets", type=_ints, default=None, metavar="N1,N2,...")
    p.add_argument("--decode-seq-buckets", type=_ints, default=None, metavar="N1,N2,...")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: experts split over ep*tp devices")
    p.add_argument("--tp", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel size: heads and FFN columns split over tp devices")
    p.add_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="split a chat reply's <think> block into reasoning_content")
    p.add_argument("--tool-call-parser", default=None, choices=sorted(PARSERS),
                   help="read <tool_call> blocks of chat replies as tool_calls: hermes (JSON "
                        "bodies, Qwen3) or qwen3_coder (<function=...> bodies, Qwen3.5)")
    p.add_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools (tool_choice \"auto\"); needs "
                        "--tool-call-parser")
    p.add_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves unset: auto, the "
                        "checkpoint's generation_config.json; vllm, none; or that file in DIR")
    p.add_argument("--log-level", default="info")
    return p


# The server's own flags (with a value, and switches): the launcher keeps them from the
# workers.
API_FLAGS = frozenset({"--reasoning-parser", "--tool-call-parser", "--generation-config"})
API_SWITCHES = frozenset({"--enable-auto-tool-choice"})


def chat_options(args, model: str) -> ChatOptions:
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
        if defaults:
            log.info("sampling defaults from %s: %s", path, defaults)
    elif args.generation_config not in ("auto", "vllm"):
        raise SystemExit(f"--generation-config: no generation_config.json in "
                         f"{args.generation_config}")
    return ChatOptions(reasoning_parser=args.reasoning_parser,
                       tool_call_parser=args.tool_call_parser,
                       auto_tool_choice=args.enable_auto_tool_choice,
                       sampling_defaults=defaults)


def engine_kwargs(args) -> dict:
    """EngineConfig fields from the flags (unset ones: engine defaults, or the
    small CPU defaults)."""
    on_cpu = jax.default_backend() == "cpu"
    kw = {"block_size": args.block_size, "max_logprobs": args.max_logprobs,
          "memory_utilization": args.gpu_memory_utilization, "ep": args.ep, "tp": args.tp,
          "track_device_idle": True,  # servers export device busy / idle time
          "enable_prefix_caching": args.enable_prefix_caching,
          "prefix_state_interval": args.prefix_state_interval,
          "num_prefix_snapshots": args.num_prefix_snapshots}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens"):
        value = getattr(args, name)
        if value is None and on_cpu:
            value = _CPU_DEFAULTS[name]
        if value is not None:
            kw[name] = value
    if args.num_blocks is not None:
        kw["num_blocks"] = args.num_blocks
    elif on_cpu:
        per_seq = -(-kw["max_model_len"] // args.block_size)
        kw["num_blocks"] = kw["max_num_seqs"] * per_seq
    buckets = (args.prefill_token_buckets, args.prefill_seq_buckets, args.decode_seq_buckets)
    if any(b is not None for b in buckets) or on_cpu:
        seqs = kw.get("max_num_seqs", 64)
        tokens = kw.get("max_num_batched_tokens", 2048)
        kw["buckets"] = Buckets(
            prefill_tokens=args.prefill_token_buckets or tuple(sorted({min(32, tokens), tokens})),
            prefill_seqs=args.prefill_seq_buckets or (seqs,),
            decode_seqs=args.decode_seq_buckets or (seqs,))
    return kw


def build(args) -> tuple:
    """(app, async engine) for parsed flags; the engine compiles here."""
    from serving.llm import LLM

    model = args.model or args.model_tag
    if not model:
        raise SystemExit("give a model: a checkpoint directory or a preset name")
    tokenizer = Tokenizer(find_tokenizer(model, args.tokenizer))
    dtype = {"bfloat16": jax.numpy.bfloat16, "float32": jax.numpy.float32}.get(args.dtype)
    llm = LLM(model, tokenizer=tokenizer, dtype=dtype, seed=args.seed,
              hf_overrides=args.hf_overrides, quantization=args.quantization,
              **engine_kwargs(args))
    engine = AsyncEngine(llm.engine, max_queued_requests=args.max_queued_requests)
    name = args.served_model_name or model
    path = builtin.resolve(model)
    app = build_app(engine, tokenizer, name, model_path=os.path.abspath(path)
                    if os.path.isdir(path) else model, api_key=api_key(args),
                    max_request_bytes=args.max_request_bytes,
                    options=chat_options(args, model))
    return app, engine


def api_key(args) -> str | None:
    """``--api-key``, else ``VLLM_API_KEY`` from the environment (vLLM's two ways)."""
    return args.api_key or os.environ.get("VLLM_API_KEY") or None


def main(argv=None) -> None:
    import uvicorn

    args = parser().parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app, _ = build(args)
    log.info("serving %s on http://%s:%d", args.served_model_name or args.model or args.model_tag,
             args.host, args.port)
    uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level)
