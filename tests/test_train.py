"""The training kit of the built-in models: the problem grammar, its tokenizer, the
exporter to the official checkpoint layout, and the training step."""

from __future__ import annotations

import json
import random

import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from transformers import AutoModelForCausalLM

import qwen35_jax
from qwen35_jax import builtin
from qwen35_jax.config import _layers
from qwen35_jax.export import checkpoint_tensors, save_pretrained
from qwen35_jax.mtp_checkpoint import load_mtp
from qwen35_jax.mtp import MTP
from qwen35_jax.train import problems, tokenizer, trainer


def test_the_working_of_every_problem_is_right():
    """The columns, read as the grammar defines them, give the stated answer, and the
    answer is Python's arithmetic on the story's operands."""
    rng = random.Random(3)
    for _ in range(3000):
        p = problems.problem(rng)
        a, op, b = p.work.split(". ")[1].split(" = ")[0].split()
        assert p.answer == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
        assert f" {a} " in f" {p.question} " and f" {b} " in f" {p.question} ".replace(".", " ")
        carry, digits = 0, []
        for col in p.work.split(". ")[0].split(", "):
            x, y, c, out, d = int(col[0]), int(col[2]), int(col[4]), int(col[6]), int(col[7])
            assert col[1] == col[3] == op and c == carry
            assert (x + y + c == 10 * out + d) if op == "+" else (x - y - c == d - 10 * out)
            carry = out
            digits.append(d)
        assert int("".join(map(str, ([carry] if op == "+" else []) + digits[::-1]))) == p.answer
        assert problems.extract(p.completion) == p.answer


def test_held_out_problems_are_not_the_training_stream():
    held = {p.question for p in problems.held_out(2000)}
    trained = {p.question for p in problems.problems(0, 20000)}
    assert len(held & trained) <= 2  # ~1e9 possible stories: a collision is chance, not a leak
    assert problems.extract("A: ... #### 12\n#### 345") == 345
    assert problems.extract("no answer here") is None


def test_digits_are_single_tokens_and_the_build_is_reproducible():
    tok = tokenizer.build()
    p = problems.held_out(1)[0]
    enc = tok.encode(p.prompt + p.completion)
    digits = [t for t in enc.tokens if any(ch.isdigit() for ch in t)]
    assert digits and all(len(t) == 1 for t in digits), digits
    assert tok.decode(enc.ids) == p.prompt + p.completion
    assert [tok.token_to_id(s) for s in ("<|endoftext|>", "<|im_end|>", "<|im_start|>")] == [0, 1, 2]
    assert tokenizer.build().to_str() == tok.to_str()


def _mtp_names(cfg) -> set[str]:
    """The MTP tensors of an official Qwen3.5 checkpoint (shared/reference, §4.6 and §5):
    fc, two pre-fc norms, the final norm, and one full-attention decoder layer whose
    experts (Qwen3.5's releases) are per-expert 2-D tensors."""
    layer = {"input_layernorm.weight", "post_attention_layernorm.weight",
             "self_attn.q_proj.weight", "self_attn.k_proj.weight", "self_attn.v_proj.weight",
             "self_attn.o_proj.weight", "self_attn.q_norm.weight", "self_attn.k_norm.weight"}
    if cfg.is_moe:
        layer |= {"mlp.gate.weight", "mlp.shared_expert_gate.weight"}
        layer |= {f"mlp.shared_expert.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
        layer |= {f"mlp.experts.{e}.{w}.weight" for e in range(cfg.num_experts)
                  for w in ("gate_proj", "up_proj", "down_proj")}
    else:
        layer |= {f"mlp.{w}.weight" for w in ("gate_proj", "up_proj", "down_proj")}
    return ({"mtp.fc.weight", "mtp.pre_fc_norm_embedding.weight",
             "mtp.pre_fc_norm_hidden.weight", "mtp.norm.weight"}
            | {"mtp.layers.0." + n for n in layer})


def test_export_is_what_the_loader_and_transformers_read(tmp_path):
    """A model written by save_pretrained loads back bit-exactly through our loader, and
    transformers (which knows nothing of our tables) reads it into the same logits; its
    MTP tensors carry the official names and shapes. (MoE here; the dense export is the
    shipped tiny-math, which test_builtin checks against transformers.)"""
    cfg = qwen35_jax.get_preset("tiny-moe")
    model = qwen35_jax.init_random(cfg, seed=4, dtype=jnp.float32)
    mtp = MTP(cfg, rngs=nnx.Rngs(5))
    save_pretrained(model, tmp_path, mtp=mtp, dtype=jnp.float32)
    ids = jnp.asarray(np.random.default_rng(0).integers(3, cfg.vocab_size, (2, 9)))
    ours = np.asarray(model(ids))
    back = qwen35_jax.from_pretrained(tmp_path, dtype=jnp.float32, progress=False)
    np.testing.assert_array_equal(np.asarray(back(ids)), ours)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(np.asarray(ids))).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=3e-4, rtol=0)
    tensors = checkpoint_tensors(model, mtp, jnp.float32)
    assert {k for k in tensors if k.startswith("mtp.")} == _mtp_names(cfg)
    d = cfg.hidden_size
    assert tensors["mtp.fc.weight"].shape == (d, 2 * d)
    np.testing.assert_array_equal(tensors["mtp.fc.weight"], np.asarray(mtp.fc.kernel[...]).T)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["text_config"]["mtp_num_hidden_layers"] == 1
    # the head loads back from those names (per-expert MoE tensors), every value exact
    head = load_mtp(tmp_path, cfg, jnp.float32)
    want, got = (dict(nnx.to_flat_state(nnx.state(m))) for m in (mtp, head))
    assert want.keys() == got.keys()
    for k in want:
        np.testing.assert_array_equal(np.asarray(got[k][...]), np.asarray(want[k][...]), str(k))


@pytest.mark.parametrize("name", builtin.NAMES)
def test_the_shipped_checkpoints_hold_the_official_mtp_tensors(name):
    from safetensors import safe_open

    cfg = qwen35_jax.Qwen35Config.from_json(builtin.resolve(name))
    with safe_open(f"{builtin.resolve(name)}/model.safetensors", "np") as f:
        assert {k for k in f.keys() if k.startswith("mtp.")} == _mtp_names(cfg)


def test_training_steps_lower_the_loss():
    cfg = qwen35_jax.Qwen35Config(
        name="t", vocab_size=tokenizer.build().get_vocab_size(), hidden_size=32,
        num_hidden_layers=4, num_attention_heads=2, num_key_value_heads=1, head_dim=16,
        linear_num_key_heads=1, linear_num_value_heads=2, linear_key_head_dim=16,
        linear_value_head_dim=16, layer_types=_layers(4), intermediate_size=64,
        max_position_embeddings=256, eos_token_ids=(1, 0))
    s = trainer.Settings(steps=8, batch=8, lr=5e-3, warmup=2, eval_every=4, eval_problems=16)
    model, mtp, history, steps = trainer.train(cfg, tokenizer.build(), s, log=lambda m: None)
    assert steps == 8 and [r["step"] for r in history] == [4, 8]
    first, last = history[0], history[-1]
    assert last["loss"] < first["loss"] < 6.3 and last["mtp_loss"] < first["mtp_loss"]
    assert 0 <= last["exact"] <= 1 and 0 <= last["mtp_accuracy"] <= 1
