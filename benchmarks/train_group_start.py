"""The fixed cost of a Ray Train run on this machine: `TorchTrainer.fit` of a function that
does nothing, on 2 CPU workers over gloo, on a local Ray already started, timed from `fit` to
the workers' first line and to `fit`'s return. Every Ray process the run starts is listed by
its actor class, with the seconds its constructor took (Ray's task events): each is a Python
process that imports Ray Train (and the workers torch) before it does anything.

    python benchmarks/train_group_start.py [--runs 3]

Prints a table; writes benchmarks/results/train_group_start.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import statistics
import tempfile
import time
from pathlib import Path

from lifecycle import results_header

RESULTS = Path(__file__).resolve().parent / "results"


def started_at(config: dict) -> None:
    """The train function: the moment it starts, in a file of its rank's."""
    import ray.train

    rank = ray.train.get_context().get_world_rank()
    Path(config["dir"], f"rank-{rank}").write_text(repr(time.time()))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=3)
    args = ap.parse_args()
    os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")  # as the test suite runs it
    load_before = os.getloadavg()[0]

    import ray
    from ray.train import RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer
    from ray.util.state import list_tasks

    from lmfoundry.platform.ray_env import init_ray

    init_ray()
    runs = []
    with tempfile.TemporaryDirectory() as scratch:
        for i in range(args.runs):
            marks = Path(scratch, f"run-{i}")
            marks.mkdir()
            trainer = TorchTrainer(
                started_at,
                train_loop_config={"dir": str(marks)},
                scaling_config=ScalingConfig(num_workers=2, resources_per_worker={"CPU": 1}),
                torch_config=TorchConfig(backend="gloo"),
                run_config=RunConfig(name=f"empty-{i}", storage_path=scratch),
            )
            began = time.time()
            trainer.fit()
            ended = time.time()
            first_line = min(float(p.read_text()) for p in marks.glob("rank-*"))
            runs.append({"began": began, "to_first_line_s": first_line - began, "fit_s": ended - began})
        time.sleep(2)  # the task events reach the state API a moment after
        constructors = collections.defaultdict(list)
        for task in list_tasks(limit=10_000, detail=True):
            if not task.name.endswith(".__init__"):
                continue
            times = {e["state"]: e["created_ms"] / 1000 for e in task.events or []}
            if (
                "PENDING_ARGS_AVAIL" in times
                and "FINISHED" in times
                and times["PENDING_ARGS_AVAIL"] >= runs[0]["began"]
            ):
                constructors[task.name.removesuffix(".__init__")].append(
                    times["FINISHED"] - times["PENDING_ARGS_AVAIL"]
                )
    ray.shutdown()

    actors = {
        name: {"per_run": round(len(seconds) / args.runs, 1), "median_s": round(statistics.median(seconds), 2)}
        for name, seconds in sorted(constructors.items())
    }
    summary = {
        "median_fit_s": round(statistics.median(r["fit_s"] for r in runs), 2),
        "median_to_first_line_s": round(statistics.median(r["to_first_line_s"] for r in runs), 2),
    }
    print(
        f"empty TorchTrainer.fit, 2 CPU workers, {args.runs} runs: median {summary['median_fit_s']} s "
        f"({summary['median_to_first_line_s']} s to the workers' first line)"
    )
    print(f"{'Ray process (actor)':<52} {'per run':>8} {'constructor s (median)':>23}")
    for name, row in actors.items():
        print(f"{name:<52} {row['per_run']:>8} {row['median_s']:>23}")
    RESULTS.mkdir(exist_ok=True)
    out = {
        **results_header(
            "fixed cost of a Ray Train run: an empty TorchTrainer.fit on 2 CPU workers",
            "benchmarks/train_group_start.py",
            load_before,
        ),
        **summary,
        "runs_s": [{k: round(v, 2) for k, v in r.items() if k != "began"} for r in runs],
        "actors": actors,
    }
    (RESULTS / "train_group_start.json").write_text(json.dumps(out, indent=2) + "\n")


if __name__ == "__main__":
    main()
