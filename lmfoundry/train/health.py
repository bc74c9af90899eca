"""Training health: non-finite losses and gradients are skipped, a run of them or a loss spike
calls for a rollback, and workers much slower than the fastest are named."""

from __future__ import annotations

import collections
import math
import statistics

from lmfoundry.train.config import HealthConfig


class Health:
    """Watches each micro-batch's loss and each optimizer step. A method returns why training
    diverged (a reason for a rollback), or None while the run is sound. Every rank calls the same
    methods with the same values (losses and step results are agreed across ranks first)."""

    def __init__(self, cfg: HealthConfig, accumulation: int):
        self.cfg, self.accumulation = cfg, accumulation
        self.nonfinite_losses = 0  # micro-batches in a row
        self.nonfinite_steps = 0  # optimizer steps in a row
        self.recent: collections.deque[float] = collections.deque(maxlen=cfg.spike_window)  # step losses

    @property
    def watches_spikes(self) -> bool:
        return bool(self.cfg.spike_factor)

    def nonfinite_loss(self) -> str | None:
        """A micro-batch's loss was not finite on some rank (the micro-batch is skipped)."""
        self.nonfinite_losses += 1
        if self.nonfinite_losses < 2 * self.accumulation:
            return None
        return f"{self.nonfinite_losses} micro-batches in a row had a non-finite loss"

    def finite_loss(self) -> None:
        self.nonfinite_losses = 0

    def step_not_applied(self) -> str | None:
        """DeepSpeed found the step's gradients non-finite and did not apply it."""
        self.nonfinite_steps += 1
        if self.nonfinite_steps < 2:
            return None
        return f"{self.nonfinite_steps} optimizer steps in a row had non-finite gradients"

    def step_applied(self) -> None:
        self.nonfinite_steps = 0

    def spike(self, step_loss: float) -> str | None:
        """The step's loss (mean across ranks) against the running median of the last steps'."""
        median = statistics.median(self.recent) if len(self.recent) >= self.recent.maxlen // 2 else math.inf
        if step_loss > self.cfg.spike_factor * median:
            return f"loss {step_loss:.3f} is above {self.cfg.spike_factor:g} x the running median {median:.3f}"
        self.recent.append(step_loss)
        return None

    def reset(self) -> None:
        """After a rollback: the steps watched so far are gone."""
        self.nonfinite_losses = self.nonfinite_steps = 0
        self.recent.clear()


def stragglers(busy: list[tuple[float, str]], factor: float) -> list[tuple[int, str, float]]:
    """(rank, host, ratio) of the workers whose busy time (waiting for data plus the forward
    pass, which involves no collective) exceeds `factor` times the fastest worker's."""
    fastest = min(seconds for seconds, _ in busy)
    if fastest <= 0:
        return []
    return [(rank, host, seconds / fastest) for rank, (seconds, host) in enumerate(busy) if seconds > factor * fastest]
