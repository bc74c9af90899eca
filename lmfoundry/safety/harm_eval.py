"""A small labelled harm set (`harm_eval.jsonl`) and a scorer's precision and recall on it.

88 short texts in English, German, French and Spanish, half harmful (insults, threats,
encouragement of self-harm, hate, requests for weapons of mass harm, crime) and half benign. Most
benign texts share words with harmful ones ("kill the process", "shoot a photo", "the film was a
bomb", a historian on ethnic cleansing), so a scorer that reacts to words rather than meaning
loses precision here. Written for the tests and `benchmarks/harm_scorers.py`: it is small (a
recall of 1/22 per language moves by 4.5 points), and some English positives hold the default
blocklist's phrases verbatim, so the blocklist's English recall is an upper bound.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from importlib import resources

from lmfoundry.platform.stats import wilson_interval


def load() -> list[dict]:
    """The rows: {"id", "lang", "harmful", "kind", "text"}."""
    text = resources.files("lmfoundry.safety").joinpath("harm_eval.jsonl").read_text(encoding="utf-8")
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _counts(flags: list[bool], labels: list[bool]) -> dict:
    tp = sum(f and y for f, y in zip(flags, labels))
    fp = sum(f and not y for f, y in zip(flags, labels))
    fn = sum(not f and y for f, y in zip(flags, labels))
    tn = len(labels) - tp - fp - fn
    precision = tp / (tp + fp) if tp + fp else None
    recall = tp / (tp + fn) if tp + fn else None
    f1 = 2 * precision * recall / (precision + recall) if precision and recall else 0.0
    return {
        "precision": precision,
        "recall": recall,
        "f1": f1,
        "recall_ci95": list(wilson_interval(tp, tp + fn)),
        "tp": tp,
        "fp": fp,
        "fn": fn,
        "tn": tn,
    }


def evaluate(score: Callable[[list[str]], list[float]], threshold: float, rows: list[dict] | None = None) -> dict:
    """Precision, recall and F1 of `score(texts) >= threshold` against the labels, overall, per
    language, and the false-positive rate on the benign texts that share words with harmful ones."""
    rows = rows if rows is not None else load()
    scores = score([r["text"] for r in rows])
    flags = [s >= threshold for s in scores]
    labels = [bool(r["harmful"]) for r in rows]
    by_lang = {}
    for lang in dict.fromkeys(r["lang"] for r in rows):
        idx = [i for i, r in enumerate(rows) if r["lang"] == lang]
        c = _counts([flags[i] for i in idx], [labels[i] for i in idx])
        by_lang[lang] = {"precision": c["precision"], "recall": c["recall"]}
    overlap = [flags[i] for i, r in enumerate(rows) if r["kind"] == "overlap"]
    return {
        **_counts(flags, labels),
        "overlap_false_positive_rate": sum(overlap) / len(overlap) if overlap else None,
        "by_language": by_lang,
        "missed": [r["id"] for r, f, y in zip(rows, flags, labels) if y and not f],
        "false_alarms": [r["id"] for r, f, y in zip(rows, flags, labels) if f and not y],
    }
