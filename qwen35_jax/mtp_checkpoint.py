"""The multi-token-prediction head's checkpoint names (``mtp.*``) and its reader.

The head (``qwen35_jax.mtp.MTP``) is one decoder layer with its own input projection and
norms. Its tensors share the layer names of the model's table (``loader.LAYER_TABLE``)
under "mtp.layers.0.", and the per-tensor reader of the model's loader; being one layer
read once a draft, it loads into host memory whole and FP8 tensors are dequantised.
"""

from __future__ import annotations

import os

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax import quant
from qwen35_jax.config import Qwen35Config
from qwen35_jax.loader import (SCALE_SUFFIX, CheckpointError, identity, layer_target, open_shard,
                               path_key, read_tensor, refuse_other_formats, shard_files,
                               transpose)
from qwen35_jax.mtp import MTP

# The MTP head (qwen35_jax.mtp.MTP): "mtp." + these names, and its one decoder layer as
# "mtp.layers.0." + a LAYER_TABLE name (per-expert 2-D experts in Qwen3.5's releases).
MTP_TABLE = {
    "fc.weight": ("fc.kernel", transpose),
    "pre_fc_norm_embedding.weight": ("pre_fc_norm_embedding.weight", identity),
    "pre_fc_norm_hidden.weight": ("pre_fc_norm_hidden.weight", identity),
    "norm.weight": ("norm.weight", identity),
}
MTP_LAYER = ("mtp.layers.0.", "layer.")  # (checkpoint prefix, parameter prefix)


def load_mtp(path: str | os.PathLike, cfg: Qwen35Config, dtype=jnp.bfloat16):
    """The checkpoint's multi-token-prediction head (``mtp.*``, ``MTP_TABLE``) as a
    ``qwen35_jax.mtp.MTP``, or None when the checkpoint has no ``mtp.*`` tensors. FP8
    tensors of the head (with their ``weight_scale_inv``) are dequantised to ``dtype``:
    the head is one layer, read once a draft. Raises CheckpointError on a tensor of the
    head that has no place in it, a shape mismatch, or a missing one."""
    path = os.fspath(path)
    graphdef, abstract = nnx.split(nnx.eval_shape(lambda: MTP(cfg, rngs=nnx.Rngs(0),
                                                               dtype=dtype)))
    flat = {".".join(map(str, k)): v for k, v in nnx.to_flat_state(abstract)}
    values = {k: np.zeros(v.shape, np.float32) for k, v in flat.items()}
    written: dict[str, set] = {k: set() for k in flat}
    tensors, scales = {}, {}
    for shard in shard_files(path):
        with open_shard(shard) as f:
            for name in f.keys():
                if not name.startswith("mtp."):
                    continue
                dt = f.get_slice(name).get_dtype()
                refuse_other_formats(path, name, dt)
                value = read_tensor(f, shard, name, dt)
                if name.endswith(".weight" + SCALE_SUFFIX):
                    scales[name[:-len(SCALE_SUFFIX)]] = np.asarray(value, np.float32)
                else:  # e4m3 stays e4m3 until its scales dequantise it
                    tensors[name] = np.asarray(value, None if dt == "F8_E4M3" else np.float32)
    if not tensors:
        return None
    unscaled = [n for n, v in tensors.items() if v.dtype.itemsize == 1 and n not in scales]
    if unscaled:
        raise CheckpointError(f"{path}: FP8 tensors without their {SCALE_SUFFIX} block "
                              f"scales: {sorted(unscaled)[:4]}")
    prefix, param_prefix = MTP_LAYER
    for name, value in tensors.items():
        if name in scales:
            value = np.asarray(quant.dequantize(value, scales.pop(name), jnp.float32))
        sub = name[len("mtp."):]
        if sub in MTP_TABLE:
            ppath, fn = MTP_TABLE[sub]
            index, cols = (), None
        else:
            tgt = layer_target(cfg, name[len(prefix):]) if name.startswith(prefix) else None
            if tgt is None:
                raise CheckpointError(f"{path}: unexpected tensor {name!r} in the MTP head")
            ppath, index, fn, cols = param_prefix + tgt[0], tgt[1], tgt[2], tgt[3]
        if ppath not in values:
            raise CheckpointError(f"{path}: {name!r} has no parameter in this config's MTP "
                                  f"head ({ppath})")
        value = np.asarray(fn(jnp.asarray(value)), np.float32)
        target = values[ppath][index] if index else values[ppath]
        want = target[..., cols].shape if cols is not None else target.shape
        if value.shape != want:
            raise CheckpointError(f"{path}: tensor {name!r} has shape {value.shape} after "
                                  f"layout conversion, but the config implies {want}")
        if cols is not None:
            target[..., cols] = value
        else:
            target[...] = value
        written[ppath].add((index, None if cols is None else cols.start))
    if scales:
        raise CheckpointError(f"{path}: block scales without an FP8 tensor: {sorted(scales)[:4]}")
    missing = [k for k, got in written.items()
               if ((), None) not in got and len(got) < _mtp_parts(cfg, k)]
    if missing:
        raise CheckpointError(f"{path}: the MTP head lacks tensors for {missing[:6]}")
    state = nnx.from_flat_state({tuple(path_key(p) for p in k.split(".")):
                                 jnp.asarray(values[k], flat[k].dtype) for k in flat})
    return nnx.merge(graphdef, state)


def _mtp_parts(cfg: Qwen35Config, path: str) -> int:
    """Tensors that write the MTP parameter at ``path`` when none writes it whole: one
    per expert (two for the fused gate/up) for experts held one by one, else one."""
    if path.endswith("experts_gate_up"):
        return 2 * cfg.num_experts
    if path.endswith("experts_down"):
        return cfg.num_experts
    return 1
