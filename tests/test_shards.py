"""The training data read once: the epoch order, each rank's share of the bytes, resume that seeks."""

from __future__ import annotations

import numpy as np
import pyarrow as pa
import pytest

from lmfoundry.data.pack import ShardWriter
from lmfoundry.train.shards import CountingOpener, EpochOrder, SplitLayout, prefetched, rank_batches

SAMPLE, PER_SHARD, PER_GROUP, MBS = 513, 40, 4, 4


@pytest.fixture
def split(tmp_path):
    """150 sequences of random tokens, the first their row number, in 4 shards of 40 (the last
    30), row groups of 4, written by pack's own writer."""
    tokens = np.random.default_rng(0).integers(0, 50_000, (150, SAMPLE), dtype=np.int32)
    tokens[:, 0] = np.arange(150)
    writer = ShardWriter(str(tmp_path / "train"), SAMPLE, PER_SHARD, PER_GROUP)
    writer.add(pa.array(list(tokens), pa.list_(pa.int32())))
    manifest = {"splits": {"train": writer.close()}, "sequences_per_shard": PER_SHARD, "rows_per_group": PER_GROUP}
    return SplitLayout.from_manifest(str(tmp_path), manifest)


def epoch(layout, world, rank, skip=0, seed=0, shuffle=True, opener=None):
    extra = {"opener": opener} if opener else {}
    return list(rank_batches(layout, seed, 0, shuffle, rank, world, MBS, skip, **extra))


def test_an_epoch_visits_every_sequence_once_in_an_order_the_seed_fixes(split):
    rows = np.concatenate([r for _, r in epoch(split, 1, 0)])[:, 0]
    assert len(rows) == 148 and len(set(rows.tolist())) == 148  # 37 micro-batches of 4; 2 dropped
    assert rows.tolist() != sorted(rows.tolist())
    assert rows.tolist() == np.concatenate([r for _, r in epoch(split, 1, 0)])[:, 0].tolist()
    assert rows.tolist() != np.concatenate([r for _, r in epoch(split, 1, 0, seed=1)])[:, 0].tolist()
    in_file_order = np.concatenate([r for _, r in epoch(split, 1, 0, shuffle=False)])[:, 0]
    assert in_file_order.tolist() == list(range(148))
    order = EpochOrder(split, 0, 0, True)
    assert {order.locate(p) for p in range(150)} == {
        (s, g, r) for s in range(4) for g in range(split.groups(s)) for r in range(split.group_rows(s, g))
    }
    with pytest.raises(IndexError):
        order.locate(150)


@pytest.mark.parametrize("world", [2, 4])
def test_the_global_micro_batches_do_not_depend_on_the_world_size(split, world):
    """Rank r of `world` trains on rows [r mbs, (r+1) mbs) of each global micro-batch, and the
    global micro-batches are those of one worker taken `world` at a time."""
    single = np.concatenate([r for _, r in epoch(split, 1, 0)])
    ranks = [epoch(split, world, r) for r in range(world)]
    joined = np.concatenate([np.concatenate([ranks[r][i][1] for r in range(world)]) for i in range(len(ranks[0]))])
    assert np.array_equal(joined, single[: len(joined)])


def test_each_rank_reads_only_its_row_groups_and_a_resume_seeks(split):
    whole = CountingOpener()
    epoch(split, 1, 0, opener=whole)
    shares = []
    for rank in range(2):
        counted = CountingOpener()
        epoch(split, 2, rank, opener=counted)
        shares.append(counted.bytes_read)
    # each rank reads half the row groups and every shard's footer (pyarrow reads the last 64 KiB
    # of a file for it): together they read what one reader does plus one more set of footers
    assert abs(shares[0] - shares[1]) < 0.05 * shares[0]
    assert sum(shares) - whole.bytes_read <= len(split.files) * 65536
    late = CountingOpener()
    resumed = epoch(split, 1, 0, skip=33, opener=late)
    assert [i for i, _ in resumed] == [33, 34, 35, 36]
    assert all(np.array_equal(a, b) for (_, a), (_, b) in zip(resumed, epoch(split, 1, 0)[33:]))
    assert late.bytes_read < 0.25 * whole.bytes_read and late.files_opened == 1


def test_a_shard_unlike_its_manifest_is_refused(split, tmp_path):
    wrong = SplitLayout(split.files, split.sequences, split.per_shard, 8)
    with pytest.raises(ValueError, match="row groups of 4, but the pack manifest says 40 rows in row groups of 8"):
        epoch(wrong, 1, 0)
    with pytest.raises(ValueError, match="rows_per_group"):
        SplitLayout.from_manifest(str(tmp_path), {"splits": {"train": {"sequences": 150, "shards": 4}}})


def test_prefetch_hands_on_items_and_errors_and_stops_when_closed():
    assert list(prefetched(iter(range(10)), 2)) == list(range(10))

    def failing():
        yield 1
        raise OSError("shard gone")

    with pytest.raises(OSError, match="shard gone"):
        list(prefetched(failing(), 2))
    stream = prefetched(iter(range(1000)), 2)
    assert next(stream) == 0
    stream.close()  # joins the reader thread
