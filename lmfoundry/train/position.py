"""The run's position: optimizer steps taken and the data consumed. Every worker reads the same
stream of global micro-batches, in an order the seed fixes, and trains on its own slice of each,
so the data position is one number per epoch (global micro-batches consumed) that a checkpoint
keeps and a resumed run skips past."""

from __future__ import annotations

import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import TypeVar

T = TypeVar("T")


@dataclass
class Position:
    step: int = 0  # optimizer steps applied
    epoch: int = 0
    batches_in_epoch: int = 0  # global micro-batches of the epoch consumed (trained on or skipped)

    @classmethod
    def from_state(cls, state: dict) -> Position:
        return cls(state.get("step", 0), state.get("epoch", 0), state.get("batches_in_epoch", 0))

    def next_epoch(self) -> None:
        self.epoch, self.batches_in_epoch = self.epoch + 1, 0


def timed(iterable: Iterable[T]) -> Iterator[tuple[T, float]]:
    """The items of an iterable, each with the seconds spent waiting for it."""
    iterator = iter(iterable)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item, time.perf_counter() - start


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    """The order of an epoch's n items (pairs, packed conversations) that the seed fixes."""
    order = list(range(n))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return order
