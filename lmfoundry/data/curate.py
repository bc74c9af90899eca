"""The curation pipeline on Ray Data: read, normalise, filter, exact dedup, write.

Output layout under `output`:
  kept/        Parquet of the documents that passed (all input fields carried through)
  rejected/    Parquet of the others, each with its `reason`
  report.json  counts by reason, characters in and out, timings
  _MANIFEST.json  written last: the stage is complete
"""

from __future__ import annotations

import hashlib
import time
from typing import Literal

import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from lmfoundry.data.filters import HeuristicFilter, HeuristicFilterConfig
from lmfoundry.data.normalize import normalize_text
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

INPUT_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"), "parquet": (".parquet",)}
KEPT = ""  # the `reason` of a kept document


class CurateConfig(StageConfig):
    input: str = Field(..., description="file or folder of jsonl(.gz) or parquet, local or s3://")
    output: str
    format: Literal["auto", "jsonl", "parquet"] = "auto"
    text_field: str = "text"
    id_field: str = "id"
    limit: int | None = Field(None, ge=1, description="read at most this many documents (trials)")
    drop_boilerplate_lines: bool = True
    filters: HeuristicFilterConfig = HeuristicFilterConfig()
    exact_dedup: bool = True
    write_rejected: bool = True
    overwrite: bool = False


def input_files(cfg: CurateConfig) -> tuple[str, list[str]]:
    """The format and the files to read; a clear error when there are none."""
    if not storage.exists(cfg.input):
        raise FileNotFoundError(f"input {cfg.input!r} does not exist")
    formats = [cfg.format] if cfg.format != "auto" else ["jsonl", "parquet"]
    for fmt in formats:
        files = storage.list_files(cfg.input, INPUT_SUFFIXES[fmt])
        if files:
            return fmt, files
    allowed = ", ".join(s for f in formats for s in INPUT_SUFFIXES[f])
    raise FileNotFoundError(f"input {cfg.input!r} holds no files ending in {allowed}")


def text_hash(text: str) -> str:
    return hashlib.sha1(text.encode("utf-8")).hexdigest()


def derive_id(path: str, text: object) -> str:
    """A stable id for a document whose input has none: its file name and a hash of its content."""
    return f"{path.rsplit('/', 1)[-1]}:{text_hash(path + chr(0) + str(text))[:16]}"


class DocumentProcessor:
    """Normalises and filters one batch; adds `reason`, `text_hash` and `chars` columns.
    A plain class so it runs (and is tested) without Ray; Ray Data calls it per batch."""

    def __init__(self, cfg: CurateConfig):
        self.cfg = cfg
        self.filter = HeuristicFilter(cfg.filters)

    def __call__(self, batch: pa.Table) -> pa.Table:
        cfg = self.cfg
        if cfg.text_field not in batch.column_names:
            raise ValueError(
                f"input has no text field {cfg.text_field!r}; its fields are {batch.column_names} "
                "(set text_field in the curate config)"
            )
        texts, reasons, hashes, chars, removed = [], [], [], [], []
        raw_texts = batch.column(cfg.text_field).to_pylist()
        for raw in raw_texts:
            if not isinstance(raw, str):
                texts.append("" if raw is None else str(raw))
                reasons.append("text_not_a_string")
                removed.append(0)
            else:
                text, n_removed = normalize_text(raw, cfg.drop_boilerplate_lines)
                texts.append(text)
                reasons.append(self.filter(text) or KEPT)
                removed.append(n_removed)
            hashes.append(text_hash(texts[-1]))
            chars.append(len(raw) if isinstance(raw, str) else 0)
        if cfg.id_field in batch.column_names:
            ids = [str(i) for i in batch.column(cfg.id_field).to_pylist()]
        else:  # a stable id from where the document came from and what it says
            paths = batch.column("path").to_pylist() if "path" in batch.column_names else [""] * len(texts)
            ids = [derive_id(p, r) for p, r in zip(paths, raw_texts)]
        batch = batch.drop_columns([c for c in (cfg.text_field, cfg.id_field) if c in batch.column_names])
        return batch.append_column(cfg.id_field, pa.array(ids, pa.string())).append_column(
            cfg.text_field, pa.array(texts, pa.string())
        ).append_column("reason", pa.array(reasons, pa.string())).append_column(
            "text_hash", pa.array(hashes, pa.string())
        ).append_column("chars_in", pa.array(chars, pa.int64())).append_column(
            "boilerplate_lines_removed", pa.array(removed, pa.int32())
        )


def mark_exact_duplicates(group, id_field: str = "id"):
    """One group of documents sharing a text hash: the smallest id among the kept ones stays,
    the others are rejected as duplicates of it. Deterministic whatever the input order."""
    kept = group[group["reason"] == KEPT]
    if len(kept) > 1:
        first = kept[id_field].min()
        dup = (group["reason"] == KEPT) & (group[id_field] != first)
        group.loc[dup, "reason"] = "exact_duplicate"
        group["duplicate_of"] = ""
        group.loc[dup, "duplicate_of"] = first
    elif "duplicate_of" not in group:
        group["duplicate_of"] = ""
    return group


def dedup_partitions(files: list[str], bytes_per_partition: int = 128 << 20) -> int:
    """Shuffle partitions for dedup, from the input size: Ray's default of 200 partitions would
    turn a small corpus into hundreds of tiny tasks."""
    total = 0
    for uri in files:
        fs, path = storage.filesystem(uri)
        total += fs.get_file_info(path).size or 0
    return max(1, min(200, -(-total // bytes_per_partition)))


def _select(table: pa.Table, kept: bool) -> pa.Table:
    mask = pc.equal(table.column("reason"), KEPT)
    return table.filter(mask if kept else pc.invert(mask))


def run_curate(cfg: CurateConfig) -> dict:
    """Curate `cfg.input` into `cfg.output`. Returns the report (also written as report.json)."""
    import ray

    out = storage.normalize(cfg.output)
    fmt, files = input_files(cfg)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("curate: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "report.json"))
    started = time.time()
    logger.info("curate: %d %s files from %s -> %s", len(files), fmt, cfg.input, out)
    if fmt == "jsonl":
        ds = ray.data.read_json(files, lines=True, include_paths=True)
    else:
        ds = ray.data.read_parquet(files, include_paths=True)
    if cfg.limit:
        ds = ds.limit(cfg.limit)
    ds = ds.map_batches(DocumentProcessor, fn_constructor_args=(cfg,), batch_format="pyarrow", concurrency=(1, 4))
    if cfg.exact_dedup:
        ds = ds.groupby("text_hash", num_partitions=dedup_partitions(files)).map_groups(
            mark_exact_duplicates, fn_kwargs={"id_field": cfg.id_field}, batch_format="pandas"
        )
    ds = ds.materialize()

    ds.map_batches(_select, fn_kwargs={"kept": True}, batch_format="pyarrow").write_parquet(
        storage.join(out, "kept")
    )
    if cfg.write_rejected:
        ds.map_batches(_select, fn_kwargs={"kept": False}, batch_format="pyarrow").write_parquet(
            storage.join(out, "rejected")
        )
    report = _report(ds, cfg, time.time() - started)
    storage.write_json_atomic(storage.join(out, "report.json"), report)
    storage.commit(out, "curate", {"input": cfg.input, "format": fmt, "files": len(files), "report": "report.json",
                                   "kept": "kept", "rejected": "rejected" if cfg.write_rejected else None,
                                   "text_field": cfg.text_field, "id_field": cfg.id_field})
    logger.info("curate: kept %d of %d documents (%.1f%% of characters); rejected by reason %s",
                report["documents_kept"], report["documents_in"], 100 * report["chars_kept_fraction"],
                report["rejected_by_reason"])
    return report


def _report(ds, cfg: CurateConfig, seconds: float) -> dict:
    by_reason: dict[str, int] = {}
    chars_in = chars_kept = boiler = 0
    columns = ["reason", "chars_in", "boilerplate_lines_removed", cfg.text_field]
    for batch in ds.select_columns(columns).iter_batches(batch_format="pyarrow", batch_size=4096):
        reasons = batch.column("reason").to_pylist()
        for r in reasons:
            by_reason[r] = by_reason.get(r, 0) + 1
        chars_in += pc.sum(batch.column("chars_in")).as_py() or 0
        boiler += pc.sum(batch.column("boilerplate_lines_removed")).as_py() or 0
        kept_text = _select(batch, kept=True).column(cfg.text_field)
        chars_kept += pc.sum(pc.utf8_length(kept_text)).as_py() or 0
    total = sum(by_reason.values())
    kept = by_reason.pop(KEPT, 0)
    return {
        "documents_in": total,
        "documents_kept": kept,
        "documents_rejected": total - kept,
        "rejected_by_reason": dict(sorted(by_reason.items(), key=lambda kv: -kv[1])),
        "chars_in": chars_in,
        "chars_kept": chars_kept,
        "chars_kept_fraction": chars_kept / max(chars_in, 1),
        "boilerplate_lines_removed": boiler,
        "seconds": round(seconds, 2),
    }
