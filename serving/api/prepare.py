"""From a validated request body to engine requests: prompts as token ids and
`SamplingParams`, with every check that depends on the served model (context
length, vocabulary, `max_logprobs`) raising an `APIError` that names the
field. Nothing reaches the backend unless all of a request's prompts pass, so
a bad request never disturbs the others.
"""

from dataclasses import dataclass, replace

from serving.api.errors import APIError
from serving.api.protocol import ChatCompletionRequest, CompletionRequest
from serving.api.text import Tokenizer
from serving.engine import SamplingParams

# Options of OpenAI's or vLLM's API that the engine does not implement, with
# their no-op values: a request is refused only when it asks for an effect.
UNSUPPORTED = {"presence_penalty": 0, "frequency_penalty": 0, "repetition_penalty": 1,
               "logit_bias": {}, "best_of": 1, "suffix": "", "prompt_logprobs": None,
               "min_tokens": 0, "bad_words": [], "allowed_token_ids": None,
               "response_format": None, "tools": [], "guided_json": None}
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


@dataclass
class Limits:
    model_name: str
    max_model_len: int
    max_logprobs: int
    vocab_size: int


def check_supported(body) -> None:
    for name, value in (body.model_extra or {}).items():
        if name in UNSUPPORTED and value is not None and value != UNSUPPORTED[name]:
            raise APIError(f"{name}: not supported by this server", name)


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


def chat_prompt(body: ChatCompletionRequest, tok: Tokenizer) -> Prompt:
    messages = [{"role": m.role, "content": _content(m.content)} for m in body.messages]
    try:
        ids = tok.chat_prompt(messages)
    except Exception as e:  # noqa: BLE001 -- templates raise anything (jinja, ValueError)
        raise APIError(f"messages: cannot apply the chat template: {e}", "messages") from e
    return Prompt(ids)


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


def sampling_params(body, *, max_tokens: int, logprobs: int | None,
                    limits: Limits) -> SamplingParams:
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
    temperature = 1.0 if body.temperature is None else body.temperature
    top_k = body.top_k or 0
    try:
        return SamplingParams(
            max_tokens=max_tokens,
            temperature=0.0 if temperature < GREEDY_BELOW else min(temperature, MAX_TEMPERATURE),
            top_k=min(top_k, limits.vocab_size) if top_k > 0 else 0,
            top_p=1.0 if body.top_p is None else body.top_p,
            min_p=body.min_p or 0.0,
            seed=None if body.seed is None else body.seed % 2**32,
            stop=stop, stop_token_ids=stop_ids,
            include_stop_str_in_output=body.include_stop_str_in_output,
            ignore_eos=body.ignore_eos, logprobs=logprobs)
    except ValueError as e:  # SamplingParams' own checks; the message names the field
        raise APIError(str(e)) from e


def check_length(prompt: Prompt, max_tokens: int, limits: Limits, field: str) -> None:
    n = len(prompt.token_ids)
    if n + max_tokens > limits.max_model_len:
        raise APIError(f"{field}: this model's maximum context length is "
                       f"{limits.max_model_len} tokens; the prompt has {n} and {field} asks "
                       f"for {max_tokens} more", field)


def jobs(prompts: list[Prompt], n: int, params: SamplingParams) -> list[Job]:
    """`n` choices per prompt, indexed like vLLM (prompt i, sample j -> i*n + j).
    With a seed, sample j uses seed + j, so the choices differ yet repeat."""
    out = []
    for i, prompt in enumerate(prompts):
        for j in range(n):
            seed = None if params.seed is None else (params.seed + j) % 2**32
            out.append(Job(i * n + j, prompt, replace(params, seed=seed)))
    return out


def completion_jobs(body: CompletionRequest, tok: Tokenizer, limits: Limits) -> list[Job]:
    check_supported(body)
    check_model(body.model, limits)
    prompts = completion_prompts(body, tok)
    max_tokens = body.max_tokens or 16  # null means the default, as in vLLM
    for prompt in prompts:
        check_prompt(prompt, limits, "prompt")
        check_length(prompt, max_tokens, limits, "max_tokens")
    params = sampling_params(body, max_tokens=max_tokens, logprobs=body.logprobs, limits=limits)
    return jobs(prompts, body.n, params)


def chat_jobs(body: ChatCompletionRequest, tok: Tokenizer, limits: Limits) -> list[Job]:
    check_supported(body)
    check_model(body.model, limits)
    prompt = chat_prompt(body, tok)
    check_prompt(prompt, limits, "messages")
    field = "max_completion_tokens" if body.max_completion_tokens else "max_tokens"
    max_tokens = body.max_completion_tokens or body.max_tokens
    if max_tokens is None:
        max_tokens = limits.max_model_len - len(prompt.token_ids)
    check_length(prompt, max_tokens, limits, field)
    logprobs = (body.top_logprobs or 0) if body.logprobs else None
    params = sampling_params(body, max_tokens=max_tokens, logprobs=logprobs, limits=limits)
    return jobs([prompt], body.n, params)
