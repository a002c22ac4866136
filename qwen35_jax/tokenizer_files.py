"""What a tokenizer directory of the built-in small models holds besides ``tokenizer.json``.

The built-in tokenizers (`serving/assets/tiny/` for the random-weight presets, the trained
``tiny-math`` checkpoints) reserve ids 0-2 for the special tokens that end a sequence and
frame a chat, and use Qwen's ChatML template:

    <|endoftext|> = 0    <|im_end|> = 1    <|im_start|> = 2
"""

from __future__ import annotations

import json
import os

SPECIAL_TOKENS = ["<|endoftext|>", "<|im_end|>", "<|im_start|>"]
EOS, PAD = "<|im_end|>", "<|endoftext|>"
EOS_IDS = (1, 0)
# ChatML, as used by Qwen: each message in <|im_start|>role ... <|im_end|>.
CHAT_TEMPLATE = (
    "{% for message in messages %}"
    "{{ '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>' + '\\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def tokenizer_config(model_max_length: int = 4096) -> dict:
    """What transformers' AutoTokenizer reads next to tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": CHAT_TEMPLATE,
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, s in enumerate(SPECIAL_TOKENS)},
    }


def save(tok, out_dir: str, model_max_length: int = 4096) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a `tokenizers` Tokenizer."""
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise ValueError(f"special token {s!r} has id {tok.token_to_id(s)}, want {i}")
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(model_max_length), f, indent=2)
        f.write("\n")
