"""The whole lifecycle end to end, as a user runs it: `lmfoundry quickstart`."""

import json
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = pytest.mark.timeout(1200)


def test_quickstart_runs_every_stage_and_serves_a_reply(own_ray_env, tmp_path):
    work = tmp_path / "qs"
    cli = str(Path(sys.executable).with_name("lmfoundry"))
    cmd = [
        cli,
        "quickstart",
        "--workdir",
        str(work),
        "--set",
        "corpus.num_clean_docs=250",
        "--set",
        "pretrain.schedule.max_steps=20",
        "--set",
        "pretrain.checkpointing.every=10",
        "--set",
        "pretrain.schedule.warmup_steps=4",
        "--set",
        f"serve.port={free_port()}",
    ]
    r = subprocess.run(cmd, env=own_ray_env, capture_output=True, text=True, timeout=1100)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    assert f"work directory {work}" in r.stdout
    assert "assistant:" in r.stdout
    for n, stage in enumerate(["sample corpus", "curate", "pack", "pretrain", "evaluate", "serve"], 1):
        assert f"[{n}/6] {stage}" in r.stdout
    figures = json.loads((work / "quickstart.json").read_text())
    assert figures["pretrain"]["final_loss"] < figures["pretrain"]["first_loss"]
    assert figures["evaluate"]["val_perplexity"] < figures["evaluate"]["uniform_perplexity"]
    for stage in ("raw", "curated", "packed", "pretrain", "eval"):
        assert (work / stage / "_MANIFEST.json").exists(), stage
    assert any((work / "curated" / "rejected").glob("*.parquet"))
