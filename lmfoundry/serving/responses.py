"""OpenAI response shapes from what the engine produced: choices, tool calls, log-probabilities,
and the server-sent chunks of a stream."""

from __future__ import annotations

import json
import uuid
from collections.abc import Callable

from lmfoundry.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatLogprobs,
    ChatTokenLogprob,
    CompletionLogprobs,
    FunctionCall,
    ToolCall,
    TopLogprob,
)
from lmfoundry.serving.sampling import TokenLogprob
from lmfoundry.serving.tool_calls import Call, parse_tool_calls

TokenText = Callable[[int], str]  # a token id's text (InferenceEngine.token_text)


def sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def tool_call(call: Call) -> ToolCall:
    return ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=call.name, arguments=json.dumps(call.arguments))
    )


def chat_choice(
    index: int,
    text: str,
    finish_reason: str,
    tools: list[dict],
    forced: bool,
    parallel: bool,
    logprobs: ChatLogprobs | None,
) -> ChatChoice:
    """The assistant's message: tool calls when the reply holds any (always, when one was forced
    and the JSON was completed), with the text outside them as content; else text."""
    calls, content = ([], text)
    if tools and finish_reason != "content_filter":
        calls, content = parse_tool_calls(text, [t["name"] for t in tools], forced, parallel)
    if not calls:
        return ChatChoice(
            index=index, message=AssistantMessage(content=text), finish_reason=finish_reason, logprobs=logprobs
        )
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=content or None, tool_calls=[tool_call(c) for c in calls]),
        finish_reason="tool_calls",
        logprobs=logprobs,
    )


def chat_logprobs(entries: list[TokenLogprob] | None, token_text: TokenText) -> ChatLogprobs | None:
    if entries is None:
        return None

    def top(token: int, logprob: float) -> dict:
        text = token_text(token)
        return {"token": text, "logprob": logprob, "bytes": list(text.encode())}

    return ChatLogprobs(
        content=[
            ChatTokenLogprob(**top(e.token, e.logprob), top_logprobs=[TopLogprob(**top(t, lp)) for t, lp in e.top])
            for e in entries
        ]
    )


def completion_logprobs(
    entries: list[TokenLogprob],
    token_text: TokenText,
    offset: int = 0,
    first_prompt_token: int | None = None,
    top_wanted: bool = True,
) -> CompletionLogprobs:
    """The legacy completions format. `first_prompt_token`: with echo, the prompt's first token,
    which nothing predicts (its log-probability is null, as OpenAI and vLLM give it)."""
    tokens, token_logprobs, top_logprobs = [], [], []
    if first_prompt_token is not None:
        tokens.append(token_text(first_prompt_token))
        token_logprobs.append(None)
        top_logprobs.append(None)
    for e in entries:
        tokens.append(token_text(e.token))
        token_logprobs.append(e.logprob)
        top_logprobs.append({token_text(t): lp for t, lp in e.top} if top_wanted else None)
    text_offset = []
    for token in tokens:
        text_offset.append(offset)
        offset += len(token)
    return CompletionLogprobs(
        tokens=tokens, token_logprobs=token_logprobs, top_logprobs=top_logprobs, text_offset=text_offset
    )


def tool_call_deltas(call: Call, index: int) -> list[dict]:
    """A call as OpenAI streams one: its id, type and name first, then its arguments."""
    made = tool_call(call)
    return [
        {"index": index, "id": made.id, "type": "function", "function": {"name": call.name, "arguments": ""}},
        {"index": index, "function": {"arguments": made.function.arguments}},
    ]
