"""The interleaved pipeline schedule (train/pipeline_schedule.py) on DeepSpeed's pipeline
engine. DeepSpeed's engine has no such schedule: it runs one stage a rank, on 1F1B.
train/pipeline_parallel.py builds each rank's chunks into one module, and this engine is
DeepSpeed's with its step's execution replaced: everything else (ZeRO-1 within each stage's
replicas, the tied embedding's gradient sum between the end stages, gradient clipping over the
whole model, the optimizer step, loss scaling, checkpoints) is DeepSpeed's own, called as its
1F1B schedule calls it.

Activations and their gradients travel by asynchronous sends and blocking receives, each kind in
a process group of its own, so that the two kinds between the same pair of ranks (at two stages,
both go both ways) never match each other's messages.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from lmfoundry.train.pipeline_schedule import FORWARD, interleaved_order


def make_interleaved(engine) -> None:
    """A DeepSpeed PipelineEngine over a module built with virtual stages
    (pipeline_parallel.pipeline_module), made to run its steps on the interleaved schedule. Its
    class is swapped because `deepspeed.initialize` builds the engine and takes no class to build;
    the subclass adds no state of its own beyond what is set here. Collective."""
    engine.__class__ = InterleavedPipelineEngine
    world = range(dist.get_world_size())
    engine.activation_group = dist.new_group(ranks=world)
    engine.gradient_group = dist.new_group(ranks=world)
    engine.receive_wait_s = 0.0


def _peer(engine, stage: int) -> int:
    """The global rank of `stage` in this rank's pipeline (same replica, same tensor-parallel rank)."""
    return engine.grid.stage_to_global(stage_id=stage)


class InterleavedPipelineEngine(PipelineEngine):
    """DeepSpeed's PipelineEngine running the interleaved schedule (see the module's doc)."""

    def _backward_prologue_per_tensor(self, grad):
        # every gradient that reaches a chunk's output is already the step's: the loss is
        # divided by the accumulation once, in DeepSpeed's backward on the last virtual stage
        return grad

    def eval_batch(self, *args, **kwargs):
        # DeepSpeed's would run each stage's first chunk only; lmfoundry evaluates the written weights
        raise NotImplementedError("the interleaved pipeline engine trains only: evaluate the weights it writes")

    def train_batch(self, data_iter=None):
        """One step: the step's micro-batches through every chunk of every stage, the gradients
        reduced, the optimizer stepped. Returns the step's mean loss, as DeepSpeed's does."""
        if not torch.is_grad_enabled():
            raise RuntimeError("train_batch() needs gradients enabled")
        batches = [next(data_iter) for _ in range(self.micro_batches)]
        self.module.train()
        self.total_loss, self.total_additional_losses, self.fwd_outputs = None, None, []
        self._run_step(batches)
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()
        self._exec_optimizer_step()
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        return self.agg_train_loss

    def _run_step(self, batches: list) -> None:
        stages, chunks = self.num_stages, self.module.virtual_stages
        last = stages * chunks - 1
        held: dict[tuple[int, int], tuple] = {}  # (chunk, micro-batch) -> its input and output
        sends: list = []  # asynchronous sends, kept (with their tensors) until they complete
        inputs = batches[0][0]
        shape = (inputs.shape[0], inputs.shape[1] // self.module.sequence_shards(), self.module.cfg.d_model)
        dtype = next(self.module.parameters()).dtype

        def send(tensor: torch.Tensor, virtual: int, group) -> None:
            tensor = tensor.contiguous()
            sends.append((dist.isend(tensor, _peer(self, virtual % stages), group=group), tensor))
            sends[:] = [(work, t) for work, t in sends if not work.is_completed()]

        def receive(virtual: int, group) -> torch.Tensor:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            started = time.perf_counter()
            dist.recv(buffer, _peer(self, virtual % stages), group=group)
            self.receive_wait_s += time.perf_counter() - started
            return buffer

        for kind, chunk, micro in interleaved_order(stages, chunks, len(batches), self.stage_id):
            virtual = chunk * stages + self.stage_id
            self.module.chunk = chunk
            if kind == FORWARD:
                if virtual == 0:
                    x = batches[micro][0].to(self.device)
                else:
                    x = receive(virtual - 1, self.activation_group).requires_grad_()
                out = DeepSpeedEngine.forward(self, x)
                if virtual == last:
                    out = self.module.loss_fn(out, batches[micro][1].to(self.device))
                    self.fwd_outputs.append(out.detach())
                    self.total_loss = out.detach() + (0 if self.total_loss is None else self.total_loss)
                else:
                    send(out.detach(), virtual + 1, self.activation_group)
                held[(chunk, micro)] = (x, out)
                continue
            x, out = held.pop((chunk, micro))
            if virtual == last:
                DeepSpeedEngine.backward(self, out)  # the loss, divided by the accumulation
            else:
                grad = receive(virtual + 1, self.gradient_group)
                if self.using_bf16_optimizer:
                    self.optimizer.clear_lp_grads()
                self._running_engine_backward = True  # as DeepSpeed's own 1F1B backward
                try:
                    out.backward(gradient=grad)
                finally:
                    self._running_engine_backward = False
                if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
                    self.optimizer.update_hp_grads(clear_lp_grads=False)
            if virtual > 0:
                send(x.grad, virtual - 1, self.gradient_group)
        for work, _ in sends:
            work.wait()
        self.module.chunk = 0
