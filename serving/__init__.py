"""Serving for qwen35_jax: `serving.LLM` for notebooks and scripts, the engine
under `serving.engine`. Imported on first use, so that the command-line entry points
answer `--help` before JAX loads."""

__all__ = ["LLM", "Engine", "EngineConfig", "RequestOutput", "SamplingParams"]


def __getattr__(name):
    if name == "LLM":
        from serving.llm import LLM
        return LLM
    if name in __all__:
        import serving.engine
        return getattr(serving.engine, name)
    raise AttributeError(name)
