"""Times the whole lifecycle (the quickstart recipe) stage by stage and records its figures.

    python benchmarks/lifecycle.py            # the quickstart recipe as `make quickstart` runs it
    python benchmarks/lifecycle.py --quick    # 40 training steps instead of 200
    python benchmarks/lifecycle.py --runs 2   # twice, comparing fingerprints and losses exactly
                                              # (writes lifecycle_repeat.json)

Prints a table and writes benchmarks/results/lifecycle.json (with the machine it ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> dict:
    import torch

    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    return {
        "cpus": os.cpu_count(),
        "memory_gb": round(mem_gb, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
        "processor": platform.processor() or platform.machine(),
    }


def results_header(benchmark: str, script: str, load_before: float) -> dict:
    """The keys a results file opens with: what was measured, when, by which command, on which
    machine, and the load average (1 min) before the run."""
    import datetime

    return {
        "benchmark": benchmark,
        "date": datetime.date.today().isoformat(),
        "command": recorded_command(script),
        "machine": machine(),
        "load_average_1min_before": round(load_before, 2),
    }


def recorded_command(script: str) -> str:
    """The command line as a results file records it: a path given to an option is written as the
    option's name (`--workdir WORKDIR`), so that no machine's paths enter the results."""
    import sys

    args = sys.argv[1:]
    shown = [
        args[i - 1][2:].upper().replace("-", "_") if i and args[i - 1].startswith("--") and "/" in a else a
        for i, a in enumerate(args)
    ]
    return " ".join(["python", script, *shown])


def loss_history(run_dir: str) -> list[list[float]]:
    """Every logged step's [step, loss] of a finished pretraining run, from its final checkpoint."""
    from lmfoundry.platform import storage

    manifest = storage.read_manifest(run_dir)
    return storage.read_json(storage.join(run_dir, manifest["final_checkpoint"], "train_state.json"))["loss_history"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--runs", type=int, default=1, help="run the lifecycle this many times and compare them")
    args = p.parse_args()

    from lmfoundry.jobs.lifecycle import load_quickstart_config, run_quickstart
    from lmfoundry.platform.ray_env import init_ray

    started = time.time()
    init_ray()
    runs = []
    for _ in range(args.runs):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        overrides = [f"serve.port={port}"] + (["pretrain.schedule.max_steps=40"] if args.quick else [])
        with tempfile.TemporaryDirectory(prefix="lmf-bench-") as work:
            cfg = load_quickstart_config(None, work, overrides)
            t = time.time()
            figures = run_quickstart(cfg)
            runs.append({"figures": figures, "seconds": time.time() - t, "losses": loss_history(cfg.pretrain.output)})
    total = time.time() - started
    figures = runs[0]["figures"]
    rows = [
        (stage, f["seconds"], {k: v for k, v in f.items() if k not in ("seconds", "url")})
        for stage, f in figures.items()
    ]
    print(f"\n{'stage':14s} {'seconds':>8s}  figures")
    for stage, secs, fig in rows:
        print(f"{stage:14s} {secs:8.1f}  {json.dumps(fig)}")
    print(f"{'total':14s} {total:8.1f}  ({args.runs} run(s), including Ray start-up)")
    pre = figures["pretrain"]
    tokens_per_step = cfg.pretrain.batch.global_batch_tokens
    result = {
        "benchmark": "lifecycle",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/lifecycle.py", *sys.argv[1:]]),
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        "quick": args.quick,
        "machine": machine(),
        "total_seconds": round(total, 1),
        "stages": figures,
        "pretrain_tokens": pre["steps"] * tokens_per_step,
        "pretrain_tokens_per_s_incl_startup": round(pre["steps"] * tokens_per_step / pre["seconds"], 1),
    }
    if args.runs > 1:
        # the same recipe and seed on the same machine: the same bytes at every stage, the same
        # loss at every logged step (compared as floats, exactly)
        stages = ("curate", "pack", "pretrain")
        result["repeat"] = {
            "runs": args.runs,
            "final_loss": [r["figures"]["pretrain"]["final_loss"] for r in runs],
            "logged_steps": len(runs[0]["losses"]),
            "losses_bitwise_equal": all(r["losses"] == runs[0]["losses"] for r in runs),
            **{
                f"{stage}_fingerprints_equal": len({r["figures"][stage]["fingerprint"] for r in runs}) == 1
                for stage in stages
            },
        }
        print("repeat:", json.dumps(result["repeat"]))
    RESULTS.mkdir(exist_ok=True)
    # a repeat run is a reproducibility check: its own file, so the timings of a single run stand
    out = RESULTS / ("lifecycle_repeat.json" if args.runs > 1 else "lifecycle.json")
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
