"""`ray job submit --working-dir .` against a real `ray start --head` cluster started here."""

import re
import subprocess
import sys
import uuid
from pathlib import Path

import pytest
from conftest import wait_until

pytestmark = pytest.mark.timeout(900)
REPO = Path(__file__).resolve().parents[1]


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def test_curate_job_submitted_to_a_local_cluster_succeeds(ray_head, sample_corpus, tmp_path):
    address, env = ray_head
    job_id = f"lmfoundry-test-{uuid.uuid4().hex[:8]}"
    out = tmp_path / "curated"
    submit = [
        ray_cli(),
        "job",
        "submit",
        "--address",
        address,
        "--submission-id",
        job_id,
        "--working-dir",
        str(REPO),
        "--",
        "python",
        "-m",
        "lmfoundry.jobs.curate",
        "configs/curate.yaml",
        "--input",
        sample_corpus[0],
        "--output",
        str(out),
    ]
    starting = ("Failed to connect", "No available agent")  # dashboard, then job agent, not up yet
    tries = []

    def submitted():
        tries.append(subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600, cwd=REPO))
        return tries[-1].returncode == 0 or not any(s in tries[-1].stdout + tries[-1].stderr for s in starting)

    wait_until(submitted, 240, lambda: "the job API to come up: " + tries[-1].stderr[-2000:], interval=1)
    r = tries[-1]
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    status = subprocess.run(
        [ray_cli(), "job", "status", "--address", address, job_id],
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    plain = re.sub(r"\x1b\[[0-9;]*m", "", status.stdout + status.stderr)
    assert f"Job '{job_id}' succeeded" in plain, plain
    assert (out / "_MANIFEST.json").exists() and (out / "report.json").exists()
    assert any((out / "kept").glob("*.parquet"))
