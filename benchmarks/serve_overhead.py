"""Serve's own overhead per request, broken down, beside the engine called directly.

    python benchmarks/serve_overhead.py                 # about 5 minutes on 2 idle CPU cores
    python benchmarks/serve_overhead.py --requests 10 --max-tokens 16

The model is benchmarks/serving.py's (Llama-shaped, about 16M parameters, random weights, stop
tokens off, so every request generates exactly --max-tokens tokens). The same prompts, one
request at a time:

1. the engine called directly: the continuous batcher alone, in a fresh process with as many
   torch threads as the replica has CPUs (benchmarks/serving.py's `engine_seconds`);
2. the same requests through the HTTP API on Ray Serve (proxy, replica, API key gate, limits,
   the engine, the JSON reply). Each reply's `Server-Timing` header gives the replica's own view:
   `engine` (from the request's submission to the batcher to its last token) and `app` (the
   route's whole handler).

The breakdown, p50 over requests: outside the handler (client latency - app: the proxy, the
handle call to the replica, ASGI, the gate, reading and writing the body), inside the handler
but not the engine (app - engine: checks, tokenizing, guardrails, the rate limiter, building
the reply), and the engine in the replica against the engine alone (the cost of sharing the
replica's CPUs with its event loop and Ray's threads). The overhead is the client latency minus
the engine alone. Prints a table; writes benchmarks/results/serve_overhead.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

from serving import build_checkpoint, engine_seconds, in_subprocess, workload  # noqa: E402

RESULTS = HERE / "results"


def server_timing(header: str) -> dict[str, float]:
    """`engine;dur=12.3, app;dur=15.0` -> {"engine": 0.0123, "app": 0.015} (seconds)."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur) / 1000
    return out


def through_serve(ckpt: Path, texts: list[str], tokens: list[int], threads: int) -> dict:
    import httpx
    import ray
    from conftest import free_port
    from ray import serve

    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.serving.app import ServeConfig, start

    init_ray()
    os.environ["LMFOUNDRY_BENCH_KEY"] = "sk-bench"
    url, _ = start(
        ServeConfig(
            checkpoint=str(ckpt),
            port=free_port(),
            api_keys_env="LMFOUNDRY_BENCH_KEY",
            cpus_per_replica=threads,  # Ray gives the replica as many torch threads
            guardrails={"enabled": False},
        )
    )
    rows, one_token = [], []
    try:
        with httpx.Client(timeout=300, headers={"Authorization": "Bearer sk-bench"}) as client:
            for _ in range(2):  # warm-up
                client.post(f"{url}/v1/completions", json={"prompt": texts[0], "max_tokens": 4})
            for text in texts:
                t = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
                one_token.append(time.perf_counter() - t)
            for text, n in zip(texts, tokens):
                t = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": n, "temperature": 0})
                total = time.perf_counter() - t
                assert r.status_code == 200, r.text
                # the same work as the engine alone only if the API generated as many tokens
                if r.json()["usage"]["completion_tokens"] == n:
                    rows.append({"client_s": total} | server_timing(r.headers["server-timing"]))
    finally:
        serve.shutdown()
        ray.shutdown()
    return {"rows": rows, "one_token_s": one_token}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmf-serve-overhead-"))
    model = build_checkpoint(work / "ckpt", vocab=8192, context=256)
    vocab = model.cfg.vocab_size
    del model
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(str(work / "ckpt" / "tokenizer.json"))
    _, prompts = workload(args.requests, 1, vocab, 0.0, seed=1)
    texts = [tok.decode(p[0]) for p in prompts]
    engine = in_subprocess(args.threads, engine_seconds, work / "ckpt", texts, args.max_tokens)
    served = through_serve(work / "ckpt", texts, [n for _, n in engine], args.threads)
    rows = served["rows"]
    engine_alone = [e for e, _ in engine]

    def p50_ms(values) -> float:
        return round(1000 * statistics.median(values), 1)

    by_index = list(zip(rows, engine_alone))
    breakdown = {
        "client_latency": p50_ms(r["client_s"] for r in rows),
        "engine_alone": p50_ms(engine_alone),
        "engine_in_replica": p50_ms(r["engine"] for r in rows),
        "outside_handler": p50_ms(r["client_s"] - r["app"] for r in rows),
        "handler_not_engine": p50_ms(r["app"] - r["engine"] for r in rows),
        "engine_in_replica_minus_alone": p50_ms(r["engine"] - e for r, e in by_index),
        "overhead": p50_ms(r["client_s"] - e for r, e in by_index),
        "overhead_over_engine_in_replica": p50_ms(r["client_s"] - r["engine"] for r in rows),
        "one_token_request": p50_ms(served["one_token_s"]),
    }
    print(f"\n{len(rows)} requests of {args.max_tokens} tokens, one at a time; p50, ms\n")
    print("| part | p50 ms |\n|---|---:|")
    for name, value in breakdown.items():
        print(f"| {name.replace('_', ' ')} | {value} |")
    load_after = os.getloadavg()
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (on {os.cpu_count()} cores)")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/serve_overhead.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU, {platform.machine()}",
        "shared_machine_load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "torch_threads": args.threads,
        "max_tokens": args.max_tokens,
        "requests": len(rows),
        "p50_ms": breakdown,
    }
    (RESULTS / "serve_overhead.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
