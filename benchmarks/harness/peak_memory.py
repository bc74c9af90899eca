"""Measure the peak memory of real DeepSpeed training steps, to hold the planner to account.

Spawns `world_size` processes over gloo, builds the pretraining model and DeepSpeed engine
exactly as the training loop does, runs a few optimizer steps on random tokens and returns the
largest rank's peak. The peak is the rise of the process's
resident set (VmHWM, reset before each config) over where it stood before the model was built,
with glibc told to map and unmap every block of 64 KiB or more so that freed tensors leave the
resident set at once. (PyTorch's profiler memory events are no substitute: they see only the
threads the profiler runs on, and DeepSpeed allocates and frees on others.)
"""

from __future__ import annotations

import gc
import logging
import os
import socket
import warnings

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmfoundry.model.moe import MoEConfig
from lmfoundry.model.transformer import ModelConfig
from lmfoundry.train.config import PretrainConfig, data_parallel, resolved_precision
from lmfoundry.train.engine import gradient_accumulation

SEQ_LEN, WORLD = 256, 2  # of the reference cases


def _rss_bytes(field: str) -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"{field} missing from /proc/self/status")


def _reset_peak_rss() -> None:
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # Linux >= 4.0: VmHWM := VmRSS


def _train_steps(cfg: PretrainConfig, seq_len: int, world: int, steps: int) -> None:
    from lmfoundry.train.pretrain import build_pretrain_engine

    engine, _, ds_config = build_pretrain_engine(cfg, world, seq_len)
    # the workers of a tensor-parallel group train on the same rows
    data_rank = data_parallel(dist.get_rank(), world, cfg.parallelism)[0]
    generator = torch.Generator().manual_seed(cfg.seed + data_rank)
    accum = ds_config["gradient_accumulation_steps"]
    shape = (cfg.batch.micro_batch_size, seq_len + 1)
    for _ in range(steps):
        rows = [torch.randint(0, cfg.model.vocab_size, shape, generator=generator) for _ in range(accum)]
        if cfg.parallelism.pipeline_parallel_size > 1:  # the step through the pipeline, whole
            engine.train_batch(iter([(tokens[:, :-1], tokens[:, 1:]) for tokens in rows]))
            continue
        for tokens in rows:
            loss = engine(tokens[:, :-1], tokens[:, 1:])[1]
            engine.backward(loss)
            engine.step()
    engine.destroy()
    release_deepspeed_groups()  # the next config in this process builds its own


def start_rank(rank: int, world: int, port: int) -> None:
    """A spawned rank's environment and gloo process group, DeepSpeed's logging quietened."""
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank)
    )
    logging.getLogger("DeepSpeed").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=world)


def release_deepspeed_groups() -> None:
    """Forget the process groups DeepSpeed keeps in module globals (tensor, data and model
    parallel, its mpu), as it does when the world group is destroyed: the next engine built in
    the same process makes its own, where it would otherwise find a tensor-parallel group set and
    keep it, or read an engine without an mpu's groups from the last one's."""
    from deepspeed.utils import groups

    groups._release_process_group_references()


def spawn_ranks(worker, args: tuple, world: int) -> dict:
    """Run `worker(rank, port, *args, results)` in `world` spawned processes, with glibc told to
    map and unmap every block of 64 KiB or more on its own, so that the resident set follows the
    live tensors instead of keeping freed memory in the heap. Returns what the ranks put in
    `results` (a dict by rank)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    saved = os.environ.get("MALLOC_MMAP_THRESHOLD_")
    os.environ["MALLOC_MMAP_THRESHOLD_"] = "65536"
    try:
        mp.spawn(worker, args=(port, *args, results), nprocs=world, join=True)
    finally:
        if saved is None:
            del os.environ["MALLOC_MMAP_THRESHOLD_"]
        else:
            os.environ["MALLOC_MMAP_THRESHOLD_"] = saved
    return dict(results)


def _worker(rank: int, port: int, world: int, configs: list[dict], seq_len: int, steps: int, results) -> None:
    start_rank(rank, world, port)
    try:
        # the first engine in a process imports DeepSpeed's modules and loads its ops: a
        # throwaway step keeps that out of the first figure
        _train_steps(PretrainConfig.model_validate(configs[0]), seq_len, world, 1)
        peaks = []
        for raw in configs:
            cfg = PretrainConfig.model_validate(raw)
            gc.collect()
            dist.barrier()
            _reset_peak_rss()
            baseline = _rss_bytes("VmRSS")
            _train_steps(cfg, seq_len, world, steps)
            peaks.append(_rss_bytes("VmHWM") - baseline)
            dist.barrier()
        results[rank] = peaks
    finally:
        dist.destroy_process_group()


def measure_peak_bytes(configs: list[PretrainConfig], seq_len: int, world_size: int = 2, steps: int = 2) -> list[int]:
    """For each config (model vocab_size and max_seq_len set), the largest per-rank rise of the
    resident set over `steps` optimizer steps on `world_size` CPU processes, in bytes."""
    for cfg in configs:
        if not cfg.model.vocab_size or cfg.model.max_seq_len < seq_len:
            raise ValueError(
                f"model.vocab_size ({cfg.model.vocab_size}) must be set and model.max_seq_len "
                f"({cfg.model.max_seq_len}) at least seq_len={seq_len}"
            )
    results = spawn_ranks(_worker, (world_size, [c.model_dump() for c in configs], seq_len, steps), world_size)
    return [max(results[rank][i] for rank in range(world_size)) for i in range(len(configs))]


def reference_cases() -> dict[str, PretrainConfig]:
    """Dense and MoE models under ZeRO 0-2, with and without checkpointing and accumulation, and
    expert, tensor and pipeline parallelism (with virtual stages too; MoE layers in a pipeline)."""
    dense = ModelConfig(vocab_size=4096, max_seq_len=SEQ_LEN, n_layer=4, d_model=256, n_head=4, n_kv_head=2)
    wide = dense.model_copy(update={"d_model": 512, "n_head": 8, "n_kv_head": 4, "vocab_size": 8192})
    # the planner models GPUs, where `dispatch: auto` runs grouped_mm; the fused dispatch, which
    # auto picks on CPUs, keeps less for backward (docs/training.md)
    experts = MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, expert_hidden=128, dispatch="grouped_mm")
    moe = dense.model_copy(update={"moe": experts})

    def cfg(
        model: ModelConfig,
        zero: int,
        micro: int = 8,
        accumulate: int = 1,
        ep: int = 1,
        tp: int = 1,
        pp: int = 1,
        sequence_parallel: bool = False,
        vocab_parallel: bool = False,
        virtual_stages: int = 1,
    ) -> PretrainConfig:
        replicas = WORLD // (tp * pp)
        return PretrainConfig(
            data="-",
            output="-",
            model=model,
            parallelism={
                "zero_stage": zero,
                "expert_parallel_size": ep,
                "tensor_parallel_size": tp,
                "pipeline_parallel_size": pp,
                "virtual_stages": virtual_stages,
                "sequence_parallel": sequence_parallel,
                "vocab_parallel": vocab_parallel,
            },
            batch={"micro_batch_size": micro, "global_batch_tokens": micro * replicas * SEQ_LEN * accumulate},
            schedule={"max_steps": 10, "warmup_steps": 1},
        )

    return {
        "dense ZeRO-0": cfg(dense, 0),
        "dense ZeRO-1": cfg(dense, 1),
        "dense ZeRO-2": cfg(dense, 2),
        "dense ZeRO-2, 2 micro-steps": cfg(dense, 2, accumulate=2),
        "dense ZeRO-2, checkpointing": cfg(dense.model_copy(update={"activation_checkpointing": True}), 2),
        "dense 512-wide ZeRO-2, micro 4": cfg(wide, 2, micro=4),
        "MoE 8 experts top-2 ZeRO-2": cfg(moe, 2),
        "MoE, expert parallel 2, ZeRO-2": cfg(moe, 2, ep=2),
        "MoE, PP 2, 4 micro": cfg(moe, 1, micro=4, accumulate=4, pp=2),
        "MoE, TP 2, sequence parallel, ZeRO-2": cfg(moe, 2, tp=2, ep=2, sequence_parallel=True),
        "dense 512-wide, TP 2, ZeRO-2": cfg(wide, 2, micro=4, tp=2),
        "dense 512-wide, TP 2, sequence parallel, ZeRO-2": cfg(wide, 2, micro=4, tp=2, sequence_parallel=True),
        "dense 512-wide, TP 2, sequence + vocab parallel, ZeRO-2": cfg(
            wide, 2, micro=4, tp=2, sequence_parallel=True, vocab_parallel=True
        ),
        "dense 512-wide, PP 2, 4 micro": cfg(wide, 1, micro=4, accumulate=4, pp=2),
        "dense 512-wide, PP 2 x 2 virtual stages, 4 micro": cfg(wide, 1, micro=4, accumulate=4, pp=2, virtual_stages=2),
    }


def composed_cases() -> dict[str, PretrainConfig]:
    """Tensor and pipeline parallelism together, on 4 processes (one replica of TP 2 x PP 2),
    without and with sequence parallelism, and with the end stages' vocabulary table split too:
    the benchmark measures them beside the reference cases (the test, to stay short, does not)."""
    wide = ModelConfig(vocab_size=8192, max_seq_len=SEQ_LEN, n_layer=4, d_model=512, n_head=8, n_kv_head=4)

    def cfg(sequence_parallel: bool, vocab_parallel: bool = False) -> PretrainConfig:
        return PretrainConfig(
            data="-",
            output="-",
            model=wide,
            parallelism={
                "num_workers": 4,
                "zero_stage": 1,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "sequence_parallel": sequence_parallel,
                "vocab_parallel": vocab_parallel,
            },
            batch={"micro_batch_size": 4, "global_batch_tokens": 4 * SEQ_LEN * 4},
            schedule={"max_steps": 10, "warmup_steps": 1},
        )

    return {
        "dense 512-wide, TP 2 x PP 2, 4 micro": cfg(False),
        "dense 512-wide, TP 2 x PP 2, sequence parallel, 4 micro": cfg(True),
        "dense 512-wide, TP 2 x PP 2, sequence + vocab parallel, 4 micro": cfg(True, vocab_parallel=True),
    }


def predicted_peak_bytes(cfg: PretrainConfig, seq_len: int, world_size: int) -> dict:
    """The planner's per-rank memory for this config trained the way measure_peak_bytes does."""
    from lmfoundry.jobs.plan import planner_layout
    from lmfoundry.model.flops import model_shape
    from lmfoundry.planner.search import Recipe, training_memory_bytes

    par = cfg.parallelism
    recipe = Recipe(
        seq_len=seq_len,
        global_batch_tokens=cfg.batch.global_batch_tokens,
        token_budget=1,
        zero_stage=par.zero_stage,
        activation_checkpointing=cfg.model.activation_checkpointing,
        sequence_parallel=par.sequence_parallel,
        vocab_parallel=par.vocab_parallel,
        micro_batch_size=cfg.batch.micro_batch_size,
        precision=resolved_precision(par),
        reduce_bucket_size=par.reduce_bucket_size,
        overlap_comm=par.use_gpu,
    )
    micro_batches = gradient_accumulation(cfg, world_size, seq_len)
    return training_memory_bytes(model_shape(cfg.model), planner_layout(cfg, world_size), recipe, micro_batches)
