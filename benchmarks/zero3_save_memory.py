"""What writing a ZeRO-3 run's servable weights costs a rank in memory, by model depth.

Two CPU processes over gloo build the pretraining model (d_model 512, vocab 8,192, tied
embedding) in its ZeRO-3 engine and write the servable weights two ways
(benchmarks/harness/save_memory.py): streamed, piece by piece, as a checkpoint save does, and
with every parameter gathered at once and copied by rank 0 for the write. The figure is the
larger rank's peak rise of the resident set during the write.

    python benchmarks/zero3_save_memory.py [--layers 4 8 16 32]

Prints a table; writes benchmarks/results/zero3_save_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

from harness.save_memory import measure_save_peaks, zero3_config
from lifecycle import results_header

RESULTS = Path(__file__).resolve().parent / "results"
MIB = 2**20


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--layers", type=int, nargs="+", default=[4, 8, 16, 32])
    args = ap.parse_args()
    load_before = os.getloadavg()[0]
    measured = measure_save_peaks([zero3_config(n) for n in args.layers])
    rows = [
        {
            "n_layer": n,
            "model_mib": round(r["model_bytes"] / MIB, 1),
            "largest_piece_mib": round(r["largest_piece_bytes"] / MIB, 1),
            "streamed_peak_rise_mib": round(r["streamed"] / MIB, 1),
            "full_gather_peak_rise_mib": round(r["full_gather"] / MIB, 1),
            "file_equal_to_full_gather": r["equal_to_full_gather"],
        }
        for n, r in zip(args.layers, measured)
    ]
    print(f"{'layers':>6} {'model MiB':>10} {'piece MiB':>10} {'streamed MiB':>13} {'full gather MiB':>16}")
    for r in rows:
        print(
            f"{r['n_layer']:>6} {r['model_mib']:>10.1f} {r['largest_piece_mib']:>10.1f} "
            f"{r['streamed_peak_rise_mib']:>13.1f} {r['full_gather_peak_rise_mib']:>16.1f}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        **results_header(
            "ZeRO-3 servable-weights write: peak resident-set rise per rank, streamed vs full gather",
            "benchmarks/zero3_save_memory.py",
            load_before,
        ),
        "world_size": 2,
        "rows": rows,
    }
    (RESULTS / "zero3_save_memory.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
