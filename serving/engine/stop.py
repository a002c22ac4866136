"""Stop conditions, checked on the host after each new token (vLLM semantics:
EOS unless `ignore_eos`, stop token ids, stop strings, `max_tokens`, and the
model length limit)."""

from serving.engine.request import Request


def check_stop(req: Request, config, tokenizer) -> tuple[str | None, int | str | None]:
    """Returns (finish_reason, stop_reason) or (None, None) to continue."""
    p = req.params
    tok = req.output_token_ids[-1]
    if not p.ignore_eos and tok in config.eos_token_ids:
        return "stop", None
    if tok in p.stop_token_ids:
        return "stop", tok
    if p.stop:
        # Decoding the whole output each token is quadratic in its length, but
        # only requests with stop strings pay it and it stays correct across
        # multi-token characters; incremental detokenization can replace it.
        # A character still incomplete ("\ufffd" at the end) is not settled text: the
        # token that completes it may complete a stop string ending in it, and only
        # settled text is searched, so the placeholder itself never matches.
        seen = len(req.output_text.rstrip("\ufffd"))
        req.output_text = text = tokenizer.decode(req.output_token_ids)
        settled = text.rstrip("\ufffd")
        # the stop string that completes first wins (list order breaks ties), as text
        # arriving a character at a time would have it
        hits = [(i + len(s), k, i, s) for k, s in enumerate(p.stop)
                if (i := settled.find(s, max(0, seen - len(s) + 1))) >= 0]
        if hits:
            _, _, i, s = min(hits)
            req.output_text = text[:i + len(s)] if p.include_stop_str_in_output else text[:i]
            return "stop", s
    if len(req.output_token_ids) >= p.max_tokens or req.num_known_tokens >= config.max_model_len:
        return "length", None
    return None, None


def text_token_ids(token_ids, finish_reason, stop_reason, params):
    """The tokens a finished request's text decodes (a stop string's cut is the caller's):
    all but a stop token id that ended it, unless ``include_stop_str_in_output``, as vLLM
    leaves that token's text out (EOS is a special token, which decoding skips)."""
    if (finish_reason == "stop" and isinstance(stop_reason, int)
            and not params.include_stop_str_in_output):
        return token_ids[:-1]
    return token_ids
