"""Metrics and reporting: the means of a logging interval, metrics.jsonl and the TensorBoard
event file in the run directory, Ray Train's reports, the live series of Ray's metrics API
(Prometheus and Grafana: platform/metrics.py) and, when configured, MLflow."""

from __future__ import annotations

import json
import math
import os
import tempfile
import threading
import time
from pathlib import Path

import torch

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.metrics import Series, record
from lmfoundry.platform.tracking import MlflowConfig, numeric, scalar_params


def mean_across_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


class MetricSums:
    """Sums of the objective's per-micro-batch metrics (the loss first) since the last logged
    step, and over the optimizer step in progress, which are taken back out of the interval when
    that step is not applied."""

    def __init__(self):
        self.sums: dict[str, float] = {}
        self.count = 0
        self.step_sums: dict[str, float] = {}
        self.step_count = 0

    def add(self, values: dict[str, float]) -> None:
        for name, value in values.items():
            self.sums[name] = self.sums.get(name, 0.0) + value
            self.step_sums[name] = self.step_sums.get(name, 0.0) + value
        self.count, self.step_count = self.count + 1, self.step_count + 1

    def step_loss(self) -> float:
        """This rank's mean loss over the optimizer step in progress."""
        return self.step_sums["loss"] / self.step_count

    def end_step(self) -> None:
        self.step_sums, self.step_count = {}, 0

    def drop_step(self) -> None:
        for name, value in self.step_sums.items():
            self.sums[name] = self.sums[name] - value
        self.count -= self.step_count
        self.end_step()

    def take_means(self) -> dict[str, float]:
        """Collective: each metric's mean over the interval and all ranks; the interval starts anew."""
        means = {name: mean_across_ranks(total / self.count) for name, total in self.sums.items()}
        self.sums, self.count = {}, 0
        return means

    def clear(self) -> None:
        self.sums, self.count = {}, 0
        self.end_step()


def imbalance(loads: list[list[int]]) -> float:
    """The worst layer's max over mean tokens per expert: 1.0 is perfectly even."""
    return max(max(layer) / max(sum(layer) / len(layer), 1e-9) for layer in loads)


TENSORBOARD_SCALARS = (
    "loss",
    "lr",
    "grad_norm",
    "tokens_per_s",
    "step_time_s",
    "tflops_per_worker",
    "mfu",
    "expert_imbalance",
    "expert_parallel_size",
    "skipped_batches",
    "rollbacks",
    "checkpoint_blocking_s",
)


class MetricsFiles:
    """metrics.jsonl and the TensorBoard event file of a run directory, both rewritten whole from
    the history of logged steps."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.tensorboard = TensorBoardWriter()

    def write(self, history: list[dict]) -> None:
        """metrics.jsonl, one JSON object per logged step (rewritten whole: object stores cannot
        append, and after a rollback or a restart the history is what the resumed run saw), with
        the evaluations of checkpoints recorded so far; the TensorBoard event file follows in the
        background."""
        history = checkpoint.attach_evals(history, self.run_dir)
        text = "".join(json.dumps(h) + "\n" for h in history)
        storage.write_bytes_atomic(storage.join(self.run_dir, "metrics.jsonl"), text.encode())
        self.tensorboard.write(self.run_dir, list(history))

    def wait(self) -> None:
        """Until the last TensorBoard render is written."""
        self.tensorboard.wait()


class TensorBoardWriter:
    """Renders the whole history as one TensorBoard event file on a background thread (thousands
    of scalars take seconds, which the training loop should not wait for); one render at a time."""

    def __init__(self):
        self.thread: threading.Thread | None = None

    def write(self, run_dir: str, history: list[dict]) -> None:
        self.wait()
        self.thread = threading.Thread(target=self._render, args=(run_dir, history), daemon=True)
        self.thread.start()

    def wait(self) -> None:
        if self.thread is not None:
            self.thread.join()
            self.thread = None

    @staticmethod
    def _render(run_dir: str, history: list[dict]) -> None:
        from tensorboardX import SummaryWriter

        with tempfile.TemporaryDirectory() as tmp:
            with SummaryWriter(tmp) as tb:
                for h in history:
                    for name in TENSORBOARD_SCALARS:
                        if isinstance(h.get(name), (int, float)):
                            tb.add_scalar(f"train/{name}", h[name], h["step"], walltime=h.get("time"))
                    for name, value in h.get("eval", {}).get("metrics", {}).items():
                        tb.add_scalar(f"eval/{name}", value, h["step"], walltime=h.get("time"))
            (event_file,) = Path(tmp).glob("events.out.tfevents.*")
            storage.write_bytes_atomic(
                storage.join(run_dir, "tensorboard", "events.out.tfevents.lmfoundry"), event_file.read_bytes()
            )


class RayTrainReporter:
    """Hands logged metrics to `ray.train.report` without holding the loop. Ray Train gives each
    worker a result queue of one that its controller empties once per poll (every
    RAY_TRAIN_HEALTH_CHECK_INTERVAL_S, 2 s by default), and a report blocks until the last one was
    taken, so a report at every fast step would hold training to one step a poll. The loops keep
    every logged step in metrics.jsonl and TensorBoard; Ray Train gets the newest at most once a
    poll, and always when forced (a save, the end). Every rank must report the same number of
    times (Ray Train synchronises reports), so rank 0's clock decides, broadcast to all:
    `maybe_report` is a collective."""

    def __init__(self, interval_s: float | None = None):
        self.interval_s = (
            float(os.environ.get("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "2.0")) if interval_s is None else interval_s
        )
        self.last = -math.inf  # rank 0's monotonic clock at the last report

    def maybe_report(self, metrics: dict, force: bool = False) -> None:
        import ray.train
        import torch.distributed as dist

        clock = torch.tensor([time.monotonic()], dtype=torch.float64)
        dist.broadcast(clock, src=0)
        if force or clock.item() - self.last >= self.interval_s:
            ray.train.report(metrics)
            self.last = clock.item()


RUN_TAGS = ("run", "objective")
SERIES = (
    Series("gauge", "lmfoundry_train_step", "the last logged optimizer step", RUN_TAGS),
    Series("gauge", "lmfoundry_train_loss", "mean loss of the last logging interval", RUN_TAGS),
    Series("gauge", "lmfoundry_train_tokens_per_s", "training tokens per second, all workers", RUN_TAGS),
    Series("gauge", "lmfoundry_train_mfu", "model FLOPs utilisation per worker (0 to 1)", RUN_TAGS),
    Series("gauge", "lmfoundry_train_grad_norm", "gradient norm at the last logged step", RUN_TAGS),
    Series("gauge", "lmfoundry_train_lr", "learning rate at the last logged step", RUN_TAGS),
    Series(
        "gauge",
        "lmfoundry_train_checkpoint_blocking_seconds",
        "how long the last save held training (the rest is written in the background)",
        RUN_TAGS,
    ),
    Series("gauge", "lmfoundry_train_skipped_batches", "micro-batches skipped for non-finite values", RUN_TAGS),
    Series("gauge", "lmfoundry_train_rollbacks", "rollbacks to an earlier checkpoint after a loss spike", RUN_TAGS),
    Series("counter", "lmfoundry_train_restarts", "worker-group restarts resumed from a checkpoint", RUN_TAGS),
)
# a logged step's key -> the series it sets
_STEP_SERIES = {
    "step": "lmfoundry_train_step",
    "loss": "lmfoundry_train_loss",
    "tokens_per_s": "lmfoundry_train_tokens_per_s",
    "mfu": "lmfoundry_train_mfu",
    "grad_norm": "lmfoundry_train_grad_norm",
    "lr": "lmfoundry_train_lr",
    "checkpoint_blocking_s": "lmfoundry_train_checkpoint_blocking_seconds",
    "skipped_batches": "lmfoundry_train_skipped_batches",
    "rollbacks": "lmfoundry_train_rollbacks",
}


class LiveMetrics:
    """Rank 0's logged steps as Ray metrics, tagged with the run's name and objective."""

    def __init__(self, run: str, objective: str):
        self.metrics = {s.name: (s, s.make({"run": run, "objective": objective})) for s in SERIES}

    def _record(self, name: str, value: float) -> None:
        series, metric = self.metrics[name]
        record(metric, series.kind, value, {})

    def step(self, logged: dict) -> None:
        for key, name in _STEP_SERIES.items():
            value = logged.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):
                self._record(name, float(value))

    def restarted(self) -> None:
        self._record("lmfoundry_train_restarts", 1)


class MlflowRun:
    """Rank 0's logged steps in an MLflow run, opened through Ray Train's MLflow integration. A
    restarted worker group opens a new run under the same name, tagged with the step it resumed
    from, so each attempt's curve stays whole."""

    def __init__(self, cfg: MlflowConfig, run_dir: str, config: dict, resumed_from: int):
        from lmfoundry.platform.tracking import require_mlflow

        require_mlflow()
        from ray.air.integrations.mlflow import setup_mlflow

        self.mlflow = setup_mlflow(
            scalar_params(config),
            tracking_uri=cfg.tracking_uri,
            experiment_name=cfg.experiment,
            run_name=cfg.run_name or run_dir.rstrip("/").rsplit("/", 1)[-1],
            create_experiment_if_not_exists=True,
            tags={"lmfoundry.run_dir": run_dir, "lmfoundry.resumed_from_step": str(resumed_from)},
        )

    def log(self, logged: dict) -> None:
        values = numeric({k: v for k, v in logged.items() if k not in ("step", "time")})
        self.mlflow.log_metrics(values, step=int(logged["step"]))

    def end(self) -> None:
        self.mlflow.end_run()
