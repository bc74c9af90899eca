"""The agent service's metrics through Ray's metrics API (platform/metrics.py): runs started and
refused at the API, and, from the store's record of each run once it ends (as the traces are),
its outcome, duration, steps, tool latencies and tokens. Every worker replica and node adds to
the same series; Prometheus and Grafana sum them."""

from __future__ import annotations

from lmfoundry.platform.metrics import LATENCY_BUCKETS, Series, record

RUN_BUCKETS = (*LATENCY_BUCKETS, 300, 600, 1800, 3600)  # a run with approvals waits on people

SERIES = (
    Series("counter", "lmfoundry_agent_runs_started", "runs accepted by the API", ("workflow", "tenant")),
    Series(
        "counter",
        "lmfoundry_agent_runs_refused",
        "runs refused with 429: the tenant's active runs are full",
        ("tenant",),
    ),
    Series("counter", "lmfoundry_agent_runs_ended", "runs that ended, by final state", ("workflow", "tenant", "state")),
    Series(
        "histogram",
        "lmfoundry_agent_run_seconds",
        "from a run's creation to its end",
        ("workflow", "state"),
        RUN_BUCKETS,
    ),
    Series("counter", "lmfoundry_agent_steps", "steps of ended runs", ("workflow", "kind", "tool", "status")),
    Series("histogram", "lmfoundry_agent_tool_seconds", "a tool call's latency", ("workflow", "tool", "ok")),
    Series("histogram", "lmfoundry_agent_model_seconds", "a model call's latency", ("workflow",)),
    Series("counter", "lmfoundry_agent_tokens", "model tokens of ended runs", ("workflow", "tenant", "kind")),
    Series("gauge", "lmfoundry_agent_active_runs", "runs a worker replica is executing now", ("worker",)),
)


class AgentMetrics:
    def __init__(self):
        self.metrics = {s.name: (s, s.make()) for s in SERIES}

    def _record(self, name: str, value: float, **tags) -> None:
        series, metric = self.metrics[name]
        record(metric, series.kind, value, {k: str(v) for k, v in tags.items()})

    def started(self, workflow: str, tenant: str) -> None:
        self._record("lmfoundry_agent_runs_started", 1, workflow=workflow, tenant=tenant)

    def refused(self, tenant: str) -> None:
        self._record("lmfoundry_agent_runs_refused", 1, tenant=tenant)

    def active(self, worker: str, runs: int) -> None:
        self._record("lmfoundry_agent_active_runs", runs, worker=worker)

    def ended(self, run: dict) -> None:
        """A run from the store (AgentStore.get) that has ended."""
        workflow, tenant, state = run["workflow"], run["tenant"], run["state"]
        self._record("lmfoundry_agent_runs_ended", 1, workflow=workflow, tenant=tenant, state=state)
        self._record(
            "lmfoundry_agent_run_seconds",
            max(run["updated_at"] - run["created_at"], 0.0),
            workflow=workflow,
            state=state,
        )
        for step in run["steps"]:
            tool = step.get("tool") or "none"
            self._record(
                "lmfoundry_agent_steps", 1, workflow=workflow, kind=step["kind"], tool=tool, status=step["status"]
            )
            if step.get("seconds") is not None and step["kind"] == "tool":
                ok = "true" if step.get("ok") else "false"
                self._record("lmfoundry_agent_tool_seconds", step["seconds"], workflow=workflow, tool=tool, ok=ok)
            elif step.get("seconds") is not None and step["kind"] == "model":
                self._record("lmfoundry_agent_model_seconds", step["seconds"], workflow=workflow)
            for kind in ("prompt", "completion"):
                self._record(
                    "lmfoundry_agent_tokens",
                    step.get(f"{kind}_tokens") or 0,
                    workflow=workflow,
                    tenant=tenant,
                    kind=kind,
                )
