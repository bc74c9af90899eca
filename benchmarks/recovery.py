"""Recovery from a killed worker: seconds from the kill to the first resumed step, steps lost,
and whether the resumed run reproduces the uninterrupted one.

Builds a small packed corpus (the sample corpus, curated and packed), then runs the same
pretraining twice on 2 CPU workers (Ray Train + DeepSpeed ZeRO-2, gloo): once uninterrupted,
once with rank 1 killed by SIGKILL after step KILL_AT (a fault drill). Recovery is measured
from the drill's marker file (written just before the kill) to the wall time of the first step
the restarted workers log; steps lost are those trained after the last checkpoint and trained
again.

    python benchmarks/recovery.py                 # 40 steps, checkpoint every 10, kill after 15
    python benchmarks/recovery.py --kill-at 19

Prints a table; writes benchmarks/results/recovery.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--checkpoint-every", type=int, default=10)
    p.add_argument("--kill-at", type=int, default=15)
    args = p.parse_args()

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
        run_pack(PackConfig(input=f"{work}/curated", output=f"{work}/packed", vocab_size=1024, seq_len=64,
                            val_fraction=0.1))
        runs = {}
        for name, drills in (("uninterrupted", []), ("killed", [FaultDrill(at_step=args.kill_at, rank=1)])):
            cfg = PretrainConfig(
                data=f"{work}/packed", output=f"{work}/{name}",
                model=ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2), num_workers=2, zero_stage=2,
                micro_batch_size=4, global_batch_tokens=2 * 4 * 64 * 2, max_steps=args.steps, warmup_steps=5,
                lr=5e-3, checkpoint_every=args.checkpoint_every, log_every=1, drills=drills)
            started = time.time()
            run_pretrain(cfg)
            rows = [json.loads(line) for line in open(f"{work}/{name}/metrics.jsonl")]
            runs[name] = {"seconds": time.time() - started, "rows": rows}
            if drills:
                [marker] = Path(f"{work}/{name}/_drills").iterdir()
                runs[name]["killed_at"] = marker.stat().st_mtime
    killed_at = runs["killed"]["killed_at"]
    resumed = next(r for r in runs["killed"]["rows"] if r["time"] > killed_at)
    last_checkpoint = args.kill_at // args.checkpoint_every * args.checkpoint_every
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "steps": args.steps, "checkpoint_every": args.checkpoint_every, "killed_after_step": args.kill_at,
        "recovery_s": resumed["time"] - killed_at, "first_resumed_step": resumed["step"],
        "steps_lost": args.kill_at - last_checkpoint,
        "run_s": {name: r["seconds"] for name, r in runs.items()},
        "losses_bitwise_equal": [r["loss"] for r in runs["killed"]["rows"]]
        == [r["loss"] for r in runs["uninterrupted"]["rows"]],
    }
    print(f"{'run':<15} {'seconds':>8}")
    for name, secs in out["run_s"].items():
        print(f"{name:<15} {secs:8.1f}")
    print(f"killed after step {args.kill_at}; first resumed step {resumed['step']} logged {out['recovery_s']:.1f} s "
          f"after the kill; steps lost {out['steps_lost']} (checkpoint every {args.checkpoint_every}); losses "
          f"bitwise equal to the uninterrupted run: {out['losses_bitwise_equal']}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "recovery.json").write_text(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
