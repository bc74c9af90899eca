"""Serve agent workflows (and, with a `model` section, the model they call) on Ray Serve.

lmfoundry agents demo-data --out work/agents
LMFOUNDRY_AGENT_KEY=sk-... lmfoundry agents configs/agents.yaml
"""

import argparse
import json
import sqlite3
import sys
import time
from pathlib import Path

from pydantic import Field

from lmfoundry.agents.api import AgentServeConfig, build_agent_app
from lmfoundry.platform.cli import run_stage
from lmfoundry.serving.app import ServeConfig


class AgentsJobConfig(AgentServeConfig):
    model: ServeConfig | None = Field(None, description="also serve this model (the workflows' model_url)")
    host: str = "127.0.0.1"
    port: int = Field(8000, ge=1, le=65535)


def run_agents(cfg: AgentsJobConfig, block: bool = True) -> dict:
    from ray import serve

    from lmfoundry.platform.keys import digest, env_keys

    model = cfg.model
    port = model.port if model else cfg.port
    serve.start(http_options={"host": model.host if model else cfg.host, "port": port})
    digests = [digest(k) for k in env_keys(model.api_keys_env if model else cfg.api_keys_env)]
    if model is not None:
        from lmfoundry.serving.app import build_app

        serve.run(build_app(model, digests), name="lmfoundry", route_prefix="/", blocking=False)
    serve.run(build_agent_app(cfg, digests), name="agents", route_prefix=cfg.route_prefix, blocking=False)
    url = f"http://{model.host if model else cfg.host}:{port}{cfg.route_prefix}"
    print(f"agents at {url}/v1/agents/runs (Ctrl-C stops)", file=sys.stderr)
    while block:
        time.sleep(3600)
    return {"url": url}


DEMO_CUSTOMERS = ("acme", "globex", "initech", "umbrella", "hooli", "vandelay", "wonka", "stark", "tyrell", "soylent")
DEMO_ITEMS = ("kettle", "lamp", "desk", "chair", "monitor", "printer")


def demo_data(out: str) -> dict:
    """An orders database (ten customers, three to five orders each, one per item) and a small
    policy corpus for the example workflows; the same bytes every time."""
    import random

    root = Path(out)
    root.mkdir(parents=True, exist_ok=True)
    db = root / "orders.sqlite"
    db.unlink(missing_ok=True)
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, item TEXT, total REAL, status TEXT)")
    rng = random.Random(0)
    rows = [
        (customer, item, rng.randrange(38, 1600) / 4, rng.choice(("shipped", "shipped", "returned", "pending")))
        for customer in DEMO_CUSTOMERS
        for item in rng.sample(DEMO_ITEMS, rng.randint(3, 5))
    ]
    conn.executemany("INSERT INTO orders (customer, item, total, status) VALUES (?, ?, ?, ?)", rows)
    conn.commit()
    conn.close()
    # one short sentence each: an agent's answer quotes one, within the 64 characters constrained
    # decoding allows a string (serving/grammar.py)
    docs = [
        {"id": "refunds", "text": "Refunds are paid within 14 days."},
        {"id": "shipping", "text": "Orders ship in two working days."},
        {"id": "warranty", "text": "Furniture has a two-year warranty."},
        {"id": "pending", "text": "Pending orders can be cancelled."},
    ]
    (root / "docs.jsonl").write_text("".join(json.dumps(d) + "\n" for d in docs))
    return {"orders": str(db), "orders_rows": len(rows), "docs": str(root / "docs.jsonl")}


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["demo-data"]:
        p = argparse.ArgumentParser(prog="lmfoundry agents demo-data")
        p.add_argument("--out", default="work/agents")
        print(json.dumps(demo_data(p.parse_args(argv[1:]).out), indent=2))
        return 0
    return run_stage(
        "agents", AgentsJobConfig, run_agents, argv, input_field=None, output_field=None, description=__doc__
    )


if __name__ == "__main__":
    sys.exit(main())
