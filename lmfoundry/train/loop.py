"""The per-worker training loop that Ray Train runs on every worker.

Each worker builds the same model (same seed), wraps it in a DeepSpeed engine over the process
group Ray Train set up, and reads the packed sequences from Ray Data in an order fixed by the
seed: every worker sees the same stream of global micro-batches and trains on its own slice of
each, so the data position is one number (global micro-batches consumed in the epoch) that the
checkpoint keeps. Checkpoints are staged locally and persisted in the background
(platform/checkpoint.py); a restarted worker group resumes from the newest valid one with the
weights, optimizer and scheduler state, RNG states and data position it had, so the run
continues as if nothing had happened.
"""

from __future__ import annotations

import collections
import contextlib
import json
import logging
import math
import os
import random
import shutil
import signal
import socket
import statistics
import tempfile
import threading
import time
import uuid
import warnings
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE
from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
from lmfoundry.model.flops import train_flops_per_token
from lmfoundry.model.transformer import Transformer
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.hardware import device_peak_tflops
from lmfoundry.platform.log import get_logger
from lmfoundry.train.config import FaultDrill, PretrainConfig, deepspeed_config, wsd_schedule
from lmfoundry.train.expert_parallel import full_state, shard_model
from lmfoundry.train.snapshot import SnapshotCheckpointEngine

logger = get_logger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and embeddings are not decayed (as in GPT-3).
    Named, because DeepSpeed splits named groups further into expert and non-expert groups."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]


def mean_across_ranks(value: float) -> float:
    t = torch.tensor([value], dtype=torch.float64)
    torch.distributed.all_reduce(t)
    return t.item() / torch.distributed.get_world_size()


def _balance_experts(moe_layers, expert_load: list[torch.Tensor]) -> list[list[int]]:
    """After an optimizer step: sum each MoE layer's expert load over all ranks, apply the same
    aux-free bias update everywhere, reset the counts. Returns the tokens per expert per layer."""
    loads = []
    for layer, load in zip(moe_layers, expert_load):
        torch.distributed.all_reduce(load)
        layer.update_bias(load)
        loads.append([int(n) for n in load.tolist()])
        load.zero_()
    return loads


def imbalance(loads: list[list[int]]) -> float:
    """The worst layer's max over mean tokens per expert: 1.0 is perfectly even."""
    return max(max(layer) / max(sum(layer) / len(layer), 1e-9) for layer in loads)


def stragglers(busy: list[tuple[float, str]], factor: float) -> list[tuple[int, str, float]]:
    """(rank, host, ratio) of the workers whose busy time (waiting for data plus the forward
    pass, which involves no collective) exceeds `factor` times the fastest worker's."""
    fastest = min(seconds for seconds, _ in busy)
    if fastest <= 0:
        return []
    return [(rank, host, seconds / fastest) for rank, (seconds, host) in enumerate(busy) if seconds > factor * fastest]


def _timed(iterable):
    """The items of an iterable, each with the seconds spent waiting for it."""
    iterator = iter(iterable)
    while True:
        start = time.perf_counter()
        try:
            item = next(iterator)
        except StopIteration:
            return
        yield item, time.perf_counter() - start


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


def write_metrics(run_dir: str, history: list[dict]) -> None:
    """metrics.jsonl in the run directory, one JSON object per logged step (rewritten whole:
    object stores cannot append, and after a rollback or a restart the history is what the
    resumed run saw), with the evaluations of checkpoints recorded so far; the TensorBoard event
    file follows in the background."""
    history = checkpoint.attach_evals(history, run_dir)
    text = "".join(json.dumps(h) + "\n" for h in history)
    storage.write_bytes_atomic(storage.join(run_dir, "metrics.jsonl"), text.encode())
    TENSORBOARD.write(run_dir, list(history))


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


TENSORBOARD = TensorBoardWriter()


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


def stage_root(stage_dir: str | None) -> Path:
    """Where checkpoints are staged before the upload: `stage_dir`, else shared memory."""
    if stage_dir:
        return Path(stage_dir)
    shm = Path("/dev/shm")
    return shm if shm.is_dir() and os.access(shm, os.W_OK) else Path(tempfile.gettempdir())


def _rng_state() -> dict:
    return {"torch": torch.get_rng_state(), "python": random.getstate(), "numpy": np.random.get_state()}


def _set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    np.random.set_state(state["numpy"])


def _expert_parallel(engine) -> bool:
    return any(layer.ep_group is not None for layer in engine.module.moe_layers())


def _gathered(engine):
    """A context in which every parameter is whole: under ZeRO-3 each rank holds only a
    partition, and a servable checkpoint needs all of it."""
    if engine.zero_optimization_stage() != 3:
        return contextlib.nullcontext()
    import deepspeed

    return deepspeed.zero.GatheredParameters(list(engine.module.parameters()), modifier_rank=None)


def stage_checkpoint(
    engine, rank: int, step: int, state: dict, tokenizer_json: str, root: Path
) -> tuple[Path, Callable[[], None]]:
    """Collective: every rank snapshots its share of the full training state in memory
    (DeepSpeed's files: module, this rank's optimizer partition, scheduler; its RNG states) and
    rank 0 the servable model files, tokenizer and training state. Returns the local directory
    the files go to and the function that writes them there (for the background thread)."""
    root.mkdir(parents=True, exist_ok=True)
    staged = Path(tempfile.mkdtemp(prefix=f"lmfoundry-{checkpoint.step_name(step)}-rank{rank}-", dir=root))
    pool = engine.checkpoint_engine.pool
    engine.save_checkpoint(str(staged / "deepspeed"), tag="state", save_latest=False)
    rng = _rng_state()
    # DeepSpeed keeps one module file, rank 0's: each rank's own experts go in a file of its own
    own_experts = pool.snapshot(engine.module.state_dict(), ("own",)) if _expert_parallel(engine) else None
    with _gathered(engine):  # ZeRO-3: every rank lends its partition of the weights for the copy
        weights = full_state(engine.module)  # collective: gathers sharded experts
        weights = pool.snapshot(weights, ("servable",)) if rank == 0 else None
    write_deepspeed = engine.checkpoint_engine.take_writer()  # marks the pool busy until written
    module = engine.module

    def write() -> None:
        write_deepspeed()
        torch.save(rng, staged / "deepspeed" / f"rng-rank-{rank}.pt")
        if own_experts is not None:
            torch.save(own_experts, staged / "deepspeed" / f"module-rank-{rank}.pt")
        if rank == 0:
            save_model_files(module, staged, weights)
            (staged / TOKENIZER).write_text(tokenizer_json)
            (staged / CHAT_TEMPLATE_FILE).write_text(DEFAULT_CHAT_TEMPLATE)  # serving and export read it
            storage.write_json_atomic(str(staged / "train_state.json"), state)

    return staged, write


def resume(engine, run_dir: str, rank: int, world: int, before_step: int | None = None) -> dict | None:
    """Load the newest valid checkpoint of the run (older than `before_step`, when given) into
    the engine; its training state, or None when there is none. Rank 0 chooses (and clears
    saves cut short), so every rank loads the same."""
    import torch.distributed as dist

    chosen = [None]
    if rank == 0:
        for uri in checkpoint.remove_uncommitted(run_dir):
            logger.warning("removed checkpoint %s: its save was cut short (no manifest)", uri)
        chosen = [checkpoint.latest_valid(run_dir, before_step)]
    dist.broadcast_object_list(chosen, src=0)
    if chosen[0] is None:
        return None
    local = Path(checkpoint.local_copy(chosen[0]))
    state = json.loads((local / "train_state.json").read_text())
    written_by = state["world_size"]
    load_dir = local / "deepspeed"
    if written_by != world:
        if _expert_parallel(engine):
            raise ValueError(
                f"checkpoint {chosen[0]} was written by {written_by} workers and this run has {world}: "
                f"a change of world size is supported without expert parallelism only (each rank's "
                f"experts are its own files); resume with {written_by} workers"
            )
        load_dir = universal_copy(local, chosen[0])
        engine._config.load_universal_checkpoint = True  # read per load: this load only
        own_settings = [{k: g[k] for k in ("weight_decay", "name") if k in g} for g in engine.optimizer.param_groups]
    # DeepSpeed's MoE loader wants per-expert files that it writes only for its own MoE layers;
    # lmfoundry's experts come back from each rank's module file instead
    has_moe_layers, engine.has_moe_layers = engine.has_moe_layers, False
    try:
        engine.load_checkpoint(str(load_dir), tag="state", load_module_strict=True)
    finally:
        engine.has_moe_layers = has_moe_layers
        engine._config.load_universal_checkpoint = False
    if written_by != world:
        _mend_universal_load(engine, own_settings)
        dist.barrier()  # every rank of the node has loaded it: the converted copy can go
        if int(os.environ.get("LOCAL_RANK", "0")) == 0:
            shutil.rmtree(load_dir, ignore_errors=True)
    if _expert_parallel(engine):
        engine.module.load_state_dict(torch.load(local / "deepspeed" / f"module-rank-{rank}.pt"))
    _set_rng_state(torch.load(local / "deepspeed" / f"rng-rank-{rank % written_by}.pt", weights_only=False))
    if written_by != world:
        # the position counts global micro-batches of micro_batch_size x world rows; a checkpoint
        # sits on a step boundary, so the rows trained on divide evenly at the new world size
        state = {**state, "batches_in_epoch": state["batches_in_epoch"] * written_by // world}
    if rank == 0:
        logger.info(
            "resumed from %s: step %d, epoch %d, %d micro-batches into the epoch%s",
            chosen[0],
            state["step"],
            state["epoch"],
            state["batches_in_epoch"],
            f" (written by {written_by} workers, now {world})" if written_by != world else "",
        )
    return state


def _mend_universal_load(engine, own_settings: list[dict]) -> None:
    """Undo two slips of DeepSpeed's ZeRO-3 universal load (0.19,
    stage3.load_hp_checkpoint_state_from_checkpoint_dir_stage3), harmless for stages 1 and 2:
    every parameter group is given the first group's settings (weight decay on the norms and
    embeddings), and every group's optimizer state is given one shared `step` tensor, which
    AdamW then advances once per group per step (the wrong bias correction from the next step
    on). Each group gets its own settings and its own step counter back."""
    for group, own in zip(engine.optimizer.param_groups, own_settings):
        group.update(own)
    inner = getattr(engine.optimizer, "optimizer", engine.optimizer)
    for state in inner.state.values():
        if torch.is_tensor(state.get("step")):
            state["step"] = state["step"].clone()


def universal_copy(local: Path, uri: str) -> Path:
    """The checkpoint's ZeRO state as a DeepSpeed universal checkpoint (whole parameters and
    optimizer moments, no partitioning), which loads at any world size. The first rank of each
    node converts it into a node-local folder named by the checkpoint's manifest (its checksums),
    so another checkpoint at the same path never reuses it; the node's other ranks wait for it."""
    import hashlib
    import subprocess
    import sys

    import torch.distributed as dist

    identity = hashlib.sha256(uri.encode() + (local / checkpoint.CHECKPOINT_MANIFEST).read_bytes()).hexdigest()[:16]
    out = Path(tempfile.gettempdir()) / f"lmfoundry-universal-{identity}"
    deepspeed_dir = local / "deepspeed"
    if int(os.environ.get("LOCAL_RANK", "0")) == 0 and not (out / "latest_universal").exists():
        shutil.rmtree(out, ignore_errors=True)  # a conversion cut short
        scratch = Path(tempfile.mkdtemp(dir=out.parent, prefix=out.name + ".tmp-"))
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "deepspeed.checkpoint.ds_to_universal",
                "--input_folder",
                str(deepspeed_dir / "state"),
                "--output_folder",
                str(scratch / "state"),
                "--num_extract_workers",
                "1",
                "--num_merge_workers",
                "1",
                "--inject_missing_state",
            ],
            capture_output=True,
            text=True,
        )
        if done.returncode != 0:
            raise RuntimeError(
                f"converting {uri} to a universal checkpoint failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}"
            )
        (scratch / "latest_universal").write_text("state")
        try:
            os.replace(scratch, out)
        except OSError:  # another node on this machine converted it first (a test's nodes share /tmp)
            if not (out / "latest_universal").exists():
                raise
            shutil.rmtree(scratch, ignore_errors=True)
    dist.barrier()
    return out


def micro_batches(shard, cfg: PretrainConfig, rank: int, world: int, epoch: int, skip: int):
    """(index, tokens): this rank's slice of each global micro-batch of the epoch, in the order
    the seed fixes, passing over the first `skip` (already trained on)."""
    mbs = cfg.micro_batch_size
    shuffle = (
        {"local_shuffle_buffer_size": cfg.shuffle_buffer, "local_shuffle_seed": cfg.seed + epoch}
        if cfg.shuffle_buffer
        else {}
    )
    batches = shard.iter_torch_batches(batch_size=mbs * world, drop_last=True, dtypes=torch.long, **shuffle)
    for index, batch in enumerate(batches):
        if index >= skip:
            yield index, batch["tokens"][rank * mbs : (rank + 1) * mbs]


def build_engine(cfg: PretrainConfig, world: int, seq_len: int):
    """The model (same seed on every rank, experts sharded for expert parallelism) in a
    DeepSpeed engine that checkpoints asynchronously. Returns engine, scheduler, DeepSpeed config
    and the model's parameter count and training FLOPs per token (counted before ZeRO-3 partitions
    the weights, after which each rank's parameters look empty)."""
    import deepspeed

    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    if cfg.expert_parallel_size > 1:
        shard_model(model, cfg.expert_parallel_size)
    num_params, flops_per_token = model.num_params(), train_flops_per_token(model, seq_len)
    ds_config = deepspeed_config(cfg, world, seq_len, num_params)

    def wsd(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, wsd_schedule(cfg))

    client_scheduler = wsd if cfg.lr_schedule == "wsd" else None  # else DeepSpeed's from the config
    engine, _, _, scheduler = deepspeed.initialize(
        model=model,
        model_parameters=param_groups(model, cfg.weight_decay),
        config=ds_config,
        lr_scheduler=client_scheduler,
    )
    engine.checkpoint_engine = SnapshotCheckpointEngine(engine._config)
    return engine, scheduler, ds_config, num_params, flops_per_token


def train_loop(loop_config: dict) -> None:
    import ray.train
    import torch.distributed as dist

    cfg = PretrainConfig.model_validate(loop_config["cfg"])
    seq_len = loop_config["seq_len"]
    tokenizer_json = loop_config["tokenizer_json"]
    run_dir = loop_config["run_dir"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank != 0:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO-2 calls a torch collective that torch has renamed; once per step it warns.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    engine, scheduler, ds_config, num_params, flops_per_token = build_engine(cfg, world, seq_len)
    accum = ds_config["gradient_accumulation_steps"]
    tokens_per_step = cfg.global_batch_tokens
    if rank == 0:
        logger.info(
            "pretrain: %.2fM parameters, %d workers, ZeRO-%d, micro batch %d, grad accumulation %d "
            "(derived from global_batch_tokens=%d)",
            num_params / 1e6,
            world,
            cfg.zero_stage,
            cfg.micro_batch_size,
            accum,
            tokens_per_step,
        )

    peak = cfg.peak_tflops_per_worker or device_peak_tflops(
        torch.cuda.get_device_name() if torch.cuda.is_available() else None
    )
    drills = Drills(cfg.drills, rank, run_dir)
    checkpointer = checkpoint.AsyncCheckpointer(
        run_dir, rank, world, cfg.keep_checkpoints, cfg.keep_every, before_commit=drills.during_save
    )
    staging = stage_root(cfg.stage_dir)

    state = resume(engine, run_dir, rank, world) or {}
    step, epoch, position = state.get("step", 0), state.get("epoch", 0), state.get("batches_in_epoch", 0)
    history: list[dict] = state.get("history", [])  # every logged step's metrics, for metrics.jsonl
    skipped, rollbacks = state.get("skipped_batches", 0), state.get("rollbacks", 0)
    recent: collections.deque[float] = collections.deque(maxlen=cfg.spike_window)  # step losses
    step_sum, step_count, nonfinite_run, nonfinite_steps = 0.0, 0, 0, 0  # the last two: in a row
    busy_s, host = 0.0, socket.gethostname()  # this worker's data waits and forward passes, per log interval

    moe_layers = engine.module.moe_layers()
    expert_load = [torch.zeros(m.cfg.num_experts) for m in moe_layers]  # summed over one optimizer step
    step_loads: list[list[int]] = []  # the last optimizer step's tokens per expert, per MoE layer

    shard = ray.train.get_dataset_shard("train")
    micro = 0
    loss_sum, loss_count = 0.0, 0
    t_last, step_last = time.time(), step
    reporter = RayTrainReporter()
    device = engine.device
    while step < cfg.max_steps:
        finished_epoch = True
        for (index, tokens), waited in _timed(micro_batches(shard, cfg, rank, world, epoch, position)):
            started = time.perf_counter()
            tokens = tokens.to(device)
            loss = engine(tokens[:, :-1], tokens[:, 1:])[1]  # the logits are not kept alive
            position = index + 1
            finite = torch.tensor([float(torch.isfinite(loss.detach()).item())])
            busy_s += waited + time.perf_counter() - started
            dist.all_reduce(finite, op=dist.ReduceOp.MIN)
            diverged, damaged_since = None, step  # why we must roll back, and from which update on
            if not finite.item():  # on any rank: every rank passes over this micro-batch
                skipped, nonfinite_run = skipped + 1, nonfinite_run + 1
                logger.warning(
                    "step %d: non-finite loss on some rank; micro-batch %d of epoch %d skipped", step + 1, index, epoch
                )
                if nonfinite_run < 2 * accum:
                    continue
                diverged = f"{nonfinite_run} micro-batches in a row had a non-finite loss"
            else:
                nonfinite_run = 0
                for load, layer in zip(expert_load, moe_layers):
                    load += layer.stats.tokens_per_expert
                drilled = drills.nan_gradients(step + 1, engine.module)
                engine.backward(loss)
                if drilled:
                    drilled.remove()
                if (micro + 1) % accum == 0:
                    drills.before_optimizer_step(step + 1, engine.optimizer)
                engine.step()
                micro += 1
                loss_sum, step_sum = loss_sum + loss.item(), step_sum + loss.item()
                loss_count, step_count = loss_count + 1, step_count + 1
                if micro % accum:
                    continue
                if not engine.was_step_applied():
                    # DeepSpeed found the step's gradients non-finite on some rank (its global
                    # gradient norm, ZeRO stages 1-3) and left the weights, the optimizer and the
                    # schedule as they were: the step is not taken and its micro-batches are passed over
                    skipped, nonfinite_steps = skipped + accum, nonfinite_steps + 1
                    loss_sum, loss_count = loss_sum - step_sum, loss_count - step_count
                    step_sum, step_count = 0.0, 0
                    for load in expert_load:
                        load.zero_()
                    logger.warning(
                        "step %d: non-finite gradients on some rank; the optimizer step and its %d "
                        "micro-batches are skipped",
                        step + 1,
                        accum,
                    )
                    if nonfinite_steps < 2:
                        continue
                    diverged = f"{nonfinite_steps} optimizer steps in a row had non-finite gradients"
                else:
                    nonfinite_steps = 0
                    step += 1
                    if cfg.spike_factor:
                        step_loss = mean_across_ranks(step_sum / step_count)
                        median = statistics.median(recent) if len(recent) >= recent.maxlen // 2 else math.inf
                        if step_loss > cfg.spike_factor * median:
                            diverged = (
                                f"loss {step_loss:.3f} is above {cfg.spike_factor:g} x the running median {median:.3f}"
                            )
                            damaged_since = step - 1  # this step's loss already saw the update before it
                        else:
                            recent.append(step_loss)
                    step_sum, step_count = 0.0, 0
            if diverged:
                if not cfg.spike_factor:
                    raise RuntimeError(f"training diverged at step {step}: {diverged} (set spike_factor to roll back)")
                # go back to a checkpoint written before the damage and keep the data position, so
                # the batches trained on since that checkpoint are skipped
                logger.error("step %d: %s; rolling back", step, diverged)
                checkpointer.wait()
                dist.barrier()
                here = (epoch, position)
                state = resume(engine, run_dir, rank, world, before_step=damaged_since)
                if state is None:
                    raise RuntimeError(
                        f"training diverged at step {step} ({diverged}) and no checkpoint before "
                        f"step {damaged_since} is there to roll back to"
                    )
                logger.error(
                    "rolled back from step %d to step %d; the batches in between are skipped", step, state["step"]
                )
                step, history = state["step"], state["history"]
                epoch, position = here
                rollbacks += 1
                micro, loss_sum, loss_count, step_sum, step_count, nonfinite_run = 0, 0.0, 0, 0.0, 0, 0
                nonfinite_steps = 0
                recent.clear()
                t_last, step_last = time.time(), step
                finished_epoch = False
                break
            if moe_layers:
                step_loads = _balance_experts(moe_layers, expert_load)
            last = step == cfg.max_steps
            save = step % cfg.checkpoint_every == 0 or last
            if step % cfg.log_every == 0 or step == 1 or last or save:
                mean_loss = mean_across_ranks(loss_sum / loss_count)
                loss_sum, loss_count = 0.0, 0
                now = time.time()
                tokens_per_s = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                tflops = tokens_per_s * flops_per_token / world / 1e12  # achieved, per worker
                metrics = {
                    "step": step,
                    "epoch": epoch,
                    "loss": mean_loss,
                    "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(engine.get_global_grad_norm() or 0.0),
                    "tokens_per_s": tokens_per_s,
                    "step_time_s": (now - t_last) / max(step - step_last, 1),
                    "tflops_per_worker": tflops,
                    "skipped_batches": skipped,
                    "rollbacks": rollbacks,
                    "world_size": world,
                    "time": now,
                }
                busy = [None] * world
                dist.all_gather_object(busy, (busy_s, host))
                busy_s = 0.0
                metrics["worker_busy_s"] = [seconds for seconds, _ in busy]
                for slow_rank, slow_host, ratio in stragglers(busy, cfg.straggler_factor):
                    if rank == 0:
                        logger.warning(
                            "step %d: rank %d on %s is a straggler: %.2f x the fastest worker's data and forward time",
                            step,
                            slow_rank,
                            slow_host,
                            ratio,
                        )
                if peak:
                    metrics["mfu"] = tflops / peak
                if moe_layers:
                    metrics["expert_imbalance"] = imbalance(step_loads)
                    metrics["tokens_per_expert"] = step_loads
                history.append(metrics)
                if rank == 0:
                    logger.info(
                        "step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f%s",
                        step,
                        cfg.max_steps,
                        mean_loss,
                        metrics["lr"],
                        metrics["grad_norm"],
                        metrics["tokens_per_s"],
                        f" expert imbalance {metrics['expert_imbalance']:.2f}" if moe_layers else "",
                    )
                if save:
                    blocked = time.perf_counter()
                    checkpointer.wait()  # the snapshot buffers are free once the last save is written
                    train_state = {
                        "step": step,
                        "epoch": epoch,
                        "batches_in_epoch": position,
                        "world_size": world,
                        "tokens_seen": step * tokens_per_step,
                        "loss": mean_loss,
                        "skipped_batches": skipped,
                        "rollbacks": rollbacks,
                        "history": history,
                        "loss_history": [[h["step"], h["loss"]] for h in history],
                        "seed": cfg.seed,
                        "config": cfg.model_dump(mode="json"),
                    }
                    staged, write = stage_checkpoint(engine, rank, step, train_state, tokenizer_json, staging)
                    checkpointer.save(step, staged, {"kind": "lmfoundry.pretrain", "step": step}, write)
                    metrics["checkpoint_blocking_s"] = time.perf_counter() - blocked
                    if rank == 0:
                        write_metrics(run_dir, history)
                reporter.maybe_report(metrics, force=save)
                t_last, step_last = time.time(), step
            drills.after_step(step)
            if last:
                finished_epoch = False
                break
        if finished_epoch:
            epoch, position = epoch + 1, 0
    checkpointer.wait()
    TENSORBOARD.wait()
    dist.barrier()  # rank 0's last commit waits for every rank's part: all are written now
