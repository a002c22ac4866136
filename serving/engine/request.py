"""A request's host-side state: tokens, progress, and the memory it holds.

Progress is counted in tokens. `num_computed_tokens` counts positions whose KV
and GDN state are written or being written by a dispatched step. With async
scheduling a step can be dispatched before the previous step's sampled token is
known on the host; such a token is counted in `num_pending` and read on device
from the per-slot last-token buffer (see runner.py), so the host never waits
for it to schedule the next step.

`epoch` increases whenever the request loses its memory (preemption): outputs
of steps dispatched in an earlier epoch are stale and dropped.
"""

import enum
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from serving.engine.sampling_params import SamplingParams

if TYPE_CHECKING:
    from serving.engine.scheduler import ScheduledSeq


class Status(enum.Enum):
    WAITING = "waiting"  # queued; holds no memory (or lost it to preemption)
    QUEUED_FOR_TRANSFER = "queued_for_transfer"  # computed elsewhere; waits for memory
    WAITING_FOR_TRANSFER = "waiting_for_transfer"  # memory held, being filled remotely
    RUNNING = "running"
    FINISHED = "finished"


@dataclass
class Request:
    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    seed: int  # params.seed, or one drawn by the engine
    arrival_time: float = field(default_factory=time.perf_counter)

    status: Status = Status.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    logprobs: list[dict[int, float]] = field(default_factory=list)
    num_computed_tokens: int = 0
    num_pending: int = 0
    block_ids: list[int] = field(default_factory=list)
    slot: int | None = None
    epoch: int = 0
    num_preemptions: int = 0
    num_passed: int = 0  # scheduling passes that admitted a request queued behind it
    hold_on_finish: bool = False  # keep memory for a transfer lease after finishing
    # prefix caching (prefix_cache.py): the keys of the full blocks of known tokens,
    # how many of block_ids are registered under them, the prompt tokens the first
    # admission found cached, the end of the cached blocks it matched
    block_keys: list[bytes] = field(default_factory=list)
    num_registered_blocks: int = 0
    # decoding from transferred bytes whose source has not yet confirmed them (a stale
    # READ fails the request): registers no block until then
    transfer_unconfirmed: bool = False
    num_cached_tokens: int | None = None
    divergence: int | None = None  # where its prompt leaves the longest cached one
    # speculative decoding: drafts waiting in the draft buffer for the next step (with a
    # step in flight, the k it may have made), and the state row the last verify step
    # left its GDN state in (None: its slot); the last scheduled step that samples, until
    # the engine has processed it (its accepted count is then known on the host only)
    num_drafts: int = 0
    verify_state: int | None = None
    in_flight: "ScheduledSeq | None" = None
    host_drafts: list[int] | None = None  # drafts known on the host (a prefill worker's)

    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None
    output_text: str = ""
    scheduled_time: float | None = None  # first admitted into a step
    first_token_time: float | None = None
    finish_time: float | None = None

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_known_tokens(self) -> int:
        return len(self.prompt_token_ids) + len(self.output_token_ids)

    @property
    def num_tokens(self) -> int:
        """Known tokens plus sampled tokens still in flight."""
        return self.num_known_tokens + self.num_pending

    @property
    def num_generated(self) -> int:
        return len(self.output_token_ids) + self.num_pending

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    def token_slice(self, a: int, b: int) -> list[int]:
        """Known tokens [a, b) of prompt + output, without concatenating all."""
        p = len(self.prompt_token_ids)
        return self.prompt_token_ids[a:min(b, p)] + self.output_token_ids[max(a - p, 0):max(b - p, 0)]
