"""docs/figures.md is generated from benchmarks/results/*.json by benchmarks/figures.py: the page
must match what the results render to (compared as text: a clone does not keep file times)."""

from __future__ import annotations

import importlib.util
import json
import shutil
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "benchmarks" / "figures.py"
RESULTS = ROOT / "benchmarks" / "results"
PAGE = ROOT / "docs" / "figures.md"


def load_figures():
    spec = importlib.util.spec_from_file_location("benchmarks_figures", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


figures = load_figures()


def test_figures_page_is_up_to_date():
    rendered = figures.page(figures.render(RESULTS))
    assert PAGE.read_text() == rendered, (
        "docs/figures.md is out of date with benchmarks/results/*.json: "
        f"{figures.stale(RESULTS, PAGE)}; regenerate it with `python benchmarks/figures.py`"
    )


def test_every_results_file_has_a_section_with_its_provenance():
    sections = figures.split_page(PAGE.read_text())
    assert sorted(sections) == sorted(p.name for p in RESULTS.glob("*.json"))
    for text in sections.values():
        for field in ("- machine: ", "- date: ", "- command: "):
            assert field in text


def test_rendering_is_deterministic():
    assert figures.page(figures.render(RESULTS)) == figures.page(figures.render(RESULTS))


def test_check_fails_naming_the_changed_results_file(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    page = tmp_path / "figures.md"
    assert figures.main(["--results", str(results), "--output", str(page)]) == 0
    assert figures.main(["--check", "--results", str(results), "--output", str(page)]) == 0

    changed = sorted(results.glob("*.json"))[0]
    data = json.loads(changed.read_text())
    data["command"] = "python benchmarks/example.py --changed"
    changed.write_text(json.dumps(data, indent=2))

    assert figures.stale(results, page) == [f"benchmarks/results/{changed.name} (its section differs)"]
    run = subprocess.run(
        [sys.executable, str(SCRIPT), "--check", "--results", str(results), "--output", str(page)],
        capture_output=True,
        text=True,
    )
    assert run.returncode == 1
    assert changed.name in run.stderr
    assert "python benchmarks/figures.py" in run.stderr


def test_check_names_added_and_removed_results_files(tmp_path):
    results = tmp_path / "results"
    shutil.copytree(RESULTS, results)
    page = tmp_path / "figures.md"
    figures.main(["--results", str(results), "--output", str(page)])
    first = sorted(results.glob("*.json"))[0]
    first.unlink()
    (results / "zz_new.json").write_text(json.dumps({"machine": "m", "value": 1}))
    problems = figures.stale(results, page)
    assert f"benchmarks/results/{first.name} (section of a file that is gone)" in problems
    assert "benchmarks/results/zz_new.json (its section differs)" in problems
