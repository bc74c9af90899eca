"""Supervised fine-tuning on conversations (Ray Train + DeepSpeed), an objective of the one
training loop (train/skeleton.py).

The model starts from a checkpoint (lmfoundry's own or one `lmfoundry import hf` wrote) and learns
the assistant's turns: next-token cross-entropy over the tokens its chat template marks as
generation, on rows that pack several conversations without attention across them
(train/sft_data.py). Every worker reads the conversations file, packs it the same way, orders the
rows by the seed and takes its slice of each global micro-batch, so the data position is one
number, and the loop's machinery (ZeRO 1-3, asynchronous checkpoints, exact resume, non-finite and
spike handling, fault drills, the evaluation gate's actions) is pretraining's.

The loss is computed in two steps so that another term can join it: `token_losses` gives the
logits, each target's cross-entropy and the mask of targets that count; `loss` averages them over
the micro-batch's assistant tokens.

With a `distill` section the loss gains a token-level distillation term: a teacher checkpoint with
the same tokenizer runs frozen in each worker beside the student, and on the same assistant tokens
the loss is (1 - weight) x cross-entropy + weight x T^2 x KL(teacher || student), both
distributions softened by the temperature T (Hinton et al. 2015, "Distilling the Knowledge in a
Neural Network": the T^2 keeps the soft term's gradients on the hard term's scale as T changes).

With a `lora` section the base weights stay frozen and only low-rank adapters train (model/lora.py):
the optimizer holds the adapters alone, and every checkpoint holds the adapter and a reference to
the base checkpoint (URI and weights' sha256), which loading merges back in.
"""

from __future__ import annotations

import contextlib
import fnmatch
import json
import time
from pathlib import Path
from typing import Annotated

import numpy as np
import torch
import torch.nn.functional as F
from pydantic import Field, StringConstraints, model_validator

from lmfoundry.model.checkpoint import (
    MODEL_CONFIG,
    TOKENIZER,
    WEIGHTS,
    base_sha256,
    load_model_files,
    load_model_on_meta,
)
from lmfoundry.model.flops import train_flops_per_token
from lmfoundry.model.lora import ADAPTER_WEIGHTS, AdapterRef, LoraConfig, LoRALinear, apply_lora
from lmfoundry.model.transformer import ModelConfig, build_on_meta
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.train import held_out, skeleton
from lmfoundry.train.config import (
    CheckpointingConfig,
    OptimizerConfig,
    ScheduleConfig,
    SequenceBatchConfig,
    TrainStageConfig,
)
from lmfoundry.train.engine import check_every_world_size, place_frozen
from lmfoundry.train.launch import open_run_dir, train_on_ray, worker_config
from lmfoundry.train.node_copies import driver_copy, on_each_node
from lmfoundry.train.position import epoch_order
from lmfoundry.train.pretrain import plot_loss, start_texts
from lmfoundry.train.sft_data import PAD_DOC, Packed, prepare

logger = get_logger(__name__)


# SFT's defaults where they differ from pretraining's: smaller steps from a trained model
class SFTOptimizerConfig(OptimizerConfig):
    lr: float = Field(2e-5, gt=0, description="the peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="on matrices only; norms and embeddings are not decayed")


class SFTScheduleConfig(ScheduleConfig):
    max_steps: int = Field(100, ge=1)
    warmup_steps: int = Field(3, ge=0, description="linear warmup, then cosine decay to min_lr_ratio")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class SFTCheckpointingConfig(CheckpointingConfig):
    every: int = Field(50, ge=1, description="optimizer steps between checkpoints")


class TokenDistillConfig(StageConfig):
    teacher: str = Field(..., description="the teacher: a checkpoint or run directory with the student's tokenizer")
    temperature: float = Field(1.0, gt=0, le=100, description="softens both distributions before the KL")
    weight: float = Field(
        0.5, ge=0, le=1, description="of the KL term; the cross-entropy on the data's tokens takes 1 - weight"
    )


def freeze(model: torch.nn.Module, patterns: list[str]) -> None:
    """Keep the parameters whose names match a pattern at their starting values. A pattern that
    matches nothing, or patterns that match everything, are refused with the names there are. A
    tied model has one `embed.weight` for its embedding and its head: freezing it freezes both."""
    if not patterns:
        return
    names = [name for name, _ in model.named_parameters()]
    for pattern in patterns:
        if not any(fnmatch.fnmatchcase(name, pattern) for name in names):
            shown = ", ".join(names[:12]) + (f" and {len(names) - 12} more" if len(names) > 12 else "")
            tied = getattr(model, "cfg", None) is not None and model.cfg.tie_embeddings
            hint = (
                " (a tied head is embed.weight; untie_embeddings gives it a weight of its own)"
                if tied and fnmatch.fnmatchcase("lm_head.weight", pattern)
                else ""
            )
            raise ValueError(f"freeze: {pattern!r} matches no parameter{hint}; the model's are {shown}")
    frozen = {name for name in names if any(fnmatch.fnmatchcase(name, p) for p in patterns)}
    if len(frozen) == len(names):
        raise ValueError(f"freeze: {patterns} freezes every parameter; nothing would train")
    for name, param in model.named_parameters():
        if name in frozen:
            param.requires_grad_(False)


def values_after_wrapping(model: torch.nn.Module, loaded: dict) -> dict:
    """The loaded checkpoint's values of the parameters still on the meta device, by their names
    after adapters and an untied head changed them: an adapted projection's weight and bias are
    its base's (`X.base.weight` was `X.weight`), an untied head starts as the embedding."""
    renamed = {}
    for path, module in model.named_modules():
        if isinstance(module, LoRALinear):
            for attr, _ in module.base.named_parameters(recurse=False):
                renamed[f"{path}.base.{attr}"] = f"{path}.{attr}"
    if "lm_head.weight" not in loaded:  # tied in the checkpoint
        renamed["lm_head.weight"] = "embed.weight"
    return {name: loaded[renamed.get(name, name)] for name, p in model.named_parameters() if p.is_meta}


def check_model_settings(cfg: SFTConfig, model_cfg: dict) -> None:
    """`untie_embeddings` and `freeze` tried on the starting model built on the meta device (no
    weights), so that a setting the model refuses fails now, not in every worker."""
    model = build_on_meta(ModelConfig.model_validate(model_cfg))
    if cfg.untie_embeddings:
        model.untie_head()
    freeze(model, cfg.freeze)


class SFTConfig(TrainStageConfig):
    checkpoint: str = Field(..., description="the starting model: a checkpoint or a run directory")
    data: str = Field(
        ..., description='JSONL of {"messages": [...], "tools": [...]} (system/developer/user/assistant/tool turns)'
    )
    max_seq_len: int | None = Field(
        None,
        ge=8,
        description="tokens per packed row, the last a target only; longer conversations are cut (default: the model's context + 1)",
    )
    batch: SequenceBatchConfig = SequenceBatchConfig()
    optimizer: SFTOptimizerConfig = SFTOptimizerConfig()
    schedule: SFTScheduleConfig = SFTScheduleConfig()
    checkpointing: SFTCheckpointingConfig = SFTCheckpointingConfig()
    lora: LoraConfig | None = Field(
        None, description="train low-rank adapters only; checkpoints hold the adapter and a reference to the base"
    )
    distill: TokenDistillConfig | None = Field(
        None, description="add KL(teacher || student) on the assistant tokens, from a local teacher checkpoint"
    )
    freeze: list[Annotated[str, StringConstraints(min_length=1, max_length=256)]] = Field(
        [],
        max_length=64,
        description="parameters kept at their starting values, by name pattern (fnmatch, e.g. 'blocks.*.attn.*'); "
        "the rest train",
    )
    untie_embeddings: bool = Field(
        False,
        description="a tied model's output head gets a weight of its own, starting as the embedding "
        "(freeze ['lm_head.weight'] then keeps the starting model's output rows while the input embedding trains)",
    )

    @model_validator(mode="after")
    def _check(self):
        self.batch.accumulation(self.parallelism.num_workers)
        if self.parallelism.expert_parallel_size > 1:
            raise ValueError("parallelism.expert_parallel_size: SFT trains without expert parallelism")
        if self.freeze and self.lora is not None:
            raise ValueError("freeze: a LoRA run freezes every base weight already; give freeze or lora, not both")
        if self.untie_embeddings and self.lora is not None:
            raise ValueError(
                "untie_embeddings: a LoRA run's checkpoint is its base plus adapters, which keeps the base tied"
            )
        return self


def row_length(cfg: SFTConfig, model_max_seq_len: int) -> int:
    """Tokens per packed row: the model sees all but the last (the last is only a target)."""
    if cfg.max_seq_len is not None and cfg.max_seq_len - 1 > model_max_seq_len:
        raise ValueError(f"max_seq_len={cfg.max_seq_len} exceeds the model's context of {model_max_seq_len} + 1")
    return cfg.max_seq_len or model_max_seq_len + 1


def token_losses(model, tokens: torch.Tensor, assistant: torch.Tensor, docs: torch.Tensor):
    """Logits (B, T-1, V), each target's cross-entropy (B, T-1) and the mask of targets that count
    (B, T-1): assistant tokens predicted from within their own conversation."""
    logits, _ = model(tokens[:, :-1], doc_ids=docs[:, :-1])
    targets = tokens[:, 1:]
    losses = F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(), reduction="none").view_as(targets)
    counted = assistant[:, 1:] & (docs[:, 1:] == docs[:, :-1])
    return logits, losses, counted


def masked_mean(losses: torch.Tensor, counted: torch.Tensor) -> torch.Tensor:
    return (losses * counted).sum() / counted.sum().clamp(min=1)


def distill_kl(teacher_logits: torch.Tensor, student_logits: torch.Tensor, temperature: float) -> torch.Tensor:
    """KL(teacher || student) of each position (..., V) -> (...), both softened by `temperature`."""
    teacher = F.log_softmax(teacher_logits.float() / temperature, dim=-1)
    student = F.log_softmax(student_logits.float() / temperature, dim=-1)
    return (teacher.exp() * (teacher - student)).sum(-1)


def check_same_vocabulary(student_dir: str, teacher_dir: str, student: str, teacher: str) -> None:
    """Token-level distillation compares distributions token id by token id: the two tokenizers
    must map the same strings to the same ids, and the models must have as many logits."""
    from tokenizers import Tokenizer

    vocab = {}
    for name, directory in ((student, student_dir), (teacher, teacher_dir)):
        path = Path(directory) / TOKENIZER
        if not path.is_file():
            raise ValueError(f"distill: {name} has no {TOKENIZER}; token-level distillation needs both tokenizers")
        config = json.loads((Path(directory) / MODEL_CONFIG).read_text())
        vocab[name] = (Tokenizer.from_file(str(path)).get_vocab(), config["vocab_size"])
    (s_tokens, s_size), (t_tokens, t_size) = vocab[student], vocab[teacher]
    if s_tokens != t_tokens or s_size != t_size:
        differ = sorted(set(s_tokens.items()) ^ set(t_tokens.items()))[:3]
        raise ValueError(
            f"distill.teacher: the teacher {teacher} ({len(t_tokens)} tokens, {t_size} logits) and the student "
            f"{student} ({len(s_tokens)} tokens, {s_size} logits) do not share a vocabulary"
            + (f" (first differences, token and id: {differ})" if differ else "")
            + "; token-level distillation needs the same tokenizer (use `lmfoundry distill` for sequence-level "
            "distillation across tokenizers)"
        )


class SFTObjective:
    """Cross-entropy over the assistant tokens of this rank's slice of each global micro-batch."""

    kind = "sft"

    def __init__(
        self,
        cfg: SFTConfig,
        start_dir: str,
        rank: int,
        world: int,
        adapter: AdapterRef | None = None,
        teacher_dir: str | None = None,
    ):
        self.cfg, self.rank, self.world, self.adapter = cfg, rank, world, adapter
        self.start_dir = start_dir
        torch.manual_seed(cfg.seed)
        # under ZeRO-3 no worker holds the whole model: built on the meta device, each parameter
        # read from the checkpoint and partitioned in turn when the engine is built
        on_meta = cfg.parallelism.zero_stage == 3
        self.model = load_model_on_meta(start_dir) if on_meta else load_model_files(start_dir).train()
        loaded = self.model.initial_values() if on_meta else None  # by the checkpoint's names
        self.teacher = None
        if cfg.distill is not None:  # frozen: no gradients, no optimizer state, not in checkpoints
            # under ZeRO-3 partitioned like the student, in an engine of its own (attach)
            self.teacher = (load_model_on_meta if on_meta else load_model_files)(teacher_dir)
            self.teacher.eval().requires_grad_(False)
        self.seq_len = row_length(cfg, self.model.cfg.max_seq_len)
        # the full model's training FLOPs (a LoRA or `freeze` run's are fewer: no gradients of
        # frozen weights; its MFU is overstated by that much)
        self.flops_per_token = train_flops_per_token(self.model, self.seq_len - 1)
        if adapter is not None:
            # the same adapters on every rank and whether the model was built whole (which draws from
            # torch's generator) or on the meta device (which does not)
            torch.manual_seed(cfg.seed)
            apply_lora(self.model, adapter.lora)
        if cfg.untie_embeddings:
            self.model.untie_head()
        freeze(self.model, cfg.freeze)
        self.initial_values = None if loaded is None else values_after_wrapping(self.model, loaded)
        self.num_params = self.model.num_params()
        self.packed, _ = prepare(cfg.data, start_dir, self.seq_len)
        self.tokenizer_json = (Path(start_dir) / TOKENIZER).read_text()
        self.chat_template, self.special_tokens = start_texts(start_dir)
        self.per_global = cfg.batch.micro_batch_size * world
        self.batches_per_epoch = len(self.packed) // self.per_global
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(self.packed)} packed rows are fewer than one global micro-batch "
                f"(micro_batch_size x workers = {self.per_global})"
            )
        # padding included: the model computes over whole rows
        self.tokens_per_step = cfg.batch.global_batch_sequences * (self.seq_len - 1)
        self.device = None

    def attach(self, engine) -> None:
        self.device = engine.device
        if self.teacher is not None:  # under ZeRO-3 a collective: every rank
            self.teacher = place_frozen(self.teacher, engine)

    def report(self, engine, final_dir: str) -> dict:
        """The assistant loss of the starting and of the final checkpoint over the same rows,
        ASSISTANT_LOSS_ROWS of them spread over the data."""
        rows = sample_rows(len(self.packed))
        # a LoRA run's final checkpoint is an adapter over the checkpoint it started from: read
        # from this node's copy of that, not downloaded again by every rank
        base_copies = {self.adapter.base: self.start_dir} if self.adapter is not None else None

        def mean_loss(directory: str) -> float:
            model = held_out.frozen_from(directory, engine, base_copies)
            total, count = held_out.summed_over_ranks(
                rows,
                self.cfg.batch.micro_batch_size,
                lambda some: assistant_loss_sum(model, self.packed, some, self.device),
                self.device,
            )
            return total / max(count, 1)

        return {
            "assistant_loss": {"before": mean_loss(self.start_dir), "after": mean_loss(final_dir), "rows": len(rows)}
        }

    def batches(self, epoch: int, skip: int):
        order = epoch_order(len(self.packed), self.cfg.seed, epoch)
        mbs, p = self.cfg.batch.micro_batch_size, self.packed
        for index in range(skip, self.batches_per_epoch):
            chunk = order[index * self.per_global : (index + 1) * self.per_global]
            rows = chunk[self.rank * mbs : (self.rank + 1) * mbs]
            yield (
                index,
                (torch.from_numpy(p.tokens[rows]), torch.from_numpy(p.assistant[rows]), torch.from_numpy(p.docs[rows])),
            )

    def token_losses(self, engine, batch):
        tokens, assistant, docs = (t.to(self.device) for t in batch)
        return token_losses(engine, tokens, assistant, docs)

    def loss(self, engine, batch) -> tuple[torch.Tensor, dict]:
        logits, losses, counted = self.token_losses(engine, batch)
        tokens = float((batch[2] != PAD_DOC).sum())  # conversation tokens, padding not counted
        metrics = {"assistant_tokens": float(counted.sum()), "tokens": tokens}
        ce = masked_mean(losses, counted)
        if self.teacher is None:
            return ce, metrics
        return distill_loss(self.teacher, self.cfg.distill, batch, logits, ce, counted, self.device, metrics)

    def describe(self, metrics: dict) -> str:
        return (
            f"lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f} tokens/s {metrics['tokens_per_s']:.0f} "
            f"assistant tokens per micro-batch {metrics['assistant_tokens']:.0f}"
        )

    def train_state(self, step: int) -> dict:
        return {"kind": "sft"}


def distill_loss(teacher, cfg: TokenDistillConfig, batch, logits, ce, counted, device, metrics: dict):
    """(1 - weight) x cross-entropy + weight x T^2 x KL(teacher || student), the KL averaged over
    the same assistant tokens as the cross-entropy."""
    tokens, _, docs = (t.to(device) for t in batch)
    with torch.no_grad():
        teacher_logits, _ = teacher(tokens[:, :-1], doc_ids=docs[:, :-1])
    kl = masked_mean(distill_kl(teacher_logits, logits, cfg.temperature), counted)
    metrics.update(ce=ce.item(), kl=kl.item())
    return (1 - cfg.weight) * ce + cfg.weight * cfg.temperature**2 * kl, metrics


def sft_loop(loop_config: dict) -> None:
    """Ray Train's per-worker function."""
    cfg = SFTConfig.model_validate(loop_config["cfg"])
    base = loop_config["adapter_base"]
    adapter = AdapterRef(cfg.lora, *base) if cfg.lora is not None else None
    run_dir, teacher = loop_config["run_dir"], loop_config["teacher"]
    with contextlib.ExitStack() as copies:  # the checkpoints as this node's copies (train/node_copies.py)
        start_dir = copies.enter_context(on_each_node(run_dir, **loop_config["start"]))
        teacher_dir = copies.enter_context(on_each_node(run_dir, **teacher)) if teacher else None
        skeleton.run(cfg, run_dir, lambda rank, world: SFTObjective(cfg, start_dir, rank, world, adapter, teacher_dir))


# Rows the before/after assistant loss reads: a sample spread over the whole data, so that the
# report after a run costs seconds, not another pass over the data.
ASSISTANT_LOSS_ROWS = 256


def sample_rows(n: int, at_most: int = ASSISTANT_LOSS_ROWS) -> np.ndarray:
    """At most `at_most` row indices of `n`, evenly spread (all of them when there are fewer)."""
    return np.unique(np.linspace(0, n - 1, num=min(n, at_most)).round().astype(np.int64)) if n else np.arange(0)


def assistant_loss_sum(model, packed: Packed, rows: list, device) -> tuple[float, float]:
    """The summed cross-entropy over every assistant token of the packed data's `rows`, and how
    many tokens that is."""
    tokens, assistant, docs = (
        torch.from_numpy(a[rows]).to(device) for a in (packed.tokens, packed.assistant, packed.docs)
    )
    _, losses, counted = token_losses(model, tokens, assistant, docs)
    return float((losses * counted).sum()), float(counted.sum())


def run_sft(cfg: SFTConfig) -> dict:
    start_uri = checkpoint.resolve(cfg.checkpoint)
    start_dir = checkpoint.local_copy(start_uri, model_only=True)
    teacher_dir = teacher_uri = None
    try:
        start_manifest = checkpoint.verify(start_dir, model_only=True)
        if cfg.distill is not None:
            teacher_uri = checkpoint.resolve(cfg.distill.teacher)
            teacher_dir = checkpoint.local_copy(teacher_uri, model_only=True)
            checkpoint.verify(teacher_dir, model_only=True)
            check_same_vocabulary(start_dir, teacher_dir, cfg.checkpoint, cfg.distill.teacher)
        # a LoRA run's checkpoints name their base: this checkpoint, by URI and the checksum of its weights
        adapter_base = (start_uri, base_sha256(start_manifest, start_uri)) if cfg.lora is not None else None
        model_cfg = json.loads((Path(start_dir) / MODEL_CONFIG).read_text())
        check_model_settings(cfg, model_cfg)
        seq_len = row_length(cfg, model_cfg["max_seq_len"])
        packed, report = prepare(cfg.data, start_dir, seq_len)  # fail now on a bad file, not inside the workers
        per_global = cfg.batch.micro_batch_size * cfg.parallelism.num_workers
        if len(packed) < per_global:
            raise ValueError(
                f"{cfg.data!r} packs into {len(packed)} rows of {seq_len} tokens, fewer than one global "
                f"micro-batch (micro_batch_size x num_workers = {per_global}); add conversations or lower "
                "batch.micro_batch_size"
            )
        check_every_world_size(cfg, seq_len)
        if report["truncated"] or sum(report["skipped"].values()):
            logger.warning(
                "sft: %d of %d conversations cut to %d tokens; skipped: %s",
                report["truncated"],
                report["conversations"],
                seq_len,
                report["skipped"],
            )
        out, done = open_run_dir(cfg, "sft")
        if done:
            return done
        started = time.time()
        loop_config = {
            # the workers run in another directory: a relative data path would name nothing there
            "cfg": worker_config(cfg, "data"),
            # each checkpoint by its URI and the driver's copy (which the workers on its node read)
            "start": driver_copy(start_uri, start_dir),
            "run_dir": out,
            "adapter_base": adapter_base,
            "teacher": driver_copy(teacher_uri, teacher_dir) if teacher_uri is not None else None,
        }
        _, final, state = train_on_ray(sft_loop, loop_config, cfg, out, "SFT")
        loss = held_out.read_report(out, final)["assistant_loss"]
        gate_action = storage.join(out, checkpoint.GATE_ACTION)
        stopped = storage.read_json(gate_action) if storage.exists(gate_action) else None
        plot_loss(out)
        manifest = storage.commit(
            out,
            "sft",
            {
                "start_checkpoint": start_uri,
                "data": cfg.data,
                "data_report": report,
                "final_checkpoint": final,
                "steps": state["step"],
                "assistant_loss": loss,
                "first_loss": state["history"][0]["loss"],
                "final_loss": state["history"][-1]["loss"],
                "fingerprint": storage.fingerprint(out, [f"{final}/{ADAPTER_WEIGHTS if cfg.lora else WEIGHTS}"]),
                **({"lora": cfg.lora.model_dump(), "base_sha256": adapter_base[1]} if cfg.lora else {}),
                **({"freeze": cfg.freeze} if cfg.freeze else {}),
                **({"untie_embeddings": True} if cfg.untie_embeddings else {}),
                "seed": cfg.seed,
                "seconds": round(time.time() - started, 2),
                **({"stopped_by_gate": stopped} if stopped and stopped.get("action") == "stop" else {}),
            },
        )
        logger.info(
            "sft: %d steps, loss %.4f -> %.4f; assistant loss on the training data %.4f -> %.4f",
            state["step"],
            manifest["first_loss"],
            manifest["final_loss"],
            loss["before"],
            loss["after"],
        )
        return manifest
    finally:  # temporary copies of remote checkpoints
        checkpoint.remove_copy(start_dir, start_uri)
        if teacher_dir is not None:
            checkpoint.remove_copy(teacher_dir, teacher_uri)
