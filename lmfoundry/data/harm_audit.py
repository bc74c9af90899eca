"""The harmful-content violation rate of a curated corpus, measured by something other than the
filter that kept it.

Re-scoring kept documents with the filter that kept them finds nothing by construction. Instead a
deterministic sample of kept documents (by a hash of their id, so the same input gives the same
sample on every run) is written to `audit/harm_sample.jsonl` and judged by, in this order:

1. `labels`: people's labels, a JSONL file of {"id", "harmful": true/false} (the sample file with
   its `harmful` fields filled in will do; rows left null are skipped): the labelled audit;
2. `scorer`: a second harm scorer that did not filter (a Hugging Face model, a judge, another
   blocklist); it must differ from the filter's config;
3. neither: the rate is not measured, and the checklist says so.

Labels made after a run are applied to its report by `lmfoundry harm-audit RUN --labels FILE`
(`report.apply_harm_labels`), without curating again.

The rate comes with its 95% Wilson interval; the checklist passes on the interval's upper bound,
so a small sample cannot pass a strict threshold by luck.
"""

from __future__ import annotations

import json

import numpy as np
import pyarrow as pa
import xxhash
from pydantic import Field

from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.stats import wilson_interval
from lmfoundry.safety.harm import HarmConfig, HarmScorer

SAMPLE_FILE = "audit/harm_sample.jsonl"


class HarmAuditConfig(StageConfig):
    sample_size: int = Field(1000, ge=10, description="kept documents sampled for the audit")
    labels: str | None = Field(None, description='JSONL of {"id", "harmful": bool}: reviewers\' labels')
    scorer: HarmConfig | None = Field(None, description="a second harm scorer that did not filter")


def id_sample(batch: pa.Table, rate: float, id_field: str) -> pa.Table:
    """Documents whose id hashes below `rate`: the same documents on every run of the same input."""
    u = np.array([xxhash.xxh3_64_intdigest(str(i).encode()) for i in batch.column(id_field).to_pylist()], np.uint64)
    return batch.filter(pa.array((u >> np.uint64(11)).astype(np.float64) / float(1 << 53) < rate))


def read_labels(path: str) -> dict[str, bool]:
    labels: dict[str, bool] = {}
    for n, row in storage.numbered_jsonl(path):
        if not isinstance(row, dict) or not isinstance(row.get("id"), str):
            raise ValueError(f'{path}:{n}: expected an object with a string "id" and "harmful": true/false/null')
        harmful = row.get("harmful")
        if harmful is None:
            continue  # not reviewed yet
        if not isinstance(harmful, bool):
            raise ValueError(f'{path}:{n}: "harmful" is {harmful!r}; allowed: true, false, null')
        labels[row["id"]] = harmful
    return labels


def estimate(
    sample: list[dict], audit: HarmAuditConfig, filter_cfg: HarmConfig | None, id_field: str, text_field: str
) -> dict:
    """{"estimate", "rate", "violations", "n", "ci95", ...} for a sample of kept documents."""
    base = {"sample": len(sample), "sample_file": SAMPLE_FILE}
    if audit.labels:
        labels = read_labels(audit.labels)
        judged = [labels[d[id_field]] for d in sample if d[id_field] in labels]
        method = "labelled_audit"
        extra = {"labels": audit.labels, "unlabelled": len(sample) - len(judged)}
    elif audit.scorer is not None:
        if not audit.scorer.enabled:
            raise ValueError("checklist.harm_audit.scorer has enabled: false; remove it or enable it")
        if filter_cfg is not None and filter_cfg.enabled and audit.scorer == filter_cfg:
            raise ValueError(
                "checklist.harm_audit.scorer is the harm filter's own config: documents it kept score "
                "under its threshold by construction; configure a different scorer (a model, a judge, "
                "another blocklist) or labels"
            )
        scorer = HarmScorer(audit.scorer)
        judged = [scorer.harmful(s) for s in scorer([d[text_field] for d in sample])]
        method = "second_scorer"
        extra = {"scorers": list(scorer.scorers)}
    else:
        return {"estimate": None, "rate": None, **base}
    k, n = sum(judged), len(judged)
    return {
        "estimate": method,
        "rate": k / n if n else None,
        "violations": k,
        "n": n,
        "ci95": list(wilson_interval(k, n)),
        **base,
        **extra,
    }


def harm_audit(cfg, out: str, kept_total: int) -> dict:
    """Sample the run's kept documents, write the sample for reviewers, and estimate the rate."""
    from lmfoundry.data.workdir import read_parquet_files

    audit = cfg.checklist.harm_audit
    files = storage.list_files(storage.join(out, "kept"), (".parquet",))
    sample: list[dict] = []
    if files and kept_total:
        rate = min(1.0, audit.sample_size / kept_total)
        columns = [cfg.id_field, cfg.text_field]
        ds = read_parquet_files(files, columns).map_batches(
            id_sample, fn_kwargs={"rate": rate, "id_field": cfg.id_field}, batch_format="pyarrow"
        )
        sample = sorted(ds.take_all(), key=lambda d: d[cfg.id_field])
    lines = [
        json.dumps({"id": d[cfg.id_field], "harmful": None, "text": d[cfg.text_field]}, ensure_ascii=False)
        for d in sample
    ]
    storage.write_bytes_atomic(storage.join(out, SAMPLE_FILE), ("\n".join(lines) + "\n" if lines else "").encode())
    return estimate(sample, audit, cfg.harm, cfg.id_field, cfg.text_field)
