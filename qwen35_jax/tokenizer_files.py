"""What a tokenizer directory of the built-in small models holds besides ``tokenizer.json``.

The built-in tokenizers (`serving/assets/tiny/` for the random-weight presets, the trained
``tiny-math`` checkpoints) reserve ids 0-2 for the special tokens that end a sequence and
frame a chat:

    <|endoftext|> = 0    <|im_end|> = 1    <|im_start|> = 2

``tiny-math`` keeps the plain ChatML template it was trained on (``CHAT_TEMPLATE``); the
random-weight presets use ``QWEN35_CHAT_TEMPLATE``, Qwen3.5's conventions in ChatML: tools
in the system turn, an assistant's tool calls as ``<tool_call><function=NAME><parameter=P>``
blocks, tool results as ``<tool_response>`` blocks of a user turn, reasoning in
``<think>`` blocks, and ``enable_thinking`` (a chat template argument) opening the reply
with ``<think>`` (true) or an empty think block (false). Unset, the reply starts plainly,
as with ``CHAT_TEMPLATE``, so a conversation without tools renders the same under both.
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

_TOOLS_PREAMBLE = (
    "# Tools\n\nYou have access to the following functions:\n\n<tools>")
_TOOLS_FORMAT = (
    "\n</tools>\n\nTo call a function, reply in this format:\n<tool_call>\n"
    "<function=example_function_name>\n<parameter=example_parameter>\nvalue\n"
    "</parameter>\n</function>\n</tool_call>")
QWEN35_CHAT_TEMPLATE = (
    "{%- if tools %}"
    "{{- '<|im_start|>system\\n' }}"
    "{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}"
    "{{- '" + _TOOLS_PREAMBLE.replace("\n", "\\n") + "' }}"
    "{%- for tool in tools %}{{- '\\n' + (tool | tojson) }}{%- endfor %}"
    "{{- '" + _TOOLS_FORMAT.replace("\n", "\\n") + "<|im_end|>\\n' }}"
    "{%- elif messages[0].role == 'system' %}"
    "{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- for message in messages %}"
    "{%- if message.role == 'system' and loop.first %}"
    "{%- elif message.role == 'assistant' %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if message.reasoning_content %}"
    "{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{{- message.content or '' }}"
    "{%- for call in message.tool_calls or [] %}"
    "{%- set f = call.function if call.function is defined else call %}"
    "{{- '\\n<tool_call>\\n<function=' + f.name + '>\\n' }}"
    "{%- for name, value in (f.arguments or {}).items() %}"
    "{{- '<parameter=' + name + '>\\n' }}"
    "{{- value if value is string else value | tojson }}"
    "{{- '\\n</parameter>\\n' }}"
    "{%- endfor %}"
    "{{- '</function>\\n</tool_call>' }}"
    "{%- endfor %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- elif message.role == 'tool' %}"
    "{%- if loop.first or loop.previtem.role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}"
    "{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}"
    "{%- if loop.last or loop.nextitem.role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}"
    "{%- else %}"
    "{{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}"
    "{{- '<|im_start|>assistant\\n' }}"
    "{%- if enable_thinking is defined %}"
    "{{- '<think>\\n' if enable_thinking else '<think>\\n\\n</think>\\n\\n' }}"
    "{%- endif %}"
    "{%- endif %}"
)


def tokenizer_config(model_max_length: int = 4096, chat_template: str = CHAT_TEMPLATE) -> dict:
    """What transformers' AutoTokenizer reads next to tokenizer.json."""
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None,
        "eos_token": EOS,
        "pad_token": PAD,
        "unk_token": None,
        "model_max_length": model_max_length,
        "clean_up_tokenization_spaces": False,
        "chat_template": chat_template,
        "added_tokens_decoder": {
            str(i): {"content": s, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for i, s in enumerate(SPECIAL_TOKENS)},
    }


def save(tok, out_dir: str, model_max_length: int = 4096,
         chat_template: str = CHAT_TEMPLATE) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` of a `tokenizers` Tokenizer."""
    for i, s in enumerate(SPECIAL_TOKENS):
        if tok.token_to_id(s) != i:
            raise ValueError(f"special token {s!r} has id {tok.token_to_id(s)}, want {i}")
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w") as f:
        json.dump(tokenizer_config(model_max_length, chat_template), f, indent=2)
        f.write("\n")
