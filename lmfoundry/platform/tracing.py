"""Where OpenTelemetry spans go: the tracing section that the agent and inference services
share, and the tracer provider it configures.

Exporters: `otlp` (OTLP over HTTP to a collector: Jaeger, Tempo, the OpenTelemetry Collector),
`jsonl` (one structured log line per span, appended to a file), or `none`.
"""

from __future__ import annotations

import os
import threading

from opentelemetry.sdk.trace.export import SpanExporter, SpanExportResult
from pydantic import Field, model_validator

from lmfoundry.platform.config import StageConfig


class TracingConfig(StageConfig):
    exporter: str = Field("none", pattern="^(none|jsonl|otlp)$")
    path: str | None = Field(None, description="jsonl: the file spans are appended to")
    endpoint: str | None = Field(None, description="otlp: the collector's traces URL, e.g. http://host:4318/v1/traces")
    service_name: str | None = Field(None, description="the service the spans name (default: the service's own)")

    @model_validator(mode="after")
    def _destination_given(self):
        if self.exporter == "jsonl" and not self.path:
            raise ValueError("tracing: exporter 'jsonl' needs 'path' (the file spans are appended to)")
        if self.exporter == "otlp" and not self.endpoint:
            raise ValueError("tracing: exporter 'otlp' needs 'endpoint' (e.g. http://collector:4318/v1/traces)")
        return self


def tracer_provider(cfg: TracingConfig, default_service: str):
    """A provider whose spans leave in batches through the configured exporter (not `none`)."""
    from opentelemetry.sdk.resources import Resource
    from opentelemetry.sdk.trace import TracerProvider
    from opentelemetry.sdk.trace.export import BatchSpanProcessor

    assert cfg.exporter != "none"
    provider = TracerProvider(resource=Resource.create({"service.name": cfg.service_name or default_service}))
    provider.add_span_processor(BatchSpanProcessor(_span_exporter(cfg)))
    return provider


def _span_exporter(cfg: TracingConfig):
    if cfg.exporter == "otlp":
        from opentelemetry.exporter.otlp.proto.http.trace_exporter import OTLPSpanExporter

        return OTLPSpanExporter(endpoint=cfg.endpoint)
    return JsonLinesExporter(cfg.path)


class JsonLinesExporter(SpanExporter):
    """Spans as structured log lines: one compact JSON object per span, a batch appended with a
    single write so that several replicas can share one file."""

    def __init__(self, path: str):
        self.path = path
        os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
        self._lock = threading.Lock()

    def export(self, spans):
        lines = "".join(span.to_json(indent=None) + "\n" for span in spans)
        with self._lock:
            fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
            try:
                os.write(fd, lines.encode())
            finally:
                os.close(fd)
        return SpanExportResult.SUCCESS
