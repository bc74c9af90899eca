"""The OpenAI-compatible HTTP API, as a FastAPI app served by a Ray Serve deployment.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time, and Serve's ingress wrapper cannot resolve postponed string annotations.)

The deployment loads the engine once in __init__; the handlers check the API key, validate the
body, and run generation in a worker thread so the event loop keeps accepting requests.
"""


import asyncio
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
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


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {401: "authentication_error", 404: "not_found_error", 405: "invalid_request_error"}.get(exc.status_code, "api_error")
    return error(exc.status_code, str(exc.detail), kind)


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
        if req.stream:
            return error(400, "stream=true is not supported by this server yet; send stream=false", param="stream")
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

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest, request: Request):
        if denied := self._unauthorized(request) or self._check_model(req.model):
            return denied
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
        outs = await self._generate(prompt, req)
        if isinstance(outs, JSONResponse):
            return outs
        return ChatCompletionResponse(
            id=f"chatcmpl-{uuid.uuid4().hex}", created=int(time.time()), model=self.model_name,
            choices=[ChatChoice(index=i, message=ChatMessage(role="assistant", content=o.text),
                                finish_reason=o.finish_reason) for i, o in enumerate(outs)],
            usage=_usage(outs),
        )
