"""Peak memory of building a tensor-parallel engine: a model built on the meta device, each rank
materialising only its shards (train/meta_init.py, what `lmfoundry pretrain` does at TP > 1
without a pipeline), against the same model built whole on every rank and then split.

Two gloo processes (TP 2, vocabulary- and sequence-parallel, untied head, ZeRO 0 and 1, fp32), a
model of about 180M parameters (714 MiB of fp32 weights). Each rank's figures are the rise of its
resident set from before the model exists to the start of DeepSpeed's optimizer set-up (the
model built, split and placed) and to the end of `deepspeed.initialize` (ZeRO's buffers on top:
on a GPU those are the GPU's, while the build is the host's) (benchmarks/harness/tp_build.py);
the table shows the larger rank's, beside the whole model's
weights, one rank's shards and the largest single parameter (what a rank holds at once while
materialising: the whole value of one parameter before its cut).

    python benchmarks/tp_build_memory.py

Prints a table; writes benchmarks/results/tp_build_memory.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness.tp_build import build_both_ways
from lifecycle import results_header

from lmfoundry.model.transformer import ModelConfig
from lmfoundry.train.config import PretrainConfig

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN = 256
MIB = 2**20
BUILDS = {"meta": "meta device, shards materialised", "whole": "whole on every rank, then split"}


def config(zero_stage: int) -> PretrainConfig:
    model = ModelConfig(
        vocab_size=32000,
        max_seq_len=SEQ_LEN,
        n_layer=8,
        d_model=1024,
        n_head=16,
        n_kv_head=4,
        ffn_hidden_size=4096,
        tie_embeddings=False,
    )
    return PretrainConfig(
        data="-",
        output="-",
        model=model,
        parallelism={
            "num_workers": 2,
            "tensor_parallel_size": 2,
            "zero_stage": zero_stage,
            "sequence_parallel": True,
            "vocab_parallel": True,
        },
        batch={"micro_batch_size": 1, "global_batch_tokens": SEQ_LEN},
        schedule={"max_steps": 2, "warmup_steps": 1},
    )


def main() -> None:
    load_before = os.getloadavg()[0]
    started = time.time()
    rows = []
    for stage in (0, 1):
        cfg = config(stage)
        for way, ranks in build_both_ways(cfg, SEQ_LEN).items():
            first = ranks[0]
            rows.append(
                {
                    "zero_stage": stage,
                    "build": BUILDS[way],
                    "peak_rise_before_optimizer_mib": max(r["peak_rise_before_optimizer_bytes"] for r in ranks.values())
                    / MIB,
                    "peak_rise_mib": max(r["peak_rise_bytes"] for r in ranks.values()) / MIB,
                    "model_mib": first["model_bytes"] / MIB,
                    "rank_parameters_mib": max(r["rank_parameter_bytes"] for r in ranks.values()) / MIB,
                    "largest_parameter_mib": first["largest_parameter_bytes"] / MIB,
                }
            )
    print(
        f"Building a TP 2 engine ({cfg.model.n_layer} layers, d_model {cfg.model.d_model}, vocabulary {cfg.model.vocab_size})"
    )
    print(
        f"{'ZeRO':>4s} {'build':36s} {'before optimizer':>16s} {'peak rise MiB':>13s} {'model MiB':>9s} "
        f"{'rank params MiB':>15s} {'largest param MiB':>17s}"
    )
    for r in rows:
        print(
            f"{r['zero_stage']:4d} {r['build']:36s} {r['peak_rise_before_optimizer_mib']:16.0f} "
            f"{r['peak_rise_mib']:13.0f} {r['model_mib']:9.0f} "
            f"{r['rank_parameters_mib']:15.0f} {r['largest_parameter_mib']:17.0f}"
        )
    ratios = {
        f"zero_{stage}_{key}": rows[2 * i][key] / rows[2 * i + 1][key]
        for i, stage in enumerate((0, 1))
        for key in ("peak_rise_before_optimizer_mib", "peak_rise_mib")
    }
    for key, ratio in ratios.items():
        print(f"meta build / whole build, {key}: {ratio:.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "tp_build_memory.json"
    out.write_text(
        json.dumps(
            {
                **results_header("Peak memory of building a TP 2 engine", "benchmarks/tp_build_memory.py", load_before),
                "config": cfg.model.model_dump(),
                "parallelism": cfg.parallelism.model_dump(include={"num_workers", "tensor_parallel_size"}),
                "rows": rows,
                "meta_over_whole_peak": ratios,
                "seconds": time.time() - started,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
