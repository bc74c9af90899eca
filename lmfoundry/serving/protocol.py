"""The OpenAI request and response shapes that the API accepts and returns."""

from __future__ import annotations

import re
from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from lmfoundry.platform.text import check_texts
from lmfoundry.serving.sampling import LOGIT_BIAS_RANGE, MAX_LOGIT_BIAS, MAX_LOGPROBS, PENALTY_RANGE

# As OpenAI: a few short stop strings. The engine looks for each one in the text after every token.
MAX_STOP_STRINGS = 4
MAX_STOP_CHARS = 64
MAX_PROMPTS = 64  # prompts in one completions request (each is n choices in the batch)
MAX_CONTENT_PARTS = 64  # text parts of one message
# Field names that a warning header repeats: a hostile name must not become a header it cannot be.
_FIELD_NAME = re.compile(r"^[A-Za-z0-9_.-]{1,64}$")
MAX_NAMED_IGNORED = 16
# top-level fields whose null is refused rather than read as "the default"
_NULL_MEANS_NULL = frozenset({"prompt", "messages"})
# torch's generators take a 64-bit seed; each choice of a request adds its index to it.
SEED_RANGE = (-(2**63), 2**63 - 1)


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")

    include_usage: bool = False


# `json_object`: a JSON object of strings, numbers, booleans, nulls and lists of them. Any JSON
# (`{"type": "object"}`) compiles to an automaton that outlines-core builds too slowly to serve
# (past grammar.COMPILE_TIMEOUT_S even on a tiny vocabulary). Deeper structure is for `json_schema`.
_SCALAR = {"type": ["string", "number", "boolean", "null"]}
JSON_OBJECT_SCHEMA = {
    "type": "object",
    "additionalProperties": {"anyOf": [_SCALAR, {"type": "array", "items": _SCALAR}]},
}


class JsonSchemaFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str = Field(..., pattern=r"^[A-Za-z0-9_-]{1,64}$")
    description: str | None = None
    # pydantic's alias: `schema` would shadow BaseModel.schema
    schema_: dict | None = Field(None, alias="schema")
    strict: bool | None = None  # the reply is always decoded under the schema, strict or not


class ResponseFormat(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self) -> ResponseFormat:
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: json_schema is given with type 'json_schema', and only then")
        return self

    def decoding_schema(self) -> dict | None:
        """The JSON schema the reply is decoded under, or None for free text."""
        if self.type == "json_object":
            return JSON_OBJECT_SCHEMA
        if self.type == "json_schema":
            return self.json_schema.schema_ or JSON_OBJECT_SCHEMA
        return None


class _Request(BaseModel):
    # Top-level fields this server does not implement are accepted and ignored, with a warning
    # (`ignored_fields`), as vLLM does: clients send many optional fields by default. Inside
    # messages, tools and formats, unknown fields are still errors.
    model_config = ConfigDict(extra="allow")

    model: str | None = None
    max_tokens: int | None = Field(None, ge=0)
    temperature: float = Field(1.0, ge=0, le=2)
    top_p: float = Field(1.0, gt=0, le=1)
    n: int = Field(1, ge=1, le=8)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=SEED_RANGE[0], le=SEED_RANGE[1])
    presence_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    frequency_penalty: float = Field(0.0, ge=PENALTY_RANGE[0], le=PENALTY_RANGE[1])
    # token id (as a string, as OpenAI sends it) -> a bias added to its logit
    logit_bias: dict[str, Annotated[float, Field(ge=LOGIT_BIAS_RANGE[0], le=LOGIT_BIAS_RANGE[1])]] | None = Field(
        None, max_length=MAX_LOGIT_BIAS
    )
    response_format: ResponseFormat | None = None  # JSON replies by constrained decoding
    stream: bool = False
    stream_options: StreamOptions | None = None
    user: str | None = None

    @model_validator(mode="before")
    @classmethod
    def _valid_texts(cls, data):
        check_texts(data)
        if isinstance(data, dict):  # OpenAI's optional fields are nullable: null is the default
            data = {k: v for k, v in data.items() if v is not None or k in _NULL_MEANS_NULL}
        return data

    @model_validator(mode="after")
    def _check_logit_bias(self):
        for key in self.logit_bias or {}:
            if not key.isascii() or not key.isdigit() or len(key) > 9:
                raise ValueError(f"logit_bias: key {key[:32]!r} is not a token id (a non-negative integer)")
        return self

    def ignored_fields(self) -> list[str]:
        """The fields sent that this server does not implement: the first few by name (names
        that are not plain identifiers are counted, not repeated)."""
        extra = sorted(self.model_extra or {})
        named = [f for f in extra if _FIELD_NAME.match(f)][:MAX_NAMED_IGNORED]
        others = len(extra) - len(named)
        return named + ([f"{others} more"] if others else [])

    def reply_schema(self) -> dict | None:
        """The JSON schema the reply is decoded under, or None for free text."""
        return None if self.response_format is None else self.response_format.decoding_schema()

    def bias_ids(self) -> tuple[tuple[int, float], ...]:
        return tuple((int(k), v) for k, v in (self.logit_bias or {}).items())

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


TokenIds = Annotated[list[Annotated[int, Field(ge=0, lt=2**31)]], Field(min_length=1)]


class CompletionRequest(_Request):
    # a text, a list of texts, token ids, or a list of token-id lists (lm-evaluation-harness
    # sends ids); each prompt gets n choices, indexed prompt by prompt
    prompt: (
        Annotated[str, Field(min_length=1)]
        | Annotated[list[Annotated[str, Field(min_length=1)]], Field(min_length=1, max_length=MAX_PROMPTS)]
        | TokenIds
        | Annotated[list[TokenIds], Field(min_length=1, max_length=MAX_PROMPTS)]
    )
    echo: bool = False  # the prompt before the completion, with its log-probabilities under `logprobs`
    logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)

    @model_validator(mode="after")
    def _check_scoring(self) -> CompletionRequest:
        if self.max_tokens == 0 and not self.echo:
            raise ValueError("max_tokens=0 generates nothing; it is allowed with echo=true, to score the prompt")
        return self

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        return list(p)


class FunctionCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    name: str
    arguments: str  # JSON text, as OpenAI sends it


class ToolCall(BaseModel):
    model_config = ConfigDict(extra="forbid")

    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class TextPart(BaseModel):
    model_config = ConfigDict(extra="forbid")

    type: Literal["text"]
    text: str


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid")

    # `developer` is OpenAI's newer name for system instructions; the template sees `system`
    role: Literal["system", "developer", "user", "assistant", "tool"]
    # a string, or text parts (joined by newlines, as vLLM does); this server reads no images
    content: str | Annotated[list[TextPart], Field(max_length=MAX_CONTENT_PARTS)] | None = None
    name: str | None = None
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None

    @model_validator(mode="after")
    def _normalise(self) -> ChatMessage:
        if self.role == "developer":
            self.role = "system"
        if isinstance(self.content, list):
            self.content = "\n".join(part.text for part in self.content)
        return self

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


# The `reasoning` extension of chat completions (serving/reasoning.py): what one request may ask for.
REASONING_STRATEGIES = ("best_of_n", "majority", "weighted", "step_beam")
MAX_REASONING_N = 64  # samples of best_of_n, majority and weighted
MAX_BEAM_WIDTH = 8  # kept partial solutions of step_beam
MAX_BEAM_EXPAND = 8  # next steps sampled from each of them
MAX_BEAM_STEPS = 16
MAX_REASONING_BUDGET = 32_768  # generated tokens, all samples together


class Reasoning(BaseModel):
    """Spend more generated tokens for a better reply: N samples (or a step-level beam search),
    one reply chosen. Absent, a request is answered as without the extension."""

    model_config = ConfigDict(extra="forbid")

    strategy: Literal["best_of_n", "majority", "weighted", "step_beam"]
    n: int = Field(4, ge=1, le=MAX_REASONING_N, description="samples (best_of_n, majority, weighted)")
    beam_width: int = Field(2, ge=1, le=MAX_BEAM_WIDTH, description="step_beam: partial solutions kept")
    expand: int = Field(2, ge=1, le=MAX_BEAM_EXPAND, description="step_beam: next steps sampled from each")
    max_steps: int = Field(8, ge=1, le=MAX_BEAM_STEPS, description="step_beam: steps of a solution at most")
    scorer: str | None = Field(
        None, max_length=64, description="'verifier' or a served reward model; majority takes none, the others one"
    )
    budget_tokens: int = Field(
        ..., ge=1, le=MAX_REASONING_BUDGET, description="generated tokens at most, all samples together"
    )

    @model_validator(mode="after")
    def _scorer_fits_the_strategy(self) -> Reasoning:
        if self.strategy == "majority" and self.scorer is not None:
            raise ValueError("reasoning.scorer: majority voting counts answers and takes no scorer")
        if self.strategy != "majority" and self.scorer is None:
            raise ValueError(f"reasoning.scorer: {self.strategy} needs a scorer ('verifier' or a served reward model)")
        return self


class ChatCompletionRequest(_Request):
    messages: list[ChatMessage] = Field(..., min_length=1)
    max_completion_tokens: int | None = Field(None, ge=1)  # OpenAI's newer name for max_tokens
    tools: list[Tool] | None = Field(None, max_length=64)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool = True  # False: at most one call per reply
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_LOGPROBS)
    reasoning: Reasoning | None = None  # lmfoundry's extension: test-time compute (sent in extra_body)

    @model_validator(mode="after")
    def _check_lengths_and_logprobs(self) -> ChatCompletionRequest:
        if self.max_tokens == 0:
            raise ValueError("max_tokens: a chat reply needs at least 1 token")
        if self.max_completion_tokens is not None:
            if self.max_tokens is not None and self.max_tokens != self.max_completion_tokens:
                raise ValueError("max_tokens and max_completion_tokens differ; send one of them")
            self.max_tokens = self.max_completion_tokens
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs=true")
        return self

    @model_validator(mode="after")
    def _check_reasoning(self) -> ChatCompletionRequest:
        """One reply is chosen from many samples: fields that shape several replies, a stream
        or a reply's format do not combine with it."""
        if self.reasoning is None:
            return self
        clashes = {
            "n": self.n != 1,
            "stream": self.stream,
            "tools": bool(self.tools) and self.tool_choice != "none",
            "response_format": self.reply_schema() is not None,
            "logprobs": self.logprobs,
        }
        clash = next((name for name, set_ in clashes.items() if set_), None)
        if clash is not None:
            raise ValueError(f"reasoning does not combine with {clash}: it chooses one plain-text reply")
        return self

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

    def reply_schema(self) -> dict | None:
        """The response format's JSON schema; a tool call, when one is forced, takes precedence."""
        return None if self.forced_tool()[0] else super().reply_schema()

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


class CompletionLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float | None]  # None for the prompt's first token, which nothing predicts
    top_logprobs: list[dict[str, float] | None]
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: str
    logprobs: CompletionLogprobs | None = None


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


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int]


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob]


class ChatLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: str
    logprobs: ChatLogprobs | None = None


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    system_fingerprint: str | None = None  # the model version that answered
    choices: list[ChatChoice]
    usage: Usage


class ReasoningReport(BaseModel):
    strategy: str
    scorer: str | None
    samples: int  # solutions (step_beam: steps) sampled
    answer: str | None  # the reply's final answer ("Answer: ..."), when it states one
    votes: dict[str, float]  # majority and weighted: final answer -> votes or summed scores


class ReasoningChatCompletionResponse(ChatCompletionResponse):
    """A `reasoning` request's reply: usage.completion_tokens counts every token every sample
    generated, the chosen reply's and the discarded samples' alike."""

    reasoning: ReasoningReport


MAX_TOKENIZE_CHARS = 1 << 20  # text to /tokenize (the body limit usually binds first)
MAX_DETOKENIZE_TOKENS = 1 << 16


class TokenizeRequest(BaseModel):
    """As vLLM's /tokenize: a prompt, or messages rendered by the chat template."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    prompt: str | None = Field(None, max_length=MAX_TOKENIZE_CHARS)
    messages: list[ChatMessage] | None = Field(None, min_length=1, max_length=1024)
    add_special_tokens: bool = True
    add_generation_prompt: bool = True  # accepted; the chat template always opens the reply
    return_token_strs: bool = False
    user: str | None = None  # the traffic split's key, as on the other routes

    @model_validator(mode="before")
    @classmethod
    def _valid_texts(cls, data):
        check_texts(data)
        return data

    @model_validator(mode="after")
    def _one_input(self) -> TokenizeRequest:
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either prompt or messages")
        return self


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    tokens: list[Annotated[int, Field(ge=0, lt=2**31)]] = Field(..., max_length=MAX_DETOKENIZE_TOKENS)
    user: str | None = None
