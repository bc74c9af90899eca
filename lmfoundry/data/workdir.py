"""The curation run's work directory: shard names, the phases' markers, Parquet written under a
temporary name and renamed, and Ray Data reads of the run's own shards."""

from __future__ import annotations

import io

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmfoundry.platform import storage

WORK = "_work"


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


def work_path(out: str, phase: str, name: str) -> str:
    return storage.join(out, WORK, phase, name)


def write_parquet_atomic(uri: str, table: pa.Table, **options) -> None:
    """`options` go to pyarrow's write_table (row_group_size, write_statistics, ...)."""
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd", **options)
    storage.write_bytes_atomic(uri, buf.getvalue())


def read_parquet(uri: str, columns: list[str] | None = None) -> pa.Table:
    return pq.read_table(io.BytesIO(storage.read_bytes(uri)), columns=columns)


def pending(out: str, phase: str, n: int) -> list[int]:
    """The shards whose `phase` has no done-marker yet."""
    return [i for i in range(n) if not storage.exists(work_path(out, phase, shard_name(i) + ".json"))]


def doc_files(out: str, n: int) -> list[str]:
    """The document shards phase 1 wrote (a shard with no documents writes none)."""
    return [f for i in range(n) if storage.exists(f := work_path(out, "docs", shard_name(i) + ".parquet"))]


def _read_files(batch: dict, columns: list[str] | None) -> pa.Table:
    return pa.concat_tables([read_parquet(f, columns) for f in batch["file"].tolist()])


def read_parquet_files(files: list[str], columns: list[str] | None = None):
    """A Ray Data dataset of the run's own Parquet shards, one read task per file.
    (ray.data.read_parquet spends seconds per call sampling file metadata, which dominates on the
    small files of a run.)"""
    import ray

    return ray.data.from_items([{"file": f} for f in files], override_num_blocks=len(files)).map_batches(
        _read_files, fn_kwargs={"columns": columns}, batch_size=1, batch_format="numpy"
    )


def hash_sample(batch: pa.Table, rate: float) -> pa.Table:
    """A deterministic pseudo-random sample: a document is in it when its key hashes below `rate`."""
    keys = np.asarray(batch.column("doc_key")).astype(np.uint64)
    with np.errstate(over="ignore"):
        u = ((keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return batch.filter(pa.array(u < rate))
