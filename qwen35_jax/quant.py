"""Which of a model's parameters are FP8, and converting a model's parameters to FP8.

The format (e4m3 values with float32 scales per 128 x 128 block, Qwen's -FP8 layout) is
``pallas_kernels.block_fp8``: the kernels that read it define it. Which parameters are
FP8 is the config's ``fp8_modules`` (layer-relative paths, the same in every layer);
``quantize_model`` converts a model's parameters there, and the layers hand the FP8
weight and its scales to the matmul kernels, which dequantise a tile at a time.
"""

from __future__ import annotations

from flax import nnx

# re-exported: the block-scale rule is part of the model's API
from pallas_kernels.block_fp8 import BLOCK, dequantize, is_fp8, k_major, quantize  # noqa: F401

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


def is_k_major(ppath: str) -> bool:
    """Whether the parameter at ``ppath`` (an FP8 one, or its scales) is held K-major
    ([..., out, in]): the experts' tensors, which the FP8 tensor cores read that way."""
    return "mlp." + ppath.rsplit(".", 1)[-1].removesuffix("_scale") in EXPERTS


def quantize_model(model, paths) -> None:
    """Convert the parameters at layer-relative ``paths`` of every layer of ``model``
    (concrete or abstract, in place) to FP8 with block scales: a ``Linear``'s kernel
    gains ``scale``; an expert tensor, held K-major (block_fp8), ``<name>_scale``."""
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
                q, s = k_major(*quantize(getattr(module, name)[...], splits_of(name)))
                setattr(module, name, nnx.Param(q))
                setattr(module, name + "_scale", nnx.Param(s))
