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
from texts import CHINESE, FRENCH, GERMAN, JAPANESE, PARAPHRASE, PROSE, RUSSIAN, SPANISH, TECH_DOC

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[1]
CONTACT = (
    "Thank you for your order of the garden tools. The parcel left our warehouse this morning and "
    "should reach you within three working days. If anything is missing or damaged, write to "
    "jane@example.com or call +44 20 7946 0958, and we will send a replacement at once. We hope the "
    "tools serve you well through the coming season. With kind regards from the whole team at the shop."
)


def table(out, part):
    return pq.read_table(f"{out}/{part}").to_pandas().sort_values("id").reset_index(drop=True)


def test_killed_run_resumes_and_equals_a_clean_run(ray_local, own_ray_env, sample_corpus, curated, tmp_path):
    from lmfoundry.data.curate import CurateConfig, run_curate

    raw, (clean_out, clean) = sample_corpus[0], curated

    # A run in its own process (its own Ray), one document worker, killed with SIGKILL as soon
    # as it has committed a shard.
    out = tmp_path / "killed"
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "lmfoundry.jobs.curate",
            "configs/curate.yaml",
            "--input",
            raw,
            "--output",
            str(out),
            "--set",
            "workers=1",
        ],
        cwd=REPO,
        env=own_ray_env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    docs = out / "_work" / "docs"
    deadline = time.time() + 300
    while not list(docs.glob("*.json")) and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert list(docs.glob("*.json")), "the first run never committed a shard"
    assert not (out / "_MANIFEST.json").exists()
    done_before = {p.name: p.stat().st_mtime_ns for p in (out / "_work" / "docs").glob("*.json")}
    assert len(done_before) < 2

    resumed = run_curate(CurateConfig(input=raw, output=str(out)))
    # the shards finished before the kill were not redone
    assert all((out / "_work" / "docs" / n).stat().st_mtime_ns == t for n, t in done_before.items())
    for part in ("kept", "rejected"):
        a, b = table(clean_out, part), table(out, part)
        assert a.equals(b), part
    kept = table(out, "kept")
    assert kept["id"].is_unique and kept["text"].is_unique
    assert resumed["documents_in"] == clean["documents_in"] == resumed["documents_kept"] + resumed["documents_rejected"]
    assert resumed["rejected_by_reason"] == clean["rejected_by_reason"]
    assert sorted(p.name for p in (out / "kept").iterdir()) == ["shard-00000.parquet", "shard-00001.parquet"]


def test_multilingual_text_folder_with_pii_harm_and_the_checklist(ray_local, tmp_path):
    from lmfoundry.data.curate import ChecklistFailed, CurateConfig, run_curate
    from lmfoundry.platform import cli

    raw = tmp_path / "txt"
    docs = {
        "en/prose.txt": PROSE,
        "en/tech.md.txt": TECH_DOC,
        "de/stadt.txt": GERMAN,
        "fr/village.txt": FRENCH,
        "es/biblioteca.txt": SPANISH,
        "ru/gorod.txt": RUSSIAN,
        "zh/city.txt": CHINESE,
        "ja/town.txt": JAPANESE,
        "en/contact.txt": CONTACT,
        "en/harm.txt": PROSE + " Then he explained how to make a bomb.",
        "en/copy.txt": PROSE,
        "en/paraphrase.txt": PARAPHRASE,
    }
    for name, text in docs.items():
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        (raw / name).write_text(text)
    out = tmp_path / "out"
    # the violation rate judged by a second scorer that did not filter: a blocklist of its own,
    # which one kept document (the German one) hits
    audit_terms = tmp_path / "audit_terms.txt"
    audit_terms.write_text("mittelalter\n")
    # semantic dedup on, with a threshold this paraphrase (cosine 0.86, Jaccard 0.04) is above
    report = run_curate(
        CurateConfig(
            input=str(raw),
            output=str(out),
            text_files_per_shard=4,
            workers=2,
            dedup={"semantic": {"enabled": True, "similarity": 0.85, "clusters": 2}},
            checklist={"harm_audit": {"scorer": {"blocklist": str(audit_terms), "offensive_language": False}}},
        )
    )
    kept, rejected = table(out, "kept"), table(out, "rejected")
    assert report["documents_in"] == 12 and report["accounted"]
    assert set(kept["lang"]) == {"en", "de", "fr", "es", "ru", "zh", "ja"}
    assert dict(zip(rejected["id"], rejected["reason"])) == {  # en/copy.txt sorts first: it stays
        "en/harm.txt": "harmful_content",
        "en/prose.txt": "exact_duplicate",
        "en/paraphrase.txt": "semantic_duplicate",
    }
    assert set(rejected["duplicate_of"].dropna()) == {"en/copy.txt"}
    contact = kept.set_index("id").loc["en/contact.txt"]
    assert "<EMAIL>" in contact["text"] and "<PHONE>" in contact["text"] and "jane@" not in contact["text"]
    assert report["pii_redacted"]["email"] == 1 and report["pii_redacted"]["phone"] == 1
    checks = {c["item"]: c for c in report["checklist"]}
    assert checks["non-English share"]["passed"] and checks["non-English share"]["value"] == pytest.approx(6 / 9)
    harm = checks["harmful-content violation rate"]
    assert (harm["estimate"], harm["value"]) == ("second_scorer", pytest.approx(1 / 9))
    assert harm["ci95"][0] < 1 / 9 < harm["ci95"][1] and not harm["passed"]  # 9 documents prove little
    sample = [json.loads(line) for line in (out / "audit/harm_sample.jsonl").read_text().splitlines()]
    assert sorted(d["id"] for d in sample) == sorted(kept["id"]) and {d["harmful"] for d in sample} == {None}
    # reviewers label the sample afterwards; `lmfoundry harm-audit` applies it to the report
    labels = tmp_path / "labels.jsonl"
    labels.write_text("".join(json.dumps({**d, "harmful": False}) + "\n" for d in sample[:5]))
    assert cli.main(["harm-audit", str(out), "--labels", str(labels), "--enforce"]) == 1  # 0 of 5 proves little
    relabelled = {c["item"]: c for c in json.loads((out / "report.json").read_text())["checklist"]}
    harm = relabelled["harmful-content violation rate"]
    assert (harm["estimate"], harm["value"], harm["ci95"][0]) == ("labelled_audit", 0, 0) and not harm["passed"]
    assert "5 labelled of a 9-document sample" in (out / "report.html").read_text()
    assert "Curation report" in (out / "report.html").read_text()
    assert json.loads((out / "report.json").read_text())["documents_kept"] == len(kept)

    # The same input with the checklist enforced and an unreachable threshold fails loudly.
    strict = CurateConfig(
        input=str(raw),
        output=str(tmp_path / "strict"),
        text_files_per_shard=4,
        checklist={"enforce": True, "min_high_density_share": 0.99},
    )
    with pytest.raises(ChecklistFailed, match="high-density share"):
        run_curate(strict)


def test_distributed_dedup_finds_the_clusters_a_union_find_finds(curated):
    """The session's curated sample corpus (planted exact and near duplicates): the clusters the
    distributed connected components left (each rejected duplicate with the document it
    duplicates) are the clusters a union-find over the same documents finds in one process."""
    from lmfoundry.data.dedup import DedupConfig, cluster_in_process

    kept, rejected = table(curated[0], "kept"), table(curated[0], "rejected")
    dups = rejected[rejected["stage"] == "dedup"]
    assert len(dups) >= 10 and set(dups["reason"]) == {"exact_duplicate", "near_duplicate"}
    docs = [*zip(kept["id"], kept["text"]), *zip(dups["id"], dups["text"])]
    uf = cluster_in_process([text for _, text in docs], DedupConfig())
    expected: dict[int, set[str]] = {}
    for i, (doc_id, _) in enumerate(docs):
        expected.setdefault(uf.find(i), set()).add(doc_id)
    found: dict[str, set[str]] = {}
    for doc_id, rep in zip(dups["id"], dups["duplicate_of"]):
        found.setdefault(rep, {rep}).add(doc_id)
    assert sorted(map(sorted, found.values())) == sorted(sorted(c) for c in expected.values() if len(c) > 1)
    assert set(found) <= set(kept["id"])  # every cluster keeps its representative


def test_shuffle_v2_finds_the_duplicates_the_sort_shuffle_finds(sample_corpus, curated, tmp_path, monkeypatch):
    """dedup.shuffle v2 (the driver holds none of the shuffles' pieces) writes the same
    duplicates as the default sort shuffle, from the session's curated corpus's document shards.
    The dedup runs under v2 with its own partition count, and Ray Data's settings are given
    back afterwards."""
    import shutil

    import ray
    from ray.data.context import ShuffleStrategy

    import lmfoundry.data.dedup_pipeline as pipeline
    from lmfoundry.data.curate import CurateConfig

    context = ray.data.DataContext.get_current()
    saved = context.shuffle_strategy, context.default_hash_shuffle_parallelism
    monkeypatch.setattr(context, "shuffle_strategy", ShuffleStrategy.HASH_SHUFFLE)  # neither of the two
    monkeypatch.setattr(context, "default_hash_shuffle_parallelism", 13)
    seen = []
    find = pipeline.find_and_write_duplicates

    def spy(cfg, out, files, num_kept, parts, stats):
        now = ray.data.DataContext.get_current()
        seen.append((now.shuffle_strategy, now.default_hash_shuffle_parallelism, parts))
        return find(cfg, out, files, num_kept, parts, stats)

    monkeypatch.setattr(pipeline, "find_and_write_duplicates", spy)
    shutil.copytree(Path(curated[0]) / "_work" / "docs", tmp_path / "_work" / "docs")
    shards = len(list((tmp_path / "_work" / "docs").glob("*.parquet")))
    cfg = CurateConfig(input=sample_corpus[0], output=str(tmp_path), dedup={"shuffle": "v2"})
    stats = pipeline.run_dedup(cfg, str(tmp_path), shards)

    [(strategy, partitions, parts)] = seen
    assert strategy == ShuffleStrategy.SHUFFLE_V2 and partitions == parts == stats["partitions"]
    assert (context.shuffle_strategy, context.default_hash_shuffle_parallelism) == (ShuffleStrategy.HASH_SHUFFLE, 13)
    assert saved != (ShuffleStrategy.HASH_SHUFFLE, 13)

    def duplicates(out):
        t = pq.read_table(Path(out) / "_work" / "dedup" / "duplicates").to_pandas()
        return t.sort_values("doc_key").reset_index(drop=True)

    ours, sorts = duplicates(tmp_path), duplicates(curated[0])
    assert stats["exact_duplicates"] + stats["near_duplicates"] == len(sorts) >= 10
    assert ours.equals(sorts)


def test_the_curate_job_starts_its_workers_with_small_results_kept_out_of_the_driver(tmp_path, monkeypatch):
    """`lmfoundry curate` connects with the worker environment that keeps small results out of
    the driver's heap (platform/ray_env.py, measured by benchmarks/dedup_memory.py). A user's
    own value wins and travels to the workers; a job submitted with the variable in its runtime
    environment keeps it there (Ray refuses the same key from the job and from ray.init)."""
    import json

    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    import lmfoundry.jobs.curate as job
    import lmfoundry.platform.ray_env as ray_env

    seen = []
    monkeypatch.setattr(ray_env, "init_ray", lambda address=None, worker_env=None: seen.append(worker_env))
    monkeypatch.setattr(job, "run_curate", lambda cfg: {"ok": True})
    (tmp_path / "raw").mkdir()
    argv = ["configs/curate.yaml", "--input", str(tmp_path / "raw"), "--output", str(tmp_path / "out")]
    monkeypatch.chdir(REPO)
    monkeypatch.delenv("RAY_max_direct_call_object_size", raising=False)
    monkeypatch.delenv(RAY_JOB_CONFIG_JSON_ENV_VAR, raising=False)
    assert job.main(argv) == 0
    monkeypatch.setenv("RAY_max_direct_call_object_size", "4096")
    assert job.main(argv) == 0
    submitted = {"runtime_env": {"env_vars": {"RAY_max_direct_call_object_size": "4096"}}}
    monkeypatch.setenv(RAY_JOB_CONFIG_JSON_ENV_VAR, json.dumps(submitted))
    assert job.main(argv) == 0
    key = "RAY_max_direct_call_object_size"
    assert seen == [{key: "1024"}, {key: "4096"}, {}]
