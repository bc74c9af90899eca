"""Fault drills (config.FaultDrill): real failures injected on purpose, to prove recovery."""

from __future__ import annotations

import math
import os
import signal
import time
import uuid

import torch

from lmfoundry.platform import storage
from lmfoundry.platform.log import get_logger
from lmfoundry.train.config import FaultDrill

logger = get_logger(__name__)


class Drills:
    """Fault drills (see FaultDrill), fired where one is due. Each firing leaves a marker in
    RUN/_drills, so a drill fires once across restarts and rollbacks."""

    def __init__(self, drills: list[FaultDrill], rank: int, run_dir: str):
        self.drills = list(enumerate(drills))
        self.rank, self.markers = rank, storage.join(run_dir, "_drills")

    def _pending(self, step: int, kind: str, during_save: bool = False, any_rank: bool = False):
        """(index, drill) of the drills due here that have not fired yet (or fire every attempt)."""
        due = []
        for i, drill in self.drills:
            if (drill.at_step, drill.kind, drill.during_save) != (step, kind, during_save):
                continue
            if drill.rank != self.rank and not any_rank:
                continue
            fired = [f for f in storage.list_files(self.markers) if f.rsplit("/", 1)[-1].startswith(f"drill-{i}-")]
            if not fired or drill.every_attempt:
                due.append((i, drill))
        return due

    def _mark(self, i: int) -> None:
        storage.write_bytes_atomic(storage.join(self.markers, f"drill-{i}-{uuid.uuid4().hex[:8]}"), b"")

    def _kill(self, step: int, during_save: bool) -> None:
        for i, _ in self._pending(step, "kill", during_save):
            self._mark(i)
            logger.warning(
                "fault drill: killing rank %d (pid %d) %s step %d",
                self.rank,
                os.getpid(),
                "while saving" if during_save else "after",
                step,
            )
            os.kill(os.getpid(), signal.SIGKILL)

    def after_step(self, step: int) -> None:
        self._kill(step, during_save=False)
        for i, drill in self._pending(step, "stall"):
            self._mark(i)
            logger.warning("fault drill: rank %d stalls for %.0f s after step %d", self.rank, drill.seconds, step)
            time.sleep(drill.seconds)

    def during_save(self, step: int) -> None:
        self._kill(step, during_save=True)

    def nan_gradients(self, step: int, model: torch.nn.Module):
        """For the micro-batch about to run backward in `step`: a hook that turns one weight's
        gradient to NaN when a nan_grad drill is due on this rank (its handle, to remove after the
        backward pass), else None."""
        due = self._pending(step, "nan_grad")
        if not due:
            return None
        for i, _ in due:
            self._mark(i)
        logger.warning("fault drill: rank %d gets NaN gradients in step %d", self.rank, step)
        weight = next(p for p in model.parameters() if p.requires_grad)
        return weight.register_hook(lambda grad: torch.full_like(grad, math.nan))

    def before_optimizer_step(self, step: int, optimizer) -> None:
        """Collective: every replica of the weights must take the same spike."""
        import torch.distributed as dist

        if not any(d.kind == "lr_spike" and d.at_step == step for _, d in self.drills):
            return  # the same on every rank: no collective on the hot path without a drill
        due = self._pending(step, "lr_spike", any_rank=True)
        dist.barrier()  # every rank has decided before the marker appears
        for i, drill in due:
            if drill.rank == self.rank:
                self._mark(i)
                logger.warning("fault drill: step %d with its learning rate multiplied by %g", step, drill.lr_factor)
            for group in optimizer.param_groups:
                group["lr"] *= drill.lr_factor
