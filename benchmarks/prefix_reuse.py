"""Time to first token with a shared system prompt, shared-prefix reuse on against off.

    python benchmarks/prefix_reuse.py                       # a few minutes on 2 idle CPU cores
    python benchmarks/prefix_reuse.py --users 4 --rounds 1  # a quick look

The model is benchmarks/serving.py's (Llama-shaped, about 16M parameters, random weights) with a
2,048-token context. --users clients each send --rounds requests one after another (the next
when the last has ended), starting at random times over the first half second: every prompt is
the same --system-tokens system prompt followed by 16-48 tokens of the user's own, and each
request generates --max-tokens tokens greedily. The same requests run through the engine's
continuous batcher (the engine the API runs) twice, each in a fresh process: with the prefix
cache (engine.prefix_cache, the default) and without it. Every request's tokens must be the same
both ways. Prints the table; writes benchmarks/results/prefix_reuse.json.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import queue
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))

from serving import build_checkpoint, in_subprocess  # noqa: E402

from lmfoundry.model.checkpoint import load_model_files  # noqa: E402
from lmfoundry.serving.sampling import SamplingParams  # noqa: E402
from lmfoundry.serving.scheduler import ContinuousBatcher  # noqa: E402

RESULTS = HERE / "results"


def make_workload(users: int, rounds: int, system_tokens: int, vocab: int, seed: int = 0):
    rng = random.Random(seed)
    system = [rng.randrange(3, vocab) for _ in range(system_tokens)]
    starts = sorted(rng.uniform(0, 0.5) for _ in range(users))
    prompts = [
        [system + [rng.randrange(3, vocab) for _ in range(rng.randint(16, 48))] for _ in range(rounds)]
        for _ in range(users)
    ]
    return [s - starts[0] for s in starts], prompts


def run(ckpt: Path, starts, prompts, max_tokens: int, reuse: bool) -> dict:
    users, rounds = len(starts), len(prompts[0])
    batcher = ContinuousBatcher(
        lambda: load_model_files(ckpt), frozenset(), max_batch_size=users, prefix_cache_tokens=16384 if reuse else 0
    )
    ended: queue.Queue = queue.Queue()
    sent, first, tokens = {}, {}, {}

    def submit(user: int, r: int) -> None:
        key = (user, r)
        tokens[key] = []

        def emit(item):
            if isinstance(item, int):
                first.setdefault(key, time.perf_counter())
                tokens[key].append(item)
            else:
                ended.put(key)

        sent[key] = time.perf_counter()
        batcher.submit(prompts[user][r], SamplingParams(max_tokens, 0.0), emit, cache_scope="bench")

    try:
        t0 = time.perf_counter()
        for user in range(users):
            time.sleep(max(0.0, t0 + starts[user] - time.perf_counter()))
            submit(user, 0)
        for _ in range(users * rounds):
            user, r = ended.get()
            if r + 1 < rounds:
                submit(user, r + 1)
        wall = time.perf_counter() - t0
    finally:
        batcher.close()
    ttfts = [first[k] - sent[k] for k in sent]
    return {
        "prefix_reuse": reuse,
        "requests": len(sent),
        "ttft_p50_s": round(statistics.median(ttfts), 4),
        "ttft_p90_s": round(statistics.quantiles(ttfts, n=10)[-1], 4),
        "seconds": round(wall, 2),
        "prefill_tokens_computed": batcher.stats["prefill_tokens"],
        "prefix_reused_tokens": batcher.stats["prefix_reused_tokens"],
        "tokens": {f"{u}/{r}": t for (u, r), t in tokens.items()},
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--users", type=int, default=16)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--system-tokens", type=int, default=1000)
    p.add_argument("--max-tokens", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count())
    args = p.parse_args()
    load_before = os.getloadavg()
    work = Path(tempfile.mkdtemp(prefix="lmf-prefix-bench-"))
    model = build_checkpoint(work / "ckpt", vocab=8192, context=2048)
    vocab = model.cfg.vocab_size
    del model
    starts, prompts = make_workload(args.users, args.rounds, args.system_tokens, vocab)
    off = in_subprocess(args.threads, run, work / "ckpt", starts, prompts, args.max_tokens, False)
    on = in_subprocess(args.threads, run, work / "ckpt", starts, prompts, args.max_tokens, True)
    same = on.pop("tokens") == off.pop("tokens")
    ratio = round(off["ttft_p50_s"] / on["ttft_p50_s"], 2)
    print(
        f"\n{args.users} users x {args.rounds} requests, a {args.system_tokens}-token shared system prompt, "
        f"{args.max_tokens} tokens each\n"
    )
    print("| prefix reuse | TTFT p50 s | TTFT p90 s | prefill tokens computed | reused | wall s |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in (off, on):
        print(
            f"| {'on' if r['prefix_reuse'] else 'off'} | {r['ttft_p50_s']} | {r['ttft_p90_s']} | "
            f"{r['prefill_tokens_computed']:,} | {r['prefix_reused_tokens']:,} | {r['seconds']} |"
        )
    load_after = os.getloadavg()
    print(f"TTFT p50 off / on = {ratio}; same tokens both ways: {same}")
    print(f"load average before {load_before[0]:.1f}, after {load_after[0]:.1f} (on {os.cpu_count()} cores)")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": "python benchmarks/prefix_reuse.py " + " ".join(sys.argv[1:]),
        "machine": f"{os.cpu_count()} CPU, {platform.machine()}",
        "shared_machine_load_average": {
            "before": [round(x, 2) for x in load_before],
            "after": [round(x, 2) for x in load_after],
        },
        "torch_threads": args.threads,
        "users": args.users,
        "rounds": args.rounds,
        "system_tokens": args.system_tokens,
        "max_tokens": args.max_tokens,
        "runs": [off, on],
        "ttft_p50_ratio_off_over_on": ratio,
        "same_tokens_with_and_without_reuse": same,
    }
    (RESULTS / "prefix_reuse.json").write_text(json.dumps(out, indent=2) + "\n")
    if not same:
        sys.exit("the tokens differ with and without prefix reuse")


if __name__ == "__main__":
    torch.set_num_threads(os.cpu_count())
    main()
