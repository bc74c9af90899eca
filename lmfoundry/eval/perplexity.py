"""Language modelling: held-out perplexity and bits per byte over packed token shards (with Ray
Data, or in-process for the fast suite), and bits per byte over raw held-out text.

Over shards, each actor loads the checkpoint once and returns, per batch, the summed negative log-likelihood
and the number of predicted tokens; the driver adds them up, so the result is the exact
token-weighted perplexity whatever the batching.
"""

from __future__ import annotations

import gzip
import json
import math

import numpy as np
import pyarrow as pa
import torch

from lmfoundry.model.checkpoint import TOKENIZER, load_model_files
from lmfoundry.model.tokenizer import token_byte_lengths
from lmfoundry.platform import storage
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class SequenceNLL:
    def __init__(self, checkpoint_dir: str, single_thread: bool = True):
        from tokenizers import Tokenizer

        if single_thread:  # one of several actors on a node
            torch.set_num_threads(1)
        self.model = load_model_files(checkpoint_dir)
        self.byte_lengths = token_byte_lengths(Tokenizer.from_file(f"{checkpoint_dir}/{TOKENIZER}"))

    @torch.no_grad()
    def __call__(self, batch: pa.Table) -> pa.Table:
        tokens = torch.from_numpy(np.stack(batch.column("tokens").to_numpy(zero_copy_only=False)).astype(np.int64))
        logits, _ = self.model(tokens[:, :-1])
        nll = torch.nn.functional.cross_entropy(logits.float().transpose(1, 2), tokens[:, 1:], reduction="none").sum(
            dim=1
        )
        targets = tokens[:, 1:].numpy()
        return pa.table(
            {
                "nll": pa.array(nll.double().numpy()),
                "tokens": pa.array(np.full(len(nll), targets.shape[1], dtype=np.int64)),
                "bytes": pa.array(self.byte_lengths[targets].sum(axis=1)),
            }
        )


def _shards(data: str, split: str) -> list[str]:
    files = storage.list_files(storage.join(storage.normalize(data), split), (".parquet",))
    if not files:
        raise FileNotFoundError(f"{data} has no {split}/ Parquet shards to evaluate on")
    return files


def perplexity(
    ckpt_dir: str, data: str, split: str, batch_size: int = 16, max_sequences: int | None = None, use_ray: bool = True
) -> dict:
    """Over Ray Data actors (`use_ray`), or in this process (the fast suite that pretraining
    runs on each checkpoint, a few batches)."""
    files = _shards(data, split)
    if use_ray:
        import ray

        ds = ray.data.read_parquet(files, columns=["tokens"])
        if max_sequences:
            ds = ds.limit(max_sequences)
        scored = ds.map_batches(
            SequenceNLL,
            fn_constructor_args=(ckpt_dir,),
            batch_size=batch_size,
            batch_format="pyarrow",
            concurrency=(1, 2),
        ).iter_batches(batch_format="pyarrow")
    else:
        scored = _local_batches(SequenceNLL(ckpt_dir, single_thread=False), files, batch_size, max_sequences)
    total_nll, total_tokens, total_bytes, n_seqs = 0.0, 0, 0, 0
    for b in scored:
        total_nll += float(np.sum(b.column("nll").to_numpy()))
        total_tokens += int(np.sum(b.column("tokens").to_numpy()))
        total_bytes += int(np.sum(b.column("bytes").to_numpy()))
        n_seqs += b.num_rows
    mean_nll = total_nll / max(total_tokens, 1)
    # bits per byte of the text the tokens stand for: comparable across tokenizers, unlike perplexity
    return {
        "split": split,
        "sequences": n_seqs,
        "tokens": total_tokens,
        "bytes": total_bytes,
        "loss": mean_nll,
        "perplexity": math.exp(mean_nll),
        "bits_per_byte": total_nll / math.log(2) / max(total_bytes, 1),
    }


def _local_batches(score: SequenceNLL, files: list[str], batch_size: int, max_sequences: int | None):
    import pyarrow.parquet as pq

    left = max_sequences or float("inf")
    for f in files:
        fs, path = storage.filesystem(f)
        for batch in pq.ParquetFile(fs.open_input_file(path)).iter_batches(batch_size=batch_size, columns=["tokens"]):
            batch = pa.Table.from_batches([batch]).slice(0, int(min(left, batch.num_rows)))
            if batch.num_rows:
                yield score(batch)
            left -= batch.num_rows
            if left <= 0:
                return


def text_bits_per_byte(model, files: list[str], text_field: str = "text", max_documents: int | None = None) -> dict:
    """Bits per UTF-8 byte of raw held-out text (JSONL with a `text` field, or plain text; either may be gzipped):
    each document cut into context-sized windows, every token after the first predicted. The
    figure does not depend on the tokenizer, so models with different tokenizers compare."""
    docs = []
    for f in files:
        data = storage.read_bytes(storage.normalize(f))
        raw = (gzip.decompress(data) if data[:2] == b"\x1f\x8b" else data).decode("utf-8")  # pyarrow may have
        # decompressed it already
        if f.removesuffix(".gz").endswith((".jsonl", ".json")):
            docs.extend(json.loads(line)[text_field] for line in raw.splitlines() if line.strip())
        else:
            docs.append(raw)
    docs = [d for d in docs[:max_documents] if d.strip()] if max_documents else [d for d in docs if d.strip()]
    if not docs:
        raise ValueError(f"no text to score in {files}")
    window = model.max_length
    requests, n_bytes = [], 0
    for doc in docs:
        ids = model.encode(doc)
        n_bytes += len(doc.encode("utf-8"))
        # the end-of-text token opens every document, so its first token is predicted too
        ids = [model.eos] + ids
        for start in range(0, len(ids) - 1, window):
            requests.append(ids[start : start + window + 1])
    total = model.sequence_nll(requests)
    return {"documents": len(docs), "bytes": n_bytes, "bits_per_byte": total / math.log(2) / max(n_bytes, 1)}
