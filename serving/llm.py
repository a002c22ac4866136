"""`LLM`: generate from a notebook or script in three lines.

    from serving import LLM, SamplingParams
    llm = LLM("tiny", num_blocks=256)               # a preset with random weights,
    llm = LLM("tiny-math")                          # a built-in trained checkpoint,
    llm = LLM("/ckpt/Qwen3.5-0.8B")                 # a checkpoint directory,
    llm = LLM(model)                                # or a model object
    outs = llm.generate([[1, 2, 3], [4, 5]], SamplingParams(max_tokens=32, temperature=0))

Prompts are token-id lists; strings are accepted when a tokenizer is given
(or found in the checkpoint directory). Keyword arguments are EngineConfig
fields (max_num_seqs, max_num_batched_tokens, max_model_len, num_blocks, ...);
on a CPU the unset ones take the servers' small CPU defaults (`engine_defaults`).
`ep`/`tp` place the weights and the cache on a mesh of ep*tp devices
(`LLM("tiny-moe", ep=2, tp=2)`). Compiled programs are kept in XLA's persistent
cache (`compilation_cache_dir`), so a second start compiles nothing.
"""

import operator
import os

import jax
import jax.numpy as jnp
import numpy as np

from qwen35_jax import builtin
from serving.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from serving.engine.buckets import Buckets
from serving.engine.capacity import allocate_cache, plan_capacity
from serving.engine.compilation_cache import use_compilation_cache
from serving.engine.config import speculative_tokens

# On a CPU, long prefill programs are slow (seconds per step for the tiny model at 256
# tokens), so prompts are prefilled in chunks of at most 64 tokens.
CPU_LIMITS = {"max_num_seqs": 8, "max_num_batched_tokens": 64, "max_model_len": 1024}


def engine_defaults(kw: dict) -> dict:
    """EngineConfig fields `kw` with, on a CPU, small defaults for the unset ones (the
    servers' too): `CPU_LIMITS`, blocks for every sequence at full length, and three
    programs (`Buckets.few`), so that start-up takes seconds. Elsewhere EngineConfig's
    own defaults stand."""
    if jax.default_backend() != "cpu":
        return kw
    kw = {**CPU_LIMITS, **kw}
    block_size = kw.get("block_size", EngineConfig.block_size)
    kw.setdefault("num_blocks", kw["max_num_seqs"] * -(-kw["max_model_len"] // block_size))
    kw.setdefault("buckets", Buckets.few(kw["max_num_seqs"], kw["max_num_batched_tokens"]))
    return kw


def adopt_model_limits(config: EngineConfig, model_cfg, given) -> None:
    """Set the engine config's fields that the model decides, unless the caller named
    them in ``given``: the EOS ids, and a max_model_len within the positions the model
    was trained on (its ``max_position_embeddings``, as vLLM derives it)."""
    if "eos_token_ids" not in given:
        config.eos_token_ids = tuple(model_cfg.eos_token_ids)
    if "max_model_len" not in given:
        config.max_model_len = min(config.max_model_len, model_cfg.max_position_embeddings)


def default_dtype():
    """Weights and cache dtype unless given: bfloat16 on accelerators; float32 on CPU, where
    bfloat16 is slow (and where the tests compare against float references)."""
    return jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16


def model_config(model: str, hf_overrides: dict | None = None, quantization: str | None = None):
    """The config of a checkpoint directory or a preset name, read without weights;
    ``hf_overrides`` (HF config fields) apply to presets, whose weights are random.
    ``quantization`` ("fp8", vLLM's flag): the layer matmuls in FP8 with block scales
    (qwen35_jax/quant.py), quantised on load; an FP8 checkpoint is FP8 without it."""
    import qwen35_jax
    from qwen35_jax import quant
    from qwen35_jax.loader import checkpoint_config

    if quantization not in (None, *quant.QUANTIZATIONS):
        raise ValueError(f"unknown quantization {quantization!r}; one of {quant.QUANTIZATIONS}")
    model = builtin.resolve(model)
    if os.path.isdir(model):
        if hf_overrides:
            raise ValueError(f"hf_overrides apply to presets (random weights), not to the "
                             f"checkpoint {model}, whose weights fix its shapes")
        cfg = checkpoint_config(model)
    else:
        cfg = qwen35_jax.get_preset(model)
        cfg = cfg.with_overrides(hf_overrides) if hf_overrides else cfg
    if quantization == "fp8" and not cfg.fp8_modules:
        cfg = cfg.replace(fp8_modules=quant.applicable(quant.DEFAULT, cfg.is_moe))
    return cfg


def load_model(model, dtype, seed, mesh=None, hf_overrides=None, quantization=None):
    """A model object as given (placed on ``mesh`` if one is given), a checkpoint
    directory or built-in checkpoint, or a preset name (random weights), loaded straight
    into ``mesh``'s layout."""
    import qwen35_jax
    from qwen35_jax.sharding import shard_model

    model = builtin.resolve(model)
    if not isinstance(model, str):
        if hf_overrides or quantization:
            raise ValueError("hf_overrides and quantization apply to a checkpoint or a preset "
                             "name, not to a model object")
        return model if mesh is None else shard_model(model, mesh)
    cfg = model_config(model, hf_overrides, quantization)
    if os.path.isdir(model):
        return qwen35_jax.from_pretrained(model, dtype=dtype, mesh=mesh, config=cfg)
    return qwen35_jax.init_random(cfg, seed=seed, dtype=dtype, mesh=mesh)


def load_mtp_head(model, cfg, dtype, seed):
    """The MTP head of a checkpoint directory or built-in checkpoint (None if it has
    none), or a random one for a preset (speed measured at a forced acceptance is what
    a random head serves for)."""
    from flax import nnx

    from qwen35_jax.mtp_checkpoint import load_mtp
    from qwen35_jax.mtp import MTP

    model = builtin.resolve(model)
    if not isinstance(model, str):
        return None
    if os.path.isdir(model):
        return load_mtp(model, cfg, dtype)
    return MTP(cfg, rngs=nnx.Rngs(seed + 1), dtype=dtype)


def _load_tokenizer(tokenizer, model):
    model = builtin.resolve(model)
    if tokenizer is None and isinstance(model, str) and os.path.isfile(
            os.path.join(model, "tokenizer.json")):
        tokenizer = model
    if isinstance(tokenizer, str):
        from transformers import AutoTokenizer
        return AutoTokenizer.from_pretrained(tokenizer)
    return tokenizer


class LLM:
    def __init__(self, model, *, tokenizer=None, dtype=None, seed: int = 0,
                 hf_overrides: dict | None = None, quantization: str | None = None,
                 compilation_cache_dir: str | None = None,
                 speculative_config: dict | None = None, **engine_kwargs):
        use_compilation_cache(compilation_cache_dir)
        if dtype is None:
            dtype = default_dtype()
        if speculative_config is not None:
            engine_kwargs["num_speculative_tokens"] = speculative_tokens(speculative_config)
        config = EngineConfig(**engine_defaults({"seed": seed, **engine_kwargs}))
        mesh = config.mesh()
        self.model = load_model(model, dtype, seed, mesh, hf_overrides, quantization)
        self.tokenizer = _load_tokenizer(tokenizer, model)
        cfg = self.model.config
        adopt_model_limits(config, cfg, engine_kwargs)
        self.cache_report = plan_capacity(cfg, config, dtype, mesh=mesh)
        cache = allocate_cache(cfg, config, dtype, mesh)
        mtp = load_mtp_head(model, cfg, dtype, seed) if config.num_speculative_tokens else None
        self.engine = Engine(self.model, cache, config, tokenizer=self.tokenizer, mtp=mtp)

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None
                 ) -> list[RequestOutput]:
        """Prompts: one or many, as token-id lists (or NumPy arrays) or, with a tokenizer,
        strings."""
        if isinstance(prompts, np.ndarray):
            prompts = prompts.tolist()
        if isinstance(prompts, str) or (len(prompts) and isinstance(prompts[0], (int, np.integer))):
            prompts = [prompts]
        ids = []
        for p in prompts:
            if isinstance(p, str):
                if self.tokenizer is None:
                    raise ValueError("string prompts need a tokenizer; pass token ids")
                p = self.tokenizer.encode(p)
            try:
                ids.append([operator.index(t) for t in p])
            except TypeError:
                raise ValueError(f"a prompt is a string or a list of token ids, "
                                 f"got {p!r:.80}") from None
        return self.engine.generate(ids, sampling_params)

    def metrics(self) -> dict:
        return {**self.engine.metrics(), "cache": self.cache_report}
