"""Build a model-parallel DeepSpeed engine two ways on spawned gloo processes: from a model built
on the meta device, each rank materialising only its shards (train/meta_init.py, what the
training loop does), and from a model built whole on every rank and then split. Each rank
reports the rise of its resident set while building (VmHWM over VmRSS before the model exists,
glibc mapping every block of 64 KiB or more on its own: see harness/peak_memory.py), at the
start of DeepSpeed's optimizer set-up and at the end of `deepspeed.initialize`, and,
when asked, its engine's parameters, for a caller to compare the two builds bitwise.
"""

from __future__ import annotations

import gc

import torch
import torch.distributed as dist

from harness.peak_memory import _reset_peak_rss, _rss_bytes, release_deepspeed_groups, spawn_ranks, start_rank
from lmfoundry.train.config import PretrainConfig


def _worker(
    rank: int, port: int, world: int, raw: dict, seq_len: int, ways: list[str], keep: bool, start: str | None, results
) -> None:
    start_rank(rank, world, port)
    try:
        cfg = PretrainConfig.model_validate(raw)
        results[rank] = {way: _build(rank, cfg, world, seq_len, way == "whole", keep, start) for way in ways}
    finally:
        dist.destroy_process_group()


def _build(
    rank: int, cfg: PretrainConfig, world: int, seq_len: int, whole: bool, keep: bool, start: str | None
) -> dict:
    """This rank's report of one build (the module's docstring says what it holds)."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    from lmfoundry.model.checkpoint import load_model_files, load_model_on_meta
    from lmfoundry.model.transformer import Transformer, build_on_meta
    from lmfoundry.train.engine import build_engine, deepspeed_config

    gc.collect()
    _reset_peak_rss()
    before = _rss_bytes("VmRSS")
    torch.manual_seed(cfg.seed)  # as train/pretrain.py's build_model
    if start is not None:  # continued training: the checkpoint's weights
        model = load_model_files(start).train() if whole else load_model_on_meta(start)
    else:
        model = Transformer(cfg.model) if whole else build_on_meta(cfg.model)
    whole_bytes = sum(p.numel() * 4 for p in model.parameters())
    largest = max(p.numel() * 4 for p in model.parameters())
    # the peak before DeepSpeed builds its optimizer (its ZeRO buffers come on top): the build
    # of the model, its split and its placement
    seen = {}
    original = DeepSpeedEngine._configure_optimizer

    def configure_optimizer(engine, *args, **kwargs):
        seen["before_optimizer"] = _rss_bytes("VmHWM") - before
        return original(engine, *args, **kwargs)

    DeepSpeedEngine._configure_optimizer = configure_optimizer
    try:
        engine, _ = build_engine(model, cfg, deepspeed_config(cfg, world, seq_len, model.num_params()))
    finally:
        DeepSpeedEngine._configure_optimizer = original
    peak = _rss_bytes("VmHWM") - before
    params = dict(engine.module.named_parameters())
    # a ZeRO-3 parameter's own tensor is empty: this rank's part is its ds_tensor
    held = {name: getattr(p, "ds_tensor", None) if hasattr(p, "ds_id") else p for name, p in params.items()}
    kept = None
    if keep:
        from deepspeed import zero

        with zero.GatheredParameters(list(params.values())):  # whole under ZeRO-3, else as they are
            kept = {name: p.detach().clone() for name, p in params.items()}
    dist.barrier()  # every rank done building before the next build starts
    release_deepspeed_groups()
    return {
        "peak_rise_bytes": peak,
        "peak_rise_before_optimizer_bytes": seen["before_optimizer"],
        "model_bytes": whole_bytes,
        "largest_parameter_bytes": largest,
        "rank_parameter_bytes": sum(p.numel() * p.element_size() for p in held.values()),
        "parameters": kept,
    }


def build_both_ways(
    cfg: PretrainConfig,
    seq_len: int,
    keep_parameters: bool = False,
    start: str | None = None,
    same_processes: bool = False,
) -> dict[str, dict]:
    """{"meta": {rank: report}, "whole": {rank: report}} for `cfg` on its num_workers ranks; with
    `start`, the model of that checkpoint directory (model files) rather than a new one. Each way
    builds in processes of its own, so that neither's memory figures carry the other's heap;
    `same_processes` builds both in one spawn (one import of torch and DeepSpeed: for a
    comparison of the parameters, not of the memory figures)."""
    world, ways = cfg.parallelism.num_workers, ["meta", "whole"]
    args = (world, cfg.model_dump(), seq_len)
    if same_processes:
        by_rank = spawn_ranks(_worker, (*args, ways, keep_parameters, start), world)
    else:
        by_rank = {}
        for way in ways:
            for rank, report in spawn_ranks(_worker, (*args, [way], keep_parameters, start), world).items():
                by_rank.setdefault(rank, {}).update(report)
    return {way: {rank: reports[way] for rank, reports in by_rank.items()} for way in ways}


def _zero3_bf16_adapter_worker(rank: int, port: int, raw: dict, start: str, results) -> None:
    from lmfoundry.model.checkpoint import load_model_on_meta
    from lmfoundry.model.lora import LoraConfig, apply_lora
    from lmfoundry.train.engine import build_engine, deepspeed_config
    from lmfoundry.train.sft import values_after_wrapping

    start_rank(rank, 1, port)
    try:
        cfg = PretrainConfig.model_validate(raw)
        model = load_model_on_meta(start)
        loaded = model.initial_values()
        apply_lora(model, LoraConfig(rank=2, targets=["wq"]))  # built on the CPU in fp32
        ds_config = deepspeed_config(cfg, 1, cfg.model.max_seq_len, model.num_params())
        ds_config["bf16"] = {"enabled": True}  # what a GPU run trains in
        engine, _ = build_engine(model, cfg, ds_config, values_after_wrapping(model, loaded))
        tokens = torch.randint(0, cfg.model.vocab_size, (2, 9))
        loss = engine(tokens[:, :-1], tokens[:, 1:])[1]
        engine.backward(loss)
        results[rank] = {
            "partition_dtypes": sorted({str(p.ds_tensor.dtype) for p in engine.module.parameters()}),
            "buffer_devices": sorted({str(b.device) for b in engine.module.buffers()}),
            "engine_device": str(engine.device),
            "loss": float(loss),
        }
    finally:
        dist.destroy_process_group()


def zero3_bf16_adapter_build(cfg: PretrainConfig, start: str) -> dict:
    """One ZeRO-3 rank in bf16 built on the meta device from the checkpoint at `start`, with a
    LoRA adapter on the CPU, run through one forward and backward: the partitions' dtypes, the
    buffers' devices, the engine's device and the loss."""
    return spawn_ranks(_zero3_bf16_adapter_worker, (cfg.model_dump(), start), 1)[0]
