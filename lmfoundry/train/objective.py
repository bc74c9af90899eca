"""What a training stage supplies to the one training loop (train/skeleton.py): the model, a
batch source and a loss. Pretraining (train/pretrain.py), supervised fine-tuning (train/sft.py),
DPO (train/dpo.py), reward models (train/reward.py) and GRPO (train/grpo.py) are objectives."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch

from lmfoundry.model.lora import AdapterRef


class Objective(Protocol):
    kind: str  # names the stage in checkpoints and logs: "pretrain", "dpo"
    model: torch.nn.Module  # built the same on every rank (same seed); the engine wraps it
    num_params: int  # counted before the engine partitions anything
    seq_len: int  # tokens per sequence in the batch arithmetic (1 where the batch counts pairs)
    tokens_per_step: int | None  # for throughput and MFU; None where a step is not counted in tokens
    flops_per_token: float | None
    tokenizer_json: str  # saved with every checkpoint
    chat_template: str  # saved with every checkpoint: serving and export read it
    special_tokens: str | None  # special_tokens.json of an imported model, saved with every checkpoint
    adapter: AdapterRef | None  # a LoRA run's adapter settings and base: checkpoints hold the adapter only
    # a model built on the meta device: its parameters' initial values by their names (None: the
    # model's own `initial_values()`)
    initial_values: dict[str, Callable[[], torch.Tensor]] | None
    # the run's before-and-after figures, measured by every worker once training has finished:
    # report(engine, final checkpoint's local directory) -> figures (train/held_out.py); None
    # where the stage reports none
    report: Callable[[Any, str], dict] | None

    def attach(self, engine) -> None:
        """Called once the engine is built, on every rank (e.g. to place a reference model beside it;
        under ZeRO-3 that builds an engine of its own, a collective)."""

    def batches(self, epoch: int, skip: int) -> Iterator[tuple[int, Any]]:
        """(index, batch): this rank's slice of each global micro-batch of the epoch, in the order
        the seed fixes, from global micro-batch `skip` on."""

    def loss(self, engine, batch) -> tuple[torch.Tensor, dict[str, float]]:
        """The micro-batch's loss (to backpropagate) and more metrics to average over a logging
        interval (the loss itself is always logged)."""

    def describe(self, metrics: dict) -> str:
        """The rest of a logged step's log line, after the step and loss."""

    def train_state(self, step: int) -> dict:
        """What the stage adds to each checkpoint's train_state.json."""
