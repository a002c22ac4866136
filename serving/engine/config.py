"""Engine options (vLLM flag names where one exists)."""

import numbers
from dataclasses import dataclass

from serving.engine.buckets import Buckets

SCHEDULING_POLICIES = ("lpm", "fcfs")
MAX_SPECULATIVE_TOKENS = 4


def speculative_tokens(config: dict | None) -> int:
    """k of vLLM's ``--speculative-config`` (``{"method": "mtp", "num_speculative_tokens":
    k}``); 0 for None. ValueError naming what is wrong otherwise."""
    if config is None:
        return 0
    if not isinstance(config, dict):
        raise ValueError(f"speculative config must be a JSON object, got {config!r}")
    unknown = set(config) - {"method", "num_speculative_tokens"}
    if unknown:
        raise ValueError(f"speculative config: unknown keys {sorted(unknown)}; this server "
                         "reads method and num_speculative_tokens")
    if config.get("method") != "mtp":
        raise ValueError(f"speculative config: method {config.get('method')!r} is not "
                         "supported; \"mtp\" (the model's MTP head) is")
    k = config.get("num_speculative_tokens")
    if type(k) is not int or not 1 <= k <= MAX_SPECULATIVE_TOKENS:
        raise ValueError(f"speculative config: num_speculative_tokens must be an integer in "
                         f"1..{MAX_SPECULATIVE_TOKENS}, got {k!r}")
    return k


@dataclass
class EngineConfig:
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    max_model_len: int = 4096
    block_size: int = 16
    # Cache capacity. None: sized from free device memory (see capacity.py).
    num_blocks: int | None = None
    num_slots: int | None = None  # default: max_num_seqs
    memory_utilization: float = 0.85  # share of device memory the engine may fill
    ssm_dtype: str = "float32"  # GDN recurrent state; "bfloat16" by option
    async_scheduling: bool = True
    max_logprobs: int = 20  # top-n logprobs are computed for n up to this; 0 = none
    buckets: Buckets | None = None  # default: powers of two up to the limits
    eos_token_ids: tuple[int, ...] = ()
    seed: int = 0  # draws the seeds of requests that have none
    track_device_idle: bool = False  # timestamp step completions (bench metric)
    # Mesh of this engine (qwen35_jax.sharding): experts split over ep*tp devices (or ep),
    # attention/GDN heads and FFN columns over tp.  Data parallelism is one engine per
    # rank (separate workers behind the router), not an axis inside one engine: see
    # docs/multihost.md.
    ep: int = 1
    tp: int = 1
    # Prefix caching (prefix_cache.py): GDN state snapshots every `prefix_state_interval`
    # blocks and at the prompt's end, in `num_prefix_snapshots` state rows (default:
    # max_num_seqs) after the request slots.
    enable_prefix_caching: bool = False
    prefix_state_interval: int = 32
    num_prefix_snapshots: int | None = None
    # Admission order of waiting requests (scheduler.py): "lpm" admits those with the
    # longest cached prefix first (SGLang's policy name), "fcfs" strictly by arrival.
    scheduling_policy: str = "lpm"
    # Speculative decoding with the model's MTP head (drafter.py): k drafts a decoding
    # request a step, verified in one target step; 0 = off. vLLM's
    # --speculative-config '{"method": "mtp", "num_speculative_tokens": k}'.
    num_speculative_tokens: int = 0

    def __post_init__(self):
        for name in ("max_num_seqs", "max_num_batched_tokens", "max_model_len", "block_size"):
            value = getattr(self, name)
            if not (isinstance(value, numbers.Integral) and value >= 1):
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        if self.num_blocks is not None and not (isinstance(self.num_blocks, numbers.Integral)
                                                and self.num_blocks >= 1):
            raise ValueError(f"num_blocks must be a positive integer, got {self.num_blocks!r}")
        if not (isinstance(self.max_logprobs, numbers.Integral) and self.max_logprobs >= 0):
            raise ValueError(f"max_logprobs must be an integer >= 0, got {self.max_logprobs!r}")
        if self.num_slots is None:
            self.num_slots = self.max_num_seqs
        if self.num_prefix_snapshots is None:
            self.num_prefix_snapshots = self.max_num_seqs if self.enable_prefix_caching else 0
        if self.enable_prefix_caching and (self.num_prefix_snapshots < 1
                                           or self.prefix_state_interval < 1):
            raise ValueError("prefix caching needs num_prefix_snapshots >= 1 and "
                             "prefix_state_interval >= 1")
        if not 0 <= self.num_speculative_tokens <= MAX_SPECULATIVE_TOKENS:
            raise ValueError(f"num_speculative_tokens must be in 0..{MAX_SPECULATIVE_TOKENS}, "
                             f"got {self.num_speculative_tokens}")
        if self.scheduling_policy not in SCHEDULING_POLICIES:
            raise ValueError(f"unknown scheduling policy {self.scheduling_policy!r}; one of "
                             f"{SCHEDULING_POLICIES}")
        if self.buckets is None:
            self.buckets = Buckets.default(self.max_num_seqs, self.max_num_batched_tokens)
        if self.num_slots < 1 or self.max_num_seqs < 1:
            raise ValueError("need at least one slot and one sequence")
        if min(self.ep, self.tp) < 1:
            raise ValueError(f"ep and tp must be >= 1, got ep={self.ep} tp={self.tp}")

    def mesh(self):
        """The engine's (data=1, expert, tensor) mesh, or None on a single device."""
        from qwen35_jax.sharding import MeshShape, make_mesh

        shape = MeshShape(ep=self.ep, tp=self.tp)
        return make_mesh(shape) if shape.size > 1 else None

    @property
    def max_blocks_per_seq(self) -> int:
        return -(-self.max_model_len // self.block_size)

    @property
    def num_state_rows(self) -> int:
        """Rows of the cache's conv and ssm arrays: request slots, snapshot rows, then k
        rows a slot for the states a verify step passes (`verify_row`)."""
        return self.num_slots * (1 + self.num_speculative_tokens) + self.num_prefix_snapshots

    @property
    def mtp_layers(self) -> int:
        """KV layers of the cache after the model's: the MTP head's, when it drafts."""
        return 1 if self.num_speculative_tokens else 0

    def verify_row(self, slot: int, r: int) -> int:
        """The state row of slot `slot`'s sequence after the (r + 1)-th token a verify
        step feeds it (r < k)."""
        return self.num_slots + self.num_prefix_snapshots + slot * self.num_speculative_tokens + r

    def snapshots_per_step(self, num_tokens: int, num_seqs: int) -> int:
        """GDN snapshots a prefill bucket emits at most: one per interval of its tokens
        plus the last two boundaries of a few sequences (more only lose hits). Each is a
        float32 state of every value head, per layer, in the step's working memory."""
        if not self.enable_prefix_caching:
            return 0
        return num_tokens // (self.prefix_state_interval * self.block_size) + 2 * min(num_seqs, 4)

    def states_per_step(self, num_tokens: int, num_seqs: int) -> int:
        """GDN states a prefill bucket stores: its prefix snapshots, and with
        speculative decoding the k states of each verified sequence."""
        return (self.snapshots_per_step(num_tokens, num_seqs)
                + min(num_seqs * self.num_speculative_tokens, num_tokens))
