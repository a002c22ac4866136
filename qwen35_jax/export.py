"""Writing a model (and its MTP head) as a Hugging Face checkpoint in the official layout.

The names come from the loader's tables run backwards, so what this writes is what
``from_pretrained`` reads, and the layout is that of the published Qwen3.5 releases:
``model.language_model.*`` names, fused 3-D experts in the main layers, per-expert 2-D
experts in the MTP layer, ``mtp.*`` for the head, a nested multimodal ``config.json``.
"""

from __future__ import annotations

import itertools
import json
import os
import re

import jax.numpy as jnp
import numpy as np
from flax import nnx

from qwen35_jax import loader, mtp_checkpoint
from qwen35_jax.config import Qwen35Config

_ALTERNATIVES = re.compile(r"\(([^()]*)\)")


def _names(pattern: str) -> list[str]:
    """The names a LAYER_TABLE pattern matches (its alternations expanded)."""
    parts = _ALTERNATIVES.split(pattern)
    literal = [p.replace("\\.", ".") for p in parts[0::2]]
    choices = [p.split("|") for p in parts[1::2]]
    return ["".join(x for pair in itertools.zip_longest(literal, combo, fillvalue="")
                    for x in pair) for combo in itertools.product(*choices)]


def _layer_names(cfg: Qwen35Config, per_expert: bool) -> list[str]:
    names = [n for pattern, _, _ in loader.LAYER_TABLE for n in _names(pattern)]
    if per_expert and cfg.is_moe:
        names = [n for n in names if not n.startswith("mlp.experts.")]
        names += [f"mlp.experts.{e}.{w}.weight" for e in range(cfg.num_experts)
                  for w in ("gate_proj", "up_proj", "down_proj")]
    return names


def _flat(module) -> dict[str, np.ndarray]:
    return {".".join(map(str, k)): v for k, v in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def _export(leaf, index, fn, cols):
    x = leaf[index] if index else leaf
    if cols is not None:
        x = x[..., cols]
    return loader.INVERSE[fn](x)


def checkpoint_tensors(model, mtp=None, dtype=jnp.bfloat16) -> dict[str, jnp.ndarray]:
    """Checkpoint name -> tensor (PyTorch layout, ``dtype``) of ``model`` and ``mtp``.
    Raises ValueError if a parameter has no checkpoint name (a gap in the tables)."""
    cfg = model.config
    flat, used, out = _flat(model), set(), {}
    names = ["lm_head.weight"] + ["model.language_model." + n for n in loader.TOP_TABLE]
    names += [f"model.language_model.layers.{i}.{sub}" for i in range(cfg.num_hidden_layers)
              for sub in _layer_names(cfg, per_expert=False)]
    for name in names:
        tgt = loader.checkpoint_target(cfg, name)
        if tgt not in (None, "skip") and tgt[0] in flat:
            out[name] = _export(flat[tgt[0]], *tgt[1:])
            used.add(tgt[0])
    unnamed = set(flat) - used
    if mtp is not None:
        head = _flat(mtp)
        for sub, (path, fn) in mtp_checkpoint.MTP_TABLE.items():
            out["mtp." + sub] = _export(head[path], (), fn, None)
            used.add("mtp:" + path)
        ckpt_prefix, param_prefix = mtp_checkpoint.MTP_LAYER
        for sub in _layer_names(cfg, per_expert=True):
            tgt = loader.layer_target(cfg, sub)
            if tgt is not None and param_prefix + tgt[0] in head:
                out[ckpt_prefix + sub] = _export(head[param_prefix + tgt[0]], *tgt[1:])
                used.add("mtp:" + param_prefix + tgt[0])
        unnamed |= {"mtp:" + k for k in head} - used
    if unnamed:
        raise ValueError(f"parameters without a checkpoint name: {sorted(unnamed)}")
    return {k: jnp.asarray(v, dtype) for k, v in out.items()}


def hf_config(cfg: Qwen35Config, *, mtp: bool, dtype: str = "bfloat16") -> dict:
    """``config.json`` of the official (multimodal-class) layout, text config nested."""
    text = cfg.to_hf_text_dict()
    tied = text.pop("tie_word_embeddings")
    text.update(dtype=dtype, eos_token_id=list(cfg.eos_token_ids),
                mtp_num_hidden_layers=1 if mtp else 0, mtp_use_dedicated_embeddings=False,
                attn_output_gate=True, full_attention_interval=cfg.full_attention_interval,
                hidden_act="silu")
    moe = cfg.is_moe
    return {"architectures": ["Qwen3_5MoeForConditionalGeneration" if moe
                              else "Qwen3_5ForConditionalGeneration"],
            "model_type": "qwen3_5_moe" if moe else "qwen3_5",
            "text_config": text, "tie_word_embeddings": tied}


def save_pretrained(model, path: str | os.PathLike, *, mtp=None, dtype=jnp.bfloat16,
                    generation_config: dict | None = None) -> str:
    """Write ``model.safetensors``, ``config.json`` and ``generation_config.json``."""
    from safetensors.flax import save_file

    path = os.fspath(path)
    os.makedirs(path, exist_ok=True)
    tensors = checkpoint_tensors(model, mtp, dtype)
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(hf_config(model.config, mtp=mtp is not None,
                            dtype=jnp.dtype(dtype).name), f, indent=2)
        f.write("\n")
    gen = {"eos_token_id": list(model.config.eos_token_ids), **(generation_config or {})}
    with open(os.path.join(path, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    return path
