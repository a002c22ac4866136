"""Engine options (vLLM flag names where one exists)."""

from dataclasses import dataclass

from serving.engine.buckets import Buckets


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

    def __post_init__(self):
        if self.num_slots is None:
            self.num_slots = self.max_num_seqs
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
