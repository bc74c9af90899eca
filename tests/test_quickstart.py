"""The whole lifecycle end to end, as a user runs it (`lmfoundry quickstart`), with everything in
an object-store bucket: raw and curated data, token shards, checkpoints (pretraining killed midway
and resumed from the bucket), the evaluation report, and the API key and traffic files the server
reads. The local-disk stages are the session fixtures' (tests/conftest.py)."""

import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

from lmfoundry.platform import checkpoint, keys, storage
from lmfoundry.serving.traffic import write_split

pytestmark = pytest.mark.timeout(1200)


def test_quickstart_runs_every_stage_in_a_bucket_through_a_killed_worker(
    own_ray_serve_env, s3_server, s3_bucket, tmp_path
):
    work = f"{s3_bucket}/qs"
    write_split(f"{s3_bucket}/serve/traffic.json", {"main": 1.0})
    cwd = tmp_path / "cwd"
    cwd.mkdir()
    cli = str(Path(sys.executable).with_name("lmfoundry"))
    settings = {
        "corpus.num_clean_docs": 250,
        "pretrain.schedule.max_steps": 8,
        "pretrain.schedule.warmup_steps": 2,
        "pretrain.checkpointing.every": 4,
        "pretrain.logging.every": 1,
        # SIGKILL while saving step 8: saves go one at a time, so step 4's is committed by then
        # and the run must resume from it (a kill right after a step can beat the save before it)
        "pretrain.drills": "[{at_step: 8, rank: 1, during_save: true}]",
        "pretrain.health.max_failures": 1,
        "serve.port": free_port(),
        "serve.keys_file": f"{s3_bucket}/serve/keys.json",
        "serve.traffic_file": f"{s3_bucket}/serve/traffic.json",
    }
    cmd = [cli, "quickstart", "--workdir", work, *(a for k, v in settings.items() for a in ("--set", f"{k}={v}"))]
    r = subprocess.run(
        cmd, env={**own_ray_serve_env, **s3_server}, cwd=cwd, capture_output=True, text=True, timeout=1100
    )
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"work directory {work}" in r.stdout
    assert "assistant:" in r.stdout
    for n, stage in enumerate(["sample corpus", "curate", "pack", "pretrain", "evaluate", "serve"], 1):
        assert f"[{n}/6] {stage}" in r.stdout
    assert list(cwd.iterdir()) == []  # nothing landed on local disk instead of the bucket

    figures = storage.read_json(f"{work}/quickstart.json")
    assert figures["pretrain"]["final_loss"] < figures["pretrain"]["first_loss"]
    assert figures["evaluate"]["val_perplexity"] < figures["evaluate"]["uniform_perplexity"]
    for stage in ("raw", "curated", "packed", "pretrain", "eval"):
        assert storage.is_committed(f"{work}/{stage}"), stage
    assert storage.list_files(f"{work}/curated/rejected", (".parquet",))
    assert storage.list_files(f"{work}/packed", (".parquet",))
    assert len(storage.list_files(f"{work}/pretrain/_drills")) == 1  # the kill happened
    assert f"resumed from {work}/pretrain/checkpoints/step-00000004" in r.stdout + r.stderr
    steps = [row["step"] for row in storage.read_jsonl(f"{work}/pretrain/metrics.jsonl")]
    assert steps == list(range(1, 9))  # resumed: every step once, none skipped or repeated
    assert [s for s, _ in checkpoint.committed_checkpoints(f"{work}/pretrain")] == [4, 8]
    assert storage.list_files(f"{work}/eval", (".json",))
    assert [k["tenant"] for k in keys.read_store(f"{s3_bucket}/serve/keys.json")] == ["quickstart"]
