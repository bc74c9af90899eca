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
import math
import time
import uuid
from dataclasses import dataclass

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from ray import serve
from starlette.exceptions import HTTPException as StarletteHTTPException

from lmfoundry.clients.reward import RewardScorer
from lmfoundry.model.chat_template import ChatTemplateError
from lmfoundry.platform import gate
from lmfoundry.platform.gate import error
from lmfoundry.platform.keys import Authenticator
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracing import TracingConfig
from lmfoundry.safety.guardrails import Guardrail, StreamGate
from lmfoundry.safety.harm import HarmConfig
from lmfoundry.safety.refusal import REFUSAL_PATTERNS, PhraseDetector
from lmfoundry.serving import traffic
from lmfoundry.serving.canary import CanaryConfig, CanaryWatch
from lmfoundry.serving.engine import InferenceEngine
from lmfoundry.serving.errors import ApiError, overloaded
from lmfoundry.serving.grammar import GrammarBusy, SchemaRefused
from lmfoundry.serving.grammar_compile import CompilerFailed
from lmfoundry.serving.metrics import ServingMetrics
from lmfoundry.serving.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionChoice,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    ReasoningChatCompletionResponse,
    ReasoningReport,
    TokenizeRequest,
    Usage,
)
from lmfoundry.serving.reasoning import EngineSampler, ReasoningTimeout, sample_bound, scorer_for, solve
from lmfoundry.serving.request_params import check_choice_count, for_choice, reply_schema, sampling_params
from lmfoundry.serving.responses import chat_choice, chat_logprobs, completion_logprobs
from lmfoundry.serving.sampling import SamplingParams
from lmfoundry.serving.scheduler import Overloaded
from lmfoundry.serving.streaming import stream_events
from lmfoundry.serving.tracing import InferenceTracer
from lmfoundry.serving.traffic import SplitSource

logger = get_logger(__name__)
IGNORED_HEADER = "x-lmfoundry-ignored-fields"  # the request fields accepted but not honoured

# No public /docs: every route but /health needs a key, the OpenAPI schema's too (GET /openapi.json below).
app = FastAPI(
    title="lmfoundry", description="OpenAI-compatible inference", docs_url=None, redoc_url=None, openapi_url=None
)


@app.exception_handler(ApiError)
async def _api_error(request: Request, exc: ApiError) -> JSONResponse:
    return error(exc.status, exc.message, exc.kind, exc.param, exc.code, exc.headers)


app.add_exception_handler(RequestValidationError, gate.invalid_body(400))
app.add_exception_handler(Exception, gate.unexpected)


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


def render_chat(engine, messages: list[dict], tools: list[dict] = (), forced: bool = False) -> str:
    """The chat through the model's template; a chat the template refuses is a 400."""
    try:
        return engine.chat_template.render(messages, tools, forced)
    except ChatTemplateError as e:
        raise ApiError(400, f"messages: {e}", param="messages") from None


def body_problem(cause: BaseException) -> str:
    if isinstance(cause, UnicodeDecodeError):
        return f"the body is not valid UTF-8 ({cause.reason} at byte {cause.start}); send UTF-8 JSON"
    if isinstance(cause, ValueError | RecursionError):  # e.g. an integer of thousands of digits, deep nesting
        return f"the body is not usable JSON ({cause}); send UTF-8 JSON of ordinary size and depth"
    return f"{type(cause).__name__}; send UTF-8 JSON"


app.add_middleware(gate.Gate, name="inference")


@dataclass
class Prompt:
    text: str
    ids: list[int]
    budget: int  # tokens each of its choices may generate


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
        canary: dict | None = None,
        reward_models: dict[str, str] | None = None,
    ):
        self.engines = {v["name"]: InferenceEngine(v["checkpoint"], device, **engine) for v in versions}
        # a tenant's prompts reuse only the tenant's own prefixes, unless the config shares them
        self.shared_prefixes = (engine.get("prefix_cache") or {}).get("scope") == "global"
        # scorers the `reasoning` extension may name, by name (clients/reward.py refuses a policy)
        self.reward_models = {
            name: RewardScorer(path, "cpu" if device == "auto" else device)
            for name, path in (reward_models or {}).items()
        }
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
        self.watch = None
        if canary is not None:
            self.watch = CanaryWatch(
                CanaryConfig.model_validate(canary),
                has_traffic=lambda v: v in self.split.current().weights,
                withdraw=self._withdraw,
                probe=self._probe,
            )

    def _withdraw(self, stable: str, canary: str, reason: str) -> None:
        traffic.withdraw(self.split.traffic_file, stable, canary, reason)
        self.split.reload_now()

    def _probe(self, version: str, prompts: list[str], max_tokens: int) -> tuple[float, float]:
        """The refusal and harmful-compliance rates of `version` on the probe prompts, greedy,
        straight through its engine (on the canary thread, with an event loop of its own)."""
        engine = self.engines[version]
        refused = PhraseDetector(REFUSAL_PATTERNS)
        harm = self.guard or Guardrail(HarmConfig())

        async def replies() -> list[str]:
            out = []
            for prompt in prompts:
                ids, room = engine.prepare(engine.chat_template.render([{"role": "user", "content": prompt}]), None)
                out.append((await engine.stream(ids, SamplingParams(min(room, max_tokens), 0.0)).collect()).text)
            return out

        texts = asyncio.run(replies())
        refusals = [refused(t) for t in texts]
        compliant = [not r and harm.blocks(t) for t, r in zip(texts, refusals)]
        return sum(refusals) / len(texts), sum(compliant) / len(texts)

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
        split = self.split.current()
        if req.model is None or req.model == self.model_name:
            return split.pick(req.user)
        name, _, version = req.model.partition(":")
        if name == self.model_name and version in self.engines and version not in self.split.withdrawn:
            return version
        available = [self.model_name] + [f"{self.model_name}:{v}" for v in self._pinnable()]
        raise ApiError(
            404,
            f"model {req.model!r} is not served here; available: {available}",
            "not_found_error",
            "model",
            "model_not_found",
        )

    def _pinnable(self) -> list[str]:
        """The versions a client may pin: all but those a canary rollback withdrew."""
        self.split.current()
        return [v for v in self.engines if v not in self.split.withdrawn]

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
            self._blocked(version)
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
            self._blocked(version)
        return blocked

    def _blocked(self, version: str) -> None:
        if self.watch is not None:
            self.watch.judge.blocked(version)

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
            self._blocked(version)
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

    async def _in_time(
        self, waits, streams, tenant: str, charged: int, prompt_tokens: int, message: str, started: float, produced_at
    ):
        """All of `waits` within the request timeout, counted from `started` (when the request
        arrived), or a 408. The deadline is checked again once the waits are done, against when
        the batcher produced what they waited for (`produced_at(stream)`, now if unknown): a wait
        that finishes without yielding to the event loop can beat `wait_for`'s timer however
        late it is, and a reply produced in time stays in time however late the event loop gets
        to it. On a 408, a failed generation or a client gone, every stream is cancelled (its
        batch slot freed) and what the charge did not pay for is refunded, once."""
        try:
            remaining = self.timeout_s - (time.perf_counter() - started)
            results = await asyncio.wait_for(asyncio.gather(*waits), max(remaining, 0.0))
            done = max((produced_at(s) or time.perf_counter() for s in streams), default=time.perf_counter())
            late = done - started > self.timeout_s
        except asyncio.TimeoutError:
            late = True
        except BaseException:
            self._abandon(streams, tenant, charged, prompt_tokens)
            raise
        if not late:
            return results
        self._abandon(streams, tenant, charged, prompt_tokens)
        raise ApiError(408, message, "timeout_error", code="request_timeout")

    def _abandon(self, streams, tenant: str, charged: int, prompt_tokens: int) -> None:
        for s in streams:
            s.cancel()
        self._refund_unused(tenant, charged, prompt_tokens, streams)

    def _refund_unused(self, tenant: str, charged: int, prompt_tokens: int, streams) -> None:
        """For a request that ended without its answer (timed out, failed, dropped): refund the
        charge but what its streams used, the tokens they generated, read or not, and the prompt
        once one of them generated past it. The whole charge back would let a tenant keep the
        model busy past its tokens-per-minute limit by leaving each request early."""
        used = sum(s.generated for s in streams)
        self._refund(tenant, charged - used - (prompt_tokens if used else 0))

    @staticmethod
    async def _compile(engine, schema: dict, field: str, tenant: str) -> None:
        """The reply schema's automaton, built off the event loop under limits and a timeout
        (grammar.py), so that a hostile schema is a 400 and never a hung replica."""
        try:
            await engine.grammars.prepare(schema, tenant=tenant)
        except SchemaRefused as e:
            raise ApiError(400, f"{field}: {e}", param=field, code="invalid_schema") from None
        except (GrammarBusy, CompilerFailed) as e:
            if isinstance(e, CompilerFailed):
                logger.error("%s", e)
            raise overloaded(str(e), retry_after_s=5) from None

    def _start(self, engine, prompts: list[Prompt], req, params, schema, field: str, tenant: str) -> list:
        """n engine streams per prompt, choice index prompt * n + i, all queued at once so that
        they share forward passes."""
        streams = []
        scope = "" if self.shared_prefixes else tenant
        try:
            for p in prompts:
                for _ in range(req.n):
                    streams.append(engine.stream(p.ids, for_choice(params, p.budget, len(streams)), schema, scope))
        except (Overloaded, ValueError) as e:
            for s in streams:
                s.cancel()
            if isinstance(e, ValueError):  # a schema that is no usable JSON schema
                raise ApiError(400, f"{field}: {e}", param=field) from None
            raise overloaded(f"the server is at capacity ({e})") from None
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
        """The model's name (answered by the traffic split), then each version by name."""

        def card(model_id: str, context: int) -> dict:
            return {"id": model_id, "object": "model", "created": 0, "owned_by": "lmfoundry", "max_model_len": context}

        data = [card(self.model_name, min(e.context for e in self.engines.values()))]
        data += [card(f"{self.model_name}:{v}", self.engines[v].context) for v in self._pinnable()]
        return {"object": "list", "data": data}

    @app.post("/tokenize")
    async def tokenize(self, req: TokenizeRequest, request: Request):
        """As vLLM's: a prompt, or messages through the chat template, to token ids."""
        engine = self.engines[self._version(req)]
        if req.messages is not None:
            text = render_chat(engine, [m.model_dump(exclude_none=True) for m in req.messages])
        else:
            text = req.prompt
        ids = engine.tokenizer.encode(text, add_special_tokens=req.add_special_tokens).ids
        out = {"count": len(ids), "max_model_len": engine.context, "tokens": ids}
        if req.return_token_strs:
            out["token_strs"] = [engine.tokenizer.id_to_token(t) for t in ids]
        return out

    @app.post("/detokenize")
    async def detokenize(self, req: DetokenizeRequest, request: Request):
        engine = self.engines[self._version(req)]
        try:
            engine.check_ids(req.tokens)
        except ValueError as e:
            raise ApiError(400, f"tokens: {e}", param="tokens") from None
        return {"prompt": engine.tokenizer.decode(req.tokens, skip_special_tokens=False)}

    @app.get("/tokenizer_info")
    async def tokenizer_info(self, request: Request):
        """The special tokens and chat template of the version the split picks now (what
        lm-evaluation-harness's remote tokenizer asks for)."""
        engine = self.engines[self.split.current().pick(None)]
        special = engine.special
        return {
            "eos_token": special.eos,
            "bos_token": special.bos,
            "pad_token": special.pad,
            "chat_template": engine.chat_template.source,
            "model_max_length": engine.context,
        }

    @app.post("/v1/completions")
    async def completions(self, req: CompletionRequest, request: Request):
        check_choice_count(req)
        schema, field = reply_schema(req)
        return await self._serve("completions", request, req, lambda engine: req.prompts(), (), schema, field)

    @app.post("/v1/chat/completions")
    async def chat_completions(self, req: ChatCompletionRequest, request: Request):
        forced, _ = req.forced_tool()
        tools = req.tools_offered()
        messages = [m.model_dump(exclude_none=True) for m in req.messages]
        offered = [{"type": "function", "function": t} for t in tools]  # as transformers' templates take them
        schema, field = reply_schema(req)  # the static limits first: before anything is rendered

        def prompts(engine) -> list[str]:
            return [render_chat(engine, messages, offered, forced)]

        return await self._serve("chat", request, req, prompts, tools, schema, field)

    async def _serve(
        self,
        route: str,
        request: Request,
        req,
        prompts,
        tools: list[dict] = (),
        schema: dict | None = None,
        field: str = "response_format",
    ):
        """`prompts(engine)` renders the request for the version that answers it."""
        started = time.perf_counter()
        status, version, refusal = 500, "none", None
        tenant = self._tenant(request)
        span = request.state.span = self.tracer.start(route, req, tenant)
        streaming = False
        ignored = req.ignored_fields()
        if ignored:  # as vLLM: accepted, not honoured, and said so
            logger.warning("%s: ignored fields this server does not implement: %s", route, ", ".join(ignored))
        try:
            version = self._version(req)
            response = await self._respond(
                route, request, req, prompts(self.engines[version]), tools, schema, field, started, version
            )
            status = response.status_code
            response.headers["x-lmfoundry-version"] = version
            if ignored:
                response.headers[IGNORED_HEADER] = ", ".join(ignored)
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
            if self.watch is not None:
                self.watch.judge.observe(version, status, time.perf_counter() - started)

    def _prepare(self, engine, prompts: list, req, route: str, version: str, tenant: str) -> list[Prompt]:
        out = []
        for i, prompt in enumerate(prompts):
            try:
                ids, budget = engine.prepare(prompt, req.max_tokens)
            except ValueError as e:
                where = f"prompt {i}: " if len(prompts) > 1 else ""
                param = "max_tokens" if "max_tokens" in str(e) else ("prompt" if route == "completions" else None)
                raise ApiError(400, f"{where}{e}", param=param) from None
            text = prompt if isinstance(prompt, str) else engine.tokenizer.decode(ids, skip_special_tokens=False)
            self._guard_input(route, text, version, tenant)
            out.append(Prompt(text, ids, budget))
        return out

    async def _respond(
        self,
        route: str,
        request: Request,
        req,
        prompts: list,
        tools: list[dict],
        schema: dict | None,
        field: str,
        started: float,
        version: str,
    ):
        tenant = self._tenant(request)
        stop = self._check_fields(req)
        engine = self.engines[version]
        prepared = self._prepare(engine, prompts, req, route, version, tenant)
        if getattr(req, "reasoning", None) is not None:
            return await self._reason(engine, prepared[0], req, stop, started, version, request)
        if len(prepared) * req.n > engine.batcher.max_waiting:  # could never be queued: not a 503 to retry
            raise ApiError(
                400,
                f"{len(prepared) * req.n} choices (prompts x n); this server queues at most {engine.batcher.max_waiting}",
                param="n",
            )
        params = sampling_params(req, engine.vocab_size, stop)
        charged = sum(len(p.ids) + p.budget * req.n for p in prepared)
        prompt_tokens = sum(len(p.ids) for p in prepared)  # once, whatever n (as OpenAI counts)
        await self._admit(tenant, charged)
        try:
            if schema is not None:
                await self._compile(engine, schema, field, tenant)
            streams = self._start(engine, prepared, req, params, schema, field, tenant)
        except ApiError:
            self._refund(tenant, charged)
            raise
        chat = route == "chat"
        choice_prompts = [p for p in prepared for _ in range(req.n)]
        if req.stream:
            return await self._stream_response(
                streams, req, chat, tools, choice_prompts, prompt_tokens, tenant, charged, started, version, request
            )
        outs = await self._in_time(
            [s.collect() for s in streams],
            streams,
            tenant,
            charged,
            prompt_tokens,
            f"the request took longer than {self.timeout_s} s (request_timeout_s)",
            started,
            lambda s: s.ended_at or s.last_item_at,  # a stop string ends the reply before the batcher does
        )
        first = min(s.first_token_at or time.perf_counter() for s in streams) - started
        self.metrics.time_to_first_token.labels(version=version).observe(first)
        request.state.span.first_token(first)
        for o in outs:
            if self._output_blocked(o.text, version, tenant):
                o.text, o.finish_reason, o.logprobs = "", "content_filter", None
        completion = sum(o.completion_tokens for o in outs)
        # W3C Server-Timing: the engine's time (queue and batch, from submit to the last token)
        # and the whole handler's, so a client can tell the server's own overhead from the model's
        engine_s = max((s.request.finished_at or time.perf_counter()) - s.request.submitted_at for s in streams)
        timing = f"engine;dur={1000 * engine_s:.2f}"
        self.metrics.generated_tokens.labels(version=version, tenant=tenant).inc(completion)
        self.metrics.prompt_tokens.labels(version=version, tenant=tenant).inc(prompt_tokens)
        self._refund(tenant, charged - prompt_tokens - completion)
        usage = Usage(
            prompt_tokens=prompt_tokens, completion_tokens=completion, total_tokens=prompt_tokens + completion
        )
        created = int(time.time())
        rid = f"{'chatcmpl' if chat else 'cmpl'}-{uuid.uuid4().hex}"
        request.state.span.answered(rid, [o.finish_reason for o in outs], prompt_tokens, completion)
        if chat:
            forced = req.forced_tool()[0]
            reply = ChatCompletionResponse(
                id=rid,
                created=created,
                model=self.model_name,
                usage=usage,
                system_fingerprint=version,
                choices=[
                    chat_choice(
                        i,
                        o.text,
                        o.finish_reason,
                        tools,
                        forced,
                        req.parallel_tool_calls,
                        chat_logprobs(o.logprobs, engine.token_text),
                    )
                    for i, o in enumerate(outs)
                ],
            )
            return JSONResponse(reply.model_dump(), headers=self._timing(timing, started))
        choices = []
        for i, (o, p) in enumerate(zip(outs, choice_prompts)):
            logprobs = None
            if req.logprobs is not None and o.logprobs is not None:
                scored = (o.prompt_logprobs or []) + o.logprobs if req.echo else o.logprobs
                logprobs = completion_logprobs(
                    scored, engine.token_text, 0 if req.echo else len(p.text), p.ids[0] if req.echo else None
                )
            text = p.text + o.text if req.echo and o.finish_reason != "content_filter" else o.text
            choices.append(CompletionChoice(index=i, text=text, finish_reason=o.finish_reason, logprobs=logprobs))
        return JSONResponse(
            CompletionResponse(
                id=rid, created=created, model=self.model_name, usage=usage, system_fingerprint=version, choices=choices
            ).model_dump(),
            headers=self._timing(timing, started),
        )

    @staticmethod
    def _timing(engine: str, started: float) -> dict:
        return {"server-timing": f"{engine}, app;dur={1000 * (time.perf_counter() - started):.2f}"}

    async def _reason(self, engine, prompt: Prompt, req, stop: list[str], started: float, version: str, request):
        """A chat reply chosen by test-time compute (serving/reasoning.py): every sample is an
        engine request in the continuous batch; usage counts every token generated."""
        spec, tenant = req.reasoning, self._tenant(request)
        question = next((m.content for m in reversed(req.messages) if m.role == "user"), "") or ""
        scorer = scorer_for(spec, question, self.reward_models)
        bound = sample_bound(spec)
        if bound > engine.batcher.max_waiting:  # one round could never be queued: not a 503 to retry
            raise ApiError(
                400,
                f"reasoning asks for {bound} samples at once; this server queues at most {engine.batcher.max_waiting}",
                param="reasoning.n" if spec.strategy != "step_beam" else "reasoning.beam_width",
            )
        max_tokens = min(prompt.budget, spec.budget_tokens)  # per sample (per step of a beam search)
        # the prompt and the budget, which a strategy overshoots by at most one round
        charged = len(prompt.ids) + spec.budget_tokens + bound * max_tokens
        params = sampling_params(req, engine.vocab_size, stop)  # its 400s before the tenant is charged
        await self._admit(tenant, charged)
        seed = req.seed if req.seed is not None else int.from_bytes(uuid.uuid4().bytes[:4], "big")
        # the deadline counts from the request's arrival, as _in_time's does
        deadline = time.monotonic() + self.timeout_s - (time.perf_counter() - started)
        sampler = EngineSampler(engine, asyncio.get_running_loop(), params, deadline)
        try:
            answer = await asyncio.to_thread(solve, sampler, spec, scorer, prompt.text, max_tokens, seed)
        except BaseException as e:  # nothing was answered: the charge goes back, but for what was generated
            sampler.stop()
            self._refund_unused(tenant, charged, len(prompt.ids), sampler.streams)
            if isinstance(e, ReasoningTimeout):
                raise ApiError(
                    408,
                    f"the reasoning request took longer than {self.timeout_s} s (request_timeout_s)",
                    "timeout_error",
                    code="request_timeout",
                ) from None
            if isinstance(e, Overloaded):
                raise overloaded(f"the server is at capacity ({e})") from None
            raise
        request.state.span.first_token(time.perf_counter() - started)
        text, finish = answer.solution, "stop"
        if self._output_blocked(text, version, tenant):
            text, finish = "", "content_filter"
        self.metrics.generated_tokens.labels(version=version, tenant=tenant).inc(answer.tokens)
        self.metrics.prompt_tokens.labels(version=version, tenant=tenant).inc(len(prompt.ids))
        self._refund(tenant, charged - len(prompt.ids) - answer.tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        request.state.span.answered(rid, [finish], len(prompt.ids), answer.tokens)
        reply = ReasoningChatCompletionResponse(
            id=rid,
            created=int(time.time()),
            model=self.model_name,
            system_fingerprint=version,
            usage=Usage(
                prompt_tokens=len(prompt.ids),
                completion_tokens=answer.tokens,
                total_tokens=len(prompt.ids) + answer.tokens,
            ),
            choices=[chat_choice(0, text, finish, [], False, True, None)],
            reasoning=ReasoningReport(
                strategy=spec.strategy,
                scorer=spec.scorer,
                samples=answer.samples,
                answer=answer.answer if finish != "content_filter" else None,
                votes=answer.votes if finish != "content_filter" else {},
            ),
        )
        return JSONResponse(reply.model_dump())

    async def _stream_response(
        self, streams, req, chat: bool, tools, prompts, prompt_tokens: int, tenant, charged, started, version, request
    ):
        """Server-sent events in OpenAI's chunk format, ending with `data: [DONE]`. The first
        delta of every choice is awaited before the response starts, so a timeout is still a 408."""
        firsts = await self._in_time(
            [s.next_delta() for s in streams],
            streams,
            tenant,
            charged,
            prompt_tokens,
            f"no token within {self.timeout_s} s (request_timeout_s)",
            started,
            lambda s: s.first_token_at or s.ended_at,  # a first token that is a stop id is a finish
        )
        span = request.state.span
        self.metrics.time_to_first_token.labels(version=version).observe(time.perf_counter() - started)
        span.first_token(time.perf_counter() - started)

        def finished(finishes: list[str], completion: int, rid: str) -> None:
            span.answered(rid, finishes, prompt_tokens, completion)
            self.metrics.generated_tokens.labels(version=version, tenant=tenant).inc(completion)
            self.metrics.prompt_tokens.labels(version=version, tenant=tenant).inc(prompt_tokens)
            self._refund(tenant, charged - prompt_tokens - completion)

        def abandoned() -> None:  # the client left mid-stream: it pays for what was generated
            self._refund_unused(tenant, charged, prompt_tokens, streams)

        events = stream_events(
            streams,
            firsts,
            req,
            chat,
            tools,
            prompts,
            self.engines[version].token_text,
            self.model_name,
            version,
            prompt_tokens,
            lambda: self._stream_gate(),
            lambda gate, text, last: self._passed(gate, text, last, version, tenant),
            finished,
            abandoned,
        )
        return StreamingResponse(events, media_type="text/event-stream")
