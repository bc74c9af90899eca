"""The agent service under load: 100 concurrent runs of a workflow of up to 5 model steps on one
machine, side by side undisturbed and with one worker replica killed mid-load; runs completed
per minute, run latency, and an audit of every run's steps (none lost, none duplicated).

    python benchmarks/agents.py            # a few minutes on 2 CPU cores
    python benchmarks/agents.py --quick    # 20 runs

The model behind the OpenAI API is Llama-shaped and small (4 layers, d_model 128, 2,048-token
context, a 4,096 BPE vocabulary trained here on standard-library docstrings, random weights):
its choices are arbitrary but, under constrained decoding, always well-formed tool calls, and a
run's cost is that of real model calls and real tool calls. The workflow offers `sql` (a SQLite
orders table) and `docs` (BM25), forces `sql` first and stops at 5 model steps (or an earlier
final answer). Two worker replicas, 16 runs each at once; after a third of the runs have ended
the replica holding the most runs is killed with SIGKILL; its runs resume on the other (and on
the replacement Serve starts) once their 5 s leases run out.
Prints a table; writes benchmarks/results/agents.json.
"""

from __future__ import annotations

import argparse
import json
import os
import sqlite3
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
RESULTS = Path(__file__).resolve().parent / "results"
KEY = "sk-bench-agents-" + "b" * 16


def build_checkpoint(directory: Path) -> None:
    import torch

    from lmfoundry.data.sample_corpus import stdlib_documents
    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    torch.manual_seed(0)
    tok = train_bpe(stdlib_documents(1000), vocab_size=4096)
    model = Transformer(
        ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=2048, n_layer=4, d_model=128, n_head=4, n_kv_head=2)
    ).eval()
    save_model_files(model, directory)
    (directory / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(directory, {"step": 0})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--runs", type=int, default=100)
    args = ap.parse_args()
    n_runs = 20 if args.quick else args.runs

    from ray import serve

    from lmfoundry.agents.api import AgentServeConfig, build_agent_app
    from lmfoundry.agents.store import AgentStore
    from lmfoundry.platform.keys import digest
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.serving.app import ServeConfig, build_app

    work = Path(tempfile.mkdtemp(prefix="lmfoundry-bench-agents-"))
    build_checkpoint(work / "ckpt")
    db = work / "orders.sqlite"
    conn = sqlite3.connect(db)
    conn.execute("CREATE TABLE orders (id INTEGER PRIMARY KEY, customer TEXT, total REAL)")
    conn.executemany("INSERT INTO orders (customer, total) VALUES (?, ?)", [(f"c{i % 9}", i * 2.5) for i in range(200)])
    conn.commit()
    conn.close()
    (work / "docs.jsonl").write_text(
        "".join(json.dumps({"id": f"d{i}", "text": f"Policy {i}: refunds in {i + 7} days."}) + "\n" for i in range(50))
    )
    port = 8123
    os.environ["LMFOUNDRY_BENCH_AGENT_KEY"] = KEY
    (work / "workflows.yaml").write_text(
        json.dumps(
            {
                "workflows": {
                    "five_steps": {
                        "model_url": f"http://127.0.0.1:{port}",
                        "model": "bench",
                        "api_key_env": "LMFOUNDRY_BENCH_AGENT_KEY",
                        "tools": {
                            "sql": {"kind": "sql", "dsn": str(db), "max_rows": 5, "max_query_chars": 60},
                            "docs": {"kind": "search", "corpus": str(work / "docs.jsonl"), "max_query_chars": 40},
                        },
                        "first_tool": "sql",
                        "max_steps": 5,
                        "max_tokens": 96,
                        "max_answer_chars": 24,
                        "max_seconds": 600,
                    }
                }
            }
        )
    )
    init_ray()
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    serve.run(
        build_app(
            ServeConfig(
                checkpoint=str(work / "ckpt"),
                model_name="bench",
                cpus_per_replica=1,
                engine={"max_batch_size": 32, "max_waiting": 256},
            ),
            [digest(KEY)],
        ),
        name="llm",
        route_prefix="/",
        blocking=False,
    )
    cfg = AgentServeConfig(
        workflows=str(work / "workflows.yaml"),
        store=str(work / "runs.sqlite"),
        workers=2,
        runs_per_worker=16,
        per_tenant_running=64,
        per_tenant_active=1000,
        lease_s=5.0,
        env_from_driver=["LMFOUNDRY_BENCH_AGENT_KEY"],
    )
    serve.run(build_agent_app(cfg, [digest(KEY)]), name="agents", route_prefix="/agents", blocking=False)
    url = f"http://127.0.0.1:{port}/agents"
    headers = {"Authorization": f"Bearer {KEY}"}
    while True:
        try:
            if (
                httpx.get(f"{url}/health").status_code == 200
                and httpx.get(f"http://127.0.0.1:{port}/health").status_code == 200
            ):
                break
        except httpx.TransportError:
            pass
        time.sleep(0.5)

    store = AgentStore(cfg.store)
    phases = {
        "undisturbed": load(url, headers, store, n_runs, kill=False),
        "replica killed": load(url, headers, store, n_runs, kill=True),
    }
    keys = (
        "wall_s",
        "runs_per_minute",
        "latency_p50_s",
        "latency_p99_s",
        "mean_model_steps",
        "mean_tool_calls",
        "model_steps_cut_short",
        "runs_resumed_after_the_kill",
        "runs_with_step_gaps",
        "tool_steps_left_unfinished",
    )
    print(f"\n{n_runs} runs submitted at once, per phase")
    print(f"{'measure':<32}" + "".join(f"{name:>18}" for name in phases))
    for k in keys:
        print(
            f"{k:<32}"
            + "".join(f"{p[k]:>18.2f}" if isinstance(p[k], float) else f"{p[k]:>18}" for p in phases.values())
        )
    print(
        f"{'succeeded / failed':<32}"
        + "".join(f"{p['states']['succeeded']:>11} / {p['states']['failed']:<4}" for p in phases.values())
    )
    killed = phases["replica killed"]["killed"]
    print(
        f"killed {killed.get('worker')} (holding {killed.get('runs_held')} runs) at {killed.get('at_s', 0):.1f} s, "
        f"after {killed.get('runs_done')} runs had ended"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "agents.json").write_text(
        json.dumps(
            {"machine": f"{os.cpu_count()} CPU cores, no GPU", "runs_per_phase": n_runs, **phases},
            indent=2,
            default=str,
        )
    )
    serve.shutdown()


def load(url: str, headers: dict, store, n_runs: int, kill: bool) -> dict:
    """Submit n_runs at once and wait for all; with `kill`, SIGKILL the worker replica holding
    the most runs once a third have ended. Throughput, latency and an audit of every run."""
    started = time.time()
    ids = [
        httpx.post(
            f"{url}/v1/agents/runs",
            json={"workflow": "five_steps", "input": f"Total for customer c{i % 9}?"},
            headers=headers,
        ).json()["id"]
        for i in range(n_runs)
    ]
    killed: dict = {}

    def kill_one_when_a_third_is_done():
        import collections
        import signal

        while True:
            done = sum(store.get(i)["state"] in ("succeeded", "failed", "cancelled") for i in ids)
            rows, _ = store.db.run(
                "SELECT lease_owner FROM agent_runs WHERE state = 'running' AND lease_owner IS NOT NULL"
            )
            owners = collections.Counter(owner for (owner,) in rows)
            if done >= n_runs // 3 and owners:
                victim, holding = owners.most_common(1)[0]
                os.kill(int(victim.split("-")[1]), signal.SIGKILL)  # worker-PID-...: a crash, not a graceful stop
                killed.update(at_s=time.time() - started, runs_done=done, worker=victim, runs_held=holding)
                return
            time.sleep(0.2)

    killer = threading.Thread(target=kill_one_when_a_third_is_done, daemon=True)
    if kill:
        killer.start()
    ends = {}
    while len(ends) < n_runs:
        for run_id in ids:
            if run_id not in ends:
                run = store.get(run_id)
                if run["state"] in ("succeeded", "failed", "cancelled"):
                    ends[run_id] = (run["updated_at"] - run["created_at"], run)
        time.sleep(0.5)
    wall = time.time() - started
    if kill:
        killer.join(timeout=5)
    latencies = [lat for lat, _ in ends.values()]
    runs = [run for _, run in ends.values()]
    gaps = [r["id"] for r in runs if [s["n"] for s in r["steps"]] != list(range(len(r["steps"])))]
    unfinished_tools = [r["id"] for r in runs if any(s["kind"] == "tool" and s["status"] != "done" for s in r["steps"])]
    resumed = [
        r["id"]
        for r in runs
        if killed
        and killed["worker"] in {s.get("worker") for s in r["steps"]}
        and r["steps"][-1].get("worker") != killed["worker"]
    ]
    return {
        "wall_s": wall,
        "runs_per_minute": n_runs / wall * 60,
        "latency_p50_s": statistics.median(latencies),
        "latency_p99_s": statistics.quantiles(latencies, n=100)[98],
        "states": {s: sum(r["state"] == s for r in runs) for s in ("succeeded", "failed", "cancelled")},
        "mean_model_steps": statistics.fmean(sum(s["kind"] == "model" for s in r["steps"]) for r in runs),
        "mean_tool_calls": statistics.fmean(
            sum(s["kind"] == "tool" and "refused" not in s for s in r["steps"]) for r in runs
        ),
        "model_steps_cut_short": sum(
            s["kind"] == "model" and s["tool"] == "_invalid_reply" for r in runs for s in r["steps"]
        ),
        "killed": killed,
        "runs_resumed_after_the_kill": len(resumed),
        "runs_with_step_gaps": len(gaps),
        "tool_steps_left_unfinished": len(unfinished_tools),
        "errors": sorted({r["error"] for r in runs if r["error"]})[:5],
    }


if __name__ == "__main__":
    main()
