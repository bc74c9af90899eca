"""Curation figures, side by side in one run:

  dedup       fuzzy-dedup recall and precision on a generated corpus with planted near duplicates
              at known Jaccard levels (edits, insertions, deletions, sentence moves)
  throughput  documents per second on one core, lmfoundry against datatrove on the same
              documents, interleaved repeat by repeat: the heuristic stage (C4 + Gopher quality +
              Gopher repetition + FineWeb rules) and MinHash signatures (same shingles, same
              16 x 6 min-hashes). datatrove is the `bench` extra: pip install 'lmfoundry[bench]' spacy
  scaling     the whole `lmfoundry curate` pipeline on local Ray over 10k and 100k documents
              (or --sizes; a size measured alone replaces its row, others are kept):
              wall time and the peak memory (proportional set size) of all Ray processes together
  multilingual  the same pipeline over a folder of a few hundred MB of .txt files in 11
              languages (Faker word lists for 10 of them: pip install faker): time, peak memory,
              what each language keeps (not in the default sections)

    python benchmarks/curation.py [--quick] [--sections dedup,throughput,scaling] [--sizes 10000,100000]
    python benchmarks/curation.py --sections multilingual [--megabytes 200,400]

Prints tables; writes benchmarks/results/curation.json.
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import platform
import random
import shutil
import statistics
import tempfile
import threading
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"


def machine() -> str:
    cpu = next(
        (line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name")),
        platform.processor(),
    )
    return f"{os.cpu_count()} vCPU {cpu}, {round(os.sysconf('SC_PAGE_SIZE') * os.sysconf('SC_PHYS_PAGES') / 2**30)} GiB"


def bench_dedup(groups: int) -> dict:
    from lmfoundry.data.dedup import DedupConfig, cluster_in_process, planted_scores
    from lmfoundry.data.sample_corpus import planted_duplicates

    texts, _, truth = planted_duplicates(groups, copies=3, seed=7)
    cfg = DedupConfig()
    started = time.perf_counter()
    uf = cluster_in_process(texts, cfg)
    seconds = time.perf_counter() - started
    scores = planted_scores(texts, truth, uf, cfg.jaccard_threshold)
    return {
        "documents": len(texts),
        "bands": cfg.num_bands,
        "rows_per_band": cfg.rows_per_band,
        "threshold": cfg.jaccard_threshold,
        "seconds": round(seconds, 2),
        **scores,
        "published_text_dedup_minhash": {"precision": 0.9587, "recall": 0.9416},
    }


def throughput_docs(n: int) -> list[str]:
    from lmfoundry.data.normalize import normalize_text
    from lmfoundry.data.sample_corpus import stdlib_documents, web_like_documents

    good = [normalize_text(d)[0] for d in stdlib_documents(n // 2)]
    return good + web_like_documents(n - len(good), seed=3)


def _let_datatrove_hash_str() -> None:
    """datatrove 0.10 hands str to xxhash, which xxhash 4 refuses; give it the UTF-8 bytes it means
    (the same work its hash did with xxhash 3)."""
    import types

    import xxhash
    from datatrove.utils.hashes import xxhash as dt_xxhash

    dt_xxhash.xxhash = types.SimpleNamespace(
        xxh64_intdigest=lambda d: xxhash.xxh64_intdigest(d.encode() if isinstance(d, str) else d),
        xxh32_intdigest=lambda d: xxhash.xxh32_intdigest(d.encode() if isinstance(d, str) else d),
    )


def bench_throughput(n: int, repeats: int) -> dict:
    from datatrove.data import Document
    from datatrove.pipeline.dedup.minhash import MinhashConfig, MinhashDedupSignature
    from datatrove.pipeline.filters import (
        C4QualityFilter,
        FineWebQualityFilter,
        GopherQualityFilter,
        GopherRepetitionFilter,
    )

    from lmfoundry.data.dedup import DedupConfig, MinHasher
    from lmfoundry.data.filters import HeuristicFilter

    docs = throughput_docs(n)
    # datatrove with the settings our defaults use: no terminal-punctuation or words-per-line rule,
    # no curly-bracket rule (both strip technical text), everything else at its defaults.
    dt_filters = [
        C4QualityFilter(filter_no_terminal_punct=False, min_words_per_line=0, filter_curly_bracket=False),
        GopherRepetitionFilter(),
        GopherQualityFilter(),
        FineWebQualityFilter(),
    ]
    ours = HeuristicFilter()

    def datatrove_heuristic():
        kept = 0
        for i, text in enumerate(docs):
            doc = Document(text=text, id=str(i))
            ok = True
            for f in dt_filters:
                r = f.filter(doc)
                if r is False or (isinstance(r, tuple) and not r[0]):
                    ok = False
                    break
            kept += ok
        return kept

    def ours_heuristic():
        return sum(ours(text, "en")[1] is None for text in docs)

    _let_datatrove_hash_str()
    tmp = tempfile.mkdtemp()
    dt_sig = MinhashDedupSignature(
        output_folder=tmp, config=MinhashConfig(num_buckets=16, hashes_per_bucket=6, n_grams=5)
    )
    hasher = MinHasher(DedupConfig())

    def datatrove_minhash():
        return sum(len(dt_sig.get_signature(dt_sig.get_shingles(t))) for t in docs)

    def ours_minhash():
        sigs, _ = hasher(docs)
        return len(sigs)

    pairs = {"heuristic": (ours_heuristic, datatrove_heuristic), "minhash": (ours_minhash, datatrove_minhash)}
    out = {"documents": len(docs), "mean_chars": round(statistics.mean(map(len, docs))), "repeats": repeats}
    for name, (mine, theirs) in pairs.items():
        mine(), theirs()  # warm-up: tokenizer loading, caches
        times = {"lmfoundry": [], "datatrove": []}
        for _ in range(repeats):
            for label, fn in (("lmfoundry", mine), ("datatrove", theirs)):
                t = time.perf_counter()
                fn()
                times[label].append(time.perf_counter() - t)
        med = {k: statistics.median(v) for k, v in times.items()}
        out[name] = {
            "lmfoundry_docs_per_s": round(len(docs) / med["lmfoundry"], 1),
            "datatrove_docs_per_s": round(len(docs) / med["datatrove"], 1),
            "ratio": round(med["datatrove"] / med["lmfoundry"], 2),
        }
    out["kept"] = {"lmfoundry": ours_heuristic(), "datatrove": datatrove_heuristic()}
    shutil.rmtree(tmp, ignore_errors=True)
    return out


def scaling_corpus(path: Path, n: int, seed: int = 0) -> None:
    """Documents assembled from real sentences (the standard library's docstrings), 5% exact and
    5% near copies, 10% web-like noise; gzip JSON lines, 12,500 documents a file (at least 8
    files), so a file stays the same size as the corpus grows, as in a real corpus."""
    import gzip

    from lmfoundry.data.sample_corpus import stdlib_documents, web_like_documents

    rng = random.Random(seed)
    sentences = [
        s.strip() + "." for d in stdlib_documents(2000) for s in d.replace("\n", " ").split(". ") if len(s.split()) >= 6
    ]
    noise = web_like_documents(500, seed=seed)
    docs: list[str] = []
    while len(docs) < n:
        r = rng.random()
        if r < 0.05 and docs:
            docs.append(rng.choice(docs))
        elif r < 0.10 and docs:
            words = rng.choice(docs).split(" ")
            i = rng.randrange(len(words))
            docs.append(" ".join(words[:i] + ["also"] + words[i:]))
        elif r < 0.20:
            docs.append(rng.choice(noise))
        else:
            docs.append("\n\n".join(" ".join(rng.sample(sentences, 5)) for _ in range(rng.randint(2, 5))))
    path.mkdir(parents=True, exist_ok=True)
    shards = max(8, n // 12_500)
    for s in range(shards):
        with gzip.open(path / f"part-{s:05d}.jsonl.gz", "wt", encoding="utf-8") as f:
            for j in range(s, n, shards):
                f.write(json.dumps({"id": f"doc-{j:08d}", "text": docs[j]}) + "\n")


class PeakRSS(threading.Thread):
    """Samples the memory of this process and every Ray process, summed as proportional set size
    (shared pages, such as Ray's object store mapped into every worker, divided among the
    processes that map them rather than counted once per process)."""

    def __init__(self, interval: float = 0.5):
        super().__init__(daemon=True)
        self.interval, self.peak, self.stopped = interval, 0, threading.Event()
        self.samples: list[tuple[float, int]] = []  # (perf_counter, bytes)

    def run(self):
        import psutil

        while not self.stopped.is_set():
            total = 0
            for p in psutil.process_iter(["pid", "name", "cmdline"]):
                cmd = " ".join(p.info["cmdline"] or [])
                if (
                    p.info["pid"] == os.getpid()
                    or "ray" in (p.info["name"] or "")
                    or "ray::" in cmd
                    or "raylet" in cmd
                    or "gcs_server" in cmd
                    or "default_worker" in cmd
                ):
                    try:
                        total += p.memory_full_info().pss
                    except (psutil.NoSuchProcess, psutil.AccessDenied):
                        pass
            self.peak = max(self.peak, total)
            self.samples.append((time.perf_counter(), total))
            self.stopped.wait(self.interval)

    def peaks_by_phase(self, start: float, phase_seconds: dict[str, float]) -> dict[str, float]:
        """GiB: the peak in each of the report's phases, laid end to end from the run's start (the
        set-up before the first phase counts to it)."""
        out, begin = {}, start
        for i, (phase, seconds) in enumerate(phase_seconds.items()):
            end = begin + seconds if i < len(phase_seconds) - 1 else float("inf")
            inside = [b for t, b in self.samples if (i == 0 or t >= begin) and t < end]
            out[phase] = round(max(inside, default=0) / 2**30, 2)
            begin = end
        return out


def timed_curate(work: Path) -> tuple[dict, float, int, dict[str, float]]:
    """`lmfoundry curate` from work/raw to work/out: its report, seconds, peak memory in bytes,
    and the peak of each phase in GiB."""
    from lmfoundry.data.curate import CurateConfig, run_curate

    monitor = PeakRSS()
    monitor.start()
    t = time.perf_counter()
    report = run_curate(CurateConfig(input=str(work / "raw"), output=str(work / "out")))
    seconds = time.perf_counter() - t
    monitor.stopped.set()
    monitor.join()
    return report, seconds, monitor.peak, monitor.peaks_by_phase(t, report["phase_seconds"])


def bench_scaling(sizes: list[int]) -> list[dict]:
    from lmfoundry.platform.ray_env import curation_worker_env, init_ray

    init_ray(worker_env=curation_worker_env())  # the workers `lmfoundry curate` starts
    rows = []
    for n in sizes:
        work = Path(tempfile.mkdtemp(prefix=f"curate-{n}-"))
        # generated in a child process: the generator's own memory is gone before the measurement
        child = multiprocessing.get_context("spawn").Process(target=scaling_corpus, args=(work / "raw", n))
        child.start()
        child.join()
        if child.exitcode != 0:
            raise RuntimeError(f"generating the {n}-document corpus failed (exit code {child.exitcode})")
        size_mb = sum(f.stat().st_size for f in (work / "raw").iterdir()) / 2**20
        report, seconds, peak, phase_peaks = timed_curate(work)
        rows.append(
            {
                "documents": n,
                "input_mb_gzip": round(size_mb, 1),
                "seconds": round(seconds, 1),
                "docs_per_s": round(n / seconds, 1),
                "peak_pss_gib": round(peak / 2**30, 2),
                "peak_pss_gib_by_phase": phase_peaks,
                "kept": report["documents_kept"],
                "phase_seconds": report["phase_seconds"],
                "exact_duplicates": report["dedup"]["exact_duplicates"],
                "near_duplicates": report["dedup"]["near_duplicates"],
            }
        )
        print(f"  {n}: {rows[-1]}", flush=True)
        shutil.rmtree(work, ignore_errors=True)
    return rows


# Faker's word lists give each language real words in that language's script (the sentences are
# not grammatical: good enough for language identification and for the cost of every stage)
FAKER_LOCALES = {
    "de": "de_DE",
    "fr": "fr_FR",
    "es": "es_ES",
    "it": "it_IT",
    "nl": "nl_NL",
    "pl": "pl_PL",
    "ru": "ru_RU",
    "ar": "ar_AA",
    "zh": "zh_CN",
    "ja": "ja_JP",
}


def multilingual_folder(path: Path, megabytes: int, seed: int = 0) -> dict:
    """A folder of .txt files, one document each, in 11 languages (English from the standard
    library's docstrings, the rest from Faker's word lists), about `megabytes` of UTF-8 in all;
    3% exact and 3% near copies. Documents per language."""
    from faker import Faker

    from lmfoundry.data.sample_corpus import stdlib_documents

    rng = random.Random(seed)
    pools = {
        "en": [
            s.strip() + "."
            for d in stdlib_documents(2000)
            for s in d.replace("\n", " ").split(". ")
            if len(s.split()) >= 6
        ]
    }
    for lang, locale in FAKER_LOCALES.items():
        fake = Faker(locale)
        fake.seed_instance(seed)
        pools[lang] = [fake.sentence(nb_words=12) for _ in range(5000)]
    langs, budget, written, n = sorted(pools), megabytes * 2**20, 0, 0
    counts = dict.fromkeys(langs, 0)
    previous: list[tuple[str, str]] = []
    while written < budget:
        r = rng.random()
        if r < 0.03 and previous:
            lang, text = rng.choice(previous)
        elif r < 0.06 and previous:
            lang, text = rng.choice(previous)
            text = text.replace(". ", ". Also, ", 1)
        else:
            lang = rng.choice(langs)
            text = "\n\n".join(" ".join(rng.sample(pools[lang], rng.randint(4, 8))) for _ in range(rng.randint(2, 6)))
            if len(previous) < 2000:
                previous.append((lang, text))
        folder = path / lang
        folder.mkdir(parents=True, exist_ok=True)
        data = text.encode()
        (folder / f"{n:07d}.txt").write_bytes(data)
        written, n, counts[lang] = written + len(data), n + 1, counts[lang] + 1
    return counts


def bench_multilingual(megabytes: int) -> dict:
    """`lmfoundry curate` over a folder of mixed-language .txt files: wall time, peak memory,
    what was kept per language."""
    import pyarrow.parquet as pq

    from lmfoundry.platform.ray_env import curation_worker_env, init_ray

    init_ray(worker_env=curation_worker_env())  # the workers `lmfoundry curate` starts
    work = Path(tempfile.mkdtemp(prefix="curate-multilingual-"))
    written = multilingual_folder(work / "raw", megabytes)
    size = sum(f.stat().st_size for f in (work / "raw").rglob("*.txt"))
    report, seconds, peak, phase_peaks = timed_curate(work)
    kept = pq.read_table(work / "out" / "kept", columns=["lang"]).column("lang").to_pylist()
    out = {
        "input_mb": round(size / 2**20, 1),
        "documents": sum(written.values()),
        "seconds": round(seconds, 1),
        "mb_per_s": round(size / 2**20 / seconds, 3),
        "docs_per_s": round(sum(written.values()) / seconds, 1),
        "peak_pss_gib": round(peak / 2**30, 2),
        "peak_pss_gib_by_phase": phase_peaks,
        "written_by_language": written,
        "kept_by_language": dict(sorted(collections.Counter(kept).items())),
        "documents_kept": report["documents_kept"],
        "rejected_by_reason": report["rejected_by_reason"],
        "phase_seconds": report["phase_seconds"],
    }
    shutil.rmtree(work, ignore_errors=True)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="small sizes, for a smoke run")
    p.add_argument("--sections", default="dedup,throughput,scaling")
    p.add_argument("--sizes", default="10000,100000", help="scaling: corpus sizes in documents")
    p.add_argument("--megabytes", default="200,400", help="multilingual: sizes of the text folder, in MB")
    args = p.parse_args()
    sections = args.sections.split(",")
    RESULTS.mkdir(exist_ok=True)
    path = RESULTS / ("curation_quick.json" if args.quick else "curation.json")
    # sections run separately keep each other's results; each is written as soon as it is done
    result: dict = json.loads(path.read_text()) if path.exists() else {}
    result.update({"machine": machine(), "date": time.strftime("%Y-%m-%d")})

    def save():
        path.write_text(json.dumps(result, indent=2) + "\n")

    if "dedup" in sections:
        result["dedup"] = d = bench_dedup(100 if args.quick else 1500)
        print(
            f"\nfuzzy dedup on {d['documents']} documents with planted near duplicates ({d['true_pairs']} pairs at "
            f"Jaccard >= {d['threshold']}), {d['bands']} bands x {d['rows_per_band']} rows, {d['seconds']} s"
        )
        print(
            f"  pair recall {d['pair_recall']:.4f}   document recall {d['document_recall']:.4f}   "
            f"document precision {d['document_precision']:.4f}   (text-dedup MinHash: P 0.9587 / R 0.9416)"
        )
        save()
    if "throughput" in sections:
        result["throughput"] = t = bench_throughput(200 if args.quick else 1000, 3 if args.quick else 5)
        print(
            f"\nper core, {t['documents']} documents of {t['mean_chars']} characters on average, median of {t['repeats']}"
        )
        print(f"  {'step':<12}{'lmfoundry docs/s':>18}{'datatrove docs/s':>18}{'ratio':>8}")
        for name in ("heuristic", "minhash"):
            r = t[name]
            print(f"  {name:<12}{r['lmfoundry_docs_per_s']:>18}{r['datatrove_docs_per_s']:>18}{r['ratio']:>7}x")
        print(f"  kept by the heuristic stage: lmfoundry {t['kept']['lmfoundry']}, datatrove {t['kept']['datatrove']}")
        save()
    if "scaling" in sections:
        sizes = [1000, 5000] if args.quick else [int(s) for s in args.sizes.split(",")]
        print("\nscaling (the whole curate pipeline on local Ray):")
        # rows of other sizes from earlier runs are kept, so one size can be (re)measured alone
        measured = {r["documents"]: r for r in result.get("scaling", []) + bench_scaling(sizes)}
        result["scaling"] = [measured[n] for n in sorted(measured)]
        print(f"  {'documents':>10}{'input MB':>10}{'seconds':>10}{'docs/s':>10}{'peak PSS GiB':>14}")
        for r in result["scaling"]:
            print(
                f"  {r['documents']:>10}{r['input_mb_gzip']:>10}{r['seconds']:>10}{r['docs_per_s']:>10}{r['peak_pss_gib']:>14}"
            )
        save()
    if "multilingual" in sections:
        sizes = [20] if args.quick else [int(m) for m in args.megabytes.split(",")]
        result["multilingual"] = [bench_multilingual(mb) for mb in sizes]
        for m in result["multilingual"]:
            print(
                f"\nmultilingual text folder: {m['input_mb']} MB, {m['documents']} .txt documents in "
                f"{len(m['written_by_language'])} languages"
            )
            print(
                f"  {m['seconds']} s ({m['mb_per_s']} MB/s, {m['docs_per_s']} docs/s), peak PSS "
                f"{m['peak_pss_gib']} GiB, kept {m['documents_kept']}"
            )
            print(f"  {'language':<10}{'written':>10}{'kept':>10}")
            for lang, n in m["written_by_language"].items():
                print(f"  {lang:<10}{n:>10}{m['kept_by_language'].get(lang, 0):>10}")
            print(f"  rejected: {m['rejected_by_reason']}")
        save()
    print(f"\nwrote {path}")


if __name__ == "__main__":
    main()
