"""The OpenAI-compatible HTTP API, as a FastAPI app served by a Ray Serve deployment.

(No `from __future__ import annotations` here: FastAPI reads the handlers' annotations at run
time, and Serve's ingress wrapper cannot resolve postponed string annotations.)

The deployment loads the engine once in __init__. A request passes, in order: the API key (its
tenant) and the body-size limit (both before FastAPI reads the body), the model name and fields, the context limit, the input
guardrail and the tenant's rate limit; then it joins the engine's continuous batch. Every
refusal is an OpenAI-shaped error object with a 4xx status (503 when the server is full), never
a 5xx for the client's mistake, and is counted in the metrics (serving/metrics.py).
"""

import asyncio
import json
import math
import time
import uuid

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.platform import gate
from lmfoundry.platform.gate import error
from lmfoundry.platform.keys import Authenticator
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracing import TracingConfig
from lmfoundry.safety.guardrails import Guardrail, StreamGate
from lmfoundry.safety.harm import HarmConfig
from lmfoundry.serving.engine import GenerationFailed, InferenceEngine, parse_tool_call
from lmfoundry.serving.grammar import GrammarBusy, SchemaRefused, check_schema, tool_call_schema
from lmfoundry.serving.metrics import ServingMetrics
from lmfoundry.serving.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    FunctionCall,
    ToolCall,
    Usage,
)
from lmfoundry.serving.scheduler import Overloaded
from lmfoundry.serving.tracing import InferenceTracer
from lmfoundry.serving.traffic import SplitSource

logger = get_logger(__name__)

# No public /docs: every route but /health needs a key, the OpenAPI schema's too (GET /openapi.json below).
app = FastAPI(
    title="lmfoundry", description="OpenAI-compatible inference", docs_url=None, redoc_url=None, openapi_url=None
)


class ApiError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        kind: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict | None = None,
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code
        self.headers = headers or {}


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)


@app.exception_handler(RequestValidationError)
async def _invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
    first = exc.errors()[0] if exc.errors() else {}
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    messages = "; ".join(
        f"{'.'.join(str(p) for p in e['loc'] if p != 'body') or 'body'}: {e['msg']}" for e in exc.errors()
    )
    return error(400, f"invalid request: {messages}", param=param)


@app.exception_handler(Exception)
async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
    return error(500, f"internal error: {type(exc).__name__}", "api_error")


@app.exception_handler(StarletteHTTPException)
async def _http_error(request: Request, exc: StarletteHTTPException) -> JSONResponse:
    kind = {
        400: "invalid_request_error",
        401: "authentication_error",
        403: "permission_error",
        404: "not_found_error",
        405: "invalid_request_error",
        413: "invalid_request_error",
    }.get(exc.status_code, "api_error")
    message = str(exc.detail)
    if exc.status_code == 400 and exc.__cause__ is not None:  # FastAPI could not parse the body: say why
        message = f"{message}: {body_problem(exc.__cause__)}"
    return error(exc.status_code, message, kind)


def body_problem(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start}); send UTF-8 JSON"
    if isinstance(cause, ValueError | RecursionError):  # e.g. an integer of thousands of digits, deep nesting
        return f"the body is not usable JSON ({cause}); send UTF-8 JSON of ordinary size and depth"
    return f"{type(cause).__name__}; send UTF-8 JSON"


app.add_middleware(gate.Gate, name="inference")


def _sse(obj: dict) -> str:
    return f"data: {json.dumps(obj)}\n\n"


def chat_choice(index: int, text: str, finish_reason: str, tools: list[dict], forced: bool) -> ChatChoice:
    """The assistant's message: a tool call when the reply is one (always, when one was forced
    and the JSON was completed), else text."""
    call = (
        parse_tool_call(text, [t["name"] for t in tools], forced)
        if tools and finish_reason != "content_filter"
        else None
    )
    if call is None:
        return ChatChoice(index=index, message=AssistantMessage(content=text), finish_reason=finish_reason)
    name, arguments, before = call
    tool_call = ToolCall(
        id=f"call_{uuid.uuid4().hex[:24]}", function=FunctionCall(name=name, arguments=json.dumps(arguments))
    )
    return ChatChoice(
        index=index,
        message=AssistantMessage(content=before or None, tool_calls=[tool_call]),
        finish_reason="tool_calls",
    )


def whole_reply_events(reply: ChatCompletionResponse, req):
    """A finished chat reply as server-sent chunks: role, content or tool calls, finish, usage."""
    head = {
        "id": reply.id,
        "object": "chat.completion.chunk",
        "created": reply.created,
        "model": reply.model,
        "system_fingerprint": reply.system_fingerprint,
    }
    for c in reply.choices:
        delta: dict = {"role": "assistant", "content": c.message.content}
        if c.message.tool_calls:
            delta["tool_calls"] = [{"index": k, **t.model_dump()} for k, t in enumerate(c.message.tool_calls)]
        yield _sse({**head, "choices": [{"index": c.index, "delta": delta, "finish_reason": None}]})
        yield _sse({**head, "choices": [{"index": c.index, "delta": {}, "finish_reason": c.finish_reason}]})
    if req.stream_options and req.stream_options.include_usage:
        yield _sse({**head, "choices": [], "usage": reply.usage.model_dump()})
    yield "data: [DONE]\n\n"


# Module-level helpers above this line: the decorator captures the module's names as they are now.
@serve.deployment(name="LLMServer")
@serve.ingress(app)
class LLMServer:
    def __init__(
        self,
        versions: list[dict],
        model_name: str,
        keys_file: str | None,
        env_key_digests: list[str],
        engine: dict,
        limits: dict,
        guardrails: dict | None,
        traffic_file: str | None = None,
        limiter=None,
        device: str = "auto",
        env_key_roles: list[str] | None = None,
        tracing: dict | None = None,
    ):
        self.engines = {v["name"]: InferenceEngine(v["checkpoint"], device, **engine) for v in versions}
        self.split = SplitSource(
            list(self.engines), {v["name"]: v["weight"] for v in versions}, traffic_file, log=logger
        )
        self.model_name = model_name
        self.max_n = limits["max_n"]
        self.timeout_s = limits["request_timeout_s"]
        gate.configure(
            "inference", Authenticator(keys_file, env_key_digests, env_roles=env_key_roles), limits["max_body_bytes"]
        )
        self.guard = Guardrail(HarmConfig.model_validate(guardrails)) if guardrails else None
        self.limiter = limiter
        self.metrics = ServingMetrics(model_name)
        self.tracer = InferenceTracer(TracingConfig.model_validate(tracing) if tracing else None, model_name)
        self.metrics.sample_engines(self.engines)

    def check_health(self) -> None:
        for version, engine in self.engines.items():
            if not engine.batcher.alive():
                raise RuntimeError(f"the continuous-batching thread of version {version!r} has stopped")

    # ---- the checks every request passes ----

    @staticmethod
    def _tenant(request: Request) -> str:
        return request.state.tenant  # set by the Gate, which refused the request if it had no valid key

    def _version(self, req) -> str:
        """The version that answers: pinned by `model: NAME:VERSION`, else by the traffic split."""
        if req.model is None or req.model == self.model_name:
            return self.split.current().pick(req.user)
        name, _, version = req.model.partition(":")
        if name == self.model_name and version in self.engines:
            return version
        available = [self.model_name] + [f"{self.model_name}:{v}" for v in self.engines]
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; available: {available}",
            "not_found_error",
            "model",
            "model_not_found",
        )

    def _check_fields(self, req) -> list[str]:
        if req.n > self.max_n:
            raise ApiError(400, f"n={req.n} is above this server's limit of {self.max_n}", param="n")
        try:
            return req.stop_strings()
        except ValueError as e:
            raise ApiError(400, str(e), param="stop") from None

    def _guard_input(self, route: str, text: str, version: str, tenant: str) -> None:
        if self.guard is None:
            return
        blocked, score = self.guard.check(text)
        if blocked:
            self.metrics.guardrail_blocks.labels(direction="input", version=version, tenant=tenant).inc()
            raise ApiError(
                400,
                f"the request was refused by the content policy: its harm score {score:.2f} is at "
                f"or above the threshold {self.guard.threshold}",
                param="messages" if route == "chat" else "prompt",
                code="content_policy_violation",
            )

    def _output_blocked(self, text: str, version: str, tenant: str) -> bool:
        if self.guard is None:
            return False
        blocked = self.guard.blocks(text)
        if blocked:
            self.metrics.guardrail_blocks.labels(direction="output", version=version, tenant=tenant).inc()
        return blocked

    def _stream_gate(self) -> StreamGate | None:
        return StreamGate(self.guard) if self.guard is not None else None

    def _passed(self, gate: StreamGate | None, text: str, last: bool, version: str, tenant: str) -> str | None:
        """The part of a stream's new text that may be sent now (the rest when `last`), or None
        when the output guardrail blocks the text so far."""
        if gate is None:
            return text
        released = gate.finish(text) if last else gate.feed(text)
        if released is None:
            self.metrics.guardrail_blocks.labels(direction="output", version=version, tenant=tenant).inc()
        return released

    async def _admit(self, tenant: str, tokens: int) -> None:
        if self.limiter is None:
            return
        wait, why = await self.limiter.admit.remote(tenant, tokens)
        if wait > 0:
            self.metrics.rate_limited.labels(tenant=tenant).inc()
            if math.isinf(wait):
                raise ApiError(429, why, "rate_limit_error", code="request_over_limit")
            raise ApiError(
                429,
                f"{why}; retry in {math.ceil(wait)} s",
                "rate_limit_error",
                code="rate_limit_exceeded",
                headers={"Retry-After": str(math.ceil(wait))},
            )

    def _refund(self, tenant: str, unused: int) -> None:
        if self.limiter is not None and unused > 0:
            self.limiter.refund.remote(tenant, unused)

    async def _in_time(self, waits, streams, tenant: str, charged: int, message: str) -> list:
        """All of `waits` within the request timeout, or a 408 that frees the streams' slots."""
        try:
            return await asyncio.wait_for(asyncio.gather(*waits), self.timeout_s)
        except asyncio.TimeoutError:
            for s in streams:
                s.cancel()
            self._refund(tenant, charged)
            raise ApiError(408, message, "timeout_error", code="request_timeout") from None

    @staticmethod
    async def _compile(engine, schema: dict) -> None:
        """The tool-call schema's automaton, built off the event loop under limits and a timeout
        (grammar.py), so that a hostile schema is a 400 and never a hung replica."""
        try:
            await engine.grammars.prepare(schema)
        except SchemaRefused as e:
            raise ApiError(400, f"tools: {e}", param="tools", code="invalid_schema") from None
        except GrammarBusy as e:
            raise ApiError(
                503, f"{e}; retry shortly", "server_overloaded", code="overloaded", headers={"Retry-After": "5"}
            ) from None

    def _start(self, engine, ids, budget, req, stop, schema):
        """One engine stream per choice, all queued at once so that they share forward passes."""
        streams = []
        try:
            for i in range(req.n):
                seed = None if req.seed is None else req.seed + i
                streams.append(engine.stream(ids, budget, req.temperature, req.top_p, stop, seed, schema))
        except (Overloaded, ValueError) as e:
            for s in streams:
                s.cancel()
            if isinstance(e, ValueError):  # a tool's parameters that are no usable JSON schema
                raise ApiError(400, f"tools: {e}", param="tools") from None
            raise ApiError(
                503,
                f"the server is at capacity ({e}); retry shortly",
                "server_overloaded",
                code="overloaded",
                headers={"Retry-After": "1"},
            ) from None
        return streams

    # ---- routes ----

    @app.get("/health")
    async def health(self) -> dict:
        return {"status": "ok"}

    @app.get("/openapi.json", include_in_schema=False)
    async def openapi_schema(self, request: Request):
        return app.openapi()

    @app.get("/metrics")
    async def metrics_text(self, request: Request):
        # admin only: the series are the whole replica's (all tenants' traffic, and tenant names)
        gate.require_role(request, "admin")
        self.metrics.key_store_failures.set(gate.authenticator("inference").reload_failures)
        for version, engine in self.engines.items():
            self.metrics.observe_engine(version, engine.batcher)
        body, content_type = self.metrics.render()
        return Response(body, media_type=content_type)

    @app.get("/v1/models")
    async def models(self, request: Request):
        context = min(e.context for e in self.engines.values())
        data = [
            {"id": self.model_name, "object": "model", "created": 0, "owned_by": "lmfoundry", "max_model_len": context}
        ]
        if len(self.engines) > 1:  # each version can be asked for by name
            data += [
                {
                    "id": f"{self.model_name}:{v}",
                    "object": "model",
                    "created": 0,
                    "owned_by": "lmfoundry",
                    "max_model_len": e.context,
                }
                for v, e in self.engines.items()
            ]
        return {"object": "list", "data": data}

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest, request: Request):
        return await self._serve("completions", request, req, lambda engine: req.prompt)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        forced, name = req.forced_tool()
        tools = req.tools_offered()
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        offered = [{"type": "function", "function": t} for t in tools]  # as transformers' templates take them

        def prompt(engine) -> str:
            return engine.chat_template.render(messages, offered, forced)

        schema = tool_call_schema(tools, name) if forced else None
        if schema is not None:  # the static limits first: before the tools are rendered and tokenized
            try:
                check_schema(schema)
            except SchemaRefused as e:
                raise ApiError(400, f"tools: {e}", param="tools", code="invalid_schema") from None
        return await self._serve("chat", request, req, prompt, tools, schema)

    async def _serve(
        self, route: str, request: Request, req, prompt, tools: list[dict] = (), schema: dict | None = None
    ):
        """`prompt(engine)` renders the request for the version that answers it."""
        started = time.perf_counter()
        status, version, refusal = 500, "none", None
        tenant = self._tenant(request)
        span = request.state.span = self.tracer.start(route, req, tenant)
        streaming = False
        try:
            version = self._version(req)
            response = await self._respond(
                route, request, req, prompt(self.engines[version]), tools, schema, started, version
            )
            status = response.status_code
            response.headers["x-lmfoundry-version"] = version
            if isinstance(response, StreamingResponse):  # the span ends with the stream
                response.body_iterator, streaming = span.until_done(response.body_iterator, version), True
            return response
        except ApiError as e:
            status, refusal = e.status, e.message
            raise
        finally:
            if not streaming:
                span.end(status, version, refusal)
            self.metrics.requests.labels(route=route, status=str(status), version=version, tenant=tenant).inc()
            self.metrics.latency.labels(route=route, version=version).observe(time.perf_counter() - started)

    async def _respond(
        self,
        route: str,
        request: Request,
        req,
        prompt: str,
        tools: list[dict],
        schema: dict | None,
        started: float,
        version: str,
    ):
        tenant = self._tenant(request)
        stop = self._check_fields(req)
        engine = self.engines[version]
        try:
            ids, budget = engine.prepare(prompt, req.max_tokens)
        except ValueError as e:
            raise ApiError(400, str(e), param="max_tokens" if "max_tokens" in str(e) else None) from None
        self._guard_input(route, prompt, version, tenant)
        charged = len(ids) + budget * req.n
        await self._admit(tenant, charged)
        try:
            if schema is not None:
                await self._compile(engine, schema)
            streams = self._start(engine, ids, budget, req, stop, schema)
        except ApiError:
            self._refund(tenant, charged)
            raise
        chat = route == "chat"
        if req.stream and not tools:  # a reply that may be a tool call is sent whole, once parsed
            return await self._stream_response(
                streams, req, chat, tenant, charged, started, version, request.state.span
            )
        outs = await self._in_time(
            [s.collect() for s in streams],
            streams,
            tenant,
            charged,
            f"the request took longer than {self.timeout_s} s (request_timeout_s)",
        )
        first = min(s.first_delta_at or time.perf_counter() for s in streams) - started
        self.metrics.time_to_first_token.labels(version=version).observe(first)
        request.state.span.first_token(first)
        for o in outs:
            if self._output_blocked(o.text, version, tenant):
                o.text, o.finish_reason = "", "content_filter"
        completion = sum(o.completion_tokens for o in outs)
        self.metrics.generated_tokens.labels(version=version, tenant=tenant).inc(completion)
        self.metrics.prompt_tokens.labels(version=version, tenant=tenant).inc(len(ids))
        self._refund(tenant, charged - len(ids) - completion)
        usage = Usage(prompt_tokens=len(ids), completion_tokens=completion, total_tokens=len(ids) + completion)
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request.state.span.answered(rid, [o.finish_reason for o in outs], len(ids), completion)
        if chat:
            reply = ChatCompletionResponse(
                id=rid,
                created=created,
                model=self.model_name,
                usage=usage,
                system_fingerprint=version,
                choices=[
                    chat_choice(i, o.text, o.finish_reason, tools, schema is not None) for i, o in enumerate(outs)
                ],
            )
            if req.stream:
                return StreamingResponse(whole_reply_events(reply, req), media_type="text/event-stream")
            return JSONResponse(reply.model_dump())
        return JSONResponse(
            CompletionResponse(
                id=rid,
                created=created,
                model=self.model_name,
                usage=usage,
                system_fingerprint=version,
                choices=[
                    CompletionChoice(index=i, text=o.text, finish_reason=o.finish_reason) for i, o in enumerate(outs)
                ],
            ).model_dump()
        )

    async def _stream_response(
        self, streams, req, chat: bool, tenant: str, charged: int, started: float, version: str, span
    ):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. The first
        delta of every choice is awaited before the response starts, so a timeout is still a 408."""
        firsts = await self._in_time(
            [s.next_delta() for s in streams],
            streams,
            tenant,
            charged,
            f"no token within {self.timeout_s} s (request_timeout_s)",
        )
        self.metrics.time_to_first_token.labels(version=version).observe(time.perf_counter() - started)
        span.first_token(time.perf_counter() - started)
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        head = {
            "id": rid,
            "object": "chat.completion.chunk" if chat else "text_completion",
            "created": int(time.time()),
            "model": self.model_name,
            "system_fingerprint": version,
        }
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        prompt_tokens = firsts[0].prompt_tokens

        def chunk(index: int, text: str, finish: str | None) -> str:
            if chat:
                return _sse(
                    {
                        **head,
                        "choices": [
                            {"index": index, "delta": {"content": text} if text else {}, "finish_reason": finish}
                        ],
                    }
                )
            return _sse({**head, "choices": [{"index": index, "text": text, "finish_reason": finish}]})

        async def events():
            completion = [0] * len(streams)
            finishes = ["error"] * len(streams)  # until a choice's last event says otherwise
            try:
                merged: asyncio.Queue = asyncio.Queue()

                async def pump(index: int, stream, first) -> None:
                    gate, delta = self._stream_gate(), first
                    try:
                        while True:
                            completion[index] = delta.completion_tokens
                            last = delta.finish_reason is not None
                            text = self._passed(gate, delta.text, last, version, tenant)
                            if text is None:  # blocked: nothing of this text leaves, the choice ends
                                stream.cancel()
                                await merged.put((index, "", "content_filter"))
                                return
                            await merged.put((index, text, delta.finish_reason))
                            if last:
                                return
                            delta = await stream.next_delta()
                    except GenerationFailed as e:  # headers are sent: the stream says so and ends this choice
                        logger.error("stream choice %d failed: %s", index, e)
                        await merged.put((index, e, None))

                if chat:
                    for index in range(len(streams)):
                        yield _sse(
                            {
                                **head,
                                "choices": [
                                    {
                                        "index": index,
                                        "delta": {"role": "assistant", "content": ""},
                                        "finish_reason": None,
                                    }
                                ],
                            }
                        )
                tasks = [asyncio.create_task(pump(i, s, f)) for i, (s, f) in enumerate(zip(streams, firsts))]
                done = 0
                while done < len(streams):
                    index, text, finish = await merged.get()
                    if isinstance(text, GenerationFailed):
                        yield _sse(
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
                    if text or finish:
                        yield chunk(index, text, finish)
                    if finish is not None:
                        finishes[index] = finish
                    done += finish is not None
                await asyncio.gather(*tasks)
                total = sum(completion)
                span.answered(rid, finishes, prompt_tokens, total)
                self.metrics.generated_tokens.labels(version=version, tenant=tenant).inc(total)
                self.metrics.prompt_tokens.labels(version=version, tenant=tenant).inc(prompt_tokens)
                self._refund(tenant, charged - prompt_tokens - total)
                if include_usage:
                    yield _sse(
                        {
                            **head,
                            "choices": [],
                            "usage": {
                                "prompt_tokens": prompt_tokens,
                                "completion_tokens": total,
                                "total_tokens": prompt_tokens + total,
                            },
                        }
                    )
                yield "data: [DONE]\n\n"
            finally:  # also when the client goes away mid-stream: free the batch slots
                for s in streams:
                    s.cancel()

        return StreamingResponse(events(), media_type="text/event-stream")
