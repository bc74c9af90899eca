"""Exact and fuzzy deduplication.

Fuzzy dedup is MinHash LSH (Broder 1997; the scheme of datatrove, NeMo Curator and text-dedup):
documents become sets of word 5-gram shingles; `num_bands x rows_per_band` min-hashes give a
signature; documents that agree on every row of any band share a bucket and become candidate
pairs; each candidate pair is verified by the true Jaccard similarity of the shingle sets; verified
pairs join duplicate clusters by connected components; the smallest id of a cluster stays.

The plain functions here run without Ray. `curate.py` wires them into Ray Data: bucket rows are
grouped by a hash partition (so a group is a bounded slice of the buckets, never the corpus),
candidate pairs are verified grouped by the pair of shards they come from (so a task reads two
shards, never the corpus), and only the verified duplicate edges reach the driver for the
connected components.

With the defaults (16 bands of 6 rows) a pair at Jaccard 0.8 becomes a candidate with probability
1 - (1 - 0.8^6)^16 = 0.992, at 0.7 with 0.87, at 0.5 with 0.22 (those are then refused by the
verification), so recall at the 0.8 threshold is bounded by the banding, precision by nothing.
"""

from __future__ import annotations

import re
from typing import Literal

import numpy as np
import xxhash
from pydantic import Field, model_validator

from lmfoundry.platform.config import StageConfig

_WORDS = re.compile(r"\w+", re.UNICODE)
_MERSENNE = np.uint64((1 << 61) - 1)
_MASK32 = np.uint64(0xFFFFFFFF)
_MIX = np.uint64(0x9E3779B97F4A7C15)  # 2^64 / golden ratio, odd: mixes word hashes into a shingle hash


class SemanticDedupConfig(StageConfig):
    """SemDeDup (Abbas et al. 2023): all-MiniLM-L6-v2 embeddings, k-means, and within each cluster
    the pairs above a cosine similarity are duplicates. Off by default: embedding every document
    costs more than every other stage together on CPU."""

    enabled: bool = False
    clusters: int = Field(100, ge=1, description="k-means clusters (capped by the sample size)")
    similarity: float = Field(0.95, gt=0, le=1, description="cosine similarity at or above: duplicates")
    kmeans_sample: int = Field(50_000, ge=10, description="kept documents the centroids are fitted on")


class DedupConfig(StageConfig):
    exact: bool = True
    fuzzy: bool = True
    shingle_words: int = Field(5, ge=1)
    num_bands: int = Field(16, ge=1)
    rows_per_band: int = Field(6, ge=1)
    jaccard_threshold: float = Field(0.8, gt=0, le=1)
    seed: int = 42
    # Bucket rows are grouped into this many hash partitions per million documents.
    partitions_per_million: int = Field(64, ge=1)
    shuffle: Literal["sort", "v2"] = Field(
        "sort",
        description="Ray Data's shuffle for the dedup groupbys: 'sort' (sort-based; the driver holds a record "
        "of every piece of every shuffle, so its memory grows with the corpus) or 'v2' (Ray's shuffle v2; the "
        "driver holds none, slower on a small machine); benchmarks/dedup_memory.py measures both",
    )
    semantic: SemanticDedupConfig = SemanticDedupConfig()

    @model_validator(mode="after")
    def _enough_perms(self):
        if self.num_bands * self.rows_per_band > 1024:
            raise ValueError("num_bands * rows_per_band must be at most 1024 min-hashes")
        return self

    @property
    def num_perm(self) -> int:
        return self.num_bands * self.rows_per_band


def shingle_hashes(text: str, k: int) -> np.ndarray:
    """The distinct 32-bit hashes of the document's word k-grams (lower-cased, punctuation
    dropped); a document shorter than k words is one shingle."""
    words = _WORDS.findall(text.lower())
    if not words:
        return np.zeros(0, dtype=np.uint64)
    w = np.fromiter((xxhash.xxh3_64_intdigest(x.encode()) for x in words), dtype=np.uint64, count=len(words))
    n = max(len(w) - k + 1, 1)
    h = w[:n].copy()
    with np.errstate(over="ignore"):
        for j in range(1, min(k, len(w))):
            h = h * _MIX + w[j : j + n]
    return np.unique(h >> np.uint64(32))


def jaccard(a: np.ndarray, b: np.ndarray) -> float:
    if len(a) == 0 and len(b) == 0:
        return 1.0
    inter = len(np.intersect1d(a, b, assume_unique=True))
    return inter / (len(a) + len(b) - inter)


def exact_key(text: str) -> int:
    """The exact-duplicate key of a text: xxh3-64 of its normalised form (normalize.py: NFC,
    control characters, whitespace). Curation groups documents by the same hash of the text it
    normalised; texts from elsewhere (a teacher's answers) are normalised here first."""
    from lmfoundry.data.normalize import normalize_text

    return xxhash.xxh3_64_intdigest(normalize_text(text, drop_boilerplate=False)[0].encode())


class MinHasher:
    """Signatures and LSH band buckets for texts."""

    def __init__(self, cfg: DedupConfig):
        self.cfg = cfg
        rng = np.random.default_rng(cfg.seed)
        self.a = rng.integers(1, int(_MERSENNE), size=cfg.num_perm, dtype=np.uint64)
        self.b = rng.integers(0, int(_MERSENNE), size=cfg.num_perm, dtype=np.uint64)
        # Per band, odd multipliers that fold its rows into one 64-bit bucket key.
        self.fold = rng.integers(1, 1 << 62, size=cfg.rows_per_band, dtype=np.uint64) | np.uint64(1)

    def signature(self, shingles: np.ndarray) -> np.ndarray:
        if len(shingles) == 0:
            return np.full(self.cfg.num_perm, 0xFFFFFFFF, dtype=np.uint32)
        with np.errstate(over="ignore"):
            hv = (shingles[:, None] * self.a + self.b) % _MERSENNE & _MASK32
        return hv.min(axis=0).astype(np.uint32)

    def buckets(self, signature: np.ndarray) -> np.ndarray:
        """One 64-bit key per band; the band's index is folded in so bands never collide."""
        rows = signature.astype(np.uint64).reshape(self.cfg.num_bands, self.cfg.rows_per_band)
        with np.errstate(over="ignore"):
            keys = (rows * self.fold).sum(axis=1) * _MIX + np.arange(self.cfg.num_bands, dtype=np.uint64)
        return keys

    def __call__(self, texts: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """Signatures (n, num_perm) uint32 and bucket keys (n, num_bands) uint64."""
        sigs = (
            np.stack([self.signature(shingle_hashes(t, self.cfg.shingle_words)) for t in texts])
            if texts
            else np.zeros((0, self.cfg.num_perm), dtype=np.uint32)
        )
        keys = np.stack([self.buckets(s) for s in sigs]) if texts else np.zeros((0, self.cfg.num_bands), np.uint64)
        return sigs, keys


def star_edges(bucket_keys: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Given rows (bucket key, doc index), the candidate edges of every bucket with two or more
    documents, as a star from the bucket's smallest doc index to each other member."""
    order = np.lexsort((ids, bucket_keys))
    keys, docs = bucket_keys[order], ids[order]
    if len(keys) < 2:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    starts = np.flatnonzero(np.r_[True, keys[1:] != keys[:-1]])
    head = np.repeat(docs[starts], np.diff(np.r_[starts, len(keys)]))
    member = docs != head
    pairs = (
        np.unique(np.stack([head[member], docs[member]], axis=1), axis=0)
        if member.any()
        else np.zeros((0, 2), np.int64)
    )
    return pairs[:, 0], pairs[:, 1]


class UnionFind:
    """Connected components over string ids; the representative is the smallest id."""

    def __init__(self):
        self.parent: dict[str, str] = {}

    def find(self, x: str) -> str:
        parent = self.parent
        root = x
        while parent.get(root, root) != root:
            root = parent[root]
        while parent.get(x, x) != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self.find(a), self.find(b)
        if ra != rb:
            lo, hi = (ra, rb) if ra < rb else (rb, ra)
            self.parent[hi] = lo
            self.parent.setdefault(lo, lo)

    def duplicates(self) -> dict[str, str]:
        """Every non-representative member -> its cluster's representative."""
        return {x: r for x in list(self.parent) if (r := self.find(x)) != x}


def cluster_in_process(texts: list[str], cfg: DedupConfig) -> UnionFind:
    """The steps the curation pipeline runs on Ray Data, in one process: signatures, band buckets,
    candidate edges, Jaccard verification, union-find. For tests, benchmarks and small corpora."""
    _, keys = MinHasher(cfg)(texts)
    ids = np.repeat(np.arange(len(texts)), cfg.num_bands)
    a, b = star_edges(keys.ravel(), ids)
    shingles = [shingle_hashes(t, cfg.shingle_words) for t in texts]
    uf = UnionFind()
    for x, y in set(zip(a.tolist(), b.tolist())):
        if jaccard(shingles[x], shingles[y]) >= cfg.jaccard_threshold:
            uf.union(x, y)
    return uf


def planted_scores(texts: list[str], truth: dict[tuple[int, int], float], uf: UnionFind, threshold: float) -> dict:
    """Recall and precision of clusters against planted pairs with known Jaccard: per pair (every
    pair at or above the threshold ends in one cluster) and per document (a document is removed -
    sits in a cluster with another - exactly when it has a partner at or above the threshold)."""
    cluster = [uf.find(i) for i in range(len(texts))]
    true_pairs = {p for p, j in truth.items() if j >= threshold}
    sizes: dict[int, int] = {}
    for c in cluster:
        sizes[c] = sizes.get(c, 0) + 1
    predicted = {i for i in range(len(texts)) if sizes[cluster[i]] > 1}
    actual = {i for p in true_pairs for i in p}
    hit = len(predicted & actual)
    return {
        "true_pairs": len(true_pairs),
        "pair_recall": sum(cluster[x] == cluster[y] for x, y in true_pairs) / max(len(true_pairs), 1),
        "document_recall": hit / max(len(actual), 1),
        "document_precision": hit / max(len(predicted), 1),
    }


def semantic_pairs(
    keys: np.ndarray, embeddings: np.ndarray, similarity: float, block: int = 2048
) -> tuple[np.ndarray, np.ndarray]:
    """Pairs (a < b) of one k-means cluster whose unit embeddings have cosine >= similarity;
    the similarity matrix is built a block of rows at a time, so memory stays block x n."""
    order = np.argsort(keys)
    keys, emb = keys[order], embeddings[order]
    out_a, out_b = [], []
    for start in range(0, len(keys), block):
        sims = emb[start : start + block] @ emb.T
        rows, cols = np.nonzero(sims >= similarity)
        rows += start
        upper = cols > rows
        out_a.append(keys[rows[upper]])
        out_b.append(keys[cols[upper]])
    if not out_a:
        return np.zeros(0, np.int64), np.zeros(0, np.int64)
    return np.concatenate(out_a), np.concatenate(out_b)
