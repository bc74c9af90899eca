"""The packed training sequences as a table that each worker reads only its share of.

pack (data/pack.py) writes a split as Parquet shards `part-NNNNN.parquet` of `sequences_per_shard`
rows each (the last may hold fewer), in row groups of `rows_per_group` rows, and records both in
its manifest. So a sequence's place is arithmetic: global row n sits in shard n // P, row group
(n % P) // K. No file has to be opened to know where anything is.

An epoch reads the split in an order the seed fixes and the world size does not (EpochOrder):
the shards in a seeded order, each shard's row groups in a seeded order, the rows of each row
group in a seeded order. pack already placed the documents by a seeded hash before cutting the
stream, so every shard is a uniform sample of the corpus, and shuffling inside a shard mixes as
well as shuffling across the whole split would, while a worker touches one shard at a time.

Position p of the epoch order is the p-th sequence trained on. Global micro-batch i is positions
[i G, (i + 1) G) with G = micro_batch_size x world; rank r trains on positions
[i G + r mbs, i G + (r + 1) mbs). A worker reads only the row groups that hold its positions
(ShardReader), so with `rows_per_group` dividing `micro_batch_size` no row group is read by two
workers; resuming at micro-batch i starts reading there (a seek), not at the top of the epoch.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from lmfoundry.platform import storage

# The most shards a split may have: each is a file name held by every worker (at pack's default
# 16,384 sequences a shard, a million shards of 4,096-token sequences hold 67 trillion tokens)
MAX_SHARDS = 1_000_000
# A shard's rows and row groups: each permutation of a shard's order is sized by them (pack's
# default is 16,384 sequences in groups of 8)
MAX_SHARD_ROWS = 1 << 24
MAX_SHARD_GROUPS = 1 << 20


@dataclass(frozen=True)
class SplitLayout:
    """Where a split's rows are: shard files of `per_shard` rows, row groups of `per_group` rows."""

    files: tuple[str, ...]
    sequences: int
    per_shard: int
    per_group: int

    @classmethod
    def from_manifest(cls, data: str, manifest: dict, split: str = "train") -> SplitLayout:
        """The layout a pack manifest records, every count checked before anything is sized by it
        (a manifest from storage may claim anything)."""
        missing = [k for k in ("sequences_per_shard", "rows_per_group") if k not in manifest]
        if missing:
            raise ValueError(
                f"pack output {data!r} does not record {', '.join(missing)} in its manifest (written by an "
                "older pack): pack it again"
            )
        info = manifest.get("splits", {}).get(split) if isinstance(manifest.get("splits"), dict) else None
        if not isinstance(info, dict):
            raise ValueError(f"pack output {data!r}: its manifest records no {split!r} split")
        counts = {
            "shards": info.get("shards"),
            "sequences": info.get("sequences"),
            "sequences_per_shard": manifest["sequences_per_shard"],
            "rows_per_group": manifest["rows_per_group"],
        }
        for key, value in counts.items():
            if type(value) is not int or value < 1:
                raise ValueError(f"pack output {data!r}: {split} {key}={value!r} in its manifest; a positive integer")
        sequences, per_shard = counts["sequences"], counts["sequences_per_shard"]
        if counts["shards"] != -(-sequences // per_shard):
            raise ValueError(
                f"pack output {data!r}: {sequences} {split} sequences do not fill {counts['shards']} "
                f"shards of {per_shard}"
            )
        if per_shard > MAX_SHARD_ROWS or -(-per_shard // counts["rows_per_group"]) > MAX_SHARD_GROUPS:
            raise ValueError(
                f"pack output {data!r}: shards of {per_shard:,} sequences in row groups of "
                f"{counts['rows_per_group']:,}; at most {MAX_SHARD_ROWS:,} sequences and {MAX_SHARD_GROUPS:,} row "
                "groups a shard (an epoch's order permutes them before any file is opened)"
            )
        if counts["shards"] > MAX_SHARDS:
            raise ValueError(
                f"pack output {data!r}: {counts['shards']:,} {split} shards; at most {MAX_SHARDS:,} "
                "(pack with a larger sequences_per_shard)"
            )
        files = tuple(storage.join(data, split, f"part-{s:05d}.parquet") for s in range(counts["shards"]))
        return cls(files, sequences, per_shard, counts["rows_per_group"])

    def shard_rows(self, shard: int) -> int:
        return min(self.per_shard, self.sequences - shard * self.per_shard)

    def groups(self, shard: int) -> int:
        return -(-self.shard_rows(shard) // self.per_group)

    def group_rows(self, shard: int, group: int) -> int:
        return min(self.per_group, self.shard_rows(shard) - group * self.per_group)


class EpochOrder:
    """The order of one epoch: position -> (shard, row group, row in the group). Deterministic in
    (seed, epoch); `shuffle=False` is file order."""

    def __init__(self, layout: SplitLayout, seed: int, epoch: int, shuffle: bool):
        self.layout, self.seed, self.epoch, self.shuffle = layout, seed, epoch, shuffle
        n = len(layout.files)
        self.shards = self._perm(n, seed, epoch) if shuffle else np.arange(n)
        sizes = np.array([layout.shard_rows(int(s)) for s in self.shards], np.int64)
        self.starts = np.concatenate([[0], np.cumsum(sizes)])  # first position of each shard in order
        self._shard_cache: tuple[int, np.ndarray, np.ndarray] | None = None
        self._rows_cache: tuple[int, int, np.ndarray] | None = None

    @staticmethod
    def _perm(n: int, *key: int) -> np.ndarray:
        return np.random.default_rng(list(key)).permutation(n)

    def _groups_of(self, shard: int) -> tuple[np.ndarray, np.ndarray]:
        """The row groups of a shard in epoch order, and the first position of each in the shard."""
        if self._shard_cache is None or self._shard_cache[0] != shard:
            n = self.layout.groups(shard)
            order = self._perm(n, self.seed, self.epoch, shard) if self.shuffle else np.arange(n)
            sizes = np.array([self.layout.group_rows(shard, int(g)) for g in order], np.int64)
            self._shard_cache = (shard, order, np.concatenate([[0], np.cumsum(sizes)]))
        return self._shard_cache[1], self._shard_cache[2]

    def locate(self, position: int) -> tuple[int, int, int]:
        """(shard, row group, row in the group) of the sequence at `position`."""
        if not 0 <= position < self.layout.sequences:
            raise IndexError(f"position {position} outside the epoch's {self.layout.sequences} sequences")
        k = int(np.searchsorted(self.starts, position, side="right")) - 1
        shard = int(self.shards[k])
        order, starts = self._groups_of(shard)
        j = int(np.searchsorted(starts, position - self.starts[k], side="right")) - 1
        group, offset = int(order[j]), int(position - self.starts[k] - starts[j])
        if self.shuffle:
            if self._rows_cache is None or self._rows_cache[:2] != (shard, group):
                rows = self._perm(self.layout.group_rows(shard, group), self.seed, self.epoch, shard, group)
                self._rows_cache = (shard, group, rows)
            offset = int(self._rows_cache[2][offset])
        return shard, group, offset


Opener = Callable[[str], "pa.NativeFile"]


def open_uri(uri: str):
    fs, path = storage.filesystem(uri)
    return fs.open_input_file(path)


class ShardReader:
    """Reads row groups of a split, one open shard at a time, keeping the last row group read (a
    micro-batch slice narrower than a row group takes it from there)."""

    def __init__(self, layout: SplitLayout, opener: Opener = open_uri):
        self.layout, self.opener = layout, opener
        self._file: tuple[int, pq.ParquetFile, object] | None = None
        self._group: tuple[int, int, np.ndarray] | None = None

    def rows(self, shard: int, group: int) -> np.ndarray:
        """The row group's sequences, (rows, sample_len) int32."""
        if self._group is not None and self._group[:2] == (shard, group):
            return self._group[2]
        if self._file is None or self._file[0] != shard:
            self.close()
            handle = self.opener(self.layout.files[shard])
            self._file = (shard, pq.ParquetFile(handle, pre_buffer=False), handle)
            self._check(shard, self._file[1].metadata)
        parquet = self._file[1]
        column = parquet.read_row_group(group, columns=["tokens"]).column("tokens").combine_chunks()
        rows = column.values.to_numpy().reshape(len(column), column.type.list_size)
        self._group = (shard, group, rows)
        return rows

    def _check(self, shard: int, meta) -> None:
        """A shard that does not have the manifest's shape would feed the wrong rows silently."""
        rows, first = meta.num_rows, meta.row_group(0).num_rows if meta.num_row_groups else 0
        if rows != self.layout.shard_rows(shard) or first != min(self.layout.per_group, rows):
            raise ValueError(
                f"{self.layout.files[shard]}: {rows} rows in row groups of {first}, but the pack manifest "
                f"says {self.layout.shard_rows(shard)} rows in row groups of {self.layout.per_group}"
            )

    def close(self) -> None:
        if self._file is not None:
            self._file[2].close()
            self._file = None


def rank_positions(index: int, rank: int, world: int, micro_batch: int) -> range:
    start = (index * world + rank) * micro_batch
    return range(start, start + micro_batch)


def micro_batches_per_epoch(sequences: int, world: int, micro_batch: int) -> int:
    return sequences // (world * micro_batch)  # the last partial global micro-batch is dropped


def rank_batches(
    layout: SplitLayout,
    seed: int,
    epoch: int,
    shuffle: bool,
    rank: int,
    world: int,
    micro_batch: int,
    skip: int,
    opener: Opener = open_uri,
) -> Iterator[tuple[int, np.ndarray]]:
    """(index, rows) for rank `rank`: its slice of each global micro-batch of the epoch from
    micro-batch `skip` on, read straight from the row groups that hold it."""
    order, reader = EpochOrder(layout, seed, epoch, shuffle), ShardReader(layout, opener)
    try:
        for index in range(skip, micro_batches_per_epoch(layout.sequences, world, micro_batch)):
            rows = []
            for p in rank_positions(index, rank, world, micro_batch):
                shard, group, row = order.locate(p)
                rows.append(reader.rows(shard, group)[row])
            yield index, np.stack(rows)
    finally:
        reader.close()


def prefetched(items: Iterator, depth: int) -> Iterator:
    """The items, produced `depth` ahead on a thread (reads overlap the training step). Closing
    the returned generator stops the thread."""
    done, q = threading.Event(), queue.Queue(maxsize=depth)
    end = object()

    def put(entry) -> bool:
        while not done.is_set():
            try:
                q.put(entry, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        try:
            for item in items:
                if not put((item, None)):
                    return
            put((end, None))
        except BaseException as e:  # handed to the consumer, raised there
            put((end, e))
        finally:
            close = getattr(items, "close", None)
            if close:
                close()

    thread = threading.Thread(target=produce, daemon=True, name="shard-prefetch")
    thread.start()
    try:
        while True:
            item, error = q.get()
            if item is end:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        done.set()
        thread.join()


class CountingOpener:
    """An opener that counts the bytes read through the files it opens: what a worker's reads
    cost, as benchmarks/data_read.py and the tests measure it."""

    def __init__(self, opener: Opener = open_uri):
        self.opener, self.bytes_read, self.files_opened = opener, 0, 0

    def __call__(self, uri: str):
        counter, inner = self, self.opener(uri)
        self.files_opened += 1

        class Counted:
            closed = False

            def read(self, n: int = -1) -> bytes:
                data = inner.read() if n is None or n < 0 else inner.read(n)
                counter.bytes_read += len(data)
                return data

            def seek(self, offset: int, whence: int = 0) -> int:
                return inner.seek(offset, whence)

            def tell(self) -> int:
                return inner.tell()

            def size(self) -> int:
                return inner.size()

            def close(self) -> None:
                inner.close()
                self.closed = True

            def readable(self) -> bool:
                return True

            def seekable(self) -> bool:
                return True

        return pa.PythonFile(Counted(), mode="r")
