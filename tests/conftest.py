"""Shared fixtures: one real local Ray per session and a tiny lifecycle whose artifacts the
stage tests reuse (corpus -> curated -> packed -> pretrained), each built once."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path

import pytest

# the harnesses that tests and benchmarks share (benchmarks/harness)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from lmfoundry.platform.ray_env import init_ray

    init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture(scope="session")
def sample_corpus(tmp_path_factory):
    from lmfoundry.data.sample_corpus import build_sample_corpus

    out = tmp_path_factory.mktemp("raw")
    details = build_sample_corpus(out, num_clean_docs=300, seed=1, shards=2)
    return str(out), details


@pytest.fixture(scope="session")
def curated(ray_local, sample_corpus, tmp_path_factory):
    from lmfoundry.data.curate import CurateConfig, run_curate

    out = str(tmp_path_factory.mktemp("curated"))
    report = run_curate(CurateConfig(input=sample_corpus[0], output=out))
    return out, report


@pytest.fixture(scope="session")
def packed(curated, tmp_path_factory):
    from lmfoundry.data.pack import PackConfig, run_pack

    out = str(tmp_path_factory.mktemp("packed"))
    manifest = run_pack(PackConfig(input=curated[0], output=out, vocab_size=1024, seq_len=64, val_fraction=0.1))
    return out, manifest


def tiny_pretrain_config(data: str, output: str, **overrides):
    """The session's reference run: 2 workers, ZeRO-2, 40 steps, every step logged. An override
    of a section (e.g. schedule={"max_steps": 8}) changes only the keys it names."""
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.train.config import PretrainConfig

    settings = dict(
        data=data,
        output=output,
        model=ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2),
        parallelism={"num_workers": 2, "zero_stage": 2},
        batch={"micro_batch_size": 4, "global_batch_tokens": 2 * 4 * 64 * 2},
        schedule={"max_steps": 40, "warmup_steps": 5},
        optimizer={"lr": 5e-3},
        checkpointing={"every": 10},
        logging={"every": 1},
    )
    for key, value in overrides.items():
        section = settings.get(key)
        settings[key] = {**section, **value} if isinstance(section, dict) else value
    return PretrainConfig(**settings)


@pytest.fixture(scope="session")
def pretrained(packed, tmp_path_factory):
    from lmfoundry.train.pretrain import run_pretrain

    out = str(tmp_path_factory.mktemp("runs") / "tiny")
    manifest = run_pretrain(tiny_pretrain_config(packed[0], out))
    return out, manifest


@pytest.fixture(scope="session")
def postgres_dsn():
    """A throwaway PostgreSQL server (initdb + pg_ctl from the machine's PostgreSQL), or a skip
    that says what is missing."""
    import glob
    import shutil
    import subprocess
    import tempfile

    # on PATH, or where Debian's postgresql package puts the server's programs
    path = os.pathsep.join([os.environ.get("PATH", ""), *sorted(glob.glob("/usr/lib/postgresql/*/bin"))])
    initdb, pg_ctl = shutil.which("initdb", path=path), shutil.which("pg_ctl", path=path)
    if not initdb or not pg_ctl:
        pytest.skip("PostgreSQL is not installed here (no initdb / pg_ctl on PATH)")
    pytest.importorskip("psycopg", reason="psycopg is not installed (pip install 'lmfoundry[postgres]')")
    run_as = []
    root = tempfile.mkdtemp(prefix="lmfoundry-pg-")
    if os.geteuid() == 0:  # PostgreSQL refuses to run as root: run it as the postgres user
        import pwd

        try:
            user = pwd.getpwnam("postgres")
        except KeyError:
            pytest.skip("running as root and there is no postgres user to run PostgreSQL as")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    data, port = os.path.join(root, "data"), free_port()
    subprocess.run([*run_as, initdb, "-D", data, "-U", "lmfoundry", "--auth=trust"], check=True, capture_output=True)
    subprocess.run(
        [
            *run_as,
            pg_ctl,
            "-D",
            data,
            "-l",
            os.path.join(root, "log"),
            "-w",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    yield f"postgresql://lmfoundry@127.0.0.1:{port}/postgres"
    subprocess.run([*run_as, pg_ctl, "-D", data, "-m", "immediate", "stop"], capture_output=True)
    shutil.rmtree(root, ignore_errors=True)
