"""The trained checkpoints that ship with the package (``tiny-math``, ``tiny-math-moe``):
read by the real loader and by transformers alike, and they solve held-out problems."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

import qwen35_jax
from qwen35_jax import builtin
from qwen35_jax.train import problems
from serving import LLM, SamplingParams
from serving.engine.capacity import cache_dtype
from serving.engine.runner import rewrites_whole_cache


@pytest.mark.parametrize("name", builtin.NAMES)
def test_transformers_reads_the_shipped_checkpoint_as_we_do(name):
    path = builtin.resolve(name)
    tok = AutoTokenizer.from_pretrained(path)
    ids = np.array([tok.encode(p.prompt + p.completion) for p in problems.held_out(1)])
    ours = np.asarray(qwen35_jax.from_pretrained(path, dtype=jnp.float32, progress=False)(
        jnp.asarray(ids)))
    hf = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    with torch.no_grad():
        theirs = hf(torch.as_tensor(ids)).logits.numpy()
    np.testing.assert_allclose(theirs, ours, atol=2e-3, rtol=0)
    assert (theirs.argmax(-1) == ours.argmax(-1)).all()


def test_the_shipped_moe_model_solves_held_out_problems():
    """Greedy answers through the engine, as completions and as chats (its template); the
    dense model's go through both servers (test_parity, test_accuracy)."""
    llm = LLM("tiny-math-moe", max_num_seqs=4, max_num_batched_tokens=64, max_model_len=256,
              num_blocks=64)
    probs = problems.held_out(24)
    greedy = SamplingParams(max_tokens=96, temperature=0)
    outs = llm.generate([p.prompt for p in probs], greedy)
    text = [llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert np.mean([problems.extract(t) == p.answer for t, p in zip(text, probs)]) >= 0.9
    chats = [llm.tokenizer.encode(llm.tokenizer.apply_chat_template(
        [{"role": "user", "content": p.question}], add_generation_prompt=True, tokenize=False),
        add_special_tokens=False) for p in probs[:8]]
    outs = llm.generate(chats, greedy)
    text = [llm.tokenizer.decode(o.token_ids, skip_special_tokens=True) for o in outs]
    assert np.mean([problems.extract(t) == p.answer for t, p in zip(text, probs)]) >= 0.9


def test_whole_array_rewrites_of_a_cache_are_found():
    """XLA's CPU backend updates a bfloat16 array by converting all of it (the reason CPU
    caches of 16-bit models are float32, which test_accuracy's bfloat16 servers rely on);
    a float32 array is updated in place, unless the program copies it whole."""
    def update(c, x, i):
        return jax.lax.dynamic_update_index_in_dim(c, x.astype(c.dtype), i, 0)

    for dtype, whole in ((jnp.bfloat16, jax.default_backend() == "cpu"), (jnp.float32, False)):
        c = jnp.zeros((64, 3, 256), dtype)
        hlo = jax.jit(update, donate_argnums=0).lower(c, jnp.ones((3, 256)), 3).compile().as_text()
        assert rewrites_whole_cache(hlo, c) is whole
    # an update XLA does not do in place: the donated array is copied out and back
    def two_updates(c, x):
        return c.at[0].set(x), c.at[1].set(x)

    c = jnp.zeros((64, 3, 256), jnp.float32)
    hlo = jax.jit(two_updates, donate_argnums=0).lower(c, jnp.ones((3, 256))).compile().as_text()
    assert rewrites_whole_cache(hlo, c)
    assert cache_dtype(jnp.bfloat16) == (
        jnp.float32 if jax.default_backend() == "cpu" else jnp.bfloat16)
    assert cache_dtype(jnp.float32) == jnp.float32
