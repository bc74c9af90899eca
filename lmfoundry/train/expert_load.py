"""The load of each MoE layer's experts over an optimizer step: summed over all ranks after the
step for the aux-free bias update (every rank that holds a layer applies the same) and the
logged balance (every layer's, on every rank, also when pipeline stages hold different layers)."""

from __future__ import annotations

import functools

import torch


class ExpertLoad:
    def __init__(self, model: torch.nn.Module):
        moe = model.cfg.moe
        self.total = 0 if moe is None else max(0, model.cfg.n_layer - moe.first_dense_layers)  # the model's
        self.experts = 0 if moe is None else moe.num_experts
        self.layers = model.moe_layers()  # this rank's
        # where each of this rank's layers stands among the model's (a pipeline stage holds some)
        positions = getattr(model, "moe_layer_positions", None)
        self.positions = positions() if positions is not None else list(range(len(self.layers)))
        self.counts = [torch.zeros(m.cfg.num_experts) for m in self.layers]  # summed over one optimizer step
        self.last_step: list[list[int]] = []  # the last applied step's tokens per expert, per layer
        # a pipeline runs a step's micro-batches inside its engine: each block's forward counts
        # (the block's, not the layer's: a recomputation in backward runs the layer again)
        self.pipelined = hasattr(model, "moe_blocks")
        if self.pipelined:
            for i, block in enumerate(model.moe_blocks()):
                block.register_forward_hook(functools.partial(self._counted, i))

    def __bool__(self) -> bool:
        return self.total > 0

    def _counted(self, i: int, block, inputs, output) -> None:
        if block.training:
            self.counts[i] += self.layers[i].stats.tokens_per_expert

    def add_micro_batch(self) -> None:
        """The last forward's load (a pipeline's blocks count their own)."""
        if self.pipelined:
            raise RuntimeError(
                "a pipeline's blocks count their load in their forward: add_micro_batch would count twice"
            )
        for count, layer in zip(self.counts, self.layers):
            count += layer.stats.tokens_per_expert

    def discard(self) -> None:
        """The step was not applied: its load is not counted."""
        for count in self.counts:
            count.zero_()

    def end_step(self) -> None:
        """Collective (one all-reduce over every rank, whatever layers it holds): sum each layer's
        load over the ranks that hold it, apply the same aux-free bias update on each of them,
        reset the counts."""
        loads = torch.zeros(self.total, self.experts)
        for position, count in zip(self.positions, self.counts):
            loads[position] = count
            count.zero_()
        torch.distributed.all_reduce(loads)
        for position, layer in zip(self.positions, self.layers):
            layer.update_bias(loads[position])
        self.last_step = [[int(n) for n in row] for row in loads.tolist()]
