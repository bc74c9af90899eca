"""Tensor parallelism against one worker holding the whole model: the same 20 steps on the same
global batches (benchmarks/harness/tensor_parallel.py), at TP 2 on 2 gloo processes and TP 2 x
DP 2 on 4. The figures: the largest loss difference from the one-worker run, and the largest
logit difference between the engine and the weights it wrote, loaded into the single-device model.

    python benchmarks/tensor_parallel.py

Prints a table; writes benchmarks/results/tensor_parallel.json. tests/test_tensor_parallel.py
runs the same comparison and holds the losses within 1e-4.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from harness.tensor_parallel import SEQ_LEN, STEPS, compare_layouts
from lifecycle import results_header

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        rows = compare_layouts(scratch)
    print(
        f"{'layout':<12} {'workers':>7} {'first loss':>10} {'last loss':>9} {'max |d loss|':>12} {'max |d logit|':>13}"
    )
    for name, r in rows.items():
        print(
            f"{name:<12} {r['workers']:>7} {r['losses'][0]:>10.4f} {r['losses'][-1]:>9.4f} "
            f"{r['loss_max_abs_diff']:>12.2e} {r['reloaded_logits_max_abs_diff']:>13.2e}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        **results_header(
            "tensor parallelism: losses against one worker, and the written weights against the engine",
            "benchmarks/tensor_parallel.py",
            load_before,
        ),
        "seq_len": SEQ_LEN,
        "steps": STEPS,
        "rows": [{"layout": name, **r} for name, r in rows.items()],
    }
    path = RESULTS / "tensor_parallel.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
