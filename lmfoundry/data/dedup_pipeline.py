"""Dedup on Ray Data: exact and MinHash-fuzzy duplicates in one groupby over hash partitions of
the bucket keys, candidate pairs verified in a second groupby that brings each pair together with
its documents' texts (each shard read once), optional semantic dedup, clusters by a distributed
connected-components pass over the duplicate edges (data/components.py). Nothing per document or
per pair passes through the driver. Writes `_work/dedup/duplicates/shard-N.parquet`."""

from __future__ import annotations

import contextlib
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
    the document's text hash and the hash partition the row belongs to."""
    keys, hashes = batch.column("doc_key"), batch.column("_text_hash")
    parts = []
    if exact:
        parts.append(
            pa.table(
                {
                    "bucket": hashes,
                    "doc_key": keys,
                    "text_hash": hashes,
                    "exact": pa.array(np.ones(batch.num_rows, bool)),
                }
            )
        )
    if fuzzy:
        parents = pc.list_parent_indices(batch.column("_buckets"))
        flat = pc.list_flatten(batch.column("_buckets"))
        parts.append(
            pa.table(
                {
                    "bucket": flat,
                    "doc_key": pc.take(keys, parents),
                    "text_hash": pc.take(hashes, parents),
                    "exact": pa.array(np.zeros(len(flat), bool)),
                }
            )
        )
    rows = pa.concat_tables(parts)
    part = np.asarray(rows.column("bucket")) % np.uint64(partitions)
    return rows.append_column("part", pa.array(part.astype(np.int64)))


def bucket_group(group: dict, exact: bool) -> dict:
    """One hash partition of buckets -> candidate edges (a < b), exact ones marked. With exact
    dedup on, a fuzzy pair of two documents with the same text is left out: the exact edges
    already join them, and it needs no verification."""
    from lmfoundry.data.dedup import star_edges

    out = {"a": [], "b": [], "exact": []}
    for flag in (True, False):
        sel = group["exact"] == flag
        a, b = star_edges(group["bucket"][sel], group["doc_key"][sel])
        if not flag and exact and len(a):
            docs, first = np.unique(group["doc_key"][sel], return_index=True)
            hashes = group["text_hash"][sel][first]
            differ = hashes[np.searchsorted(docs, a)] != hashes[np.searchsorted(docs, b)]
            a, b = a[differ], b[differ]
        out["a"].append(a)
        out["b"].append(b)
        out["exact"].append(np.full(len(a), flag))
    return {k: np.concatenate(v) for k, v in out.items()}


PAIRS_PER_PARTITION = 20_000  # candidate pairs verified by one map_groups call, about


def pair_rows(batch: pa.Table, partitions: int) -> pa.Table:
    """Candidate pairs as rows (part, a, b, no text), the partition a hash of the pair: the same
    pair found in several buckets lands in one partition, which verifies it once."""
    a, b = np.asarray(batch.column("a"), np.int64), np.asarray(batch.column("b"), np.int64)
    mixed = (a.astype(np.uint64) * np.uint64(0x9E3779B97F4A7C15)) ^ b.astype(np.uint64)
    part = (mixed % np.uint64(partitions)).astype(np.int64)
    return pa.table({"part": part, "a": a, "b": b, "text": pa.nulls(len(a), pa.string())})


def send_rows(batch: pa.Table) -> pa.Table:
    """For each pair, its two documents, each addressed to the pair's partition, by shard."""
    keys = np.concatenate([np.asarray(batch.column("a")), np.asarray(batch.column("b"))])
    parts = np.concatenate([np.asarray(batch.column("part"))] * 2)
    return pa.table({"shard": keys >> SHARD_BITS, "key": keys, "part": parts})


def candidate_texts(group: pa.Table, out: str, text_field: str) -> pa.Table:
    """One shard's candidate documents (the shard read once): a row (part, doc key as `a`,
    b = -1, text) for each partition that verifies one of its pairs, once per partition however
    many pairs there it is in."""
    shard = int(group.column("shard")[0].as_py())
    sends = np.unique(np.stack([np.asarray(group.column("key")), np.asarray(group.column("part"))], axis=1), axis=0)
    keys, parts = sends[:, 0], sends[:, 1]
    t = read_parquet(work_path(out, "docs", shard_name(shard) + ".parquet"), ["doc_key", text_field])
    t = t.filter(pc.is_in(t.column("doc_key"), pa.array(np.unique(keys))))
    texts = pc.take(t.column(text_field), pc.index_in(pa.array(keys), t.column("doc_key")))
    return pa.table(
        {
            "part": pa.array(parts, pa.int64()),
            "a": pa.array(keys, pa.int64()),
            "b": pa.array(np.full(len(keys), -1), pa.int64()),
            "text": texts.cast(pa.string()),
        }
    )


def verify_group(group: pa.Table, shingle_words: int, threshold: float) -> dict:
    """One partition: its pairs and the texts of their documents -> each distinct pair, `ok` when
    its shingle sets have Jaccard similarity at or above the threshold."""
    from lmfoundry.data.dedup import jaccard, shingle_hashes

    is_text = pc.equal(group.column("b"), -1)
    texts, pairs = group.filter(is_text), group.filter(pc.invert(is_text))
    shingles = {
        k: shingle_hashes(v, shingle_words)
        for k, v in zip(texts.column("a").to_pylist(), texts.column("text").to_pylist())
    }
    ab = np.stack([np.asarray(pairs.column("a")), np.asarray(pairs.column("b"))], axis=1)
    ab = np.unique(ab, axis=0) if len(ab) else np.zeros((0, 2), np.int64)
    a, b = ab[:, 0], ab[:, 1]
    ok = np.array([jaccard(shingles[x], shingles[y]) >= threshold for x, y in zip(a.tolist(), b.tolist())], bool)
    return {"a": a, "b": b, "ok": ok}


def verified_pairs(cfg: CurateConfig, out: str, fuzzy):
    """The candidate pairs (a dataset), each verified once: every shard read once for the texts
    of its candidate documents, which a groupby brings together with their pairs. Returns a
    materialised dataset (a, b, ok) of the distinct pairs."""
    parts = max(1, min(512, -(-fuzzy.count() // PAIRS_PER_PARTITION)))
    pairs = fuzzy.map_batches(pair_rows, fn_kwargs={"partitions": parts}, batch_format="pyarrow").materialize()
    texts = (
        pairs.map_batches(send_rows, batch_format="pyarrow")
        .groupby("shard")
        .map_groups(candidate_texts, fn_kwargs={"out": out, "text_field": cfg.text_field}, batch_format="pyarrow")
    )
    return (
        texts.union(pairs)
        .groupby("part", num_partitions=parts)
        .map_groups(
            verify_group,
            fn_kwargs={"shingle_words": cfg.dedup.shingle_words, "threshold": cfg.dedup.jaccard_threshold},
            batch_format="pyarrow",
        )
        .materialize()
    )


EXACT, NEAR = 1, 2  # marks on a document: an exact edge's later end, an end of a verified pair


def marks(batch: dict, mark: int, ends: tuple[str, ...]) -> pa.Table:
    nodes = np.concatenate([np.asarray(batch[e], np.int64) for e in ends])
    return pa.table(
        {"node": nodes, "name": pa.nulls(len(nodes), pa.string()), "mark": np.full(len(nodes), mark, np.int64)}
    )


def root_names(group: pa.Table, out: str, id_field: str) -> pa.Table:
    """One shard's cluster representatives (the shard read once) -> (member, the representative's
    id) for every member of their clusters."""
    roots = np.asarray(group.column("b"), np.int64)
    t = read_parquet(
        work_path(out, "docs", shard_name(int(roots[0] >> SHARD_BITS)) + ".parquet"), ["doc_key", id_field]
    )
    t = t.filter(pc.is_in(t.column("doc_key"), pa.array(np.unique(roots))))
    names = pc.take(t.column(id_field), pc.index_in(pa.array(roots), t.column("doc_key"))).cast(pa.string())
    return pa.table({"node": group.column("a"), "name": names, "mark": pa.array(np.zeros(len(roots), np.int64))})


def write_duplicates(group: pa.Table, out: str) -> dict:
    """One shard's duplicates: its members of a cluster with their representative's id and their
    marks -> `_work/dedup/duplicates/shard-N.parquet` (doc_key, reason, duplicate_of); returns the
    shard's counts by reason."""
    nodes, names, mark = (group.column(c).to_pylist() for c in ("node", "name", "mark"))
    shard = int(nodes[0]) >> SHARD_BITS
    dup_of: dict[int, str] = {}
    marked: dict[int, set[int]] = {}
    for node, name, m in zip(nodes, names, mark):
        if m:
            marked.setdefault(node, set()).add(m)
        else:
            dup_of[node] = name
    keys = sorted(dup_of)
    reasons = [
        "exact_duplicate"
        if EXACT in marked.get(k, ())
        else "near_duplicate"
        if NEAR in marked.get(k, ())
        else "semantic_duplicate"
        for k in keys
    ]
    if keys:
        table = pa.table(
            {
                "doc_key": pa.array(keys, pa.int64()),
                "reason": pa.array(reasons, pa.string()),
                "duplicate_of": pa.array([dup_of[k] for k in keys], pa.string()),
            }
        )
        write_parquet_atomic(duplicates_path(out, shard), table)
    return {
        "shard": [shard],
        **{f"{kind}_duplicates": [reasons.count(f"{kind}_duplicate")] for kind in ("exact", "near", "semantic")},
    }


def duplicates_path(out: str, shard: int) -> str:
    return work_path(out, "dedup", f"duplicates/{shard_name(shard)}.parquet")


def _exact_or_not(batch: dict, exact: bool) -> dict:
    keep = np.asarray(batch["exact"], bool) == exact
    return {k: np.asarray(v)[keep] for k, v in batch.items()}


def _edge_columns(batch: dict) -> dict:
    return {"a": np.asarray(batch["a"], np.int64), "b": np.asarray(batch["b"], np.int64)}


def _ok(batch: dict) -> dict:
    return {"a": batch["a"][batch["ok"]], "b": batch["b"][batch["ok"]]}


def _shard_of_root(batch: dict) -> dict:
    return {**batch, "rshard": np.asarray(batch["b"], np.int64) >> SHARD_BITS}


def _shard_of_node(batch: pa.Table) -> pa.Table:
    return batch.append_column("shard", pa.array(np.asarray(batch.column("node"), np.int64) >> SHARD_BITS))


def run_dedup(cfg: CurateConfig, out: str, num_shards: int) -> dict:
    """Exact and fuzzy duplicates in one Ray Data groupby over hash partitions of the buckets;
    candidate pairs verified by true Jaccard (verified_pairs); clusters by connected components
    on the cluster (data/components.py). The driver holds counts only, nothing per document or
    per pair. Writes `_work/dedup/duplicates/shard-N.parquet`: (doc_key, reason, duplicate_of)."""
    marker = work_path(out, "dedup", "_DONE.json")
    if storage.exists(marker):
        logger.info("curate: dedup already done; resuming after it")
        return storage.read_json(marker)
    storage.remove_dir(work_path(out, "dedup", "duplicates"))  # what a run cut short wrote
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
    with shuffle_strategy(cfg.dedup.shuffle, parts):
        stats.update(find_and_write_duplicates(cfg, out, files, num_kept, parts, stats))
    stats["seconds"] = round(time.time() - started, 2)
    storage.write_json_atomic(marker, stats)
    logger.info("curate: dedup: %s", stats)
    return stats


@contextlib.contextmanager
def shuffle_strategy(name: str, partitions: int):
    """Ray Data's shuffle for the groupbys inside, and the previous one back afterwards.

    sort: the sort-based shuffle, on tasks that reuse warm workers. The driver owns every piece
    of every shuffle (partitions x blocks of them), so its memory grows with the corpus.
    v2: Ray's shuffle v2, map and reduce tasks whose pieces the driver does not hold: its memory
    stayed within 2 MiB of its start up to a million documents. Every groupby gets `partitions`,
    those that name no count too (v2's default of 200 is seconds of empty tasks on a small
    corpus). benchmarks/dedup_memory.py runs both."""
    import ray
    from ray.data.context import ShuffleStrategy

    context = ray.data.DataContext.get_current()
    saved = context.shuffle_strategy, context.default_hash_shuffle_parallelism
    strategy = {"sort": ShuffleStrategy.SORT_SHUFFLE_PULL_BASED, "v2": ShuffleStrategy.SHUFFLE_V2}[name]
    context.shuffle_strategy = strategy
    context.default_hash_shuffle_parallelism = partitions
    try:
        yield
    finally:
        context.shuffle_strategy, context.default_hash_shuffle_parallelism = saved


def find_and_write_duplicates(
    cfg: CurateConfig, out: str, files: list[str], num_kept: int, parts: int, stats: dict
) -> dict:
    """The duplicates' edges, their clusters, and each shard's duplicates written; returns the
    counts by reason (and fills the pair counts into `stats`)."""
    from ray.data.expressions import col

    from lmfoundry.data.components import connected_components

    edges, marked = [], []
    if files and num_kept and (cfg.dedup.exact or cfg.dedup.fuzzy):
        kept = read_parquet_files(files, ["doc_key", "reason", "_text_hash", "_buckets"]).filter(
            expr=col("reason") == KEPT
        )
        rows = kept.map_batches(
            bucket_rows,
            fn_kwargs={"partitions": parts, "exact": cfg.dedup.exact, "fuzzy": cfg.dedup.fuzzy},
            batch_format="pyarrow",
        )
        candidates = (
            rows.groupby("part", num_partitions=parts)
            .map_groups(bucket_group, fn_kwargs={"exact": cfg.dedup.exact}, batch_format="numpy")
            .materialize()
        )
        exact = candidates.map_batches(_exact_or_not, fn_args=(True,), batch_format="numpy")
        edges.append(exact.map_batches(_edge_columns, batch_format="numpy"))
        marked.append(exact.map_batches(marks, fn_args=(EXACT, ("b",)), batch_format="numpy"))
        fuzzy = candidates.map_batches(_exact_or_not, fn_args=(False,), batch_format="numpy")
        if fuzzy.count():
            checked = verified_pairs(cfg, out, fuzzy)
            stats["candidate_pairs"] = checked.count()
            verified = checked.map_batches(_ok, batch_format="numpy").materialize()
            stats["verified_pairs"] = verified.count()
            edges.append(verified)
            marked.append(verified.map_batches(marks, fn_args=(NEAR, ("a", "b")), batch_format="numpy"))
    if files and num_kept > 1 and cfg.dedup.semantic.enabled:
        semantic = semantic_edges(cfg, files, num_kept).materialize()
        stats["semantic_pairs"] = semantic.count()
        edges.append(semantic)
    counts = {f"{kind}_duplicates": 0 for kind in ("exact", "near", "semantic")}
    if sum(e.count() for e in edges):
        members = connected_components(edges[0].union(*edges[1:]) if len(edges) > 1 else edges[0], parts)
        named = (
            members.map_batches(_shard_of_root, batch_format="numpy")
            .groupby("rshard")
            .map_groups(root_names, fn_kwargs={"out": out, "id_field": cfg.id_field}, batch_format="pyarrow")
        )
        written = (
            named.union(*marked)
            .map_batches(_shard_of_node, batch_format="pyarrow")
            .groupby("shard")
            .map_groups(write_duplicates, fn_kwargs={"out": out}, batch_format="pyarrow")
        )
        for row in written.iter_rows():  # a row a shard
            for key in counts:
                counts[key] += int(row[key])
    return counts


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
    (one Ray Data group per cluster). Returns the dataset of pairs (a, b)."""
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
    return assigned.groupby("cluster", num_partitions=max(1, min(k, 64))).map_groups(
        _cluster_pairs, fn_kwargs={"similarity": sem.similarity}, batch_format="numpy"
    )
