"""Measure what writing a ZeRO-3 run's servable weights costs each rank in memory.

Spawns two processes over gloo, builds the pretraining model in its ZeRO-3 DeepSpeed engine as
the training loop does, and writes the servable weights two ways, measuring each rank's peak
resident set (VmHWM, reset first) over where it stood before:
- `streamed`: what a checkpoint save does (train/checkpointing.stream_servable_weights), one
  piece of the model gathered at a time and written by rank 0 while it is whole;
- `full_gather`: every parameter gathered at once and rank 0 copying the whole state for the
  write, as saves did before.
glibc is told to map and unmap every block of 64 KiB or more on its own, so that freed tensors
leave the resident set at once (as in peak_memory.py).
"""

from __future__ import annotations

import gc
import tempfile
from pathlib import Path

import torch
import torch.distributed as dist
from safetensors.torch import load_file

from harness.peak_memory import _reset_peak_rss, _rss_bytes, spawn_ranks, start_rank
from lmfoundry.model.checkpoint import TIED_HEAD
from lmfoundry.model.transformer import ModelConfig
from lmfoundry.train.config import PretrainConfig

SEQ_LEN, WORLD = 64, 2


def zero3_config(n_layer: int, d_model: int = 512, vocab_size: int = 8192) -> PretrainConfig:
    model = ModelConfig(
        vocab_size=vocab_size, max_seq_len=SEQ_LEN, n_layer=n_layer, d_model=d_model, n_head=8, n_kv_head=4
    )
    return PretrainConfig(
        data="-",
        output="-",
        model=model,
        parallelism={"zero_stage": 3},
        batch={"micro_batch_size": 1, "global_batch_tokens": WORLD * SEQ_LEN},
        schedule={"max_steps": 2, "warmup_steps": 1},
    )


def _peak_rise(fn) -> int:
    gc.collect()
    dist.barrier()
    _reset_peak_rss()
    baseline = _rss_bytes("VmRSS")
    fn()
    rise = _rss_bytes("VmHWM") - baseline
    dist.barrier()
    return rise


def _measure_case(rank: int, cfg: PretrainConfig, path: Path) -> dict:
    from lmfoundry.train.checkpointing import _gathered, _pieces, stream_servable_weights
    from lmfoundry.train.expert_parallel import full_state
    from lmfoundry.train.pretrain import build_pretrain_engine

    engine, _, _ = build_pretrain_engine(cfg, WORLD, SEQ_LEN)
    whole: dict[str, torch.Tensor] = {}

    def streamed():
        stream_servable_weights(engine.module, path if rank == 0 else None)

    def full_gather():
        with _gathered(engine):
            state = full_state(engine.module)
            if rank == 0:
                whole.update({k: v.clone() for k, v in state.items()})

    row = {"streamed": _peak_rise(streamed), "full_gather": _peak_rise(full_gather)}
    # rank 0 writing where it cannot (a folder that is not there) raises, and leaves no rank
    # waiting in a gather: every rank reaches the barrier after it
    try:
        stream_servable_weights(engine.module, path.parent / "missing" / path.name if rank == 0 else None)
        raised = False
    except OSError:
        raised = True
    dist.barrier()
    row["failed_write_raised_on_rank_0_only"] = raised == (rank == 0)
    if rank == 0:
        if cfg.model.tie_embeddings:
            whole.pop(TIED_HEAD)
        written = load_file(str(path))
        row["equal_to_full_gather"] = written.keys() == whole.keys() and all(
            torch.equal(written[k], whole[k]) for k in whole
        )
        row["model_bytes"] = sum(p.ds_numel * p.element_size() for p in engine.module.parameters())
        row["largest_piece_bytes"] = max(
            sum(p.ds_numel * p.element_size() for p in piece.parameters()) for _, piece in _pieces(engine.module)
        )
        row["file_bytes"] = path.stat().st_size
    engine.destroy()
    return row


def _worker(rank: int, port: int, configs: list[dict], out_dir: str, results) -> None:
    start_rank(rank, WORLD, port)
    try:
        results[rank] = [
            _measure_case(rank, PretrainConfig.model_validate(raw), Path(out_dir) / f"case-{i}.safetensors")
            for i, raw in enumerate(configs)
        ]
    finally:
        dist.destroy_process_group()


def measure_save_peaks(configs: list[PretrainConfig], out_dir: str | None = None) -> list[dict]:
    """For each ZeRO-3 config: the model's bytes, its largest piece's, the file's, whether the
    file holds exactly the fully gathered weights, the largest per-rank peak rise of the
    resident set for the streamed write and for a full gather, and whether a write that fails on
    rank 0 raised there alone and left every rank free to go on.
    The streamed files are left in `out_dir` (case-N.safetensors) when given."""
    with tempfile.TemporaryDirectory() as scratch:
        results = spawn_ranks(_worker, ([c.model_dump() for c in configs], out_dir or scratch), WORLD)
    merged = []
    for i in range(len(configs)):
        row = dict(results[0][i])
        for way in ("streamed", "full_gather"):  # the larger rank's rise
            row[way] = max(results[rank][i][way] for rank in range(WORLD))
        row["failed_write_raised_on_rank_0_only"] = all(
            results[rank][i]["failed_write_raised_on_rank_0_only"] for rank in range(WORLD)
        )
        merged.append(row)
    return merged
