"""Direct Preference Optimization (Rafailov et al., 2023) on Ray Train + DeepSpeed.

The policy starts from a checkpoint and learns to prefer each pair's chosen reply over its
rejected one, relative to a frozen copy of the starting weights (the reference):

    loss = -log sigmoid(beta * ((log pi(chosen) - log ref(chosen)) - (log pi(rejected) - log ref(rejected))))

where log pi(reply) sums the reply's token log-probabilities after the prompt, rendered with the
checkpoint's chat template. The implicit reward of a reply is beta * (log pi - log ref); the
preference accuracy is the share of pairs whose chosen reply has the higher reward (0 at the
start, where policy and reference agree exactly).

DPO is an objective of the one training loop (train/skeleton.py), so it has pretraining's
machinery: DeepSpeed ZeRO with the same derived config, asynchronous atomic checkpoints with the
data position, exact resume after a worker is killed, non-finite and spike handling, fault
drills. Every worker reads the pairs file, orders it by the seed and takes its slice of each
global micro-batch, so the position is one number.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import ClassVar

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from lmfoundry.model.chat_template import ChatTemplate
from lmfoundry.model.checkpoint import TOKENIZER, load_model_files, load_model_on_meta
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.train import held_out, skeleton
from lmfoundry.train.config import (
    CheckpointingConfig,
    OptimizerConfig,
    PairBatchConfig,
    ScheduleConfig,
    TrainStageConfig,
)
from lmfoundry.train.engine import check_every_world_size, place_frozen
from lmfoundry.train.launch import open_run_dir, train_on_ray, worker_config
from lmfoundry.train.node_copies import driver_copy, on_each_node
from lmfoundry.train.position import epoch_order
from lmfoundry.train.pretrain import start_texts

logger = get_logger(__name__)


# DPO's defaults where they differ from pretraining's: a small step from a trained model
class DPOOptimizerConfig(OptimizerConfig):
    lr: float = Field(5e-6, gt=0, description="the peak learning rate")
    weight_decay: float = Field(0.0, ge=0, description="on matrices only; norms and embeddings are not decayed")


class DPOScheduleConfig(ScheduleConfig):
    max_steps: int = Field(100, ge=1)
    warmup_steps: int = Field(2, ge=1, description="linear warmup, then cosine decay to min_lr_ratio")
    min_lr_ratio: float = Field(0.0, ge=0, le=1)


class DPOCheckpointingConfig(CheckpointingConfig):
    every: int = Field(50, ge=1, description="optimizer steps between checkpoints")


class DPOConfig(TrainStageConfig):
    checkpoint: str = Field(..., description="the starting policy (and reference): a checkpoint or a run directory")
    pairs: str = Field(..., description="JSONL of {prompt, chosen, rejected}, plain text or chat messages")
    beta: float = Field(0.1, gt=0, description="how far the policy may move from the reference")
    max_seq_len: int | None = Field(None, ge=8, description="prompt + reply tokens (default: the model's context)")
    batch: PairBatchConfig = PairBatchConfig()
    optimizer: DPOOptimizerConfig = DPOOptimizerConfig()
    schedule: DPOScheduleConfig = DPOScheduleConfig()
    checkpointing: DPOCheckpointingConfig = DPOCheckpointingConfig()

    LEGACY_KEYS: ClassVar[dict[str, str]] = {
        **TrainStageConfig.LEGACY_KEYS,
        **{k: f"batch.{k}" for k in ("micro_batch_size", "global_batch_pairs")},
    }

    @model_validator(mode="after")
    def _check(self):
        self.batch.accumulation(self.parallelism.num_workers)
        if self.parallelism.expert_parallel_size > 1:
            raise ValueError("parallelism.expert_parallel_size: DPO trains without expert parallelism")
        return self


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
        special = SpecialTokens.of_checkpoint(checkpoint_dir)
        # the end of a turn (<|im_end|>, or an imported model's own), else the end of sequence
        ends = [i for i in (self.tokenizer.token_to_id(t) for t in special.stop) if i is not None]
        self.end = ends[0] if ends else special.eos_id(self.tokenizer)
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


@torch.no_grad()
def preference_hits(policy, reference, pairs: list, pad: int, beta: float, device) -> tuple[float, float]:
    """How many of the pairs' chosen replies the policy rewards above the rejected ones, and of
    how many pairs (the policy may be the reference itself: then none)."""
    ids, mask = collate(pairs, pad)
    ids, mask = ids.to(device), mask.to(device)
    reference_logprobs = reply_logprobs(reference, ids, mask)
    policy_logprobs = reference_logprobs if policy is reference else reply_logprobs(policy, ids, mask)
    _, stats = dpo_loss(policy_logprobs, reference_logprobs, beta)
    return stats["accuracy"] * len(pairs), float(len(pairs))


# --- the objective ------------------------------------------------------------------------------


class DPOObjective:
    """The DPO loss of the policy (the engine's model) against the frozen reference, over this
    rank's slice of each global micro-batch of pairs."""

    kind = "dpo"
    seq_len = 1  # the batch counts pairs
    tokens_per_step = flops_per_token = None
    adapter = None  # trains every weight
    initial_values = None  # a meta-built model's are its own

    def __init__(self, cfg: DPOConfig, start_dir: str, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        torch.manual_seed(cfg.seed)
        # under ZeRO-3 no worker holds a whole model: the policy and the reference are built on
        # the meta device, each parameter read from the checkpoint and partitioned in turn
        load = load_model_on_meta if cfg.parallelism.zero_stage == 3 else load_model_files
        self.model = load(start_dir).train()
        self.num_params = self.model.num_params()
        self.reference = load(start_dir).eval().requires_grad_(False)
        self.encoder = PairEncoder(start_dir, cfg.max_seq_len or self.model.cfg.max_seq_len)
        self.pairs = [self.encoder.encode(p) for p in read_pairs(cfg.pairs)]
        self.tokenizer_json = (Path(start_dir) / TOKENIZER).read_text()
        self.chat_template, self.special_tokens = start_texts(start_dir)  # an imported model keeps its own
        self.per_global = cfg.batch.micro_batch_size * world
        self.batches_per_epoch = len(self.pairs) // self.per_global
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(self.pairs)} pairs are fewer than one global micro-batch "
                f"(micro_batch_size x workers = {self.per_global})"
            )
        self.device = None

    def attach(self, engine) -> None:
        self.device = engine.device
        self.reference = place_frozen(self.reference, engine)  # under ZeRO-3 a collective: every rank

    def report(self, engine, final_dir: str) -> dict:
        """The preference accuracy on the training pairs of the starting checkpoint (the
        reference: 0) and of the final one, each against the reference."""

        def accuracy(policy) -> float:
            hits, pairs = held_out.summed_over_ranks(
                self.pairs,
                self.cfg.batch.micro_batch_size,
                lambda some: preference_hits(
                    policy, self.reference, some, self.encoder.end, self.cfg.beta, self.device
                ),
                self.device,
            )
            return hits / max(pairs, 1)

        return {
            "preference_accuracy": {
                "before": accuracy(self.reference),
                "after": accuracy(held_out.frozen_from(final_dir, engine)),
            }
        }

    def batches(self, epoch: int, skip: int):
        order = epoch_order(len(self.pairs), self.cfg.seed, epoch)
        mbs = self.cfg.batch.micro_batch_size
        for index in range(skip, self.batches_per_epoch):
            chunk = order[index * self.per_global : (index + 1) * self.per_global]
            yield index, [self.pairs[i] for i in chunk[self.rank * mbs : (self.rank + 1) * mbs]]

    def loss(self, engine, pairs: list) -> tuple[torch.Tensor, dict]:
        ids, mask = collate(pairs, self.encoder.end)
        ids, mask = ids.to(self.device), mask.to(self.device)
        with torch.no_grad():
            reference = reply_logprobs(self.reference, ids, mask)
        return dpo_loss(reply_logprobs(engine, ids, mask), reference, self.cfg.beta)

    def describe(self, metrics: dict) -> str:
        return f"preference accuracy {metrics['accuracy']:.3f} margin {metrics['margin']:.3f}"

    def train_state(self, step: int) -> dict:
        return {"kind": "dpo"}


def dpo_loop(loop_config: dict) -> None:
    """Ray Train's per-worker function."""
    cfg = DPOConfig.model_validate(loop_config["cfg"])
    run_dir = loop_config["run_dir"]
    with on_each_node(run_dir, **loop_config["start"]) as start_dir:  # this node's copy (train/node_copies.py)
        skeleton.run(cfg, run_dir, lambda rank, world: DPOObjective(cfg, start_dir, rank, world))


# --- the driver -------------------------------------------------------------------------------


def run_dpo(cfg: DPOConfig) -> dict:
    start_uri = checkpoint.resolve(cfg.checkpoint)
    start_dir = checkpoint.local_copy(start_uri, model_only=True)
    try:
        checkpoint.verify(start_dir, model_only=True)
        read_pairs(cfg.pairs)  # fail now on a bad file, not inside the workers
        check_every_world_size(cfg, seq_len=1)
        out, done = open_run_dir(cfg, "align")
        if done:
            return done
        started = time.time()
        loop_config = {"cfg": worker_config(cfg, "pairs"), "start": driver_copy(start_uri, start_dir), "run_dir": out}
        _, final, state = train_on_ray(dpo_loop, loop_config, cfg, out, "DPO")
        accuracy = held_out.read_report(out, final)["preference_accuracy"]
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
    finally:  # a temporary copy of a remote checkpoint
        checkpoint.remove_copy(start_dir, start_uri)
