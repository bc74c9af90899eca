"""The OpenAI-compatible HTTP API, as a FastAPI app served by a Ray Serve deployment.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time, and Serve's ingress wrapper cannot resolve postponed string annotations.)

The deployment loads the engine once in __init__; the handlers check the API key, validate the
body, and run generation in a worker thread so the event loop keeps accepting requests.
"""


import asyncio
import json
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.serving.auth import authorized
from lmfoundry.serving.engine import InferenceEngine, render_chat
from lmfoundry.serving.protocol import (
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    ChatMessage,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    Usage,
)

app = FastAPI(title="lmfoundry", description="OpenAI-compatible inference")


def error(status: int, message: str, kind: str = "invalid_request_error", param: str | None = None) -> JSONResponse:
    return JSONResponse(status_code=status, content={"error": {"message": message, "type": kind,
                                                                "param": param, "code": None}})


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    messages = "; ".join(f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}"
                         for e in exc.errors())
    return error(400, f"invalid request: {messages}", param=param)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error(500, f"internal error: {type(exc).__name__}", "api_error")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "api_error")
    return error(exc.status_code, str(exc.detail), kind)


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def _usage(outs) -> Usage:
    prompt = outs[0].prompt_tokens
    completion = sum(o.completion_tokens for o in outs)
    return Usage(prompt_tokens=prompt, completion_tokens=completion, total_tokens=prompt + completion)


# Module-level helpers above this line: the decorator captures the module's names as they are now.
@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer:
    def __init__(self, checkpoint: str, model_name: str, key_digests: list[str], device: str = "auto"):
        self.engine = InferenceEngine(checkpoint, device)
        self.model_name = model_name
        self.key_digests = key_digests

    def check_health(self) -> None:
        if self.engine.model is None:
            raise RuntimeError("model not loaded")

    def _unauthorized(self, request: Request) -> JSONResponse | None:
        if authorized(request.headers.get("authorization"), self.key_digests):
            return None
        return error(401, "missing or invalid API key: send 'Authorization: Bearer <key>'", "authentication_error")

    def _check_model(self, name: str | None) -> JSONResponse | None:
        if name is not None and name != self.model_name:
            return error(404, f"model {name!r} is not served here; available: [{self.model_name!r}]",
                         "not_found_error", "model")
        return None

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/v1/models")
    async def models(self, request: Request):
        if denied := self._unauthorized(request):
            return denied
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "created": 0,
                                            "owned_by": "lmfoundry", "max_model_len": self.engine.context}]}

    async def _generate(self, prompt: str, req) -> list | JSONResponse:
        try:
            stop = req.stop_strings()
            outs = []
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                outs.append(await asyncio.to_thread(self.engine.complete, prompt, req.max_tokens, req.temperature,
                                                    req.top_p, stop, seed))
            return outs
        except ValueError as e:
            return error(400, str(e))

    def _stream(self, prompt: str, req, chat: bool) -> StreamingResponse | JSONResponse:
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`."""
        try:
            stop = req.stop_strings()
            streams = [self.engine.stream(prompt, req.max_tokens, req.temperature, req.top_p, stop,
                                          None if req.seed is None else req.seed + i) for i in range(req.n)]
        except ValueError as e:  # raised before any chunk is sent, so it can still be a 400
            return error(400, str(e))
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {"id": rid, "object": "chat.completion.chunk" if chat else "text_completion",
                "created": int(time.time()), "model": self.model_name}
        include_usage = bool(req.stream_options and req.stream_options.include_usage)

        def events():
            prompt_tokens, completion_tokens = 0, 0
            for index, deltas in enumerate(streams):
                if chat:
                    yield _sse({**head, "choices": [{"index": index, "delta": {"role": "assistant", "content": ""},
                                                     "finish_reason": None}]})
                for d in deltas:
                    if d.text or d.finish_reason:
                        body = {"content": d.text} if chat else None
                        choice = ({"index": index, "delta": body if d.text else {}, "finish_reason": d.finish_reason}
                                  if chat else {"index": index, "text": d.text, "finish_reason": d.finish_reason})
                        yield _sse({**head, "choices": [choice]})
                    prompt_tokens, last_completion = d.prompt_tokens, d.completion_tokens
                completion_tokens += last_completion
            if include_usage:
                yield _sse({**head, "choices": [], "usage": {"prompt_tokens": prompt_tokens,
                                                             "completion_tokens": completion_tokens,
                                                             "total_tokens": prompt_tokens + completion_tokens}})
            yield "data: [DONE]\n\n"

        # a sync iterator: Starlette runs each step in its thread pool, off the event loop
        return StreamingResponse(events(), media_type="text/event-stream")

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest, request: Request):
        if denied := self._unauthorized(request) or self._check_model(req.model):
            return denied
        if req.stream:
            return self._stream(req.prompt, req, chat=False)
        outs = await self._generate(req.prompt, req)
        if isinstance(outs, JSONResponse):
            return outs
        return CompletionResponse(
            id=f"cmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
            choices=[CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason) for i, o in enumerate(outs)],
            usage=_usage(outs),
        )

    @app.post("/v1/chat/completions")
    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        if denied := self._unauthorized(request) or self._check_model(req.model):
            return denied
        prompt = render_chat([m.model_dump() for m in req.messages])
        if req.stream:
            return self._stream(prompt, req, chat=True)
        outs = await self._generate(prompt, req)
        if isinstance(outs, JSONResponse):
            return outs
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
            choices=[ChatChoice(index=i, message=ChatMessage(role="assistant", content=o.text),
                                finish_reason=o.finish_reason) for i, o in enumerate(outs)],
            usage=_usage(outs),
        )
