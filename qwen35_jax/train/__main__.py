"""Train a ``tiny-math`` model and write it as a Hugging Face checkpoint.

    python -m qwen35_jax.train --variant tiny-math --out qwen35_jax/checkpoints/tiny-math
    python -m qwen35_jax.train --variant tiny-math-moe --out qwen35_jax/checkpoints/tiny-math-moe

The directory gets ``model.safetensors`` (the model and its MTP head, official names,
bfloat16), ``config.json``, ``generation_config.json``, ``tokenizer.json``,
``tokenizer_config.json`` (ChatML template) and ``training.json`` (settings and the
loss/accuracy history); ``--plot PNG`` draws that history (matplotlib), and
``--replot DIR --plot PNG`` draws it again from a written checkpoint's training.json.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import time

import jax
import jax.numpy as jnp

from qwen35_jax import tokenizer_files
from qwen35_jax.config import Qwen35Config, _layers
from qwen35_jax.export import save_pretrained
from qwen35_jax.train import tokenizer, trainer


def config(variant: str, vocab_size: int) -> Qwen35Config:
    """The architecture of each variant: 8 layers (6 GDN, 2 attention), hidden 128."""
    common = dict(vocab_size=vocab_size, hidden_size=128, num_hidden_layers=8,
                  num_attention_heads=4, num_key_value_heads=2, head_dim=32,
                  linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=32,
                  linear_value_head_dim=32, layer_types=_layers(8),
                  max_position_embeddings=2048, eos_token_ids=tokenizer_files.EOS_IDS)
    if variant == "tiny-math":
        return Qwen35Config(name=variant, intermediate_size=384, **common)
    if variant == "tiny-math-moe":
        return Qwen35Config(name=variant, num_experts=8, num_experts_per_tok=2,
                            moe_intermediate_size=128, shared_expert_intermediate_size=128,
                            **common)
    raise ValueError(f"unknown variant {variant!r}: tiny-math or tiny-math-moe")


def plot(history: list[dict], path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in history]
    fig, (a, b) = plt.subplots(1, 2, figsize=(10, 3.6))
    a.semilogy(steps, [r["loss"] for r in history], label="answer tokens")
    a.semilogy(steps, [r["mtp_loss"] for r in history], label="MTP head (token t+2)")
    a.set_xlabel("step")
    a.set_ylabel("training loss (nats/token)")
    a.legend()
    b.plot(steps, [r["exact"] for r in history], label="held-out exact (completion)")
    b.plot(steps, [r["chat_exact"] for r in history], label="held-out exact (chat)")
    b.plot(steps, [r["mtp_accuracy"] for r in history], label="MTP top-1 (answer tokens)")
    b.set_xlabel("step")
    b.set_ylim(0, 1)
    b.legend(loc="lower right")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def _title(r: dict) -> str:
    return (f"{r['variant']}: {r['steps_run']} steps of {r['settings']['batch']}, "
            f"{r['seconds']:.0f} s on {r['device']}")


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--variant", default="tiny-math", choices=["tiny-math", "tiny-math-moe"])
    p.add_argument("--out", help="the checkpoint directory to write")
    p.add_argument("--plot", metavar="PNG", help="draw the loss and accuracy curves here")
    p.add_argument("--replot", metavar="DIR", help="only draw DIR/training.json to --plot")
    for f in dataclasses.fields(trainer.Settings):
        p.add_argument("--" + f.name.replace("_", "-"), type=float if f.type in ("float", "float | None") else int,
                       default=f.default)
    a = p.parse_args(argv)
    if a.replot:
        with open(os.path.join(a.replot, "training.json")) as f:
            r = json.load(f)
        plot(r["history"], a.plot, _title(r))
        return
    if not a.out:
        p.error("--out is required")
    settings = trainer.Settings(**{f.name: getattr(a, f.name) for f in dataclasses.fields(trainer.Settings)})
    tok = tokenizer.build()
    cfg = config(a.variant, tok.get_vocab_size())
    t0 = time.perf_counter()
    model, mtp, history, steps = trainer.train(cfg, tok, settings, log=lambda m: print(m, flush=True))
    seconds = time.perf_counter() - t0
    save_pretrained(model, a.out, mtp=mtp, dtype=jnp.bfloat16)
    tokenizer_files.save(tok, a.out, model_max_length=cfg.max_position_embeddings)
    record = dict(variant=a.variant, device=str(jax.devices()[0].device_kind), steps_run=steps,
                  seconds=round(seconds, 1), settings=dataclasses.asdict(settings),
                  history=history)
    with open(os.path.join(a.out, "training.json"), "w") as f:
        json.dump(record, f, indent=1)
        f.write("\n")
    if a.plot:
        plot(history, a.plot, _title(record))
    last = history[-1] if history else {}
    print(f"wrote {a.out}: {steps} steps in {seconds:.0f} s, held-out exact "
          f"{last.get('exact', float('nan')):.1%}", flush=True)


if __name__ == "__main__":
    main()
