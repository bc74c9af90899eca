"""The curation report: counts per shard merged into `report.json`, the data-quality checklist,
and a self-contained `report.html` (funnel, drops per reason, score histograms, language mix)."""

from __future__ import annotations

import base64
import html
import io
import json
import time

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
from pydantic import Field

from lmfoundry.data.harm_audit import SAMPLE_FILE, HarmAuditConfig, estimate, harm_audit
from lmfoundry.data.workdir import WORK, hash_sample, read_parquet_files
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

BINS = 20  # histogram bins over [0, 1]
FUNNEL = ("read", "normalise", "language", "heuristic", "harm", "quality", "dedup")


class ChecklistConfig(StageConfig):
    enforce: bool = Field(False, description="curate exits non-zero when an item fails")
    max_residual_duplicate_rate: float = Field(0.05, ge=0, le=1)
    max_harm_violation_rate: float = Field(
        0.01, ge=0, le=1, description="passes when the audit's 95% upper bound is below it (data/harm_audit.py)"
    )
    harm_audit: HarmAuditConfig = HarmAuditConfig()
    min_high_density_share: float = Field(0.30, ge=0, le=1)
    min_non_english_share: float = Field(0.20, ge=0, le=1)
    duplicate_sample_size: int = Field(
        1000, ge=10, description="kept documents sampled for the residual duplicate rate"
    )


def _hist(values: pa.ChunkedArray) -> list[int]:
    v = values.drop_null().to_numpy(zero_copy_only=False)
    return np.histogram(np.clip(v, 0, 1), bins=BINS, range=(0, 1))[0].tolist()


def _counts(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out


def shard_stats(t: pa.Table | None, cfg) -> dict:
    """What the report needs from one shard, small enough to keep per shard."""
    if t is None or t.num_rows == 0:
        return {
            "documents": 0,
            "kept": 0,
            "chars_in": 0,
            "chars_kept": 0,
            "by_reason": {},
            "by_stage": {},
            "kept_languages": {},
            "pii": {},
            "hist": {},
            "high_density_kept": 0,
            "density_scored_kept": 0,
            "boilerplate_lines_removed": 0,
            "c4_lines_removed": 0,
        }
    kept_mask = pc.equal(t.column("reason"), "")
    kept = t.filter(kept_mask)
    rejected = t.filter(pc.invert(kept_mask))
    density = kept.column("knowledge_density")
    return {
        "documents": t.num_rows,
        "kept": kept.num_rows,
        "chars_in": pc.sum(t.column("chars_in")).as_py() or 0,
        "chars_kept": pc.sum(pc.utf8_length(kept.column(cfg.text_field))).as_py() or 0,
        "by_reason": _counts(rejected.column("reason").to_pylist()),
        "by_stage": _counts(rejected.column("stage").to_pylist()),
        "kept_languages": _counts(kept.column("lang").to_pylist()),
        "pii": {c[4:]: pc.sum(t.column(c)).as_py() or 0 for c in t.column_names if c.startswith("pii_")},
        "hist": {
            name: _hist(t.column(col))
            for name, col in (
                ("quality", "quality_score"),
                ("harm", "harm_score"),
                ("density", "knowledge_density"),
                ("language_confidence", "lang_confidence"),
            )
        },
        "high_density_kept": pc.sum(pc.greater_equal(density, cfg.density.high_density_threshold)).as_py() or 0,
        "density_scored_kept": len(density) - density.null_count,
        "boilerplate_lines_removed": pc.sum(t.column("boilerplate_lines_removed")).as_py() or 0,
        "c4_lines_removed": pc.sum(t.column("c4_lines_removed")).as_py() or 0,
    }


def _merge(stats: list[dict]) -> dict:
    total: dict = {"hist": {}}
    for s in stats:
        for k, v in s.items():
            if isinstance(v, int):
                total[k] = total.get(k, 0) + v
            elif k == "hist":
                for name, h in v.items():
                    prev = total["hist"].get(name, [0] * BINS)
                    total["hist"][name] = [a + b for a, b in zip(prev, h)]
            else:
                d = total.setdefault(k, {})
                for key, n in v.items():
                    d[key] = d.get(key, 0) + n
    return total


def residual_duplicate_rate(cfg, out: str, kept_total: int) -> dict:
    """Share of a random sample of kept documents that still have a near duplicate among all kept
    documents. Candidates come from a banding independent of the dedup's (32 bands of 3 rows of
    the same signatures: more permissive), similarity is the MinHash estimate."""
    files = storage.list_files(storage.join(out, WORK, "signatures"), (".parquet",))
    n_perm = cfg.dedup.num_perm
    if not files or kept_total < 2 or not cfg.dedup.fuzzy:
        return {"rate": None, "sample": 0, "with_duplicate": 0}
    rate = min(1.0, cfg.checklist.duplicate_sample_size / kept_total)
    ds = read_parquet_files(files)

    sample = ds.map_batches(hash_sample, fn_kwargs={"rate": rate}, batch_format="pyarrow").take_all()
    if not sample:
        return {"rate": None, "sample": 0, "with_duplicate": 0}
    s_keys = np.array([r["doc_key"] for r in sample], dtype=np.int64)
    s_sigs = np.stack([np.asarray(r["_signature"], dtype=np.uint32) for r in sample])
    rows = 3
    bands = n_perm // rows

    def band_keys(sigs: np.ndarray) -> np.ndarray:
        b = sigs[:, : bands * rows].astype(np.uint64).reshape(len(sigs), bands, rows)
        with np.errstate(over="ignore"):
            return (
                (b[..., 0] * np.uint64(1_000_003) + b[..., 1]) * np.uint64(1_000_033)
                + b[..., 2]
                + np.arange(bands, dtype=np.uint64) * np.uint64(0x9E3779B97F4A7C15)
            )

    s_bands = band_keys(s_sigs)
    threshold = cfg.dedup.jaccard_threshold

    def match(batch: dict) -> dict:
        sigs = (
            np.stack(batch["_signature"]).astype(np.uint32)
            if len(batch["doc_key"])
            else np.zeros((0, n_perm), np.uint32)
        )
        found = []
        if len(sigs):
            kb = band_keys(sigs)
            cand = np.flatnonzero(np.isin(kb, s_bands).any(axis=1))
            for i in cand:
                sharing = np.flatnonzero(np.isin(s_bands, kb[i]).any(axis=1))
                est = (s_sigs[sharing] == sigs[i]).mean(axis=1)
                for j in sharing[(est >= threshold) & (s_keys[sharing] != batch["doc_key"][i])]:
                    found.append(s_keys[j])
        return {"sample_key": np.array(found, dtype=np.int64)}

    hits = ds.map_batches(match, batch_format="numpy").take_all()
    with_dup = len({r["sample_key"] for r in hits})
    return {"rate": with_dup / len(sample), "sample": len(sample), "with_duplicate": with_dup}


def _harm_item(audit: dict, threshold: float) -> dict:
    """The violation-rate item: the point estimate, passing on the 95% upper bound."""
    if audit["estimate"] is None:
        return {
            "item": "harmful-content violation rate",
            "value": None,
            "threshold": f"95% upper bound < {threshold}",
            "passed": False,
            "estimate": None,
            "measures": f"not measured independently: label the {audit['sample']} kept documents in "
            f"{audit['sample_file']} (checklist.harm_audit.labels) or configure a second scorer "
            "(checklist.harm_audit.scorer); re-scoring with the filter finds nothing by construction",
        }
    how = {
        "labelled_audit": f"reviewers' labels ({audit['n']} labelled of a {audit['sample']}-document sample)",
        "second_scorer": f"a second scorer that did not filter ({', '.join(audit.get('scorers', []))}) "
        f"on a {audit['n']}-document sample",
    }[audit["estimate"]]
    low, high = audit["ci95"]
    return {
        "item": "harmful-content violation rate",
        "value": audit["rate"],
        "threshold": f"95% upper bound < {threshold}",
        "passed": bool(audit["n"]) and high < threshold,
        "estimate": audit["estimate"],
        "ci95": audit["ci95"],
        "measures": f"kept documents judged harmful by {how}; 95% Wilson interval [{low:.4f}, {high:.4f}]",
    }


def checklist(cfg, merged: dict, residual: dict, audit: dict) -> list[dict]:
    c = cfg.checklist
    langs = merged.get("kept_languages", {})
    identified = sum(n for lang, n in langs.items() if lang)
    items = [
        (
            "residual duplicate rate",
            residual["rate"],
            "<=",
            c.max_residual_duplicate_rate,
            f"near duplicates among a sample of {residual['sample']} kept documents",
        ),
        (
            "high-density share",
            merged.get("high_density_kept", 0) / merged["density_scored_kept"]
            if merged.get("density_scored_kept")
            else None,
            ">=",
            c.min_high_density_share,
            f"kept documents with knowledge density >= {cfg.density.high_density_threshold}",
        ),
        (
            "non-English share",
            (identified - langs.get("en", 0)) / identified if identified else None,
            ">=",
            c.min_non_english_share,
            "kept documents whose identified language is not English",
        ),
    ]
    out = []
    for name, value, op, threshold, what in items:
        passed = value is not None and {"<=": value <= threshold, ">=": value >= threshold}[op]
        out.append(
            {
                "item": name,
                "value": value,
                "threshold": f"{op} {threshold}",
                "passed": bool(passed),
                "measures": what if value is not None else what + " (not measured: stage disabled or no data)",
            }
        )
    out.insert(1, _harm_item(audit, c.max_harm_violation_rate))
    return out


def apply_harm_labels(out: str, labels: str) -> dict:
    """Reviewers' labels of a finished run's audit sample (`audit/harm_sample.jsonl`) made its
    violation-rate estimate: report.json and report.html are rewritten, nothing is recomputed.
    Returns the new checklist item."""
    report_uri = storage.join(out, "report.json")
    if not storage.is_committed(out) or not storage.exists(report_uri):
        raise FileNotFoundError(f"{out} is not a finished curation run (no manifest or report.json)")
    report = storage.read_json(report_uri)
    if "harm_audit" not in report:
        raise ValueError(f"{out}/report.json has no harm audit: it was written before the audit existed")
    sample = [json.loads(line) for line in storage.read_bytes(storage.join(out, SAMPLE_FILE)).decode().splitlines()]
    audit = {
        **estimate(sample, HarmAuditConfig(labels=labels), None, "id", "text"),
        "max_rate": report["harm_audit"]["max_rate"],
    }
    item = _harm_item(audit, audit["max_rate"])
    report["harm_audit"] = audit
    report["checklist"] = [item if c["item"] == item["item"] else c for c in report["checklist"]]
    storage.write_json_atomic(report_uri, report)
    storage.write_bytes_atomic(storage.join(out, "report.html"), render_html(report).encode("utf-8"))
    return item


def pii_quality(pii_cfg) -> dict:
    """Recall and precision per PII type of the run's redactor (its configured types and
    regions) on the project's labelled PII set (lmfoundry.safety.pii_eval)."""
    from lmfoundry.safety.pii import PIIRedactor
    from lmfoundry.safety.pii_eval import score

    if not pii_cfg.enabled:
        return {"enabled": False}
    return {"enabled": True, "labelled_set": "lmfoundry.safety.pii_eval", **score(PIIRedactor(pii_cfg))}


def build_report(cfg, out: str, stats: list[dict], dedup: dict, timings: dict, started: float) -> dict:
    merged = _merge(stats)
    docs_in, kept = merged.get("documents", 0), merged.get("kept", 0)
    rejected = sum(merged.get("by_reason", {}).values())
    t = time.time()
    residual = residual_duplicate_rate(cfg, out, kept)
    timings = {**timings, "residual_duplicates": round(time.time() - t, 2)}
    t = time.time()
    audit = {**harm_audit(cfg, out, kept), "max_rate": cfg.checklist.max_harm_violation_rate}
    timings["harm_audit"] = round(time.time() - t, 2)
    remaining, funnel = docs_in, []
    for stage in FUNNEL:
        remaining -= merged.get("by_stage", {}).get(stage, 0)
        funnel.append({"after": stage, "documents": remaining})
    report = {
        "documents_in": docs_in,
        "documents_kept": kept,
        "documents_rejected": rejected,
        "accounted": docs_in == kept + rejected,
        "rejected_by_reason": dict(sorted(merged.get("by_reason", {}).items(), key=lambda kv: -kv[1])),
        "rejected_by_stage": merged.get("by_stage", {}),
        "funnel": funnel,
        "chars_in": merged.get("chars_in", 0),
        "chars_kept": merged.get("chars_kept", 0),
        "chars_kept_fraction": merged.get("chars_kept", 0) / max(merged.get("chars_in", 0), 1),
        "kept_languages": dict(sorted(merged.get("kept_languages", {}).items(), key=lambda kv: -kv[1])),
        "pii_redacted": merged.get("pii", {}),
        "pii": pii_quality(cfg.pii),
        "boilerplate_lines_removed": merged.get("boilerplate_lines_removed", 0),
        "c4_lines_removed": merged.get("c4_lines_removed", 0),
        "dedup": dedup,
        "residual_duplicates": residual,
        "harm_audit": audit,
        "histograms": {"bins": BINS, "range": [0, 1], **merged.get("hist", {})},
        "checklist": checklist(cfg, merged, residual, audit),
        "seconds": round(time.time() - started, 2),
        "phase_seconds": timings,
    }
    if not report["accounted"]:
        raise RuntimeError(f"curate lost documents: {docs_in} in, {kept} kept + {rejected} rejected")
    storage.write_json_atomic(storage.join(out, "report.json"), report)
    storage.write_bytes_atomic(storage.join(out, "report.html"), render_html(report).encode("utf-8"))
    return report


def _figure_png(draw) -> str:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 3.2))
    draw(ax)
    fig.tight_layout()
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=90)
    plt.close(fig)
    return f'<img alt="" src="data:image/png;base64,{base64.b64encode(buf.getvalue()).decode()}">'


def render_html(report: dict) -> str:
    def funnel(ax):
        names = ["input"] + [f["after"] for f in report["funnel"]]
        values = [report["documents_in"]] + [f["documents"] for f in report["funnel"]]
        ax.bar(names, values, color="#4477aa")
        ax.set_ylabel("documents")
        ax.set_title("documents remaining after each stage")

    def reasons(ax):
        items = list(report["rejected_by_reason"].items())[:15][::-1]
        ax.barh([k for k, _ in items], [v for _, v in items], color="#cc6677")
        ax.set_title("rejections by reason")

    def histogram(name):
        def draw(ax):
            h = report["histograms"].get(name, [0] * BINS)
            ax.bar(np.linspace(0, 1, BINS, endpoint=False), h, width=1 / BINS, align="edge", color="#228833")
            ax.set_title(f"{name} score (all documents scored)")

        return draw

    def languages(ax):
        items = list(report["kept_languages"].items())[:15]
        ax.bar([k or "unknown" for k, _ in items], [v for _, v in items], color="#aa3377")
        ax.set_title("kept documents by language")

    def value(v):
        return "-" if v is None else f"{v:.4f}"

    rows = "".join(
        f"<tr class={'pass' if c['passed'] else 'fail'}><td>{html.escape(c['item'])}</td>"
        f"<td>{value(c['value'])}</td><td>{html.escape(c['threshold'])}</td>"
        f"<td>{'pass' if c['passed'] else 'FAIL'}</td><td>{html.escape(c['measures'])}</td></tr>"
        for c in report["checklist"]
    )
    figures = [funnel, reasons, histogram("quality"), histogram("harm"), histogram("density"), languages]
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>lmfoundry curation report</title>
<style>body{{font-family:sans-serif;max-width:60em;margin:2em auto}}td,th{{padding:.2em .6em;text-align:left}}
.pass td:nth-child(4){{color:#228833}}.fail td:nth-child(4){{color:#cc3311;font-weight:bold}}</style></head><body>
<h1>Curation report</h1>
<p>{report["documents_in"]} documents in, {report["documents_kept"]} kept, {report["documents_rejected"]} rejected
({100 * report["chars_kept_fraction"]:.1f}% of characters kept) in {report["seconds"]} s.</p>
<h2>Data-quality checklist</h2>
<table><tr><th>item</th><th>value</th><th>threshold</th><th>result</th><th>what it measures</th></tr>{rows}</table>
<h2>Figures</h2>{"".join(_figure_png(f) for f in figures)}
<h2>PII redacted</h2><p>{html.escape(str(report["pii_redacted"]))}</p>
</body></html>"""
