"""The per-worker training loop that Ray Train runs on every worker.

Each worker builds the same model (same seed), wraps it in a DeepSpeed engine over the process
group Ray Train set up, and streams its shard of the packed sequences from Ray Data. Rank 0
logs, writes checkpoints and hands them to `ray.train.report`; every rank reports, since a
report is a collective step in Ray Train.
"""

from __future__ import annotations

import json
import logging
import shutil
import tempfile
import time
import warnings
from pathlib import Path

import torch

from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
from lmfoundry.model.flops import train_flops_per_token
from lmfoundry.model.transformer import Transformer
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.hardware import device_peak_tflops
from lmfoundry.platform.log import get_logger
from lmfoundry.train.config import PretrainConfig, deepspeed_config
from lmfoundry.train.expert_parallel import full_state, shard_model

logger = get_logger(__name__)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and embeddings are not decayed (as in GPT-3).
    Named, because DeepSpeed splits named groups further into expert and non-expert groups."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    return [{"params": decay, "weight_decay": weight_decay, "name": "decay"},
            {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"}]


def _mean_across_ranks(value: float) -> float:
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


def write_metrics(run_dir: str, history: list[dict]) -> None:
    """metrics.jsonl in the run directory, one JSON object per logged step (rewritten whole:
    object stores cannot append)."""
    text = "".join(json.dumps(h) + "\n" for h in history)
    storage.write_bytes_atomic(storage.join(run_dir, "metrics.jsonl"), text.encode())


def _save_checkpoint(engine, weights: dict, tokenizer_json: str, state: dict) -> str:
    """Rank 0 writes a sealed checkpoint into a fresh local directory and returns its path."""
    directory = Path(tempfile.mkdtemp(prefix="lmfoundry-ckpt-"))
    save_model_files(engine.module, directory, weights)
    (directory / TOKENIZER).write_text(tokenizer_json)
    storage.write_json_atomic(str(directory / "train_state.json"), state)
    checkpoint.seal(directory, {"kind": "lmfoundry.pretrain", "step": state["step"]})
    return str(directory)


def train_loop(loop_config: dict) -> None:
    import deepspeed
    import ray.train
    from ray.train import Checkpoint

    cfg = PretrainConfig.model_validate(loop_config["cfg"])
    seq_len = loop_config["seq_len"]
    tokenizer_json = loop_config["tokenizer_json"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank != 0:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)
    # DeepSpeed's ZeRO-2 calls a torch collective that torch has renamed; once per step it warns.
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.*", category=FutureWarning)

    torch.manual_seed(cfg.seed)
    model = Transformer(cfg.model)
    if cfg.expert_parallel_size > 1:
        shard_model(model, cfg.expert_parallel_size)
    ds_config = deepspeed_config(cfg, world, seq_len, model.num_params())
    engine, _, _, scheduler = deepspeed.initialize(
        model=model, model_parameters=param_groups(model, cfg.weight_decay), config=ds_config
    )
    accum = ds_config["gradient_accumulation_steps"]
    tokens_per_step = cfg.global_batch_tokens
    if rank == 0:
        logger.info("pretrain: %.2fM parameters, %d workers, ZeRO-%d, micro batch %d, grad accumulation %d "
                    "(derived from global_batch_tokens=%d)", model.num_params() / 1e6, world, cfg.zero_stage,
                    cfg.micro_batch_size, accum, tokens_per_step)

    flops_per_token = train_flops_per_token(model, seq_len)
    peak = cfg.peak_tflops_per_worker or device_peak_tflops(
        torch.cuda.get_device_name() if torch.cuda.is_available() else None)
    history: list[dict] = []  # every logged step's metrics, written to metrics.jsonl by rank 0
    run_dir = loop_config["run_dir"]

    moe_layers = engine.module.moe_layers()
    expert_load = [torch.zeros(m.cfg.num_experts) for m in moe_layers]  # summed over one optimizer step
    step_loads: list[list[int]] = []  # the last optimizer step's tokens per expert, per MoE layer

    shard = ray.train.get_dataset_shard("train")
    step, epoch, micro = 0, 0, 0
    loss_sum, loss_count = 0.0, 0
    t_last, step_last = time.time(), 0
    device = engine.device
    while step < cfg.max_steps:
        for batch in shard.iter_torch_batches(batch_size=cfg.micro_batch_size, drop_last=True,
                                               dtypes=torch.long, device=device):
            tokens = batch["tokens"]
            loss = engine(tokens[:, :-1], tokens[:, 1:])[1]  # the logits are not kept alive
            for load, layer in zip(expert_load, moe_layers):
                load += layer.stats.tokens_per_expert
            engine.backward(loss)
            engine.step()
            micro += 1
            loss_sum += loss.item()
            loss_count += 1
            if micro % accum:
                continue
            step += 1
            if moe_layers:
                step_loads = _balance_experts(moe_layers, expert_load)
            last = step == cfg.max_steps
            if step % cfg.log_every == 0 or step == 1 or last:
                mean_loss = _mean_across_ranks(loss_sum / loss_count)
                loss_sum, loss_count = 0.0, 0
                now = time.time()
                tokens_per_s = (step - step_last) * tokens_per_step / max(now - t_last, 1e-9)
                tflops = tokens_per_s * flops_per_token / world / 1e12  # achieved, per worker
                metrics = {
                    "step": step, "epoch": epoch, "loss": mean_loss, "lr": scheduler.get_last_lr()[0],
                    "grad_norm": float(engine.get_global_grad_norm() or 0.0), "tokens_per_s": tokens_per_s,
                    "step_time_s": (now - t_last) / max(step - step_last, 1), "tflops_per_worker": tflops,
                }
                if peak:
                    metrics["mfu"] = tflops / peak
                if moe_layers:
                    metrics["expert_imbalance"] = imbalance(step_loads)
                    metrics["tokens_per_expert"] = step_loads
                t_last, step_last = now, step
                history.append(metrics)
                if rank == 0:
                    logger.info("step %d/%d loss %.4f lr %.2e grad_norm %.3f tokens/s %.0f%s", step, cfg.max_steps,
                                mean_loss, metrics["lr"], metrics["grad_norm"], metrics["tokens_per_s"],
                                f" expert imbalance {metrics['expert_imbalance']:.2f}" if moe_layers else "")
                if step % cfg.checkpoint_every == 0 or last:
                    ckpt_dir = None
                    weights = full_state(engine.module)  # collective: gathers sharded experts
                    if rank == 0:
                        state = {"step": step, "epoch": epoch, "tokens_seen": step * tokens_per_step,
                                 "loss": mean_loss, "loss_history": [[h["step"], h["loss"]] for h in history],
                                 "seed": cfg.seed, "config": cfg.model_dump(mode="json")}
                        ckpt_dir = _save_checkpoint(engine, weights, tokenizer_json, state)
                        write_metrics(run_dir, history)
                    ray.train.report(metrics, checkpoint=Checkpoint.from_directory(ckpt_dir) if ckpt_dir else None)
                    if ckpt_dir:
                        shutil.rmtree(ckpt_dir, ignore_errors=True)  # Ray Train has persisted it
                else:
                    ray.train.report(metrics)
            if last:
                break
        epoch += 1
