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


ENGINE_FAILED_EXIT = 3  # the status of a worker whose engine stopped (or hung) while serving
ENGINE_FAILED_GRACE = 2.0  # seconds its requests' errors have to reach the router first


def serve(worker, app, a) -> None:
    """Serve ``app``, ``worker``'s HTTP API, until the process is stopped, then shut the
    worker down; or until the worker's engine stops with an error or hangs
    (``AsyncEngine.error``): then, after ``ENGINE_FAILED_GRACE`` seconds, the process exits
    with status ``ENGINE_FAILED_EXIT``, so that a supervisor (``python -m serving``)
    restarts it instead of keeping a worker that can only answer 503."""
    import threading

    import uvicorn

    from serving.messages import WORKER_IDLE_SECONDS

    server = uvicorn.Server(uvicorn.Config(app, host=a.host, port=a.port, log_level="warning",
                                           timeout_keep_alive=WORKER_IDLE_SECONDS))
    failed = threading.Event()

    def watch():
        while not server.should_exit:
            time.sleep(0.5)
            if worker.engine.error is not None:
                log.error("the engine stopped (%r): exiting in %.0f s", worker.engine.error,
                          ENGINE_FAILED_GRACE)
                failed.set()
                time.sleep(ENGINE_FAILED_GRACE)
                server.should_exit = True

    threading.Thread(target=watch, name="engine-exit", daemon=True).start()
    try:
        server.run()
    finally:
        if failed.is_set():  # a hung engine thread may never join: no orderly shutdown
            logging.shutdown()
            os._exit(ENGINE_FAILED_EXIT)
        worker.shutdown()


if __name__ == "__main__":
    main()
