"""Device meshes and where every parameter, cache array and activation lives on them.

One mesh, three named axes:

* ``data``: independent batch rows.  Activations, KV blocks and GDN state slots
  split along it; parameters are replicated across it.
* ``expert``: MoE experts split along it (with ``tensor``: see ``expert_axes``);
  every other parameter is replicated across it.
* ``tensor``: attention heads, GDN value heads and FFN intermediate columns split
  along it (Megatron column/row pairs), the vocabulary of the LM head too.

The shardings are a declarative table (``PARAM_RULES``) from parameter path to
the partition of its own dimensions, with the count that must divide by the
axis size for the split to stay on head (or expert) boundaries; a split that
would cut a head falls back to replication rather than to a wrong layout.
Stacked leading axes (layer groups, GDN layers within a group) are never split.

Programs are compiled with these shardings as in/out shardings and traced under
``jax.set_mesh(mesh)``, so layers that need explicit collectives (the MoE's
expert-parallel dispatch) find the mesh with ``jax.sharding.get_abstract_mesh``
while the model code itself stays mesh-agnostic: without a mesh, or on a mesh of
one device, every layer runs its single-device path.

The attention, GDN and conv kernels are Pallas custom calls on the GPU, which the
SPMD partitioner cannot split: ``per_device`` runs each of them inside
``shard_map``, every device on its own heads (``head_axis``) with the cache pools
passed in and out in their own layout, so a kernel never gathers its operands.
"""

from __future__ import annotations

import dataclasses
import re

import jax
import numpy as np
from flax import nnx
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from qwen35_jax.cache import HybridCache
from qwen35_jax.config import Qwen35Config

DATA, EXPERT, TENSOR = "data", "expert", "tensor"
AXES = (DATA, EXPERT, TENSOR)


@dataclasses.dataclass(frozen=True)
class MeshShape:
    """Sizes of the three axes.  ``parse("dp2,ep2,tp1")`` reads a spec string; axes left
    out have size 1."""

    dp: int = 1
    ep: int = 1
    tp: int = 1

    def __post_init__(self):
        if min(self.dp, self.ep, self.tp) < 1:
            raise ValueError(f"mesh axis sizes must be >= 1, got {self}")

    @property
    def size(self) -> int:
        return self.dp * self.ep * self.tp

    @classmethod
    def parse(cls, spec: str) -> "MeshShape":
        sizes = {}
        for part in filter(None, (s.strip() for s in spec.split(","))):
            m = re.fullmatch(r"(dp|ep|tp)=?(\d+)", part)
            if not m or m.group(1) in sizes:
                raise ValueError(f"bad mesh spec {spec!r}: want e.g. 'dp2,ep2,tp1'")
            sizes[m.group(1)] = int(m.group(2))
        return cls(**sizes)


def make_mesh(shape: MeshShape, devices=None) -> Mesh:
    """The ``(data, expert, tensor)`` mesh over the first ``shape.size`` devices.

    Axes are Auto (GSPMD propagates shardings between the annotated points);
    ``tensor`` is innermost so its collectives stay between neighbouring devices."""
    devices = list(jax.devices() if devices is None else devices)
    if len(devices) < shape.size:
        raise ValueError(f"mesh {shape} needs {shape.size} devices, {len(devices)} available")
    grid = np.asarray(devices[:shape.size], dtype=object).reshape(shape.dp, shape.ep, shape.tp)
    return Mesh(grid, AXES, axis_types=(AxisType.Auto,) * 3)


def axis_size(mesh, axes) -> int:
    """Product of the sizes of ``axes`` (a name or a tuple of names) on ``mesh``."""
    names = (axes,) if isinstance(axes, str) else tuple(axes)
    return int(np.prod([mesh.shape[a] for a in names])) if names else 1


def expert_axes(mesh, num_experts: int) -> tuple[str, ...]:
    """The axes the experts are split over: ``expert`` and ``tensor`` together when the
    count divides (the FFN then needs no tensor split of its own: vLLM's EP = DP x TP
    uses the devices the same way), else ``expert`` alone, else none."""
    for axes in ((EXPERT, TENSOR), (EXPERT,), ()):
        if all(a in mesh.shape for a in axes) and num_experts % axis_size(mesh, axes) == 0:
            return axes
    return ()


# (parameter path regex, partition of the parameter's own trailing dimensions, config
# attribute whose count must divide by the split's axis size).  Kernels are [in, out].
# Unlisted parameters (norms, router, shared-expert gate, the GDN qkv projection and
# conv, whose [q | k | v] channel layout no contiguous split keeps head-aligned) are
# replicated.
PARAM_RULES: tuple[tuple[str, tuple, str], ...] = (
    (r"embed_tokens\.embedding", (None, TENSOR), "hidden_size"),
    (r"lm_head\.kernel", (None, TENSOR), "vocab_size"),
    (r".*self_attn\.q_proj\.kernel", (None, TENSOR), "num_attention_heads"),
    (r".*self_attn\.(k_proj|v_proj)\.kernel", (None, TENSOR), "num_key_value_heads"),
    (r".*self_attn\.o_proj\.kernel", (TENSOR, None), "num_attention_heads"),
    (r".*linear_attn\.(in_proj_z|in_proj_b|in_proj_a)\.kernel", (None, TENSOR),
     "linear_num_value_heads"),
    (r".*linear_attn\.(A_log|dt_bias)", (TENSOR,), "linear_num_value_heads"),
    (r".*linear_attn\.out_proj\.kernel", (TENSOR, None), "linear_num_value_heads"),
    (r".*mlp\.(gate_proj|up_proj)\.kernel", (None, TENSOR), "intermediate_size"),
    (r".*mlp\.down_proj\.kernel", (TENSOR, None), "intermediate_size"),
    (r".*mlp\.shared_expert\.(gate_proj|up_proj)\.kernel", (None, TENSOR),
     "shared_expert_intermediate_size"),
    (r".*mlp\.shared_expert\.down_proj\.kernel", (TENSOR, None),
     "shared_expert_intermediate_size"),
    (r".*mlp\.experts_(gate_up|down)", (EXPERT, None, None), "num_experts"),
)


def _fit(spec: tuple, count: int, mesh) -> tuple:
    """Drop splits whose axis size does not divide ``count`` (replicate instead)."""
    return tuple(a if a is None or count % axis_size(mesh, a) == 0 else None for a in spec)


def param_spec(cfg: Qwen35Config, path: str, ndim: int, mesh) -> P:
    """PartitionSpec of parameter ``path`` (dotted, as ``nnx.to_flat_state`` names it)."""
    for pattern, spec, unit in PARAM_RULES:
        if re.fullmatch(pattern, path):
            if unit == "num_experts":
                spec = (expert_axes(mesh, cfg.num_experts) or None,) + spec[1:]
            else:
                spec = _fit(spec, getattr(cfg, unit) or 0, mesh)
            return P(*((None,) * (ndim - len(spec)) + spec))
    return P()


def param_shardings(cfg: Qwen35Config, state: nnx.State, mesh) -> nnx.State:
    """NamedShardings with the structure of ``state`` (concrete or abstract)."""
    flat = [(k, NamedSharding(mesh, param_spec(cfg, ".".join(map(str, k)), len(v.shape), mesh)))
            for k, v in nnx.to_flat_state(state)]
    return nnx.from_flat_state(flat)


def shard_model(model: nnx.Module, mesh) -> nnx.Module:
    """Place an existing model's parameters on ``mesh`` (in place; returns the model)."""
    state = nnx.state(model)
    nnx.update(model, jax.device_put(state, param_shardings(model.config, state, mesh)))
    return model


def head_axis(mesh, heads: int) -> str | None:
    """``tensor`` if ``heads`` divide by its size (each device then holds whole heads),
    else None (replicated)."""
    return _fit((TENSOR,), heads, mesh)[0] if TENSOR in mesh.shape else None


def cache_specs(cfg: Qwen35Config, mesh):
    """PartitionSpecs of the HybridCache arrays: blocks and slots along ``data``, KV heads
    and GDN value heads along ``tensor`` when the head counts divide (else replicated);
    the conv state follows the replicated qkv projection."""
    kv_heads = head_axis(mesh, cfg.num_key_value_heads)
    v_heads = head_axis(mesh, cfg.linear_num_value_heads)
    return HybridCache(kv=P(DATA, None, None, None, kv_heads, None),
                       conv=P(DATA, None, None, None, None),
                       ssm=P(DATA, None, None, v_heads, None, None))


def cache_shardings(cfg: Qwen35Config, mesh):
    return jax.tree.map(lambda s: NamedSharding(mesh, s), cache_specs(cfg, mesh))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())


def mesh_of(array) -> Mesh | None:
    """The mesh an array is laid out on, or None for a single-device array."""
    s = getattr(array, "sharding", None)
    return s.mesh if isinstance(s, NamedSharding) and s.mesh.size > 1 else None


def per_device(fn, in_specs, out_specs):
    """``fn`` run by every device of the mesh the step is traced under, on its own
    shards (``shard_map`` over all axes); ``fn`` itself without a mesh or on one device.

    For the Pallas kernels: a custom call is opaque to the partitioner, which would
    replicate it (gathering split heads and cache shards first).  Axes a spec leaves
    out are replicated; in an engine (``data`` of size 1) that is the ``expert`` axis,
    whose devices all run every token's attention.  A model traced on a mesh with a
    ``data`` split hands its pools to the kernels whole along ``data``, since its block
    tables and slots are global indices.  The kernels are device-local programs that
    know nothing of mesh axes (their loop carries start invariant), hence no
    ``check_vma``; what a spec leaves replicated is computed alike on every device."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.size == 1:
        return fn
    return jax.shard_map(fn, mesh=mesh, in_specs=in_specs, out_specs=out_specs,
                         check_vma=False)
