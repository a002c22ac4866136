"""Loading Hugging Face Qwen3.5 checkpoints, random weights, and orbax round trips.

Checkpoint names map to parameters through one declarative table (in the
manner of sglang-jax's weight mappings): a layer-relative name pattern, the
parameter path inside the layer, and the transform from PyTorch's layout.
Layer ``i`` lands at group ``i // interval``; inside the group it is GDN layer
``i % interval`` or, for the last position, the attention layer, stacked on
the parameters' leading axes.

Tensors stream one at a time from memory-mapped safetensors to the device,
where each is written into its preallocated stacked parameter by a donated
update: host memory never holds more than one tensor.
"""

from __future__ import annotations

import contextlib
import functools
import json
import os
import re
from typing import Callable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tqdm.auto import tqdm

from qwen35_jax import quant, sharding
from qwen35_jax.config import Qwen35Config
from qwen35_jax.model import Qwen35ForCausalLM


class CheckpointError(ValueError):
    """A checkpoint that cannot be loaded into the model: missing, malformed or unsupported."""


def transpose(x):  # nn.Linear [out, in] -> kernel [in, out]
    return x.T


def _swap_last(x):  # experts [E, out, in] -> [E, in, out]
    return jnp.swapaxes(x, -1, -2)


def _squeeze_conv(x):  # depthwise conv1d [C, 1, K] -> [C, K]
    return x.reshape(x.shape[0], x.shape[-1])


def identity(x):
    return x


def _unsqueeze_conv(x):  # [C, K] -> depthwise conv1d [C, 1, K]
    return x.reshape(x.shape[0], 1, x.shape[-1])


# Each transform's inverse: parameter layout -> PyTorch's (the exporter's direction).
INVERSE: dict[Callable, Callable] = {transpose: transpose, _swap_last: _swap_last,
                                     _squeeze_conv: _unsqueeze_conv, identity: identity}


# (layer-relative checkpoint name, parameter path inside the layer, transform).
# Patterns are anchored regexes; a group in the pattern is substituted into the path.
LAYER_TABLE: tuple[tuple[str, str, Callable], ...] = (
    (r"input_layernorm\.weight", "input_layernorm.weight", identity),
    (r"post_attention_layernorm\.weight", "post_attention_layernorm.weight", identity),
    (r"linear_attn\.(in_proj_qkv|in_proj_z|in_proj_b|in_proj_a|out_proj)\.weight",
     r"linear_attn.\1.kernel", transpose),
    (r"linear_attn\.conv1d\.weight", "linear_attn.conv1d", _squeeze_conv),
    (r"linear_attn\.(A_log|dt_bias)", r"linear_attn.\1", identity),
    (r"linear_attn\.norm\.weight", "linear_attn.norm.weight", identity),
    (r"self_attn\.(q_proj|k_proj|v_proj|o_proj)\.weight", r"self_attn.\1.kernel", transpose),
    (r"self_attn\.(q_norm|k_norm)\.weight", r"self_attn.\1.weight", identity),
    (r"mlp\.(gate_proj|up_proj|down_proj)\.weight", r"mlp.\1.kernel", transpose),
    (r"mlp\.gate\.weight", "mlp.router.kernel", transpose),
    (r"mlp\.experts\.gate_up_proj", "mlp.experts_gate_up", _swap_last),
    (r"mlp\.experts\.down_proj", "mlp.experts_down", _swap_last),
    (r"mlp\.shared_expert\.(gate_proj|up_proj|down_proj)\.weight",
     r"mlp.shared_expert.\1.kernel", transpose),
    (r"mlp\.shared_expert_gate\.weight", "mlp.shared_expert_gate.kernel", transpose),
)
# Per-expert 2-D tensors (an alternative on-disk layout HF also reads): expert e's
# gate/up rows go into its slice of the fused [E, D, 2I] tensor, down into [E, I, D].
PER_EXPERT = re.compile(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight")
TOP_TABLE = {
    "embed_tokens.weight": ("embed_tokens.embedding", identity),
    "norm.weight": ("norm.weight", identity),
}
PREFIXES = ("model.language_model.", "model.")
IGNORED = re.compile(r"^(mtp\.|model\.visual\.|visual\.|model\.mtp\.)")  # mtp.*: mtp_checkpoint.py
LAYER = re.compile(r"layers\.(\d+)\.(.+)")
QUANTISED_DTYPES = {"F8_E5M2", "I8", "U8", "I4", "U4", "F4"}  # F8_E4M3: FP8 (quant.py)
FLOAT_DTYPES = {"F16", "BF16", "F32", "F64", "F8_E4M3"}  # what a parameter is stored as
SCALE_SUFFIX = "_scale_inv"  # "<name>.weight_scale_inv": the block scales of "<name>.weight"


def checkpoint_target(cfg: Qwen35Config, name: str):
    """Checkpoint name -> (param path, leading index tuple, transform, expert slice) or None."""
    if name == "lm_head.weight":
        return ("lm_head.kernel", (), transpose, None) if not cfg.tie_word_embeddings else "skip"
    for p in PREFIXES:
        if name.startswith(p):
            rest = name[len(p):]
            break
    else:
        return None
    if rest in TOP_TABLE:
        path, fn = TOP_TABLE[rest]
        return path, (), fn, None
    m = LAYER.fullmatch(rest)
    if not m:
        return None
    i, sub = int(m.group(1)), m.group(2)
    if i >= cfg.num_hidden_layers:
        return None
    period = cfg.full_attention_interval
    g, pos = divmod(i, period)
    base, index = ("groups.attn", (g,)) if pos == period - 1 else ("groups.gdn", (g, pos))
    inner = layer_target(cfg, sub)
    if inner is None:
        return None
    path, expert, fn, cols = inner
    return f"{base}.{path}", index + expert, fn, cols


def layer_target(cfg: Qwen35Config, sub: str):
    """Layer-relative checkpoint name -> (parameter path inside the layer, expert index
    tuple, transform, column slice of the fused gate/up tensor) or None."""
    for pattern, path, fn in LAYER_TABLE:
        pm = re.fullmatch(pattern, sub)
        if pm:
            return pm.expand(path), (), fn, None
    pm = PER_EXPERT.fullmatch(sub)
    if pm and cfg.is_moe and int(pm.group(1)) < cfg.num_experts:
        e, which = int(pm.group(1)), pm.group(2)
        inter = cfg.moe_intermediate_size
        if which == "down_proj":
            return "mlp.experts_down", (e,), transpose, None
        cols = slice(0, inter) if which == "gate_proj" else slice(inter, 2 * inter)
        return "mlp.experts_gate_up", (e,), transpose, cols
    return None


def shard_files(path: str) -> list[str]:
    """The safetensors files of a checkpoint directory (its index's, or the one file)."""
    index = os.path.join(path, "model.safetensors.index.json")
    single = os.path.join(path, "model.safetensors")
    if os.path.exists(index):
        try:
            with open(index) as f:
                files = sorted(set(json.load(f)["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CheckpointError(f"{index}: not a safetensors index with a weight_map "
                                  f"({e!r})") from None
        if not all(isinstance(x, str) for x in files):
            raise CheckpointError(f"{index}: its weight_map names files by strings")
        missing = [s for s in files if not os.path.exists(os.path.join(path, s))]
        if missing:
            raise CheckpointError(f"{path}: shard(s) listed in model.safetensors.index.json are "
                                  f"missing: {missing}")
        return [os.path.join(path, s) for s in files]
    if os.path.exists(single):
        return [single]
    others = [f for f in os.listdir(path) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
    if others:
        raise CheckpointError(f"{path}: only non-safetensors weights found ({others[:3]}); "
                              "this loader reads safetensors checkpoints")
    raise CheckpointError(f"{path}: no model.safetensors or model.safetensors.index.json")


_write = jax.jit(lambda leaf, value, index: jax.lax.dynamic_update_slice(
    leaf, value.astype(leaf.dtype), index), donate_argnums=0)


def _zeros(shape, dtype, out_sharding):
    """A zero parameter, created directly in its sharded layout when one is given."""
    return jax.jit(lambda: jnp.zeros(shape, dtype), out_shardings=out_sharding)()


def abstract_model(cfg: Qwen35Config, dtype=jnp.bfloat16) -> Qwen35ForCausalLM:
    """The model with shapes only (no memory): for compile-only work and as a load target."""
    return nnx.eval_shape(lambda: _build(cfg, nnx.Rngs(0), dtype))


def _build(cfg: Qwen35Config, rngs, dtype) -> Qwen35ForCausalLM:
    model = Qwen35ForCausalLM(cfg, rngs=rngs, dtype=dtype)
    quant.quantize_model(model, cfg.fp8_modules)
    return model


def _scale_path(ppath: str) -> str:
    """The block-scale parameter of an FP8 parameter (quant.quantize_model's names)."""
    return ppath[:-len("kernel")] + "scale" if ppath.endswith(".kernel") else ppath + "_scale"


def _relative(ppath: str) -> str:
    """A layer parameter's path inside its layer, as ``fp8_modules`` names it."""
    rel = ppath.split(".", 2)[2]
    return rel[:-len(".kernel")] if rel.endswith(".kernel") else rel


def checkpoint_config(path: str | os.PathLike) -> Qwen35Config:
    """The config of a checkpoint directory, with ``fp8_modules`` the layer parameters
    its tensors hold in FP8 (those with a ``weight_scale_inv``; the same in every layer
    once loaded: a layer that left one in bf16 is quantised on load)."""
    path = os.fspath(path)
    cfg = Qwen35Config.from_json(path)
    if not cfg.fp8_modules:
        return cfg
    found = set()
    for shard in shard_files(path):
        with open_shard(shard) as f:
            for name in f.keys():
                if name.endswith(".weight" + SCALE_SUFFIX) and not IGNORED.match(name):
                    tgt = checkpoint_target(cfg, name[:-len(SCALE_SUFFIX)])
                    if tgt is None or tgt == "skip" or not tgt[0].startswith("groups."):
                        raise CheckpointError(f"{path}: {name!r} scales a tensor that this "
                                              "model does not hold in FP8")
                    found.add(_relative(tgt[0]))
    return cfg.replace(fp8_modules=tuple(p for p in quant.QUANTISABLE if p in found))


@contextlib.contextmanager
def open_shard(shard: str, framework: str = "flax"):
    """``safetensors.safe_open``, with a shard it cannot read (truncated, or not
    safetensors at all) named in a CheckpointError."""
    from safetensors import SafetensorError, safe_open

    try:
        f = safe_open(shard, framework=framework)
    except (SafetensorError, OSError) as e:
        raise CheckpointError(f"{shard}: not a readable safetensors file ({e})") from None
    with f:
        yield f


def refuse_other_formats(path: str, name: str, dtype: str) -> None:
    """Raise CheckpointError for a tensor quantised in a format the loaders do not read
    (their one FP8 format: e4m3 with 128 x 128 ``weight_scale_inv`` block scales), or
    stored as integers or booleans, which no parameter is (a cast would load them as
    numbers of another meaning)."""
    if dtype in QUANTISED_DTYPES or name.endswith(".weight_scale"):
        raise CheckpointError(f"{path}: tensor {name!r} is quantised ({dtype}) in a format "
                              "this loader does not read: only FP8 e4m3 with 128 x 128 block "
                              "scales (weight_scale_inv)")
    if dtype not in FLOAT_DTYPES:
        raise CheckpointError(f"{path}: tensor {name!r} is {dtype}, not a floating-point "
                              f"tensor ({', '.join(sorted(FLOAT_DTYPES))})")


def read_tensor(f, shard: str, name: str, dtype: str):
    """Tensor ``name`` of the open safetensors file ``f`` (path ``shard``) whose
    safetensors dtype is ``dtype``: e4m3 ("F8_E4M3") read through PyTorch, since
    safetensors' NumPy and Flax readers have no FP8 type; anything else as Flax reads it."""
    if dtype != "F8_E4M3":
        return f.get_tensor(name)
    import ml_dtypes
    import torch

    with open_shard(shard, framework="pt") as pt:
        raw = pt.get_tensor(name).view(torch.uint8).numpy()
    return jnp.asarray(raw.view(ml_dtypes.float8_e4m3fn))


def _scale_cols(cols: slice | None) -> slice | None:
    """The block-scale columns of the part of a fused tensor at columns ``cols`` (each
    part has its own blocks: quant.py)."""
    if cols is None:
        return None
    nb = -(-(cols.stop - cols.start) // quant.BLOCK)
    j = cols.start // (cols.stop - cols.start)
    return slice(j * nb, (j + 1) * nb)


def from_pretrained(path: str | os.PathLike, dtype=jnp.bfloat16, *,
                    config: Qwen35Config | None = None, progress: bool = True, mesh=None
                    ) -> Qwen35ForCausalLM:
    """Load a Hugging Face Qwen3.5 checkpoint directory (dense or MoE, sharded or not).

    With ``mesh``, every parameter is allocated with its ``qwen35_jax.sharding`` layout
    before the tensors stream in, so no device ever holds a whole split weight.

    FP8 (``cfg.fp8_modules``, quant.py): an FP8 checkpoint's e4m3 tensors and their
    ``weight_scale_inv`` block scales load as they are; a bf16 tensor of a parameter
    held in FP8 (``--quantization fp8`` on a bf16 checkpoint) is quantised on load, one
    tensor at a time.

    Raises CheckpointError on a missing shard or tensor, a shape mismatch, an
    unexpected tensor, or a quantised tensor in another format, and ConfigError on a
    config that is not Qwen3.5.
    """
    path = os.fspath(path)
    cfg = config or checkpoint_config(path)
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(abstract)}
    shardings = None if mesh is None else dict(nnx.to_flat_state(
        sharding.param_shardings(cfg, abstract, mesh)))
    leaves = {k: _zeros(v.shape, v.dtype, None if shardings is None else
                        shardings[tuple(path_key(p) for p in k.split("."))])
              for k, v in flat.items()}
    filled: dict[str, set] = {k: set() for k in flat}
    expected = {k: _coverage(cfg, k) for k in flat}

    shards = shard_files(path)
    total = 0
    for shard in shards:
        with open_shard(shard) as f:
            total += len(f.keys())

    def put(ppath, value, index, cols, name):
        """Write one tensor (in the [..., in, out] layout, ``cols`` of its out axis) into
        its stacked leaf, transposed where the leaf is K-major (FP8 experts)."""
        leaf = leaves[ppath]
        out_axis = -1
        if quant.is_k_major(ppath) and quant.is_fp8(leaves[ppath.removesuffix("_scale")]):
            value, out_axis = value.swapaxes(-1, -2), -2
        want = list(leaf.shape[len(index):])
        if cols is not None:
            want[out_axis] = cols.stop - cols.start
        if tuple(value.shape) != tuple(want):
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(value.shape)} after layout "
                f"conversion, but the config implies {tuple(want)}")
        start = list(index + (0,) * (leaf.ndim - len(index)))
        if cols is not None:
            start[out_axis] = cols.start
        leaves[ppath] = _write(leaf, value.reshape((1,) * len(index) + value.shape),
                               jnp.array(start, jnp.int32))
        lead = len(next(iter(expected[ppath])))  # stacking axes: 0, 1 (attn) or 2 (GDN)
        filled[ppath].add(index if len(index) == lead else
                          index[:lead] + ((index[lead], cols.start if cols else 0),))

    fp8_weights, scaled = set(), set()  # names of e4m3 weights; of weights given a scale
    bar = tqdm(total=total, desc="loading weights", unit="tensor", disable=not progress)
    for shard in shards:
        with open_shard(shard) as f:
            for name in f.keys():
                bar.update(1)
                if IGNORED.match(name):
                    continue
                dt = f.get_slice(name).get_dtype()
                is_scale = name.endswith(".weight" + SCALE_SUFFIX)
                refuse_other_formats(path, name, dt)
                tgt = checkpoint_target(cfg, name[:-len(SCALE_SUFFIX)] if is_scale else name)
                if tgt == "skip":
                    continue
                if tgt is None:
                    raise CheckpointError(f"{path}: unexpected tensor {name!r} for a "
                                          f"{'MoE' if cfg.is_moe else 'dense'} Qwen3.5 model")
                ppath, index, fn, cols = tgt
                fp8 = quant.is_fp8(leaves[ppath])
                if (is_scale or dt == "F8_E4M3") and not fp8:
                    raise CheckpointError(f"{path}: tensor {name!r} is FP8 but {ppath} is not "
                                          f"one of this config's fp8_modules {cfg.fp8_modules}")
                (scaled.add(name[:-len(SCALE_SUFFIX)]) if is_scale
                 else fp8_weights.add(name) if dt == "F8_E4M3" else None)
                raw = read_tensor(f, shard, name, dt)
                try:
                    value = fn(raw)
                except (TypeError, ValueError, IndexError):  # a rank the layout cannot take
                    raise CheckpointError(f"{path}: tensor {name!r} has shape {raw.shape}, "
                                          f"which the model's layout cannot take") from None
                if is_scale:
                    put(_scale_path(ppath), value.astype(jnp.float32), index, _scale_cols(cols),
                        name)
                elif fp8 and dt != "F8_E4M3":  # a bf16 tensor of an FP8 parameter: quantised
                    q, scale = quant.quantize(np.asarray(value, np.float32),
                                              1 if cols else quant.splits_of(ppath))
                    put(ppath, jnp.asarray(q), index, cols, name)
                    put(_scale_path(ppath), jnp.asarray(scale), index, _scale_cols(cols), name)
                else:
                    put(ppath, value, index, cols, name)
    bar.close()
    # a scale belongs to an e4m3 weight: beside a wider one it would rescale the weight's
    # own values (or be overwritten by the scale its quantisation on load computes)
    unpaired = sorted(scaled ^ fp8_weights)
    if unpaired:
        name = unpaired[0]
        raise CheckpointError(f"{path}: {name!r} is " + (
            "FP8 e4m3 without its weight_scale_inv" if name in fp8_weights
            else "not FP8 e4m3 but has a weight_scale_inv beside it"))
    filled = {k: _layers_covered(cfg, k, v) for k, v in filled.items()}
    missing = [k for k in flat if not expected[k] <= filled[k]]
    if missing:
        details = [f"{k} (missing entries {sorted(expected[k] - filled[k])[:4]})" for k in missing]
        raise CheckpointError(f"{path}: checkpoint lacks tensors for {details[:6]}"
                              f"{' ...' if len(details) > 6 else ''}")
    state = nnx.from_flat_state({tuple(path_key(p) for p in k.split(".")): leaves[k] for k in flat})
    return nnx.merge(graphdef, state)


def path_key(part: str):
    """A parameter path's part as nnx keys it: list indices as ints."""
    return int(part) if part.isdigit() else part


def _layers_covered(cfg: Qwen35Config, path: str, units: set) -> set:
    """Layer indices fully written: directly, or by every per-expert tensor of that layer."""
    whole = {u for u in units if not (u and isinstance(u[-1], tuple))}
    parts: dict[tuple, set] = {}
    for u in units - whole:
        parts.setdefault(u[:-1], set()).add(u[-1])
    need = cfg.num_experts * (2 if "experts_gate_up" in path else 1)
    return whole | {lead for lead, got in parts.items() if len(got) == need}


def _coverage(cfg: Qwen35Config, path: str) -> set:
    """The stacking indices that must be written for parameter ``path`` to be complete."""
    if path.startswith("groups.gdn"):
        return {(g, j) for g in range(cfg.num_groups) for j in range(cfg.gdn_per_group)}
    if path.startswith("groups.attn"):
        return {(g,) for g in range(cfg.num_groups)}
    return {()}


def init_random(cfg: Qwen35Config, seed: int = 0, dtype=jnp.bfloat16, *, mesh=None
                ) -> Qwen35ForCausalLM:
    """Random weights created directly on device (one jitted program), for benchmarks;
    with ``mesh``, created in their sharded layout (the same values as without)."""
    graphdef, init = _init_program(cfg, dtype, mesh)
    return nnx.merge(graphdef, init(jax.random.key(seed)))


@functools.lru_cache(maxsize=16)
def _init_program(cfg: Qwen35Config, dtype, mesh):
    """The model's graph and the jitted initialiser of its state for one (config, dtype,
    mesh); the initialiser takes the seed's key as an argument, so another model of the
    same shapes (another seed, or the same preset again) reuses the compiled program.
    Compiling it is most of ``init_random``'s time on CPU (every parameter's threefry
    stream is inlined: about 10 s for ``tiny-moe``), and one process often builds the
    same preset several times (the test suite, a benchmark sweep). The values are those
    of ``nnx.Rngs(seed)``, which makes its key with the same ``jax.random.key(seed)``.

    On CPU the program is compiled at LLVM optimisation level 0: it runs once, and LLVM's
    default level spends most of the compile on the inlined threefry streams (tiny-moe: a
    quarter of the time at level 0). The values are those of the level-0 program, on one
    device and on a mesh alike; they differ from the default level's in the last bits
    (the two levels round the normal's transform differently)."""
    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    out = None if mesh is None else sharding.param_shardings(cfg, abstract, mesh)
    cpu = (jax.default_backend() if mesh is None else mesh.devices.flat[0].platform) == "cpu"
    return graphdef, jax.jit(
        lambda key: nnx.state(_build(cfg, nnx.Rngs(key), dtype)),
        out_shardings=out, compiler_options={"xla_backend_optimization_level": 0} if cpu else None)


def save_params(model: Qwen35ForCausalLM, path: str | os.PathLike) -> None:
    """Save converted parameters with orbax (restores without re-reading safetensors)."""
    import orbax.checkpoint as ocp

    with ocp.StandardCheckpointer() as ckpt:
        ckpt.save(os.path.abspath(os.fspath(path)), nnx.state(model))


def restore_params(path: str | os.PathLike, cfg: Qwen35Config, dtype=jnp.bfloat16
                   ) -> Qwen35ForCausalLM:
    import orbax.checkpoint as ocp

    graphdef, abstract = nnx.split(abstract_model(cfg, dtype))
    with ocp.StandardCheckpointer() as ckpt:
        state = ckpt.restore(os.path.abspath(os.fspath(path)), abstract)
    return nnx.merge(graphdef, state)
