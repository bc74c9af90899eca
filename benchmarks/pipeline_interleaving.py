"""The interleaved pipeline schedule against DeepSpeed's 1F1B: step time of the same 8-block
model in 2 pipeline stages on 2 gloo processes (one thread each), 4 micro-batches a step, with 1
(DeepSpeed's engine), 2 and 4 virtual stages a stage (train/interleaved_pipeline.py). The
configurations run in turn, 5 rounds of 2 warm-up and 8 timed steps each, in the same processes;
the figures are the median and quartiles over the timed steps of every round. Beside each: the
planner's bubble (p - 1) / (v * m + p - 1) and the step time relative to 1F1B that the bubble
alone would give (transfers not counted), and, for the interleaved engine, the share of the step
each stage spent waiting on a receive (its bubble plus the transfers' own time; on gloo, whose
receives block).

    python benchmarks/pipeline_interleaving.py

Prints a table; writes benchmarks/results/pipeline_interleaving.json.
"""

from __future__ import annotations

import json
import os
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist
from harness.peak_memory import release_deepspeed_groups, spawn_ranks, start_rank
from lifecycle import results_header

from lmfoundry.planner.search import bubble_fraction
from lmfoundry.train.config import PretrainConfig

RESULTS = Path(__file__).resolve().parent / "results"
STAGES, MICRO_BATCHES, SEQ_LEN, MICRO_BATCH_SIZE = 2, 4, 128, 2
VIRTUAL = (1, 2, 4)
ROUNDS, WARMUP, TIMED = 5, 2, 8


def config(virtual: int) -> PretrainConfig:
    return PretrainConfig(
        data="-",
        output="-",
        model={"vocab_size": 1024, "max_seq_len": SEQ_LEN, "n_layer": 8, "d_model": 256, "n_head": 4},
        parallelism={
            "num_workers": STAGES,
            "pipeline_parallel_size": STAGES,
            "virtual_stages": virtual,
            "zero_stage": 1,
        },
        batch={"micro_batch_size": MICRO_BATCH_SIZE, "global_batch_tokens": MICRO_BATCHES * MICRO_BATCH_SIZE * SEQ_LEN},
        schedule={"max_steps": ROUNDS * (WARMUP + TIMED), "warmup_steps": 1},
    )


def _worker(rank: int, port: int, results) -> None:
    from lmfoundry.train.pretrain import build_pretrain_engine

    start_rank(rank, STAGES, port)
    generator = torch.Generator().manual_seed(0)
    steps: dict[int, list[float]] = {v: [] for v in VIRTUAL}
    waits: dict[int, list[float]] = {v: [] for v in VIRTUAL}
    try:
        for _ in range(ROUNDS):
            for virtual in VIRTUAL:
                engine, _, _ = build_pretrain_engine(config(virtual), STAGES, SEQ_LEN)
                for step in range(WARMUP + TIMED):
                    tokens = torch.randint(0, 1024, (MICRO_BATCHES, MICRO_BATCH_SIZE, SEQ_LEN + 1), generator=generator)
                    batches = iter([(t[:, :-1], t[:, 1:]) for t in tokens])
                    dist.barrier()
                    waited = getattr(engine, "receive_wait_s", 0.0)
                    started = time.perf_counter()
                    engine.train_batch(batches)
                    elapsed = time.perf_counter() - started
                    if step >= WARMUP:
                        steps[virtual].append(elapsed)
                        if hasattr(engine, "receive_wait_s"):
                            waits[virtual].append((engine.receive_wait_s - waited) / elapsed)
                dist.barrier()
                release_deepspeed_groups()
        results[rank] = {"steps": steps, "waits": waits}
    finally:
        dist.destroy_process_group()


def main() -> None:
    load_before = os.getloadavg()[0]
    results = spawn_ranks(_worker, (), STAGES)
    baseline = statistics.median(results[0]["steps"][1])
    rows = []
    for virtual in VIRTUAL:
        times = results[0]["steps"][virtual]
        step = statistics.median(times)
        quartiles = statistics.quantiles(times, n=4)
        bubble = bubble_fraction(STAGES, MICRO_BATCHES, virtual)
        waits = [results[r]["waits"][virtual] for r in range(STAGES)]
        rows.append(
            {
                "virtual_stages": virtual,
                "engine": "DeepSpeed 1F1B" if virtual == 1 else "lmfoundry interleaved",
                "step_s_median": round(step, 4),
                "step_s_quartiles": [round(quartiles[0], 4), round(quartiles[2], 4)],
                "step_vs_1f1b": round(step / baseline, 3),
                "planner_bubble": round(bubble, 4),
                "bubble_only_step_vs_1f1b": round((1 - bubble_fraction(STAGES, MICRO_BATCHES)) / (1 - bubble), 3),
                "receive_wait_share_by_stage": [round(statistics.median(w), 3) if w else None for w in waits],
            }
        )
    print(
        f"{'virtual stages':>14} {'engine':<22} {'step s':>7} {'quartiles':>13} {'vs 1F1B':>7} {'planner bubble':>14} "
        f"{'bubble alone vs 1F1B':>20} {'receive wait share (stage 0, 1)':>31}"
    )
    for r in rows:
        waits = ", ".join("-" if w is None else f"{w:.3f}" for w in r["receive_wait_share_by_stage"])
        print(
            f"{r['virtual_stages']:>14} {r['engine']:<22} {r['step_s_median']:>7.3f} "
            f"{r['step_s_quartiles'][0]:>6.3f}-{r['step_s_quartiles'][1]:<6.3f} {r['step_vs_1f1b']:>7.3f} "
            f"{r['planner_bubble']:>14.3f} {r['bubble_only_step_vs_1f1b']:>20.3f} {waits:>31}"
        )
    RESULTS.mkdir(exist_ok=True)
    out = {
        **results_header(
            "interleaved pipeline schedule against DeepSpeed's 1F1B: step time",
            "benchmarks/pipeline_interleaving.py",
            load_before,
        ),
        "stages": STAGES,
        "micro_batches": MICRO_BATCHES,
        "seq_len": SEQ_LEN,
        "micro_batch_size": MICRO_BATCH_SIZE,
        "model": "8 blocks, d_model 256, 4 heads, vocabulary 1,024",
        "rounds": ROUNDS,
        "timed_steps_per_round": TIMED,
        "rows": rows,
    }
    path = RESULTS / "pipeline_interleaving.json"
    path.write_text(json.dumps(out, indent=2) + "\n")
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
