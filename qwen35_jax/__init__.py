"""Qwen3.5 language model (dense and MoE) in Flax NNX."""

from qwen35_jax.config import PRESETS, ConfigError, Qwen35Config, get_preset
from qwen35_jax.loader import (CheckpointError, abstract_model, from_pretrained, init_random,
                               restore_params, save_params)
from qwen35_jax.model import Qwen35ForCausalLM

__all__ = ["PRESETS", "CheckpointError", "ConfigError", "Qwen35Config", "Qwen35ForCausalLM",
           "abstract_model", "from_pretrained", "get_preset", "init_random", "restore_params",
           "save_params"]
