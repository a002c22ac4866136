"""Request and response bodies in the shapes of OpenAI's API, with vLLM's extras
(`top_k`, `min_p`, `ignore_eos`, `stop_token_ids`, `include_stop_str_in_output`,
`chat_template_kwargs`, `continuous_usage_stats`, `reasoning_content`, the
`/tokenize` and `/detokenize` bodies).

Range limits live here as field constraints, so that they are checked before a
request reaches the engine and appear in the OpenAPI document that clients and
the schema fuzzer read. Limits that depend on the served model (context
length, vocabulary, `max_logprobs`) are checked in app.py. Types are strict
(`"5"` is not an integer) and NaN/infinity are refused: a value that a client
got wrong is answered with 400, never quietly reinterpreted. Unknown fields are
kept (`model_extra`) so that prepare.py can refuse the OpenAI/vLLM options the
engine does not implement instead of silently ignoring them. Text must be
Unicode: a lone surrogate (JSON allows "\ud800") cannot be tokenized or
encoded as UTF-8, so it is refused where it arrives.
"""

import re
import time
from typing import Annotated, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Discriminator, Field, Tag

MAX_N = 16  # choices per prompt; each is a separate engine request
# prompts in one completion request: each is tokenized, then queued with the others, so
# a request of many thousands would tie the server up only to be refused for room
MAX_PROMPTS = 1024

TokenId = Annotated[int, Field(ge=0)]
_SURROGATE = re.compile("[\ud800-\udfff]")


def unicode_text(text: str) -> str:
    """`text`, or ValueError naming its first lone surrogate."""
    found = _SURROGATE.search(text)
    if found:
        raise ValueError(f"lone surrogate U+{ord(found.group()):04X} at character "
                         f"{found.start()}: text must be valid Unicode")
    return text


Text = Annotated[str, AfterValidator(unicode_text)]


def _prompt_kind(value) -> str:
    """Which form of ``Prompt`` a value claims, by its type and its first item: the
    value is validated against that form alone, so a long token-id prompt is read once
    and a bad one gets one error list (a plain union tries every form and lists an error
    per item of each that fails, on the server's event loop)."""
    if isinstance(value, str):
        return "text"
    if isinstance(value, list) and value and isinstance(value[0], str):
        return "texts"
    if isinstance(value, list) and value and isinstance(value[0], list):
        return "token_lists"
    return "tokens"


# A prompt: text, texts, token ids, or lists of token ids (one completion each).
Prompt = Annotated[Annotated[Text, Tag("text")]
                   | Annotated[list[Text], Field(max_length=MAX_PROMPTS), Tag("texts")]
                   | Annotated[list[TokenId], Tag("tokens")]
                   | Annotated[list[list[TokenId]], Field(max_length=MAX_PROMPTS),
                               Tag("token_lists")],
                   Discriminator(_prompt_kind)]


class _Body(BaseModel):
    model_config = ConfigDict(strict=True, allow_inf_nan=False, extra="allow")


class StreamOptions(_Body):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # usage in every chunk, as vLLM's


class _SamplingFields(_Body):
    """Fields shared by completions and chat completions."""

    model: Text | None = None
    temperature: float | None = Field(None, ge=0)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1, description="-1 or 0: off")
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2**63), le=2**64 - 1)
    stop: Text | list[Text] | None = None
    stop_token_ids: list[TokenId] | None = None
    include_stop_str_in_output: bool = False
    ignore_eos: bool = False
    n: int = Field(1, ge=1, le=MAX_N)
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: Text | None = None


class CompletionRequest(_SamplingFields):
    prompt: Prompt
    max_tokens: int | None = Field(16, ge=1)
    logprobs: int | None = Field(None, ge=0)
    echo: bool = False


class TextPart(_Body):
    type: Literal["text"]
    text: Text


FunctionName = Annotated[str, Field(min_length=1, max_length=256,
                                     pattern=r"^[^<>\s]+$")]  # no markup, no spaces


class FunctionDefinition(_Body):
    name: FunctionName
    description: Text | None = None
    parameters: dict | None = None  # a JSON Schema object
    strict: bool | None = None


class Tool(_Body):
    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(_Body):
    name: FunctionName


class NamedToolChoice(_Body):
    type: Literal["function"]
    function: NamedFunction


class FunctionCallIn(_Body):
    name: FunctionName
    arguments: Text  # a JSON object, as the API returned it


class ToolCallIn(_Body):
    """A tool call of an earlier assistant turn, sent back in the history."""
    id: Text | None = None
    type: Literal["function"] = "function"
    function: FunctionCallIn


class ChatMessage(_Body):
    role: Literal["system", "user", "assistant", "developer", "tool"]
    content: Text | list[TextPart] | None = None
    name: Text | None = None
    tool_calls: list[ToolCallIn] | None = None  # assistant turns
    tool_call_id: Text | None = None  # tool turns
    reasoning_content: Text | None = None  # assistant turns, as this server returned it


class ChatCompletionRequest(_SamplingFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1, description="default: the rest of the context")
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)
    tools: list[Tool] | None = None
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True
    chat_template_kwargs: dict | None = None


class TokenizeCompletionRequest(_Body):
    model: Text | None = None
    prompt: Text
    add_special_tokens: bool = True


class TokenizeChatRequest(_Body):
    model: Text | None = None
    messages: list[ChatMessage] = Field(min_length=1)
    add_generation_prompt: bool = True
    tools: list[Tool] | None = None
    chat_template_kwargs: dict | None = None


def _tokenize_kind(value) -> str:
    """Which body a /tokenize request is, by whether it has messages: it is validated as
    that one alone, so an error names the field the client got wrong."""
    chat = isinstance(value, TokenizeChatRequest) or isinstance(value, dict) and "messages" in value
    return "body:chat" if chat else "body:prompt"


# (a tag "body:..." names a whole body's form; errors.validation_error leaves it out of
# the path it reports)
TokenizeRequest = Annotated[Annotated[TokenizeCompletionRequest, Tag("body:prompt")]
                            | Annotated[TokenizeChatRequest, Tag("body:chat")],
                            Discriminator(_tokenize_kind)]


class DetokenizeRequest(_Body):
    model: Text | None = None
    tokens: list[TokenId]


# ---- responses ------------------------------------------------------------

class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0  # prompt tokens the prefix cache supplied


class UsageInfo(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails | None = None


class CompletionLogprobs(BaseModel):
    text_offset: list[int] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    tokens: list[str] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[CompletionChoice]
    usage: UsageInfo | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class TokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[TokenLogprob]


class FunctionCall(BaseModel):
    name: str
    arguments: str  # a JSON object


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    reasoning_content: str | None = None
    tool_calls: list[ToolCall] = Field(default_factory=list)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    choices: list[ChatChoice]
    usage: UsageInfo


class DeltaToolCall(BaseModel):
    """A whole tool call in one delta: it is sent once its block is complete."""
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class DeltaMessage(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    reasoning_content: str | None = None
    tool_calls: list[DeltaToolCall] | None = None


class ChatStreamChoice(BaseModel):
    index: int
    delta: DeltaMessage
    logprobs: ChatLogprobs | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None


class ChatCompletionChunk(BaseModel):
    """One server-sent event of a streamed chat completion."""

    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatStreamChoice]
    usage: UsageInfo | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int = Field(default_factory=lambda: int(time.time()))
    owned_by: str = "qwen35-jax"
    root: str
    max_model_len: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]


class DetokenizeResponse(BaseModel):
    prompt: str


class VersionResponse(BaseModel):
    version: str


class ErrorInfo(BaseModel):
    message: str
    type: str
    param: str | None = None
    code: int


class ErrorResponse(BaseModel):
    error: ErrorInfo
