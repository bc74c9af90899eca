"""Times the whole lifecycle (the quickstart recipe) stage by stage and records its figures.

    python benchmarks/lifecycle.py            # the quickstart recipe as `make quickstart` runs it
    python benchmarks/lifecycle.py --quick    # 40 training steps instead of 200

Prints a table and writes benchmarks/results/lifecycle.json (with the machine it ran on).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
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


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    args = p.parse_args()

    from lmfoundry.jobs.lifecycle import load_quickstart_config, run_quickstart
    from lmfoundry.platform.ray_env import init_ray

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    overrides = [f"serve.port={port}"] + (["pretrain.max_steps=40"] if args.quick else [])
    with tempfile.TemporaryDirectory(prefix="lmf-bench-") as work:
        cfg = load_quickstart_config(None, work, overrides)
        started = time.time()
        init_ray()
        figures = run_quickstart(cfg)
        total = time.time() - started
    rows = [
        (stage, f["seconds"], {k: v for k, v in f.items() if k not in ("seconds", "url")})
        for stage, f in figures.items()
    ]
    print(f"\n{'stage':14s} {'seconds':>8s}  figures")
    for stage, secs, fig in rows:
        print(f"{stage:14s} {secs:8.1f}  {json.dumps(fig)}")
    print(f"{'total':14s} {total:8.1f}  (including Ray start-up)")
    pre = figures["pretrain"]
    tokens_per_step = cfg.pretrain.global_batch_tokens
    result = {
        "benchmark": "lifecycle",
        "quick": args.quick,
        "machine": machine(),
        "total_seconds": round(total, 1),
        "stages": figures,
        "pretrain_tokens": pre["steps"] * tokens_per_step,
        "pretrain_tokens_per_s_incl_startup": round(pre["steps"] * tokens_per_step / pre["seconds"], 1),
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "lifecycle.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
