"""Each harm scorer's precision and recall on the labelled set (safety/harm_eval.jsonl), side by side.

    python benchmarks/harm_scorers.py                       # blocklist, classifier, combined
    python benchmarks/harm_scorers.py --model DIR           # + a local Hugging Face classifier
    python benchmarks/harm_scorers.py --judge-url URL --judge-model NAME   # + a generative judge

88 texts in four languages, half harmful; most benign ones share words with harmful ones. Per
scorer: precision, recall (with its 95% Wilson interval), F1, the false-positive rate on those
word-sharing benign texts, recall per language, and the median time to score the whole set (CPU).
Writes benchmarks/results/harm_scorers.json. The set is small: one text moves a language's recall
by 4.5 points; read the figures as which scorer covers what, not as a leaderboard.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

from lmfoundry.safety.harm import HarmConfig, HarmScorer
from lmfoundry.safety.harm_eval import evaluate, load
from lmfoundry.safety.judge import JudgeConfig

THRESHOLD = 0.5


def median_ms(score, texts: list[str], runs: int) -> float:
    times = []
    for _ in range(runs):
        started = time.perf_counter()
        score(texts)
        times.append(time.perf_counter() - started)
    return round(1000 * statistics.median(times), 2)


def row(score, rows: list[dict], runs: int) -> dict:
    r = evaluate(score, THRESHOLD, rows)
    return {
        "precision": r["precision"],
        "recall": r["recall"],
        "recall_ci95": [round(x, 3) for x in r["recall_ci95"]],
        "f1": r["f1"],
        "overlap_false_positive_rate": r["overlap_false_positive_rate"],
        **{f"recall_{lang}": v["recall"] for lang, v in r["by_language"].items()},
        "ms_per_set": median_ms(score, [x["text"] for x in rows], runs),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--model", help="a local Hugging Face sequence-classification model directory")
    p.add_argument("--harmful-labels", nargs="+", default=["toxic", "harmful", "unsafe", "LABEL_1"])
    p.add_argument("--judge-url", help="an OpenAI-compatible endpoint serving a safety judge (without /v1)")
    p.add_argument("--judge-model", default="llama-guard")
    p.add_argument("--runs", type=int, default=5, help="timed runs per scorer")
    args = p.parse_args()

    rows = load()
    cfg = HarmConfig(
        model=args.model,
        harmful_labels=args.harmful_labels,
        judge=JudgeConfig(base_url=args.judge_url, model=args.judge_model) if args.judge_url else None,
    )
    scorer = HarmScorer(cfg)
    scorers = {name: row(s, rows, args.runs if name != "judge" else 1) for name, s in scorer.scorers.items()}
    default = HarmScorer()  # the default: blocklist + offensive-language classifier
    scorers["combined (default)"] = row(default, rows, args.runs)
    if len(scorer.scorers) > 2:
        scorers["combined (all)"] = row(scorer, rows, 1)
    not_measured = {}
    if not args.model:
        not_measured["model"] = (
            "no --model given: lmfoundry ships no Hugging Face toxicity classifier and none installs from PyPI"
        )
    if not args.judge_url:
        not_measured["judge"] = "no --judge-url: no safety judge endpoint given"

    result = {
        "machine": {"platform": platform.platform(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "command": " ".join(["python benchmarks/harm_scorers.py", *sys.argv[1:]]),
        "labelled_set": {
            "texts": len(rows),
            "harmful": sum(r["harmful"] for r in rows),
            "languages": sorted({r["lang"] for r in rows}),
            "benign_sharing_words": sum(r["kind"] == "overlap" for r in rows),
        },
        "threshold": THRESHOLD,
        "scorers": scorers,
        "not_measured": not_measured,
    }
    header = ["scorer", "precision", "recall", "recall 95% CI", "F1", "overlap FP", "en", "de", "fr", "es", "ms/set"]
    print(" | ".join(header))
    for name, r in scorers.items():
        cells = [r["precision"], r["recall"], r["recall_ci95"], r["f1"], r["overlap_false_positive_rate"]]
        cells += [r.get(f"recall_{lang}") for lang in ("en", "de", "fr", "es")] + [r["ms_per_set"]]
        print(
            " | ".join([name] + ["-" if c is None else f"{c:.3f}" if isinstance(c, float) else str(c) for c in cells])
        )
    for name, why in not_measured.items():
        print(f"{name}: not measured ({why})")
    out = Path(__file__).parent / "results" / "harm_scorers.json"
    out.write_text(json.dumps(result, indent=2) + "\n")
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
