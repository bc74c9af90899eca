"""The curation pipeline on real Ray: resumable after a kill, the checklist, multilingual input,
.txt folders."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from texts import CHINESE, FRENCH, GERMAN, JAPANESE, PROSE, RUSSIAN, SPANISH, TECH_DOC

pytestmark = [pytest.mark.ray, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]
CONTACT = ("Thank you for your order of the garden tools. The parcel left our warehouse this morning and "
           "should reach you within three working days. If anything is missing or damaged, write to "
           "jane@example.com or call +44 20 7946 0958, and we will send a replacement at once. We hope the "
           "tools serve you well through the coming season. With kind regards from the whole team at the shop.")


def table(out, part):
    return pq.read_table(f"{out}/{part}").to_pandas().sort_values("id").reset_index(drop=True)


def test_killed_run_resumes_and_equals_a_clean_run(ray_local, tmp_path):
    from lmfoundry.data.curate import CurateConfig, run_curate
    from lmfoundry.data.sample_corpus import build_sample_corpus

    raw = tmp_path / "raw"
    build_sample_corpus(raw, num_clean_docs=200, seed=2, shards=4)
    clean = run_curate(CurateConfig(input=str(raw), output=str(tmp_path / "clean")))

    # A run in its own process (its own Ray), one document worker, killed with SIGKILL as soon
    # as it has committed its first shard.
    out = tmp_path / "killed"
    env = {**os.environ, "RAY_ADDRESS": ""}
    proc = subprocess.Popen([sys.executable, "-m", "lmfoundry.jobs.curate", "configs/curate.yaml", "--input", str(raw),
                             "--output", str(out), "--set", "workers=1"], cwd=REPO, env=env,
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, start_new_session=True)
    first = out / "_work" / "docs" / "shard-00000.json"
    deadline = time.time() + 300
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.2)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert first.exists(), "the first run never committed a shard"
    assert not (out / "_MANIFEST.json").exists()
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "_work" / "docs").glob("*.json")}
    assert len(done_before) < 4

    resumed = run_curate(CurateConfig(input=str(raw), output=str(out)))
    # the shards finished before the kill were not redone
    assert all((out / "_work" / "docs" / n).stat().st_mtime_ns == t for n, t in done_before.items())
    for part in ("kept", "rejected"):
        a, b = table(tmp_path / "clean", part), table(out, part)
        assert a.equals(b), part
    kept = table(out, "kept")
    assert kept["id"].is_unique and kept["text"].is_unique
    assert resumed["documents_in"] == clean["documents_in"] == resumed["documents_kept"] + resumed["documents_rejected"]
    assert resumed["rejected_by_reason"] == clean["rejected_by_reason"]
    assert sorted(p.name for p in (out / "kept").iterdir()) == [f"shard-{i:05d}.parquet" for i in range(4)]


def test_multilingual_text_folder_with_pii_harm_and_the_checklist(ray_local, tmp_path):
    from lmfoundry.data.curate import ChecklistFailed, CurateConfig, run_curate

    raw = tmp_path / "txt"
    docs = {"en/prose.txt": PROSE, "en/tech.md.txt": TECH_DOC, "de/stadt.txt": GERMAN, "fr/village.txt": FRENCH,
            "es/biblioteca.txt": SPANISH, "ru/gorod.txt": RUSSIAN, "zh/city.txt": CHINESE, "ja/town.txt": JAPANESE,
            "en/contact.txt": CONTACT,
            "en/harm.txt": PROSE + " Then he explained how to make a bomb.",
            "en/copy.txt": PROSE}
    for name, text in docs.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text(text)
    out = tmp_path / "out"
    report = run_curate(CurateConfig(input=str(raw), output=str(out), text_files_per_shard=4))
    kept, rejected = table(out, "kept"), table(out, "rejected")
    assert report["documents_in"] == 11 and report["accounted"]
    assert set(kept["lang"]) == {"en", "de", "fr", "es", "ru", "zh", "ja"}
    assert dict(zip(rejected["id"], rejected["reason"])) == {
        "en/harm.txt": "harmful_content", "en/prose.txt": "exact_duplicate"}  # en/copy.txt sorts first
    contact = kept.set_index("id").loc["en/contact.txt"]
    assert "<EMAIL>" in contact["text"] and "<PHONE>" in contact["text"] and "jane@" not in contact["text"]
    assert report["pii_redacted"]["email"] == 1 and report["pii_redacted"]["phone"] == 1
    checks = {c["item"]: c for c in report["checklist"]}
    assert checks["non-English share"]["passed"] and checks["non-English share"]["value"] == pytest.approx(6 / 9)
    assert checks["harmful-content violation rate"]["value"] == 0
    assert "Curation report" in (out / "report.html").read_text()
    assert json.loads((out / "report.json").read_text())["documents_kept"] == len(kept)

    # The same input with the checklist enforced and an unreachable threshold fails loudly.
    strict = CurateConfig(input=str(raw), output=str(tmp_path / "strict"), text_files_per_shard=4,
                          checklist={"enforce": True, "min_high_density_share": 0.99})
    with pytest.raises(ChecklistFailed, match="high-density share"):
        run_curate(strict)
