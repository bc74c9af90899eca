"""Serve's own overhead per request, broken down, beside the engine called directly.

    python benchmarks/serve_overhead.py                 # about 5 minutes on 2 idle CPU cores
    python benchmarks/serve_overhead.py --requests 10 --max-tokens 16

The model is benchmarks/serving.py's (Llama-shaped, about 16M parameters, random weights, stop
tokens off, so every request generates exactly --max-tokens tokens). The same prompts, one
request at a time:

1. the engine called directly: the continuous batcher alone, in this process, with as many
   torch threads as the replica has CPUs;
2. the same requests through the HTTP API on Ray Serve (proxy, replica, API key gate, limits,
   the engine, the JSON reply). Each reply's `Server-Timing` header gives the replica's own view:
   `engine` (from the request's submission to the batcher to its last token) and `app` (the
   route's whole handler).
The two alternate request by request, so that on a machine whose load changes from minute to
minute both sides see the same load.

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
import queue
import statistics
import sys
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
sys.path.insert(0, str(HERE.parent / "tests"))

import torch  # noqa: E402
from serving import build_checkpoint, workload  # noqa: E402
from tokenizers import Tokenizer  # noqa: E402

from lmfoundry.model.checkpoint import TOKENIZER, load_model_files  # noqa: E402
from lmfoundry.serving.sampling import SamplingParams  # noqa: E402
from lmfoundry.serving.scheduler import ContinuousBatcher  # noqa: E402

RESULTS = HERE / "results"


def server_timing(header: str) -> dict[str, float]:
    """`engine;dur=12.3, app;dur=15.0` -> {"engine": 0.0123, "app": 0.015} (seconds)."""
    out = {}
    for part in header.split(","):
        name, _, dur = part.strip().partition(";dur=")
        out[name] = float(dur) / 1000
    return out


def engine_alone(batcher, ids: list[int], max_tokens: int) -> float:
    done: queue.Queue = queue.Queue()
    t = time.perf_counter()
    batcher.submit(ids, SamplingParams(max_tokens, 0.0), done.put)
    while isinstance(done.get(), int):
        pass
    return time.perf_counter() - t


def side_by_side(ckpt: Path, texts: list[str], max_tokens: int, threads: int) -> dict:
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
    torch.set_num_threads(threads)
    batcher = ContinuousBatcher(lambda: load_model_files(ckpt), frozenset(), max_batch_size=1)
    tok = Tokenizer.from_file(str(ckpt / TOKENIZER))
    rows, one_token = [], []
    try:
        with httpx.Client(timeout=300, headers={"Authorization": "Bearer sk-bench"}) as client:
            for _ in range(2):  # warm-up
                client.post(f"{url}/v1/completions", json={"prompt": texts[0], "max_tokens": 4})
            for text in texts:
                t = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": 1})
                one_token.append(time.perf_counter() - t)
            engine_alone(batcher, tok.encode(texts[0], add_special_tokens=False).ids, 4)  # warm-up
            for text in texts:
                ids = tok.encode(text, add_special_tokens=False).ids
                n = min(max_tokens, batcher.context - len(ids))
                alone = engine_alone(batcher, ids, n)
                t = time.perf_counter()
                r = client.post(f"{url}/v1/completions", json={"prompt": text, "max_tokens": n, "temperature": 0})
                total = time.perf_counter() - t
                assert r.status_code == 200, r.text
                # the same work as the engine alone only if the API generated as many tokens
                if r.json()["usage"]["completion_tokens"] == n:
                    rows.append({"client_s": total, "alone": alone} | server_timing(r.headers["server-timing"]))
    finally:
        batcher.close()
        serve.shutdown()
        ray.shutdown()
    return {"rows": rows, "one_token_s": one_token}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--requests", type=int, default=20)
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    p.add_argument(
        "--throughput-optimized",
        action="store_true",
        help="start Ray with RAY_SERVE_THROUGHPUT_OPTIMIZED=1 (Ray Serve's own low-overhead settings)",
    )
    p.add_argument("--output", default="serve_overhead.json", help="file name under benchmarks/results")
    args = p.parse_args()
    if args.throughput_optimized:  # read by Serve's processes as they start, so set before Ray starts
        os.environ["RAY_SERVE_THROUGHPUT_OPTIMIZED"] = "1"
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmf-serve-overhead-"))
    model = build_checkpoint(work / "ckpt", vocab=8192, context=256)
    vocab = model.cfg.vocab_size
    del model
    tok = Tokenizer.from_file(str(work / "ckpt" / TOKENIZER))
    _, prompts = workload(args.requests, 1, vocab, 0.0, seed=1)
    texts = [tok.decode(p[0]) for p in prompts]
    served = side_by_side(work / "ckpt", texts, args.max_tokens, args.threads)
    rows = served["rows"]

    def p50_ms(values) -> float:
        return round(1000 * statistics.median(values), 1)

    breakdown = {
        "client_latency": p50_ms(r["client_s"] for r in rows),
        "engine_alone": p50_ms(r["alone"] for r in rows),
        "engine_in_replica": p50_ms(r["engine"] for r in rows),
        "outside_handler": p50_ms(r["client_s"] - r["app"] for r in rows),
        "handler_not_engine": p50_ms(r["app"] - r["engine"] for r in rows),
        "engine_in_replica_minus_alone": p50_ms(r["engine"] - r["alone"] for r in rows),
        "overhead": p50_ms(r["client_s"] - r["alone"] for r in rows),
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
        "ray_serve_throughput_optimized": args.throughput_optimized,
        "max_tokens": args.max_tokens,
        "requests": len(rows),
        "p50_ms": breakdown,
    }
    (RESULTS / args.output).write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
