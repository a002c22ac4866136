"""Builds the tokenizer of the built-in random-weight presets (`serving/assets/tiny/`).

The "tiny" presets have random weights and a 512-token vocabulary, so any
tokenizer of that size lets the server take text: a byte-level BPE (every
string encodes, every id decodes) with the special tokens and the Qwen3.5-style chat
template (tools, tool calls, thinking) of `qwen35_jax.tokenizer_files`.

The training text is generated here from a fixed seed, so the files do not
depend on what else is in the repository and rerunning the script reproduces
them byte for byte:

    python serving/assets/make_tiny_tokenizer.py   # writes serving/assets/tiny/

Random-weight presets of a real vocabulary (35B-A3B: 248,320 ids) have no
tokenizer either; ``--vocab-size N --out DIR`` pads the same BPE with filler
tokens ``" w<id>"`` up to N ids, so that every id the model can sample decodes to
text (a streaming server sends a chunk only when there is text to send):

    python serving/assets/make_tiny_tokenizer.py --vocab-size 248320 --out /tmp/tok
"""

import json
import os
import random

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qwen35_jax import tokenizer_files
from qwen35_jax.tokenizer_files import SPECIAL_TOKENS

VOCAB_SIZE = 512

_WORDS = """the a an of to and in is it that for on with as are this be by from at
or model token tokens request server engine batch cache block state slot prefill
decode step time latency throughput prompt text chat user assistant system hello
world what how why when where which who you we they he she one two three four
five six seven eight nine ten first last next small large fast slow good new old
write read run serve send stream answer question number list code data layer
attention memory device host queue sample seed stop length value key word
""".split()


def corpus(num_lines: int = 4000, seed: int = 0) -> list[str]:
    """Sentence-like lines over a fixed word list, with capitals, digits and
    punctuation, so frequent English fragments get merges of their own."""
    rng = random.Random(seed)
    lines = []
    for _ in range(num_lines):
        words = [rng.choice(_WORDS) for _ in range(rng.randint(3, 14))]
        if rng.random() < 0.3:
            words.insert(rng.randrange(len(words)), str(rng.randint(0, 9999)))
        line = " ".join(words)
        lines.append(line[0].upper() + line[1:] + rng.choice([".", "?", "!", ",", ":"]))
    return lines


def pad(tok: Tokenizer, vocab_size: int) -> Tokenizer:
    """``tok`` with filler tokens up to ``vocab_size`` ids: byte-level strings "Ġw<id>"
    (" w<id>" once decoded) that no merge produces, so encoding is unchanged."""
    spec = json.loads(tok.to_str())
    vocab = spec["model"]["vocab"]
    for i in range(len(vocab), vocab_size):
        vocab[f"\u0120w{i}"] = i
    return Tokenizer.from_str(json.dumps(spec))


def build() -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    if tok.get_vocab_size() != VOCAB_SIZE:
        raise RuntimeError(f"trained {tok.get_vocab_size()} tokens, want {VOCAB_SIZE}")
    return tok


def main(out_dir: str | None = None, vocab_size: int = VOCAB_SIZE) -> str:
    out_dir = out_dir or os.path.join(os.path.dirname(os.path.abspath(__file__)), "tiny")
    tok = build()
    if vocab_size > VOCAB_SIZE:
        tok = pad(tok, vocab_size)
    tokenizer_files.save(tok, out_dir, chat_template=tokenizer_files.QWEN35_CHAT_TEMPLATE)
    return out_dir


if __name__ == "__main__":
    import argparse

    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--out", default=None, help="default: serving/assets/tiny/")
    p.add_argument("--vocab-size", type=int, default=VOCAB_SIZE)
    a = p.parse_args()
    print("wrote", main(a.out, a.vocab_size))
