"""Tool calls in a model's output: the body of one ``<tool_call>…</tool_call>`` block
to a function name and JSON arguments, as vLLM's ``--tool-call-parser`` options read it.

    hermes       {"name": "get_weather", "arguments": {"city": "Paris"}}   (Qwen3, Hermes)
    qwen3_coder  <function=get_weather>                                   (Qwen3.5, Qwen3-Coder)
                 <parameter=city>
                 Paris
                 </parameter>
                 </function>

A ``qwen3_coder`` parameter value is text; it becomes a JSON value by the type the tool's
schema gives that parameter (a string stays text, anything else is read as JSON, and
text that is not JSON stays text), as vLLM's parser does. A block that does not parse is
no tool call: the caller keeps it as content.
"""

from __future__ import annotations

import json
import re

START, END = "<tool_call>", "</tool_call>"

_FUNCTION = re.compile(r"\s*<function=([^>\n]+)>\n?(.*?)</function>\s*", re.DOTALL)
_PARAMETER = re.compile(r"<parameter=([^>\n]+)>\n?(.*?)\n?</parameter>", re.DOTALL)


def _hermes(body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    try:
        call = json.loads(body)
    except json.JSONDecodeError:
        return None
    if not (isinstance(call, dict) and isinstance(call.get("name"), str)):
        return None
    args = call.get("arguments", call.get("parameters", {}))
    if isinstance(args, str):  # some models emit the arguments already encoded
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return call["name"], json.dumps(args, ensure_ascii=False)


def _qwen3_coder(body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    m = _FUNCTION.fullmatch(body)
    if m is None:
        return None
    name, inner = m.group(1).strip(), m.group(2)
    properties = ((tools.get(name) or {}).get("parameters") or {}).get("properties") or {}
    args = {}
    for pname, raw in _PARAMETER.findall(inner):
        pname = pname.strip()
        args[pname] = _typed(raw, (properties.get(pname) or {}).get("type"))
    if _PARAMETER.sub("", inner).strip():  # text outside any parameter: not this format
        return None
    return name, json.dumps(args, ensure_ascii=False)


def _typed(raw: str, kind) -> object:
    if kind == "string":
        return raw
    try:
        return json.loads(raw)
    except json.JSONDecodeError:
        return raw


PARSERS = {"hermes": _hermes, "qwen3_coder": _qwen3_coder}


def parse_call(parser: str, body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """(name, arguments as a JSON object) of one block's body, or None if it is no call.
    `tools`: the request's function definitions by name."""
    return PARSERS[parser](body.strip("\n"), tools)
