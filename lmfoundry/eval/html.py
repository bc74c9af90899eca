"""`report.html`: one self-contained page (no scripts, no external files) with the tracked
metrics, the gate's verdict, each suite's table, the needle heat map and the red-team breakdown."""

from __future__ import annotations

import html

STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:70em;color:#222}
table{border-collapse:collapse;margin:.5em 0 1.5em}td,th{border:1px solid #ccc;padding:.25em .6em;text-align:right}
th{background:#f3f3f3}td.l,th.l{text-align:left}.fail{color:#b00;font-weight:bold}.pass{color:#070;font-weight:bold}
.heat td{width:3.5em;text-align:center}"""


def _e(value) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return html.escape(str(value))


def _table(header: list[str], rows: list[list], cls: str = "") -> str:
    head = "".join(f"<th{' class=l' if i == 0 else ''}>{_e(h)}</th>" for i, h in enumerate(header))
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=l' if i == 0 else ''}>{c if str(c).startswith('<') else _e(c)}</td>"
            for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table class='{cls}'><tr>{head}</tr>{body}</table>"


def _rate_rows(section: dict) -> list[list]:
    return [
        [name, r["rate"], f"{r['count']}/{r['n']}", f"[{r['ci95'][0]:.2f}, {r['ci95'][1]:.2f}]"]
        for name, r in section.items()
        if isinstance(r, dict) and "rate" in r
    ]


def _heat_cell(value: float) -> str:
    # white (0) to green (1)
    shade = int(255 - 155 * value)
    return f"<span style='display:block;background:rgb({shade},255,{shade})'>{value:.2f}</span>"


def write_html(report: dict) -> str:
    parts = [f"<h1>Evaluation of {_e(report.get('checkpoint') or report.get('endpoint') or report['model'])}</h1>"]
    if report.get("step") is not None:
        parts.append(f"<p>step {_e(report['step'])}</p>")
    g = report.get("gate")
    if g:
        verdict = "<span class=pass>passed</span>" if g["passed"] else "<span class=fail>FAILED</span>"
        parts.append(f"<h2>Gate against {_e(g['baseline'])}: {verdict}</h2>")
        parts.append(
            _table(
                ["metric", "baseline", "value", "better", "worse by", "allowed", ""],
                [
                    [
                        c["metric"],
                        c["baseline"],
                        c["value"],
                        c["direction"],
                        c["worse_by"],
                        c["allowed"],
                        "<span class=fail>regressed</span>" if c in g["regressions"] else "ok",
                    ]
                    for c in g["checked"]
                ]
                + [[m, "", "missing", "", "", "", "<span class=fail>missing</span>"] for m in g["missing"]],
            )
        )
    parts.append("<h2>Tracked metrics</h2>")
    parts.append(_table(["metric", "value"], [[k, v] for k, v in sorted(report["metrics"].items())]))
    if report.get("tasks"):
        parts.append("<h2>Tasks</h2>")
        parts.append(
            _table(
                ["task", "type", "documents", "metrics"],
                [
                    [n, t["output_type"], t["documents"], ", ".join(f"{k} {v:.3f}" for k, v in t["metrics"].items())]
                    for n, t in report["tasks"].items()
                ],
            )
        )
    for axis in ("helpful", "harmless", "honest"):
        if axis in report:
            parts.append(f"<h2>{axis.capitalize()}</h2>")
            parts.append(_table(["measure", "rate", "count", "95% interval"], _rate_rows(report[axis])))
    cal = (report.get("honest") or {}).get("calibration")
    if cal:
        parts.append(
            "<p>calibration: "
            + (
                _e(cal["skipped"])
                if "skipped" in cal
                else f"ECE {cal['ece']:.3f}, accuracy {cal['accuracy']:.3f}, mean confidence "
                f"{cal['mean_confidence']:.3f} over {cal['n']} questions"
            )
            + "</p>"
        )
    lc = report.get("long_context")
    if lc:
        parts.append(f"<h2>Needle in a haystack ({_e(lc['mode'])})</h2>")
        parts.append(
            f"<p>effective context length: <b>{lc['effective_context_length']}</b> tokens "
            f"(retrieval at or above {lc['threshold']:.2f}; chance {lc['chance']:.2f})</p>"
        )
        parts.append(
            _table(
                ["length \\ depth", *[f"{d:.2f}" for d in lc["depths"]]],
                [[L, *[_heat_cell(v) for v in row]] for L, row in zip(lc["lengths"], lc["heatmap"])],
                cls="heat",
            )
        )
    rt = report.get("red_team") or {}
    if "attack_success_rate" in rt:
        parts.append(f"<h2>Red team (seed {rt['seed']}, {rt['attacks']} fresh attacks)</h2>")
        parts.append(
            _table(
                ["family", "success rate", "count", "95% interval"],
                _rate_rows({"all": rt["attack_success_rate"], **rt["by_family"]}),
            )
        )
        if rt.get("by_category"):
            parts.append(
                _table(["goal category", "success rate", "count", "95% interval"], _rate_rows(rt["by_category"]))
            )
        if rt.get("search"):
            search = rt["search"]
            parts.append(
                f"<h3>Attacker loop ({len(search['rounds'])} rounds, {search['attacks']} attempts)</h3>"
                f"<p>goals broken: {search['goal_success_rate_first_round']['rate']:.3f} by the first round, "
                f"{search['goal_success_rate']['rate']:.3f} with the search</p>"
            )
            parts.append(
                _table(
                    ["strategy", "success rate", "count", "95% interval"],
                    _rate_rows({"all": search["attack_success_rate"], **search["by_strategy"]}),
                )
            )
        if rt.get("replay"):
            parts.append(
                f"<p>replayed regression attacks: {rt['replay']['attack_success_rate']['rate']:.3f} "
                f"of {rt['replay']['attacks']} still succeed</p>"
            )
        if rt["successful_examples"]:
            parts.append(
                _table(
                    ["family", "attack", "reply"],
                    [[x["family"], x["prompt"][:300], x["reply"][:300]] for x in rt["successful_examples"]],
                )
            )
    if rt.get("garak"):
        parts.append(f"<h2>garak {rt['garak']['garak_version']} ({rt['garak']['generator']})</h2>")
        parts.append(_table(["probe", "failure rate", "count", "95% interval"], _rate_rows(rt["garak"]["by_probe"])))
    return (
        f"<!doctype html><html><head><meta charset='utf-8'><title>lmfoundry evaluation</title>"
        f"<style>{STYLE}</style></head><body>{''.join(parts)}</body></html>"
    )
