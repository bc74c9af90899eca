"""Dedup on Ray Data: exact and MinHash-fuzzy duplicates in one groupby over hash partitions of
the bucket keys, candidate pairs verified in a second groupby that brings each pair together with
its documents' texts (each shard read once), optional semantic dedup, clusters by union-find over
the duplicate edges. Writes `_work/dedup/duplicates.parquet`."""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from lmfoundry.data.documents import KEPT, SHARD_BITS
from lmfoundry.data.workdir import (
    doc_files,
    hash_sample,
    read_parquet,
    read_parquet_files,
    shard_name,
    work_path,
    write_parquet_atomic,
)
from lmfoundry.platform import storage
from lmfoundry.platform.log import get_logger

if TYPE_CHECKING:
    from lmfoundry.data.curate import CurateConfig

logger = get_logger(__name__)


def _partitions(num_docs: int, per_million: int) -> int:
    return max(1, min(512, -(-num_docs * per_million // 1_000_000)))


def bucket_rows(batch: pa.Table, partitions: int, exact: bool, fuzzy: bool) -> pa.Table:
    """One row per (document, bucket): its text hash (exact) and its LSH band keys (fuzzy), with
    the hash partition the row belongs to."""
    keys = batch.column("doc_key")
    parts = []
    if exact:
        parts.append(
            pa.table(
                {
                    "bucket": batch.column("_text_hash"),
                    "doc_key": keys,
                    "exact": pa.array(np.ones(batch.num_rows, bool)),
                }
            )
        )
    if fuzzy:
        parents = pc.list_parent_indices(batch.column("_buckets"))
        flat = pc.list_flatten(batch.column("_buckets"))
        parts.append(
            pa.table({"bucket": flat, "doc_key": pc.take(keys, parents), "exact": pa.array(np.zeros(len(flat), bool))})
        )
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


PAIRS_PER_PARTITION = 20_000  # candidate pairs verified by one map_groups call, about


def verification_plan(a: np.ndarray, b: np.ndarray) -> tuple[pa.Table, list[dict], int]:
    """The candidate pairs (a, b) spread over hash partitions: the pairs' rows (part, a, b) and,
    per shard, the candidate documents it must send and to which partitions (a document goes to
    each partition that holds one of its pairs, once). Each shard is then read once, however many
    other shards its documents pair with."""
    parts = max(1, min(512, -(-len(a) // PAIRS_PER_PARTITION)))
    mixed = (a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ b.astype(np.uint64)
    part = (mixed % np.uint64(parts)).astype(np.int64)
    pairs = pa.table({"part": part, "a": a, "b": b, "text": pa.nulls(len(a), pa.string())})
    sends = np.unique(np.stack([np.concatenate([a, b]), np.concatenate([part, part])], axis=1), axis=0)
    shards = sends[:, 0] >> SHARD_BITS
    items = [
        {"shard": int(s), "keys": sends[shards == s, 0].tolist(), "parts": sends[shards == s, 1].tolist()}
        for s in np.unique(shards)
    ]
    return pairs, items, parts


def candidate_texts(batch: dict, out: str, text_field: str) -> pa.Table:
    """One shard's candidate documents, a row (part, doc key as `a`, b = -1, text) for each
    partition that verifies one of its pairs."""
    shard, keys, parts = int(batch["shard"][0]), np.asarray(batch["keys"][0], np.int64), np.asarray(batch["parts"][0])
    t = read_parquet(work_path(out, "docs", shard_name(shard) + ".parquet"), ["doc_key", text_field])
    t = t.filter(pc.is_in(t.column("doc_key"), pa.array(np.unique(keys))))
    texts = pc.take(t.column(text_field), pc.index_in(pa.array(keys), t.column("doc_key")))
    return pa.table(
        {
            "part": pa.array(parts, pa.int64()),
            "a": pa.array(keys),
            "b": pa.array(np.full(len(keys), -1)),
            "text": texts.cast(pa.string()),
        }
    )


def verify_group(group: pa.Table, shingle_words: int, threshold: float) -> dict:
    """One partition: its pairs and the texts of their documents -> the pairs whose shingle
    sets have Jaccard similarity at or above the threshold."""
    from lmfoundry.data.dedup import jaccard, shingle_hashes

    is_text = pc.equal(group.column("b"), -1)
    texts, pairs = group.filter(is_text), group.filter(pc.invert(is_text))
    shingles = {
        k: shingle_hashes(v, shingle_words)
        for k, v in zip(texts.column("a").to_pylist(), texts.column("text").to_pylist())
    }
    a, b = np.asarray(pairs.column("a")), np.asarray(pairs.column("b"))
    ok = np.array([jaccard(shingles[x], shingles[y]) >= threshold for x, y in zip(a.tolist(), b.tolist())], bool)
    return {"a": a[ok], "b": b[ok]}


def verified_pairs(cfg: CurateConfig, out: str, a: np.ndarray, b: np.ndarray):
    """Batches of the candidate pairs that pass verification: every shard read once for the
    texts of its candidate documents, which a groupby brings together with their pairs."""
    import ray

    pairs, items, parts = verification_plan(a, b)
    texts = ray.data.from_items(items, override_num_blocks=len(items)).map_batches(
        candidate_texts, fn_kwargs={"out": out, "text_field": cfg.text_field}, batch_size=1, batch_format="numpy"
    )
    chunks = [pairs.slice(i, PAIRS_PER_PARTITION) for i in range(0, pairs.num_rows, PAIRS_PER_PARTITION)]
    grouped = (
        texts.union(ray.data.from_arrow(chunks))
        .groupby("part", num_partitions=parts)
        .map_groups(
            verify_group,
            fn_kwargs={"shingle_words": cfg.dedup.shingle_words, "threshold": cfg.dedup.jaccard_threshold},
            batch_format="pyarrow",
        )
    )
    return grouped.iter_batches(batch_format="numpy")


def run_dedup(cfg: CurateConfig, out: str, num_shards: int) -> dict:
    """Exact and fuzzy duplicates in one Ray Data groupby over hash partitions of the buckets;
    candidate pairs verified by true Jaccard (verified_pairs); clusters by union-find over the
    duplicate edges.
    Writes `_work/dedup/duplicates.parquet`: (shard, doc_key, reason, duplicate_of)."""
    import ray
    from ray.data.context import ShuffleStrategy
    from ray.data.expressions import col

    from lmfoundry.data.dedup import UnionFind

    marker = work_path(out, "dedup", "_DONE.json")
    if storage.exists(marker):
        logger.info("curate: dedup already done; resuming after it")
        return storage.read_json(marker)
    started = time.time()
    files = doc_files(out, num_shards)
    num_kept = sum(
        storage.read_json(work_path(out, "docs", shard_name(i) + ".json")).get("kept", 0) for i in range(num_shards)
    )
    parts = _partitions(num_kept, cfg.dedup.partitions_per_million)
    stats = {
        "kept_before_dedup": num_kept,
        "partitions": parts,
        "exact_duplicates": 0,
        "candidate_pairs": 0,
        "verified_pairs": 0,
        "near_duplicates": 0,
    }
    uf, exact_dups, near_linked = UnionFind(), set(), set()
    if files and num_kept and (cfg.dedup.exact or cfg.dedup.fuzzy):
        # The sort-based shuffle runs on tasks, which reuse warm workers; the hash shuffle starts
        # a set of aggregator actors for every groupby (seconds each on a small cluster).
        ray.data.DataContext.get_current().shuffle_strategy = ShuffleStrategy.SORT_SHUFFLE_PULL_BASED
        kept = read_parquet_files(files, ["doc_key", "reason", "_text_hash", "_buckets"]).filter(
            expr=col("reason") == KEPT
        )
        rows = kept.map_batches(
            bucket_rows,
            fn_kwargs={"partitions": parts, "exact": cfg.dedup.exact, "fuzzy": cfg.dedup.fuzzy},
            batch_format="pyarrow",
        )
        fuzzy_pairs: set[tuple[int, int]] = set()
        grouped = rows.groupby("part", num_partitions=parts).map_groups(bucket_group, batch_format="numpy")
        for batch in grouped.iter_batches(batch_format="numpy"):
            for a, b, is_exact in zip(batch["a"].tolist(), batch["b"].tolist(), batch["exact"].tolist()):
                if is_exact:
                    uf.union(a, b)
                    exact_dups.add(b)
                else:  # the same pair can share buckets in several bands, in several partitions
                    fuzzy_pairs.add((a, b))
        # exact pairs need no verification
        candidates = sorted((a, b) for a, b in fuzzy_pairs if b not in exact_dups or uf.find(a) != uf.find(b))
        stats["candidate_pairs"] = len(candidates)
        if candidates:
            a, b = (np.array(side, np.int64) for side in zip(*candidates))
            for batch in verified_pairs(cfg, out, a, b):
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
    names = _ids_of(out, {rep for rep in dups.values()}, cfg.id_field) if dups else {}
    keys = np.array(sorted(dups), dtype=np.int64)
    reasons = [
        "exact_duplicate" if k in exact_dups else "near_duplicate" if k in near_linked else "semantic_duplicate"
        for k in keys.tolist()
    ]
    for kind in ("exact", "near", "semantic"):
        stats[f"{kind}_duplicates"] = reasons.count(f"{kind}_duplicate")
    table = pa.table(
        {
            "shard": pa.array(keys >> SHARD_BITS, pa.int64()),
            "doc_key": pa.array(keys, pa.int64()),
            "reason": pa.array(reasons, pa.string()),
            "duplicate_of": pa.array([names[dups[k]] for k in keys.tolist()], pa.string()),
        }
    )
    write_parquet_atomic(work_path(out, "dedup", "duplicates.parquet"), table)
    stats["seconds"] = round(time.time() - started, 2)
    storage.write_json_atomic(marker, stats)
    logger.info("curate: dedup: %s", stats)
    return stats


def _assign_cluster(batch: dict, centroids: np.ndarray) -> dict:
    emb = np.stack(batch["_embedding"]).astype(np.float32)
    return {
        "doc_key": batch["doc_key"],
        "_embedding": batch["_embedding"],
        "cluster": np.argmax(emb @ centroids.T, axis=1).astype(np.int64),
    }


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
    docs = (
        read_parquet_files(files, ["doc_key", "reason", "_embedding"])
        .filter(expr=col("reason") == KEPT)
        .select_columns(["doc_key", "_embedding"])
    )
    sample = docs.map_batches(
        hash_sample, fn_kwargs={"rate": min(1.0, sem.kmeans_sample / num_kept)}, batch_format="pyarrow"
    ).take_all()
    emb = np.stack([np.asarray(r["_embedding"], np.float32) for r in sample])
    k = min(sem.clusters, len(emb))
    centroids = KMeans(n_clusters=k, n_init=1, random_state=cfg.dedup.seed).fit(emb).cluster_centers_
    centroids /= np.linalg.norm(centroids, axis=1, keepdims=True) + 1e-12
    assigned = docs.map_batches(
        _assign_cluster, fn_kwargs={"centroids": centroids.astype(np.float32)}, batch_format="numpy"
    )
    edges = assigned.groupby("cluster", num_partitions=max(1, min(k, 64))).map_groups(
        _cluster_pairs, fn_kwargs={"similarity": sem.similarity}, batch_format="numpy"
    )
    for batch in edges.iter_batches(batch_format="numpy"):
        yield from zip(batch["a"].tolist(), batch["b"].tolist())


def _ids_of(out: str, keys: set[int], id_field: str) -> dict[int, str]:
    """The ids of the given documents (the cluster representatives), read where they live."""
    wanted = np.array(sorted(keys), dtype=np.int64)
    found: dict[int, str] = {}
    for shard in np.unique(wanted >> SHARD_BITS).tolist():
        t = read_parquet(work_path(out, "docs", shard_name(shard) + ".parquet"), ["doc_key", id_field])
        t = t.filter(pc.is_in(t.column("doc_key"), pa.array(wanted[(wanted >> SHARD_BITS) == shard])))
        found.update(zip(t.column("doc_key").to_pylist(), t.column(id_field).to_pylist()))
    return found
