"""The curation pipeline on Ray Data, resumable shard by shard.

Phases, each committed piece by piece so that a killed run, rerun with the same config, redoes
only what was not finished and ends with the same output as a clean run:

1. documents  per input shard (a file, or a group of .txt files), in a Ray Data actor pool that
              holds the models (language, harm, quality): every per-document stage
              (`documents.DocumentProcessor`) -> `_work/docs/shard-NNNNN.parquet` + marker
2. dedup      exact (same normalised text) and fuzzy (MinHash LSH, verified Jaccard, connected
              components; optional semantic dedup) over all shards (`dedup_pipeline.py`) ->
              `_work/dedup/duplicates/shard-N.parquet` + marker
3. write      per shard: the dedup decisions applied -> `kept/shard-NNNNN.parquet`,
              `rejected/shard-NNNNN.parquet` (every row with `reason` and `stage`) + marker
4. report     `report.json`, `report.html`, the quality checklist; `_MANIFEST.json` last

Files are written under a temporary name and renamed; the marker of a shard is written after its
files. Output names depend only on the input's sorted file list, so reruns write the same names.
"""

from __future__ import annotations

import io
import json
import os
import time
from typing import Literal

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from pydantic import Field

from lmfoundry.data.dedup import DedupConfig
from lmfoundry.data.dedup_pipeline import duplicates_path, run_dedup
from lmfoundry.data.density import DensityConfig
from lmfoundry.data.documents import INTERNAL_COLUMNS, KEPT, DocumentProcessor
from lmfoundry.data.filters import HeuristicFilterConfig
from lmfoundry.data.langid import LanguageConfig
from lmfoundry.data.quality import QualityConfig
from lmfoundry.data.report import ChecklistConfig, build_report, shard_stats
from lmfoundry.data.workdir import WORK, pending, read_parquet, shard_name, work_path, write_parquet_atomic
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig, StageFailed
from lmfoundry.platform.log import get_logger
from lmfoundry.safety.harm import HarmConfig
from lmfoundry.safety.pii import PIIConfig

logger = get_logger(__name__)

INPUT_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"), "parquet": (".parquet",), "text": (".txt",)}


class CurateConfig(StageConfig):
    input: str = Field(..., description="file or folder of jsonl(.gz), parquet or .txt files, local or s3://")
    output: str
    format: Literal["auto", "jsonl", "parquet", "text"] = "auto"
    text_field: str = "text"
    id_field: str = "id"
    limit: int | None = Field(None, ge=1, description="read at most this many documents (trials)")
    text_files_per_shard: int = Field(1000, ge=1, description=".txt input: files (documents) per shard")
    batch_rows: int = Field(1000, ge=1, description="documents per processing batch")
    drop_boilerplate_lines: bool = True
    language: LanguageConfig = LanguageConfig()
    filters: HeuristicFilterConfig = HeuristicFilterConfig()
    pii: PIIConfig = PIIConfig()
    harm: HarmConfig = HarmConfig()
    quality: QualityConfig = QualityConfig()
    density: DensityConfig = DensityConfig()
    dedup: DedupConfig = DedupConfig()
    checklist: ChecklistConfig = ChecklistConfig()
    write_rejected: bool = True
    workers: int | None = Field(None, ge=1, description="document workers (actors); default: the cluster's CPUs")
    gpus_per_worker: float = Field(0.0, ge=0, description="GPUs each document worker takes (quality/harm models)")
    overwrite: bool = False


# -- input --------------------------------------------------------------------------------------


def input_shards(cfg: CurateConfig) -> tuple[str, list[list[str]]]:
    """The input format and its shards (lists of files), in a deterministic order."""
    if not storage.exists(cfg.input):
        raise FileNotFoundError(f"input {cfg.input!r} does not exist")
    formats = [cfg.format] if cfg.format != "auto" else ["jsonl", "parquet", "text"]
    for fmt in formats:
        files = storage.list_files(cfg.input, INPUT_SUFFIXES[fmt])
        if files:
            if fmt == "text":
                k = cfg.text_files_per_shard
                return fmt, [files[i : i + k] for i in range(0, len(files), k)]
            return fmt, [[f] for f in files]
    allowed = ", ".join(s for f in formats for s in INPUT_SUFFIXES[f])
    raise FileNotFoundError(f"input {cfg.input!r} holds no files ending in {allowed}")


def read_shard(fmt: str, files: list[str], cfg: CurateConfig) -> pa.Table:
    if fmt == "text":
        base = storage.normalize(cfg.input).rstrip("/")
        texts = [storage.read_bytes(f).decode("utf-8", errors="replace") for f in files]
        names = [f[len(base) + 1 :] if f.startswith(base + "/") else f.rsplit("/", 1)[-1] for f in files]
        return pa.table({cfg.id_field: names, cfg.text_field: texts})
    (uri,) = files
    data = storage.read_bytes(uri)
    if fmt == "parquet":
        return pq.read_table(io.BytesIO(data))
    import pyarrow.json as pj

    try:
        return pj.read_json(io.BytesIO(data), read_options=pj.ReadOptions(block_size=64 << 20))
    except pa.ArrowInvalid:  # rows whose fields change type: parse in Python, keep them as strings
        rows = []
        for n, line in enumerate(data.decode("utf-8").splitlines(), 1):
            if line.strip():
                try:
                    row = json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"{uri}:{n}: not a JSON line ({e.msg})") from None
                rows.append({k: v if isinstance(v, str) or v is None else json.dumps(v) for k, v in row.items()})
        return pa.Table.from_pylist(rows)


# -- phase 1: documents -------------------------------------------------------------------------


class ShardWorker:
    """A Ray Data actor: curates whole shards (models loaded once per actor)."""

    def __init__(self, cfg: CurateConfig, out: str, fmt: str, shards: list[list[str]], limits: dict[int, int]):
        self.cfg, self.out, self.fmt, self.shards, self.limits = cfg, out, fmt, shards, limits
        self.processor = DocumentProcessor(cfg)

    def __call__(self, batch: dict) -> dict:
        rows = []
        for i in batch["shard"].tolist():
            table = read_shard(self.fmt, self.shards[i], self.cfg)
            if i in self.limits:
                table = table.slice(0, self.limits[i])
            parts = [
                self.processor(table.slice(s, self.cfg.batch_rows), i, s, self.shards[i][0])
                for s in range(0, table.num_rows, self.cfg.batch_rows)
            ]
            base = work_path(self.out, "docs", shard_name(i))
            if parts:
                write_parquet_atomic(base + ".parquet", pa.concat_tables(parts, promote_options="permissive"))
            kept = sum(pc.sum(pc.equal(p.column("reason"), KEPT)).as_py() or 0 for p in parts)
            storage.write_json_atomic(
                base + ".json", {"shard": i, "files": self.shards[i], "documents": table.num_rows, "kept": kept}
            )
            rows.append(table.num_rows)
        return {"shard": batch["shard"], "documents": np.array(rows)}


def _row_limits(fmt: str, shards: list[list[str]], cfg: CurateConfig) -> dict[int, int]:
    """With `limit`, how many rows each shard contributes (shards past the limit: 0)."""
    if not cfg.limit:
        return {}
    limits, left = {}, cfg.limit
    for i, files in enumerate(shards):
        n = read_shard(fmt, files, cfg).num_rows if left else 0
        limits[i] = min(n, left)
        left -= limits[i]
    return limits


def _workers(cfg: CurateConfig, pending: int) -> int:
    """Workers for `pending` shards: the configured number, else one per CPU of the cluster, but on
    a one-node cluster no more than the machine's cores (the embedded local Ray advertises twice
    the cores so that training workers and data tasks never wait on each other; a CPU-bound
    worker per logical CPU would only contend)."""
    import ray

    cpus = int(ray.cluster_resources().get("CPU", 1))
    if len([n for n in ray.nodes() if n.get("Alive")]) == 1:
        cpus = min(cpus, os.cpu_count() or cpus)
    return max(1, min(pending, cfg.workers or cpus))


def run_documents(cfg: CurateConfig, out: str, fmt: str, shards: list[list[str]]) -> None:
    import ray

    todo = pending(out, "docs", len(shards))
    if len(todo) < len(shards):
        logger.info("curate: documents: %d of %d shards already done; resuming", len(shards) - len(todo), len(shards))
    if not todo:
        return
    limits = _row_limits(fmt, shards, cfg)
    ds = ray.data.from_items([{"shard": i} for i in todo], override_num_blocks=len(todo))
    ds = ds.map_batches(
        ShardWorker,
        fn_constructor_args=(cfg, out, fmt, shards, limits),
        batch_size=1,
        compute=ray.data.ActorPoolStrategy(size=_workers(cfg, len(todo))),
        num_cpus=1,
        num_gpus=cfg.gpus_per_worker or None,
    )
    done = ds.take_all()
    logger.info("curate: documents: %d shards, %d documents", len(done), sum(int(r["documents"]) for r in done))


# -- phase 3: write kept/ and rejected/ ---------------------------------------------------------


def finalize_shards(batch: dict, out: str, cfg_json: str) -> dict:
    cfg = CurateConfig.model_validate_json(cfg_json)
    for i in batch["shard"].tolist():
        src = work_path(out, "docs", shard_name(i) + ".parquet")
        name = shard_name(i)
        if storage.exists(src):
            t = read_parquet(src)
            if storage.exists(duplicates_path(out, i)):
                mine = read_parquet(duplicates_path(out, i))
                lookup = dict(
                    zip(
                        mine.column("doc_key").to_pylist(),
                        zip(mine.column("reason").to_pylist(), mine.column("duplicate_of").to_pylist()),
                    )
                )
                reason, stage, dup_of = (t.column(c).to_pylist() for c in ("reason", "stage", "duplicate_of"))
                for j, key in enumerate(t.column("doc_key").to_pylist()):
                    if key in lookup:
                        reason[j], dup_of[j] = lookup[key]
                        stage[j] = "dedup"
                for col, values in (("reason", reason), ("stage", stage), ("duplicate_of", dup_of)):
                    t = t.set_column(t.column_names.index(col), col, pa.array(values, pa.string()))
            is_kept = pc.equal(t.column("reason"), KEPT)
            kept, rejected = t.filter(is_kept), t.filter(pc.invert(is_kept))
            public = [c for c in t.column_names if c not in INTERNAL_COLUMNS]
            write_parquet_atomic(storage.join(out, "kept", name + ".parquet"), kept.select(public))
            if cfg.write_rejected:
                write_parquet_atomic(storage.join(out, "rejected", name + ".parquet"), rejected.select(public))
            write_parquet_atomic(
                work_path(out, "signatures", name + ".parquet"), kept.select(["doc_key", "_signature"])
            )
            stats = shard_stats(t, cfg)
        else:
            stats = shard_stats(None, cfg)
        storage.write_json_atomic(work_path(out, "final", name + ".json"), stats)
    return {"shard": batch["shard"]}


def run_finalize(cfg: CurateConfig, out: str, num_shards: int) -> None:
    import ray

    todo = pending(out, "final", num_shards)
    if todo:
        ray.data.from_items([{"shard": i} for i in todo], override_num_blocks=len(todo)).map_batches(
            finalize_shards,
            fn_kwargs={"out": out, "cfg_json": cfg.model_dump_json()},
            batch_size=1,
            num_cpus=1,
            compute=ray.data.TaskPoolStrategy(size=_workers(cfg, len(todo))),
        ).take_all()


# -- the stage ----------------------------------------------------------------------------------


def _fingerprint(cfg: CurateConfig) -> dict:
    # what does not change the output: a killed run resumes with other workers or another shuffle
    return json.loads(cfg.model_dump_json(exclude={"overwrite": True, "workers": True, "dedup": {"shuffle"}}))


def prepare_run(cfg: CurateConfig, out: str) -> bool:
    """False when a committed output stands (skip); otherwise resume a killed run of the same
    config, or start afresh (a different config's partial output is removed, with a warning)."""
    if storage.is_committed(out) and not cfg.overwrite:
        return False
    settings = storage.join(out, WORK, "config.json")  # the run's settings, to know a resumable run
    if not cfg.overwrite and storage.exists(settings) and storage.read_json(settings) == _fingerprint(cfg):
        logger.info("curate: resuming the unfinished run in %s", out)
        return True
    if storage.exists(out):
        logger.warning("curate: removing %s (an unfinished run with another config, or overwrite=true)", out)
    storage.prepare_output(out, overwrite=True)
    storage.write_json_atomic(settings, _fingerprint(cfg))
    return True


def run_curate(cfg: CurateConfig) -> dict:
    """Curate `cfg.input` into `cfg.output`. Returns the report (also written as report.json)."""
    out = storage.normalize(cfg.output)
    fmt, shards = input_shards(cfg)
    if not prepare_run(cfg, out):
        logger.info("curate: %s is already committed; skipping (set overwrite=true to redo)", out)
        return storage.read_json(storage.join(out, "report.json"))
    started = time.time()
    logger.info("curate: %d %s shards from %s -> %s", len(shards), fmt, cfg.input, out)
    timings = {}
    t = time.time()
    run_documents(cfg, out, fmt, shards)
    timings["documents"] = round(time.time() - t, 2)
    t = time.time()
    dedup_stats = run_dedup(cfg, out, len(shards))
    timings["dedup"] = round(time.time() - t, 2)
    t = time.time()
    run_finalize(cfg, out, len(shards))
    timings["write"] = round(time.time() - t, 2)
    stats = [storage.read_json(work_path(out, "final", shard_name(i) + ".json")) for i in range(len(shards))]
    report = build_report(cfg, out, stats, dedup_stats, timings, started)
    storage.commit(
        out,
        "curate",
        {
            "input": cfg.input,
            "format": fmt,
            "shards": len(shards),
            "report": "report.json",
            "kept": "kept",
            "rejected": "rejected" if cfg.write_rejected else None,
            "text_field": cfg.text_field,
            "id_field": cfg.id_field,
            "fingerprint": storage.fingerprint(out, ["kept", "rejected"]),
        },
    )
    logger.info(
        "curate: kept %d of %d documents (%.1f%% of characters); rejected by reason %s",
        report["documents_kept"],
        report["documents_in"],
        100 * report["chars_kept_fraction"],
        report["rejected_by_reason"],
    )
    failed = [c["item"] for c in report["checklist"] if not c["passed"]]
    if cfg.checklist.enforce and failed:
        raise ChecklistFailed(f"the data-quality checklist failed: {', '.join(failed)} (see {out}/report.json)")
    return report


class ChecklistFailed(StageFailed):
    pass
