"""Prometheus metrics of one serving replica, rendered at GET /metrics.

Each replica has its own registry (a scrape sees the replica that answered it; every series
carries the replica's id so that series from different replicas never mix).
"""

from __future__ import annotations

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

disable_created_metrics()  # the *_created series double a scrape's size and say nothing here

_LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)


class ServingMetrics:
    def __init__(self, model: str, replica: str | None = None):
        if replica is None:
            try:
                from ray import serve

                replica = serve.get_replica_context().replica_id.unique_id
            except Exception:  # outside a Serve replica (unit tests): one local registry
                replica = "local"
        self.registry = CollectorRegistry()
        const = {"model": model, "replica": replica}

        def metric(kind, name: str, doc: str, *labels: str, **kw) -> _Labelled:
            made = kind(name, doc, ["model", "replica", *labels], registry=self.registry, namespace="lmfoundry", **kw)
            return _Labelled(made, const)

        self.requests = metric(
            Counter,
            "requests",
            "requests answered, by route, status code and model version",
            "route",
            "status",
            "version",
        )
        self.latency = metric(
            Histogram,
            "request_seconds",
            "time from request to full response (streams: to first byte)",
            "route",
            "version",
            buckets=_LATENCY_BUCKETS,
        )
        self.time_to_first_token = metric(
            Histogram,
            "time_to_first_token_seconds",
            "time from request to its first token",
            "version",
            buckets=_LATENCY_BUCKETS,
        )
        self.generated_tokens = metric(Counter, "generated_tokens", "completion tokens generated", "version")
        self.guardrail_blocks = metric(
            Counter, "guardrail_blocks", "requests and replies blocked by the harm scorer", "direction"
        )
        self.rate_limited = metric(Counter, "rate_limited", "requests refused with 429, by tenant", "tenant")
        self.queue_depth = metric(Gauge, "queue_depth", "requests waiting for a batch slot", "version")
        self.running = metric(Gauge, "running_requests", "requests in the running batch", "version")
        self.key_store_failures = _Labelled(
            Gauge(
                "key_store_reload_failures",
                "times the API key file could not be read or parsed (the last good keys stay in force)",
                ["model", "replica"],
                registry=self.registry,
                namespace="lmfoundry",
            ),
            const,
        ).labels()

    def observe_engine(self, version: str, batcher) -> None:
        self.queue_depth.labels(version=version).set(batcher.queue_depth)
        self.running.labels(version=version).set(batcher.running)

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Labelled:
    """A metric whose model and replica labels are fixed: `.labels(route=...)` adds the rest."""

    def __init__(self, metric, const: dict):
        self.metric, self.const = metric, const

    def labels(self, **labels):
        return self.metric.labels(**self.const, **labels)
