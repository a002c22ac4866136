"""Qwen35Config: the text model's hyper-parameters, read from a checkpoint's
``config.json`` or taken from a built-in preset.

Real checkpoints are vision-language configs with the language model nested
under ``text_config`` and ``tie_word_embeddings`` at the top level; text-only
configs (``qwen3_5_text``) are flat.  Fields we do not understand are refused
rather than silently ignored: a config field that changes the maths and is
dropped on the floor gives a model that loads and is wrong.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Mapping

FULL = "full_attention"
LINEAR = "linear_attention"

DENSE_TYPES = ("qwen3_5", "qwen3_5_text")
MOE_TYPES = ("qwen3_5_moe", "qwen3_5_moe_text")

# Keys HF's generic PretrainedConfig writes, plus keys real Qwen3.5 configs carry
# that HF's modelling code ignores (architecture reference, section 1.1).  They
# never change the language model's maths, so they are accepted and dropped.
_IGNORED_TEXT_KEYS = frozenset({
    "transformers_version", "architectures", "output_hidden_states", "return_dict", "dtype",
    "torch_dtype", "chunk_size_feed_forward", "is_encoder_decoder", "id2label", "label2id",
    "problem_type", "pad_token_id", "bos_token_id", "_name_or_path", "output_attentions",
    "use_cache", "initializer_range", "attention_dropout", "output_router_logits",
    "router_aux_loss_coef", "attn_output_gate", "mamba_ssm_dtype", "mtp_num_hidden_layers",
    "mtp_use_dedicated_embeddings", "tie_word_embeddings", "model_type", "eos_token_id",
    "use_bfloat16", "tokenizer_class", "prefix", "task_specific_params", "finetuning_task",
    "tf_legacy_loss", "pruned_heads", "torchscript", "cross_attention_hidden_size",
    "add_cross_attention", "decoder_start_token_id", "sep_token_id", "layer_norm_eps",
})
_IGNORED_TOP_KEYS = frozenset({
    "architectures", "model_type", "tie_word_embeddings", "text_config", "vision_config",
    "transformers_version", "image_token_id", "video_token_id", "vision_start_token_id",
    "vision_end_token_id", "dtype", "torch_dtype", "_name_or_path", "use_cache",
    "output_attentions", "output_hidden_states", "return_dict", "id2label", "label2id",
    "is_encoder_decoder", "problem_type", "eos_token_id", "pad_token_id", "bos_token_id",
})


class ConfigError(ValueError):
    """A config.json or preset that this model cannot represent faithfully."""


def _fp8_modules(qc, name: str) -> tuple[str, ...]:
    """The FP8 parameters a checkpoint's ``quantization_config`` implies before its
    tensors are read: the default set (the loader then takes the set its
    ``weight_scale_inv`` tensors name). Anything but 128 x 128 block-scaled e4m3 is
    refused: other block shapes or formats would load as wrong weights."""
    from qwen35_jax.quant import BLOCK, DEFAULT

    method = qc.get("quant_method", "unknown") if isinstance(qc, dict) else qc
    if method != "fp8":
        raise ConfigError(f"{name}: quantised checkpoints of method {method!r} are not "
                          "supported; FP8 (block-scaled e4m3, as Qwen's -FP8 releases) is, "
                          "or use the bf16 release")
    block = list(qc.get("weight_block_size") or [])
    if block != [BLOCK, BLOCK]:
        raise ConfigError(f"{name}: FP8 weight_block_size {block or None} is not supported "
                          f"(only [{BLOCK}, {BLOCK}] block scales)")
    fmt = qc.get("fmt", "e4m3")
    if fmt != "e4m3":
        raise ConfigError(f"{name}: FP8 format {fmt!r} is not supported (only e4m3)")
    if qc.get("scale_fmt", "float") != "float":
        raise ConfigError(f"{name}: FP8 scale_fmt {qc['scale_fmt']!r} is not supported "
                          "(only float32 scales)")
    return DEFAULT


@dataclasses.dataclass(frozen=True)
class Qwen35Config:
    """Hyper-parameters of the Qwen3.5 language model (dense or MoE).

    ``layer_types`` must repeat one group of layers (``linear_attention`` ×
    (interval−1), then ``full_attention``): the model scans that group, so
    compile time does not grow with depth.
    """

    vocab_size: int
    hidden_size: int
    num_hidden_layers: int
    num_attention_heads: int
    num_key_value_heads: int
    head_dim: int
    linear_num_key_heads: int
    linear_num_value_heads: int
    linear_key_head_dim: int
    linear_value_head_dim: int
    layer_types: tuple[str, ...]
    intermediate_size: int | None = None  # dense FFN; None for MoE
    num_experts: int = 0  # 0: dense model
    num_experts_per_tok: int = 0
    moe_intermediate_size: int | None = None
    shared_expert_intermediate_size: int | None = None
    linear_conv_kernel_dim: int = 4
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1e7
    partial_rotary_factor: float = 0.25
    max_position_embeddings: int = 262144
    tie_word_embeddings: bool = False
    eos_token_ids: tuple[int, ...] = (248046, 248044)
    # Layer-relative parameter paths held as FP8 with 128 x 128 block scales (quant.py):
    # an FP8 checkpoint's quantised tensors, or ``--quantization fp8``'s default set.
    fp8_modules: tuple[str, ...] = ()
    name: str = "custom"

    def __post_init__(self):
        def need(cond, msg):
            if not cond:
                raise ConfigError(f"{self.name}: {msg}")

        for f in ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads",
                  "num_key_value_heads", "head_dim", "linear_num_key_heads",
                  "linear_num_value_heads", "linear_key_head_dim", "linear_value_head_dim",
                  "linear_conv_kernel_dim"):
            v = getattr(self, f)
            need(isinstance(v, int) and v > 0, f"{f} must be a positive integer, got {v!r}")
        need(len(self.layer_types) == self.num_hidden_layers,
             f"layer_types has {len(self.layer_types)} entries but num_hidden_layers is "
             f"{self.num_hidden_layers}")
        bad = sorted(set(self.layer_types) - {FULL, LINEAR})
        need(not bad, f"unknown layer types {bad}; expected {LINEAR!r} or {FULL!r}")
        period = self.full_attention_interval
        need(period > 1 and self.num_hidden_layers % period == 0
             and self.layer_types == tuple(
                 ([LINEAR] * (period - 1) + [FULL]) * (self.num_hidden_layers // period)),
             "layer_types must repeat one group of (interval-1) linear_attention layers "
             f"followed by one full_attention layer; got {list(self.layer_types)}")
        need(self.num_attention_heads % self.num_key_value_heads == 0,
             "num_attention_heads must be a multiple of num_key_value_heads")
        need(self.linear_num_value_heads % self.linear_num_key_heads == 0,
             "linear_num_value_heads must be a multiple of linear_num_key_heads")
        need(self.rotary_dim % 2 == 0 and 0 < self.rotary_dim <= self.head_dim,
             f"head_dim*partial_rotary_factor = {self.head_dim * self.partial_rotary_factor} "
             "must be an even number of dimensions within head_dim")
        from qwen35_jax.quant import QUANTISABLE, applicable
        bad = sorted(set(self.fp8_modules) - set(QUANTISABLE))
        need(not bad, f"fp8_modules {bad} are not parameters that can be FP8 "
                      f"(one of {list(QUANTISABLE)})")
        absent = sorted(set(self.fp8_modules) - set(applicable(self.fp8_modules, self.is_moe)))
        need(not absent, f"fp8_modules {absent} are not parameters of a "
                         f"{'MoE' if self.is_moe else 'dense'} model")
        def positive(v) -> bool:
            return isinstance(v, int) and not isinstance(v, bool) and v > 0

        def finite_positive(v) -> bool:
            return (isinstance(v, (int, float)) and not isinstance(v, bool)
                    and math.isfinite(v) and v > 0)

        need(finite_positive(self.rms_norm_eps) and self.rms_norm_eps < 1,
             f"rms_norm_eps must be a number in (0, 1), got {self.rms_norm_eps!r}")
        need(finite_positive(self.rope_theta) and self.rope_theta > 1,
             f"rope_theta must be a finite number > 1, got {self.rope_theta!r}")
        need(positive(self.max_position_embeddings),
             f"max_position_embeddings must be a positive integer, got "
             f"{self.max_position_embeddings!r}")
        need(all(isinstance(i, int) and not isinstance(i, bool) and i >= 0
                 for i in self.eos_token_ids),
             f"eos_token_id must be token ids (integers >= 0), got {list(self.eos_token_ids)}")

        need(isinstance(self.num_experts, int) and self.num_experts >= 0,
             f"num_experts must be an integer >= 0, got {self.num_experts!r}")
        if self.is_moe:
            need(isinstance(self.num_experts_per_tok, int)
                 and 0 < self.num_experts_per_tok <= self.num_experts,
                 "num_experts_per_tok must be in 1..num_experts")
            need(positive(self.moe_intermediate_size)
                 and positive(self.shared_expert_intermediate_size),
                 "MoE models need moe_intermediate_size and shared_expert_intermediate_size, "
                 f"positive integers; got {self.moe_intermediate_size!r} and "
                 f"{self.shared_expert_intermediate_size!r}")
            need(self.intermediate_size is None,
                 "a MoE config must not set a dense intermediate_size")
        else:
            need(positive(self.intermediate_size), "dense models need intermediate_size, a "
                 f"positive integer; got {self.intermediate_size!r}")
            need(self.num_experts_per_tok == 0 and self.moe_intermediate_size is None,
                 "a dense config must not set MoE fields")

    # Derived sizes -----------------------------------------------------------------
    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def full_attention_interval(self) -> int:
        return self.layer_types.index(FULL) + 1 if FULL in self.layer_types else 0

    @property
    def num_groups(self) -> int:
        """Number of scanned groups (each: interval-1 GDN layers, then attention)."""
        return self.num_hidden_layers // self.full_attention_interval

    @property
    def gdn_per_group(self) -> int:
        return self.full_attention_interval - 1

    @property
    def rotary_dim(self) -> int:
        return int(round(self.head_dim * self.partial_rotary_factor))

    @property
    def conv_dim(self) -> int:
        """Channels of the GDN causal conv: [q | k | v]."""
        return (2 * self.linear_num_key_heads * self.linear_key_head_dim
                + self.linear_num_value_heads * self.linear_value_head_dim)

    def replace(self, **kw) -> "Qwen35Config":
        return dataclasses.replace(self, **kw)

    # Reading config.json -------------------------------------------------------------
    @classmethod
    def from_dict(cls, d: Mapping[str, Any], name: str = "checkpoint") -> "Qwen35Config":
        """Build from a HF config dict (nested multimodal or flat text config)."""
        d = dict(d)
        top_type = d.get("model_type")
        if "text_config" in d and not isinstance(d["text_config"], dict):
            raise ConfigError(f"{name}: text_config must be an object, got "
                              f"{d['text_config']!r:.80}")
        text_qc = (d.get("text_config") or {}).get("quantization_config")
        qc = d.pop("quantization_config", None) or text_qc
        if "text_config" in d and text_qc is not None:
            d["text_config"] = {k: v for k, v in d["text_config"].items()
                                if k != "quantization_config"}
        fp8 = () if qc is None else _fp8_modules(qc, name)
        if "text_config" in d:
            if top_type not in DENSE_TYPES + MOE_TYPES:
                raise ConfigError(f"{name}: model_type {top_type!r} is not a Qwen3.5 model "
                                  f"(expected one of {DENSE_TYPES + MOE_TYPES})")
            unknown = sorted(set(d) - _IGNORED_TOP_KEYS)
            if unknown:
                raise ConfigError(f"{name}: unknown top-level config fields {unknown}")
            text = dict(d["text_config"])
            if "tie_word_embeddings" in d:
                inner = text.get("tie_word_embeddings")
                if inner is not None and bool(inner) != bool(d["tie_word_embeddings"]):
                    raise ConfigError(
                        f"{name}: tie_word_embeddings is {d['tie_word_embeddings']} at the top "
                        f"level but {inner} in text_config")
                text["tie_word_embeddings"] = d["tie_word_embeddings"]
            text.setdefault("model_type", {"qwen3_5": "qwen3_5_text",
                                           "qwen3_5_moe": "qwen3_5_moe_text"}[top_type])
            if "eos_token_id" in d and "eos_token_id" not in text:
                text["eos_token_id"] = d["eos_token_id"]
        else:
            text = d
        cfg = cls._from_text_dict(text, name)
        if fp8:
            from qwen35_jax.quant import applicable
            cfg = dataclasses.replace(cfg, fp8_modules=applicable(fp8, cfg.is_moe))
        return cfg

    @classmethod
    def _from_text_dict(cls, t: dict, name: str) -> "Qwen35Config":
        mtype = t.get("model_type")
        if mtype not in DENSE_TYPES + MOE_TYPES:
            raise ConfigError(f"{name}: model_type {mtype!r} is not a Qwen3.5 text model "
                              f"(expected one of {DENSE_TYPES + MOE_TYPES})")
        moe = mtype in MOE_TYPES
        t = dict(t)
        if t.pop("hidden_act", "silu") != "silu":
            raise ConfigError(f"{name}: only hidden_act='silu' exists in Qwen3.5")
        if t.pop("attention_bias", False):
            raise ConfigError(f"{name}: attention_bias=true is not part of Qwen3.5")
        if t.pop("mlp_only_layers", []):
            raise ConfigError(f"{name}: mlp_only_layers is not supported (every Qwen3.5 MoE "
                              "layer is sparse)")
        if moe and t.pop("norm_topk_prob", True) is False:
            raise ConfigError(f"{name}: norm_topk_prob=false contradicts Qwen3.5, which "
                              "always renormalises the top-k router weights")
        t.pop("norm_topk_prob", None)
        if t.pop("decoder_sparse_step", 1) != 1:
            raise ConfigError(f"{name}: decoder_sparse_step != 1 is not supported")

        rope = dict(t.pop("rope_parameters", None) or t.pop("rope_scaling", None) or {})
        theta_flat = t.pop("rope_theta", None)
        factor_flat = t.pop("partial_rotary_factor", None)
        rope_type = rope.pop("rope_type", rope.pop("type", "default"))
        if rope_type != "default":
            raise ConfigError(f"{name}: rope_type {rope_type!r} is not supported yet "
                              "(only the default partial RoPE)")
        theta = rope.pop("rope_theta", None)
        factor = rope.pop("partial_rotary_factor", None)
        for flat, nested, what in ((theta_flat, theta, "rope_theta"),
                                   (factor_flat, factor, "partial_rotary_factor")):
            if flat is not None and nested is not None and float(flat) != float(nested):
                raise ConfigError(f"{name}: {what} is {flat} and {nested} in rope_parameters")
        theta = theta if theta is not None else theta_flat
        factor = factor if factor is not None else factor_flat
        section = rope.pop("mrope_section", None)
        rope.pop("mrope_interleaved", None)
        if rope:
            raise ConfigError(f"{name}: unknown rope_parameters fields {sorted(rope)}")

        def required(key):
            if key not in t:
                raise ConfigError(f"{name}: missing config field {key!r}")
            return t.pop(key)

        n_layers = required("num_hidden_layers")
        interval = t.pop("full_attention_interval", None)
        layer_types = t.pop("layer_types", None)
        if not (isinstance(n_layers, int) and n_layers > 0):
            raise ConfigError(f"{name}: num_hidden_layers must be a positive integer, "
                              f"got {n_layers!r}")
        if interval is not None and not (isinstance(interval, int) and interval > 1):
            raise ConfigError(f"{name}: full_attention_interval must be an integer > 1 (one "
                              f"attention layer after interval-1 GDN layers), got {interval!r}")
        if layer_types is None:
            interval = interval or 4  # Qwen3.5's, when neither is given
            layer_types = _layers(n_layers, interval)
        elif interval is not None:
            if tuple(layer_types) != _layers(n_layers, interval):
                raise ConfigError(f"{name}: layer_types contradicts full_attention_interval="
                                  f"{interval}")
        eos = t.pop("eos_token_id", None)
        eos_ids = (tuple(eos) if isinstance(eos, (list, tuple))
                   else (eos,) if eos is not None else ())
        eos_ids = tuple(dict.fromkeys(eos_ids + (248046, 248044)))

        fields = dict(
            vocab_size=required("vocab_size"), hidden_size=required("hidden_size"),
            num_hidden_layers=n_layers, num_attention_heads=required("num_attention_heads"),
            num_key_value_heads=required("num_key_value_heads"), head_dim=t.pop("head_dim", 256),
            linear_num_key_heads=required("linear_num_key_heads"),
            linear_num_value_heads=required("linear_num_value_heads"),
            linear_key_head_dim=t.pop("linear_key_head_dim", 128),
            linear_value_head_dim=t.pop("linear_value_head_dim", 128),
            linear_conv_kernel_dim=t.pop("linear_conv_kernel_dim", 4),
            rms_norm_eps=_number(t.pop("rms_norm_eps", 1e-6), "rms_norm_eps", name),
            max_position_embeddings=t.pop("max_position_embeddings", 262144),
            tie_word_embeddings=bool(t.get("tie_word_embeddings", False)),
            layer_types=tuple(layer_types), eos_token_ids=eos_ids, name=name,
        )
        if theta is not None:
            fields["rope_theta"] = _number(theta, "rope_theta", name)
        if factor is not None:
            fields["partial_rotary_factor"] = _number(factor, "partial_rotary_factor", name)
        if moe:
            fields.update(num_experts=required("num_experts"),
                          num_experts_per_tok=required("num_experts_per_tok"),
                          moe_intermediate_size=required("moe_intermediate_size"),
                          shared_expert_intermediate_size=required(
                              "shared_expert_intermediate_size"))
            if t.pop("intermediate_size", None) is not None:
                raise ConfigError(f"{name}: a MoE config must not set intermediate_size")
        else:
            fields["intermediate_size"] = required("intermediate_size")
            extra_moe = [k for k in ("num_experts", "num_experts_per_tok",
                                     "moe_intermediate_size",
                                     "shared_expert_intermediate_size") if t.get(k)]
            if extra_moe:
                raise ConfigError(f"{name}: dense model_type {mtype!r} has MoE fields {extra_moe}")
            for k in ("num_experts", "num_experts_per_tok", "moe_intermediate_size",
                      "shared_expert_intermediate_size"):
                t.pop(k, None)
        unknown = sorted(set(t) - _IGNORED_TEXT_KEYS)
        if unknown:
            raise ConfigError(f"{name}: unknown config fields {unknown}")
        cfg = cls(**fields)
        if section is not None and 2 * sum(section) != cfg.rotary_dim:
            raise ConfigError(f"{name}: mrope_section {section} does not cover the rotary "
                              f"dim {cfg.rotary_dim}")
        return cfg

    @classmethod
    def from_json(cls, path: str | os.PathLike) -> "Qwen35Config":
        """Read ``config.json`` (a file, or a checkpoint directory holding one)."""
        path = os.fspath(path)
        if os.path.isdir(path):
            path = os.path.join(path, "config.json")
        if not os.path.exists(path):
            raise ConfigError(f"no config.json at {path}")
        with open(path) as f:
            return cls.from_dict(json.load(f), name=os.path.basename(os.path.dirname(path)) or path)

    def with_overrides(self, overrides: Mapping[str, Any]) -> "Qwen35Config":
        """This config with HF text-config fields replaced (vLLM's ``--hf-overrides``), read
        by the same rules as a checkpoint's config: fewer ``num_hidden_layers`` of the
        same shapes, say, for a model that must fit beside another on one device. A new
        layer count without ``layer_types`` keeps the every-fourth-layer pattern."""
        d = self.to_hf_text_dict()
        if "layer_types" not in overrides and {"num_hidden_layers",
                                               "full_attention_interval"} & set(overrides):
            del d["layer_types"]
        for key in ("rope_theta", "partial_rotary_factor"):  # a flat one replaces the nested
            if key in overrides and "rope_parameters" not in overrides:
                del d["rope_parameters"][key]
        d.update(eos_token_id=list(self.eos_token_ids), **overrides)
        cfg = Qwen35Config._from_text_dict(d, f"{self.name} with {dict(overrides)}")
        return dataclasses.replace(cfg, name=self.name, fp8_modules=self.fp8_modules,
                                   eos_token_ids=(cfg.eos_token_ids if "eos_token_id" in
                                                  overrides else self.eos_token_ids))

    def to_hf_text_dict(self) -> dict:
        """The flat HF text-config dict of this config (for building reference models)."""
        d = dict(
            model_type="qwen3_5_moe_text" if self.is_moe else "qwen3_5_text",
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            num_hidden_layers=self.num_hidden_layers, num_attention_heads=self.num_attention_heads,
            num_key_value_heads=self.num_key_value_heads, head_dim=self.head_dim,
            linear_num_key_heads=self.linear_num_key_heads,
            linear_num_value_heads=self.linear_num_value_heads,
            linear_key_head_dim=self.linear_key_head_dim,
            linear_value_head_dim=self.linear_value_head_dim,
            linear_conv_kernel_dim=self.linear_conv_kernel_dim, rms_norm_eps=self.rms_norm_eps,
            max_position_embeddings=self.max_position_embeddings,
            tie_word_embeddings=self.tie_word_embeddings, layer_types=list(self.layer_types),
            rope_parameters={"rope_type": "default", "rope_theta": self.rope_theta,
                             "partial_rotary_factor": self.partial_rotary_factor},
        )
        if self.is_moe:
            d.update(num_experts=self.num_experts, num_experts_per_tok=self.num_experts_per_tok,
                     moe_intermediate_size=self.moe_intermediate_size,
                     shared_expert_intermediate_size=self.shared_expert_intermediate_size)
        else:
            d["intermediate_size"] = self.intermediate_size
        return d


def _number(v, key: str, name: str) -> float:
    """A config's real number as a float; anything else (a string, a boolean, null) is a
    ConfigError naming the field."""
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ConfigError(f"{name}: {key} must be a number, got {v!r}")
    return float(v)


def _layers(n: int, interval: int = 4) -> tuple[str, ...]:
    """Qwen3.5's layer pattern: a full-attention layer after every interval - 1 GDN ones."""
    return tuple(FULL if (i + 1) % interval == 0 else LINEAR for i in range(n))


def _published(name, hidden, layers, heads, kv, hv, *, ffn=None, experts=0, topk=0, moe_i=None,
               shared_i=None, tied=False) -> Qwen35Config:
    return Qwen35Config(
        name=name, vocab_size=248320, hidden_size=hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv, head_dim=256,
        linear_num_key_heads=16, linear_num_value_heads=hv, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=_layers(layers), intermediate_size=ffn,
        num_experts=experts, num_experts_per_tok=topk, moe_intermediate_size=moe_i,
        shared_expert_intermediate_size=shared_i, tie_word_embeddings=tied)


PRESETS: dict[str, Qwen35Config] = {c.name: c for c in (
    # Published sizes (architecture reference, table 1.3).
    _published("0.8B", 1024, 24, 8, 2, 16, ffn=3584, tied=True),
    _published("2B", 2048, 24, 8, 2, 16, ffn=6144, tied=True),
    _published("4B", 2560, 32, 16, 4, 32, ffn=9216, tied=True),
    _published("9B", 4096, 32, 16, 4, 32, ffn=12288),
    _published("27B", 5120, 64, 24, 4, 48, ffn=17408),
    _published("35B-A3B", 2048, 40, 16, 2, 32, experts=256, topk=8, moe_i=512, shared_i=512),
    _published("122B-A10B", 3072, 48, 32, 2, 64, experts=256, topk=8, moe_i=1024, shared_i=1024),
    _published("397B-A17B", 4096, 60, 32, 2, 64, experts=512, topk=10, moe_i=1024,
               shared_i=1024),
    # Small test presets: every structural feature (grouped GDN heads, GQA, partial
    # RoPE, MoE with shared expert) at sizes that run in milliseconds on a CPU.
    Qwen35Config(name="tiny", vocab_size=512, hidden_size=64, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, layer_types=_layers(8), intermediate_size=128,
                 max_position_embeddings=4096, eos_token_ids=(1, 0)),
    Qwen35Config(name="tiny-moe", vocab_size=512, hidden_size=64, num_hidden_layers=8,
                 num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                 linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                 linear_value_head_dim=32, layer_types=_layers(8), num_experts=8,
                 num_experts_per_tok=2, moe_intermediate_size=32,
                 shared_expert_intermediate_size=48, max_position_embeddings=4096,
                 eos_token_ids=(1, 0)),
)}


def get_preset(name: str) -> Qwen35Config:
    """A built-in config by name ("35B-A3B", "tiny", ...); 'Qwen3.5-' prefixes are accepted."""
    key = name.removeprefix("Qwen/").removeprefix("Qwen3.5-")
    if key not in PRESETS:
        raise KeyError(f"unknown preset {name!r}; known: {sorted(PRESETS)}")
    return PRESETS[key]
