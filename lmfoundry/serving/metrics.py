"""The serving metrics: each recorded twice, cluster-wide through Ray's metrics API (every
replica and node, summed by Prometheus and Grafana: platform/metrics.py) and in the replica's own
registry rendered at GET /metrics (the replica that answered the scrape, for a quick look
without Prometheus).

Every series carries the model name and the replica's id, so series of different replicas never
mix; the tags below say what else each is split by (the version that answered, the tenant).
"""

from __future__ import annotations

import threading
import time

from prometheus_client import (
    CONTENT_TYPE_LATEST,
    CollectorRegistry,
    Counter,
    Gauge,
    Histogram,
    disable_created_metrics,
    generate_latest,
)

from lmfoundry.platform.metrics import Series, record

disable_created_metrics()  # the *_created series double a scrape's size and say nothing here

REPLICA_TAGS = ("model", "replica")


def _series(kind, name: str, description: str, tags: tuple[str, ...] = ()) -> Series:
    return Series(kind, name, description, (*REPLICA_TAGS, *tags))


SERIES = (
    _series(
        "counter",
        "lmfoundry_requests",
        "requests answered, by route, status code, model version and tenant",
        ("route", "status", "version", "tenant"),
    ),
    _series(
        "histogram",
        "lmfoundry_request_seconds",
        "time from request to full response (streams: to first byte)",
        ("route", "version"),
    ),
    _series("histogram", "lmfoundry_time_to_first_token_seconds", "time from request to its first token", ("version",)),
    _series("counter", "lmfoundry_generated_tokens", "completion tokens generated", ("version", "tenant")),
    _series("counter", "lmfoundry_prompt_tokens", "prompt tokens of answered requests", ("version", "tenant")),
    _series(
        "counter",
        "lmfoundry_guardrail_blocks",
        "requests and replies blocked by the harm scorer",
        ("direction", "version", "tenant"),
    ),
    _series("counter", "lmfoundry_rate_limited", "requests refused with 429, by tenant", ("tenant",)),
    _series("gauge", "lmfoundry_queue_depth", "requests waiting for a batch slot", ("version",)),
    _series("gauge", "lmfoundry_running_requests", "requests in the running batch", ("version",)),
    _series(
        "gauge",
        "lmfoundry_key_store_reload_failures",
        "times the API key file could not be read or parsed (the last good keys stay in force)",
    ),
)
_PROMETHEUS = {"counter": Counter, "gauge": Gauge, "histogram": Histogram}


def replica_id() -> str:
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # outside a Serve replica (unit tests): one local registry
        return "local"


class ServingMetrics:
    def __init__(self, model: str, replica: str | None = None):
        self.registry = CollectorRegistry()
        const = {"model": model, "replica": replica or replica_id()}
        made = {s.name: _Recorded(s, self.registry, const) for s in SERIES}
        self.requests = made["lmfoundry_requests"]
        self.latency = made["lmfoundry_request_seconds"]
        self.time_to_first_token = made["lmfoundry_time_to_first_token_seconds"]
        self.generated_tokens = made["lmfoundry_generated_tokens"]
        self.prompt_tokens = made["lmfoundry_prompt_tokens"]
        self.guardrail_blocks = made["lmfoundry_guardrail_blocks"]
        self.rate_limited = made["lmfoundry_rate_limited"]
        self.queue_depth = made["lmfoundry_queue_depth"]
        self.running = made["lmfoundry_running_requests"]
        self.key_store_failures = made["lmfoundry_key_store_reload_failures"].labels()

    def observe_engine(self, version: str, batcher) -> None:
        self.queue_depth.labels(version=version).set(batcher.queue_depth)
        self.running.labels(version=version).set(batcher.running)

    def sample_engines(self, engines: dict, every_s: float = 5.0) -> None:
        """The queue gauges every `every_s` seconds, on a daemon thread: a gauge is read when
        Prometheus scrapes Ray's agent, not when a request passes."""

        def loop() -> None:
            while True:
                for version, engine in engines.items():
                    self.observe_engine(version, engine.batcher)
                time.sleep(every_s)

        threading.Thread(target=loop, name="serving-metrics", daemon=True).start()

    def render(self) -> tuple[bytes, str]:
        return generate_latest(self.registry), CONTENT_TYPE_LATEST


class _Recorded:
    """One series in both places; the model and replica tags are fixed, `.labels(...)` adds the rest."""

    def __init__(self, series: Series, registry: CollectorRegistry, const: dict):
        self.series, self.const = series, const
        kw = {"buckets": series.buckets} if series.kind == "histogram" else {}
        self.local = _PROMETHEUS[series.kind](series.name, series.description, series.tags, registry=registry, **kw)
        self.cluster = series.make(const)

    def labels(self, **tags: str) -> _Child:
        return _Child(self, self.local.labels(**self.const, **tags), tags)


class _Child:
    def __init__(self, parent: _Recorded, local, tags: dict):
        self.parent, self.local, self.tags = parent, local, tags

    def _cluster(self, value: float) -> None:
        record(self.parent.cluster, self.parent.series.kind, value, self.tags)

    def inc(self, value: float = 1.0) -> None:
        self.local.inc(value)
        self._cluster(value)

    def observe(self, value: float) -> None:
        self.local.observe(value)
        self._cluster(value)

    def set(self, value: float) -> None:
        self.local.set(value)
        self._cluster(value)
