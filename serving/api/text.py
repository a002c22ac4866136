"""Text in and out: the tokenizer the server uses, and streaming detokenization
(tokenizers' `DecodeStream`).

The tokenizer comes from the checkpoint directory (`tokenizer.json`, loaded by
transformers' AutoTokenizer so its chat template comes along) or, for the
built-in "tiny" presets, from `serving/assets/tiny/`.
"""

import os

from tokenizers.decoders import DecodeStream
from transformers import AutoTokenizer

from qwen35_jax import builtin
from transformers.convert_slow_tokenizer import bytes_to_unicode

BUILTIN_TOKENIZER = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                 "assets", "tiny")


def find_tokenizer(model: str, tokenizer: str | None = None) -> str:
    """Where to load the tokenizer of `model` (a checkpoint directory or a preset) from."""
    if tokenizer:
        return tokenizer
    model = builtin.resolve(model)
    if os.path.isfile(os.path.join(model, "tokenizer.json")):
        return model
    from qwen35_jax import get_preset

    if not os.path.isdir(model) and get_preset(model).vocab_size == 512:
        return BUILTIN_TOKENIZER
    raise ValueError(f"no tokenizer.json in {model!r}: pass --tokenizer")


class Tokenizer:
    """A transformers tokenizer with the conventions of vLLM's server: output
    text skips special tokens (so EOS never shows up in completions), token
    strings in logprobs keep them. The engine is given this object too, so its
    stop-string checks and final texts agree with what the server streams."""

    def __init__(self, path: str):
        self.hf = AutoTokenizer.from_pretrained(path)
        self.vocab_size = len(self.hf)

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return self.hf.encode(text, add_special_tokens=add_special_tokens)

    def decode(self, ids: list[int]) -> str:
        return self.hf.decode(ids, skip_special_tokens=True)

    def token_str(self, token_id: int) -> str:
        """A token's text for logprobs; a token that is only part of a UTF-8 character
        is written as its bytes (``bytes:\\xe2\\x80``, OpenAI's convention), so distinct
        tokens never collapse into one "\ufffd" key of ``top_logprobs``."""
        text = self.hf.decode([token_id])
        if "\ufffd" not in text:
            return text
        raw = self.token_bytes(token_id)
        return text if raw is None else "bytes:" + "".join(f"\\x{b:02x}" for b in raw)

    def token_bytes(self, token_id: int) -> bytes | None:
        """The raw bytes of a byte-level BPE token (Qwen's kind); None for other kinds."""
        piece = self.hf.convert_ids_to_tokens(token_id)
        if piece is None or not all(c in _BYTE_OF_CHAR for c in piece):
            return None
        return bytes(_BYTE_OF_CHAR[c] for c in piece)

    def chat_prompt(self, messages: list[dict], tools: list[dict] | None = None,
                    **template_kwargs) -> list[int]:
        """Token ids of a conversation under the chat template, ready for the
        assistant's reply. Raises ValueError without a template."""
        return self.encode(self.chat_text(messages, tools, **template_kwargs),
                           add_special_tokens=False)

    def chat_text(self, messages: list[dict], tools: list[dict] | None = None,
                  add_generation_prompt: bool = True, **template_kwargs) -> str:
        """The chat prompt as text (`chat_prompt` encodes it). `tools`: OpenAI function
        definitions for templates that render them; `template_kwargs`: the template's own
        variables (`enable_thinking`, ...)."""
        if not self.hf.chat_template:
            raise ValueError("this model's tokenizer has no chat template; use /v1/completions")
        return self.hf.apply_chat_template(messages, tools=tools, tokenize=False,
                                           add_generation_prompt=add_generation_prompt,
                                           **template_kwargs)


_BYTE_OF_CHAR = {c: b for b, c in bytes_to_unicode().items()}  # byte-level BPE alphabet


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas.

    tokenizers' `DecodeStream` holds back a token that is only part of a UTF-8
    character (or of a word piece it cannot place yet) until the text is whole.
    With stop strings, the last `holdback` characters are held back as well until the
    request finishes: the engine cuts the text where a stop string starts, and a
    streamed prefix of the stop string could not be taken back.
    """

    def __init__(self, tokenizer: Tokenizer, holdback: int = 0):
        self._backend = tokenizer.hf.backend_tokenizer
        self._stream = DecodeStream(skip_special_tokens=True)
        self.holdback = holdback
        self.text = ""
        self.sent = 0  # characters of `text` already emitted

    def push(self, new_ids: list[int]) -> str:
        for token_id in new_ids:
            self.text += self._stream.step(self._backend, token_id) or ""
        return self._emit(len(self.text) - self.holdback)

    def finish(self, final_text: str) -> str:
        """The rest of the engine's final text (which honours stop strings)."""
        self.text = final_text
        return self._emit(len(final_text))

    def _emit(self, upto: int) -> str:
        if upto <= self.sent:
            return ""
        delta, self.sent = self.text[self.sent:upto], upto
        return delta
