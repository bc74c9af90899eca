"""`ray job submit --working-dir .` against a real `ray start --head` cluster started here."""

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pytest
from conftest import free_port

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]
REPO = Path(__file__).resolve().parents[1]


def ray_cli() -> str:
    return str(Path(sys.executable).with_name("ray"))


def test_curate_job_submitted_to_a_local_cluster_succeeds(sample_corpus, tmp_path):
    gcs, dash, agent = free_port(), free_port(), free_port()
    temp_dir = tempfile.mkdtemp(prefix="rj", dir="/tmp")  # short: Ray's socket paths have a length limit
    # The entrypoint's `python` is looked up on the PATH the cluster was started with, as on a
    # cluster node whose PATH holds the environment lmfoundry is installed in.
    env = {
        **os.environ,
        "RAY_AUTH_MODE": "token",
        "PATH": f"{Path(sys.executable).parent}{os.pathsep}{os.environ.get('PATH', '')}",
    }
    env.pop("RAY_ADDRESS", None)
    # --block keeps `ray start` in the foreground; terminating it stops exactly this cluster.
    head = subprocess.Popen(
        [
            ray_cli(),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            # the job agent's HTTP port is fixed by default (52365): another Ray on this machine
            # (the session's local one) would hold it and the job API would have no agent
            f"--dashboard-agent-listen-port={agent}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        address = f"http://127.0.0.1:{dash}"
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
        deadline = time.time() + 240
        starting = ("Failed to connect", "No available agent")  # dashboard, then job agent, not up yet
        while True:
            r = subprocess.run(submit, env=env, capture_output=True, text=True, timeout=600, cwd=REPO)
            if r.returncode == 0 or time.time() > deadline or not any(s in r.stdout + r.stderr for s in starting):
                break
            time.sleep(3)
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
    finally:
        head.terminate()
        try:
            head.wait(timeout=60)
        except subprocess.TimeoutExpired:
            head.kill()
        shutil.rmtree(temp_dir, ignore_errors=True)
