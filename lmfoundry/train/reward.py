"""Reward models on Ray Train + DeepSpeed: an outcome model scores a whole reply, a process model
scores every step of a solution.

    lmfoundry reward configs/reward_process.yaml --input CHECKPOINT --output RUN

The model is the starting checkpoint's decoder with its vocabulary projection replaced by a scalar
head (`reward_head` in its model config; the head starts at zero, so every score starts at 0).
A score is read at the last token of what it rates. Data, a JSONL whose rows are one of:

- `{prompt, chosen, rejected}` (the pairs of `lmfoundry pairs`): outcome, Bradley-Terry,
  loss = -log sigmoid(r(chosen) - r(rejected)); rendered with the checkpoint's chat template;
- `{prompt, reply, label}` (e.g. verified and failed answers, label 1 or 0): outcome, pointwise,
  binary cross-entropy of the reply's score;
- `{prompt, steps, labels}` (step labels, e.g. from reasoning/step_labels.py): process, binary
  cross-entropy of the score after each step (a label may be a soft target in [0, 1]).

Text rows are encoded piece by piece by clients/reward.py, which the scorer uses at inference too:
the prompt, then each step with its delimiter (or the reply and the end-of-sequence token), so a
step's score sits where the scorer reads it.

A reward model is an objective of the one training loop (train/skeleton.py): asynchronous
checkpoints, exact resume after a killed worker, fault drills. The run reports accuracy on a
held-out slice of the data before and after training.
"""

from __future__ import annotations

import functools
import json
import random
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from pydantic import Field, model_validator

from lmfoundry.clients.reward import encode_reply, encode_steps
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, load_model_files, load_model_on_meta
from lmfoundry.model.tokenizer import SpecialTokens
from lmfoundry.model.transformer import ModelConfig, Transformer, build_on_meta
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.train import held_out, skeleton
from lmfoundry.train.config import RewardBatchConfig, TrainStageConfig
from lmfoundry.train.dpo import DPOCheckpointingConfig, DPOOptimizerConfig, DPOScheduleConfig, PairEncoder
from lmfoundry.train.engine import check_every_world_size
from lmfoundry.train.launch import open_run_dir, train_on_ray, worker_config
from lmfoundry.train.node_copies import driver_copy, on_each_node
from lmfoundry.train.pretrain import start_texts

logger = get_logger(__name__)

FORMATS = {"pairs": {"prompt", "chosen", "rejected"}, "outcome": {"prompt", "reply", "label"},
           "process": {"prompt", "steps", "labels"}}  # fmt: skip


class RewardConfig(TrainStageConfig):
    checkpoint: str = Field(..., description="the starting model: a checkpoint or a run directory")
    data: str = Field(..., description="JSONL of pairs, of {prompt, reply, label} or of {prompt, steps, labels}")
    validation_fraction: float = Field(0.1, ge=0, lt=1, description="held out, for the accuracy before and after")
    max_seq_len: int | None = Field(None, ge=8, description="tokens per example (default: the model's context)")
    batch: RewardBatchConfig = RewardBatchConfig()
    optimizer: DPOOptimizerConfig = DPOOptimizerConfig(lr=1e-4)
    schedule: DPOScheduleConfig = DPOScheduleConfig()
    checkpointing: DPOCheckpointingConfig = DPOCheckpointingConfig()

    @model_validator(mode="after")
    def _check(self):
        self.batch.accumulation(self.parallelism.num_workers)
        if self.parallelism.expert_parallel_size > 1:
            raise ValueError("parallelism.expert_parallel_size: reward models train without expert parallelism")
        return self


# --- the data --------------------------------------------------------------------------------


def read_rows(uri: str) -> tuple[str, list[dict]]:
    """The rows and their format; every row must be of the same one, with valid labels."""
    rows = storage.numbered_jsonl(uri)
    if not rows:
        raise ValueError(f"{uri} holds no examples")
    fmt = None
    for line, row in rows:
        found = [name for name, keys in FORMATS.items() if isinstance(row, dict) and keys <= set(row)]
        if not found:
            allowed = "; ".join(f"{name}: {sorted(keys)}" for name, keys in FORMATS.items())
            raise ValueError(f"{uri}:{line}: not a reward example; each row has the keys of one format ({allowed})")
        if fmt is None:
            fmt = found[0]
        elif found[0] != fmt:
            raise ValueError(f"{uri}:{line}: a {found[0]} row among {fmt} rows; one format per file")
        _check_labels(uri, line, fmt, row)
    return fmt, [row for _, row in rows]


def _check_labels(uri: str, line: int, fmt: str, row: dict) -> None:
    def label(value) -> bool:
        return isinstance(value, (int, float)) and not isinstance(value, bool) and 0 <= value <= 1

    if fmt == "outcome" and not label(row["label"]):
        raise ValueError(f"{uri}:{line}: label must be a number from 0 to 1, not {row['label']!r}")
    if fmt == "process":
        steps, labels = row["steps"], row["labels"]
        if not (isinstance(steps, list) and steps and all(isinstance(s, str) and s.strip() for s in steps)):
            raise ValueError(f"{uri}:{line}: steps must be a non-empty list of non-empty strings")
        if not isinstance(labels, list) or len(labels) != len(steps) or not all(map(label, labels)):
            raise ValueError(f"{uri}:{line}: labels must be one number from 0 to 1 per step ({len(steps)} steps)")


class Encoder:
    """Examples to (ids, score positions, targets); pairs through the chat template (DPO's
    PairEncoder), text rows piece by piece."""

    def __init__(self, checkpoint_dir: str, max_seq_len: int):
        self.pairs = PairEncoder(checkpoint_dir, max_seq_len)
        self.tokenizer = self.pairs.tokenizer
        self.eos = SpecialTokens.of_checkpoint(checkpoint_dir).eos_id(self.tokenizer)
        self.max_seq_len = max_seq_len
        self.truncated_steps = 0

    def ids(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode(self, fmt: str, row: dict):
        if fmt == "pairs":
            prompt, chosen, rejected = self.pairs.encode(row)
            return ("pair", prompt + chosen, prompt + rejected)
        if fmt == "outcome":
            ids = encode_reply(self.ids, row["prompt"], row["reply"], self.max_seq_len, self.eos)
            return ("scored", ids, [len(ids) - 1], [float(row["label"])])
        ids, positions = encode_steps(self.ids, row["prompt"], row["steps"], self.max_seq_len, self.eos)
        self.truncated_steps += len(row["steps"]) - len(positions)
        return ("scored", ids, positions, [float(x) for x in row["labels"][: len(positions)]])


def pad(rows: list[list[int]], value: int) -> torch.Tensor:
    out = torch.full((len(rows), max(map(len, rows))), value, dtype=torch.long)
    for r, ids in enumerate(rows):
        out[r, : len(ids)] = torch.tensor(ids)
    return out


def scores(model, ids: torch.Tensor) -> torch.Tensor:
    """(B, T) score of every position (right padding changes nothing before it: causal)."""
    out, _ = model(ids)
    return out[..., 0].float()


def bradley_terry_loss(chosen: torch.Tensor, rejected: torch.Tensor) -> tuple[torch.Tensor, dict]:
    margin = chosen - rejected
    return -F.logsigmoid(margin).mean(), {
        "accuracy": float((margin > 0).float().mean()),
        "margin": float(margin.mean()),
    }


def pointwise_loss(logits: torch.Tensor, targets: torch.Tensor) -> tuple[torch.Tensor, dict]:
    """Binary cross-entropy of scores (logits) against targets in [0, 1]; accuracy against the
    targets rounded."""
    loss = F.binary_cross_entropy_with_logits(logits, targets)
    return loss, {"accuracy": float(((logits > 0) == (targets >= 0.5)).float().mean())}


def example_loss(model, examples: list, pad_id: int, device) -> tuple[torch.Tensor, dict]:
    if examples[0][0] == "pair":
        ids = pad([e[1] for e in examples] + [e[2] for e in examples], pad_id).to(device)
        lengths = torch.tensor([len(e[1]) for e in examples] + [len(e[2]) for e in examples], device=device)
        last = scores(model, ids).gather(1, (lengths - 1)[:, None])[:, 0]
        n = len(examples)
        return bradley_terry_loss(last[:n], last[n:])
    examples = [e for e in examples if e[2]]  # a process row whose first step did not fit scores nothing
    ids = pad([e[1] for e in examples], pad_id).to(device)
    all_scores = scores(model, ids)
    rows = torch.tensor([r for r, e in enumerate(examples) for _ in e[2]], device=device)
    cols = torch.tensor([p for e in examples for p in e[2]], device=device)
    targets = torch.tensor([t for e in examples for t in e[3]], device=device)
    return pointwise_loss(all_scores[rows, cols], targets)


def split(rows: list, fraction: float, seed: int) -> tuple[list, list]:
    """(train, held out): a seeded shuffle, so the split is the same on every worker."""
    order = list(range(len(rows)))
    random.Random(seed).shuffle(order)
    cut = int(len(rows) * fraction)
    return [rows[i] for i in order[cut:]], [rows[i] for i in order[:cut]]


def ranked_right(model, examples: list, pad_id: int, device) -> tuple[float, float]:
    """How many pairs the model ranks right, or how many step scores it puts on the right side
    of 0 (process rows), and of how many."""
    chunk = [e for e in examples if e[0] == "pair" or e[2]]
    if not chunk:  # nothing to score, but the forward runs all the same: under ZeRO-3 a collective
        scores(model, pad([examples[0][1]], pad_id).to(device))
        return 0.0, 0.0
    _, stats = example_loss(model, chunk, pad_id, device)
    n = len(chunk) if chunk[0][0] == "pair" else sum(len(e[2]) for e in chunk)
    return stats["accuracy"] * n, float(n)


def reward_model(start_dir: str) -> Transformer:
    """The starting checkpoint as a reward model: its decoder with a zero scalar head, or itself
    when it is one already."""
    base = load_model_files(start_dir)
    if base.cfg.reward_head:
        return base
    model = Transformer(
        ModelConfig.model_validate({**base.cfg.model_dump(), "reward_head": True, "tie_embeddings": False})
    )
    state = {k: v for k, v in base.state_dict().items() if not k.startswith("lm_head.")}
    model.load_state_dict(state, strict=False)
    torch.nn.init.zeros_(model.lm_head.weight)
    return model


def reward_model_on_meta(start_dir: str) -> tuple[Transformer, dict | None]:
    """`reward_model` built on the meta device, for ZeRO-3 (no worker holds it whole), with its
    initial values by name (None: its own, read from the checkpoint): the decoder's read from the
    checkpoint one tensor at a time, the new scalar head zeros."""
    base = load_model_on_meta(start_dir)
    if base.cfg.reward_head:
        return base, None
    loaded = base.initial_values()
    model = build_on_meta(
        ModelConfig.model_validate({**base.cfg.model_dump(), "reward_head": True, "tie_embeddings": False})
    )
    values = {
        name: functools.partial(torch.zeros, tuple(p.shape)) if name.startswith("lm_head.") else loaded[name]
        for name, p in model.named_parameters()
    }
    return model.train(), values


# --- the objective ------------------------------------------------------------------------------


class RewardObjective:
    kind = "reward"
    adapter = None  # trains every weight
    seq_len = 1  # the batch counts examples
    tokens_per_step = flops_per_token = None

    def __init__(self, cfg: RewardConfig, start_dir: str, rank: int, world: int):
        self.cfg, self.rank, self.world = cfg, rank, world
        torch.manual_seed(cfg.seed)
        self.initial_values = None
        if cfg.parallelism.zero_stage == 3:  # partitioned as it is read: no worker holds it whole
            self.model, self.initial_values = reward_model_on_meta(start_dir)
        else:
            self.model = reward_model(start_dir).train()
        self.num_params = self.model.num_params()
        self.encoder = Encoder(start_dir, cfg.max_seq_len or self.model.cfg.max_seq_len)
        fmt, rows = read_rows(cfg.data)
        train, held = split(rows, cfg.validation_fraction, cfg.seed)
        self.examples = [self.encoder.encode(fmt, row) for row in train]
        self.held_out = [self.encoder.encode(fmt, row) for row in held]
        self.start_dir = start_dir
        self.tokenizer_json = (Path(start_dir) / TOKENIZER).read_text()
        self.chat_template, self.special_tokens = start_texts(start_dir)  # an imported model keeps its own
        self.per_global = cfg.batch.micro_batch_size * world
        self.batches_per_epoch = len(self.examples) // self.per_global
        if self.batches_per_epoch == 0:
            raise ValueError(
                f"{len(self.examples)} training examples are fewer than one global micro-batch "
                f"(micro_batch_size x workers = {self.per_global})"
            )
        self.device = None

    def attach(self, engine) -> None:
        self.device = engine.device

    def report(self, engine, final_dir: str) -> dict:
        """The accuracy on the held-out rows of the starting checkpoint as a reward model (its
        decoder with the zero head the run started from) and of the final one."""
        if not self.held_out:
            return {"held_out_accuracy": {"before": None, "after": None}}

        def start_model():
            if engine.zero_optimization_stage() == 3:
                model, values = reward_model_on_meta(self.start_dir)
                return held_out.frozen(model, engine, values)
            return held_out.frozen(reward_model(self.start_dir), engine)

        def accuracy(model) -> float | None:
            hits, scored = held_out.summed_over_ranks(
                self.held_out,
                self.cfg.batch.micro_batch_size,
                lambda some: ranked_right(model, some, self.encoder.eos, self.device),
                self.device,
            )
            return hits / scored if scored else None

        # one model at a time: each is released once measured
        before = accuracy(start_model())
        return {"held_out_accuracy": {"before": before, "after": accuracy(held_out.frozen_from(final_dir, engine))}}

    def batches(self, epoch: int, skip: int):
        order = list(range(len(self.examples)))
        random.Random(self.cfg.seed * 100003 + epoch).shuffle(order)
        mbs = self.cfg.batch.micro_batch_size
        for index in range(skip, self.batches_per_epoch):
            chunk = order[index * self.per_global : (index + 1) * self.per_global]
            yield index, [self.examples[i] for i in chunk[self.rank * mbs : (self.rank + 1) * mbs]]

    def loss(self, engine, examples: list) -> tuple[torch.Tensor, dict]:
        return example_loss(engine, examples, self.encoder.eos, self.device)

    def describe(self, metrics: dict) -> str:
        return f"accuracy {metrics['accuracy']:.3f}"

    def train_state(self, step: int) -> dict:
        return {"kind": "reward"}


def reward_loop(loop_config: dict) -> None:
    """Ray Train's per-worker function."""
    cfg = RewardConfig.model_validate(loop_config["cfg"])
    run_dir = loop_config["run_dir"]
    with on_each_node(run_dir, **loop_config["start"]) as start_dir:  # this node's copy (train/node_copies.py)
        skeleton.run(cfg, run_dir, lambda rank, world: RewardObjective(cfg, start_dir, rank, world))


# --- the driver -------------------------------------------------------------------------------


def run_reward(cfg: RewardConfig) -> dict:
    start_uri = checkpoint.resolve(cfg.checkpoint)
    start_dir = checkpoint.local_copy(start_uri, model_only=True)
    try:
        checkpoint.verify(start_dir, model_only=True)
        fmt, rows = read_rows(cfg.data)  # fail now on a bad file, not inside the workers
        _, held = split(rows, cfg.validation_fraction, cfg.seed)
        model_cfg = json.loads((Path(start_dir) / MODEL_CONFIG).read_text())
        check_every_world_size(cfg, seq_len=1)
        out, done = open_run_dir(cfg, "reward")
        if done:
            return done
        started = time.time()
        loop_config = {"cfg": worker_config(cfg, "data"), "start": driver_copy(start_uri, start_dir), "run_dir": out}
        _, final, state = train_on_ray(reward_loop, loop_config, cfg, out, "reward model training")
        encoder = Encoder(start_dir, cfg.max_seq_len or model_cfg["max_seq_len"])
        for row in rows:  # counts what max_seq_len cut, over the whole file
            encoder.encode(fmt, row)
        held_accuracy = held_out.read_report(out, final)["held_out_accuracy"]
        manifest = storage.commit(
            out,
            "reward",
            {
                "start_checkpoint": start_uri,
                "data": cfg.data,
                "format": fmt,
                "kind": "process" if fmt == "process" else "outcome",
                "final_checkpoint": final,
                "steps": state["step"],
                "examples": len(rows),
                "held_out": len(held),
                "held_out_accuracy": held_accuracy,
                "truncated_steps": encoder.truncated_steps,
                "first_loss": state["history"][0]["loss"],
                "final_loss": state["history"][-1]["loss"],
                "seconds": round(time.time() - started, 2),
            },
        )
        logger.info(
            "reward: %s model, %d steps, loss %.4f -> %.4f, held-out accuracy %s -> %s",
            manifest["kind"],
            state["step"],
            manifest["first_loss"],
            manifest["final_loss"],
            held_accuracy["before"],
            held_accuracy["after"],
        )
        return manifest
    finally:  # a temporary copy of a remote checkpoint
        checkpoint.remove_copy(start_dir, start_uri)
