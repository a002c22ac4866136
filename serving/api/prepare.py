"""From a validated request body to engine requests: prompts as token ids and
`SamplingParams`, with every check that depends on the served model (context
length, vocabulary, `max_logprobs`, what its chat template renders) or on the
server's options (parsers, sampling defaults) raising an `APIError` that names the
field. Nothing reaches the backend unless all of a request's prompts pass, so
a bad request never disturbs the others.
"""

import json
from dataclasses import dataclass, field, replace

from serving.api.chat_output import ChatParsing
from serving.api.errors import APIError
from serving.api.protocol import (ChatCompletionRequest, ChatMessage, CompletionRequest,
                                  unicode_text)
from serving.api.text import Tokenizer
from serving.engine import SamplingParams

# Options of OpenAI's or vLLM's API that the engine does not implement, with
# their no-op values: a request is refused only when it asks for an effect (an unset
# option, null, is none). Other unknown fields are ignored, as vLLM ignores them.
UNSUPPORTED = {"presence_penalty": (0,), "frequency_penalty": (0,), "repetition_penalty": (1,),
               "logit_bias": ({},), "best_of": (1,), "suffix": ("",), "prompt_logprobs": (),
               "min_tokens": (0,), "bad_words": ([],), "allowed_token_ids": (),
               "response_format": ({"type": "text"},), "functions": (), "function_call": (),
               "guided_json": (), "guided_regex": (), "guided_choice": (), "guided_grammar": (),
               "structured_outputs": (), "use_beam_search": (False,), "length_penalty": (1,),
               "skip_special_tokens": (True,), "spaces_between_special_tokens": (True,),
               "truncate_prompt_tokens": (), "return_tokens_as_token_ids": (False,),
               "logits_processors": (), "chat_template": (), "echo": (False,),
               "add_generation_prompt": (True,), "continue_final_message": (False,),
               "documents": ()}
# Arguments of `apply_chat_template` itself, which `chat_template_kwargs` may not set.
RESERVED_TEMPLATE_KWARGS = frozenset({
    "conversation", "messages", "tools", "documents", "chat_template", "tokenize",
    "add_generation_prompt", "continue_final_message", "return_dict", "return_tensors",
    "return_assistant_tokens_mask", "tokenizer_kwargs", "padding", "truncation",
    "max_length"})
SAMPLING_DEFAULTS = ("temperature", "top_p", "top_k", "min_p")  # read from generation_config
GREEDY_BELOW = 1e-5  # temperatures under this are greedy (vLLM's _SAMPLING_EPS)
# Temperatures over this sample uniformly anyway; the cap keeps them finite in float32.
MAX_TEMPERATURE = 1e4


@dataclass
class Prompt:
    token_ids: list[int]
    text: str | None = None  # as the client sent it (for echo), when it was text


@dataclass
class Job:
    """One engine request: choice `index` of the response."""

    index: int
    prompt: Prompt
    params: SamplingParams
    parsing: ChatParsing = field(default_factory=ChatParsing)  # how a chat reply is read


@dataclass
class Limits:
    model_name: str
    max_model_len: int
    max_logprobs: int
    vocab_size: int


@dataclass(frozen=True)
class ServerOptions:
    """The server's options for reading requests and writing replies (vLLM's flags)."""
    reasoning_parser: str | None = None  # --reasoning-parser (qwen3)
    tool_call_parser: str | None = None  # --tool-call-parser (hermes, qwen3_coder)
    auto_tool_choice: bool = False  # --enable-auto-tool-choice
    sampling_defaults: dict = field(default_factory=dict)  # from generation_config.json
    stream_interval: int = 1  # --stream-interval: tokens per streamed event


def check_supported(body) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and value not in UNSUPPORTED[name]:
            raise APIError(f"{name}: not supported by this server", name)
    if body.stream_options is not None and not body.stream:
        raise APIError("stream_options: only with stream", "stream_options")
    chat = isinstance(body, ChatCompletionRequest)
    if chat and body.top_logprobs is not None and not body.logprobs:
        raise APIError("top_logprobs: only with logprobs", "top_logprobs")
    if not chat and body.echo and body.logprobs is not None:
        # OpenAI's answer lists the echoed prompt's tokens with their logprobs too
        raise APIError("echo: not supported with logprobs (the prompt's logprobs are not "
                       "computed by this server)", "echo")


def check_model(model: str | None, limits: Limits) -> None:
    if model is not None and model != limits.model_name:
        raise APIError(f"model: the model `{model}` does not exist; this server serves "
                       f"`{limits.model_name}`", "model")


def completion_prompts(body: CompletionRequest, tok: Tokenizer) -> list[Prompt]:
    p = body.prompt
    if isinstance(p, str):
        prompts = [Prompt(tok.encode(p), p)]
    elif p and all(isinstance(x, str) for x in p):
        prompts = [Prompt(tok.encode(x), x) for x in p]
    elif p and all(isinstance(x, int) for x in p):
        prompts = [Prompt(list(p))]
    else:
        prompts = [Prompt(list(x)) for x in p]
    if not prompts or any(not x.token_ids for x in prompts):
        raise APIError("prompt: must not be empty", "prompt")
    return prompts


def chat_prompt(body: ChatCompletionRequest, tok: Tokenizer,
                options: ServerOptions) -> tuple[Prompt, ChatParsing]:
    """The prompt of a chat request, and how its reply is to be read."""
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []]
    by_name = {t["function"]["name"]: t["function"] for t in tools}
    if len(by_name) < len(tools):
        raise APIError("tools: function names must be unique", "tools")
    tool_parser = _tool_parser(body, options)
    text = chat_text(body, tok)
    if tools and text == chat_text(body, tok, with_tools=False):
        raise APIError("tools: this model's chat template does not render tools", "tools")
    parsing = ChatParsing.of(text, options.reasoning_parser is not None, tool_parser, by_name)
    return Prompt(tok.encode(text, add_special_tokens=False)), parsing


def chat_text(body, tok: Tokenizer, with_tools: bool = True,
              add_generation_prompt: bool = True) -> str:
    """A chat body's messages (and tools, `chat_template_kwargs`) through the template:
    for /v1/chat/completions and /tokenize alike."""
    messages = [chat_message(m, i) for i, m in enumerate(body.messages)]
    tools = [t.model_dump(exclude_none=True) for t in body.tools or []] if with_tools else []
    kwargs = template_kwargs(body.chat_template_kwargs)
    try:
        text = tok.chat_text(messages, tools or None, add_generation_prompt=add_generation_prompt,
                             **kwargs)
    except Exception as e:  # noqa: BLE001 -- templates raise anything (jinja, ValueError)
        raise APIError(f"messages: cannot apply the chat template: {e}", "messages") from e
    try:  # a template's tojson may write out what the fields' checks cannot see: a tool's
        # schema, or tool-call arguments decoded from JSON escapes
        return unicode_text(text)
    except ValueError as e:
        raise APIError(f"messages: the rendered prompt is not text: {e}", "messages") from None


def template_kwargs(kwargs: dict | None) -> dict:
    bad = sorted(set(kwargs or {}) & RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise APIError(f"chat_template_kwargs: {', '.join(bad)} cannot be set here",
                       "chat_template_kwargs")
    return dict(kwargs or {})


def _tool_parser(body: ChatCompletionRequest, options: ServerOptions) -> str | None:
    """The parser that reads this reply's tool calls (None: they stay content)."""
    choice = body.tool_choice
    if choice is None:
        choice = "auto" if body.tools else "none"
    if choice == "none":
        return None
    if not body.tools:
        raise APIError("tool_choice: needs tools", "tool_choice")
    if choice != "auto":
        raise APIError("tool_choice: only \"auto\" and \"none\" are served (\"required\" and "
                       "a named function need guided decoding)", "tool_choice")
    if not (options.auto_tool_choice and options.tool_call_parser):
        raise APIError("tool_choice: \"auto\" tool choice requires --enable-auto-tool-choice "
                       "and --tool-call-parser to be set", "tool_choice")
    return options.tool_call_parser


def chat_message(m: ChatMessage, i: int) -> dict:
    out = {"role": m.role, "content": _content(m.content)}
    if m.name is not None:
        out["name"] = m.name
    if m.reasoning_content is not None:
        out["reasoning_content"] = m.reasoning_content
    if m.tool_call_id is not None:
        out["tool_call_id"] = m.tool_call_id
    if m.tool_calls:
        if m.role != "assistant":
            raise APIError(f"messages[{i}].tool_calls: only assistant messages call tools",
                           "messages")
        out["tool_calls"] = [
            {"id": c.id, "type": "function",
             "function": {"name": c.function.name,
                          "arguments": _arguments(c.function.arguments, f"messages[{i}]")}}
            for c in m.tool_calls]
    return out


def _arguments(text: str, where: str) -> dict:
    """A tool call's arguments as the template renders them: a JSON object."""
    try:
        args = json.loads(text)
    except json.JSONDecodeError as e:
        raise APIError(f"{where}.tool_calls: arguments are not JSON: {e}", "messages") from e
    if not isinstance(args, dict):
        raise APIError(f"{where}.tool_calls: arguments must be a JSON object", "messages")
    return args


def _content(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(part.text for part in content)


def check_prompt(prompt: Prompt, limits: Limits, field: str) -> None:
    n = len(prompt.token_ids)
    bad = [t for t in prompt.token_ids if t >= limits.vocab_size]
    if bad:
        raise APIError(f"{field}: token id {bad[0]} is outside the vocabulary "
                       f"(size {limits.vocab_size})", field)
    if n >= limits.max_model_len:
        raise APIError(f"{field}: this model's maximum context length is "
                       f"{limits.max_model_len} tokens, the prompt has {n} tokens and leaves "
                       f"no room for output", field)


def sampling_params(body, *, max_tokens: int, logprobs: int | None, limits: Limits,
                    defaults: dict) -> SamplingParams:
    """`defaults`: the checkpoint's sampling defaults, for the fields a request leaves
    unset (vLLM's `--generation-config auto`)."""
    if logprobs is not None and logprobs > limits.max_logprobs:
        field = "top_logprobs" if isinstance(body, ChatCompletionRequest) else "logprobs"
        raise APIError(f"{field}: at most {limits.max_logprobs} are served, got {logprobs}",
                       field)
    stop = [body.stop] if isinstance(body.stop, str) else list(body.stop or [])
    if any(not s for s in stop):
        raise APIError("stop: stop strings must not be empty", "stop")
    stop_ids = list(body.stop_token_ids or [])
    if any(t >= limits.vocab_size for t in stop_ids):
        raise APIError(f"stop_token_ids: ids must be below the vocabulary size "
                       f"{limits.vocab_size}", "stop_token_ids")
    def given(name, fallback):
        value = getattr(body, name)
        return defaults.get(name, fallback) if value is None else value

    temperature = given("temperature", 1.0)
    top_k = given("top_k", 0) or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else min(temperature, MAX_TEMPERATURE),
            top_k=min(top_k, limits.vocab_size) if top_k > 0 else 0,
            top_p=given("top_p", 1.0),
            min_p=given("min_p", 0.0),
            seed=None if body.seed is None else body.seed % 2**32,
            stop=stop, stop_token_ids=stop_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logprobs=logprobs)
    except ValueError as e:  # SamplingParams' own checks; each message starts with the field
        raise APIError(str(e), str(e).split(" ", 1)[0].rstrip(":")) from e


def check_length(prompt: Prompt, max_tokens: int, limits: Limits, field: str) -> None:
    n = len(prompt.token_ids)
    if n + max_tokens > limits.max_model_len:
        raise APIError(f"{field}: this model's maximum context length is "
                       f"{limits.max_model_len} tokens; the prompt has {n} and {field} asks "
                       f"for {max_tokens} more", field)


def jobs(prompts: list[Prompt], n: int, params: list[SamplingParams]) -> list[Job]:
    """`n` choices per prompt (``params[i]`` for prompt i), indexed like vLLM (prompt i,
    sample j -> i*n + j). With a seed, sample j uses seed + j, so the choices differ yet
    repeat."""
    out = []
    for i, (prompt, params) in enumerate(zip(prompts, params, strict=True)):
        for j in range(n):
            seed = None if params.seed is None else (params.seed + j) % 2**32
            out.append(Job(i * n + j, prompt, replace(params, seed=seed)))
    return out


def completion_jobs(body: CompletionRequest, tok: Tokenizer, limits: Limits,
                    options: ServerOptions) -> list[Job]:
    check_supported(body)
    check_model(body.model, limits)
    prompts = completion_prompts(body, tok)
    params = []
    for prompt in prompts:
        check_prompt(prompt, limits, "prompt")
        # absent: OpenAI's 16; null: the rest of the prompt's context, as in vLLM
        max_tokens = (limits.max_model_len - len(prompt.token_ids) if body.max_tokens is None
                      else body.max_tokens)
        check_length(prompt, max_tokens, limits, "max_tokens")
        params.append(sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs,
                                      limits=limits, defaults=options.sampling_defaults))
    return jobs(prompts, body.n, params)


def chat_jobs(body: ChatCompletionRequest, tok: Tokenizer, limits: Limits,
              options: ServerOptions) -> list[Job]:
    check_supported(body)
    check_model(body.model, limits)
    prompt, parsing = chat_prompt(body, tok, options)
    check_prompt(prompt, limits, "messages")
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = limits.max_model_len - len(prompt.token_ids)
    check_length(prompt, max_tokens, limits, field)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, limits=limits,
                             defaults=options.sampling_defaults)
    return [replace(j, parsing=parsing) for j in jobs([prompt], body.n, [params])]
