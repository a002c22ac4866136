"""Serving for qwen35_jax: `serving.LLM` for notebooks and scripts, the engine
under `serving.engine`."""

from serving.engine import Engine, EngineConfig, RequestOutput, SamplingParams
from serving.llm import LLM

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]
