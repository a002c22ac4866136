"""FP8 weights (qwen35_jax/quant.py): the block-scale rule, FP8 checkpoints in the layout
of Qwen's -FP8 releases, and quantisation on load.

The test writes its own FP8 checkpoints from random transformers models with PyTorch's
float8 conversion, block by block (``_quantize_torch``): e4m3 weights of every layer
matmul but the gates, each with a float32 ``weight_scale_inv`` per 128 x 128 block, and
a ``quantization_config`` as the releases carry. Dimensions of 160 and 288 give whole and
partial blocks.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import re
from unittest import mock

import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
import torch
from flax import nnx
from safetensors.torch import load_file, save_file

from checkpoints import save_hf
from hf_reference import hf_model
from pallas_kernels import block_fp8
from qwen35_jax import ConfigError, get_preset, quant
from qwen35_jax.loader import CheckpointError, checkpoint_config, from_pretrained
from test_model import float32_budget, forward, rel_err

QC = {"quant_method": "fp8", "weight_block_size": [128, 128], "activation_scheme": "dynamic",
      "fmt": "e4m3", "modules_to_not_convert": ["lm_head", "mlp.gate", "shared_expert_gate",
                                                 "in_proj_a", "in_proj_b"]}
# the tensors the releases hold in FP8: every layer matmul but the gates
QUANTISED = re.compile(r".*layers\.\d+\.(?!.*(norm|conv1d|in_proj_a|in_proj_b|mlp\.gate\.|"
                       r"shared_expert_gate)).*\.weight")
CONFIGS = {
    "dense": get_preset("tiny").replace(hidden_size=160, intermediate_size=288),
    "moe": get_preset("tiny-moe").replace(hidden_size=160, moe_intermediate_size=160,
                                          shared_expert_intermediate_size=136),
}


def _quantize_torch(w):
    """[out, in] float32 -> (e4m3 [out, in], scale [out/128, in/128]), block by block."""
    o, i = w.shape
    scale = torch.ones(math.ceil(o / 128), math.ceil(i / 128))
    q = torch.empty(o, i, dtype=torch.float8_e4m3fn)
    for a in range(scale.shape[0]):
        for b in range(scale.shape[1]):
            blk = w[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128]
            m = blk.abs().max()
            if m > 0:
                scale[a, b] = m / 448.0
            q[a * 128:(a + 1) * 128, b * 128:(b + 1) * 128] = (blk / scale[a, b]).to(
                torch.float8_e4m3fn)
    return q, scale


def _dequantize_np(q, scale):
    """q * its block's scale, in float32 (IEEE's product, rounded once)."""
    s = np.repeat(np.repeat(scale.numpy().astype(np.float32), 128, 0), 128, 1)
    return q.float().numpy() * s[:q.shape[0], :q.shape[1]]


def _quantize_in(tensors: dict, names) -> dict:
    """Each of ``names`` in ``tensors`` to e4m3 with its ``_scale_inv`` beside it, in
    place; returns {name: dequantised float32}."""
    exact = {}
    for name in names:
        q, s = _quantize_torch(tensors[name].float())
        tensors[name], tensors[name + "_scale_inv"] = q, s
        exact[name] = _dequantize_np(q, s)
    return exact


def _to_fp8(src, dst):
    """The checkpoint at ``src`` (save_hf's) in FP8; returns {name: dequantised float64}."""
    os.makedirs(dst, exist_ok=True)
    exact = {}
    for f in os.listdir(src):
        if not f.endswith(".safetensors"):
            continue
        tensors = load_file(os.path.join(src, f))
        exact |= _quantize_in(tensors, [n for n in tensors if QUANTISED.fullmatch(n)])
        save_file(tensors, os.path.join(dst, f), metadata={"format": "pt"})
    index = os.path.join(src, "model.safetensors.index.json")
    if os.path.exists(index):
        d = json.load(open(index))
        for name in exact:
            d["weight_map"][name + "_scale_inv"] = d["weight_map"][name]
        json.dump(d, open(os.path.join(dst, "model.safetensors.index.json"), "w"))
    d = json.load(open(os.path.join(src, "config.json")))
    d["quantization_config"] = QC
    json.dump(d, open(os.path.join(dst, "config.json"), "w"))
    return exact


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    """kind -> (cfg, hf model, bf16 path, fp8 path, exact dequantised weights)."""
    out = {}

    def get(kind):
        if kind not in out:
            cfg = CONFIGS[kind]
            hf = hf_model(cfg, seed=3)
            bf16 = save_hf(hf, str(tmp_path_factory.mktemp(kind + "-bf16")), shard_size="2MB")
            fp8 = str(tmp_path_factory.mktemp(kind + "-fp8"))
            out[kind] = (cfg, hf, bf16, fp8, _to_fp8(bf16, fp8))
        return out[kind]

    return get


def _params(model):
    return {".".join(map(str, k)): np.asarray(v[...])
            for k, v in nnx.to_flat_state(nnx.state(model))}


@pytest.mark.parametrize("shape,splits", [((300, 200), 1), ((2, 3, 160, 288), 1),
                                          ((4, 64, 2 * 160), 2), ((130, 7), 1)])
def test_block_rule_matches_numpy(shape, splits):
    """q and the scales bit for bit those of the rule computed in NumPy block by block
    (ml_dtypes' e4m3 rounding), and dequantise exactly to q * scale."""
    rng = np.random.default_rng(0)
    w = (rng.standard_normal(shape) * rng.uniform(0.01, 3, shape)).astype(np.float32)
    w[..., :128, :min(shape[-1], 128)] = 0.0  # an all-zero block: scale 1
    q, scale = block_fp8.quantize(w, splits)
    assert q.dtype == jnp.float8_e4m3fn and scale.shape == block_fp8.scale_shape(shape, splits)
    q_dev, scale_dev = block_fp8.quantize(jnp.asarray(w), splits)  # XLA's division: an ulp
    np.testing.assert_allclose(np.asarray(scale_dev), scale, rtol=2 ** -23, atol=0)
    assert np.mean(np.asarray(q_dev).view(np.uint8) == q.view(np.uint8)) > 0.999
    part = shape[-1] // splits
    nb = math.ceil(part / 128)
    want_q = np.zeros(shape, ml_dtypes.float8_e4m3fn)
    for idx in np.ndindex(*shape[:-2]):
        for j in range(splits):
            for a in range(math.ceil(shape[-2] / 128)):
                for b in range(nb):
                    rows = slice(a * 128, (a + 1) * 128)
                    cols = slice(j * part + b * 128, j * part + min((b + 1) * 128, part))
                    blk = w[idx][rows, cols]
                    m = np.float32(np.abs(blk).max())
                    s = np.float32(m / np.float32(448.0)) if m > 0 else np.float32(1.0)
                    assert np.asarray(scale)[idx][a, j * nb + b] == s
                    want_q[idx][rows, cols] = (blk / s).astype(ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want_q.view(np.uint8))
    back = np.asarray(block_fp8.dequantize(jnp.asarray(q), jnp.asarray(scale), jnp.float32, splits))
    s_full = block_fp8._expand(scale, shape[-2], shape[-1], splits)
    np.testing.assert_array_equal(back, want_q.astype(np.float32) * s_full)
    assert np.abs(back - w).max() <= np.abs(w).max() / 16  # e4m3 keeps 3 mantissa bits


@contextlib.contextmanager
def _w8a8_experts():
    """transformers' MoE experts with each matmul's input quantised as the -FP8
    checkpoints' inference code quantises it: per token, in 128-entry groups, each
    scaled to its largest magnitude / 448 and rounded to e4m3 (PyTorch's rounding)."""
    from transformers.models.qwen3_5_moe import modeling_qwen3_5_moe as m

    forward_, linear = m.Qwen3_5MoeExperts.forward, torch.nn.functional.linear

    def quantised_linear(x, w, b=None):
        k = x.shape[-1]
        g = torch.nn.functional.pad(x.float(), (0, -k % 128)).reshape(*x.shape[:-1], -1, 128)
        s = g.abs().amax(-1, keepdim=True) / 448.0
        s = torch.where(s > 0, s, torch.ones_like(s))
        q = ((g / s).to(torch.float8_e4m3fn).float() * s).reshape(*x.shape[:-1], -1)
        return linear(q[..., :k].to(x.dtype), w, b)

    def experts_forward(self, *a, **kw):
        with mock.patch.object(torch.nn.functional, "linear", quantised_linear):
            return forward_(self, *a, **kw)

    with mock.patch.object(m.Qwen3_5MoeExperts, "forward", experts_forward):
        yield


def _set_dequantised(hf, exact):
    """Give the transformers model the dequantised weights (its experts are fused
    [E, 2I, D] gate | up and [E, D, I] parameters, the checkpoint's per expert)."""
    params = dict(hf.named_parameters())
    with torch.no_grad():
        for name, w in exact.items():
            e = re.fullmatch(r"(.+\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight", name)
            if e is None:
                params[name].copy_(torch.from_numpy(w))
                continue
            base, ex, which = e.group(1), int(e.group(2)), e.group(3)
            if which == "down_proj":
                params[base + ".down_proj"][ex].copy_(torch.from_numpy(w))
            else:
                rows = w.shape[0]
                at = 0 if which == "gate_proj" else rows
                params[base + ".gate_up_proj"][ex, at:at + rows].copy_(torch.from_numpy(w))


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_fp8_checkpoint_loads_its_weights_exactly(checkpoints, kind):
    """Every quantised tensor dequantises to the checkpoint's q * scale exactly (the
    expert tensors per expert, gate and up in the fused parameter); the rest is as in
    the bf16 checkpoint; logits match transformers on the dequantised weights, its
    experts' inputs quantised as FP8 inference does (W8A8)."""
    cfg, hf, _, fp8, exact = checkpoints(kind)
    loaded_cfg = checkpoint_config(fp8)
    assert set(loaded_cfg.fp8_modules) == set(quant.applicable(quant.DEFAULT, cfg.is_moe))
    assert "mlp.experts_gate_up" in loaded_cfg.fp8_modules or not cfg.is_moe
    model = from_pretrained(fp8, dtype=jnp.float32, progress=False)
    layer = model.groups.gdn
    for name, want in exact.items():
        m = re.fullmatch(r"model\.layers\.(\d+)\.(.+)\.weight", name)
        i, sub = int(m.group(1)), m.group(2)
        g, pos = divmod(i, cfg.full_attention_interval)
        attn = pos == cfg.full_attention_interval - 1
        base, lead = (model.groups.attn, (g,)) if attn else (model.groups.gdn, (g, pos))
        e = re.fullmatch(r"mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)", sub)
        if e:
            ex, which = int(e.group(1)), e.group(2)
            moe = base.mlp
            if which == "down_proj":  # experts are held K-major
                got = block_fp8.dequantize_k_major(moe.experts_down[...][lead + (ex,)],
                                                   moe.experts_down_scale[...][lead + (ex,)],
                                                   jnp.float32)
            else:
                full = block_fp8.dequantize_k_major(moe.experts_gate_up[...][lead + (ex,)],
                                                    moe.experts_gate_up_scale[...][lead + (ex,)],
                                                    jnp.float32, splits=2)
                inter = cfg.moe_intermediate_size
                got = full[:, :inter] if which == "gate_proj" else full[:, inter:]
        else:
            lin = base
            for part in sub.split("."):
                lin = getattr(lin, "router" if part == "gate" else part)
            got = block_fp8.dequantize(lin.kernel[...][lead], lin.scale[...][lead], jnp.float32)
        np.testing.assert_array_equal(np.asarray(got).T, want, err_msg=name)
    assert not block_fp8.is_fp8(layer.linear_attn.in_proj_a.kernel[...])
    _set_dequantised(hf, exact)
    ids = np.random.default_rng(1).integers(0, cfg.vocab_size, (2, 150))
    with _w8a8_experts() if cfg.is_moe else contextlib.nullcontext():  # experts are W8A8
        ref64, budget = float32_budget(hf, ids)
    assert rel_err(forward(model, jnp.asarray(ids)), ref64) <= budget


@pytest.mark.parametrize("kind", ["dense", "moe"])
def test_quantization_on_load_is_the_fp8_checkpoint(checkpoints, kind):
    """A bf16 checkpoint loaded with fp8_modules (``--quantization fp8``) holds the same
    e4m3 values and scales, bit for bit, as the FP8 checkpoint made from it."""
    cfg, _, bf16, fp8, _ = checkpoints(kind)
    want = _params(from_pretrained(fp8, dtype=jnp.float32, progress=False))
    got = _params(from_pretrained(bf16, dtype=jnp.float32, progress=False,
                                  config=checkpoint_config(fp8)))
    assert got.keys() == want.keys()
    n_fp8 = 0
    for k in want:
        assert got[k].dtype == want[k].dtype, k
        n_fp8 += want[k].dtype == ml_dtypes.float8_e4m3fn
        np.testing.assert_array_equal(got[k].view(np.uint8) if got[k].dtype.itemsize == 1
                                      else got[k], want[k].view(np.uint8)
                                      if want[k].dtype.itemsize == 1 else want[k], err_msg=k)
    n_scales = sum(k.endswith("scale") for k in want)  # a path can be in both layer kinds
    assert n_fp8 == n_scales >= len(checkpoint_config(fp8).fp8_modules)


def _fp8_with_a_bf16_tensor(checkpoints, path, name: str, keep_scale: bool) -> str:
    """A copy at ``path`` of the dense FP8 checkpoint whose tensor ``name`` is the bf16
    checkpoint's, its weight_scale_inv kept beside it or dropped."""
    import shutil
    _, _, bf16, fp8, _ = checkpoints("dense")
    shutil.copytree(fp8, path)
    index_path = os.path.join(path, "model.safetensors.index.json")
    index = json.load(open(index_path))
    shard = os.path.join(path, index["weight_map"][name])
    t = load_file(shard)
    t[name] = load_file(os.path.join(bf16, index["weight_map"][name]))[name]
    if not keep_scale:
        del t[name + "_scale_inv"], index["weight_map"][name + "_scale_inv"]
        json.dump(index, open(index_path, "w"))
    save_file(t, shard, metadata={"format": "pt"})
    return path


def test_a_layer_left_in_bf16_is_quantised_on_load(checkpoints, tmp_path):
    """A tensor the checkpoint kept in bf16 where the other layers are FP8 (a per-layer
    modules_to_not_convert) loads quantised by the same rule."""
    fp8 = checkpoints("dense")[3]
    path = _fp8_with_a_bf16_tensor(checkpoints, str(tmp_path / "mixed"),
                                   "model.layers.1.mlp.down_proj.weight", keep_scale=False)
    a = _params(from_pretrained(path, dtype=jnp.float32, progress=False))
    b = _params(from_pretrained(fp8, dtype=jnp.float32, progress=False))
    for k in ("groups.gdn.mlp.down_proj.kernel", "groups.gdn.mlp.down_proj.scale"):
        np.testing.assert_array_equal(a[k].view(np.uint8) if a[k].dtype.itemsize == 1 else a[k],
                                      b[k].view(np.uint8) if b[k].dtype.itemsize == 1 else b[k])


def test_fp8_tensor_without_its_scale_is_named(checkpoints, tmp_path):
    import shutil
    _, _, _, fp8, _ = checkpoints("dense")
    path = str(tmp_path / "noscale")
    shutil.copytree(fp8, path)
    name = "model.layers.2.linear_attn.out_proj.weight_scale_inv"
    index = json.load(open(os.path.join(path, "model.safetensors.index.json")))
    shard = os.path.join(path, index["weight_map"].pop(name))
    t = load_file(shard)
    del t[name]
    save_file(t, shard, metadata={"format": "pt"})
    json.dump(index, open(os.path.join(path, "model.safetensors.index.json"), "w"))
    with pytest.raises(CheckpointError, match="out_proj.weight' is FP8 e4m3 without its "
                                              "weight_scale_inv"):
        from_pretrained(path, dtype=jnp.float32, progress=False)


def test_a_scale_beside_a_wider_weight_is_refused(checkpoints, tmp_path):
    """A bf16 weight that kept its weight_scale_inv (an FP8 checkpoint half converted
    back): the scale would rescale the weight's own values, so it is refused rather than
    loaded wrong."""
    path = _fp8_with_a_bf16_tensor(checkpoints, str(tmp_path / "stale"),
                                   "model.layers.3.self_attn.o_proj.weight", keep_scale=True)
    with pytest.raises(CheckpointError, match="o_proj.weight' is not FP8 e4m3 but has a "
                                              "weight_scale_inv"):
        from_pretrained(path, dtype=jnp.float32, progress=False)


@pytest.mark.parametrize("change,match", [
    (dict(quant_method="gptq"), "method 'gptq' are not supported"),
    (dict(weight_block_size=[64, 64]), r"weight_block_size \[64, 64\] is not supported"),
    (dict(fmt="e5m2"), "format 'e5m2' is not supported"),
])
def test_other_quantisation_configs_are_refused(change, match):
    from qwen35_jax import Qwen35Config
    d = {**CONFIGS["dense"].to_hf_text_dict(), "quantization_config": {**QC, **change}}
    with pytest.raises(ConfigError, match=match):
        Qwen35Config.from_dict(d)


def test_an_fp8_mtp_head_loads_as_its_dequantised_weights(tmp_path):
    """An MTP head whose matmuls are e4m3 with block scales (as in the -FP8 releases)
    loads as the same head written with those weights dequantised (q * scale in float32),
    every value exact; the quantisation changed some of them."""
    from qwen35_jax import init_random
    from qwen35_jax.export import save_pretrained
    from qwen35_jax.mtp import MTP
    from qwen35_jax.mtp_checkpoint import load_mtp

    cfg = CONFIGS["dense"]
    src = str(tmp_path / "export")
    save_pretrained(init_random(cfg, dtype=jnp.float32), src, mtp=MTP(cfg, rngs=nnx.Rngs(2)),
                    dtype=jnp.float32)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    head = [n for n in tensors if n.startswith("mtp.") and QUANTISED.fullmatch(
        n.replace("mtp.layers.0.", "model.layers.0."))] + ["mtp.fc.weight"]
    assert any("self_attn" in n for n in head) and any("mlp" in n for n in head), head
    fp8 = dict(tensors)
    dequantised = {**tensors, **{n: torch.from_numpy(v)
                                 for n, v in _quantize_in(fp8, head).items()}}
    heads = {}
    for kind, ts in (("fp8", fp8), ("dequantised", dequantised), ("f32", tensors)):
        path = tmp_path / kind
        os.makedirs(path)
        save_file(ts, str(path / "model.safetensors"), metadata={"format": "pt"})
        heads[kind] = _params(load_mtp(str(path), cfg, jnp.float32))
    assert heads["fp8"].keys() == heads["dequantised"].keys()
    for k, want in heads["dequantised"].items():
        np.testing.assert_array_equal(heads["fp8"][k], want, err_msg=k)
    assert any(not np.array_equal(heads["f32"][k], v) for k, v in heads["fp8"].items())
    # an e4m3 tensor without its scales, or one in another format, is refused by name
    unscaled = {k: v for k, v in fp8.items() if k != "mtp.fc.weight_scale_inv"}
    int8 = {**tensors, "mtp.fc.weight": tensors["mtp.fc.weight"].to(torch.int8)}
    for kind, ts, match in (("unscaled", unscaled, "without their _scale_inv.*mtp.fc.weight"),
                            ("int8", int8, r"'mtp.fc.weight' is quantised \(I8\)")):
        path = tmp_path / kind
        os.makedirs(path)
        save_file(ts, str(path / "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(CheckpointError, match=match):
            load_mtp(str(path), cfg, jnp.float32)
