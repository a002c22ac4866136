"""``python -m serving.worker``: one prefill or decode worker.

    QWEN35_JAX_SECRET=... python -m serving.worker --role prefill --model tiny --port 8101
    QWEN35_JAX_SECRET=... python -m serving.worker --role decode  --model tiny --port 8102

``python -m serving`` starts these itself, with a secret of its own; a worker started by
hand needs the router's shared secret in its environment (``serving.secret``).
"""

from __future__ import annotations

import logging
import os
import time

from serving.flags import add_worker_flags, engine_kwargs, server_parser

log = logging.getLogger("serving.worker")


def parser():
    p = add_worker_flags(server_parser("python -m serving.worker", __doc__, api=False))
    p.add_argument("--role", required=True, choices=["prefill", "decode"])
    return p


def main(argv=None):
    a = parser().parse_args(argv)  # before JAX loads: --help and bad flags answer at once
    from serving.worker.app import build_app

    secret = shared_secret()
    worker = load_worker(a, secret)
    serve(worker, build_app(worker, secret=secret, max_body_bytes=a.max_request_bytes), a)


def shared_secret() -> str:
    from serving.secret import SecretMissing, load

    try:
        return load()
    except SecretMissing as e:
        raise SystemExit(f"python -m serving.worker: {e}") from None


def load_worker(a, secret: str, agent_type=None):
    """The worker ``a`` (parsed flags) describes, its model loaded and its programs
    compiled; ``agent_type`` as `WorkerBase` takes it (default `transfer.Agent`)."""
    import jax
    import jax.numpy as jnp

    from serving.api.text import Tokenizer, find_tokenizer
    from serving.engine import EngineConfig
    from serving.engine.compilation_cache import use_compilation_cache
    from serving.llm import adopt_model_limits, default_dtype, load_model, load_mtp_head
    from serving.worker.common import param_bytes
    from serving.worker.decode import DecodeWorker
    from serving.worker.prefill import PrefillWorker
    from transfer import Agent, size_xla_pool

    logging.basicConfig(level=a.log_level.upper(),
                        format=f"%(asctime)s {a.role} %(levelname)s %(name)s: %(message)s")
    name = a.model or a.model_tag
    # The cache regions live beside XLA's pool (transfer/memory.py): size the pool before
    # JAX starts its GPU client below, for the weights one device of the mesh holds.
    total = size_xla_pool(param_bytes(name, a.dtype or "bfloat16", a.ep, a.tp, a.hf_overrides,
                                      a.quantization),
                          a.gpu_memory_utilization)
    if total:
        log.info("XLA pool: %s of %.1f GiB", os.environ["XLA_PYTHON_CLIENT_MEM_FRACTION"],
                 total / 2**30)
    use_compilation_cache(a.compilation_cache_dir)
    dtype = jnp.dtype(a.dtype) if a.dtype else default_dtype()
    config = EngineConfig(seed=a.seed, **engine_kwargs(a))
    model = load_model(name, dtype, a.seed, config.mesh(), a.hf_overrides, a.quantization)
    adopt_model_limits(config, model.config, {"max_model_len"} if a.max_model_len is not None else ())
    mtp = (load_mtp_head(name, model.config, dtype, a.seed) if config.num_speculative_tokens
           else None)
    t0 = time.perf_counter()
    common = dict(model_name=name, dtype=dtype, secret=secret, lease_ttl=a.lease_ttl,
                  host=a.host, transfer_port=a.transfer_port,
                  transfer_interface=a.transfer_interface,
                  max_queued_requests=a.max_queued_requests,
                  iteration_timeout=a.engine_iteration_timeout, mtp=mtp,
                  tokenizer=Tokenizer(find_tokenizer(name, a.tokenizer)),
                  agent_type=agent_type or Agent)
    if a.role == "prefill":
        worker = PrefillWorker(model, config, **common)
    else:
        worker = DecodeWorker(model, config, **common, transfer_timeout=a.transfer_timeout,
                              recompute_on_failure=a.on_transfer_failure == "recompute")
    log.info("%s worker ready in %.1f s on %s: http %s:%d, transfer %s", a.role,
             time.perf_counter() - t0, jax.devices()[0], a.host, a.port,
             worker.transfer.address)
    return worker


def serve(worker, app, a) -> None:
    """Serve ``app``, ``worker``'s HTTP API, until the process is stopped, then shut the
    worker down; a worker whose engine fails exits instead (``serving.engine_exit``), so
    that the launcher restarts it."""
    import uvicorn

    from serving.engine_exit import serve as serve_while_engine_lives
    from serving.messages import WORKER_IDLE_SECONDS

    try:
        serve_while_engine_lives(uvicorn.Config(app, host=a.host, port=a.port,
                                                log_level="warning",
                                                timeout_keep_alive=WORKER_IDLE_SECONDS),
                                 worker.engine)
    finally:
        worker.shutdown()


if __name__ == "__main__":
    main()
