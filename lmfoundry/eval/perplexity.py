"""Held-out perplexity and bits per byte of a checkpoint over packed token shards, with Ray Data.

Each actor loads the checkpoint once and returns, per batch, the summed negative log-likelihood
and the number of predicted tokens; the driver adds them up, so the result is the exact
token-weighted perplexity whatever the batching.
"""

from __future__ import annotations

import math
import time

import numpy as np
import pyarrow as pa
import torch
from pydantic import Field

from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.tokenizer import token_byte_lengths
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class EvaluateConfig(StageConfig):
    checkpoint: str = Field(..., description="a checkpoint directory or a pretrain run directory")
    data: str = Field(..., description="a pack output directory")
    output: str
    split: str = "val"
    batch_size: int = Field(16, ge=1)
    max_sequences: int | None = Field(None, ge=1)
    overwrite: bool = False


class SequenceNLL:
    def __init__(self, checkpoint_dir: str):
        from tokenizers import Tokenizer

        torch.set_num_threads(1)
        self.model = load_model_files(checkpoint_dir)
        self.byte_lengths = token_byte_lengths(Tokenizer.from_file(f"{checkpoint_dir}/{TOKENIZER}"))

    @torch.no_grad()
    def __call__(self, batch: pa.Table) -> pa.Table:
        tokens = torch.from_numpy(np.stack(batch.column("tokens").to_numpy(zero_copy_only=False)).astype(np.int64))
        logits, _ = self.model(tokens[:, :-1])
        nll = torch.nn.functional.cross_entropy(
            logits.float().transpose(1, 2), tokens[:, 1:], reduction="none"
        ).sum(dim=1)
        targets = tokens[:, 1:].numpy()
        return pa.table({"nll": pa.array(nll.double().numpy()),
                         "tokens": pa.array(np.full(len(nll), targets.shape[1], dtype=np.int64)),
                         "bytes": pa.array(self.byte_lengths[targets].sum(axis=1))})


def perplexity(ckpt_dir: str, data: str, split: str, batch_size: int = 16, max_sequences: int | None = None) -> dict:
    import ray

    files = storage.list_files(storage.join(storage.normalize(data), split), (".parquet",))
    if not files:
        raise FileNotFoundError(f"{data} has no {split}/ Parquet shards to evaluate on")
    ds = ray.data.read_parquet(files, columns=["tokens"])
    if max_sequences:
        ds = ds.limit(max_sequences)
    scored = ds.map_batches(SequenceNLL, fn_constructor_args=(ckpt_dir,), batch_size=batch_size,
                            batch_format="pyarrow", concurrency=(1, 2))
    total_nll, total_tokens, total_bytes, n_seqs = 0.0, 0, 0, 0
    for b in scored.iter_batches(batch_format="pyarrow"):
        total_nll += float(np.sum(b.column("nll").to_numpy()))
        total_tokens += int(np.sum(b.column("tokens").to_numpy()))
        total_bytes += int(np.sum(b.column("bytes").to_numpy()))
        n_seqs += b.num_rows
    mean_nll = total_nll / max(total_tokens, 1)
    # bits per byte of the text the tokens stand for: comparable across tokenizers, unlike perplexity
    return {"split": split, "sequences": n_seqs, "tokens": total_tokens, "bytes": total_bytes, "loss": mean_nll,
            "perplexity": math.exp(mean_nll), "bits_per_byte": total_nll / math.log(2) / max(total_bytes, 1)}


def run_evaluate(cfg: EvaluateConfig) -> dict:
    out = storage.normalize(cfg.output)
    ckpt_uri = checkpoint.resolve(cfg.checkpoint)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("evaluate: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "report.json"))
    started = time.time()
    local = checkpoint.local_copy(ckpt_uri, model_only=True)
    manifest = checkpoint.verify(local, model_only=True)
    result = perplexity(local, cfg.data, cfg.split, cfg.batch_size, cfg.max_sequences)
    vocab = storage.read_json(storage.join(local, "model_config.json"))["vocab_size"]
    report = {"checkpoint": ckpt_uri, "step": manifest.get("step"), **result,
              # a model that learned nothing predicts uniformly: perplexity = vocabulary size
              "uniform_perplexity": vocab, "seconds": round(time.time() - started, 2)}
    storage.write_json_atomic(storage.join(out, "report.json"), report)
    storage.commit(out, "evaluate", {"checkpoint": ckpt_uri, "report": "report.json"})
    logger.info("evaluate: %s perplexity %.2f, %.3f bits per byte, over %d tokens (uniform would be %d)",
                cfg.split, report["perplexity"], report["bits_per_byte"], report["tokens"], vocab)
    return report
