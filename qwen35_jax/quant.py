"""FP8 weights with 128 x 128 block scales: the layout of Qwen's FP8 releases.

A quantised weight is float8 e4m3 values ``q`` and one float32 scale per 128 x 128
block (the checkpoints' ``weight_scale_inv``): ``w = q * scale[block]``. The scale
of a block is its largest magnitude over 448 (e4m3's largest finite value), so the
block's largest entry maps to +-448 and nothing saturates; an all-zero block has
scale 1. Edge blocks are partial (a dimension that is not a multiple of 128).

Weights here are in the kernels' [..., in, out] layout, the transpose of the
checkpoints' [out, in]: the rule is symmetric, so the scales are the transposed
``weight_scale_inv``. A fused tensor of ``splits`` weights side by side on its out
axis (the experts' [gate | up]) keeps each part's blocks: its scale holds each
part's block columns in turn.

Which parameters are FP8 is the config's ``fp8_modules`` (layer-relative paths, the
same in every layer); ``quantize_model`` converts a model's parameters there, and
the layers dequantise a layer's weight before their matmul (``dequantize_layer``).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
from flax import nnx

BLOCK = 128
FP8 = jnp.float8_e4m3fn
FP8_MAX = 448.0

# Layer-relative parameter paths that can be FP8, and the default set of
# ``--quantization fp8``: every matmul of a layer but the ones whose outputs are
# per-head or per-expert gates (the GDN's a/b projections, the router, the shared
# expert's gate), which stay in the model dtype, as the FP8 releases keep them.
LINEARS = ("linear_attn.in_proj_qkv", "linear_attn.in_proj_z", "linear_attn.in_proj_b",
           "linear_attn.in_proj_a", "linear_attn.out_proj", "self_attn.q_proj",
           "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj", "mlp.gate_proj",
           "mlp.up_proj", "mlp.down_proj", "mlp.router", "mlp.shared_expert.gate_proj",
           "mlp.shared_expert.up_proj", "mlp.shared_expert.down_proj",
           "mlp.shared_expert_gate")
EXPERTS = ("mlp.experts_gate_up", "mlp.experts_down")
QUANTISABLE = LINEARS + EXPERTS
_KEPT = ("linear_attn.in_proj_b", "linear_attn.in_proj_a", "mlp.router", "mlp.shared_expert_gate")
DEFAULT = tuple(p for p in QUANTISABLE if p not in _KEPT)
QUANTIZATIONS = ("fp8",)


def applicable(paths, is_moe: bool) -> tuple[str, ...]:
    """``paths`` that exist in a dense (MLP) or MoE (router, experts, shared expert) model."""
    moe_only = ("mlp.router", "mlp.shared_expert", "mlp.experts")
    dense_only = ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj")
    drop = dense_only if is_moe else moe_only
    return tuple(p for p in paths if not p.startswith(drop))


def splits_of(path: str) -> int:
    """Weights fused side by side on the out axis of the parameter at ``path``."""
    return 2 if path.endswith("experts_gate_up") else 1


def _blocks(n: int) -> int:
    return -(-n // BLOCK)


def _expand(scale, rows: int, cols: int, splits: int):
    """Per-block scales [..., bi, splits * bo] -> per-entry [..., rows, cols] (NumPy in,
    NumPy out)."""
    xp = np if isinstance(scale, np.ndarray) else jnp
    s = xp.repeat(scale, BLOCK, axis=-2)[..., :rows, :]
    part = cols // splits
    nb = scale.shape[-1] // splits
    return xp.concatenate([xp.repeat(s[..., j * nb:(j + 1) * nb], BLOCK, axis=-1)[..., :part]
                           for j in range(splits)], axis=-1)


def scale_shape(shape, splits: int = 1) -> tuple[int, ...]:
    *lead, rows, cols = shape
    return (*lead, _blocks(rows), splits * _blocks(cols // splits))


def quantize(w, splits: int = 1):
    """w [..., in, out] -> (q float8 e4m3 [..., in, out], scale float32 [..., in/128,
    splits * out/splits/128], blocks rounded up).

    A NumPy ``w`` is quantised in NumPy, whose float32 division is IEEE's, so the result
    is bit for bit that of the checkpoints' quantisers (PyTorch's); the loader quantises
    that way. A JAX array stays on its device (random weights for benchmarks): XLA's
    CPU division can be an ulp off, so a scale there may differ in its last bit."""
    xp = np if isinstance(w, np.ndarray) else jnp
    fp8 = ml_dtypes.float8_e4m3fn if xp is np else FP8
    *lead, rows, cols = w.shape
    if cols % splits:
        raise ValueError(f"{cols} columns do not split into {splits} equal parts")
    w = w.astype(np.float32)
    part = cols // splits
    pr, pc = _blocks(rows) * BLOCK - rows, _blocks(part) * BLOCK - part
    amax = []
    for j in range(splits):
        x = xp.pad(xp.abs(w[..., j * part:(j + 1) * part]),
                   [(0, 0)] * len(lead) + [(0, pr), (0, pc)])
        x = x.reshape(*lead, _blocks(rows), BLOCK, _blocks(part), BLOCK)
        amax.append(xp.max(x, axis=(-3, -1)))
    amax = xp.concatenate(amax, axis=-1)
    scale = xp.where(amax > 0, amax / np.float32(FP8_MAX), np.float32(1.0)).astype(np.float32)
    q = (w / _expand(scale, rows, cols, splits)).astype(fp8)
    return q, scale


def dequantize(q, scale, dtype, splits: int = 1):
    """q [..., in, out] float8 and its block scales -> [..., in, out] in ``dtype``."""
    s = _expand(scale, q.shape[-2], q.shape[-1], splits)
    return (q.astype(jnp.float32) * s).astype(dtype)


def dequantize_layer(q, scale, layer, dtype, *, core: int = 2, splits: int = 1):
    """Flat layer ``layer`` of a weight stacked over layers ([..., in, out], the last
    ``core`` axes one layer's: 2 for a kernel, 3 for experts [E, in, out]), dequantised;
    ``layer`` None: q is one layer's weight."""
    if layer is None or q.ndim == core:
        return dequantize(q, scale, dtype, splits)
    q = q.reshape((-1,) + q.shape[-core:])
    scale = scale.reshape((-1,) + scale.shape[-core:])
    return dequantize(jax.lax.dynamic_index_in_dim(q, layer, 0, keepdims=False),
                      jax.lax.dynamic_index_in_dim(scale, layer, 0, keepdims=False),
                      dtype, splits)


def is_fp8(x) -> bool:
    return jnp.dtype(x.dtype) == jnp.dtype(FP8)


def quantize_model(model, paths) -> None:
    """Convert the parameters at layer-relative ``paths`` of every layer of ``model``
    (concrete or abstract, in place) to FP8 with block scales: a ``Linear``'s kernel
    gains ``scale``, an expert tensor ``<name>_scale``."""
    from qwen35_jax.layers.linear import Linear

    paths = set(paths)
    modules = []
    for path, module in nnx.iter_graph(model):
        rel = ".".join(map(str, path))
        for prefix in ("groups.gdn.", "groups.attn."):
            if isinstance(module, nnx.Module) and rel.startswith(prefix):
                modules.append((rel[len(prefix):], module))
    for rel, module in modules:
        if isinstance(module, Linear) and rel in paths:
            q, s = quantize(module.kernel[...])
            module.kernel, module.scale = nnx.Param(q), nnx.Param(s)
        for name in ("experts_gate_up", "experts_down"):
            if f"{rel}.{name}" in paths and hasattr(module, name):
                q, s = quantize(getattr(module, name)[...], splits_of(name))
                setattr(module, name, nnx.Param(q))
                setattr(module, name + "_scale", nnx.Param(s))
