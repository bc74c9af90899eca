"""Recovery from a killed worker and from a lost node: seconds from the failure to the first
resumed step, steps lost, and whether the resumed run reproduces the uninterrupted one.

Builds a small packed corpus (the sample corpus, curated and packed), then runs the same
pretraining twice on 2 CPU workers (Ray Train + DeepSpeed ZeRO-2, gloo): once uninterrupted,
once with rank 1 killed by SIGKILL after step KILL_AT (a fault drill). Recovery is measured
from the drill's marker file (written just before the kill) to the wall time of the first step
the restarted workers log; steps lost are those trained after the last checkpoint and trained
again. Then the elastic drill (benchmarks/harness/elastic_drill.py): the same run with
min_workers=1 on a three-node Ray cluster on this machine, a training node removed after step
--remove-at and added back after step --add-at; measured from each change to the first step the
resized group logs.

    python benchmarks/recovery.py                 # 40 steps, checkpoint every 10, kill after 15
    python benchmarks/recovery.py --kill-at 19

Prints a table; writes benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=15)
    p.add_argument("--remove-at", type=int, default=12, help="elastic: a training node removed after this step")
    p.add_argument("--add-at", type=int, default=25, help="elastic: and added back after this step")
    p.add_argument("--resize-interval", type=float, default=5.0, help="elastic: seconds between resize checks")
    args = p.parse_args()
    load_before = os.getloadavg()[0]  # the machine may be shared

    from harness.elastic_drill import run_elastic_drill
    from lifecycle import machine, recorded_command

    from lmfoundry.data.curate import CurateConfig, run_curate
    from lmfoundry.data.pack import PackConfig, run_pack
    from lmfoundry.data.sample_corpus import build_sample_corpus
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.train.config import FaultDrill, PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    init_ray()
    with tempfile.TemporaryDirectory(prefix="lmf-recovery-") as work:
        build_sample_corpus(f"{work}/raw", num_clean_docs=300, seed=1, shards=2)
        run_curate(CurateConfig(input=f"{work}/raw", output=f"{work}/curated"))
        run_pack(
            PackConfig(input=f"{work}/curated", output=f"{work}/packed", vocab_size=1024, seq_len=64, val_fraction=0.1)
        )
        runs = {}

        def config(name: str, **overrides) -> PretrainConfig:
            return PretrainConfig(
                data=f"{work}/packed",
                output=f"{work}/{name}",
                model=ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2),
                batch={"micro_batch_size": 4, "global_batch_tokens": 2 * 4 * 64 * 2},
                schedule={"max_steps": args.steps, "warmup_steps": 5},
                optimizer={"lr": 5e-3},
                checkpointing={"every": args.checkpoint_every},
                logging={"every": 1},
                **overrides,
            )

        def record(name: str, started: float) -> None:
            rows = [json.loads(line) for line in open(f"{work}/{name}/metrics.jsonl")]
            runs[name] = {"seconds": time.time() - started, "rows": rows}

        for name, drills in (("uninterrupted", []), ("killed", [FaultDrill(at_step=args.kill_at, rank=1)])):
            started = time.time()
            run_pretrain(config(name, drills=drills))
            record(name, started)
            if drills:
                [marker] = Path(f"{work}/{name}/_drills").iterdir()
                runs[name]["killed_at"] = marker.stat().st_mtime
        started = time.time()
        drill = run_elastic_drill(
            config(
                "elastic",
                parallelism={"num_workers": 2, "min_workers": 1, "elastic_resize_interval_s": args.resize_interval},
                health={"max_failures": 2},
            ),
            remove_after=args.remove_at,
            add_after=args.add_at,
        )
        record("elastic", started)
    elastic = runs["elastic"]["rows"]
    shrunk = next(r for r in elastic if r["world_size"] == 1)
    grown = next(r for r in elastic if r["world_size"] == 2 and r["time"] > drill.added_at)
    every = args.checkpoint_every
    reference = runs["uninterrupted"]["rows"]
    elastic_out = {
        "removed_after_step": args.remove_at,
        "added_after_step": args.add_at,
        "resize_interval_s": args.resize_interval,
        "shrink_s": shrunk["time"] - drill.removed_at,
        "first_step_at_1_worker": shrunk["step"],
        "grow_s": grown["time"] - drill.added_at,
        "first_step_at_2_workers_again": grown["step"],
        "steps_lost": (args.remove_at - args.remove_at // every * every) + (args.add_at - args.add_at // every * every),
        "world_size_by_step": [r["world_size"] for r in elastic],
        "max_relative_loss_difference": max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(elastic, reference)),
        "every_step_once": [r["step"] for r in elastic] == list(range(1, args.steps + 1)),
    }
    killed_at = runs["killed"]["killed_at"]
    resumed = next(r for r in runs["killed"]["rows"] if r["time"] > killed_at)
    last_checkpoint = args.kill_at // args.checkpoint_every * args.checkpoint_every
    out = {
        "benchmark": "recovery",
        "date": time.strftime("%Y-%m-%d"),
        "command": recorded_command("benchmarks/recovery.py"),
        "machine": machine(),
        "load_average_1min": {"before": round(load_before, 1), "after": round(os.getloadavg()[0], 1)},
        "steps": args.steps,
        "checkpoint_every": args.checkpoint_every,
        "killed_after_step": args.kill_at,
        "recovery_s": resumed["time"] - killed_at,
        "first_resumed_step": resumed["step"],
        "steps_lost": args.kill_at - last_checkpoint,
        "run_s": {name: r["seconds"] for name, r in runs.items()},
        "losses_bitwise_equal": [r["loss"] for r in runs["killed"]["rows"]]
        == [r["loss"] for r in runs["uninterrupted"]["rows"]],
        "elastic": elastic_out,
    }
    print(f"{'run':<15} {'seconds':>8}")
    for name, secs in out["run_s"].items():
        print(f"{name:<15} {secs:8.1f}")
    print(
        f"killed after step {args.kill_at}; first resumed step {resumed['step']} logged {out['recovery_s']:.1f} s "
        f"after the kill; steps lost {out['steps_lost']} (checkpoint every {args.checkpoint_every}); losses "
        f"bitwise equal to the uninterrupted run: {out['losses_bitwise_equal']}"
    )
    e = elastic_out
    print(
        f"elastic (num_workers 1-2, a node removed after step {e['removed_after_step']} and added after step "
        f"{e['added_after_step']}, resize check every {e['resize_interval_s']} s): first step at 1 worker (step "
        f"{e['first_step_at_1_worker']}) {e['shrink_s']:.1f} s after the removal, first step at 2 workers again "
        f"(step {e['first_step_at_2_workers_again']}) {e['grow_s']:.1f} s after the return; steps lost "
        f"{e['steps_lost']}; every step once: {e['every_step_once']}; losses within "
        f"{e['max_relative_loss_difference']:.1e} (relative) of the uninterrupted run"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
