"""Cluster-wide metrics through Ray's metrics API (`ray.util.metrics`).

A series is recorded in whichever process does the work (a Serve replica, an agent worker, a
training worker); each node's Ray metrics agent collects the series of every process on it and
serves them in Prometheus format, which Prometheus scrapes from every node (Ray's service
discovery file lists them) and Grafana sums over replicas and nodes. Ray prefixes every name
with `ray_`, and a counter's with `_total` as Prometheus does: `Series.exported_names` says which.

Each stage declares its series as a tuple of `Series` (serving/metrics.py, agents/metrics.py,
train/metrics.py), so that the Grafana dashboards in deploy/grafana can be checked against them.
Outside a Ray worker (a unit test, a plain script) recording is a no-op.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

LATENCY_BUCKETS = (0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120)
RAY_PREFIX = "ray_"


@dataclass(frozen=True)
class Series:
    kind: Literal["counter", "gauge", "histogram"]
    name: str
    description: str
    tags: tuple[str, ...] = ()
    buckets: tuple[float, ...] = LATENCY_BUCKETS

    def exported_names(self) -> set[str]:
        """The Prometheus series Ray's metrics agent exports for this metric."""
        base = RAY_PREFIX + self.name
        if self.kind == "counter":
            return {base + "_total"}
        if self.kind == "histogram":
            return {base + "_bucket", base + "_sum", base + "_count"}
        return {base}

    def make(self, default_tags: dict[str, str] | None = None):
        """The Ray metric; `default_tags` (a subset of `tags`) are added to every record."""
        from ray.util import metrics

        if self.kind == "counter":
            metric = metrics.Counter(self.name, self.description, self.tags)
        elif self.kind == "gauge":
            metric = metrics.Gauge(self.name, self.description, self.tags)
        else:
            metric = metrics.Histogram(self.name, self.description, list(self.buckets), self.tags)
        if default_tags:
            metric.set_default_tags(default_tags)
        return metric


def record(metric, kind: str, value: float, tags: dict[str, str]) -> None:
    """One observation: a counter's increment (zero increments are dropped: Ray refuses them), a
    gauge's value, a histogram's sample."""
    if kind == "counter":
        if value > 0:
            metric.inc(value, tags)
    elif kind == "gauge":
        metric.set(value, tags)
    else:
        metric.observe(value, tags)
