"""Packing: train the tokenizer on the kept documents (or take an existing checkpoint's, e.g. an
imported open model's, for continued pretraining), tokenise them with Ray Data and cut the token
stream into fixed-length sequences.

Output layout under `output`:
  tokenizer.json         the trained byte-level BPE, or the checkpoint's tokenizer
  train/, val/           Parquet shards `part-NNNNN.parquet`, one row per sequence: `tokens`
                         (seq_len + 1 int32 ids, so a sequence gives seq_len next-token predictions)
  _MANIFEST.json         seq_len, vocab size, sequence and token counts, a fingerprint of the
                         shards; written last

Reproducible by construction: the same documents, config and seed give byte-identical shards,
whatever the cluster size, the number of blocks or the order in which tasks finish. Every
document gets an order key (a seeded hash of its id and text); the tokenizer trains on the
documents with the smallest keys, in key order; the tokenised documents are sorted by key (Ray
Data's distributed sort) and streamed in that order through one writer, which joins them with the
end-of-text token, cuts rows and starts a new shard every `sequences_per_shard` rows. A document
goes to val/ when a hash of its id falls under `val_fraction`, so the split does not move with the
seed.
"""

from __future__ import annotations

import hashlib
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from lmfoundry.data.tokenizer import train_bpe
from lmfoundry.data.workdir import WORK, read_parquet, shard_name, work_path, write_parquet_atomic
from lmfoundry.model.tokenizer import checkpoint_tokenizer, eos_id
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

ORDER = "_order"  # the order key column while packing; never written


class PackConfig(StageConfig):
    input: str = Field(..., description="a curate output directory (its kept/ is read) or a folder of Parquet")
    output: str
    text_field: str = "text"
    id_field: str = "id"
    vocab_size: int = Field(4096, ge=259)
    tokenizer_train_docs: int = Field(100_000, ge=1, description="documents the tokenizer trains on")
    tokenizer: str | None = Field(None, description="a checkpoint whose tokenizer to use instead of training one")
    copyable_tokens: bool = Field(
        False,
        description="train the BPE with spaces as tokens of their own and digits one by one, so a number or word is "
        "the same ids wherever it stands (arithmetic, copying values); costs more tokens per text",
    )
    seq_len: int = Field(256, ge=8, description="tokens per training sequence")
    val_fraction: float = Field(0.05, ge=0, lt=1)
    seed: int = Field(0, ge=0, description="orders the documents before they are joined and cut")
    # at most what pretraining reads (train/shards.py MAX_SHARD_ROWS)
    sequences_per_shard: int = Field(16_384, ge=1, le=1 << 24, description="rows per output Parquet shard")
    rows_per_group: int = Field(
        8,
        ge=1,
        description="rows per Parquet row group, the unit a training worker reads: a divisor of the training "
        "micro_batch_size, so that no row group is read by two workers",
    )
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


def order_key(seed: int, doc_id: str, text: str) -> int:
    """A document's place in the packed stream: a seeded hash of its id and text, so that two
    documents sharing an id still have distinct keys, and equal keys mean equal documents."""
    h = hashlib.blake2b(seed.to_bytes(8, "big"), digest_size=8)
    h.update(doc_id.encode())
    h.update(b"\0")
    h.update(text.encode("utf-8", "surrogatepass"))
    return int.from_bytes(h.digest(), "big")


def add_order_keys(batch: pa.Table, cfg: PackConfig) -> pa.Table:
    ids = [str(i) for i in batch.column(cfg.id_field).to_pylist()]
    texts = [t or "" for t in batch.column(cfg.text_field).to_pylist()]
    keys = pa.array([order_key(cfg.seed, i, t) for i, t in zip(ids, texts)], pa.uint64())
    return pa.table({ORDER: keys, cfg.id_field: pa.array(ids, pa.string()), cfg.text_field: pa.array(texts)})


def below(batch: pa.Table, threshold: int) -> pa.Table:
    return batch.filter(pc.less_equal(batch.column(ORDER), pa.scalar(threshold, pa.uint64())))


def sample_candidates(batch: dict, cfg: PackConfig, threshold: int) -> pa.Table:
    """One input file's documents whose order key falls under `threshold`: the candidates for the
    tokenizer's sample (the keys are hashes, so this is a uniform sample of the file)."""
    keyed = add_order_keys(read_parquet(batch["file"][0], [cfg.id_field, cfg.text_field]), cfg)
    return below(keyed, threshold)


def tokenizer_sample(files: list[str], cfg: PackConfig, total: int) -> list[str]:
    """The `tokenizer_train_docs` documents with the smallest order keys, in key order: a seeded,
    deterministic sample, uniform over the documents (docs/reproducibility.md), chosen by a filter
    on the key in each file's task (so only about that many documents reach the driver) and
    sorted here."""
    import ray

    n = cfg.tokenizer_train_docs
    rate = min(1.0, 1.2 * n / max(total, 1))  # 20% margin, so the filter rarely keeps fewer than n
    threshold = 2**64 - 1 if rate >= 1.0 else int(rate * (2**64 - 1))
    picked = ray.data.from_items([{"file": f} for f in files], override_num_blocks=len(files)).map_batches(
        sample_candidates, fn_args=(cfg, threshold), batch_size=1, batch_format="numpy"
    )
    batches = [b for b in picked.iter_batches(batch_format="pyarrow", batch_size=None) if b.num_rows]
    if not batches:
        return []
    table = pa.concat_tables(batches).sort_by([(ORDER, "ascending"), (cfg.id_field, "ascending")])
    return table.column(cfg.text_field).to_pylist()[:n]


class Tokenize:
    """Tokenises a batch of documents (tokenizer loaded once per actor); ends each with EOS and
    marks it train or val. The order key and id travel with the tokens for the sort."""

    def __init__(self, tokenizer_json: str, eos: int, cfg: PackConfig):
        from tokenizers import Tokenizer

        self.tok = Tokenizer.from_str(tokenizer_json)
        self.eos = eos
        self.cfg = cfg

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(self.cfg.text_field).to_pylist()
        encodings = self.tok.encode_batch(texts, add_special_tokens=False)
        ids = [np.append(np.asarray(e.ids, dtype=np.int32), np.int32(self.eos)) for e in encodings]
        doc_ids = batch.column(self.cfg.id_field)
        val = [is_val(i, self.cfg.val_fraction) for i in doc_ids.to_pylist()]
        return pa.table(
            {
                ORDER: batch.column(ORDER),
                self.cfg.id_field: doc_ids,
                "ids": pa.array(ids, pa.list_(pa.int32())),
                "n_tokens": pa.array([len(x) for x in ids], pa.int64()),
                "val": pa.array(val, pa.bool_()),
            }
        )


class ShardWriter:
    """Joins documents, in the order they are given, into one token stream, cuts it into rows of
    `sample_len` tokens and writes `part-NNNNN.parquet` every `per_shard` rows: the shard
    boundaries follow from the document order alone. The tail that does not fill a row is
    dropped (counted). A writer resumed after `shards_done` full shards is given the same stream
    from the start and passes over the tokens those shards hold."""

    def __init__(self, out_dir: str, sample_len: int, per_shard: int, per_group: int, shards_done: int = 0):
        self.out_dir, self.sample_len, self.per_shard, self.per_group = out_dir, sample_len, per_shard, per_group
        self.pending: list[np.ndarray] = []  # token arrays not yet written
        self.pending_tokens = 0
        self.tokens_in = 0
        self.shards, self.sequences = shards_done, shards_done * per_shard
        self.skip = shards_done * per_shard * sample_len  # tokens already in the written shards

    def add(self, docs: pa.ChunkedArray | pa.Array) -> None:
        if isinstance(docs, pa.ChunkedArray):
            docs = docs.combine_chunks()
        tokens = pc.list_flatten(docs).to_numpy(zero_copy_only=False).astype(np.int32, copy=False)
        self.tokens_in += len(tokens)
        if self.skip:
            passed = min(self.skip, len(tokens))
            tokens, self.skip = tokens[passed:], self.skip - passed
        self.pending.append(tokens)
        self.pending_tokens += len(tokens)
        shard_tokens = self.per_shard * self.sample_len
        while self.pending_tokens >= shard_tokens:
            self._write(shard_tokens)

    def close(self) -> dict:
        rows = self.pending_tokens // self.sample_len
        if rows:
            self._write(rows * self.sample_len)
        return {
            "sequences": self.sequences,
            "shards": self.shards,
            "tokens_in": self.tokens_in,
            "tokens_dropped": self.tokens_in - self.sequences * self.sample_len,
        }

    def _write(self, n_tokens: int) -> None:
        stream = np.concatenate(self.pending)
        head, rest = stream[:n_tokens], stream[n_tokens:]
        self.pending, self.pending_tokens = [rest], len(rest)
        rows = pa.FixedSizeListArray.from_arrays(pa.array(head, pa.int32()), self.sample_len)
        # statistics of token lists would only lengthen the footer every training worker reads
        write_parquet_atomic(
            storage.join(self.out_dir, f"part-{self.shards:05d}.parquet"),
            pa.table({"tokens": rows}),
            row_group_size=self.per_group,
            write_statistics=False,
        )
        self.shards += 1
        self.sequences += len(rows)


def tokenize_file(batch: dict, cfg: PackConfig, tokenizer_json: str, eos: int, out: str) -> dict:
    """One input file -> `_work/tokens/shard-N.parquet`: its documents tokenised and sorted by
    order key (the id breaks the tie only between identical documents). Written under a
    temporary name and renamed, so a file there is a finished one."""
    i, path = int(batch["index"][0]), batch["file"][0]
    keyed = add_order_keys(read_parquet(path, [cfg.id_field, cfg.text_field]), cfg)
    tokens = Tokenize(tokenizer_json, eos, cfg)(keyed).sort_by([(ORDER, "ascending"), (cfg.id_field, "ascending")])
    write_parquet_atomic(work_path(out, "tokens", shard_name(i) + ".parquet"), tokens.drop_columns(["n_tokens"]))
    return {"index": [i]}


def merged(token_files: list[str], id_field: str, batch_rows: int = 1024):
    """The tokenised documents of every file in one order (order key, then id): a streaming
    merge of the files, each already sorted, read a batch at a time. Yields (ids, val) per
    document."""
    import heapq

    def rows(path: str):
        fs, local = storage.filesystem(path)
        with fs.open_input_file(local) as f:
            for batch in pq.ParquetFile(f).iter_batches(batch_size=batch_rows, columns=[ORDER, id_field, "ids", "val"]):
                keys, ids, val = (batch.column(c).to_pylist() for c in (0, 1, 3))
                lists = batch.column(2)
                offsets = lists.offsets.to_numpy()
                values = lists.values.to_numpy()
                for j in range(batch.num_rows):
                    yield keys[j], ids[j], values[offsets[j] : offsets[j + 1]], val[j]

    for _, _, tokens, val in heapq.merge(*(rows(f) for f in token_files), key=lambda r: (r[0], r[1])):
        yield tokens, val


def _settings(cfg: PackConfig, files: list[str]) -> dict:
    return {"config": json.loads(cfg.model_dump_json(exclude={"overwrite"})), "files": files}


def prepare_run(cfg: PackConfig, out: str, files: list[str]) -> bool:
    """False when a committed output stands (skip); otherwise resume a killed run of the same
    config and input, or start afresh (another run's partial output is removed, with a warning)."""
    if storage.is_committed(out) and not cfg.overwrite:
        return False
    settings = storage.join(out, WORK, "config.json")
    if not cfg.overwrite and storage.exists(settings) and storage.read_json(settings) == _settings(cfg, files):
        logger.info("pack: resuming the unfinished run in %s", out)
        return True
    if storage.exists(out):
        logger.warning("pack: removing %s (an unfinished run with another config, or overwrite=true)", out)
    storage.prepare_output(out, overwrite=True)
    storage.write_json_atomic(settings, _settings(cfg, files))
    return True


def parquet_rows(uri: str) -> int:
    """Rows of a Parquet file, from its footer."""
    fs, path = storage.filesystem(uri)
    with fs.open_input_file(path) as f:
        return pq.ParquetFile(f).metadata.num_rows


def full_shards(split_dir: str, per_shard: int) -> int:
    """Shards a killed run finished, counted from part-00000 up to the first missing or short one
    (the last shard of a split is short, and written again after the rest); the files after it go."""
    files = storage.list_files(split_dir, (".parquet",)) if storage.exists(split_dir) else []
    done = 0
    while done < len(files) and files[done].endswith(f"part-{done:05d}.parquet"):
        if parquet_rows(files[done]) != per_shard:
            break
        done += 1
    for stale in files[done:]:
        storage.remove_file(stale)
    return done


def run_pack(cfg: PackConfig) -> dict:
    """Pack in three phases, each resumable: the tokenizer (`tokenizer.json`), the input files
    tokenised and sorted one task each (`_work/tokens/shard-N.parquet`, skipped when there), and
    the ordered write, which keeps the full shards a killed run wrote."""
    import ray

    out = storage.normalize(cfg.output)
    source = kept_dir(cfg.input)
    files = storage.list_files(source, (".parquet",))
    if not files:
        raise FileNotFoundError(f"pack input {cfg.input!r} holds no .parquet files (expected a curate output)")
    if not prepare_run(cfg, out, files):
        logger.info("pack: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_manifest(out)
    started = time.time()
    phases: dict[str, float] = {}

    def lap(name: str, t: float) -> float:
        now = time.time()
        phases[name] = round(now - t, 2)
        return now

    total = sum(parquet_rows(f) for f in files)
    t = started
    tokenizer_uri = storage.join(out, "tokenizer.json")
    if cfg.tokenizer is not None:
        logger.info("pack: the tokenizer of checkpoint %s", cfg.tokenizer)
        tokenizer_json, eos, vocab_size = checkpoint_tokenizer(cfg.tokenizer)
    elif storage.exists(tokenizer_uri):  # trained by the run this one resumes
        from tokenizers import Tokenizer

        tokenizer_json = storage.read_bytes(tokenizer_uri).decode()
        tok = Tokenizer.from_str(tokenizer_json)
        eos, vocab_size = eos_id(tok), tok.get_vocab_size()
    else:
        logger.info(
            "pack: training a byte-level BPE (vocab %d) on up to %d documents", cfg.vocab_size, cfg.tokenizer_train_docs
        )
        tok = train_bpe(tokenizer_sample(files, cfg, total), cfg.vocab_size, copyable=cfg.copyable_tokens)
        tokenizer_json, eos, vocab_size = tok.to_str(), eos_id(tok), tok.get_vocab_size()
    storage.write_bytes_atomic(tokenizer_uri, tokenizer_json.encode())
    t = lap("tokenizer", t)

    token_files = [work_path(out, "tokens", shard_name(i) + ".parquet") for i in range(len(files))]
    todo = [i for i, f in enumerate(token_files) if not storage.exists(f)]
    if todo:  # one task a file: as many run at once as the cluster has CPUs for
        ray.data.from_items([{"index": i, "file": files[i]} for i in todo], override_num_blocks=len(todo)).map_batches(
            tokenize_file, fn_args=(cfg, tokenizer_json, eos, out), batch_size=1, batch_format="numpy"
        ).materialize()
    logger.info(
        "pack: %d of %d files tokenised now, %d by the run resumed", len(todo), len(files), len(files) - len(todo)
    )
    t = lap("tokenize", t)

    sample_len = cfg.seq_len + 1
    writers = {}
    for name in ("train", "val"):
        done = full_shards(storage.join(out, name), cfg.sequences_per_shard)
        writers[name] = ShardWriter(
            storage.join(out, name), sample_len, cfg.sequences_per_shard, cfg.rows_per_group, done
        )
    docs: dict[bool, list] = {True: [], False: []}
    for tokens, val in merged(token_files, cfg.id_field):
        docs[val].append(tokens)
        if len(docs[val]) >= 1024:
            writers["val" if val else "train"].add(pa.array(docs[val], pa.list_(pa.int32())))
            docs[val] = []
    for val, rest in docs.items():
        if rest:
            writers["val" if val else "train"].add(pa.array(rest, pa.list_(pa.int32())))
    splits = {name: w.close() for name, w in writers.items()}
    lap("write", t)
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
            "vocab_size": vocab_size,
            "seq_len": cfg.seq_len,
            "sample_len": sample_len,
            "eos_id": eos,
            "tokenizer_from": cfg.tokenizer,
            "seed": cfg.seed,
            "sequences_per_shard": cfg.sequences_per_shard,
            "rows_per_group": cfg.rows_per_group,
            "documents": total,
            "splits": splits,
            "fingerprint": storage.fingerprint(out, ["tokenizer.json", "train", "val"]),
            "seconds": round(time.time() - started, 2),
            "phase_seconds": phases,
        },
    )
    storage.remove_dir(storage.join(out, WORK))  # the tokenised copy of the corpus, no longer needed
    logger.info("pack: %s, fingerprint %s", {k: v["sequences"] for k, v in splits.items()}, manifest["fingerprint"])
    return manifest
