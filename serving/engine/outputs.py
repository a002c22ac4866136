"""What the engine returns to callers: plain host data, no JAX arrays."""

import dataclasses
from dataclasses import dataclass, field


@dataclass
class RequestOutput:
    request_id: str
    prompt_token_ids: list[int]
    token_ids: list[int]  # all output tokens so far (the engine's list: it grows until finished)
    new_token_ids: list[int]  # the tokens added by this step
    finished: bool
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string
    text: str | None = None  # when the engine has a tokenizer
    logprobs: list[dict[int, float]] | None = None  # per token: {id: logprob}, chosen + top-n
    num_preemptions: int = 0
    num_cached_tokens: int = 0  # prompt tokens the prefix cache supplied (first admission)
    # arrival, first_token, finish (perf_counter s); queue_s: arrival to first admission
    metrics: dict = field(default_factory=dict)


def joined(earlier: RequestOutput, later: RequestOutput) -> RequestOutput:
    """One output for two consecutive ones of a request: the later one's state with the
    new tokens of both (its token ids, text and logprobs are already cumulative)."""
    return dataclasses.replace(later, new_token_ids=earlier.new_token_ids + later.new_token_ids)
