"""Writing test checkpoints in the layouts real Qwen3.5 releases use."""

from __future__ import annotations

import json
import os

import torch
from safetensors.torch import save_file


def save_hf(model, path, shard_size="200KB"):
    """transformers' own ``save_pretrained`` (text-only names, per-expert MoE tensors)."""
    model.save_pretrained(path, max_shard_size=shard_size)
    return path


def save_official(model, path, *, n_shards=3, extras=True):
    """The layout of the published VLM checkpoints: ``model.language_model.*`` names, fused 3-D
    expert tensors without ``.weight``, a nested ``text_config``, ``tie_word_embeddings`` at
    the top, ``mtp.*`` and ``model.visual.*`` tensors that the loader must ignore."""
    os.makedirs(path, exist_ok=True)
    cfg = model.config
    sd = {k: v.detach().clone().contiguous() for k, v in model.state_dict().items()}
    out = {}
    experts: dict[tuple[int, str], dict[int, torch.Tensor]] = {}
    for k, v in sd.items():
        if k == "lm_head.weight":
            if not cfg.tie_word_embeddings:
                out[k] = v
            continue
        parts = k.split(".")
        if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
            i = parts.index("experts")
            layer, e, which = int(parts[2]), int(parts[i + 1]), parts[i + 2]
            experts.setdefault((layer, which), {})[e] = v
            continue
        out["model.language_model." + k.removeprefix("model.")] = v
    layers = sorted({layer for layer, _ in experts})
    for layer in layers:
        n = len(experts[(layer, "gate_proj")])
        gate = torch.stack([experts[(layer, "gate_proj")][e] for e in range(n)])
        up = torch.stack([experts[(layer, "up_proj")][e] for e in range(n)])
        down = torch.stack([experts[(layer, "down_proj")][e] for e in range(n)])
        base = f"model.language_model.layers.{layer}.mlp.experts."
        out[base + "gate_up_proj"] = torch.cat([gate, up], dim=1).contiguous()
        out[base + "down_proj"] = down.contiguous()
    if extras:
        out["mtp.fc.weight"] = torch.zeros(4, 8)
        out["mtp.layers.0.mlp.experts.0.gate_proj.weight"] = torch.zeros(2, 2)
        out["model.visual.blocks.0.attn.qkv.weight"] = torch.zeros(3, 3)
    names = sorted(out)
    weight_map = {}
    for s in range(n_shards):
        shard = f"model-{s + 1:05d}-of-{n_shards:05d}.safetensors"
        chunk = {n: out[n] for n in names[s::n_shards]}
        save_file(chunk, os.path.join(path, shard), metadata={"format": "pt"})
        weight_map.update({n: shard for n in chunk})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    text = cfg.to_dict()
    moe = "moe" in text["model_type"]
    top = {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                             else "Qwen3_5ForConditionalGeneration"],
           "model_type": "qwen3_5_moe" if moe else "qwen3_5",
           "tie_word_embeddings": cfg.tie_word_embeddings,
           "image_token_id": 248056, "video_token_id": 248057,
           "vision_start_token_id": 248053, "vision_end_token_id": 248054,
           "text_config": {**text, "full_attention_interval": 4, "attn_output_gate": True,
                           "mamba_ssm_dtype": "float32", "mtp_num_hidden_layers": 1,
                           "mtp_use_dedicated_embeddings": False},
           "vision_config": {"model_type": "qwen3_5", "depth": 2, "hidden_size": 16}}
    top["text_config"]["rope_parameters"] = {**text["rope_parameters"], "mrope_section": [1, 1, 2],
                                             "mrope_interleaved": True}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(top, f)
    return path
