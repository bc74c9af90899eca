"""The Grafana dashboards in deploy/grafana query only series the code exports through Ray's
metrics API, by labels those series carry, and every exported series is on a dashboard.
(tests/test_serve.py reads the series from Ray's metrics agent for real requests.)"""

import json
import re
from pathlib import Path

import pytest

from lmfoundry.agents.metrics import SERIES as AGENT_SERIES
from lmfoundry.serving.metrics import SERIES as SERVING_SERIES
from lmfoundry.train.metrics import SERIES as TRAINING_SERIES

DASHBOARDS = sorted((Path(__file__).resolve().parents[1] / "deploy" / "grafana").glob("*.json"))
EXPORTED = {name: s for s in (*SERVING_SERIES, *AGENT_SERIES, *TRAINING_SERIES) for name in s.exported_names()}
# labels Ray's metrics agent adds to every series, and the histogram buckets' bound
RAY_LABELS = {"Component", "NodeAddress", "SessionName", "Version", "WorkerId"}


def queries(dashboard: dict) -> list[str]:
    exprs = [t["expr"] for p in dashboard["panels"] for t in p.get("targets", [])]
    variables = [v["query"]["query"] for v in dashboard["templating"]["list"] if v["type"] == "query"]
    return exprs + variables


def labels_used(expr: str) -> set[str]:
    names = set()
    for selector in re.findall(r"\{([^}]*)\}", expr):
        names |= set(re.findall(r"(\w+)\s*(?:=~|!~|!=|=)\s*\"", selector))
    for grouping in re.findall(r"\b(?:by|without)\s*\(([^)]*)\)", expr):
        names |= {n.strip() for n in grouping.split(",") if n.strip()}
    names |= set(re.findall(r"label_values\(\s*[\w:]+(?:\{[^}]*\})?\s*,\s*(\w+)\s*\)", expr))
    return names


def test_the_three_dashboards_are_there():
    assert [d.name for d in DASHBOARDS] == ["agents.json", "serving.json", "training.json"]


@pytest.mark.parametrize("path", DASHBOARDS, ids=lambda p: p.stem)
def test_every_series_a_dashboard_queries_is_exported_with_the_labels_it_uses(path):
    dashboard = json.loads(path.read_text())
    ids = [p["id"] for p in dashboard["panels"]]
    assert len(ids) == len(set(ids)) and dashboard["uid"].startswith("lmfoundry-")
    for expr in queries(dashboard):
        series = re.findall(r"\b(ray_[A-Za-z0-9_:]+)", expr)
        assert series, f"{path.name}: {expr!r} queries no lmfoundry series"
        for name in series:
            assert name in EXPORTED, f"{path.name}: {name} is not a series the code exports ({expr!r})"
        allowed = set(RAY_LABELS)
        for name in series:
            allowed |= set(EXPORTED[name].tags) | ({"le"} if name.endswith("_bucket") else set())
        unknown = labels_used(expr) - allowed
        assert not unknown, f"{path.name}: {expr!r} uses labels {sorted(unknown)} that {series} do not carry"


def test_every_exported_series_is_on_a_dashboard():
    queried = {
        name
        for path in DASHBOARDS
        for e in queries(json.loads(path.read_text()))
        for name in re.findall(r"\bray_\w+", e)
    }
    declared = {s.name for s in EXPORTED.values()}
    shown = {s.name for name, s in EXPORTED.items() if name in queried}
    assert declared - shown == set()


def test_the_label_check_catches_a_label_a_series_lacks():
    assert labels_used('sum by (tenant, le) (rate(x{model=~"$m", ok!="1"}[5m]))') == {"tenant", "le", "model", "ok"}
    assert labels_used("label_values(ray_lmfoundry_train_step, run)") == {"run"}
