"""The per-worker training loop that Ray Train runs on every worker, for every objective.

Each worker wraps the objective's model (the same on every rank) in a DeepSpeed engine over the
process group Ray Train set up and trains on its slice of each global micro-batch. Checkpoints
are staged locally and persisted in the background; a restarted worker group resumes from the
newest valid one with the weights, optimizer and scheduler state, RNG states and data position
it had, so the run continues as if nothing had happened. A non-finite loss or gradient skips its
micro-batch or step; a run of them, or a loss spike, rolls back to a checkpoint before the damage
and skips the batches since. When the evaluation gate failed too often in a row (eval/watch.py
writes RUN/gate_action.json), the loop stops, or rolls back to the newest checkpoint that passed.
"""

from __future__ import annotations

import logging
import math
import socket
import time
import warnings
from collections.abc import Callable

import torch

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.hardware import device_peak_tflops
from lmfoundry.platform.log import get_logger
from lmfoundry.train import held_out
from lmfoundry.train.checkpointing import resume, stage_checkpoint, stage_root
from lmfoundry.train.config import TrainStageConfig, data_parallel
from lmfoundry.train.drills import Drills
from lmfoundry.train.engine import build_engine, deepspeed_config
from lmfoundry.train.expert_load import ExpertLoad
from lmfoundry.train.health import Health, stragglers
from lmfoundry.train.metrics import (
    LiveMetrics,
    MetricsFiles,
    MetricSums,
    MlflowRun,
    RayTrainReporter,
    imbalance,
    mean_across_ranks,
)
from lmfoundry.train.node_copies import on_each_node
from lmfoundry.train.objective import Objective
from lmfoundry.train.position import Position, timed
from lmfoundry.train.tensor_parallel import splits_embedding_vocabulary, splits_vocabulary

logger = get_logger(__name__)


def run(cfg: TrainStageConfig, run_dir: str, build_objective: Callable[[int, int], Objective]) -> None:
    """Train `cfg` on this worker: `build_objective(data_rank, data_world)` supplies model, batches
    and loss for its data-parallel rank (its rank, unless tensor parallelism groups the workers)."""
    import ray.train

    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank != 0:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO-2 calls a torch collective that torch has renamed; once per step it warns.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)
    if cfg.deterministic:
        use_deterministic_kernels()
    # the objective reads the batches of this worker's data-parallel rank
    objective = build_objective(*data_parallel(rank, world, cfg.parallelism))
    trainer = Trainer(cfg, run_dir, objective, rank, world)
    trainer.train()
    if objective.report is not None:  # measured by every worker on the final checkpoint (train/held_out.py)
        trainer.release_training_state()
        final_uri = held_out.final_checkpoint(run_dir)
        with on_each_node(run_dir, final_uri) as final_dir:
            figures = objective.report(trainer.engine, final_dir)
        if rank == 0:
            held_out.write_report(run_dir, final_uri, figures)


def use_deterministic_kernels() -> None:
    """PyTorch's deterministic mode: an op without a deterministic implementation raises instead of
    running a nondeterministic kernel; cuDNN picks no algorithm by benchmarking."""
    torch.use_deterministic_algorithms(True)
    torch.backends.cudnn.deterministic = True
    torch.backends.cudnn.benchmark = False


class Diverged(Exception):
    """Training went wrong in a way that only a rollback mends."""

    def __init__(self, reason: str, damaged_since: int):
        super().__init__(reason)
        self.reason, self.damaged_since = reason, damaged_since  # the first update that may be damaged


class GateRollback(Exception):
    """Failed evaluation gates ask training to go back to the newest checkpoint that passed."""

    def __init__(self, action: dict):
        super().__init__(f"roll back to step {action['to_step']}")
        self.action = action


class Trainer:
    def __init__(self, cfg: TrainStageConfig, run_dir: str, objective: Objective, rank: int, world: int):
        self.cfg, self.run_dir, self.objective, self.rank, self.world = cfg, run_dir, objective, rank, world
        self.ds_config = deepspeed_config(cfg, world, objective.seq_len, objective.num_params)
        self.engine, self.scheduler = build_engine(objective.model, cfg, self.ds_config, objective.initial_values)
        objective.initial_values = None  # read: their checkpoint file is not kept open for the run
        objective.attach(self.engine)
        self.accum = self.ds_config["gradient_accumulation_steps"]
        # DeepSpeed's pipeline engine takes a whole step's micro-batches at once
        self.pipelined = cfg.parallelism.pipeline_parallel_size > 1
        self.pending: list = []  # a pipelined step's micro-batches, until it has them all
        if rank == 0:
            logger.info(
                "%s: %.2fM parameters, %d workers, tensor parallel %d, pipeline stages %d, ZeRO-%d, micro batch %d, "
                "grad accumulation %d",
                objective.kind,
                objective.num_params / 1e6,
                world,
                cfg.parallelism.tensor_parallel_size,
                cfg.parallelism.pipeline_parallel_size,
                cfg.parallelism.zero_stage,
                cfg.batch.micro_batch_size,
                self.accum,
            )
        self.peak_tflops = cfg.logging.peak_tflops_per_worker or device_peak_tflops(
            torch.cuda.get_device_name() if torch.cuda.is_available() else None
        )
        self.drills = Drills(cfg.drills, rank, run_dir)
        self.checkpointer = checkpoint.AsyncCheckpointer(
            run_dir,
            rank,
            world,
            cfg.checkpointing.keep_last,
            cfg.checkpointing.keep_every,
            before_commit=self.drills.during_save,
        )
        self.staging = stage_root(cfg.checkpointing.stage_dir)
        self.metrics_files = MetricsFiles(run_dir)
        self.reporter = RayTrainReporter()
        self.health = Health(cfg.health, self.accum)
        self.expert_load = ExpertLoad(self.engine.module)
        self.sums = MetricSums()

        state = resume(self.engine, run_dir, rank, world) or {}
        self.position = Position.from_state(state)
        self.history: list[dict] = state.get("history", [])  # every logged step's metrics, for metrics.jsonl
        self.skipped, self.rollbacks = state.get("skipped_batches", 0), state.get("rollbacks", 0)
        self.micro = 0  # micro-batches trained on (counts the micro-steps of each optimizer step)
        self.busy_s, self.host = 0.0, socket.gethostname()  # data waits and forward passes, per log interval
        self.t_last, self.step_last = time.time(), self.position.step
        self.live = self.mlflow = None  # rank 0 exports the run's metrics
        if rank == 0:
            self.live = LiveMetrics(run_dir.rstrip("/").rsplit("/", 1)[-1], objective.kind)
            if state:  # this worker group took over from one that failed
                self.live.restarted()
            if cfg.logging.mlflow:
                self.mlflow = MlflowRun(cfg.logging.mlflow, run_dir, cfg.model_dump(mode="json"), self.position.step)

    # --- the loop ---------------------------------------------------------------------------

    def train(self) -> None:
        import torch.distributed as dist

        pos, max_steps = self.position, self.cfg.schedule.max_steps
        self.stopped_by_gate = self._stopped_earlier()
        while pos.step < max_steps and self.stopped_by_gate is None:
            try:
                finished_epoch = self._train_epoch()
            except Diverged as diverged:
                self._roll_back(diverged)
                continue
            except GateRollback as rollback:
                self._roll_back_to_passing(rollback.action)
                continue
            if finished_epoch:
                pos.next_epoch()
        self.checkpointer.wait()
        self.metrics_files.wait()
        if self.mlflow:
            self.mlflow.end()
        dist.barrier()  # rank 0's last commit waits for every rank's part: all are written now

    def release_training_state(self) -> None:
        """Once training is over: the optimizer's state and the engine's buffers go (DeepSpeed's
        `destroy`), so that what runs after (the final figures' models) has that memory. The
        engine keeps its config, device and model."""
        import gc

        self.engine.destroy()
        self.engine.optimizer = self.engine.lr_scheduler = self.scheduler = None
        gc.collect()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()

    def _train_epoch(self) -> bool:
        """Train on the rest of this epoch's micro-batches; False when the run ended inside it."""
        pos = self.position
        for (index, batch), waited in timed(self.objective.batches(pos.epoch, pos.batches_in_epoch)):
            train = self._pipeline_micro_batch if self.pipelined else self._micro_batch
            if not train(index, batch, waited):
                continue  # no optimizer step was completed
            if self.expert_load:
                self.expert_load.end_step()
            last = pos.step == self.cfg.schedule.max_steps
            save = pos.step % self.cfg.checkpointing.every == 0 or last
            if pos.step % self.cfg.logging.every == 0 or pos.step == 1 or save:
                self._log_step(save)
                if self._gate_action():
                    return False
            self.drills.after_step(pos.step)
            if last:
                return False
        return True

    # --- the evaluation gate's verdicts -----------------------------------------------------

    def _gate_action(self) -> bool:
        """Collective: carry out what failed gates ask (eval/watch.py). True when training stops
        here; a rollback raises GateRollback."""
        action = self._read_on_rank0(checkpoint.read_gate_action)
        if action is None:
            return False
        if action.get("action") == "rollback" and isinstance(action.get("to_step"), int):
            raise GateRollback(action)
        if self.rank == 0:
            logger.error(
                "step %d: the evaluation gate failed at steps %s in a row: training stops",
                self.position.step,
                action.get("failed_steps"),
            )
        self._gate_action_done(action)
        self.stopped_by_gate = {**action, "stopped_at_step": self.position.step}
        return True

    def _stopped_earlier(self) -> dict | None:
        """Collective: the stop an earlier worker group of this run carried out (a group that
        takes over after it, e.g. one restarted while the final figures were measured, trains
        no further), or None."""
        return self._read_on_rank0(checkpoint.carried_out_stop)

    def _read_on_rank0(self, read: Callable[[str], dict | None]) -> dict | None:
        """Collective: what `read(run_dir)` gives on rank 0, on every rank."""
        import torch.distributed as dist

        found = [read(self.run_dir) if self.rank == 0 else None]
        dist.broadcast_object_list(found, src=0)
        return found[0]

    def _gate_action_done(self, action: dict) -> None:
        if self.rank == 0:
            done = {**action, "done": True, "carried_out_at_step": self.position.step, "done_at": time.time()}
            storage.write_json_atomic(storage.join(self.run_dir, checkpoint.GATE_ACTION), done)

    def _roll_back_to_passing(self, action: dict) -> None:
        """Back to the newest checkpoint that passed its gate; the failed ones after it go (their
        steps are trained again, on fresh batches), and so do their evaluation records."""
        import torch.distributed as dist

        step, to_step = self.position.step, action["to_step"]
        self.checkpointer.wait()
        dist.barrier()
        if self.rank == 0:
            logger.error(
                "step %d: the gate failed at steps %s in a row; rolling back to step %d",
                step,
                action.get("failed_steps"),
                to_step,
            )
            for later, uri in checkpoint.committed_checkpoints(self.run_dir):
                if later > to_step:
                    storage.remove_dir(uri)
                    record = checkpoint.eval_path(self.run_dir, later)
                    if storage.exists(record):
                        storage.remove_file(record)
        dist.barrier()
        state = resume(self.engine, self.run_dir, self.rank, self.world, before_step=to_step + 1)
        if state is None or state["step"] != to_step:
            raise RuntimeError(
                f"rolling back to step {to_step}, the last checkpoint that passed its gate, failed: "
                f"{'it is gone' if state is None else 'resumed step ' + str(state['step'])}"
            )
        self._restored(state)
        self._gate_action_done(action)

    def _micro_batch(self, index: int, batch, waited: float) -> bool:
        """Forward and backward through one micro-batch; True when it completed an optimizer step.
        Raises Diverged when training must roll back."""
        import torch.distributed as dist

        pos, engine = self.position, self.engine
        started = time.perf_counter()
        loss, stats = self.objective.loss(engine, batch)
        pos.batches_in_epoch = index + 1
        finite = torch.tensor([float(torch.isfinite(loss.detach()).item())])
        self.busy_s += waited + time.perf_counter() - started
        dist.all_reduce(finite, op=dist.ReduceOp.MIN)
        if not finite.item():  # on any rank: every rank passes over this micro-batch
            self.skipped += 1
            logger.warning(
                "step %d: non-finite loss on some rank; micro-batch %d of epoch %d skipped",
                pos.step + 1,
                index,
                pos.epoch,
            )
            reason = self.health.nonfinite_loss()
            if reason:
                raise Diverged(reason, pos.step)
            return False
        self.health.finite_loss()
        if self.expert_load:
            self.expert_load.add_micro_batch()
        drilled = self.drills.nan_gradients(pos.step + 1, engine.module)
        engine.backward(loss)
        if drilled:
            drilled.remove()
        if (self.micro + 1) % self.accum == 0:
            self.drills.before_optimizer_step(pos.step + 1, engine.optimizer)
        engine.step()
        self.micro += 1
        self.sums.add({"loss": loss.item(), **stats})
        if self.micro % self.accum:
            return False
        if not engine.was_step_applied():
            self._skip_step()
            return False
        return self._apply_step()

    def _pipeline_micro_batch(self, index: int, batch, waited: float) -> bool:
        """Keep a micro-batch for the pipelined step; with the step's last, run the step through
        the pipeline (forward and backward of every micro-batch on the 1F1B schedule, then the
        optimizer step). True when it completed an optimizer step."""
        pos, engine = self.position, self.engine
        self.pending.append(self.objective.pipeline_inputs(batch))
        pos.batches_in_epoch = index + 1
        # data waits only: the pipeline's step waits on the other stages (no straggler signal)
        self.busy_s += waited
        if len(self.pending) < self.accum:
            return False
        step, self.pending = self.pending, []
        self.drills.before_optimizer_step(pos.step + 1, engine.optimizer)
        drilled = self.drills.nan_gradients(pos.step + 1, engine.module)
        try:
            loss = float(engine.train_batch(iter(step)))  # the step's mean over every micro-batch and replica
        finally:
            if drilled:
                drilled.remove()
        self.micro += self.accum
        if not engine.was_step_applied():  # DeepSpeed found non-finite gradients
            self._skip_step()
            return False
        if not math.isfinite(loss):  # the same on every stage: the step was applied to the weights
            reason = self.health.nonfinite_loss() or "a non-finite loss in a pipelined step that was applied"
            raise Diverged(reason, pos.step)
        self.health.finite_loss()
        self.sums.add({"loss": loss})
        return self._apply_step()

    def _skip_step(self) -> None:
        """DeepSpeed found the step's gradients non-finite on some rank (its global gradient norm:
        ZeRO stages 1-3, bf16, and ZeRO-0 in fp32 through train/engine.py) and left the weights, the optimizer and the schedule as they were: the
        step is not taken and its micro-batches are passed over."""
        self.skipped += self.accum
        self.sums.drop_step()
        self.expert_load.discard()
        logger.warning(
            "step %d: non-finite gradients on some rank; the optimizer step and its %d micro-batches are skipped",
            self.position.step + 1,
            self.accum,
        )
        reason = self.health.step_not_applied()
        if reason:
            raise Diverged(reason, self.position.step)

    def _apply_step(self) -> bool:
        self.health.step_applied()
        self.position.step += 1
        if self.health.watches_spikes:
            reason = self.health.spike(mean_across_ranks(self.sums.step_loss()))
            if reason:  # this step's loss already saw the update before it
                raise Diverged(reason, self.position.step - 1)
        self.sums.end_step()
        return True

    # --- rollback ---------------------------------------------------------------------------

    def _roll_back(self, diverged: Diverged) -> None:
        """Go back to a checkpoint written before the damage and keep the data position, so the
        batches trained on since that checkpoint are skipped."""
        import torch.distributed as dist

        step = self.position.step
        if not self.cfg.health.spike_factor:
            raise RuntimeError(
                f"training diverged at step {step}: {diverged.reason} (set health.spike_factor to roll back)"
            )
        logger.error("step %d: %s; rolling back", step, diverged.reason)
        self.checkpointer.wait()
        dist.barrier()
        state = resume(self.engine, self.run_dir, self.rank, self.world, before_step=diverged.damaged_since)
        if state is None:
            raise RuntimeError(
                f"training diverged at step {step} ({diverged.reason}) and no checkpoint before "
                f"step {diverged.damaged_since} is there to roll back to"
            )
        logger.error("rolled back from step %d to step %d; the batches in between are skipped", step, state["step"])
        self._restored(state)

    def _restored(self, state: dict) -> None:
        """The loop's own state after the engine was rolled back to the checkpoint of `state`."""
        self.position.step, self.history = state["step"], state["history"]
        self.rollbacks += 1
        self.micro, self.pending = 0, []
        self.sums.clear()
        self.expert_load.discard()  # a rolled-back step's load moves no routing bias
        self.health.reset()
        self.t_last, self.step_last = time.time(), self.position.step

    # --- logging and saving -----------------------------------------------------------------

    def _log_step(self, save: bool) -> None:
        """Collective: the interval's metrics (logged, kept in the history, reported) and, when
        `save`, a checkpoint."""
        metrics = self._metrics()
        self.history.append(metrics)
        if self.rank == 0:
            logger.info(
                "%s step %d/%d loss %.4f %s",
                self.objective.kind,
                metrics["step"],
                self.cfg.schedule.max_steps,
                metrics["loss"],
                self.objective.describe(metrics),
            )
        if save:
            blocked = time.perf_counter()
            self._save(metrics["loss"])
            metrics["checkpoint_blocking_s"] = time.perf_counter() - blocked
            if self.rank == 0:
                self.metrics_files.write(self.history)
        if self.rank == 0:
            self.live.step(metrics)
            if self.mlflow:
                self.mlflow.log(metrics)
        self.reporter.maybe_report(metrics, force=save)
        self.t_last, self.step_last = time.time(), self.position.step

    def _metrics(self) -> dict:
        import torch.distributed as dist

        pos, objective = self.position, self.objective
        means = self.sums.take_means()
        now = time.time()
        steps = pos.step - self.step_last
        metrics = {
            "step": pos.step,
            "epoch": pos.epoch,
            **means,
            "lr": self.scheduler.get_last_lr()[0],
            "grad_norm": float(self.engine.get_global_grad_norm() or 0.0),
            "step_time_s": (now - self.t_last) / max(steps, 1),
            "skipped_batches": self.skipped,
            "rollbacks": self.rollbacks,
            "world_size": self.world,
            "time": now,
        }
        if objective.tokens_per_step:
            metrics["tokens_per_s"] = steps * objective.tokens_per_step / max(now - self.t_last, 1e-9)
            tflops = metrics["tokens_per_s"] * objective.flops_per_token / self.world / 1e12  # achieved, per worker
            metrics["tflops_per_worker"] = tflops
            if self.peak_tflops:
                metrics["mfu"] = tflops / self.peak_tflops
        busy = [None] * self.world
        dist.all_gather_object(busy, (self.busy_s, self.host))
        self.busy_s = 0.0
        metrics["worker_busy_s"] = [seconds for seconds, _ in busy]
        for slow_rank, slow_host, ratio in stragglers(busy, self.cfg.health.straggler_factor):
            if self.rank == 0:
                logger.warning(
                    "step %d: rank %d on %s is a straggler: %.2f x the fastest worker's data and forward time",
                    pos.step,
                    slow_rank,
                    slow_host,
                    ratio,
                )
        if self.expert_load:
            # the split the model was built with (build_model): an elastic run's changes with its
            # world size (ParallelismConfig.at_world_size, applied to the config train_loop passes in);
            # read from the config, since a pipeline stage may hold no MoE layer to read it from
            metrics["expert_parallel_size"] = self.cfg.parallelism.expert_parallel_size
            metrics["expert_imbalance"] = imbalance(self.expert_load.last_step)
            metrics["tokens_per_expert"] = self.expert_load.last_step
        return metrics

    def _save(self, loss: float) -> None:
        pos, objective = self.position, self.objective
        self.checkpointer.wait()  # the snapshot buffers are free once the last save is written
        train_state = {
            "step": pos.step,
            "epoch": pos.epoch,
            "batches_in_epoch": pos.batches_in_epoch,
            "world_size": self.world,
            "tensor_parallel_size": self.cfg.parallelism.tensor_parallel_size,
            "pipeline_parallel_size": self.cfg.parallelism.pipeline_parallel_size,
            "virtual_stages": self.cfg.parallelism.virtual_stages,  # which layers each stage's files hold
            "vocab_parallel": splits_vocabulary(self.engine),  # as the engine split it: what a resume compares
            "vocab_parallel_embedding": splits_embedding_vocabulary(self.engine),
            **objective.train_state(pos.step),
            "loss": loss,
            "skipped_batches": self.skipped,
            "rollbacks": self.rollbacks,
            "history": self.history,
            "loss_history": [[h["step"], h["loss"]] for h in self.history],
            "seed": self.cfg.seed,
            "config": self.cfg.model_dump(mode="json"),
        }
        staged, write = stage_checkpoint(
            self.engine,
            self.rank,
            pos.step,
            train_state,
            objective.tokenizer_json,
            objective.chat_template,
            self.staging,
            objective.special_tokens,
            objective.adapter,
        )
        self.checkpointer.save(pos.step, staged, {"kind": f"lmfoundry.{objective.kind}", "step": pos.step}, write)
