"""Series on Ray's metrics API (platform/metrics.py): the names Ray exports, the agent series
recorded from a real ended run and read back from the node's metrics agent, and the values
MLflow gets."""

import re
import uuid

import httpx
import pytest
from conftest import wait_until
from test_tracing import ended_run

from lmfoundry.platform.metrics import Series
from lmfoundry.platform.tracking import numeric, scalar_params

pytestmark = pytest.mark.timeout(120)


def test_the_names_ray_exports_for_each_kind():
    assert Series("counter", "lmfoundry_x", "").exported_names() == {"ray_lmfoundry_x_total"}
    assert Series("gauge", "lmfoundry_x", "").exported_names() == {"ray_lmfoundry_x"}
    assert Series("histogram", "lmfoundry_x", "").exported_names() == {
        "ray_lmfoundry_x_bucket",
        "ray_lmfoundry_x_sum",
        "ray_lmfoundry_x_count",
    }


def test_a_replica_records_each_series_in_its_own_registry_too():
    from lmfoundry.serving.metrics import ServingMetrics

    metrics = ServingMetrics("tiny", replica="r1")
    metrics.requests.labels(route="chat", status="200", version="main", tenant="acme").inc()
    metrics.generated_tokens.labels(version="main", tenant="acme").inc(0)  # nothing generated: no error
    text = metrics.render()[0].decode()
    assert (
        'lmfoundry_requests_total{model="tiny",replica="r1",route="chat",status="200",tenant="acme",version="main"} 1.0'
        in text
    )


def test_mlflow_gets_the_finite_numbers_and_the_scalar_settings():
    assert numeric({"loss": 2.5, "ok": True, "nan": float("nan"), "eval": {"ppl": 9}, "busy": [1, 2]}) == {
        "loss": 2.5,
        "eval.ppl": 9.0,
    }
    assert scalar_params({"model": {"n_layer": 2}, "drills": [], "data": "s3://b/p", "x": None}) == {
        "model.n_layer": "2",
        "data": "s3://b/p",
    }


def test_an_ended_runs_agent_series_reach_rays_metrics_agent(ray_local, tmp_path):
    from lmfoundry.agents.metrics import AgentMetrics

    run = {**ended_run(tmp_path), "workflow": f"orders-{uuid.uuid4().hex[:8]}"}  # apart from other tests' runs
    ray_local.get(ray_local.remote(lambda: AgentMetrics().ended(run)).remote())  # in a Ray worker, as a replica
    (node,) = ray_local.nodes()
    agent = f"http://127.0.0.1:{node['MetricsExportPort']}/metrics"

    def exported():
        text = httpx.get(agent, timeout=10).text
        return (
            text
            if f'workflow="{run["workflow"]}"' in text and "ray_lmfoundry_agent_tool_seconds_count" in text
            else None
        )

    text = wait_until(exported, 60, "the run's agent series in Ray's metrics export")

    def value(name: str, **labels) -> float:
        total = 0.0
        for line in text.splitlines():
            if line.startswith(name + "{") and all(f'{k}="{v}"' in line for k, v in labels.items()):
                total += float(line.rsplit(" ", 1)[1])
        return total

    wf = run["workflow"]
    assert value("ray_lmfoundry_agent_runs_ended_total", workflow=wf, tenant="acme", state="succeeded") == 1
    assert value("ray_lmfoundry_agent_steps_total", workflow=wf, kind="model") == 3
    assert value("ray_lmfoundry_agent_tool_seconds_count", workflow=wf, tool="sql", ok="true") == 1
    assert value("ray_lmfoundry_agent_tokens_total", workflow=wf, kind="prompt") == 440
    assert value("ray_lmfoundry_agent_tokens_total", workflow=wf, kind="completion") == 31
    assert re.search(r"ray_lmfoundry_agent_run_seconds_count\{[^}]*state=\"succeeded\"", text)
