"""Agent run traces as OpenTelemetry spans.

A run is one trace: a root span `agent.run` (workflow, tenant, state, step and token totals)
with a child span per step (`agent.model`, `agent.tool`, `agent.approval`: the tool, its
arguments and output, attempts, latency, token counts, whether the output was withheld as an
injection). The spans are built from the store's durable record once a run ends, not from the
live process, so a run that moved between replicas still gives one whole trace, with the step
times the store kept.

Where the spans go is the tracing section (platform/tracing.py: OTLP, JSON lines). The same record is
queryable at any time through the run API (`GET /v1/agents/runs/{id}`: each step's seconds and
tokens).
"""

from __future__ import annotations

import json

from lmfoundry.platform.tracing import TracingConfig, tracer_provider

MAX_ATTRIBUTE_CHARS = 4000  # a span attribute is a summary; the whole output stays in the store


def _text(value) -> str:
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text[:MAX_ATTRIBUTE_CHARS]


def _ns(seconds: float) -> int:
    return round(seconds * 1e9)


def step_attributes(step: dict) -> dict:
    attrs = {"agent.step": step["n"], "agent.step.kind": step["kind"], "agent.step.status": step["status"]}
    for key in (
        "tool",
        "ok",
        "attempts",
        "refused",
        "approved",
        "by",
        "injection_flagged",
        "secret_redacted",
        "prompt_tokens",
        "completion_tokens",
        "worker",
    ):
        if step.get(key) is not None:
            attrs[f"agent.{key}"] = step[key] if isinstance(step[key], (bool, int, float, str)) else _text(step[key])
    for key in ("arguments", "output", "error"):
        if step.get(key) is not None:
            attrs[f"agent.{key}"] = _text(step[key])
    return attrs


class RunTracer:
    """Turns ended runs into spans and hands them to the configured exporter."""

    def __init__(self, cfg: TracingConfig):
        self.provider = tracer_provider(cfg, "lmfoundry-agents")
        self.tracer = self.provider.get_tracer("lmfoundry.agents.workflow")

    def export(self, run: dict) -> None:
        from opentelemetry import trace
        from opentelemetry.trace import Status, StatusCode

        steps = run["steps"]
        tokens = {k: sum(s.get(k) or 0 for s in steps) for k in ("prompt_tokens", "completion_tokens")}
        root = self.tracer.start_span(
            "agent.run",
            start_time=_ns(run["created_at"]),
            attributes={
                "agent.run_id": run["id"],
                "agent.workflow": run["workflow"],
                "agent.tenant": run["tenant"],
                "agent.state": run["state"],
                "agent.steps": len(steps),
                "agent.prompt_tokens": tokens["prompt_tokens"],
                "agent.completion_tokens": tokens["completion_tokens"],
                "agent.input": _text(run["input"]),
                **({"agent.error": _text(run["error"])} if run.get("error") else {}),
            },
        )
        context = trace.set_span_in_context(root)
        for step in steps:
            end = step["at"] + (step["seconds"] or 0.0) if step["kind"] == "tool" else step["at"]
            start = step["at"] - (step["seconds"] or 0.0) if step["kind"] == "model" else step["at"]
            span = self.tracer.start_span(
                f"agent.{step['kind']}", context=context, start_time=_ns(start), attributes=step_attributes(step)
            )
            if step.get("ok") is False:
                span.set_status(Status(StatusCode.ERROR, _text(step.get("refused") or step.get("error") or "")))
            span.end(end_time=_ns(max(end, start)))
        if run["state"] == "failed":
            root.set_status(Status(StatusCode.ERROR, _text(run.get("error") or "")))
        root.end(end_time=_ns(run["updated_at"]))
        self.provider.force_flush()  # a run's spans leave together, as soon as it has ended

    def shutdown(self) -> None:
        self.provider.shutdown()
