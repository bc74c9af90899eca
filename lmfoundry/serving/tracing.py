"""A span per inference request, with OpenTelemetry's GenAI semantic-convention attributes
(gen_ai.operation.name, gen_ai.request.*, gen_ai.response.*, gen_ai.usage.*), exported where the
serve config's `tracing` section says (platform/tracing.py: an OTLP collector, JSON lines).

A span starts when the request reaches its route and ends with the whole reply (a stream: its
last event), so its duration is what the client waited. Prompts and replies are not recorded:
they are the tenants' data, and the API's own logs keep none either.
"""

from __future__ import annotations

from opentelemetry import trace
from opentelemetry.semconv._incubating.attributes import gen_ai_attributes as gen_ai
from opentelemetry.trace import SpanKind, Status, StatusCode

from lmfoundry.platform.tracing import TracingConfig, tracer_provider

OPERATIONS = {"chat": "chat", "completions": "text_completion"}
PROVIDER = "lmfoundry"
MAX_MODEL_CHARS = 128


class InferenceTracer:
    def __init__(self, cfg: TracingConfig | None, model_name: str):
        self.model_name = model_name
        self.provider = tracer_provider(cfg, "lmfoundry-serving") if cfg and cfg.exporter != "none" else None
        self.tracer = self.provider.get_tracer("lmfoundry.serving") if self.provider else trace.NoOpTracer()

    def start(self, route: str, req, tenant: str) -> RequestSpan:
        """The request's span (a no-op one when tracing is off)."""
        operation = OPERATIONS[route]
        attributes = {
            gen_ai.GEN_AI_OPERATION_NAME: operation,
            gen_ai.GEN_AI_PROVIDER_NAME: PROVIDER,
            # the client's text, bounded: an unknown model is a 404, but its span is still written
            gen_ai.GEN_AI_REQUEST_MODEL: (req.model or self.model_name)[:MAX_MODEL_CHARS],
            gen_ai.GEN_AI_REQUEST_CHOICE_COUNT: req.n,
            gen_ai.GEN_AI_REQUEST_STREAM: bool(req.stream),
            "lmfoundry.tenant": tenant,
        }
        for key, value in (
            (gen_ai.GEN_AI_REQUEST_MAX_TOKENS, req.max_tokens),
            (gen_ai.GEN_AI_REQUEST_TEMPERATURE, req.temperature),
            (gen_ai.GEN_AI_REQUEST_TOP_P, req.top_p),
            (gen_ai.GEN_AI_REQUEST_SEED, req.seed),
        ):
            if value is not None:
                attributes[key] = value
        name = f"{operation} {self.model_name}"
        return RequestSpan(self.tracer.start_span(name, kind=SpanKind.SERVER, attributes=attributes), self.model_name)

    def shutdown(self) -> None:
        if self.provider:
            self.provider.shutdown()


class RequestSpan:
    def __init__(self, span, model_name: str):
        self.span, self.model_name = span, model_name

    def first_token(self, seconds: float) -> None:
        self.span.set_attribute(gen_ai.GEN_AI_RESPONSE_TIME_TO_FIRST_CHUNK, seconds)

    def answered(self, response_id: str, finish_reasons: list[str], input_tokens: int, output_tokens: int) -> None:
        self.span.set_attributes(
            {
                gen_ai.GEN_AI_RESPONSE_ID: response_id,
                gen_ai.GEN_AI_RESPONSE_MODEL: self.model_name,
                gen_ai.GEN_AI_RESPONSE_FINISH_REASONS: finish_reasons,
                gen_ai.GEN_AI_USAGE_INPUT_TOKENS: input_tokens,
                gen_ai.GEN_AI_USAGE_OUTPUT_TOKENS: output_tokens,
            }
        )

    def end(self, status: int, version: str, message: str | None = None) -> None:
        """With the HTTP status and the version that answered; a refusal or failure is an error."""
        self.span.set_attributes({"http.response.status_code": status, "lmfoundry.version": version})
        if status >= 400:
            self.span.set_attribute("error.type", str(status))
            self.span.set_status(Status(StatusCode.ERROR, message or ""))
        self.span.end()

    async def until_done(self, events, version: str):
        """A stream's events, the span ending after the last one (or when the client left)."""
        try:
            async for event in events:
                yield event
        finally:
            self.end(200, version)
