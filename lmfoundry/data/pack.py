"""Packing: train the tokenizer on the kept documents, tokenise them with Ray Data and cut the
token stream into fixed-length sequences.

Output layout under `output`:
  tokenizer.json         the trained byte-level BPE
  train/, val/           Parquet, one row per sequence: `tokens` (seq_len + 1 int32 ids, so
                         a sequence gives seq_len next-token predictions)
  _MANIFEST.json         seq_len, vocab size, sequence and token counts; written last
Documents are joined with the end-of-text token. A document goes to val/ when a hash of its id
falls under `val_fraction`, so the split is stable across reruns and machines.
"""

from __future__ import annotations

import hashlib
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.model.tokenizer import eos_id
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class PackConfig(StageConfig):
    input: str = Field(..., description="a curate output directory (its kept/ is read) or a folder of Parquet")
    output: str
    text_field: str = "text"
    id_field: str = "id"
    vocab_size: int = Field(4096, ge=259)
    tokenizer_train_docs: int = Field(100_000, ge=1, description="documents the tokenizer trains on")
    seq_len: int = Field(256, ge=8, description="tokens per training sequence")
    val_fraction: float = Field(0.05, ge=0, lt=1)
    overwrite: bool = False


def kept_dir(input_uri: str) -> str:
    """A curate stage directory means its kept/ folder; any other folder is read as it is."""
    uri = storage.normalize(input_uri)
    if storage.is_committed(uri) and storage.read_manifest(uri).get("stage") == "curate":
        return storage.join(uri, storage.read_manifest(uri)["kept"])
    return uri


def is_val(doc_id: str, val_fraction: float) -> bool:
    h = int.from_bytes(hashlib.blake2b(doc_id.encode(), digest_size=8).digest(), "big")
    return h / 2**64 < val_fraction


class Tokenize:
    """Tokenises a batch of documents (tokenizer loaded once per actor); ends each with EOS and
    marks it train or val."""

    def __init__(self, tokenizer_json: str, cfg: PackConfig):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.eos = eos_id(self.tok)
        self.cfg = cfg

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(self.cfg.text_field).to_pylist()
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        ids = [np.append(np.asarray(e.ids, dtype=np.int32), np.int32(self.eos)) for e in encodings]
        val = [is_val(str(i), self.cfg.val_fraction) for i in batch.column(self.cfg.id_field).to_pylist()]
        return pa.table(
            {
                "ids": pa.array(ids, pa.list_(pa.int32())),
                "n_tokens": pa.array([len(x) for x in ids], pa.int64()),
                "val": pa.array(val, pa.bool_()),
            }
        )


def pack_sequences(batch: pa.Table, sample_len: int) -> pa.Table:
    """Joins a batch's documents into one token stream and cuts it into rows of `sample_len`
    tokens; the tail that does not fill a row is dropped (counted in the manifest)."""
    stream = pc.list_flatten(batch.column("ids")).to_numpy(zero_copy_only=False).astype(np.int32)
    n = len(stream) // sample_len
    flat = pa.array(stream[: n * sample_len], pa.int32())
    return pa.table({"tokens": pa.FixedSizeListArray.from_arrays(flat, sample_len)})


def run_pack(cfg: PackConfig) -> dict:
    import ray

    out = storage.normalize(cfg.output)
    source = kept_dir(cfg.input)
    files = storage.list_files(source, (".parquet",))
    if not files:
        raise FileNotFoundError(f"pack input {cfg.input!r} holds no .parquet files (expected a curate output)")
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("pack: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_manifest(out)
    started = time.time()
    docs = ray.data.read_parquet(files, columns=[cfg.id_field, cfg.text_field])

    logger.info(
        "pack: training a byte-level BPE (vocab %d) on up to %d documents", cfg.vocab_size, cfg.tokenizer_train_docs
    )
    sample = docs.limit(cfg.tokenizer_train_docs).select_columns([cfg.text_field])
    texts = (
        t
        for b in sample.iter_batches(batch_format="pyarrow", batch_size=1024)
        for t in b.column(cfg.text_field).to_pylist()
    )
    tok = train_bpe(texts, cfg.vocab_size)
    tokenizer_json = tok.to_str()
    storage.write_bytes_atomic(storage.join(out, "tokenizer.json"), tokenizer_json.encode())

    tokenized = docs.map_batches(
        Tokenize, fn_constructor_args=(tokenizer_json, cfg), batch_format="pyarrow", concurrency=(1, 4)
    ).materialize()
    sample_len = cfg.seq_len + 1
    splits = {}
    for name, is_val_split in (("train", False), ("val", True)):
        part = tokenized.filter(expr=f"val == {is_val_split}")
        n_tokens = part.sum("n_tokens") or 0
        seqs = part.map_batches(
            pack_sequences, fn_kwargs={"sample_len": sample_len}, batch_format="pyarrow", batch_size=512
        )
        seqs = seqs.materialize()
        n_seqs = seqs.count()
        if n_seqs:
            seqs.write_parquet(storage.join(out, name))
        splits[name] = {"sequences": n_seqs, "tokens_in": n_tokens, "tokens_dropped": n_tokens - n_seqs * sample_len}
    if splits["train"]["sequences"] == 0:
        raise ValueError(
            f"pack: the corpus yields no training sequence of {sample_len} tokens; lower seq_len or provide more text"
        )
    manifest = storage.commit(
        out,
        "pack",
        {
            "input": source,
            "tokenizer": "tokenizer.json",
            "vocab_size": tok.get_vocab_size(),
            "seq_len": cfg.seq_len,
            "sample_len": sample_len,
            "eos_id": eos_id(tok),
            "splits": splits,
            "seconds": round(time.time() - started, 2),
        },
    )
    logger.info("pack: %s", {k: v["sequences"] for k, v in splits.items()})
    return manifest
