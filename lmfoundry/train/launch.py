"""Launching a training stage on Ray Train: the run directory as Ray's storage, the worker
group's scaling and restarts, and a clear error when the restarts ran out."""

from __future__ import annotations

import gc
import signal
import threading
from pathlib import PurePosixPath

from lmfoundry.platform import storage
from lmfoundry.platform.ray_env import cpu_worker_env
from lmfoundry.train.config import ParallelismConfig


def ordered_ingest():
    """Ray Data's ingest options for training, with blocks delivered in dataset order."""
    from ray.train import DataConfig

    options = DataConfig.default_ingest_options()
    options.preserve_order = True
    return options


def run_config(run_dir: str, max_failures: int, use_gpu: bool):
    """Ray Train's RunConfig for a run directory (its parent is Ray's storage path); workers that
    train on the CPU start with the allocator settings of ray_env.cpu_worker_env."""
    from ray.train import FailureConfig, RunConfig

    local = PurePosixPath(run_dir) if not storage.is_remote(run_dir) else None
    storage_path, name = (str(local.parent), local.name) if local else run_dir.rsplit("/", 1)
    return RunConfig(
        name=name,
        storage_path=storage_path,
        failure_config=FailureConfig(max_failures=max_failures),
        worker_runtime_env={"env_vars": {} if use_gpu else cpu_worker_env()},
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
