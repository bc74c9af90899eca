"""Pretraining: next-token prediction on packed token sequences, as an objective of the one
training loop (train/skeleton.py), and its driver, which reads the pack manifest, derives the
model shape, runs TorchTrainer (restarting the worker group up to health.max_failures times; the
loop resumes from the newest valid checkpoint) and commits the run directory with a manifest
naming the final checkpoint. A run directory that holds checkpoints but no manifest (a run that
died) is resumed, not cleared."""

from __future__ import annotations

import dataclasses
import json
import time
from pathlib import Path

import numpy as np
import torch

from lmfoundry.model.chat_template import CHAT_TEMPLATE_FILE, DEFAULT_CHAT_TEMPLATE
from lmfoundry.model.checkpoint import MODEL_CONFIG, TOKENIZER, WEIGHTS, load_model_files, load_model_on_meta
from lmfoundry.model.flops import train_flops_per_token
from lmfoundry.model.tokenizer import SPECIAL_TOKENS_FILE
from lmfoundry.model.transformer import ModelConfig, Transformer, build_on_meta
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger
from lmfoundry.train import skeleton
from lmfoundry.train.config import ParallelismConfig, PretrainConfig, world_sizes
from lmfoundry.train.engine import build_engine, check_every_world_size, deepspeed_config
from lmfoundry.train.expert_parallel import shard_model
from lmfoundry.train.launch import open_run_dir, train_on_ray
from lmfoundry.train.shards import SplitLayout, prefetched, rank_batches

logger = get_logger(__name__)

PREFETCH_MICRO_BATCHES = 4  # read ahead of the step on a thread, as Ray Data's iterator did


def build_model(cfg: PretrainConfig, start_dir: str | None = None) -> Transformer:
    """The model, the same on every rank (same seed, or the weights of the checkpoint in
    `start_dir`), its experts sharded for expert parallelism. A model split by tensor or pipeline
    parallelism or partitioned by ZeRO-3 is built on the meta device, new or from a checkpoint's
    weights (an adapter's merged into its base's one tensor at a time): each rank materialises
    only its part when the engine is built (train/meta_init.py)."""
    torch.manual_seed(cfg.seed)
    par = cfg.parallelism
    split = par.tensor_parallel_size > 1 or par.pipeline_parallel_size > 1 or par.zero_stage == 3
    if start_dir is not None:
        model = load_model_on_meta(start_dir) if split else load_model_files(start_dir).train()
    elif split:
        model = build_on_meta(cfg.model)
    else:
        model = Transformer(cfg.model)
    # a whole build draws from torch's global generator (its layers' default inits), a meta build
    # does not: seeded again, what draws from it next sees the same stream in every layout
    torch.manual_seed(cfg.seed)
    if cfg.parallelism.expert_parallel_size > 1:
        shard_model(model, cfg.parallelism.expert_parallel_size, cfg.parallelism.pipeline_parallel_size)
    return model


class PretrainObjective:
    """Next-token cross-entropy over packed sequences, each worker reading only the row groups of
    its slice of each global micro-batch (train/shards.py)."""

    kind = "pretrain"
    chat_template = DEFAULT_CHAT_TEMPLATE
    special_tokens = None  # its tokenizer is pack's, with lmfoundry's special tokens, unless init_from says otherwise
    adapter = None  # trains every weight
    initial_values = None  # a meta-built model's are its own
    report = None  # its figures are the training metrics

    def __init__(
        self, cfg: PretrainConfig, seq_len: int, tokenizer_json: str, layout: SplitLayout, rank: int, world: int
    ):
        self.cfg, self.seq_len, self.tokenizer_json, self.rank, self.world = cfg, seq_len, tokenizer_json, rank, world
        if cfg.init_from is None:
            self.model = build_model(cfg)
        else:  # verified on every worker; an imported model keeps its chat template and special tokens
            with checkpoint.opened(cfg.init_from) as (start_dir, _):
                self.model = build_model(cfg, start_dir)
                self.chat_template, self.special_tokens = start_texts(start_dir)
        # counted before ZeRO-3 partitions the weights, after which each rank's parameters look empty
        self.num_params = self.model.num_params()
        self.flops_per_token = train_flops_per_token(self.model, seq_len)
        self.tokens_per_step = cfg.batch.global_batch_tokens
        self.layout = layout
        self.device = None

    def attach(self, engine) -> None:
        self.device = engine.device

    def batches(self, epoch: int, skip: int):
        rows = rank_batches(
            self.layout,
            self.cfg.seed,
            epoch,
            self.cfg.batch.shuffle,
            self.rank,
            self.world,
            self.cfg.batch.micro_batch_size,
            skip,
        )
        for index, tokens in prefetched(rows, PREFETCH_MICRO_BATCHES):
            yield index, torch.from_numpy(tokens.astype(np.int64))

    def loss(self, engine, tokens: torch.Tensor) -> tuple[torch.Tensor, dict]:
        tokens = tokens.to(self.device)
        return engine(tokens[:, :-1], tokens[:, 1:])[1], {}  # the logits are not kept alive

    def pipeline_inputs(self, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """A micro-batch as DeepSpeed's pipeline engine takes it: the first stage's inputs, the
        last stage's targets."""
        tokens = tokens.to(self.device)
        return tokens[:, :-1], tokens[:, 1:]

    def describe(self, metrics: dict) -> str:
        imbalance = metrics.get("expert_imbalance")
        balance = f" expert imbalance {imbalance:.2f}" if imbalance is not None else ""
        return (
            f"lr {metrics['lr']:.2e} grad_norm {metrics['grad_norm']:.3f} "
            f"tokens/s {metrics['tokens_per_s']:.0f}{balance}"
        )

    def train_state(self, step: int) -> dict:
        return {"tokens_seen": step * self.tokens_per_step}


def at_world_size(cfg: PretrainConfig, world: int) -> PretrainConfig:
    """`cfg` as it trains at `world` workers (ParallelismConfig.at_world_size: an elastic run's
    experts split as that size allows)."""
    return cfg.model_copy(update={"parallelism": cfg.parallelism.at_world_size(world)})


def log_expert_splits(par: ParallelismConfig) -> None:
    """An elastic expert-parallel run's split at each world size it may train at, with a warning
    where it is smaller than expert_parallel_size (each worker then holds more experts)."""
    if par.min_workers is None or par.expert_parallel_size == 1:
        return
    splits = {world: par.at_world_size(world).expert_parallel_size for world in world_sizes(par)}
    logger.info("pretrain: the experts split over this many workers at each world size: %s", splits)
    smaller = [world for world, split in splits.items() if split < par.expert_parallel_size]
    if smaller:
        logger.warning(
            "pretrain: at %s workers the experts split fewer than expert_parallel_size=%d ways (%s), so each "
            "worker holds more of them: every size must fit in memory with its own split",
            ", ".join(map(str, smaller)),
            par.expert_parallel_size,
            ", ".join(f"{splits[world]} at {world}" for world in smaller),
        )


def train_loop(loop_config: dict) -> None:
    """Ray Train's per-worker function, at the world size Ray Train started (an elastic run's
    experts split as that size allows)."""
    import ray.train

    cfg = at_world_size(PretrainConfig.model_validate(loop_config["cfg"]), ray.train.get_context().get_world_size())
    skeleton.run(
        cfg,
        loop_config["run_dir"],
        lambda rank, world: PretrainObjective(
            cfg,
            loop_config["seq_len"],
            loop_config["tokenizer_json"],
            SplitLayout(**loop_config["layout"]),
            rank,
            world,
        ),
    )


def build_pretrain_engine(cfg: PretrainConfig, world: int, seq_len: int):
    """The model in its DeepSpeed engine as the loop builds it, for tools that step it directly
    (memory and checkpoint benchmarks). Returns engine, scheduler and DeepSpeed config."""
    cfg = at_world_size(cfg, world)
    model = build_model(cfg)
    ds_config = deepspeed_config(cfg, world, seq_len, model.num_params())
    engine, scheduler = build_engine(model, cfg, ds_config)
    return engine, scheduler, ds_config


def start_texts(start_dir: str) -> tuple[str, str | None]:
    """The chat template and special tokens of the checkpoint a run starts from."""
    template, special = Path(start_dir) / CHAT_TEMPLATE_FILE, Path(start_dir) / SPECIAL_TOKENS_FILE
    return (
        template.read_text() if template.exists() else DEFAULT_CHAT_TEMPLATE,
        special.read_text() if special.exists() else None,
    )


# The most a pack manifest may claim for the model's shape: 16 times the largest vocabularies of
# open models (Gemma 3's 262,144) and a million-token training sequence
MAX_PACK_VOCAB = 1 << 22
MAX_PACK_SEQ_LEN = 1 << 20


def read_pack_tokenizer(data: str, pack_manifest: dict) -> str:
    """The text of the tokenizer a pack output was tokenised with: its own tokenizer.json, read
    bounded and parsed, and the shape the manifest records checked against it. The manifest's
    word is not followed anywhere else: the file is written into every checkpoint of the run, so
    a name leading out of the pack directory, or a link there, would publish whatever it reached."""
    from tokenizers import Tokenizer

    from lmfoundry.model.tensor_files import read_source_file
    from lmfoundry.model.tokenizer import MAX_TOKENIZER_BYTES

    named = pack_manifest.get("tokenizer")
    if named != TOKENIZER:
        raise ValueError(
            f"pack output {data!r}: its manifest names the tokenizer {str(named)[:80]!r}, not {TOKENIZER!r}"
        )
    uri = storage.join(data, TOKENIZER)
    try:
        if storage.is_remote(uri):
            raw = storage.read_bytes(uri, limit=MAX_TOKENIZER_BYTES)
        else:  # opened without following a link (not checked first and swapped in after)
            raw = read_source_file(Path(uri).parent, TOKENIZER, MAX_TOKENIZER_BYTES)
            if raw is None:
                raise FileNotFoundError(uri)
        text = raw.decode("utf-8")
        tokenizer_vocab = Tokenizer.from_str(text).get_vocab_size()
    except Exception as e:  # missing, a link, too large, not a file, not UTF-8, not a tokenizer: which, and where
        raise ValueError(f"pack output {data!r}: {TOKENIZER} is not a usable tokenizer: {str(e)[:200]}") from None
    vocab, seq_len = pack_manifest.get("vocab_size"), pack_manifest.get("seq_len")
    if type(vocab) is not int or not tokenizer_vocab <= vocab <= MAX_PACK_VOCAB:
        raise ValueError(
            f"pack output {data!r}: vocab_size={vocab!r} in its manifest; an integer from its tokenizer's "
            f"{tokenizer_vocab:,} to {MAX_PACK_VOCAB:,}"
        )
    if type(seq_len) is not int or not 1 <= seq_len <= MAX_PACK_SEQ_LEN:
        raise ValueError(
            f"pack output {data!r}: seq_len={seq_len!r} in its manifest; an integer from 1 to {MAX_PACK_SEQ_LEN:,}"
        )
    return text


def resolve_start(cfg: PretrainConfig, pack_tokenizer_json: str) -> PretrainConfig:
    """Continued pretraining: the model section from the `init_from` checkpoint (verified), whose
    tokenizer must be the one the data was packed with (`pack_tokenizer_json`)."""
    if cfg.model != ModelConfig():  # compared, not looked up in fields_set: a config passed on is dumped whole
        raise ValueError(f"init_from={cfg.init_from!r} takes the model from the checkpoint: remove the model section")
    start = checkpoint.resolve(cfg.init_from)
    with checkpoint.opened(start) as (start_dir, _):  # verified: every file against the manifest
        model = ModelConfig.model_validate_json((Path(start_dir) / MODEL_CONFIG).read_text())
        tokenizer = json.loads((Path(start_dir) / TOKENIZER).read_text())
    if json.loads(pack_tokenizer_json) != tokenizer:
        raise ValueError(
            f"pretrain data {cfg.data!r} was not tokenised with the tokenizer of init_from={cfg.init_from!r}: "
            f"pack it with --set tokenizer={cfg.init_from}"
        )
    return cfg.model_copy(update={"init_from": start, "model": model})


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
    tp = cfg.parallelism.tensor_parallel_size
    if cfg.parallelism.splits_vocabulary and model.vocab_size < tp:
        raise ValueError(
            f"vocab_parallel splits the {model.vocab_size} vocabulary rows over tensor_parallel_size={tp} "
            "ranks: every rank needs at least one"
        )
    if cfg.parallelism.splits_sequences and pack_manifest["seq_len"] % tp:
        raise ValueError(
            f"sequence_parallel splits each sequence over tensor_parallel_size={tp} ranks: the packed "
            f"seq_len={pack_manifest['seq_len']} must be a multiple of {tp} (pack with another seq_len)"
        )
    return cfg.model_copy(update={"model": model})


def plot_loss(run_dir: str) -> None:
    """loss.png in the run directory, from metrics.jsonl."""
    import io

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


def run_pretrain(cfg: PretrainConfig) -> dict:
    data = storage.normalize(cfg.data)
    pack = storage.read_manifest(data)
    if pack.get("stage") != "pack":
        raise ValueError(f"pretrain data {cfg.data!r} is a {pack.get('stage')!r} output, not a pack output")
    tokenizer_json = read_pack_tokenizer(data, pack)  # checked before anything is written
    if cfg.init_from is not None:
        cfg = resolve_start(cfg, tokenizer_json)
    cfg = resolve_model_shape(cfg, pack)
    seq_len = pack["seq_len"]
    check_every_world_size(cfg, seq_len)  # fail now, not inside the workers
    layout = SplitLayout.from_manifest(data, pack)
    sequences = layout.sequences
    per_micro_step = cfg.parallelism.num_workers * cfg.batch.micro_batch_size
    if sequences < per_micro_step:  # an epoch would hold no micro-batch, and training no step
        raise ValueError(
            f"pretrain data {cfg.data!r} holds {sequences} training sequences, fewer than one global "
            f"micro-batch (num_workers x micro_batch_size = {per_micro_step}); pack more text or "
            "lower batch.micro_batch_size"
        )
    out, done = open_run_dir(cfg, "pretrain")
    if done:
        return done
    logger.info("pretrain: DeepSpeed config %s", deepspeed_config(cfg, cfg.parallelism.num_workers, seq_len))
    log_expert_splits(cfg.parallelism)

    started = time.time()
    if cfg.batch.micro_batch_size % layout.per_group:
        logger.warning(
            "pretrain: micro_batch_size=%d is not a multiple of the data's rows_per_group=%d: workers share "
            "row groups and read more than their share (pack with a rows_per_group that divides it)",
            cfg.batch.micro_batch_size,
            layout.per_group,
        )
    loop_config = {
        "cfg": cfg.model_dump(mode="json"),
        "seq_len": seq_len,
        "tokenizer_json": tokenizer_json,
        "layout": dataclasses.asdict(layout),
        "run_dir": out,
    }
    _, final, state = train_on_ray(train_loop, loop_config, cfg, out, "pretraining")
    history = state["loss_history"]
    gate_action = storage.join(out, checkpoint.GATE_ACTION)
    stopped = storage.read_json(gate_action) if storage.exists(gate_action) else None
    plot_loss(out)
    manifest = storage.commit(
        out,
        "pretrain",
        {
            "data": data,
            "final_checkpoint": final,
            "steps": state["step"],
            "tokens_seen": state["tokens_seen"],
            "init_from": cfg.init_from,
            "first_loss": history[0][1],
            "final_loss": history[-1][1],
            "fingerprint": storage.fingerprint(out, [f"{final}/{WEIGHTS}"]),
            "model": cfg.model.model_dump(),
            "seconds": round(time.time() - started, 2),
            **({"stopped_by_gate": stopped} if stopped and stopped.get("action") == "stop" else {}),
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
