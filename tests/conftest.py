"""Shared fixtures: one real local Ray per session and a tiny lifecycle whose artifacts the
stage tests reuse (corpus -> curated -> packed -> pretrained), each built once.

Tiers come from the fixtures a test uses, never from hand-written marks: a test whose fixture
closure holds one of TIER_FIXTURES gets that fixture's markers (see pytest_collection_modifyitems).
A fixture parametrized over fixture names (request.getfixturevalue(request.param)) gives each
case the markers of the fixture it gets. A test that nothing marks is the unit tier:
`make test-fast` runs it alone."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import sys
import time
from pathlib import Path

import pytest

# the harnesses that tests and benchmarks share (benchmarks/harness)
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))

os.environ.setdefault("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "0")
# Ray Train's controller polls its workers every RAY_TRAIN_HEALTH_CHECK_INTERVAL_S (2 s by
# default): a finished run, a killed worker or a forced report (at every save) waits for the next
# poll, and lmfoundry's RayTrainReporter reports at most once a poll. The tiny runs of the suite
# take a few seconds each: a shorter poll takes out most of that waiting (the processes Ray
# starts from here, and the programs the tests run, inherit it).
os.environ.setdefault("RAY_TRAIN_HEALTH_CHECK_INTERVAL_S", "0.5")
# Ray Train (2.60) starts a preemption watcher actor, a Python process of its own, with every
# worker group, to poll for nodes being drained; no test drains a node. On 2 CPU cores, where
# each new actor process importing Ray is what a short run waits for, a 4-step run of 2 workers
# took 24.5-27.9 s without it against 27.2-30.7 s with it, alternating run by run.
os.environ.setdefault("RAY_TRAIN_ENABLE_PREEMPTION_WATCHER", "0")
# MLflow (3.x) refuses a folder as its tracking store unless told that is meant: the tests track
# into a folder of their own (a deployment points at an MLflow server instead).
os.environ.setdefault("MLFLOW_ALLOW_FILE_STORE", "true")

# fixture -> the markers of every test that uses it, directly or through other fixtures
TIER_FIXTURES = {
    "ray_local": {"ray"},  # the session's Ray; curated, packed, pretrained, ... depend on it
    "pretrained": {"deepspeed"},  # the session's reference run on 2 DeepSpeed workers
    "deepspeed_workers": {"ray", "deepspeed", "slow"},  # the test trains on worker groups of its own
    "deepspeed_processes": {"deepspeed", "slow"},  # DeepSpeed engines in processes it spawns, no Ray
    "own_ray_env": {"ray", "slow"},  # a program in a subprocess that starts a Ray of its own
    "own_ray_serve_env": {"ray", "slow", "server"},  # ... and serves HTTP from it (Ray Serve)
    "ray_head": {"ray", "slow", "server"},  # a `ray start --head` cluster in a subprocess
    "ray_serve": {"ray", "server"},  # Ray Serve's HTTP proxy on the session's Ray
    "postgres_dsn": {"server", "postgres"},  # a throwaway PostgreSQL server
    "s3_server": {"server"},  # a local S3-compatible server over HTTP (moto's server mode)
}


# Modules that serve the Serve ingress apps in this process, without Ray Serve: afterwards the
# apps' routers hold this process's objects, and Serve, which ships these classes and their apps
# by value, can no longer pickle them for a real deployment. They run after every other test.
IN_PROCESS_SERVE_APPS = {"test_api_auth.py", "test_api_inputs.py"}


def pytest_collection_modifyitems(config, items):
    items.sort(key=lambda item: item.path.name in IN_PROCESS_SERVE_APPS)  # stable: the rest keep their order
    for item in items:
        names = set(getattr(item, "fixturenames", ()))
        callspec = getattr(item, "callspec", None)
        if callspec is not None:
            names |= {v for v in callspec.params.values() if isinstance(v, str)}
        for marker in sorted(set().union(*(TIER_FIXTURES.get(n, set()) for n in names))):
            item.add_marker(marker)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def wait_until(predicate, timeout: float, what, interval: float = 0.05):
    """Polls `predicate` until it returns something truthy and returns that; after `timeout`
    seconds fails the test, naming `what` it waited for (a text, or a function that says it at
    that moment) and the last value it saw."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            said = what() if callable(what) else what
            pytest.fail(f"waited {timeout:g} s for {said}; last seen: {value!r}", pytrace=False)
        time.sleep(interval)


@pytest.fixture(scope="session")
def ray_local():
    import ray

    from lmfoundry.platform.ray_env import init_ray

    init_ray()
    yield ray
    ray.shutdown()


@pytest.fixture
def deepspeed_workers(ray_local):
    """For a test that trains on DeepSpeed worker groups of its own (fault drills, DPO, expert
    parallelism) on the session's Ray: each run starts its workers, minutes in all."""
    return ray_local


@pytest.fixture
def deepspeed_processes():
    """For a test that runs DeepSpeed engines in processes it spawns itself (torch.multiprocessing
    over gloo, no Ray), as the planner's memory measurement does: minutes of training steps."""
    return None


@pytest.fixture
def own_ray_env():
    """The environment for a program run in a subprocess that starts a Ray of its own, not the
    session's: RAY_ADDRESS cleared."""
    return {**os.environ, "RAY_ADDRESS": ""}


@pytest.fixture
def own_ray_serve_env(own_ray_env):
    """own_ray_env for a program that also serves HTTP from its Ray (Ray Serve)."""
    return own_ray_env


@pytest.fixture(scope="module")
def ray_serve(ray_local):
    """Ray Serve on the session's Ray, shut down after the module so that the next one starts
    its HTTP proxy on a port of its own."""
    from ray import serve

    yield serve
    serve.shutdown()


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
    manifest = run_pack(
        PackConfig(
            input=curated[0],
            output=out,
            vocab_size=1024,
            seq_len=64,
            val_fraction=0.1,
            rows_per_group=4,  # a divisor of the tests' micro_batch_size
            sequences_per_shard=128,  # several shards a split, as the training data reader meets them
        )
    )
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


def stopped_at(run: Path, step: int, copy: Path) -> Path:
    """A copy of `run` as if it had stopped after `step`'s checkpoint: the later checkpoints and
    the run manifest removed (a run killed there resumes the same way: test_fault_tolerance's
    test_killed_workers_...). The markers of drills that fired in `run` stay behind: the copy
    goes on with drills of its own."""
    import shutil

    from lmfoundry.platform import checkpoint

    shutil.copytree(run, copy, ignore=lambda folder, names: ["_drills"] if Path(folder) == Path(run) else [])
    (copy / "_MANIFEST.json").unlink()
    for later, uri in checkpoint.committed_checkpoints(str(copy)):
        if later > step:
            shutil.rmtree(uri)
    assert checkpoint.committed_checkpoints(str(copy))[-1][0] == step
    return copy


@pytest.fixture(scope="session")
def mlflow_store(tmp_path_factory):
    """A local MLflow tracking store (a folder) that the session's runs log to."""
    return (tmp_path_factory.mktemp("mlflow") / "mlruns").as_uri()


@pytest.fixture(scope="session")
def pretrained(packed, tmp_path_factory, mlflow_store):
    """The session's reference run; it also logs its steps to MLflow (`mlflow_store`)."""
    from lmfoundry.train.pretrain import run_pretrain

    out = str(tmp_path_factory.mktemp("runs") / "tiny")
    mlflow = {"tracking_uri": mlflow_store, "experiment": "lmfoundry-tests"}
    manifest = run_pretrain(tiny_pretrain_config(packed[0], out, logging={"mlflow": mlflow}))
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


@pytest.fixture(scope="session")
def s3_server():
    """A local S3-compatible server over HTTP (moto's server mode, in a thread of this process):
    yields the environment that points AWS clients at it, the usual variables a deployment sets."""
    import logging

    from moto.server import ThreadedMotoServer

    logging.getLogger("werkzeug").setLevel(logging.WARNING)  # not a line per S3 request in a failure's log
    port = free_port()
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port, verbose=False)
    server.start()
    yield {
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
        "AWS_ACCESS_KEY_ID": "lmfoundry-test",
        "AWS_SECRET_ACCESS_KEY": "lmfoundry-test",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_EC2_METADATA_DISABLED": "true",  # no instance-metadata lookups for credentials
    }
    server.stop()


@pytest.fixture
def s3_bucket(s3_server, monkeypatch):
    """A new empty bucket on the S3 server, with this process's environment pointing at it:
    yields its s3:// URI."""
    import uuid

    import pyarrow.fs as pafs

    for name, value in s3_server.items():
        monkeypatch.setenv(name, value)
    bucket = f"lmfoundry-{uuid.uuid4().hex[:12]}"
    fs, _ = pafs.FileSystem.from_uri(f"s3://{bucket}?allow_bucket_creation=true")  # as storage.filesystem does
    fs.create_dir(bucket)
    return f"s3://{bucket}"


@pytest.fixture(scope="module")
def ray_head():
    """A `ray start --head` cluster in a subprocess with its dashboard (the job API), one per test
    module: yields its dashboard address and the environment to reach it with, and stops exactly
    this cluster. It declares one logical GPU, so that what a manifest asks of a GPU node
    schedules here; nothing sees a device (torch runs on the CPU)."""
    import shutil
    import subprocess
    import sys
    import tempfile
    from pathlib import Path

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
            str(Path(sys.executable).with_name("ray")),
            "start",
            "--head",
            "--block",
            f"--port={gcs}",
            f"--dashboard-port={dash}",
            "--dashboard-host=127.0.0.1",
            "--num-cpus=4",
            "--num-gpus=1",
            f"--temp-dir={temp_dir}",
            "--disable-usage-stats",
            # the job agent's HTTP port is fixed by default (52365): another Ray on this machine
            # (the session's local one) would hold it and the job API would have no agent
            f"--dashboard-agent-listen-port={agent}",
        ],
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own process group: the teardown can end every process of it
    )
    try:
        yield f"http://127.0.0.1:{dash}", env
    finally:
        # SIGTERM lets `ray start` stop its processes one by one, a second's grace each (half a
        # minute with Serve's actors up); what is left after a few seconds is killed together.
        head.terminate()
        try:
            head.wait(timeout=5)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                os.killpg(head.pid, signal.SIGKILL)
            head.wait(timeout=60)
        shutil.rmtree(temp_dir, ignore_errors=True)


# ---- the inference API in this process: the real app, engine and HTTP, no Ray ----

INFERENCE_KEY = "sk-test-" + "s" * 20
SERVING_TEXT = [
    "The quick brown fox jumps over the lazy dog while the farmer watches from the porch.",
    "Later that evening the family gathered to discuss the harvest and the weather ahead.",
    "def add(a, b):\n    return a + b\n",
] * 20


@pytest.fixture(scope="module")
def tiny_serving_checkpoint(tmp_path_factory):
    """A random-weight one-layer model with a 400-token byte-level BPE and a 512-token context."""
    import torch

    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    torch.manual_seed(0)
    path = tmp_path_factory.mktemp("tiny")
    tok = train_bpe(SERVING_TEXT, vocab_size=400)
    cfg = ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=512, n_layer=1, d_model=32, n_head=2, n_kv_head=1)
    save_model_files(Transformer(cfg).eval(), path)
    (path / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(path, {"step": 0})
    return str(path)


@pytest.fixture(scope="module")
def inference_api(tiny_serving_checkpoint):
    """`.url` serves the inference app over HTTP (uvicorn in a thread; Ray Serve's proxy is left
    out, so no Ray starts); `.use(guardrails, reward_models)` puts a fresh replica behind it, built as the
    deployment builds it. Serve's class-based routes find their replica through the replica
    context, which a Serve replica sets; here it is pointed at the replica made for the test."""
    import threading
    import types

    import uvicorn
    from ray import serve

    from lmfoundry.platform.keys import digest
    from lmfoundry.serving.api import LLMServer, app

    replica_class = LLMServer.func_or_class.__mro__[1]  # the class under Serve's ingress wrapper
    current = types.SimpleNamespace(servable_object=None)

    def use(guardrails: dict | None = None, versions: list[dict] | None = None, traffic_file=None, **options):
        """options: the replica's keyword arguments (canary, tracing, ...)."""
        if current.servable_object is not None and current.servable_object.watch is not None:
            current.servable_object.watch.stop()
        current.servable_object = replica_class(
            versions or [{"name": "main", "checkpoint": tiny_serving_checkpoint, "weight": 1.0}],
            "tiny",
            None,
            [digest(INFERENCE_KEY)],
            {"max_batch_size": 4, "max_waiting": 16},
            {"max_body_bytes": 1 << 20, "max_n": 4, "request_timeout_s": 60},
            guardrails,
            traffic_file,
            device="cpu",
            **options,
        )
        return current.servable_object

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(serve, "get_replica_context", lambda: current)
        use()
        port = free_port()
        server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="off"))
        thread = threading.Thread(target=server.run, daemon=True)
        thread.start()
        wait_until(lambda: server.started, 30, "uvicorn to start")
        yield types.SimpleNamespace(url=f"http://127.0.0.1:{port}", use=use, key=INFERENCE_KEY)
        server.should_exit = True
        thread.join(10)
