"""Command-line flags of the servers, the launcher and the workers, as vLLM spells them.

This module imports no JAX, so ``--help`` and a mistyped flag answer at once; each
entry point adds its own flags to ``server_parser()``.
"""

import argparse
import json
import os

from serving.api.tool_parsers import PARSERS as TOOL_CALL_PARSERS  # imports no JAX either
from serving.body_limit import DEFAULT_MAX_BYTES
DEFAULT_COMPILATION_CACHE = os.path.join(os.path.expanduser("~"), ".cache", "qwen35_jax", "xla")


def _ints(text: str) -> tuple[int, ...]:
    return tuple(int(x) for x in text.split(","))


def _positive(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def _json_object(text: str) -> dict:
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise argparse.ArgumentTypeError(f"not JSON: {e}") from None
    if not isinstance(value, dict):
        raise argparse.ArgumentTypeError("want a JSON object of config fields")
    return value


# The OpenAI layer's own flags (with a value, and switches): the launcher keeps them from
# the workers, whose parser leaves them out.
API_FLAGS = frozenset({"--served-model-name", "--api-key", "--reasoning-parser",
                       "--tool-call-parser", "--generation-config", "--stream-interval",
                       "--timeout-keep-alive"})
API_SWITCHES = frozenset({"--enable-auto-tool-choice"})


def server_parser(prog: str = "python -m serving.api", description: str | None = None,
                  api: bool = True) -> argparse.ArgumentParser:
    """The flags of the OpenAI server over one engine (``python -m serving.api``); the
    launcher and the workers start from these. ``api=False`` (a worker) leaves out the
    OpenAI layer's own flags (API_FLAGS, API_SWITCHES), which a worker has no use for."""
    p = argparse.ArgumentParser(prog=prog, description=description,
                                formatter_class=argparse.RawDescriptionHelpFormatter)

    def api_argument(name, **kwargs):
        assert name in API_FLAGS | API_SWITCHES, name
        if api:
            p.add_argument(name, **kwargs)

    p.add_argument("model_tag", nargs="?", help="same as --model")
    p.add_argument("--model", default=None,
                   help="checkpoint directory or preset name (tiny, tiny-moe, ...)")
    p.add_argument("--tokenizer", default=None, help="default: the checkpoint's tokenizer.json, "
                   "or the built-in one for the tiny presets")
    api_argument("--served-model-name", default=None, help="default: --model")
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
    p.add_argument("--engine-iteration-timeout", type=float, default=120.0, metavar="SECONDS",
                   help="an engine iteration (a step, or a compile while serving) running "
                        "longer counts as a hung engine: its requests end with an error and "
                        "the health check fails (vLLM's VLLM_ENGINE_ITERATION_TIMEOUT_S)")
    api_argument("--api-key", default=None,
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
    p.add_argument("--scheduling-policy", default="lpm", choices=["lpm", "fcfs"],
                   help="order of admitting waiting requests: longest cached prefix first "
                        "(lpm, SGLang's name; arrival order without prefix caching) or "
                        "strictly by arrival (fcfs)")
    p.add_argument("--speculative-config", type=_json_object, default=None, metavar="JSON",
                   help='speculative decoding with the model\'s MTP head: '
                        '\'{"method": "mtp", "num_speculative_tokens": k}\' (k 1..4)')
    p.add_argument("--prefill-token-buckets", type=_ints, default=None, metavar="T1,T2,...")
    p.add_argument("--prefill-seq-buckets", type=_ints, default=None, metavar="N1,N2,...")
    p.add_argument("--decode-seq-buckets", type=_ints, default=None, metavar="N1,N2,...")
    p.add_argument("--ep", type=int, default=1,
                   help="expert-parallel size: experts split over ep*tp devices")
    p.add_argument("--tp", "--tensor-parallel-size", type=int, default=1,
                   help="tensor-parallel size: heads and FFN columns split over tp devices")
    api_argument("--reasoning-parser", default=None, choices=["qwen3"],
                   help="split a chat reply's <think> block into reasoning_content")
    api_argument("--tool-call-parser", default=None, choices=sorted(TOOL_CALL_PARSERS),
                   help="read <tool_call> blocks of chat replies as tool_calls: hermes (JSON "
                        "bodies, Qwen3) or qwen3_coder (<function=...> bodies, Qwen3.5)")
    api_argument("--enable-auto-tool-choice", action="store_true",
                   help="let the model call tools (tool_choice \"auto\"); needs "
                        "--tool-call-parser")
    api_argument("--generation-config", default="auto", metavar="auto|vllm|DIR",
                   help="sampling defaults for fields a request leaves unset: auto, the "
                        "checkpoint's generation_config.json; vllm, none; or that file in DIR")
    p.add_argument("--mamba-ssm-cache-dtype", default="auto",
                   choices=["auto", "float32", "bfloat16"],
                   help="dtype of the GDN recurrent state (auto: float32, which keeps long "
                        "sequences exact; bfloat16 halves its memory and transfer bytes)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="prepare step N+1 on the host while the device runs step N")
    api_argument("--stream-interval", type=_positive, default=1, metavar="N",
                   help="tokens per streamed event: a choice's first token leaves at once, "
                        "then every N tokens and its last (fewer events at high concurrency)")
    api_argument("--timeout-keep-alive", type=_positive, default=75, metavar="SECONDS",
                 help="how long the server keeps an idle client connection open: longer "
                      "than clients' own pools keep one (httpx 5 s, aiohttp 15 s), so a "
                      "client never sends a request on a connection the server is closing")
    p.add_argument("--compilation-cache-dir", default=None, metavar="DIR",
                   help="XLA's persistent cache of compiled programs, so a second start "
                        "compiles nothing (default: JAX_COMPILATION_CACHE_DIR if set, else "
                        f"{DEFAULT_COMPILATION_CACHE}; '' turns it off)")
    p.add_argument("--log-level", default="info")
    return p


def add_worker_flags(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The transfer flags of a worker (``python -m serving.worker``), which the launcher
    passes on."""
    p.add_argument("--transfer-port", type=int, default=0, help="handshake port (0: any)")
    p.add_argument("--transfer-interface", default="lo",
                   help="network devices UCX may transfer over and listen on (UCX_NET_DEVICES; "
                        "default: loopback only), e.g. mlx5_0:1 or eth0 across hosts")
    p.add_argument("--lease-ttl", type=float, default=30.0,
                   help="seconds a prefill result stays pinned without a pull")
    p.add_argument("--transfer-timeout", type=float, default=30.0)
    p.add_argument("--on-transfer-failure", choices=["error", "recompute"], default="error")
    return p



def engine_kwargs(args) -> dict:
    """EngineConfig fields from the flags; the unset ones keep the engine's defaults, or
    on a CPU the small ones (`serving.llm.engine_defaults`). Imports the engine (and JAX)
    when called, not with this module."""
    from serving.engine.buckets import Buckets
    from serving.engine.config import speculative_tokens
    from serving.llm import engine_defaults

    try:
        k = speculative_tokens(args.speculative_config)
    except ValueError as e:
        raise SystemExit(f"--speculative-config: {e}") from None
    kw = {"block_size": args.block_size, "max_logprobs": args.max_logprobs,
          "num_speculative_tokens": k,
          "memory_utilization": args.gpu_memory_utilization, "ep": args.ep, "tp": args.tp,
          "track_device_idle": True,  # servers export device busy / idle time
          "enable_prefix_caching": args.enable_prefix_caching,
          "prefix_state_interval": args.prefix_state_interval,
          "num_prefix_snapshots": args.num_prefix_snapshots,
          "scheduling_policy": args.scheduling_policy,
          "async_scheduling": args.async_scheduling,
          "ssm_dtype": {"auto": "float32"}.get(args.mamba_ssm_cache_dtype,
                                               args.mamba_ssm_cache_dtype)}
    for name in ("max_model_len", "max_num_seqs", "max_num_batched_tokens", "num_blocks"):
        if getattr(args, name) is not None:
            kw[name] = getattr(args, name)
    kw = engine_defaults(kw)
    given = (args.prefill_token_buckets, args.prefill_seq_buckets, args.decode_seq_buckets)
    if any(b is not None for b in given):
        seqs = kw.get("max_num_seqs", 64)
        tokens = kw.get("max_num_batched_tokens", 2048)
        few = Buckets.few(seqs, tokens)
        kw["buckets"] = Buckets(prefill_tokens=args.prefill_token_buckets or few.prefill_tokens,
                                prefill_seqs=args.prefill_seq_buckets or few.prefill_seqs,
                                decode_seqs=args.decode_seq_buckets or few.decode_seqs)
    return kw
