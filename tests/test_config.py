"""Qwen35Config: presets, config.json nesting, and refusal of what it cannot represent."""

from __future__ import annotations

import dataclasses
import json

import pytest

from qwen35_jax import ConfigError, PRESETS, Qwen35Config, get_preset
from qwen35_jax.config import FULL, LINEAR

PUBLISHED = {  # name: (hidden, layers, H, KV, Hv, experts, topk, tied)
    "0.8B": (1024, 24, 8, 2, 16, 0, 0, True), "2B": (2048, 24, 8, 2, 16, 0, 0, True),
    "4B": (2560, 32, 16, 4, 32, 0, 0, True), "9B": (4096, 32, 16, 4, 32, 0, 0, False),
    "27B": (5120, 64, 24, 4, 48, 0, 0, False),
    "35B-A3B": (2048, 40, 16, 2, 32, 256, 8, False),
    "122B-A10B": (3072, 48, 32, 2, 64, 256, 8, False),
    "397B-A17B": (4096, 60, 32, 2, 64, 512, 10, False),
}


@pytest.mark.parametrize("name", list(PUBLISHED))
def test_published_presets(name):
    c = get_preset(f"Qwen3.5-{name}")
    hidden, layers, h, kv, hv, e, k, tied = PUBLISHED[name]
    assert (c.hidden_size, c.num_hidden_layers, c.num_attention_heads, c.num_key_value_heads,
            c.linear_num_value_heads, c.num_experts, c.num_experts_per_tok,
            c.tie_word_embeddings) == (hidden, layers, h, kv, hv, e, k, tied)
    assert c.vocab_size == 248320 and c.head_dim == 256 and c.rotary_dim == 64
    assert c.num_groups * 4 == layers and c.gdn_per_group == 3
    assert c.layer_types[3] == FULL and c.layer_types[0] == LINEAR


def test_unknown_preset_names_the_known_ones():
    with pytest.raises(KeyError, match="35B-A3B"):
        get_preset("70B")


def _official(text_overrides=None, **top):
    text = PRESETS["35B-A3B"].to_hf_text_dict()
    text.update(text_overrides or {})
    d = {"architectures": ["Qwen3_5MoeForConditionalGeneration"], "model_type": "qwen3_5_moe",
         "tie_word_embeddings": False, "text_config": text,
         "vision_config": {"model_type": "qwen3_5", "depth": 27}, "image_token_id": 248056}
    d.update(top)
    return d


def test_nested_multimodal_config_round_trips_the_preset():
    c = Qwen35Config.from_dict(_official())
    assert c.replace(name="35B-A3B") == PRESETS["35B-A3B"]


def test_interval_without_layer_types(tmp_path):
    text = PRESETS["9B"].to_hf_text_dict()
    del text["layer_types"]
    text["full_attention_interval"] = 4
    (tmp_path / "config.json").write_text(json.dumps(text))
    c = Qwen35Config.from_json(tmp_path)
    assert c.layer_types == PRESETS["9B"].layer_types


def test_top_level_tie_word_embeddings_wins_when_text_config_is_silent():
    text = PRESETS["2B"].to_hf_text_dict()
    del text["tie_word_embeddings"]
    d = {"model_type": "qwen3_5", "tie_word_embeddings": True, "text_config": text}
    assert Qwen35Config.from_dict(d).tie_word_embeddings


@pytest.mark.parametrize("mutate, match", [
    (lambda d: d.update(model_type="llama"), "not a Qwen3.5"),
    (lambda d: d["text_config"].update(full_attention_interval=2), "contradicts"),
    (lambda d: d["text_config"].update(tie_word_embeddings=True), "tie_word_embeddings"),
    (lambda d: d["text_config"].update(sliding_window=4096), "unknown config fields"),
    (lambda d: d.update(speculative=True), "unknown top-level"),
    (lambda d: d.update(quantization_config={"quant_method": "awq"}), "method 'awq'"),
    (lambda d: d.update(quantization_config={"quant_method": "fp8"}), "weight_block_size"),
    (lambda d: d["text_config"].update(layer_types=["full_attention"] * 40), "layer_types"),
    (lambda d: d["text_config"]["rope_parameters"].update(rope_type="yarn"), "rope_type"),
    (lambda d: d["text_config"].update(linear_num_value_heads=24), "multiple"),
    (lambda d: d["text_config"].update(intermediate_size=1024), "intermediate_size"),
    (lambda d: d["text_config"].update(norm_topk_prob=False), "renormalises"),
    (lambda d: d["text_config"].update(rope_theta=1e6), "rope_theta"),
    (lambda d: d["text_config"].pop("vocab_size"), "missing config field 'vocab_size'"),
    (lambda d: d["text_config"].pop("num_experts"), "missing config field 'num_experts'"),
    (lambda d: d["text_config"].update(full_attention_interval=0), "integer > 1"),
    (lambda d: d["text_config"].update(num_hidden_layers="40"), "positive integer"),
    (lambda d: d["text_config"].update(moe_intermediate_size=-64), "positive integers"),
    (lambda d: d["text_config"].update(shared_expert_intermediate_size=64.5),
     "positive integers"),
    (lambda d: d.update(text_config=None), "text_config must be an object"),
    (lambda d: d["text_config"].update(rms_norm_eps=0.0), "rms_norm_eps must be a number in"),
    (lambda d: d["text_config"].update(rms_norm_eps="1e-6"), "rms_norm_eps must be a number"),
    (lambda d: d["text_config"]["rope_parameters"].update(rope_theta=float("inf")),
     "rope_theta must be a finite number > 1"),
    (lambda d: d["text_config"]["rope_parameters"].update(partial_rotary_factor=True),
     "partial_rotary_factor must be a number"),
    (lambda d: d["text_config"].update(max_position_embeddings=0), "max_position_embeddings"),
    (lambda d: d["text_config"].update(eos_token_id=[-1]), "eos_token_id must be token ids"),
    (lambda d: d["text_config"].update(eos_token_id="</s>"), "eos_token_id must be token ids"),
])
def test_bad_configs_are_refused(mutate, match):
    d = _official()
    mutate(d)
    with pytest.raises(ConfigError, match=match):
        Qwen35Config.from_dict(d)


def test_missing_config_file(tmp_path):
    with pytest.raises(ConfigError, match="no config.json"):
        Qwen35Config.from_json(tmp_path)


def test_hf_overrides_keep_the_shapes_and_the_layer_pattern():
    """vLLM's --hf-overrides on a preset: 35B-A3B at 20 layers keeps every width, the
    every-fourth-layer attention pattern and the EOS ids; bad fields are refused as in a
    checkpoint's config, and a checkpoint's shapes cannot be overridden."""
    from serving.llm import model_config

    full = get_preset("35B-A3B")
    half = model_config("35B-A3B", {"num_hidden_layers": 20})
    assert half.num_hidden_layers == 20 and half.layer_types == full.layer_types[:20]
    assert dataclasses.replace(half, num_hidden_layers=40, layer_types=full.layer_types) == full
    assert model_config("tiny", {"num_hidden_layers": 4}).eos_token_ids == (1, 0)
    with pytest.raises(ConfigError, match="unknown config fields"):
        model_config("tiny", {"num_layers": 4})
    # flat HF fields replace the preset's own (nested rope_parameters, layer pattern)
    assert model_config("tiny", {"rope_theta": 5e6}).rope_theta == 5e6
    assert model_config("tiny", {"partial_rotary_factor": 0.5}).partial_rotary_factor == 0.5
    assert model_config("tiny", {"full_attention_interval": 2}).full_attention_interval == 2
    with pytest.raises(ValueError, match="presets"):
        model_config("tiny-math", {"num_hidden_layers": 4})
