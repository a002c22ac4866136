"""Bias-free linear layer whose weight may arrive as a stack over layers.

Standalone, ``kernel`` is [in, out] and the layer is ``x @ kernel`` (what ``nnx.Linear``
does, with the same parameter name and initialiser). Inside the scanned model the
kernels reach each layer as the whole stack ([..., in, out], model.py) with the layer's
flat index, and ``layer_matmul`` reads that layer in place at decode sizes: a per-layer
slice of a stacked weight inside the layer scan is a copy of every dense weight on
every step (bench/RESULTS.md, "Decode: dense weights read in place from the layer
stack"). ``project`` runs the Linears that read the same x together: at decode sizes
their layers share one launch (``layer_matmuls``).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from pallas_kernels.block_fp8 import dequantize
from pallas_kernels.layer_matmul import layer_matmuls


class Linear(nnx.Module):
    def __init__(self, din: int, dout: int, *, rngs: nnx.Rngs, dtype=jnp.float32):
        self.kernel = nnx.Param(nnx.initializers.lecun_normal()(rngs.params(), (din, dout), dtype))

    def __call__(self, x, layer=None):
        """x [..., in]; ``layer``: the flat index into a stacked kernel's leading dimensions.
        An FP8 kernel (``quant.quantize_model`` gave it a ``scale``) goes to the matmul
        with its block scales."""
        return project(x, layer, self)[0]

    def _scale(self):
        return self.scale[...] if hasattr(self, "scale") else None


def project(x, layer, *linears: Linear):
    """(linear(x, layer) for each of ``linears``): stacked kernels through one
    ``layer_matmuls`` call, which reads them in one launch at decode sizes."""
    kernels = [lin.kernel[...] for lin in linears]
    if kernels[0].ndim == 2:
        return tuple(jnp.dot(x, w if s is None else dequantize(w, s, x.dtype))
                     for w, s in zip(kernels, (lin._scale() for lin in linears)))
    if layer is None:
        raise ValueError(f"a kernel stacked as {kernels[0].shape} needs the layer index")
    flat = lambda a: a.reshape((-1,) + a.shape[-2:])  # noqa: E731
    scales = [None if s is None else flat(s) for s in (lin._scale() for lin in linears)]
    outs = layer_matmuls(x.reshape(-1, x.shape[-1]), [flat(w) for w in kernels], layer,
                         scales=scales)
    return tuple(out.reshape(x.shape[:-1] + (w.shape[-1],)) for out, w in zip(outs, kernels))
