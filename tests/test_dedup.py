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
    """The rows behind the distributed verification: a pair found in several buckets lands in one
    partition, and each of its documents is addressed to that partition by its own shard."""
    import pyarrow as pa

    from lmfoundry.data.dedup_pipeline import pair_rows, send_rows
    from lmfoundry.data.documents import SHARD_BITS

    rng = np.random.default_rng(0)
    docs = (rng.integers(0, 40, 5000) << SHARD_BITS) | rng.integers(0, 300, 5000)
    a, b = np.sort(rng.choice(np.unique(docs), (800, 2)), axis=1).T
    a, b = a[a != b], b[a != b]
    twice = pa.table({"a": np.concatenate([a, a]), "b": np.concatenate([b, b])})
    pairs = pair_rows(twice, 7)
    part_of = {}
    for part, x, y in zip(*(pairs.column(c).to_pylist() for c in ("part", "a", "b"))):
        assert part_of.setdefault((x, y), part) == part  # the same pair, the same partition
    assert set(part_of.values()) == set(range(7))
    sends = send_rows(pairs)
    assert all(k >> SHARD_BITS == s for k, s in zip(sends.column("key").to_pylist(), sends.column("shard").to_pylist()))
    sent = set(zip(sends.column("key").to_pylist(), sends.column("part").to_pylist()))
    assert all((x, p) in sent and (y, p) in sent for (x, y), p in part_of.items())


def star_rounds(a: np.ndarray, b: np.ndarray) -> tuple[dict, int]:
    """The distributed connected components with every partition in one: large- and small-star
    until neither changes an edge."""
    from lmfoundry.data.components import large_star, small_star

    a, b, rounds = a[a != b], b[a != b], 0
    while True:
        rounds += 1
        large = large_star(np.concatenate([a, b]), np.concatenate([b, a]))
        small = small_star(np.maximum(large["a"], large["b"]), np.minimum(large["a"], large["b"]))
        a, b = small["a"], small["b"]
        if not large["changed"].any() and not small["changed"].any():
            return dict(zip(a.tolist(), b.tolist())), rounds


@pytest.mark.parametrize("seed", range(4))
def test_star_components_equal_union_find(seed):
    rng = np.random.default_rng(seed)
    n = 500
    a, b = rng.integers(0, n, 400), rng.integers(0, n, 400)
    a = np.concatenate([a, np.arange(100, 199)])  # and one long path, the worst shape for labels
    b = np.concatenate([b, np.arange(101, 200)])
    uf = UnionFind()
    for x, y in zip(a.tolist(), b.tolist()):
        if x != y:
            uf.union(x, y)
    members, rounds = star_rounds(a, b)
    assert members == uf.duplicates()
    assert rounds <= 12


@pytest.mark.parametrize("shuffle", ["V2", "hash", "shuffle_v2", " v2", "../sort", "v2" * 5000, None, 2, ["v2"]])
def test_dedup_shuffle_takes_only_its_two_names(shuffle):
    """dedup.shuffle comes from a user's config: anything but sort or v2 is refused, naming the
    field and what it allows, before any Ray Data setting is touched."""
    import pydantic
    import ray

    from lmfoundry.data.dedup_pipeline import shuffle_strategy

    with pytest.raises(pydantic.ValidationError, match=r"(?s)shuffle.*'sort' or 'v2'"):
        DedupConfig(shuffle=shuffle)
    context = ray.data.DataContext.get_current()
    before = context.shuffle_strategy, context.default_hash_shuffle_parallelism
    with pytest.raises(KeyError), shuffle_strategy(str(shuffle), 4):
        pass
    assert (context.shuffle_strategy, context.default_hash_shuffle_parallelism) == before
