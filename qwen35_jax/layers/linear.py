"""Bias-free linear layer whose weight may arrive as a stack over layers.

Standalone, ``kernel`` is [in, out] and the layer is ``x @ kernel`` (what ``nnx.Linear``
does, with the same parameter name and initialiser). Inside the scanned model the
kernels reach each layer as the whole stack ([..., in, out], model.py) with the layer's
flat index, and ``layer_matmul`` reads that layer in place at decode sizes: a per-layer
slice of a stacked weight inside the layer scan is a copy of every dense weight on
every step (bench/RESULTS.md, "Decode: dense weights read in place from the layer
stack").
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.block_fp8 import dequantize
from pallas_kernels.layer_matmul import layer_matmul


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout), dtype))

    def __call__(self, x, layer=None):
        """x [..., in]; ``layer``: the flat index into a stacked kernel's leading dimensions.
        An FP8 kernel (``quant.quantize_model`` gave it a ``scale``) goes to the matmul
        with its block scales."""
        w = self.kernel[...]
        scale = self.scale[...] if hasattr(self, "scale") else None
        if w.ndim == 2:
            return jnp.dot(x, w if scale is None else dequantize(w, scale, x.dtype))
        if layer is None:
            raise ValueError(f"a kernel stacked as {w.shape} needs the layer index")
        if scale is not None:
            scale = scale.reshape((-1,) + scale.shape[-2:])
        out = layer_matmul(x.reshape(-1, x.shape[-1]), w.reshape((-1,) + w.shape[-2:]), layer,
                           scale=scale)
        return out.reshape(x.shape[:-1] + (w.shape[-1],))
