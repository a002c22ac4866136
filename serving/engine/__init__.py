"""The serving engine: hybrid cache managers, scheduler, compiled step programs
and the async host loop. One concept per module:

    request.py, sampling_params.py, outputs.py   a request, its options, what comes back
    block_pool.py, state_pool.py                  KV blocks and GDN state slots (ref counted)
    fence.py                                      memory returns only after in-flight steps end
    scheduler.py                                  continuous batching, chunked prefill, preemption
    buckets.py, runner.py, sampler.py             padded shapes, compiled programs, on-device sampling
    compile_guard.py, idle_timer.py               serving-time compiles, host-idle share
    capacity.py, config.py                        cache sizing from device memory; options
    prefix_cache.py, drafter.py                   cached prefixes; MTP drafts
    engine.py                                     the host loop tying them together
    remote.py, connector.py                       the disaggregated side: memory transfers
                                                  fill or hand out; how a worker joins the loop

Public API: `Engine` (add_request / abort / step / generate, plus the transfer
methods of remote.py: add_remote_request / finish_transfer / release ...), `EngineConfig`,
`SamplingParams`, `RequestOutput`. Notebooks use `serving.LLM`.
"""

from serving.engine.config import EngineConfig
from serving.engine.engine import Engine
from serving.engine.outputs import RequestOutput
from serving.engine.sampling_params import SamplingParams

__all__ = ["Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
