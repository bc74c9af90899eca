"""The OpenAI request and response shapes that the API accepts and returns."""

from __future__ import annotations

import re
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

# As OpenAI: a few short stop strings. The engine looks for each one in the text after every token.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
# torch's generators take a 64-bit seed; each choice of a request adds its index to it.
SEED_RANGE = (-(2**63), 2**63 - 1)
_UNUSABLE = re.compile("[\x00\ud800-\udfff]")


def text_problem(text: str) -> str | None:
    """What makes a string unusable as model text, or None. JSON lets a client send `\\ud800`
    (half of a UTF-16 pair, no character) and `\\u0000`; the tokenizer and the stores behind the
    API cannot take either."""
    bad = _UNUSABLE.search(text)
    if bad is None:
        return None
    if bad.group() == "\x00":
        return "contains a NUL character (\\u0000), which is not allowed in text"
    return f"contains a lone UTF-16 surrogate (\\u{ord(bad.group()):04x}); text must be valid Unicode"


def check_texts(data) -> None:
    """Raise a ValueError naming the first string (value or key) anywhere in a request body that
    `text_problem` refuses. Iterative: a body may be nested as deep as the JSON parser allows."""
    stack = [("", data)]
    while stack:
        where, item = stack.pop()
        if isinstance(item, str):
            problem = text_problem(item)
            if problem:
                raise ValueError(f"{where or 'body'}: {problem}")
        elif isinstance(item, dict):
            for key, value in item.items():
                path = f"{where}.{key}" if where else str(key)
                if isinstance(key, str) and (problem := text_problem(key)):
                    raise ValueError(f"{where or 'body'}: a key {problem}")
                stack.append((path, value))
        elif isinstance(item, list):
            stack.extend((f"{where}[{i}]", value) for i, value in enumerate(item))


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


class _Request(BaseModel):
    # Unknown fields are errors: a client asking for something unsupported hears so.
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=8)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_texts(cls, data):
        check_texts(data)
        return data

    def stop_strings(self) -> list[str]:
        if self.stop is None:
            return []
        stops = [self.stop] if isinstance(self.stop, str) else self.stop
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"stop: {len(stops)} strings; at most {MAX_STOP_STRINGS} are allowed")
        for s in stops:
            if not 1 <= len(s) <= MAX_STOP_CHARS:
                raise ValueError(
                    f"stop: a string of {len(s)} characters; each must have 1 to {MAX_STOP_CHARS} characters"
                )
        return stops


class CompletionRequest(_Request):
    prompt: str = Field(..., min_length=1)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    role: Literal["system", "user", "assistant", "tool"]
    content: str | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _check_role_fields(self) -> ChatMessage:
        if self.role in ("system", "user") and self.content is None:
            raise ValueError(f"a {self.role} message needs content")
        if self.role == "tool" and (self.content is None or not self.tool_call_id):
            raise ValueError("a tool message needs content and the tool_call_id it answers")
        if self.role == "assistant" and self.content is None and not self.tool_calls:
            raise ValueError("an assistant message needs content or tool_calls")
        if self.tool_calls and self.role != "assistant":
            raise ValueError("only assistant messages carry tool_calls")
        return self


class FunctionDefinition(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None  # a JSON schema; None: no arguments
    strict: bool | None = None  # accepted; calls are always decoded under the schema


class Tool(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: FunctionDefinition


class NamedFunction(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str


class NamedToolChoice(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["function"]
    function: NamedFunction


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None  # accepted; at most one call per reply

    @model_validator(mode="after")
    def _check_tools(self) -> ChatCompletionRequest:
        names = [t.function.name for t in self.tools or []]
        if len(set(names)) != len(names):
            raise ValueError(f"tools: function names must be unique, got {names}")
        choice = self.tool_choice
        if choice not in (None, "none") and not names:
            raise ValueError("tool_choice needs tools")
        if isinstance(choice, NamedToolChoice) and choice.function.name not in names:
            raise ValueError(f"tool_choice names {choice.function.name!r}, which is not among the tools {names}")
        return self

    def forced_tool(self) -> tuple[bool, str | None]:
        """(whether the reply must be a tool call, the tool it must call or None for any)."""
        if isinstance(self.tool_choice, NamedToolChoice):
            return True, self.tool_choice.function.name
        return self.tool_choice == "required", None

    def tools_offered(self) -> list[dict]:
        if not self.tools or self.tool_choice == "none":
            return []
        return [t.function.model_dump(exclude_none=True) for t in self.tools]


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: None = None


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # the model version that answered
    choices: list[CompletionChoice]
    usage: Usage


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    tool_calls: list[ToolCall] | None = None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # the model version that answered
    choices: list[ChatChoice]
    usage: Usage
