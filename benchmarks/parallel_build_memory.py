"""Peak memory of building a model-parallel or ZeRO-3 engine: a model built on the meta device,
each rank materialising only its part (train/meta_init.py, what `lmfoundry pretrain` does at
TP > 1, PP > 1 or ZeRO-3), against the same model built whole on every rank and then split.

Gloo processes, fp32, a model of about 180M parameters (714 MiB of weights, untied head): TP 2
(vocabulary- and sequence-parallel) under ZeRO 0 and 1, PP 2 and TP 2 x PP 2 (vocabulary- and
sequence-parallel too, on 4 processes) under ZeRO 1, and 2 and 8 data-parallel ranks under ZeRO-3 (each parameter
partitioned as it gets its value; a whole build is partitioned inside the optimizer's set-up). Each rank's
figures are the rise of its resident set from before the model exists to the start of
DeepSpeed's optimizer set-up (the model built, split and placed) and to the end of
`deepspeed.initialize` (ZeRO's buffers on top: on a GPU those are the GPU's, while the build is
the host's) (benchmarks/harness/parallel_build.py). The table shows the larger rank's, beside
the whole model's weights, the larger rank's parameters and the largest single parameter (what
a rank holds at once while materialising a split weight: its whole value before the cut).

    python benchmarks/parallel_build_memory.py

Prints a table; writes benchmarks/results/parallel_build_memory.json.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

from harness.parallel_build import build_both_ways
from lifecycle import results_header

from lmfoundry.model.transformer import ModelConfig
from lmfoundry.train.config import PretrainConfig

RESULTS = Path(__file__).resolve().parent / "results"
SEQ_LEN = 256
MIB = 2**20
BUILDS = {"meta": "meta device, own part materialised", "whole": "whole on every rank, then split"}
# name: (tensor parallel, pipeline stages, ZeRO stage, workers)
LAYOUTS = {
    "TP 2, ZeRO-0": (2, 1, 0, 2),
    "TP 2, ZeRO-1": (2, 1, 1, 2),
    "PP 2, ZeRO-1": (1, 2, 1, 2),
    "TP 2 x PP 2, ZeRO-1": (2, 2, 1, 4),
    "DP 2, ZeRO-3": (1, 1, 3, 2),
    "DP 8, ZeRO-3": (1, 1, 3, 8),
}


def config(tp: int, pp: int, zero_stage: int, workers: int) -> PretrainConfig:
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
            "num_workers": workers,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "zero_stage": zero_stage,
            "sequence_parallel": tp > 1,
            "vocab_parallel": tp > 1,
        },
        batch={"micro_batch_size": 1, "global_batch_tokens": SEQ_LEN * workers},
        schedule={"max_steps": 2, "warmup_steps": 1},
    )


def main() -> None:
    load_before = os.getloadavg()[0]
    started = time.time()
    rows = []
    for layout, shape in LAYOUTS.items():
        cfg = config(*shape)
        for way, ranks in build_both_ways(cfg, SEQ_LEN).items():
            rows.append(
                {
                    "layout": layout,
                    "build": BUILDS[way],
                    "peak_rise_before_optimizer_mib": max(r["peak_rise_before_optimizer_bytes"] for r in ranks.values())
                    / MIB,
                    "peak_rise_mib": max(r["peak_rise_bytes"] for r in ranks.values()) / MIB,
                    "model_mib": ranks[0]["model_bytes"] / MIB,
                    "rank_parameters_mib": max(r["rank_parameter_bytes"] for r in ranks.values()) / MIB,
                    "largest_parameter_mib": ranks[0]["largest_parameter_bytes"] / MIB,
                }
            )
    model = config(*LAYOUTS["TP 2, ZeRO-0"]).model
    print(
        f"Building a model-parallel engine ({model.n_layer} layers, d_model {model.d_model}, vocabulary {model.vocab_size})"
    )
    print(
        f"{'layout':20s} {'build':36s} {'before optimizer':>16s} {'peak rise MiB':>13s} {'model MiB':>9s} "
        f"{'rank params MiB':>15s} {'largest param MiB':>17s}"
    )
    for r in rows:
        print(
            f"{r['layout']:20s} {r['build']:36s} {r['peak_rise_before_optimizer_mib']:16.0f} "
            f"{r['peak_rise_mib']:13.0f} {r['model_mib']:9.0f} "
            f"{r['rank_parameters_mib']:15.0f} {r['largest_parameter_mib']:17.0f}"
        )
    ratios = {}
    for layout in LAYOUTS:
        meta, whole = (r for r in rows if r["layout"] == layout)
        for key in ("peak_rise_before_optimizer_mib", "peak_rise_mib"):
            ratios[f"{layout}: {key}"] = meta[key] / whole[key]
    for key, ratio in ratios.items():
        print(f"meta build / whole build, {key}: {ratio:.2f}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "parallel_build_memory.json"
    out.write_text(
        json.dumps(
            {
                **results_header(
                    "Peak memory of building a model-parallel engine",
                    "benchmarks/parallel_build_memory.py",
                    load_before,
                ),
                "model": model.model_dump(),
                "layouts": {
                    name: dict(zip(("tensor_parallel", "pipeline_stages", "zero_stage", "workers"), v))
                    for name, v in LAYOUTS.items()
                },
                "rows": rows,
                "meta_over_whole": ratios,
                "seconds": time.time() - started,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
