"""A streamed reply: the choices' engine streams merged into OpenAI's server-sent chunks, through
the output guardrail, with log-probabilities and tool calls as OpenAI streams them.

Each choice's text passes the guardrail's stream gate first (nothing it blocks leaves), then,
when tools are offered, the tool-call reader (tool_calls.py): text goes out as content as soon
as it cannot start a call, and each call goes out as deltas once it is complete.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import Callable

from lmfoundry.platform.log import get_logger
from lmfoundry.serving.engine import GenerationFailed
from lmfoundry.serving.responses import TokenText, chat_logprobs, completion_logprobs, sse, tool_call_deltas
from lmfoundry.serving.tool_calls import ToolCallStream

logger = get_logger(__name__)
DONE = "data: [DONE]\n\n"


async def stream_events(
    streams: list,
    firsts: list,
    req,
    chat: bool,
    tools: list[dict],
    prompts: list,
    token_text: TokenText,
    model_name: str,
    version: str,
    prompt_tokens: int,
    new_gate: Callable,
    passed: Callable,
    finished: Callable[[list[str], int, str], None],
    abandoned: Callable[[], None],
):
    """`prompts[i]` is choice i's prompt (text, ids); `new_gate()` a guardrail gate per choice and
    `passed(gate, text, last)` the text it lets out (None: blocked); `finished(finish reasons,
    completion tokens, id)` is called once every choice has ended, `abandoned()` instead when the
    stream ends before that (the client went away)."""
    rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
    head = {
        "id": rid,
        "object": "chat.completion.chunk" if chat else "text_completion",
        "created": int(time.time()),
        "model": model_name,
        "system_fingerprint": version,
    }
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    want_logprobs = (req.logprobs if chat else req.logprobs is not None) or False
    echo = not chat and req.echo
    completion = [0] * len(streams)
    finishes = ["error"] * len(streams)  # until a choice's last event says otherwise
    forced = chat and req.forced_tool()[0]
    names = [t["name"] for t in tools]
    readers = [ToolCallStream(names, forced, req.parallel_tool_calls) if names else None for _ in streams]
    calls = [0] * len(streams)  # tool calls sent, per choice
    offsets = [0 if echo else len(p.text) for p in prompts]  # completions' text_offset, per choice

    def choice(index: int, body: dict, finish: str | None, logprobs=None) -> str:
        entry = {"index": index, **body, "finish_reason": finish}
        if want_logprobs:
            entry["logprobs"] = logprobs
        return sse({**head, "choices": [entry]})

    def completion_chunk(index: int, text: str, entries: list, finish: str | None, first_token=None) -> str:
        logprobs = None
        if want_logprobs:
            shaped = completion_logprobs(entries, token_text, offsets[index], first_token)
            offsets[index] += sum(len(t) for t in shaped.tokens)
            logprobs = shaped.model_dump()
        return choice(index, {"text": text}, finish, logprobs)

    def chat_chunks(index: int, text: str, entries: list, finish: str | None):
        logprobs = chat_logprobs(entries, token_text).model_dump() if want_logprobs else None
        reader = readers[index]
        if reader is None:
            if text or finish or (want_logprobs and entries):
                yield choice(index, {"delta": {"content": text} if text else {}}, finish, logprobs)
            return
        events = reader.feed(text)
        if finish is not None and finish != "content_filter":
            events += reader.finish()
        for event in events:
            if isinstance(event, str):
                if not event:
                    continue
                delta = {"content": event}
            else:
                opening, arguments = tool_call_deltas(event, calls[index])
                yield choice(index, {"delta": {"tool_calls": [opening]}}, None, logprobs)
                logprobs = None
                delta = {"tool_calls": [arguments]}
                calls[index] += 1
            yield choice(index, {"delta": delta}, None, logprobs)
            logprobs = None
        if logprobs and logprobs["content"]:  # tokens that are still held back: their scores go now
            yield choice(index, {"delta": {}}, None, logprobs)
        if finish is not None:
            if calls[index] and finish != "content_filter":
                finish = "tool_calls"
            yield choice(index, {"delta": {}}, finish)

    reported = False
    try:
        merged: asyncio.Queue = asyncio.Queue()

        async def pump(index: int, stream, first) -> None:
            gate, delta = new_gate(), first
            try:
                while True:
                    completion[index] = delta.completion_tokens
                    last = delta.finish_reason is not None
                    text = passed(gate, delta.text, last)
                    if text is None:  # blocked: nothing of this text leaves, the choice ends
                        stream.cancel()
                        await merged.put((index, "", [], "content_filter"))
                        return
                    await merged.put((index, text, delta.logprobs, delta.finish_reason))
                    if last:
                        return
                    delta = await stream.next_delta()
            except GenerationFailed as e:  # headers are sent: the stream says so and ends this choice
                logger.error("stream choice %d failed: %s", index, e)
                await merged.put((index, e, [], None))

        for index, stream in enumerate(streams):
            if chat:
                yield choice(index, {"delta": {"role": "assistant", "content": ""}}, None)
            elif echo:  # the prompt first, scored when log-probabilities are asked for
                p = prompts[index]
                yield completion_chunk(index, p.text, stream.request.prompt_logprobs, None, p.ids[0])
        tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
        done = 0
        while done < len(streams):
            index, text, entries, finish = await merged.get()
            if isinstance(text, GenerationFailed):
                yield sse(
                    {
                        "error": {
                            "message": f"choice {index}: {text}",
                            "type": "api_error",
                            "param": None,
                            "code": "generation_failed",
                        }
                    }
                )
                done += 1
                continue
            if chat:
                for chunk in chat_chunks(index, text, entries, finish):
                    yield chunk
            elif text or finish or (want_logprobs and entries):
                yield completion_chunk(index, text, entries, finish)
            if finish is not None:
                finishes[index] = finish
            done += finish is not None
        await asyncio.gather(*tasks)
        total = sum(completion)
        reported = True
        finished(finishes, total, rid)
        if include_usage:
            usage = {"prompt_tokens": prompt_tokens, "completion_tokens": total, "total_tokens": prompt_tokens + total}
            yield sse({**head, "choices": [], "usage": usage})
        yield DONE
    finally:  # also when the client goes away mid-stream: free the batch slots
        for s in streams:
            s.cancel()
        if not reported:
            abandoned()
