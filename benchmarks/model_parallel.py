"""Tensor and pipeline parallelism against one worker holding the whole model: the same 20
steps on the same global batches (benchmarks/harness/model_parallel.py), at TP 2 x DP 2 on 4
gloo processes (with a vocabulary-parallel head and embedding), PP 2 on 2 (4 micro-batches a step, 1F1B),
PP 2 x DP 2 on 4 (with activation checkpointing, whose recomputation must not change the
losses), and with sequence parallelism TP 2 on 2 (with activation checkpointing), TP 2 x PP 2
on 4 (each stage split over 2 ranks, 4 micro-batches a step: the head whole; the tied table split
by vocabulary rows on both end stages; an untied head and embedding split by vocabulary rows,
with activation checkpointing), TP 2 x PP 2 on 4 with an untied head and embedding split by
vocabulary rows and no sequence split, TP 2 on 2 with an untied head and embedding, each split by
vocabulary rows (an untied layout is held to a one-worker run of the untied model), and, with 4
blocks against a one-worker run of the 4-block model, PP 2 with 2 virtual stages on 2 and TP 2 x
PP 2 with 2 virtual stages on 4 (sequence and vocabulary parallel, activation checkpointing),
and with 8 blocks PP 4 with 2 virtual stages on 4, on the interleaved schedule; with 4 blocks of
which the last 3 are MoE layers, against one worker holding that model, PP 2 on 2 (the
load-balancing loss), PP 2 x DP 2 on 4 (aux-free balancing, activation checkpointing), PP 2 x DP
2 on 4 with each stage's experts split over its 2 replicas, PP 2 with 2 virtual stages on 2
(activation checkpointing), and with sequence parallelism TP 2 on 2 and TP 2 x PP 2 on 4
(aux-free balancing), each rank routing its slice of the tokens to experts split over its
tensor-parallel group, each also held to the one worker's load of every expert, step by step. The figures: the largest loss difference from the one-worker run, the
largest relative difference of the gradient norm (clipping's), and the largest logit difference
between the weights each run wrote, loaded into the single-device model, and the one-worker
engine (and the run's own engine, where it sees the logits). For the layouts without a pipeline, the
tensor-parallel traffic of the first micro-batch, forward and backward, in all-reduces of one
activation (an all-gather or a reduce-scatter is half of one): the planner counts 4 a block for
tensor parallelism and 1.25 times that with sequence parallelism.

    python benchmarks/model_parallel.py

Prints a table; writes benchmarks/results/model_parallel.json. tests/test_model_parallel.py runs
the first 10 of its 20 steps and holds the losses within 1e-4.
"""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path

from harness.model_parallel import SEQ_LEN, STEPS, compare_layouts
from lifecycle import results_header

RESULTS = Path(__file__).resolve().parent / "results"


def traffic(all_reduces: dict | None) -> str:
    return "-" if all_reduces is None else f"{all_reduces['forward']:g} + {all_reduces['backward']:g}"


def main() -> None:
    load_before = os.getloadavg()[0]
    with tempfile.TemporaryDirectory() as scratch:
        rows = compare_layouts(scratch)
    print(
        f"{'layout':<58} {'workers':>7} {'first loss':>10} {'last loss':>9} {'max |d loss|':>12} {'grad norm':>9} "
        f"{'written vs 1 worker':>19} {'written vs own':>14} {'TP all-reduces':>14} {'expert loads':>12}"
    )
    for name, r in rows.items():
        own = r["reloaded_vs_own_engine_logits"]
        print(
            f"{name:<58} {r['workers']:>7} {r['losses'][0]:>10.4f} {r['losses'][-1]:>9.4f} "
            f"{r['loss_max_abs_diff']:>12.2e} {r['grad_norm_max_rel_diff']:>9.1e} "
            f"{r['reloaded_vs_one_worker_logits']:>19.2e} "
            f"{'-' if own is None else f'{own:.2e}':>14} {traffic(r.get('tensor_parallel_all_reduces')):>14} "
            f"{ ({None: '-', True: 'same'}.get(r['expert_loads_equal'], 'differ')):>12}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        **results_header(
            "tensor and pipeline parallelism: losses and written weights against one worker",
            "benchmarks/model_parallel.py",
            load_before,
        ),
        "seq_len": SEQ_LEN,
        "steps": STEPS,
        "rows": [{"layout": name, **r} for name, r in rows.items()],
    }
    path = RESULTS / "model_parallel.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
