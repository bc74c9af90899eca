"""The pretraining driver: reads the pack manifest, derives the model shape, runs TorchTrainer
(restarting the worker group up to max_failures times; the loop resumes from the newest valid
checkpoint) and commits the run directory with a manifest naming the final checkpoint. A run
directory that holds checkpoints but no manifest (a run that died) is resumed, not cleared."""

from __future__ import annotations

import gc
import signal
import threading
import time
from pathlib import PurePosixPath

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.ray_env import cpu_worker_env
from lmfoundry.train.config import PretrainConfig, deepspeed_config, gradient_accumulation, world_sizes
from lmfoundry.train.loop import train_loop

logger = get_logger(__name__)


def resolve_model_shape(cfg: PretrainConfig, pack_manifest: dict) -> PretrainConfig:
    """Fill vocab_size and max_seq_len from the packed data where the config leaves them 0."""
    model = cfg.model.model_copy()
    if model.vocab_size == 0:
        model.vocab_size = pack_manifest["vocab_size"]
    elif model.vocab_size < pack_manifest["vocab_size"]:
        raise ValueError(
            f"model.vocab_size={model.vocab_size} is smaller than the tokenizer's {pack_manifest['vocab_size']}"
        )
    if model.max_seq_len == 0:
        model.max_seq_len = pack_manifest["seq_len"]
    elif model.max_seq_len < pack_manifest["seq_len"]:
        raise ValueError(
            f"model.max_seq_len={model.max_seq_len} is shorter than the packed seq_len={pack_manifest['seq_len']}"
        )
    return cfg.model_copy(update={"model": model})


def plot_loss(run_dir: str) -> None:
    """loss.png in the run directory, from metrics.jsonl."""
    import io
    import json

    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [
        json.loads(line) for line in storage.read_bytes(storage.join(run_dir, "metrics.jsonl")).decode().splitlines()
    ]
    fig, ax = plt.subplots(figsize=(6, 3.5))
    ax.plot([r["step"] for r in rows], [r["loss"] for r in rows], marker=".")
    ax.set_xlabel("optimizer step")
    ax.set_ylabel("training loss")
    ax.set_title(f"{run_dir.rsplit('/', 1)[-1]}: loss {rows[0]['loss']:.2f} -> {rows[-1]['loss']:.2f}")
    ax.grid(alpha=0.3)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100)
    plt.close(fig)
    storage.write_bytes_atomic(storage.join(run_dir, "loss.png"), buf.getvalue())


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


def scaling_config(cfg: PretrainConfig):
    """Ray Train's ScalingConfig: a fixed group, or with min_workers an elastic one that Ray
    shrinks when workers are lost and grows when resources return (each change a restart of the
    group, which resumes from the newest checkpoint at its new size)."""
    from ray.train import ScalingConfig

    resources = {"CPU": cfg.cpus_per_worker, **({"GPU": 1} if cfg.use_gpu else {}), **cfg.worker_resources}
    workers = (cfg.min_workers, cfg.num_workers) if cfg.min_workers is not None else cfg.num_workers
    return ScalingConfig(
        num_workers=workers,
        use_gpu=cfg.use_gpu,
        resources_per_worker=resources,
        elastic_resize_monitor_interval_s=cfg.elastic_resize_interval_s,
    )


def run_pretrain(cfg: PretrainConfig) -> dict:
    import ray
    from ray.train import DataConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    data = storage.normalize(cfg.data)
    pack = storage.read_manifest(data)
    if pack.get("stage") != "pack":
        raise ValueError(f"pretrain data {cfg.data!r} is a {pack.get('stage')!r} output, not a pack output")
    cfg = resolve_model_shape(cfg, pack)
    seq_len = pack["seq_len"]
    for world in world_sizes(cfg):  # fail now, not inside the workers
        gradient_accumulation(cfg, world, seq_len)
    sequences, per_micro_step = pack["splits"]["train"]["sequences"], cfg.num_workers * cfg.micro_batch_size
    if sequences < per_micro_step:  # an epoch would hold no micro-batch, and training no step
        raise ValueError(
            f"pretrain data {cfg.data!r} holds {sequences} training sequences, fewer than one global "
            f"micro-batch (num_workers x micro_batch_size = {per_micro_step}); pack more text or "
            "lower micro_batch_size"
        )
    out = storage.normalize(cfg.output)
    if storage.is_committed(out) and not cfg.overwrite:
        logger.info("pretrain: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_manifest(out)
    if cfg.overwrite:
        storage.remove_dir(out)
    elif checkpoint.committed_checkpoints(out):
        logger.info("pretrain: %s holds checkpoints of an unfinished run; resuming it", out)
    logger.info("pretrain: DeepSpeed config %s", deepspeed_config(cfg, cfg.num_workers, seq_len))

    started = time.time()
    train_ds = ray.data.read_parquet(storage.list_files(storage.join(data, "train"), (".parquet",)))
    # each worker streams this dataset for the whole run; its progress bars would be redrawn every
    # second in every worker and carried to the driver's log for as long as training lasts
    train_ds.context.enable_progress_bars = False
    tokenizer_json = storage.read_bytes(storage.join(data, pack["tokenizer"])).decode()
    trainer = TorchTrainer(
        train_loop,
        train_loop_config={
            "cfg": cfg.model_dump(mode="json"),
            "seq_len": seq_len,
            "tokenizer_json": tokenizer_json,
            "run_dir": out,
        },
        scaling_config=scaling_config(cfg),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        datasets={"train": train_ds},
        # every worker reads the whole stream, in file order, and keeps its slice of each global
        # micro-batch (loop.micro_batches): a split handed out as workers ask is not reproducible
        dataset_config=DataConfig(datasets_to_split=[], execution_options=ordered_ingest()),
        run_config=run_config(out, cfg.max_failures, cfg.use_gpu),
    )
    fit(trainer, cfg.max_failures, "pretraining")
    final_uri = checkpoint.latest_valid(out)
    if final_uri is None:
        raise RuntimeError("pretraining finished without a checkpoint")
    final = f"{checkpoint.CHECKPOINTS}/{final_uri.rstrip('/').rsplit('/', 1)[-1]}"
    state = storage.read_json(storage.join(out, final, "train_state.json"))
    history = state["loss_history"]
    plot_loss(out)
    manifest = storage.commit(
        out,
        "pretrain",
        {
            "data": data,
            "final_checkpoint": final,
            "steps": state["step"],
            "tokens_seen": state["tokens_seen"],
            "first_loss": history[0][1],
            "final_loss": history[-1][1],
            "model": cfg.model.model_dump(),
            "seconds": round(time.time() - started, 2),
        },
    )
    logger.info(
        "pretrain: %d steps, loss %.3f -> %.3f, final checkpoint %s",
        state["step"],
        history[0][1],
        history[-1][1],
        storage.join(out, final),
    )
    return manifest
