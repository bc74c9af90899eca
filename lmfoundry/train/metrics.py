"""Metrics and reporting: the means of a logging interval, metrics.jsonl and the TensorBoard
event file in the run directory, and Ray Train's reports."""

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
