"""MinHash LSH dedup without Ray: signatures, buckets, candidate edges, verification, clusters,
and recall / precision on planted near duplicates."""

import itertools

import numpy as np
import pytest

from lmfoundry.data.dedup import (
    DedupConfig,
    MinHasher,
    UnionFind,
    cluster_in_process,
    jaccard,
    planted_scores,
    shingle_hashes,
    star_edges,
)
from lmfoundry.data.sample_corpus import planted_duplicates


def test_shingles_ignore_case_and_punctuation_and_jaccard_is_exact():
    a = shingle_hashes("The cat sat on the mat, and then it slept.", 3)
    b = shingle_hashes("the cat sat on the mat and then it slept", 3)
    assert np.array_equal(a, b) and len(a) == 8
    c = shingle_hashes("the cat sat on the mat and then it ran", 3)
    assert jaccard(a, c) == pytest.approx(7 / 9)
    assert len(shingle_hashes("too short", 5)) == 1 and len(shingle_hashes("", 5)) == 0


def test_signature_agreement_estimates_jaccard():
    texts, _, truth = planted_duplicates(20, copies=2, seed=3)
    mh = MinHasher(DedupConfig(num_bands=32, rows_per_band=8))
    sigs, keys = mh(texts)
    assert sigs.shape == (len(texts), 256) and keys.shape == (len(texts), 32)
    err = [abs((sigs[a] == sigs[b]).mean() - j) for (a, b), j in truth.items()]
    assert np.mean(err) < 0.05


def test_star_edges_connect_each_bucket_to_its_smallest_member():
    keys = np.array([7, 7, 7, 9, 3, 3], dtype=np.uint64)
    ids = np.array([12, 5, 9, 1, 4, 2], dtype=np.int64)
    a, b = star_edges(keys, ids)
    assert sorted(zip(a.tolist(), b.tolist())) == [(2, 4), (5, 9), (5, 12)]


def test_union_find_keeps_the_smallest_id():
    uf = UnionFind()
    for x, y in [(5, 9), (9, 12), (2, 4), (12, 1)]:
        uf.union(x, y)
    assert uf.duplicates() == {5: 1, 9: 1, 12: 1, 4: 2}


def test_planted_near_duplicates_found_with_high_recall_and_precision():
    texts, groups, truth = planted_duplicates(60, copies=3, seed=0)
    uf = cluster_in_process(texts, DedupConfig())
    scores = planted_scores(texts, truth, uf, 0.8)
    assert scores["true_pairs"] > 50
    assert scores["pair_recall"] >= 0.95 and scores["document_recall"] >= 0.95, scores
    assert scores["document_precision"] >= 0.98, scores
    # nothing across groups: unrelated documents are never merged
    cluster = [uf.find(i) for i in range(len(texts))]
    assert all(
        groups[x] == groups[y] for x, y in itertools.combinations(range(len(texts)), 2) if cluster[x] == cluster[y]
    )


def test_dedup_config_is_checked():
    with pytest.raises(ValueError, match="at most 1024"):
        DedupConfig(num_bands=100, rows_per_band=20)


def test_verification_sends_each_document_once_to_each_partition_that_checks_one_of_its_pairs():
    """The plan behind the distributed verification: every pair's partition receives the texts
    of both its documents, each shard is asked only for its own documents, and a document that
    pairs with many others is sent once per partition, not once per pair."""
    from lmfoundry.data.dedup_pipeline import PAIRS_PER_PARTITION, verification_plan
    from lmfoundry.data.documents import SHARD_BITS

    rng = np.random.default_rng(0)
    docs = (rng.integers(0, 40, 5000) << SHARD_BITS) | rng.integers(0, 300, 5000)
    a, b = np.unique(np.sort(rng.choice(np.unique(docs), (3 * PAIRS_PER_PARTITION, 2)), axis=1), axis=0).T
    a, b = a[a != b], b[a != b]
    pairs, items, parts = verification_plan(a, b)
    assert parts == -(-len(a) // PAIRS_PER_PARTITION) and pairs.num_rows == len(a)
    sent = {(k, p) for item in items for k, p in zip(item["keys"], item["parts"])}
    assert all(k >> SHARD_BITS == item["shard"] for item in items for k in item["keys"])
    assert len(sent) == sum(len(item["keys"]) for item in items)  # no document twice to one partition
    for part, x, y in zip(*(pairs.column(c).to_pylist() for c in ("part", "a", "b"))):
        assert (x, part) in sent and (y, part) in sent
    assert len(sent) < 2 * len(a)  # shared documents travel once per partition
