"""Tool calls in generated text, in the chat template's format: <tool_call>{"name": ...,
"arguments": {...}}</tool_call> (model/chat_template.py, the Hermes convention vLLM's `hermes`
parser reads too).

`parse_tool_calls` reads a finished reply; `ToolCallStream` reads one as it is generated,
passing text on as soon as it cannot be the start of a call and each call once it is closed.
A block that is not a call to one of the offered tools (bad JSON, an unknown name) stays text.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from lmfoundry.model.chat_template import TOOL_CALL_CLOSE, TOOL_CALL_OPEN


@dataclass
class Call:
    name: str
    arguments: dict


def read_call(body: str, tool_names: list[str]) -> Call | None:
    """The call that `body` (the JSON between the tags) is, or None."""
    try:
        call = json.loads(body)
    except (json.JSONDecodeError, RecursionError):
        return None
    if not isinstance(call, dict) or call.get("name") not in tool_names or not isinstance(call.get("arguments"), dict):
        return None
    return Call(call["name"], call["arguments"])


def parse_tool_calls(text: str, tool_names: list[str], forced: bool, parallel: bool = True) -> tuple[list[Call], str]:
    """(the calls in a finished reply, the text outside them). A forced reply is the call's JSON
    alone (the prompt opened the tag and the grammar shaped it). With `parallel` False, only the
    first call counts."""
    stream = ToolCallStream(tool_names, forced, parallel)
    events = stream.feed(text) + stream.finish()
    calls = [e for e in events if isinstance(e, Call)]
    return calls, "".join(e for e in events if isinstance(e, str))


class ToolCallStream:
    """Feed generated text; get back events in order: text (str) to pass on, and Call objects."""

    def __init__(self, tool_names: list[str], forced: bool = False, parallel: bool = True):
        self.names = tool_names
        self.parallel = parallel
        self.calls = 0
        self.inside = forced  # a forced reply starts inside a call
        self.forced = forced
        self.buffer = ""

    def feed(self, text: str) -> list[str | Call]:
        self.buffer += text
        events: list[str | Call] = []
        while True:
            if self.inside:
                end = self.buffer.find(TOOL_CALL_CLOSE)
                if end < 0 or self.forced:
                    return events  # a forced call has no closing tag: it ends with the reply
                events.append(
                    self._close(self.buffer[:end], TOOL_CALL_OPEN + self.buffer[: end + len(TOOL_CALL_CLOSE)])
                )
                self.buffer = self.buffer[end + len(TOOL_CALL_CLOSE) :]
                self.inside = False
                continue
            start = self.buffer.find(TOOL_CALL_OPEN)
            if start >= 0:
                if start:
                    events.append(self.buffer[:start])
                self.buffer = self.buffer[start + len(TOOL_CALL_OPEN) :]
                self.inside = True
                continue
            keep = _partial_tag(self.buffer)  # the start of a tag that the next text may finish
            if len(self.buffer) > keep:
                events.append(self.buffer[: len(self.buffer) - keep])
                self.buffer = self.buffer[len(self.buffer) - keep :]
            return events

    def finish(self) -> list[str | Call]:
        """What is left when the reply ends: an unclosed call (a forced one, or one cut short by
        the token limit) counts if its JSON is whole."""
        rest, self.buffer = self.buffer, ""
        if not self.inside:
            return [rest] if rest else []
        self.inside = False
        event = self._close(rest, rest if self.forced else TOOL_CALL_OPEN + rest)
        return [event] if event else []

    def _close(self, body: str, raw: str) -> str | Call:
        call = read_call(body, self.names)
        if call is None:
            return raw
        if self.calls and not self.parallel:
            return ""  # one call per reply was asked for: later ones are dropped
        self.calls += 1
        return call


def _partial_tag(text: str) -> int:
    """The length of the longest end of `text` that is a proper start of the opening tag."""
    for size in range(min(len(text), len(TOOL_CALL_OPEN) - 1), 0, -1):
        if TOOL_CALL_OPEN.startswith(text[-size:]):
            return size
    return 0
