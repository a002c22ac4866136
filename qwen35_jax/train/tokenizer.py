"""The tokenizer of the ``tiny-math`` models: a byte-level BPE whose digits stay single tokens.

Every digit is its own token (``Digits(individual_digits=True)`` runs before the
byte-level split), so a number's columns are the positions the model reads and writes;
the story words, trained on the problem grammar and chat framing, become whole tokens.
Byte-level coverage keeps every string encodable and every id decodable. The training
text comes from a fixed seed, so building twice gives the same file.
"""

from __future__ import annotations

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

from qwen35_jax.tokenizer_files import CHAT_TEMPLATE, SPECIAL_TOKENS
from qwen35_jax.train import problems

VOCAB_SIZE = 512


def corpus(n: int = 6000, seed: int = 7) -> list[str]:
    texts = [p.prompt + p.completion for p in problems.problems(seed, n)]
    return texts + ["user", "assistant", "system", "Hello", "Question", "Answer",
                    CHAT_TEMPLATE]


def build(vocab_size: int = VOCAB_SIZE) -> Tokenizer:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Digits(individual_digits=True),
        pre_tokenizers.ByteLevel(add_prefix_space=False)])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tok.train_from_iterator(corpus(), trainer=trainer)
    return tok
