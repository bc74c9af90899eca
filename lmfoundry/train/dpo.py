"""Direct Preference Optimization (Rafailov et al., 2023) on Ray Train + DeepSpeed.

The policy starts from a checkpoint and learns to prefer each pair's chosen reply over its
rejected one, relative to a frozen copy of the starting weights (the reference):

    loss = -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

where log pi(reply) sums the reply's token log-probabilities after the prompt, rendered with the
checkpoint's chat template. The implicit reward of a reply is beta * (log pi - log ref); the
preference accuracy is the share of pairs whose chosen reply has the higher reward (0 at the
start, where policy and reference agree exactly).

The loop has pretraining's machinery (train/loop.py): DeepSpeed ZeRO with the same derived
config, asynchronous atomic checkpoints with the data position, exact resume after a worker
is killed, fault drills. Every worker reads the pairs file, orders it by the seed and takes its
slice of each global micro-batch, so the position is one number.
"""

from __future__ import annotations

import json
import logging
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, ChatTemplate
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, load_model_files
from lmfoundry.model.tokenizer import IM_END, eos_id
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.train.config import FaultDrill, PretrainConfig, deepspeed_config

logger = get_logger(__name__)


class DPOConfig(StageConfig):
    checkpoint: str = Field(..., description="the starting policy (and reference): a checkpoint or a run directory")
    pairs: str = Field(..., description="JSONL of {prompt, chosen, rejected}, plain text or chat messages")
    output: str = Field(..., description="the run directory")
    beta: float = Field(0.1, gt=0, description="how far the policy may move from the reference")
    lr: float = Field(5e-6, gt=0)
    warmup_steps: int = Field(2, ge=1, description="linear warmup, then cosine decay to 0")
    max_steps: int = Field(100, ge=1)
    micro_batch_size: int = Field(4, ge=1, description="pairs per worker per forward pass")
    global_batch_pairs: int = Field(16, ge=1, description="pairs per optimizer step, all workers")
    max_seq_len: int | None = Field(None, ge=8, description="prompt + reply tokens (default: the model's context)")
    num_workers: int = Field(2, ge=1)
    cpus_per_worker: float = Field(1.0, gt=0)
    use_gpu: bool = False
    zero_stage: int = Field(2, ge=0, le=3)
    precision: str = Field("auto", pattern="^(auto|fp32|bf16)$")
    grad_clip: float = Field(1.0, ge=0)
    weight_decay: float = Field(0.0, ge=0)
    checkpoint_every: int = Field(50, ge=1)
    keep_checkpoints: int = Field(2, ge=2)
    max_failures: int = Field(3, ge=0)
    drills: list[FaultDrill] = Field(default_factory=list)
    log_every: int = Field(10, ge=1)
    seed: int = 0
    overwrite: bool = False

    @model_validator(mode="after")
    def _check(self):
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below max_steps={self.max_steps}")
        per_micro_step = self.micro_batch_size * self.num_workers
        if self.global_batch_pairs % per_micro_step:
            raise ValueError(
                f"global_batch_pairs={self.global_batch_pairs} must be a multiple of micro_batch_size x "
                f"num_workers = {self.micro_batch_size} x {self.num_workers} = {per_micro_step}"
            )
        for drill in self.drills:
            if drill.kind != "kill" or drill.rank >= self.num_workers:
                raise ValueError(
                    f"drills: {drill.kind} at rank {drill.rank}; DPO takes kill drills on ranks "
                    f"0..{self.num_workers - 1}"
                )
        return self


def as_pretrain_config(cfg: DPOConfig, model_cfg) -> PretrainConfig:
    """The DeepSpeed settings of a DPO run, in the form the one derivation takes. A DPO step is
    counted in pairs, not tokens: with seq_len 1 in `deepspeed_config`, its token arithmetic
    counts pairs (global_batch_pairs = micro_batch_size x workers x accumulation)."""
    return PretrainConfig(
        data=cfg.pairs,
        output=cfg.output,
        model=model_cfg,
        num_workers=cfg.num_workers,
        use_gpu=cfg.use_gpu,
        zero_stage=cfg.zero_stage,
        precision=cfg.precision,
        micro_batch_size=cfg.micro_batch_size,
        global_batch_tokens=cfg.global_batch_pairs,
        max_steps=cfg.max_steps,
        lr=cfg.lr,
        warmup_steps=cfg.warmup_steps,
        weight_decay=cfg.weight_decay,
        grad_clip=cfg.grad_clip,
        min_lr_ratio=0.0,
        checkpoint_every=cfg.checkpoint_every,
        keep_checkpoints=cfg.keep_checkpoints,
        seed=cfg.seed,
    )


# --- the data --------------------------------------------------------------------------------


def _messages(prompt) -> list[dict]:
    if isinstance(prompt, str):
        return [{"role": "user", "content": prompt}]
    if isinstance(prompt, list) and all(isinstance(m, dict) and "role" in m for m in prompt):
        return prompt
    raise ValueError(f"a pair's prompt is text or a list of chat messages, not {type(prompt).__name__}")


def _reply_text(reply) -> str:
    if isinstance(reply, str):
        return reply
    if isinstance(reply, list) and reply and reply[-1].get("role") == "assistant":
        return reply[-1]["content"]
    raise ValueError("a pair's chosen/rejected is text or a list of messages ending with the assistant's")


class PairEncoder:
    """Pairs to token ids with the checkpoint's tokenizer and chat template: the prompt rendered
    up to the assistant's turn, each reply followed by the end-of-turn token."""

    def __init__(self, checkpoint_dir: str, max_seq_len: int):
        from tokenizers import Tokenizer

        self.tokenizer = Tokenizer.from_file(str(Path(checkpoint_dir) / TOKENIZER))
        self.template = ChatTemplate.from_checkpoint(checkpoint_dir)
        end = self.tokenizer.token_to_id(IM_END)
        self.end = end if end is not None else eos_id(self.tokenizer)
        self.max_seq_len = max_seq_len

    def encode(self, pair: dict) -> tuple[list[int], list[int], list[int]]:
        """(prompt, chosen, rejected) ids; the prompt cut from the left and the replies from the
        right so that prompt + each reply fits in max_seq_len."""
        prompt = self.tokenizer.encode(self.template.render(_messages(pair["prompt"])), add_special_tokens=False).ids
        replies = [
            self.tokenizer.encode(_reply_text(pair[k]), add_special_tokens=False).ids + [self.end]
            for k in ("chosen", "rejected")
        ]
        room = self.max_seq_len - min(len(prompt), self.max_seq_len // 2)
        prompt = prompt[-(self.max_seq_len - min(max(map(len, replies)), room)) :]
        replies = [r[: self.max_seq_len - len(prompt)] for r in replies]
        return prompt, replies[0], replies[1]


def read_pairs(uri: str) -> list[dict]:
    rows = storage.read_jsonl(uri)
    for n, row in enumerate(rows):
        missing = {"prompt", "chosen", "rejected"} - set(row)
        if missing:
            raise ValueError(f"{uri}: pair {n} needs prompt, chosen and rejected; missing {sorted(missing)}")
        if _reply_text(row["chosen"]) == _reply_text(row["rejected"]):
            raise ValueError(f"{uri}: pair {n}: chosen and rejected are the same reply (a tie is no preference)")
    if not rows:
        raise ValueError(f"{uri} holds no pairs")
    return rows


def collate(encoded: list[tuple[list[int], list[int], list[int]]], pad: int):
    """Rows 0..n-1 chosen, n..2n-1 rejected: (ids (2n, T), reply mask over targets (2n, T-1))."""
    sequences = [(p, c) for p, c, _ in encoded] + [(p, r) for p, _, r in encoded]
    width = max(len(p) + len(x) for p, x in sequences)
    ids = torch.full((len(sequences), width), pad, dtype=torch.long)
    mask = torch.zeros((len(sequences), width - 1))
    for row, (p, x) in enumerate(sequences):
        ids[row, : len(p) + len(x)] = torch.tensor(p + x)
        mask[row, len(p) - 1 : len(p) + len(x) - 1] = 1  # the targets that are reply tokens
    return ids, mask


def reply_logprobs(model, ids: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Summed log-probability of each row's reply tokens, (2n,)."""
    logits, _ = model(ids[:, :-1])
    logprobs = torch.log_softmax(logits.float(), dim=-1).gather(2, ids[:, 1:, None]).squeeze(2)
    return (logprobs * mask).sum(dim=1)


def dpo_loss(policy: torch.Tensor, reference: torch.Tensor, beta: float) -> tuple[torch.Tensor, dict]:
    """policy, reference: (2n,) reply log-probabilities, chosen rows first."""
    n = policy.shape[0] // 2
    chosen = beta * (policy[:n] - reference[:n])
    rejected = beta * (policy[n:] - reference[n:])
    loss = -F.logsigmoid(chosen - rejected).mean()
    stats = {
        "accuracy": float((chosen > rejected).float().mean()),
        "margin": float((chosen - rejected).mean()),
        "chosen_reward": float(chosen.mean()),
        "rejected_reward": float(rejected.mean()),
    }
    return loss, stats


def epoch_order(n: int, seed: int, epoch: int) -> list[int]:
    order = list(range(n))
    random.Random(seed * 100003 + epoch).shuffle(order)
    return order


@torch.no_grad()
def preference_accuracy(policy, reference, encoded: list, pad: int, beta: float, batch: int = 16) -> float:
    """The share of pairs whose chosen reply the policy rewards above the rejected one."""
    hits = 0
    for start in range(0, len(encoded), batch):
        ids, mask = collate(encoded[start : start + batch], pad)
        _, stats = dpo_loss(reply_logprobs(policy, ids, mask), reply_logprobs(reference, ids, mask), beta)
        hits += stats["accuracy"] * len(encoded[start : start + batch])
    return hits / len(encoded)


# --- the per-worker loop ------------------------------------------------------------------------


def dpo_loop(loop_config: dict) -> None:
    import deepspeed
    import ray.train
    import torch.distributed as dist

    from lmfoundry.train.loop import (
        Drills,
        RayTrainReporter,
        mean_across_ranks,
        param_groups,
        resume,
        stage_checkpoint,
        stage_root,
    )
    from lmfoundry.train.snapshot import SnapshotCheckpointEngine

    cfg = DPOConfig.model_validate(loop_config["cfg"])
    start_dir, run_dir = loop_config["start_dir"], loop_config["run_dir"]
    ctx = ray.train.get_context()
    rank, world = ctx.get_world_rank(), ctx.get_world_size()
    if rank != 0:
        logging.getLogger("DeepSpeed").setLevel(logging.WARNING)

    torch.manual_seed(cfg.seed)
    policy = load_model_files(start_dir).train()
    reference = load_model_files(start_dir).eval().requires_grad_(False)
    max_len = cfg.max_seq_len or policy.cfg.max_seq_len
    encoder = PairEncoder(start_dir, max_len)
    pairs = [encoder.encode(p) for p in read_pairs(cfg.pairs)]
    ds_config = deepspeed_config(as_pretrain_config(cfg, policy.cfg), world, seq_len=1)
    engine, _, _, scheduler = deepspeed.initialize(
        model=policy, model_parameters=param_groups(policy, cfg.weight_decay), config=ds_config
    )
    engine.checkpoint_engine = SnapshotCheckpointEngine(engine._config)
    reference.to(engine.device)
    accum = ds_config["gradient_accumulation_steps"]
    drills = Drills(cfg.drills, rank, run_dir)
    reporter = RayTrainReporter()
    checkpointer = checkpoint.AsyncCheckpointer(
        run_dir, rank, world, cfg.keep_checkpoints, before_commit=drills.during_save
    )
    staging = stage_root(None)
    tokenizer_json = (Path(start_dir) / TOKENIZER).read_text()

    state = resume(engine, run_dir, rank, world) or {}
    step, epoch, position = state.get("step", 0), state.get("epoch", 0), state.get("batches_in_epoch", 0)
    history: list[dict] = state.get("history", [])
    per_global = cfg.micro_batch_size * world
    batches_per_epoch = len(pairs) // per_global
    if batches_per_epoch == 0:
        raise ValueError(
            f"{len(pairs)} pairs are fewer than one global micro-batch (micro_batch_size x workers = {per_global})"
        )
    micro, sums, t_last, step_last = 0, {}, time.time(), step
    while step < cfg.max_steps:
        order = epoch_order(len(pairs), cfg.seed, epoch)
        for index in range(position, batches_per_epoch):
            chunk = order[index * per_global : (index + 1) * per_global]
            mine = [pairs[i] for i in chunk[rank * cfg.micro_batch_size : (rank + 1) * cfg.micro_batch_size]]
            ids, mask = collate(mine, encoder.end)
            ids, mask = ids.to(engine.device), mask.to(engine.device)
            with torch.no_grad():
                ref = reply_logprobs(reference, ids, mask)
            loss, stats = dpo_loss(reply_logprobs(engine, ids, mask), ref, cfg.beta)
            engine.backward(loss)
            engine.step()
            position, micro = index + 1, micro + 1
            for k, v in {"loss": loss.item(), **stats}.items():
                sums[k] = sums.get(k, 0.0) + v
            if micro % accum:
                continue
            step += 1
            last = step == cfg.max_steps
            save = step % cfg.checkpoint_every == 0 or last
            if step % cfg.log_every == 0 or step == 1 or save:
                count = micro
                metrics = {k: mean_across_ranks(v / count) for k, v in sums.items()}
                now = time.time()
                metrics.update(
                    step=step,
                    epoch=epoch,
                    lr=scheduler.get_last_lr()[0],
                    grad_norm=float(engine.get_global_grad_norm() or 0.0),
                    step_time_s=(now - t_last) / max(step - step_last, 1),
                    time=now,
                )
                history.append(metrics)
                sums, micro = {}, 0
                if rank == 0:
                    logger.info(
                        "dpo step %d/%d loss %.4f preference accuracy %.3f margin %.3f",
                        step,
                        cfg.max_steps,
                        metrics["loss"],
                        metrics["accuracy"],
                        metrics["margin"],
                    )
                if save:
                    checkpointer.wait()
                    train_state = {
                        "step": step,
                        "epoch": epoch,
                        "batches_in_epoch": position,
                        "world_size": world,
                        "history": history,
                        "loss_history": [[h["step"], h["loss"]] for h in history],
                        "seed": cfg.seed,
                        "config": cfg.model_dump(mode="json"),
                        "kind": "dpo",
                    }
                    staged, write = stage_checkpoint(engine, rank, step, train_state, tokenizer_json, staging)
                    if rank == 0:
                        # the chat template the policy was tuned with, not the default
                        template = Path(start_dir) / CHAT_TEMPLATE_FILE
                        write = _with_template(write, staged, template)
                    checkpointer.save(step, staged, {"kind": "lmfoundry.dpo", "step": step}, write)
                    if rank == 0:
                        storage.write_bytes_atomic(
                            storage.join(run_dir, "metrics.jsonl"),
                            "".join(json.dumps(h) + "\n" for h in history).encode(),
                        )
                reporter.maybe_report({k: v for k, v in metrics.items() if isinstance(v, (int, float))}, force=save)
                t_last, step_last = time.time(), step
            drills.after_step(step)
            if last:
                break
        else:
            epoch, position = epoch + 1, 0
    checkpointer.wait()
    dist.barrier()


def _with_template(write, staged: Path, template: Path):
    def write_then_template():
        write()
        if template.exists():
            (staged / CHAT_TEMPLATE_FILE).write_text(template.read_text())

    return write_then_template


# --- the driver -------------------------------------------------------------------------------


def run_dpo(cfg: DPOConfig) -> dict:
    from ray.train import ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    from lmfoundry.train.pretrain import fit, run_config

    start_uri = checkpoint.resolve(cfg.checkpoint)
    start_dir = checkpoint.local_copy(start_uri, model_only=True)
    checkpoint.verify(start_dir, model_only=True)
    pairs = read_pairs(cfg.pairs)  # fail now on a bad file, not inside the workers
    model_cfg = json.loads((Path(start_dir) / MODEL_CONFIG).read_text())
    deepspeed_config(as_pretrain_config(cfg, model_cfg), cfg.num_workers, seq_len=1)
    out = storage.normalize(cfg.output)
    if storage.is_committed(out) and not cfg.overwrite:
        logger.info("align: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_manifest(out)
    if cfg.overwrite:
        storage.remove_dir(out)
    started = time.time()
    trainer = TorchTrainer(
        dpo_loop,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "start_dir": start_dir, "run_dir": out},
        scaling_config=ScalingConfig(
            num_workers=cfg.num_workers, use_gpu=cfg.use_gpu, resources_per_worker={"CPU": cfg.cpus_per_worker}
        ),
        torch_config=TorchConfig(backend="nccl" if cfg.use_gpu else "gloo"),
        run_config=run_config(out, cfg.max_failures, cfg.use_gpu),
    )
    fit(trainer, cfg.max_failures, "DPO")
    final_uri = checkpoint.latest_valid(out)
    final = f"{checkpoint.CHECKPOINTS}/{final_uri.rstrip('/').rsplit('/', 1)[-1]}"
    final_dir = checkpoint.local_copy(final_uri, model_only=True)
    encoder = PairEncoder(start_dir, cfg.max_seq_len or model_cfg["max_seq_len"])
    encoded = [encoder.encode(p) for p in pairs]
    reference = load_model_files(start_dir)
    accuracy = {
        "before": preference_accuracy(reference, reference, encoded, encoder.end, cfg.beta),
        "after": preference_accuracy(load_model_files(final_dir), reference, encoded, encoder.end, cfg.beta),
    }
    state = storage.read_json(storage.join(final_uri, "train_state.json"))
    manifest = storage.commit(
        out,
        "align",
        {
            "start_checkpoint": start_uri,
            "pairs": cfg.pairs,
            "final_checkpoint": final,
            "steps": state["step"],
            "beta": cfg.beta,
            "preference_accuracy": accuracy,
            "first_loss": state["history"][0]["loss"],
            "final_loss": state["history"][-1]["loss"],
            "seconds": round(time.time() - started, 2),
        },
    )
    logger.info(
        "align: DPO %d steps, loss %.4f -> %.4f, preference accuracy on the training pairs %.3f -> %.3f",
        state["step"],
        manifest["first_loss"],
        manifest["final_loss"],
        accuracy["before"],
        accuracy["after"],
    )
    return manifest
