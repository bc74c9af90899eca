"""What reproducible packing costs: `pack` on corpora of 100,000 and 1,000,000 documents, with the
time of every phase. Corpora up to 100,000 documents are packed twice (the second time in blocks a
quarter the size, from the same files) to check that both runs write the same bytes.

    python benchmarks/pack.py                       # 100,000 and 1,000,000 documents
    python benchmarks/pack.py --sizes 20000         # a smoke run

The cost of the order is the `write` phase (a streaming merge of the tokenised files, each sorted
by order key in its own task, and one ordered pass that cuts and writes the shards), against the
`tokenize` phase that any packing pays. (Results written before pack merged sorted files have a
`sort` phase, Ray Data's distributed sort, counted in the order's cost too.) Prints a table and writes benchmarks/results/pack.json.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
DOCS_PER_FILE = 12_500


def corpus(path: Path, n: int, seed: int = 0) -> dict:
    """Documents assembled from real sentences (the standard library's docstrings), 2 to 5
    paragraphs each, as Parquet files of 12,500 documents (a curate output's kept/ at scale)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmfoundry.data.sample_corpus import stdlib_documents

    rng = random.Random(seed)
    sentences = [
        s.strip() + "." for d in stdlib_documents(2000) for s in d.replace("\n", " ").split(". ") if len(s.split()) >= 6
    ]
    path.mkdir(parents=True, exist_ok=True)
    chars = 0
    for f, start in enumerate(range(0, n, DOCS_PER_FILE)):
        ids = [f"doc-{j:08d}" for j in range(start, min(n, start + DOCS_PER_FILE))]
        texts = ["\n\n".join(" ".join(rng.sample(sentences, 5)) for _ in range(rng.randint(2, 5))) for _ in ids]
        chars += sum(map(len, texts))
        pq.write_table(pa.table({"id": ids, "text": texts}), path / f"part-{f:05d}.parquet")
    return {"documents": n, "files": -(-n // DOCS_PER_FILE), "text_mb": round(chars / 1e6, 1)}


def pack_once(src: Path, out: Path, block_bytes: int) -> dict:
    import ray

    from lmfoundry.data.pack import PackConfig, run_pack

    ctx = ray.data.DataContext.get_current()
    default = ctx.target_max_block_size
    ctx.target_max_block_size = block_bytes
    try:
        t = time.perf_counter()
        manifest = run_pack(PackConfig(input=str(src), output=str(out), vocab_size=4096, seq_len=256))
        seconds = time.perf_counter() - t
    finally:
        ctx.target_max_block_size = default
    return {"seconds": round(seconds, 1), "manifest": manifest}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sizes", default="100000,1000000", help="corpus sizes in documents")
    p.add_argument("--twice-up-to", type=int, default=100_000, help="larger corpora are packed once")
    args = p.parse_args()

    import ray

    from lmfoundry.platform.ray_env import init_ray

    init_ray()
    block = ray.data.DataContext.get_current().target_max_block_size
    rows = []
    for n in (int(s) for s in args.sizes.split(",")):
        work = Path(tempfile.mkdtemp(prefix="lmf-pack-"))
        try:
            info = corpus(work / "docs", n)
            blocks = (block, block // 4) if n <= args.twice_up_to else (block,)
            runs = [pack_once(work / "docs", work / f"packed-{i}", b) for i, b in enumerate(blocks)]
            phases = {
                k: statistics.median(r["manifest"]["phase_seconds"][k] for r in runs)
                for k in runs[0]["manifest"]["phase_seconds"]
            }
            total = statistics.median(r["seconds"] for r in runs)
            first = runs[0]["manifest"]
            rows.append(
                {
                    **info,
                    "seconds_median": total,
                    "seconds": [r["seconds"] for r in runs],
                    "phase_seconds_median": phases,
                    "order_cost_fraction": round(phases["write"] / total, 3),
                    "train_sequences": first["splits"]["train"]["sequences"],
                    "train_shards": first["splits"]["train"]["shards"],
                    "byte_identical": len({r["manifest"]["fingerprint"] for r in runs}) == 1 if len(runs) > 1 else None,
                    "fingerprint": first["fingerprint"][:16],
                }
            )
        finally:
            shutil.rmtree(work, ignore_errors=True)
        r = rows[-1]
        r["load_average_1min_at_end"] = round(os.getloadavg()[0], 1)
        r["date"] = time.strftime("%Y-%m-%d")
        r["command"] = " ".join(["python", "benchmarks/pack.py", *sys.argv[1:]])
        print(
            f"{r['documents']:>9,d} docs {r['text_mb']:>7.1f} MB  {r['seconds_median']:>7.1f} s  "
            + "  ".join(f"{k} {v:.1f}" for k, v in r["phase_seconds_median"].items())
            + f"  order cost {100 * r['order_cost_fraction']:.0f}%  identical {r['byte_identical']}",
            flush=True,
        )
        write_results(rows)


def write_results(rows: list[dict]) -> None:
    """Written after every size, so a long run keeps what it measured. Sizes this run did not
    measure keep their rows from the file, each with the date it was measured, and so do the rows
    of earlier designs (`sizes_before_sorted_files`)."""
    from lifecycle import machine

    out = RESULTS / "pack.json"
    measured = {r["documents"] for r in rows}
    before = {}
    if out.exists():
        earlier = json.loads(out.read_text())
        kept = [
            dict(r, date=r.get("date", earlier["date"]), command=r.get("command", earlier["command"]))
            for r in earlier["sizes"]
            if r["documents"] not in measured
        ]
        rows = sorted(kept + rows, key=lambda r: r["documents"])
        before = {k: v for k, v in earlier.items() if k == "sizes_before_sorted_files"}
    result = {
        "benchmark": "pack",
        "date": time.strftime("%Y-%m-%d"),
        "command": " ".join(["python", "benchmarks/pack.py", *sys.argv[1:]]),
        "machine": machine(),
        "sizes": rows,
        **before,
    }
    RESULTS.mkdir(exist_ok=True)
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
