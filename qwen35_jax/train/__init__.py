"""Training the built-in ``tiny-math`` models (``python -m qwen35_jax.train``)."""
