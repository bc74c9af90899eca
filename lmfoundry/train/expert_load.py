"""The load of each MoE layer's experts over an optimizer step: summed over all ranks after the
step for the aux-free bias update (every rank applies the same) and the logged balance."""

from __future__ import annotations

import torch


class ExpertLoad:
    def __init__(self, model: torch.nn.Module):
        self.layers = model.moe_layers()
        self.counts = [torch.zeros(m.cfg.num_experts) for m in self.layers]  # summed over one optimizer step
        self.last_step: list[list[int]] = []  # the last applied step's tokens per expert, per layer

    def __bool__(self) -> bool:
        return bool(self.layers)

    def add_micro_batch(self) -> None:
        for count, layer in zip(self.counts, self.layers):
            count += layer.stats.tokens_per_expert

    def discard(self) -> None:
        """The step was not applied: its load is not counted."""
        for count in self.counts:
            count.zero_()

    def end_step(self) -> None:
        """Collective: sum each layer's load over all ranks, apply the same aux-free bias update
        everywhere, reset the counts."""
        loads = []
        for layer, count in zip(self.layers, self.counts):
            torch.distributed.all_reduce(count)
            layer.update_bias(count)
            loads.append([int(n) for n in count.tolist()])
            count.zero_()
        self.last_step = loads
