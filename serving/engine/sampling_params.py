"""Per-request sampling and stopping options (vLLM names and defaults)."""

import math
import numbers
from dataclasses import dataclass, field

# Stop conditions a request may set: each stop string is searched for after every token
# of its request (serving/engine/stop.py), so their number and length bound that work.
MAX_STOP_STRINGS = 64
MAX_STOP_CHARS = 1024  # a stop string's length
MAX_STOP_TOKEN_IDS = 1024


@dataclass
class SamplingParams:
    """`temperature == 0` is greedy. `top_k <= 0`, `top_p == 1` and `min_p == 0`
    disable those filters. `seed` makes sampling reproducible and independent of
    batch composition and preemption: the random key of every token is derived
    from (seed, token position) only. `logprobs = n` returns the log-probability
    of the chosen token and of the top n tokens (raw model distribution)."""

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_p: float = 0.0
    seed: int | None = None
    stop_token_ids: list[int] = field(default_factory=list)
    stop: list[str] = field(default_factory=list)
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    logprobs: int | None = None

    def __post_init__(self):
        if isinstance(self.stop, str):
            self.stop = [self.stop]
        self.stop_token_ids = list(self.stop_token_ids)
        if len(self.stop) > MAX_STOP_STRINGS or any(len(x) > MAX_STOP_CHARS for x in self.stop):
            raise ValueError(f"stop: at most {MAX_STOP_STRINGS} stop strings of at most "
                             f"{MAX_STOP_CHARS} characters")
        if len(self.stop_token_ids) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"stop_token_ids: at most {MAX_STOP_TOKEN_IDS}")
        if not isinstance(self.max_tokens, numbers.Integral) or self.max_tokens < 1:
            raise ValueError(f"max_tokens must be an integer >= 1, got {self.max_tokens!r}")
        if not (math.isfinite(self.temperature) and self.temperature >= 0):
            raise ValueError(f"temperature must be finite and >= 0, got {self.temperature!r}")
        if not 0 < self.top_p <= 1:
            raise ValueError("top_p must be in (0, 1]")
        if not 0 <= self.min_p <= 1:
            raise ValueError("min_p must be in [0, 1]")
        if self.logprobs is not None and self.logprobs < 0:
            raise ValueError("logprobs must be >= 0")
        # The device sampler holds seeds as uint32 and top_k as int32: fold or clamp here,
        # so that no value can overflow inside a step that serves other requests too.
        if self.seed is not None:
            self.seed = int(self.seed) % 2**32
        self.top_k = min(int(self.top_k), 2**31 - 1)
