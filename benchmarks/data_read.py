"""Training data read once: the bytes each worker reads per epoch, and the time from a restart to
the first resumed micro-batch.

A packed split shaped as pack writes it (its ShardWriter: shards of --per-shard sequences, row
groups of --per-group) is read the way each rank of a pretraining run reads it
(lmfoundry.train.shards.rank_batches), through a file opener that counts every byte read. For
each world size, every rank reads one whole epoch; the table gives the bytes read per worker
against the split's bytes on disk divided by the world size.

Resume: the time from building a rank's batch source at micro-batch `skip` to holding its first
micro-batch, at 10% and at 90% of an epoch (world --resume-world, rank 0), median of --repeats.
"seek" is what a resumed run does now; "read up to it" reads and drops the stream before the
position, as a resume did when every worker read the whole stream. The files are in the page
cache after the first read, so both columns are reads from memory; from object storage the
read-up-to-it column grows with the bytes it reads.

    python benchmarks/data_read.py                               # 4 shards of 16,384 x 1,025 tokens
    python benchmarks/data_read.py --shards 2 --per-shard 2048   # a smoke run

Prints a table; writes benchmarks/results/data_read.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa

RESULTS = Path(__file__).resolve().parent / "results"


def write_split(root: Path, shards: int, per_shard: int, per_group: int, sample_len: int, vocab: int):
    """Random tokens (nothing for zstd to find but the unused high bits) cut by pack's writer."""
    from lmfoundry.data.pack import ShardWriter
    from lmfoundry.train.shards import SplitLayout

    rng = np.random.default_rng(0)
    writer = ShardWriter(str(root / "train"), sample_len, per_shard, per_group)
    for _ in range(shards):
        tokens = rng.integers(0, vocab, (per_shard, sample_len), dtype=np.int32)
        writer.add(pa.array(list(tokens), pa.list_(pa.int32())))
    stats = writer.close()
    manifest = {"splits": {"train": stats}, "sequences_per_shard": per_shard, "rows_per_group": per_group}
    return SplitLayout.from_manifest(str(root), manifest)


def epoch_bytes(layout, world: int, rank: int, micro_batch: int) -> int:
    from lmfoundry.train.shards import CountingOpener, rank_batches

    counted = CountingOpener()
    for _ in rank_batches(layout, 0, 0, True, rank, world, micro_batch, 0, counted):
        pass
    return counted.bytes_read


def first_batch_seconds(layout, world: int, micro_batch: int, skip: int, seek: bool) -> float:
    from lmfoundry.train.shards import rank_batches

    started = time.perf_counter()
    if seek:
        next(rank_batches(layout, 0, 0, True, 0, world, micro_batch, skip))
    else:  # the whole stream up to the position, as one reader, then the first batch
        single = rank_batches(layout, 0, 0, True, 0, 1, micro_batch, 0)
        for index, _ in single:
            if index == skip * world:
                break
    return time.perf_counter() - started


def main() -> None:
    from lifecycle import machine

    from lmfoundry.train.shards import micro_batches_per_epoch

    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--per-shard", type=int, default=16_384)
    p.add_argument("--per-group", type=int, default=8)
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--vocab", type=int, default=32_000)
    p.add_argument("--micro-batch", type=int, default=8)
    p.add_argument("--worlds", type=int, nargs="+", default=[1, 2, 4, 8, 16])
    p.add_argument("--resume-world", type=int, default=8)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        layout = write_split(Path(tmp), args.shards, args.per_shard, args.per_group, args.seq_len + 1, args.vocab)
        on_disk = sum(os.path.getsize(f) for f in layout.files)
        print(f"{layout.sequences:,} sequences in {len(layout.files)} shards, {on_disk / 2**20:.1f} MiB on disk")
        print(f"{'world':>5} {'MiB/worker (max)':>17} {'share MiB':>10} {'max/share':>10} {'min/share':>10}")
        reads = []
        for world in args.worlds:
            per_rank = [epoch_bytes(layout, world, r, args.micro_batch) for r in range(world)]
            share = on_disk / world
            row = {
                "world": world,
                "bytes_per_worker_max": max(per_rank),
                "bytes_per_worker_min": min(per_rank),
                "share_bytes": round(share),
                "max_over_share": round(max(per_rank) / share, 4),
                "min_over_share": round(min(per_rank) / share, 4),
                "all_workers_over_on_disk": round(sum(per_rank) / on_disk, 4),
            }
            reads.append(row)
            print(
                f"{world:>5} {max(per_rank) / 2**20:>17.2f} {share / 2**20:>10.2f} "
                f"{row['max_over_share']:>10.4f} {row['min_over_share']:>10.4f}",
                flush=True,
            )

        batches = micro_batches_per_epoch(layout.sequences, args.resume_world, args.micro_batch)
        resume = {}
        print(f"\nresume, world {args.resume_world}: seconds to the first micro-batch (median of {args.repeats})")
        for fraction in (0.1, 0.9):
            skip = int(fraction * batches)
            for seek in (True, False):
                times = [
                    first_batch_seconds(layout, args.resume_world, args.micro_batch, skip, seek)
                    for _ in range(args.repeats)
                ]
                resume[f"{'seek' if seek else 'read_up_to_it'}_at_{int(fraction * 100)}pct_s"] = round(
                    statistics.median(times), 4
                )
        resume["seek_90_over_10"] = round(resume["seek_at_90pct_s"] / resume["seek_at_10pct_s"], 3)
        resume["read_up_to_it_90_over_10"] = round(
            resume["read_up_to_it_at_90pct_s"] / resume["read_up_to_it_at_10pct_s"], 3
        )
        for key, value in resume.items():
            print(f"  {key:<28} {value}")

    result = {
        "benchmark": "data_read",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/data_read.py", *sys.argv[1:]]),
        "machine": {**machine(), "load_average_1min": round(os.getloadavg()[0], 2)},
        "split": {
            "sequences": layout.sequences,
            "shards": len(layout.files),
            "sequences_per_shard": args.per_shard,
            "rows_per_group": args.per_group,
            "seq_len": args.seq_len,
            "micro_batch_size": args.micro_batch,
            "bytes_on_disk": on_disk,
        },
        "bytes_read_per_epoch": reads,
        "resume": {"world": args.resume_world, "micro_batches_per_epoch": batches, **resume},
    }
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "data_read.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
