"""Tiny random transformers Qwen3.5 models: the independent reference for the model tests.

Every parameter is randomised, including the ones HF initialises to constants
(norm weights, ``A_log``, ``dt_bias``), so that a ``w`` vs ``1+w`` or a head
mapping mistake shows up as an O(1) logit error instead of hiding.
"""

from __future__ import annotations

import torch
from transformers import (Qwen3_5ForCausalLM, Qwen3_5MoeForCausalLM, Qwen3_5MoeTextConfig,
                          Qwen3_5TextConfig)

from qwen35_jax.config import Qwen35Config


def hf_model(cfg: Qwen35Config, seed: int = 0):
    d = cfg.to_hf_text_dict()
    d.pop("model_type")
    cls_cfg, cls = ((Qwen3_5MoeTextConfig, Qwen3_5MoeForCausalLM) if cfg.is_moe
                    else (Qwen3_5TextConfig, Qwen3_5ForCausalLM))
    hf_cfg = cls_cfg(**d)
    hf_cfg._attn_implementation = "eager"
    hf_cfg._experts_implementation = "eager"  # the per-expert loop: the plainest reference
    torch.manual_seed(seed)
    model = cls(hf_cfg).eval().float()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("A_log"):
                p.copy_(torch.log(torch.empty_like(p).uniform_(1.0, 16.0)))
            elif name.endswith("dt_bias"):
                p.copy_(torch.empty_like(p).uniform_(-1.0, 2.0))
            elif "norm" in name:
                p.copy_(torch.randn_like(p) * 0.2 + (1.0 if name.endswith("linear_attn.norm.weight") else 0.0))
            elif name.endswith("mlp.gate.weight"):
                # Decisive routing: near-tied router scores would let float rounding pick a
                # different expert, a discontinuity no implementation can match.
                p.copy_(torch.randn_like(p) * 1.0)
            elif "conv1d" in name:
                p.copy_(torch.randn_like(p) * 0.5)
            else:
                p.copy_(torch.randn_like(p) * 0.04)
    return model


def hf_logits(model, ids) -> "torch.Tensor":
    with torch.no_grad():
        return model(torch.as_tensor(ids)).logits.float().numpy()
