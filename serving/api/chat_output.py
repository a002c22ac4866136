"""A chat reply's text split into reasoning, content and tool calls, whole or as it streams.

    --reasoning-parser qwen3      text up to ``</think>`` is ``reasoning_content``: from the
                                  reply's start when the prompt opened a ``<think>`` block
                                  (Qwen3.5's template with thinking on), else only when
                                  the reply itself starts with ``<think>``.
    --tool-call-parser P          each complete ``<tool_call>…</tool_call>`` block that
                                  parser P reads (serving/api/tool_parsers.py) is a tool
                                  call; a block it cannot read stays in the content.

`split(text, final)` parses the whole text so far. Before the reply ends (`final`
false) it leaves out what may still change meaning: an unclosed tool call block and a
tail that may be the start of a marker. So each field of an earlier split is a prefix
of the same field of a later one, and a stream sends the differences (`ChatStream`).
Tool calls are sent whole, once their block closes.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass, field

from serving.api import tool_parsers
from serving.api.protocol import DeltaMessage, DeltaToolCall, FunctionCall, ToolCall

THINK_START, THINK_END = "<think>", "</think>"


@dataclass(frozen=True)
class ChatParsing:
    """How one request's reply is read."""
    reasoning: bool = False  # a reasoning parser is on
    thinking: bool = False  # the prompt ends inside an open <think> block
    tool_parser: str | None = None  # None: tool calls are left in the content
    tools: dict[str, dict] = field(default_factory=dict)  # function definitions by name

    @property
    def plain(self) -> bool:
        """No parser is on: the whole reply is content, sent as it comes."""
        return not self.reasoning and self.tool_parser is None

    @staticmethod
    def of(prompt_text: str, reasoning: bool, tool_parser: str | None,
           tools: dict[str, dict]) -> "ChatParsing":
        opened = prompt_text.rfind(THINK_START) > prompt_text.rfind(THINK_END)
        return ChatParsing(reasoning, reasoning and opened, tool_parser, tools)


@dataclass
class Split:
    reasoning: str = ""
    content: str = ""
    calls: list[tuple[str, str]] = field(default_factory=list)  # (name, arguments)
    reasoning_seen: bool = False  # the reply has a reasoning part, maybe empty


def _partial_tail(text: str, marker: str) -> int:
    """Length of the longest end of `text` that is a proper start of `marker`."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if marker.startswith(text[-n:]):
            return n
    return 0


def split(text: str, parsing: ChatParsing, final: bool) -> Split:
    out = Split()
    rest = text
    if parsing.reasoning:
        body = None
        if parsing.thinking:
            body = text
        else:
            stripped = text.lstrip()
            if stripped.startswith(THINK_START):
                body = stripped[len(THINK_START):]
            elif not final and THINK_START.startswith(stripped):
                return out  # may still open a think block
        if body is not None:
            out.reasoning_seen = True
            end = body.find(THINK_END)
            if end < 0:
                out.reasoning = body if final else body[:len(body) - _partial_tail(body, THINK_END)]
                return out
            # the blank lines between </think> and the answer are not content
            out.reasoning, rest = body[:end], body[end + len(THINK_END):].lstrip("\n")
    if parsing.tool_parser is None:
        out.content = rest
        return out
    pos = 0
    while True:
        start = rest.find(tool_parsers.START, pos)
        if start < 0:
            tail = rest[pos:]
            out.content += tail if final else tail[:len(tail) - _partial_tail(tail, tool_parsers.START)]
            return out
        out.content += rest[pos:start]
        end = rest.find(tool_parsers.END, start)
        if end < 0:
            if final:  # an unclosed block is no call
                out.content += rest[start:]
            return out
        block = rest[start + len(tool_parsers.START):end]
        call = tool_parsers.parse_call(parsing.tool_parser, block, parsing.tools)
        if call is None:
            out.content += rest[start:end + len(tool_parsers.END)]
        else:
            out.calls.append(call)
        pos = end + len(tool_parsers.END)


def tool_call(name: str, arguments: str) -> ToolCall:
    return ToolCall(id=f"call_{uuid.uuid4().hex[:24]}",
                    function=FunctionCall(name=name, arguments=arguments))


def message_fields(text: str, parsing: ChatParsing) -> dict:
    """`AssistantMessage` fields of a finished reply."""
    s = split(text, parsing, final=True)
    content = s.content
    if s.calls and not content.strip():
        content = None  # OpenAI's shape of a reply that only calls tools
    elif s.reasoning_seen and not content:
        content = None  # vLLM's reasoning parsers: no content is None, not ""
    return dict(content=content, reasoning_content=s.reasoning or None,
                tool_calls=[tool_call(*c) for c in s.calls])


class ChatStream:
    """The deltas of one streamed reply: what each new split adds."""

    def __init__(self, parsing: ChatParsing):
        self.parsing = parsing
        self.reasoning = self.content = 0  # characters sent
        self.calls = 0

    def update(self, text: str, final: bool) -> DeltaMessage | None:
        s = split(text, self.parsing, final)
        reasoning = s.reasoning[self.reasoning:]
        content = s.content[self.content:]
        # Whitespace is held until other content follows, or the end: a reply whose
        # content is only whitespace around tool calls has none (message_fields)
        if content.strip() if not final else not (s.calls and not s.content.strip()):
            self.content = len(s.content)
        else:
            content = ""
        self.reasoning = len(s.reasoning)
        calls = [DeltaToolCall(index=i, id=c.id, function=c.function)
                 for i, c in enumerate((tool_call(*x) for x in s.calls[self.calls:]),
                                       start=self.calls)]
        self.calls = len(s.calls)
        if not (reasoning or content or calls):
            return None
        return DeltaMessage(content=content or None, reasoning_content=reasoning or None,
                            tool_calls=calls or None)
