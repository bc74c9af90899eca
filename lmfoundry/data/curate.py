"""The curation pipeline on Ray Data, resumable shard by shard.

Phases, each committed piece by piece so that a killed run, rerun with the same config, redoes
only what was not finished and ends with the same output as a clean run:

1. documents  per input shard (a file, or a group of .txt files), in a Ray Data actor pool that
              holds the models (language, harm, quality): every per-document stage
              (`documents.DocumentProcessor`) -> `_work/docs/shard-NNNNN.parquet` + marker
2. dedup      exact (same normalised text) and fuzzy (MinHash LSH, verified Jaccard, connected
              components) over all shards with Ray Data groupbys -> `_work/dedup/*.parquet` + marker
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
from lmfoundry.data.density import DensityConfig
from lmfoundry.data.documents import INTERNAL_COLUMNS, KEPT, SHARD_BITS, DocumentProcessor
from lmfoundry.data.filters import HeuristicFilterConfig
from lmfoundry.data.harm import HarmConfig
from lmfoundry.data.langid import LanguageConfig
from lmfoundry.data.pii import PIIConfig
from lmfoundry.data.quality import QualityConfig
from lmfoundry.data.report import ChecklistConfig, build_report, shard_stats
from lmfoundry.platform import storage
from lmfoundry.platform.cli import StageFailed
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

INPUT_SUFFIXES = {"jsonl": (".jsonl", ".jsonl.gz", ".json", ".json.gz"), "parquet": (".parquet",), "text": (".txt",)}
WORK = "_work"


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
                return fmt, [files[i:i + k] for i in range(0, len(files), k)]
            return fmt, [[f] for f in files]
    allowed = ", ".join(s for f in formats for s in INPUT_SUFFIXES[f])
    raise FileNotFoundError(f"input {cfg.input!r} holds no files ending in {allowed}")


def read_shard(fmt: str, files: list[str], cfg: CurateConfig) -> pa.Table:
    if fmt == "text":
        base = storage.normalize(cfg.input).rstrip("/")
        texts = [storage.read_bytes(f).decode("utf-8", errors="replace") for f in files]
        names = [f[len(base) + 1:] if f.startswith(base + "/") else f.rsplit("/", 1)[-1] for f in files]
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

def _write_parquet_atomic(uri: str, table: pa.Table) -> None:
    buf = io.BytesIO()
    pq.write_table(table, buf, compression="zstd")
    storage.write_bytes_atomic(uri, buf.getvalue())


def shard_name(i: int) -> str:
    return f"shard-{i:05d}"


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
            parts = [self.processor(table.slice(s, self.cfg.batch_rows), i, s, self.shards[i][0])
                     for s in range(0, table.num_rows, self.cfg.batch_rows)]
            base = storage.join(self.out, WORK, "docs", shard_name(i))
            if parts:
                _write_parquet_atomic(base + ".parquet", pa.concat_tables(parts, promote_options="permissive"))
            kept = sum(pc.sum(pc.equal(p.column("reason"), KEPT)).as_py() or 0 for p in parts)
            storage.write_json_atomic(base + ".json", {"shard": i, "files": self.shards[i], "documents": table.num_rows,
                                                       "kept": kept})
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


def _pending(out: str, phase: str, n: int) -> list[int]:
    return [i for i in range(n) if not storage.exists(storage.join(out, WORK, phase, shard_name(i) + ".json"))]


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

    pending = _pending(out, "docs", len(shards))
    if len(pending) < len(shards):
        logger.info("curate: documents: %d of %d shards already done; resuming", len(shards) - len(pending), len(shards))
    if not pending:
        return
    limits = _row_limits(fmt, shards, cfg)
    ds = ray.data.from_items([{"shard": i} for i in pending], override_num_blocks=len(pending))
    ds = ds.map_batches(ShardWorker, fn_constructor_args=(cfg, out, fmt, shards, limits), batch_size=1,
                        compute=ray.data.ActorPoolStrategy(size=_workers(cfg, len(pending))), num_cpus=1,
                        num_gpus=cfg.gpus_per_worker or None)
    done = ds.take_all()
    logger.info("curate: documents: %d shards, %d documents", len(done), sum(int(r["documents"]) for r in done))


# -- phase 2: dedup -----------------------------------------------------------------------------

def _read_files(batch: dict, columns: list[str] | None) -> pa.Table:
    return pa.concat_tables([pq.read_table(io.BytesIO(storage.read_bytes(f)), columns=columns)
                             for f in batch["file"].tolist()])


def read_parquet_files(files: list[str], columns: list[str] | None = None):
    """A Ray Data dataset of our own Parquet shards, one read task per file. (ray.data.read_parquet
    spends seconds per call sampling file metadata, which dominates on the small files of a run.)"""
    import ray

    return ray.data.from_items([{"file": f} for f in files], override_num_blocks=len(files)).map_batches(
        _read_files, fn_kwargs={"columns": columns}, batch_size=1, batch_format="numpy")


def _doc_files(out: str, n: int) -> list[str]:
    return [f for i in range(n) if storage.exists(f := storage.join(out, WORK, "docs", shard_name(i) + ".parquet"))]


def _partitions(num_docs: int, per_million: int) -> int:
    return max(1, min(512, -(-num_docs * per_million // 1_000_000)))


def bucket_rows(batch: pa.Table, partitions: int, exact: bool, fuzzy: bool) -> pa.Table:
    """One row per (document, bucket): its text hash (exact) and its LSH band keys (fuzzy), with
    the hash partition the row belongs to."""
    keys = batch.column("doc_key")
    parts = []
    if exact:
        parts.append(pa.table({"bucket": batch.column("_text_hash"), "doc_key": keys,
                               "exact": pa.array(np.ones(batch.num_rows, bool))}))
    if fuzzy:
        parents = pc.list_parent_indices(batch.column("_buckets"))
        flat = pc.list_flatten(batch.column("_buckets"))
        parts.append(pa.table({"bucket": flat, "doc_key": pc.take(keys, parents),
                               "exact": pa.array(np.zeros(len(flat), bool))}))
    rows = pa.concat_tables(parts)
    part = np.asarray(rows.column("bucket")) % np.uint64(partitions)
    return rows.append_column("part", pa.array(part.astype(np.int64)))


def bucket_group(group: dict) -> dict:
    """One hash partition of buckets -> candidate edges (a < b), exact ones marked."""
    from lmfoundry.data.dedup import star_edges

    out = {"a": [], "b": [], "exact": []}
    for flag in (True, False):
        sel = group["exact"] == flag
        a, b = star_edges(group["bucket"][sel], group["doc_key"][sel])
        out["a"].append(a)
        out["b"].append(b)
        out["exact"].append(np.full(len(a), flag))
    return {k: np.concatenate(v) for k, v in out.items()}


def verify_pairs(batch: dict, out: str, cfg_json: str) -> dict:
    """Candidate pairs between two shards: read the two shards' texts, keep the pairs whose
    shingle sets have Jaccard similarity at or above the threshold."""
    from lmfoundry.data.dedup import jaccard, shingle_hashes

    cfg = CurateConfig.model_validate_json(cfg_json)
    keep_a, keep_b = [], []
    for shard_a, shard_b, a, b in zip(batch["shard_a"], batch["shard_b"], batch["a"], batch["b"]):
        a, b = np.asarray(a, np.int64), np.asarray(b, np.int64)
        texts = {}
        for shard in {int(shard_a), int(shard_b)}:
            uri = storage.join(out, WORK, "docs", shard_name(shard) + ".parquet")
            t = pq.read_table(io.BytesIO(storage.read_bytes(uri)), columns=["doc_key", cfg.text_field])
            t = t.filter(pc.is_in(t.column("doc_key"), pa.array(np.unique(np.concatenate([a, b])))))
            texts.update(zip(t.column("doc_key").to_pylist(), t.column(cfg.text_field).to_pylist()))
        shingles = {k: shingle_hashes(v, cfg.dedup.shingle_words) for k, v in texts.items()}
        ok = np.array([jaccard(shingles[x], shingles[y]) >= cfg.dedup.jaccard_threshold
                       for x, y in zip(a.tolist(), b.tolist())], dtype=bool)
        keep_a.append(a[ok])
        keep_b.append(b[ok])
    return {"a": np.concatenate(keep_a), "b": np.concatenate(keep_b)}


def run_dedup(cfg: CurateConfig, out: str, num_shards: int) -> dict:
    """Exact and fuzzy duplicates in one Ray Data groupby over hash partitions of the buckets;
    candidate pairs verified per pair of shards; clusters by union-find over the duplicate edges.
    Writes `_work/dedup/duplicates.parquet`: (shard, doc_key, reason, duplicate_of)."""
    import ray
    from ray.data.context import ShuffleStrategy
    from ray.data.expressions import col

    from lmfoundry.data.dedup import UnionFind

    marker = storage.join(out, WORK, "dedup", "_DONE.json")
    if storage.exists(marker):
        logger.info("curate: dedup already done; resuming after it")
        return storage.read_json(marker)
    started = time.time()
    files = _doc_files(out, num_shards)
    num_kept = sum(storage.read_json(storage.join(out, WORK, "docs", shard_name(i) + ".json")).get("kept", 0)
                   for i in range(num_shards))
    parts = _partitions(num_kept, cfg.dedup.partitions_per_million)
    stats = {"kept_before_dedup": num_kept, "partitions": parts, "exact_duplicates": 0, "candidate_pairs": 0,
             "verified_pairs": 0, "near_duplicates": 0}
    uf, exact_dups, near_linked = UnionFind(), set(), set()
    if files and num_kept and (cfg.dedup.exact or cfg.dedup.fuzzy):
        # The sort-based shuffle runs on tasks, which reuse warm workers; the hash shuffle starts
        # a set of aggregator actors for every groupby (seconds each on a small cluster).
        ray.data.DataContext.get_current().shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        kept = read_parquet_files(files, ["doc_key", "reason", "_text_hash", "_buckets"]).filter(expr=col("reason") == KEPT)
        rows = kept.map_batches(bucket_rows, fn_kwargs={"partitions": parts, "exact": cfg.dedup.exact,
                                                        "fuzzy": cfg.dedup.fuzzy}, batch_format="pyarrow")
        fuzzy_pairs: set[tuple[int, int]] = set()
        grouped = rows.groupby("part", num_partitions=parts).map_groups(bucket_group, batch_format="numpy")
        for batch in grouped.iter_batches(batch_format="numpy"):
            for a, b, is_exact in zip(batch["a"].tolist(), batch["b"].tolist(), batch["exact"].tolist()):
                if is_exact:
                    uf.union(a, b)
                    exact_dups.add(b)
                else:  # the same pair can share buckets in several bands, in several partitions
                    fuzzy_pairs.add((a, b))
        candidates: dict[tuple[int, int], tuple[list, list]] = {}
        for a, b in sorted(fuzzy_pairs):
            if b not in exact_dups or uf.find(a) != uf.find(b):  # exact pairs need no verification
                pair = candidates.setdefault((a >> SHARD_BITS, b >> SHARD_BITS), ([], []))
                pair[0].append(a)
                pair[1].append(b)
        stats["candidate_pairs"] = sum(len(v[0]) for v in candidates.values())
        if candidates:
            items = [{"shard_a": sa, "shard_b": sb, "a": v[0], "b": v[1]} for (sa, sb), v in sorted(candidates.items())]
            verified = ray.data.from_items(items, override_num_blocks=min(len(items), 4 * max(1, _workers(cfg, len(items))))) \
                .map_batches(verify_pairs, fn_kwargs={"out": out, "cfg_json": cfg.model_dump_json()}, batch_size=1,
                             num_cpus=1)
            for batch in verified.iter_batches(batch_format="numpy"):
                for a, b in zip(batch["a"].tolist(), batch["b"].tolist()):
                    uf.union(a, b)
                    near_linked.update((a, b))
                    stats["verified_pairs"] += 1
    if files and num_kept > 1 and cfg.dedup.semantic.enabled:
        pairs = 0
        for a, b in semantic_edges(cfg, files, num_kept):
            uf.union(a, b)
            pairs += 1
        stats["semantic_pairs"] = pairs
    dups = uf.duplicates()
    names = _ids_of(files, {rep for rep in dups.values()}, cfg) if dups else {}
    keys = np.array(sorted(dups), dtype=np.int64)
    reasons = ["exact_duplicate" if k in exact_dups else "near_duplicate" if k in near_linked else "semantic_duplicate"
               for k in keys.tolist()]
    for kind in ("exact", "near", "semantic"):
        stats[f"{kind}_duplicates"] = reasons.count(f"{kind}_duplicate")
    table = pa.table({"shard": pa.array(keys >> SHARD_BITS, pa.int64()), "doc_key": pa.array(keys, pa.int64()),
                      "reason": pa.array(reasons, pa.string()),
                      "duplicate_of": pa.array([names[dups[k]] for k in keys.tolist()], pa.string())})
    _write_parquet_atomic(storage.join(out, WORK, "dedup", "duplicates.parquet"), table)
    stats["seconds"] = round(time.time() - started, 2)
    storage.write_json_atomic(marker, stats)
    logger.info("curate: dedup: %s", stats)
    return stats


def hash_sample(batch: pa.Table, rate: float) -> pa.Table:
    """A deterministic pseudo-random sample: a document is in it when its key hashes below `rate`."""
    keys = np.asarray(batch.column("doc_key")).astype(np.uint64)
    with np.errstate(over="ignore"):
        u = ((keys * np.uint64(0x9E3779B97F4A7C15)) >> np.uint64(11)).astype(np.float64) / float(1 << 53)
    return batch.filter(pa.array(u < rate))


def _assign_cluster(batch: dict, centroids: np.ndarray) -> dict:
    emb = np.stack(batch["_embedding"]).astype(np.float32)
    return {"doc_key": batch["doc_key"], "_embedding": batch["_embedding"],
            "cluster": np.argmax(emb @ centroids.T, axis=1).astype(np.int64)}


def _cluster_pairs(group: dict, similarity: float) -> dict:
    from lmfoundry.data.dedup import semantic_pairs

    a, b = semantic_pairs(group["doc_key"], np.stack(group["_embedding"]).astype(np.float32), similarity)
    return {"a": a, "b": b}


def semantic_edges(cfg: CurateConfig, files: list[str], num_kept: int):
    """SemDeDup: k-means centroids fitted on a sample of the kept embeddings, every document
    assigned to its nearest centroid, pairs above the cosine threshold found inside each cluster
    (one Ray Data group per cluster)."""
    from ray.data.expressions import col
    from sklearn.cluster import KMeans

    sem = cfg.dedup.semantic
    docs = read_parquet_files(files, ["doc_key", "reason", "_embedding"]).filter(expr=col("reason") == KEPT) \
        .select_columns(["doc_key", "_embedding"])
    sample = docs.map_batches(hash_sample, fn_kwargs={"rate": min(1.0, sem.kmeans_sample / num_kept)},
                              batch_format="pyarrow").take_all()
    emb = np.stack([np.asarray(r["_embedding"], np.float32) for r in sample])
    k = min(sem.clusters, len(emb))
    centroids = KMeans(n_clusters=k, n_init=1, random_state=cfg.dedup.seed).fit(emb).cluster_centers_
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True) + 1e-12
    assigned = docs.map_batches(_assign_cluster, fn_kwargs={"centroids": centroids.astype(np.float32)},
                                batch_format="numpy")
    edges = assigned.groupby("cluster", num_partitions=max(1, min(k, 64))).map_groups(
        _cluster_pairs, fn_kwargs={"similarity": sem.similarity}, batch_format="numpy")
    for batch in edges.iter_batches(batch_format="numpy"):
        yield from zip(batch["a"].tolist(), batch["b"].tolist())


def _ids_of(files: list[str], keys: set[int], cfg: CurateConfig) -> dict[int, str]:
    """The ids of the given documents (the cluster representatives), read where they live."""
    wanted = np.array(sorted(keys), dtype=np.int64)
    out: dict[int, str] = {}
    for shard in np.unique(wanted >> SHARD_BITS).tolist():
        uri = storage.join(storage.normalize(cfg.output), WORK, "docs", shard_name(shard) + ".parquet")
        t = pq.read_table(io.BytesIO(storage.read_bytes(uri)), columns=["doc_key", cfg.id_field])
        t = t.filter(pc.is_in(t.column("doc_key"), pa.array(wanted[(wanted >> SHARD_BITS) == shard])))
        out.update(zip(t.column("doc_key").to_pylist(), t.column(cfg.id_field).to_pylist()))
    return out


# -- phase 3: write kept/ and rejected/ ---------------------------------------------------------

def finalize_shards(batch: dict, out: str, cfg_json: str) -> dict:
    cfg = CurateConfig.model_validate_json(cfg_json)
    dups = pq.read_table(io.BytesIO(storage.read_bytes(storage.join(out, WORK, "dedup", "duplicates.parquet"))))
    for i in batch["shard"].tolist():
        src = storage.join(out, WORK, "docs", shard_name(i) + ".parquet")
        name = shard_name(i)
        if storage.exists(src):
            t = pq.read_table(io.BytesIO(storage.read_bytes(src)))
            mine = dups.filter(pc.equal(dups.column("shard"), i))
            if mine.num_rows:
                lookup = dict(zip(mine.column("doc_key").to_pylist(),
                                  zip(mine.column("reason").to_pylist(), mine.column("duplicate_of").to_pylist())))
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
            _write_parquet_atomic(storage.join(out, "kept", name + ".parquet"), kept.select(public))
            if cfg.write_rejected:
                _write_parquet_atomic(storage.join(out, "rejected", name + ".parquet"), rejected.select(public))
            _write_parquet_atomic(storage.join(out, WORK, "signatures", name + ".parquet"),
                                  kept.select(["doc_key", "_signature"]))
            stats = shard_stats(t, cfg)
        else:
            stats = shard_stats(None, cfg)
        storage.write_json_atomic(storage.join(out, WORK, "final", name + ".json"), stats)
    return {"shard": batch["shard"]}


def run_finalize(cfg: CurateConfig, out: str, num_shards: int) -> None:
    import ray

    pending = _pending(out, "final", num_shards)
    if pending:
        ray.data.from_items([{"shard": i} for i in pending], override_num_blocks=len(pending)).map_batches(
            finalize_shards, fn_kwargs={"out": out, "cfg_json": cfg.model_dump_json()}, batch_size=1,
            num_cpus=1, compute=ray.data.TaskPoolStrategy(size=_workers(cfg, len(pending)))).take_all()


# -- the stage ----------------------------------------------------------------------------------

def _fingerprint(cfg: CurateConfig) -> dict:
    return json.loads(cfg.model_dump_json(exclude={"overwrite", "workers"}))


def prepare_run(cfg: CurateConfig, out: str) -> bool:
    """False when a committed output stands (skip); otherwise resume a killed run of the same
    config, or start afresh (a different config's partial output is removed, with a warning)."""
    if storage.is_committed(out) and not cfg.overwrite:
        return False
    settings = storage.join(out, WORK, "config.json")
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
    stats = [storage.read_json(storage.join(out, WORK, "final", shard_name(i) + ".json")) for i in range(len(shards))]
    report = build_report(cfg, out, stats, dedup_stats, timings, started)
    storage.commit(out, "curate", {"input": cfg.input, "format": fmt, "shards": len(shards), "report": "report.json",
                                   "kept": "kept", "rejected": "rejected" if cfg.write_rejected else None,
                                   "text_field": cfg.text_field, "id_field": cfg.id_field})
    logger.info("curate: kept %d of %d documents (%.1f%% of characters); rejected by reason %s",
                report["documents_kept"], report["documents_in"], 100 * report["chars_kept_fraction"],
                report["rejected_by_reason"])
    failed = [c["item"] for c in report["checklist"] if not c["passed"]]
    if cfg.checklist.enforce and failed:
        raise ChecklistFailed(f"the data-quality checklist failed: {', '.join(failed)} (see {out}/report.json)")
    return report


class ChecklistFailed(StageFailed):
    pass
