"""Launching a training stage on Ray Train: the run directory (skipped when committed, cleared
on overwrite, resumed when it holds checkpoints), the run directory as Ray's storage, the worker
group's scaling and restarts, a clear error when the restarts ran out, and the final checkpoint."""

from __future__ import annotations

import gc
import os
import signal
import threading
from pathlib import PurePosixPath

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.ray_env import cpu_worker_env
from lmfoundry.train.config import ParallelismConfig, TrainStageConfig

logger = get_logger(__name__)

# What deterministic GPU training needs in the worker's environment before CUDA and NCCL start:
# cuBLAS's fixed workspace (PyTorch's reproducibility notes) and one all-reduce algorithm (what
# Megatron's deterministic mode requires); the user's own NCCL_ALGO wins if it is Ring or Tree.
DETERMINISTIC_GPU_ENV = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}


def worker_config(cfg: TrainStageConfig, *paths: str) -> dict:
    """The config as the workers receive it, with the named fields' local paths (those set) made
    absolute: a Ray worker runs in a directory of its own, where a path relative to the driver's
    is not there."""
    given = {field: getattr(cfg, field) for field in paths}
    return {**cfg.model_dump(mode="json"), **{f: storage.normalize(v) for f, v in given.items() if v is not None}}


def worker_env(use_gpu: bool, deterministic: bool = False) -> dict[str, str]:
    """Environment variables for the training workers: the CPU allocator settings
    (ray_env.cpu_worker_env) on the CPU, the deterministic-kernel settings on GPUs when asked."""
    if not use_gpu:
        return cpu_worker_env()
    if not deterministic:
        return {}
    env = dict(DETERMINISTIC_GPU_ENV)
    if os.environ.get("NCCL_ALGO") in ("Ring", "Tree"):
        env["NCCL_ALGO"] = os.environ["NCCL_ALGO"]
    return env


def run_config(run_dir: str, max_failures: int, use_gpu: bool, deterministic: bool = False):
    """Ray Train's RunConfig for a run directory (its parent is Ray's storage path), with the
    workers' environment of worker_env."""
    from ray.train import FailureConfig, RunConfig

    local = PurePosixPath(run_dir) if not storage.is_remote(run_dir) else None
    storage_path, name = (str(local.parent), local.name) if local else run_dir.rsplit("/", 1)
    return RunConfig(
        name=name,
        storage_path=storage_path,
        failure_config=FailureConfig(max_failures=max_failures),
        worker_runtime_env={"env_vars": worker_env(use_gpu, deterministic)},
    )


def fit(trainer, max_failures: int, what: str) -> None:
    """Run the trainer; a clear error when the worker group failed more than max_failures times."""
    main_thread = threading.current_thread() is threading.main_thread()
    sigint = signal.getsignal(signal.SIGINT) if main_thread else None
    try:
        error = trainer.fit().error
    except Exception as e:  # Ray Train raises once the worker group has failed max_failures + 1 times
        error = e
    finally:
        # Ray Train leaves its SIGINT handler installed after fit(), and that handler holds the
        # finished run's controller actor: the controller would live on until something replaces
        # the handler (the next fit, at a moment of its own). Put ours back and collect, so the
        # controller ends here, while nothing else is starting. (A driver that ran several runs
        # was seen to miss the next controller's start, and wait forever, when an old controller
        # died late.)
        if main_thread:
            signal.signal(signal.SIGINT, sigint)
        gc.collect()
    if error:
        raise RuntimeError(f"{what} failed after {max_failures} restarts at most: {error}") from error


def scaling_config(par: ParallelismConfig):
    """Ray Train's ScalingConfig: a fixed group, or with min_workers an elastic one that Ray
    shrinks when workers are lost and grows when resources return (each change a restart of the
    group, which resumes from the newest checkpoint at its new size)."""
    from ray.train import ScalingConfig

    resources = {"CPU": par.cpus_per_worker, **({"GPU": 1} if par.use_gpu else {}), **par.worker_resources}
    workers = (par.min_workers, par.num_workers) if par.min_workers is not None else par.num_workers
    return ScalingConfig(
        num_workers=workers,
        use_gpu=par.use_gpu,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=par.elastic_resize_interval_s,
    )


def open_run_dir(cfg: TrainStageConfig, stage: str) -> tuple[str, dict | None]:
    """(the run directory, its manifest when it holds a committed run and overwrite is off: the
    stage has nothing to do). With overwrite the directory is cleared; checkpoints of an
    unfinished run are resumed by the workers."""
    out = storage.normalize(cfg.output)
    if storage.is_committed(out) and not cfg.overwrite:
        logger.info("%s: %s is already committed; skipping (set overwrite=true to redo)", stage, out)
        return out, storage.read_manifest(out)
    if cfg.overwrite:
        storage.remove_dir(out)
    elif checkpoint.committed_checkpoints(out):
        logger.info("%s: %s holds checkpoints of an unfinished run; resuming it", stage, out)
    return out, None


def train_on_ray(loop, loop_config: dict, cfg: TrainStageConfig, out: str, what: str) -> tuple[str, str, dict]:
    """Run `loop` on a Ray Train worker group (cfg.parallelism; gloo on CPUs, NCCL on GPUs) with
    up to cfg.health.max_failures restarts. Returns the newest valid checkpoint: its URI, its name
    inside the run directory and its train_state.json."""
    from ray.train.torch import TorchConfig, TorchTrainer

    par = cfg.parallelism
    trainer = TorchTrainer(
        loop,
        train_loop_config=loop_config,
        scaling_config=scaling_config(par),
        torch_config=TorchConfig(backend="nccl" if par.use_gpu else "gloo"),
        run_config=run_config(out, cfg.health.max_failures, par.use_gpu, cfg.deterministic),
    )
    fit(trainer, cfg.health.max_failures, what)
    final_uri = checkpoint.latest_valid(out)
    if final_uri is None:
        raise RuntimeError(f"{what} finished without a checkpoint")
    final = checkpoint.name_in_run(final_uri)
    return final_uri, final, storage.read_json(storage.join(final_uri, "train_state.json"))
