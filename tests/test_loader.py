"""Bad checkpoints raise the documented errors; converted parameters round-trip through orbax."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file

from checkpoints import save_hf, save_official
from hf_reference import hf_model
from qwen35_jax import (CheckpointError, ConfigError, from_pretrained, get_preset,
                        restore_params, save_params)


@pytest.fixture(scope="module")
def good(tmp_path_factory):
    cfg = get_preset("tiny-moe")
    path = str(tmp_path_factory.mktemp("good"))
    save_official(hf_model(cfg, seed=7), path)
    return cfg, path


def copy(good, tmp_path):
    dst = str(tmp_path / "ckpt")
    shutil.copytree(good[1], dst)
    return dst


def shard_of(path, name):
    with open(os.path.join(path, "model.safetensors.index.json")) as f:
        return os.path.join(path, json.load(f)["weight_map"][name])


def rewrite(path, name, fn):
    shard = shard_of(path, name)
    tensors = load_file(shard)
    fn(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_missing_shard(good, tmp_path):
    path = copy(good, tmp_path)
    os.remove(os.path.join(path, "model-00002-of-00003.safetensors"))
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors"):
        from_pretrained(path, progress=False)


def test_missing_tensor_is_named(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.5.linear_attn.A_log"
    rewrite(path, name, lambda t: t.pop(name))
    with pytest.raises(CheckpointError, match=r"groups\.gdn\.linear_attn\.A_log.*\(1, 1\)"):
        from_pretrained(path, progress=False)


def test_wrong_shape(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.3.self_attn.k_proj.weight"
    rewrite(path, name, lambda t: t.update({name: torch.zeros(7, 64)}))
    with pytest.raises(CheckpointError, match=r"k_proj.weight.*\(64, 7\).*\(64, 64\)"):
        from_pretrained(path, progress=False)


def test_unexpected_tensor(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.0.input_layernorm.weight"
    rewrite(path, name, lambda t: t.update({"model.language_model.layers.0.foo.bias": torch.zeros(3)}))
    with pytest.raises(CheckpointError, match="unexpected tensor.*foo.bias"):
        from_pretrained(path, progress=False)


def test_an_expert_past_num_experts_is_unexpected(good, tmp_path):
    """Per-expert tensors (transformers' own layout) of an expert the config does not have
    are refused: written, they would land on the last expert (a clamped write) and leave
    the one they replaced zero."""
    cfg, _ = good
    path = save_hf(hf_model(cfg, seed=7), str(tmp_path / "per-expert"), shard_size="100MB")
    [shard] = [os.path.join(path, f) for f in os.listdir(path) if f.endswith(".safetensors")]
    tensors = load_file(shard)
    old = "model.layers.0.mlp.experts.1."
    for name in [n for n in tensors if n.startswith(old)]:
        tensors[name.replace(old, f"model.layers.0.mlp.experts.{cfg.num_experts}.")] = tensors.pop(name)
    save_file(tensors, shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=f"unexpected tensor.*experts.{cfg.num_experts}"):
        from_pretrained(path, progress=False)


def test_a_tensor_of_a_rank_the_layout_cannot_take_is_named(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.0.linear_attn.conv1d.weight"
    rewrite(path, name, lambda t: t.update({name: torch.cat([t[name], t[name]], 1)}))
    with pytest.raises(CheckpointError, match=r"conv1d.weight' has shape \(\d+, 2, 4\)"):
        from_pretrained(path, progress=False)


def test_an_unreadable_shard_or_index_is_named(good, tmp_path):
    """A truncated shard, and an index without its weight_map: each a CheckpointError
    naming the file, not safetensors' or json's own error."""
    path = copy(good, tmp_path)
    shard = os.path.join(path, "model-00002-of-00003.safetensors")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    with pytest.raises(CheckpointError, match="model-00002-of-00003.safetensors: not a readable"):
        from_pretrained(path, progress=False)
    index = os.path.join(path, "model.safetensors.index.json")
    with open(index, "w") as f:
        json.dump({"metadata": {}}, f)
    with pytest.raises(CheckpointError, match="index.json: not a safetensors index"):
        from_pretrained(path, progress=False)


def test_wrong_model_type(good, tmp_path):
    path = copy(good, tmp_path)
    cfg_path = os.path.join(path, "config.json")
    d = json.load(open(cfg_path))
    d["model_type"] = "qwen3_next"
    json.dump(d, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="qwen3_next"):
        from_pretrained(path, progress=False)


def test_fp8_weights_without_an_fp8_config_are_refused_plainly(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.0.linear_attn.out_proj.weight"
    rewrite(path, name, lambda t: t.update({name: t[name].to(torch.float8_e4m3fn)}))
    with pytest.raises(CheckpointError, match="out_proj.weight' is FP8 but .* not one of "
                                              "this config's fp8_modules"):
        from_pretrained(path, progress=False)


def test_other_quantised_formats_are_refused(good, tmp_path):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.0.linear_attn.out_proj.weight"
    rewrite(path, name, lambda t: t.update({name: t[name].to(torch.float8_e5m2)}))
    with pytest.raises(CheckpointError, match="quantised \\(F8_E5M2\\) in a format"):
        from_pretrained(path, progress=False)


@pytest.mark.parametrize("dtype", [torch.int32, torch.bool])
def test_an_integer_or_boolean_tensor_is_refused_not_cast(good, tmp_path, dtype):
    path = copy(good, tmp_path)
    name = "model.language_model.layers.0.input_layernorm.weight"
    rewrite(path, name, lambda t: t.update({name: t[name].to(dtype)}))
    with pytest.raises(CheckpointError, match="input_layernorm.weight.*not a floating-point"):
        from_pretrained(path, progress=False)


def test_quantization_config_of_another_method_is_refused(good, tmp_path):
    path = copy(good, tmp_path)
    cfg_path = os.path.join(path, "config.json")
    d = json.load(open(cfg_path))
    d["quantization_config"] = {"quant_method": "gptq", "bits": 4}
    json.dump(d, open(cfg_path, "w"))
    with pytest.raises(ConfigError, match="method 'gptq' are not supported"):
        from_pretrained(path, progress=False)


def test_pytorch_bin_only(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(get_preset("tiny").to_hf_text_dict()))
    (tmp_path / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(CheckpointError, match="non-safetensors"):
        from_pretrained(tmp_path, progress=False)


def test_orbax_round_trip(good, tmp_path):
    cfg, path = good
    model = from_pretrained(path, dtype=jnp.float32, progress=False)
    save_params(model, tmp_path / "orbax")
    back = restore_params(tmp_path / "orbax", cfg, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (1, 20)))
    np.testing.assert_array_equal(np.asarray(back(ids)), np.asarray(model(ids)))
    a = jax.tree.leaves(back.groups.gdn.mlp.experts_gate_up)[0]
    assert a.shape == (2, 3, 8, 64, 64)


def test_init_random_makes_every_parameter_on_device():
    from flax import nnx

    from qwen35_jax import init_random

    cfg = get_preset("tiny-moe")
    model = init_random(cfg, seed=3, dtype=jnp.bfloat16)
    leaves = jax.tree.leaves(nnx.state(model, nnx.Param))
    assert all(isinstance(x, jax.Array) for x in leaves)
    assert model.groups.attn.self_attn.q_proj.kernel[...].dtype == jnp.bfloat16
    assert model.groups.gdn.linear_attn.A_log[...].dtype == jnp.float32  # decay stays float32
    logits = model(jnp.arange(12, dtype=jnp.int32)[None])
    assert logits.shape == (1, 12, cfg.vocab_size) and bool(jnp.isfinite(logits).all())
    other = init_random(cfg, seed=4, dtype=jnp.bfloat16)
    assert not np.array_equal(np.asarray(other.lm_head.kernel[...]),
                              np.asarray(model.lm_head.kernel[...]))
