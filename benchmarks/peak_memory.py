"""The planner's per-GPU memory against the measured peak of real DeepSpeed training runs.

Each case is a small pretraining config trained for two optimizer steps by two CPU processes
over gloo (benchmarks/harness/peak_memory.py: the training loop's model, DeepSpeed engine and
optimizer, on random tokens); the measured figure is the largest per-rank rise of the resident
set during training. The prediction is `planner.training_memory_bytes` for the same layout (dp=2, fp32, no GPU
workspace allowance). Three more cases, tensor and pipeline parallelism together without and with
sequence parallelism, and with the end stages' vocabulary tables split as well, run on four
processes (one TP 2 x PP 2 replica).

    python benchmarks/peak_memory.py

Prints a table; writes benchmarks/results/peak_memory.json. tests/test_planner_memory.py runs
the two-process cases and holds every one within 15%.
"""

from __future__ import annotations

import json
import platform
import time
from pathlib import Path

from harness.peak_memory import (
    SEQ_LEN,
    WORLD,
    composed_cases,
    measure_peak_bytes,
    predicted_peak_bytes,
    reference_cases,
)

from lmfoundry.train.config import PretrainConfig

RESULTS = Path(__file__).resolve().parent / "results"


def compare(selected: dict[str, PretrainConfig], world: int) -> list[dict]:
    measured = measure_peak_bytes(list(selected.values()), SEQ_LEN, world)
    rows = []
    for (name, cfg), peak in zip(selected.items(), measured):
        predicted = predicted_peak_bytes(cfg, SEQ_LEN, world)
        rows.append(
            {
                "case": name,
                "world_size": world,
                "measured_mib": peak / 2**20,
                "predicted_mib": predicted["total"] / 2**20,
                "ratio": predicted["total"] / peak,
                "predicted_parts_mib": {k: v / 2**20 for k, v in predicted.items()},
            }
        )
    return rows


def main() -> None:
    start = time.time()
    rows = compare(reference_cases(), WORLD) + compare(composed_cases(), 4)
    print(f"{'case':<56} {'measured MiB':>12} {'predicted MiB':>13} {'ratio':>6}   predicted parts, MiB")
    for r in rows:
        parts = r["predicted_parts_mib"]
        detail = " ".join(
            f"{k} {parts[k]:.0f}"
            for k in ("weights", "gradients", "optimizer", "buckets", "activations", "backward_transient")
        )
        print(f"{r['case']:<56} {r['measured_mib']:12.1f} {r['predicted_mib']:13.1f} {r['ratio']:6.3f}   {detail}")
    RESULTS.mkdir(exist_ok=True)
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {platform.system()}",
        "seq_len": SEQ_LEN,
        "world_size": WORLD,  # of the reference cases; each row names its own
        "seconds": time.time() - start,
        "cases": rows,
    }
    (RESULTS / "peak_memory.json").write_text(json.dumps(out, indent=2))
    print(f"wrote {RESULTS / 'peak_memory.json'} in {out['seconds']:.0f} s")


if __name__ == "__main__":
    main()
