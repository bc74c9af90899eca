"""The interleaved pipeline schedule (train/pipeline_schedule.py) on DeepSpeed's pipeline
engine. DeepSpeed's engine has no such schedule: it runs one stage a rank, on 1F1B.
train/pipeline_parallel.py builds each rank's chunks into one module, and this engine is
DeepSpeed's with its step's execution replaced: everything else (ZeRO-1 within each stage's
replicas, the tied embedding's gradient sum between the end stages, gradient clipping over the
whole model, the optimizer step, loss scaling, checkpoints) is DeepSpeed's own, called as its
1F1B schedule calls it.

Activations and their gradients travel by asynchronous sends and blocking receives, in a process
group for each kind and direction (pipeline_schedule.channel: at two stages both kinds go both
ways between the same two ranks, and NCCL matches a pair's transfers in one queue a group). A
send's buffer is let go as soon as a later message from its receiver proves it arrived
(pipeline_schedule.release_points): gloo reports no send complete before it is waited on, and
keeping every send to the end of the step would hold m x v activations. The tests run the
orders through a model of each transport (gloo's blocking receives, NCCL's matching queues);
the engine itself has run on gloo only.
"""

from __future__ import annotations

import time

import torch
import torch.distributed as dist
from deepspeed.runtime.engine import DeepSpeedEngine
from deepspeed.runtime.pipe.engine import PipelineEngine

from lmfoundry.train.pipeline_schedule import (
    ACTIVATION,
    FORWARD,
    GRADIENT,
    channel,
    interleaved_order,
    messages,
    receiving_stage,
    release_points,
    transfer_pairs,
)


def make_interleaved(engine) -> None:
    """A DeepSpeed PipelineEngine over a module built with virtual stages
    (pipeline_parallel.pipeline_module), made to run its steps on the interleaved schedule. Its
    class is swapped because `deepspeed.initialize` builds the engine and takes no class to build;
    the subclass adds no state of its own beyond what is set here. Collective: every rank makes
    the transfers' process groups (pipeline_schedule.channel), over the whole world."""
    engine.__class__ = InterleavedPipelineEngine
    world = range(dist.get_world_size())
    engine.transfer_groups = {
        (kind, direction): dist.new_group(ranks=world)
        for kind in (ACTIVATION, GRADIENT)
        for direction in ("later", "earlier")
    }
    engine.receive_wait_s = 0.0
    engine.step_plans = {}  # micro-batches a step -> this stage's order and its release points
    connect_transfer_pairs(engine)


def connect_transfer_pairs(engine) -> None:
    """One small transfer on every (group, pair of stages) the steps use, in one order on every
    rank of the pipeline, the lower stage sending: NCCL makes a pair's communicator at its first
    transfer (a blocking rendezvous of the two), which must not first happen mid-step while other
    transfers wait on the GPU. In that order each pair's transfer is the next of both its ranks,
    so every one completes."""
    stages, stage = engine.num_stages, engine.stage_id
    token = torch.zeros(1, device=engine.device)
    for route, low, high in transfer_pairs(stages, engine.module.virtual_stages):
        if stage == low:
            dist.send(token, _peer(engine, high), group=engine.transfer_groups[route])
        elif stage == high:
            dist.recv(token, _peer(engine, low), group=engine.transfer_groups[route])
    if torch.cuda.is_available() and token.is_cuda:
        torch.cuda.synchronize()


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
        if data_iter is None:
            raise ValueError("train_batch() needs the step's micro-batches: an iterator of (inputs, targets)")
        batches = [next(data_iter) for _ in range(self.micro_batches)]
        self.module.train()
        self.total_loss, self.total_additional_losses, self.fwd_outputs = None, None, []
        try:
            self._run_step(batches)
        finally:
            self.module.chunk = 0
        self._exec_reduce_tied_grads()
        self._exec_reduce_grads()
        self._exec_optimizer_step()
        with torch.no_grad():
            self.agg_train_loss = self._aggregate_total_loss()
        return self.agg_train_loss

    def _run_step(self, batches: list) -> None:
        stages, chunks, stage = self.num_stages, self.module.virtual_stages, self.stage_id
        last = stages * chunks - 1
        if len(batches) not in self.step_plans:
            self.step_plans[len(batches)] = (
                interleaved_order(stages, chunks, len(batches), stage),
                release_points(stages, chunks, len(batches), stage),
            )
        order, release = self.step_plans[len(batches)]
        held: dict[tuple[int, int], tuple] = {}  # (chunk, micro-batch) -> its input and output
        sending: dict[int, tuple] = {}  # op index -> its asynchronous send and the tensor it sends
        inputs = batches[0][0]
        shape = (inputs.shape[0], inputs.shape[1] // self.module.sequence_shards(), self.module.cfg.d_model)
        dtype = next(self.module.parameters()).dtype

        def release_sends(index: int) -> None:
            """The sends op `index`'s message proves received (pipeline_schedule.release_points)."""
            for done in release[index]:
                sending.pop(done)[0].wait()

        def receive(message: tuple) -> torch.Tensor:
            buffer = torch.empty(shape, dtype=dtype, device=self.device)
            started = time.perf_counter()
            dist.recv(buffer, _peer(self, message[1] % stages), group=self.transfer_groups[channel(message, stages)])
            self.receive_wait_s += time.perf_counter() - started
            return buffer

        for index, (kind, chunk, micro) in enumerate(order):
            virtual = chunk * stages + stage
            received, sent = messages(stages, chunks, (kind, chunk, micro), stage)
            self.module.chunk = chunk
            if kind == FORWARD:
                x = batches[micro][0].to(self.device) if received is None else receive(received).requires_grad_()
                release_sends(index)
                out = DeepSpeedEngine.forward(self, x)
                if virtual == last:
                    out = self.module.loss_fn(out, batches[micro][1].to(self.device))
                    self.fwd_outputs.append(out.detach())
                    self.total_loss = out.detach() + (0 if self.total_loss is None else self.total_loss)
                held[(chunk, micro)] = (x, out)
                outgoing = out
            else:
                x, out = held.pop((chunk, micro))
                grad = None if received is None else receive(received)
                release_sends(index)
                if grad is None:  # the last virtual stage: the loss, divided by the accumulation
                    DeepSpeedEngine.backward(self, out)
                else:
                    if self.using_bf16_optimizer:
                        self.optimizer.clear_lp_grads()
                    self._running_engine_backward = True  # as DeepSpeed's own 1F1B backward
                    try:
                        out.backward(gradient=grad)
                    finally:
                        self._running_engine_backward = False
                    if self.using_bf16_optimizer and not self._config.bfloat16_config.immediate_grad_update:
                        self.optimizer.update_hp_grads(clear_lp_grads=False)
                outgoing = x.grad
            if sent is not None:
                tensor = outgoing.detach().contiguous()
                peer = _peer(self, receiving_stage(stages, sent))
                sending[index] = (dist.isend(tensor, peer, group=self.transfer_groups[channel(sent, stages)]), tensor)
        for work, _ in sending.values():
            work.wait()
