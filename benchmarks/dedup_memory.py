"""The driver's memory in curation's dedup phase, by corpus size: the dedup of `lmfoundry curate`
(data/dedup_pipeline.run_dedup, on local Ray) over a generated work directory of 100,000,
300,000 and 1,000,000 documents (or --sizes), as phase 1 of curate leaves it.

The documents are generated, not curated, so that the dedup phase can be measured at sizes whose
document phase would take an hour here: each has a random text of 60 words, a text hash and 16
band keys. Every tenth document copies an earlier one exactly (same text, same hash, same band
keys); every tenth other one is a near copy (one word of the 60 changed, Jaccard of 5-word
shingles 0.83) that shares 12 of the 16 band keys with its original; the rest share no key.

Driver memory: the resident set of this process, sampled every 20 ms by a thread while run_dedup
runs; the table gives the peak above the level just before the call. The Ray workers' memory is
theirs, not the driver's, and is not counted. Each size runs once per shuffle (dedup.shuffle:
sort, the default, and Ray's shuffle v2) and per kind of worker, each time in a process and on
a local Ray of its own: Ray's default workers, which return results under 100 KiB inline to the
driver, and the workers `lmfoundry curate` starts (platform/ray_env.py CURATION_WORKER_ENV).

    python benchmarks/dedup_memory.py                    # 100,000, 300,000 and 1,000,000 documents
    python benchmarks/dedup_memory.py --sizes 20000      # a smoke run
    python benchmarks/dedup_memory.py --shuffles v2      # one shuffle

Prints a table; writes benchmarks/results/dedup_memory.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_PER_SHARD = 25_000


def write_work_dir(out: Path, n: int, seed: int = 0) -> dict:
    """`_work/docs/shard-N.parquet` and their markers for n documents (see the docstring)."""
    import pyarrow as pa
    import xxhash

    from lmfoundry.data.documents import KEPT, SHARD_BITS
    from lmfoundry.data.workdir import shard_name, work_path, write_parquet_atomic

    rng = np.random.default_rng(seed)
    vocab = np.array([f"w{i}" for i in range(20_000)])
    words = rng.integers(0, len(vocab), (n, 60))
    keys = rng.integers(0, 2**63, (n, 16), dtype=np.int64).astype(np.uint64)
    kind = np.zeros(n, np.int8)
    for i in range(1, n):
        r = rng.random()
        if r < 0.1:
            kind[i], j = 1, rng.integers(0, i)
            words[i], keys[i] = words[j], keys[j]
        elif r < 0.2:
            kind[i], j = 2, rng.integers(0, i)
            words[i] = words[j]
            words[i, rng.integers(0, 60)] = rng.integers(0, len(vocab))
            keys[i, :12] = keys[j, :12]
    for s, start in enumerate(range(0, n, DOCS_PER_SHARD)):
        rows = range(start, min(n, start + DOCS_PER_SHARD))
        texts = [" ".join(vocab[words[i]]) for i in rows]
        table = pa.table(
            {
                "id": [f"doc-{i:07d}" for i in rows],
                "text": texts,
                "doc_key": pa.array([(s << SHARD_BITS) + k for k in range(len(rows))], pa.int64()),
                "reason": [KEPT] * len(rows),
                "_text_hash": pa.array([xxhash.xxh3_64_intdigest(t.encode()) for t in texts], pa.uint64()),
                "_buckets": pa.array([keys[i].tolist() for i in rows], pa.list_(pa.uint64())),
            }
        )
        write_parquet_atomic(work_path(str(out), "docs", shard_name(s) + ".parquet"), table)
        (out / "_work" / "docs" / f"{shard_name(s)}.json").write_text(json.dumps({"kept": len(rows)}))
    return {
        "shards": -(-n // DOCS_PER_SHARD),
        "exact_copies": int((kind == 1).sum()),
        "near_copies": int((kind == 2).sum()),
    }


def rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def measure(n: int, shuffle: str) -> dict:
    from lmfoundry.data.curate import CurateConfig
    from lmfoundry.data.dedup_pipeline import run_dedup

    work = Path(tempfile.mkdtemp(prefix="lmf-dedup-"))
    try:
        planted = write_work_dir(work, n)
        cfg = CurateConfig(input=str(work), output=str(work), dedup={"shuffle": shuffle})
        base, peak, done = rss(), [0], threading.Event()

        def sample() -> None:
            while not done.is_set():
                peak[0] = max(peak[0], rss())
                time.sleep(0.02)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        started = time.perf_counter()
        stats = run_dedup(cfg, str(work), planted["shards"])
        seconds = time.perf_counter() - started
        done.set()
        sampler.join()
        return {
            "documents": n,
            **planted,
            "seconds": round(seconds, 1),
            "driver_rss_before_mib": round(base / 2**20, 1),
            "driver_rss_peak_above_mib": round((peak[0] - base) / 2**20, 1),
            "exact_duplicates": stats["exact_duplicates"],
            "near_duplicates": stats["near_duplicates"],
            "candidate_pairs": stats["candidate_pairs"],
            "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        }
    finally:
        shutil.rmtree(work, ignore_errors=True)


def measure_sizes(env: dict[str, str], shuffle: str, sizes: list[int], rows) -> None:
    """In a process of its own (a fresh heap: memory an earlier run freed would hide this one's
    growth), on a local Ray whose workers start with `env`."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from lmfoundry.platform.ray_env import init_ray

    init_ray(worker_env=env)
    measure(5_000, shuffle)  # warm-up: Ray's workers and imports, so the first size does not pay them
    rows.extend([measure(n, shuffle) for n in sizes])


def main() -> None:
    import multiprocessing

    from lifecycle import machine

    from lmfoundry.platform.ray_env import CURATION_WORKER_ENV

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,300000,1000000", help="corpus sizes in documents")
    p.add_argument("--shuffles", default="sort,v2", help="dedup.shuffle settings to compare")
    args = p.parse_args()
    sizes = [int(s) for s in args.sizes.split(",")]
    shuffles = args.shuffles.split(",")
    # side by side: Ray's default returns results under 100 KiB inline to the driver;
    # `lmfoundry curate` starts its workers with only those under 1 KiB inline
    settings = {"Ray's default workers": {}, "lmfoundry curate's workers": CURATION_WORKER_ENV}
    rows = []
    print(
        f"{'shuffle':<8} {'workers':<28} {'documents':>10} {'seconds':>8} {'peak RSS above, MiB':>20} "
        f"{'exact':>7} {'near':>7}"
    )
    ctx = multiprocessing.get_context("spawn")
    for shuffle in shuffles:
        for name, env in settings.items():
            with ctx.Manager() as manager:
                measured = manager.list()
                child = ctx.Process(target=measure_sizes, args=(env, shuffle, sizes, measured))
                child.start()
                child.join()
                if child.exitcode:
                    raise SystemExit(f"the {shuffle} / {name} run failed (exit code {child.exitcode})")
                measured = list(measured)
            for row in measured:
                rows.append({"shuffle": shuffle, "workers": name, "worker_env": env, **row})
                print(
                    f"{shuffle:<8} {name:<28} {row['documents']:>10,d} {row['seconds']:>8.1f} "
                    f"{row['driver_rss_peak_above_mib']:>20.1f} {row['exact_duplicates']:>7,d} "
                    f"{row['near_duplicates']:>7,d}",
                    flush=True,
                )
    result = {
        "benchmark": "dedup_memory",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/dedup_memory.py", *sys.argv[1:]]),
        "machine": machine(),
        "sizes": rows,
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "dedup_memory.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {RESULTS / 'dedup_memory.json'}")


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main()
