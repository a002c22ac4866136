"""Tool calls in a model's output: the body of one ``<tool_call>…</tool_call>`` block
to a function name and JSON arguments, as vLLM's ``--tool-call-parser`` options read it.

    hermes       {"name": "get_weather", "arguments": {"city": "Paris"}}   (Qwen3, Hermes)
    qwen3_coder  <function=get_weather>                                   (Qwen3.5, Qwen3-Coder)
                 <parameter=city>
                 Paris
                 </parameter>
                 </function>

A ``qwen3_coder`` parameter value is text; it becomes a JSON value by the type the tool's
schema gives that parameter, as vLLM's parser reads it (``_typed``). A block that does
not parse is no tool call: the caller keeps it as content.
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
        args[pname] = _typed(raw, properties.get(pname))
    if _PARAMETER.sub("", inner).strip():  # text outside any parameter: not this format
        return None
    return name, json.dumps(args, ensure_ascii=False)


STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")


def _typed(raw: str, schema) -> object:
    """A parameter's text as the JSON value its schema names, as vLLM's Qwen3-Coder
    parser reads it: ``null`` is None; a parameter the tool does not declare, or one
    whose schema names no type, stays text; ``anyOf`` and a list of types take their
    first type but null; integers, numbers and booleans parse as such; objects and
    arrays as JSON. Text that does not parse as its type stays text."""
    if raw.strip().lower() == "null":
        return None
    if not isinstance(schema, dict):
        return raw
    kind = schema.get("type")
    if kind is None and isinstance(schema.get("anyOf"), list):
        kind = [a.get("type") for a in schema["anyOf"] if isinstance(a, dict)]
    if isinstance(kind, list):
        kind = next((k for k in kind if k not in (None, "null")), None)
    kind = str(kind or "string").strip().lower()
    if kind in STRING_TYPES:
        return raw
    text = raw.strip()
    if kind.startswith("int"):
        return int(text) if re.fullmatch(r"[+-]?\d+", text) else raw
    if kind.startswith(("num", "float")):
        try:
            value = float(text)
        except ValueError:
            return raw
        return int(value) if value.is_integer() and re.fullmatch(r"[+-]?\d+", text) else value
    if kind in ("boolean", "bool", "binary"):
        return {"true": True, "false": False}.get(text.lower(), raw)
    try:
        return json.loads(text)
    except json.JSONDecodeError:
        return raw


PARSERS = {"hermes": _hermes, "qwen3_coder": _qwen3_coder}


def parse_call(parser: str, body: str, tools: dict[str, dict]) -> tuple[str, str] | None:
    """(name, arguments as a JSON object) of one block's body, or None if it is no call.
    `tools`: the request's function definitions by name."""
    return PARSERS[parser](body.strip("\n"), tools)
