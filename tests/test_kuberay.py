"""deploy/kuberay/: every manifest against KubeRay's own CRD schemas (deploy/kuberay/crds/), secrets
only from Kubernetes Secrets, token authentication on; then, on a local `ray start --head`
cluster, the RayJobs' entrypoints for curate and pack submitted unchanged with `ray job submit`
(the other stages' entrypoints are parsed and their configs validated, not run), and the
RayService's serveConfigV2 deployed with `serve deploy`, answering an authenticated chat completion
and upgraded to a new checkpoint without dropping a request."""

from __future__ import annotations

import copy
import inspect
import json
import os
import re
import shlex
import subprocess
import sys
import threading
import time
import uuid
from functools import cache
from pathlib import Path

import httpx
import jsonschema
import pytest
import yaml
from conftest import free_port, wait_until

REPO = Path(__file__).resolve().parents[1]
KUBERAY = REPO / "deploy" / "kuberay"
CRDS = {"RayCluster": "rayclusters", "RayJob": "rayjobs", "RayService": "rayservices"}
RAYJOB_STAGES = {"curate", "pack", "pretrain", "evaluate", "sft", "align"}
# which config key each stage's --input / --output sets (as its job passes them to run_stage)
STAGE_PATHS = {
    "curate": ("input", "output"),
    "pack": ("input", "output"),
    "pretrain": ("data", "output"),
    "evaluate": ("checkpoint", "output"),
    "sft": ("checkpoint", "output"),
    "align": ("checkpoint", "output"),
}
SECRET_NAME = re.compile(r"KEY|TOKEN|SECRET|PASSWORD|PASSWD|DSN|CREDENTIAL", re.I)


def manifests() -> dict[str, dict]:
    return {p.name: yaml.safe_load(p.read_text()) for p in sorted(KUBERAY.glob("*.yaml"))}


def strict(schema):
    """The CRD's schema as the API server applies it to `kubectl apply --validate=strict`: a field
    the schema does not name is an error, not silently pruned."""
    if isinstance(schema, dict):
        schema = {k: strict(v) for k, v in schema.items()}
        if (
            schema.get("type") == "object"
            and "properties" in schema
            and "additionalProperties" not in schema
            and not schema.get("x-kubernetes-preserve-unknown-fields")
        ):
            schema["additionalProperties"] = False
        return schema
    if isinstance(schema, list):
        return [strict(v) for v in schema]
    return schema


@cache
def crd_schema(kind: str) -> dict:
    path = KUBERAY / "crds" / f"ray.io_{CRDS[kind]}.yaml"
    crd = yaml.load(path.read_text(), Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))
    (version,) = [v for v in crd["spec"]["versions"] if v["storage"]]
    assert version["name"] == "v1"
    return strict(version["schema"]["openAPIV3Schema"])


def validate(manifest: dict) -> None:
    assert manifest["apiVersion"] == "ray.io/v1", manifest["apiVersion"]
    jsonschema.Draft7Validator(crd_schema(manifest["kind"])).validate(manifest)


def containers(manifest: dict) -> list[dict]:
    found = []

    def walk(node):
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("containers", "initContainers") and isinstance(value, list):
                    found.extend(value)
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(manifest)
    return found


def security_problems(manifest: dict) -> list[str]:
    problems = []
    for c in containers(manifest):
        for env in c.get("env", []):
            if "value" in env and SECRET_NAME.search(env["name"]) and env["name"] != "RAY_AUTH_MODE":
                problems.append(f"container {c['name']}: {env['name']} written inline, not from a Secret")
        for source in c.get("envFrom", []):
            if "secretRef" not in source:
                problems.append(f"container {c['name']}: envFrom other than a Secret: {source}")
    spec = manifest["spec"]
    cluster = (
        spec.get("rayClusterSpec")
        or spec.get("rayClusterConfig")
        or (spec if manifest["kind"] == "RayCluster" else None)
    )
    if cluster is not None:
        if cluster.get("authOptions", {}).get("mode") != "token":
            problems.append("the cluster runs without token authentication (authOptions.mode: token)")
        if cluster["headGroupSpec"].get("serviceType", "ClusterIP") != "ClusterIP":
            problems.append("the head's service is exposed outside the cluster")
    text = json.dumps(manifest)
    if re.search(r"sk-[A-Za-z0-9_-]{8,}|AKIA[0-9A-Z]{16}", text):
        problems.append("a key is written into the manifest")
    return problems


def test_every_manifest_validates_against_the_kuberay_crds():
    found = manifests()
    kinds = sorted(m["kind"] for m in found.values())
    assert kinds == ["RayCluster", *["RayJob"] * len(RAYJOB_STAGES), "RayService"]
    for name, manifest in found.items():
        try:
            validate(manifest)
        except jsonschema.ValidationError as e:
            pytest.fail(f"{name}: {e.message} at {list(e.absolute_path)}")


@pytest.mark.parametrize(
    "edit",
    [
        lambda m: m["spec"]["headGroupSpec"].update(rayStartParam={}),  # a misspelt field
        lambda m: m["spec"].update(authOptions={"mode": "password"}),  # a value outside the enum
        lambda m: m["spec"]["workerGroupSpecs"][0].update(maxReplicas="many"),  # a wrong type
        lambda m: m["spec"]["headGroupSpec"].pop("template"),  # a required field dropped
    ],
)
def test_validation_catches_a_broken_manifest(edit):
    manifest = copy.deepcopy(manifests()["raycluster.yaml"])
    edit(manifest)
    with pytest.raises(jsonschema.ValidationError):
        validate(manifest)


def test_secrets_come_from_kubernetes_secrets_and_token_auth_is_on():
    for name, manifest in manifests().items():
        assert security_problems(manifest) == [], name
    cluster = manifests()["raycluster.yaml"]
    inline = copy.deepcopy(cluster)
    inline["spec"]["headGroupSpec"]["template"]["spec"]["containers"][0]["env"] = [
        {"name": "AWS_SECRET_ACCESS_KEY", "value": "wJalrXUtnFEMI"}
    ]
    no_auth = copy.deepcopy(cluster)
    no_auth["spec"].pop("authOptions")
    public = copy.deepcopy(cluster)
    public["spec"]["headGroupSpec"]["serviceType"] = "LoadBalancer"
    service = copy.deepcopy(manifests()["rayservice.yaml"])
    service["spec"]["serveConfigV2"] += "        # sk-lmf-abcdefghijklmnop\n"
    for attack in (inline, no_auth, public, service):
        assert security_problems(attack) != []


def rayjobs() -> dict[str, dict]:
    return {m["metadata"]["labels"]["lmfoundry.dev/stage"]: m for m in manifests().values() if m["kind"] == "RayJob"}


def submitter_env(job: dict) -> dict[str, str]:
    (container,) = job["spec"]["submitterPodTemplate"]["spec"]["containers"]
    return {e["name"]: e["value"] for e in container.get("env", []) if "value" in e}


def entrypoint_argv(job: dict, data: str) -> list[str]:
    """The entrypoint's words as the submitter's shell passes them on, $LMFOUNDRY_DATA being `data`."""
    return shlex.split(job["spec"]["entrypoint"].replace("$LMFOUNDRY_DATA", data))


def test_a_rayjob_per_stage_whose_entrypoint_is_the_stage_and_whose_config_validates():
    from lmfoundry.jobs.config import stage_config
    from lmfoundry.platform.cli import stage_parser
    from lmfoundry.platform.config import load_config

    jobs = rayjobs()
    assert set(jobs) == RAYJOB_STAGES
    for stage, job in jobs.items():
        argv = entrypoint_argv(job, submitter_env(job)["LMFOUNDRY_DATA"])
        assert argv[:3] == ["python", "-m", f"lmfoundry.jobs.{stage}"], argv
        args = stage_parser(stage, "").parse_args(argv[3:])
        assert (REPO / args.config).is_file(), args.config  # the image ships configs/ as the working dir
        input_field, output_field = STAGE_PATHS[stage]
        overrides = [*args.overrides, f"{input_field}={args.input}", f"{output_field}={args.output}"]
        cfg = load_config(stage_config(stage), REPO / args.config, overrides)
        assert getattr(cfg, input_field).startswith("s3://lmfoundry-data/")
        assert job["spec"]["clusterSelector"] == {"ray.io/cluster": manifests()["raycluster.yaml"]["metadata"]["name"]}


def test_the_rayservice_serve_config_is_valid_for_ray_serve_and_lmfoundry():
    from ray.serve.schema import ServeDeploySchema

    from lmfoundry.platform.config import build_config
    from lmfoundry.serving.app import ServeConfig

    serve_config = yaml.safe_load(manifests()["rayservice.yaml"]["spec"]["serveConfigV2"])
    ServeDeploySchema.parse_obj(serve_config)
    (app,) = serve_config["applications"]
    assert app["import_path"] == "lmfoundry.serving.app:build"
    assert build_config(ServeConfig, app["args"]).gpus_per_replica == 1


def test_the_serve_app_builder_refuses_bad_args_naming_them(monkeypatch):
    from lmfoundry.platform.config import ConfigError
    from lmfoundry.serving import app

    # Serve calls a builder with exactly one argument, the args mapping, and refuses any other signature
    assert list(inspect.signature(app.build).parameters) == ["args"]
    monkeypatch.delenv("LMFOUNDRY_API_KEYS", raising=False)
    monkeypatch.delenv(app.SERVE_CONFIG_ENV, raising=False)
    with pytest.raises(ConfigError, match="key 'num_replica': unknown key; allowed keys here: .*num_replicas"):
        app.build({"checkpoint": "ckpt", "keys_file": "keys.json", "num_replica": 2})
    with pytest.raises(ConfigError, match="key 'engine.max_batch_size': Input should be greater than or equal to 1"):
        app.build({"checkpoint": "ckpt", "keys_file": "keys.json", "engine": {"max_batch_size": 0}})
    with pytest.raises(ConfigError, match="either checkpoint .* or versions"):
        app.build({"keys_file": "keys.json"})
    with pytest.raises(ConfigError, match=r"no API keys: set keys_file, or \$LMFOUNDRY_API_KEYS"):
        app.build({"checkpoint": "ckpt"})
    with pytest.raises(ConfigError, match="must be a mapping"):
        app.build(["checkpoint=ckpt"])
    with pytest.raises(AttributeError, match="LMFOUNDRY_SERVE_CONFIG"):
        app.app  # noqa: B018 - the attribute access is the test


def ray_cli(name: str = "ray") -> str:
    return str(Path(sys.executable).with_name(name))


def run(cmd: list[str], env: dict, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, cwd=REPO)


def submit_when_up(cmd: list[str], env: dict) -> subprocess.CompletedProcess:
    """Runs a submission, retrying while the dashboard and its job agent are still starting."""
    starting = ("Failed to connect", "No available agent", "Connection refused")
    tries = []

    def submitted():
        tries.append(run(cmd, env))
        return tries[-1].returncode == 0 or not any(s in tries[-1].stdout + tries[-1].stderr for s in starting)

    # seconds on an idle machine; minutes when other heavy work shares its cores
    wait_until(submitted, 600, lambda: "the job API to come up: " + tries[-1].stderr[-2000:], interval=2)
    return tries[-1]


@pytest.mark.timeout(1800)
def test_rayjob_entrypoints_for_curate_then_pack_run_unchanged_on_a_local_cluster(ray_head, tmp_path):
    from lmfoundry.data.sample_corpus import build_sample_corpus

    address, env = ray_head
    data = tmp_path / "bucket"
    build_sample_corpus(data / "raw", num_clean_docs=120, seed=3, shards=1)
    jobs = rayjobs()
    for stage in ("curate", "pack"):
        spec = jobs[stage]["spec"]
        runtime_env = yaml.safe_load(spec["runtimeEnvYAML"])
        # the image's working dir (/home/ray/lmfoundry: configs/) is this checkout's
        runtime_env["working_dir"] = str(REPO)
        job_id = f"lmfoundry-{stage}-{uuid.uuid4().hex[:6]}"
        # as KubeRay's submitter runs it (ray-operator/controllers/ray/common/job.go): one bash
        # command line with the entrypoint appended as the manifest has it, in the submitter's
        # environment, whose bucket is a local folder here
        command = " ".join(
            [shlex.quote(ray_cli()), "job", "submit", "--address", address, "--submission-id", job_id]
            + ["--runtime-env-json", shlex.quote(json.dumps(runtime_env)), "--", spec["entrypoint"].strip()]
        )
        r = submit_when_up(["bash", "-c", command], {**env, **submitter_env(jobs[stage]), "LMFOUNDRY_DATA": str(data)})
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
        # `ray job submit` waits for the job's end, says how it ended, and exits 1 if it failed
        plain = re.sub(r"\x1b\[[0-9;]*m", "", r.stdout + r.stderr)
        assert f"Job '{job_id}' succeeded" in plain, plain[-3000:]
    assert (data / "curated" / "_MANIFEST.json").exists() and any((data / "curated" / "kept").glob("*.parquet"))
    packed = json.loads((data / "packed" / "_MANIFEST.json").read_text())
    assert packed["stage"] == "pack", packed


def test_serve_build_writes_a_serve_config_from_a_recipe(pretrained, tmp_path):
    from ray.serve.schema import ServeDeploySchema

    from lmfoundry.platform.keys import create_key

    keys = str(tmp_path / "keys.json")
    create_key(keys, "acme")
    recipe = tmp_path / "serve.yaml"
    recipe.write_text(yaml.safe_dump({"checkpoint": pretrained[0], "keys_file": keys, "num_replicas": 2}))
    out = tmp_path / "serve_config.yaml"
    env = {**os.environ, "LMFOUNDRY_SERVE_CONFIG": str(recipe)}
    r = run([ray_cli("serve"), "build", "lmfoundry.serving.app:app", "-o", str(out)], env, timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    config = yaml.safe_load(out.read_text())
    ServeDeploySchema.parse_obj(config)
    (app,) = config["applications"]
    assert app["import_path"] == "lmfoundry.serving.app:app"
    server = next(d for d in app["deployments"] if d["name"] == "LLMServer")
    assert server["num_replicas"] == 2 and server["max_ongoing_requests"] == 32


def serve_config_file(tmp_path: Path, name: str, port: int, **args) -> Path:
    """The RayService's serveConfigV2 with `args` replaced (the checkpoint and key file: the
    manifest's are on s3://) and http_options for a free port (KubeRay sets them on a cluster)."""
    config = yaml.safe_load(manifests()["rayservice.yaml"]["spec"]["serveConfigV2"])
    for app in config["applications"]:
        app["args"].update(args)
    config["http_options"] = {"host": "127.0.0.1", "port": port}
    path = tmp_path / name
    path.write_text(yaml.safe_dump(config))
    return path


@pytest.mark.timeout(1800)
def test_rayservice_serve_config_answers_and_upgrades_without_dropping_a_request(ray_head, pretrained, tmp_path):
    from lmfoundry.platform import checkpoint
    from lmfoundry.platform.keys import create_key

    address, env = ray_head
    keys = str(tmp_path / "keys.json")
    key, _ = create_key(keys, "acme", ["user", "admin"])
    (_, older), (_, newer) = checkpoint.committed_checkpoints(pretrained[0])[-2:]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    headers = {"Authorization": f"Bearer {key}"}
    model = yaml.safe_load(manifests()["rayservice.yaml"]["spec"]["serveConfigV2"])["applications"][0]["args"][
        "model_name"
    ]
    chat = {"model": model, "messages": [{"role": "user", "content": "Hello"}], "max_tokens": 16}

    def deploy(path: Path):
        r = submit_when_up([ray_cli("serve"), "deploy", str(path), "--address", address], env)
        assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]

    def replicas() -> set[str]:
        try:
            text = httpx.get(f"{url}/metrics", headers=headers, timeout=10).text
        except httpx.HTTPError:
            return set()
        return {part.split('"')[1] for part in text.split("replica=")[1:]}

    status_checked = 0.0

    def answering() -> set[str]:
        nonlocal status_checked
        seen = replicas()
        # a failed deploy ends the wait early; `serve status` (a CLI start) at most every 15 s,
        # not on every poll, where it would take the CPUs the deploy needs
        if not seen and time.monotonic() - status_checked > 15:
            status_checked = time.monotonic()
            status = run([ray_cli("serve"), "status", "--address", address], env, timeout=120).stdout
            if "DEPLOY_FAILED" in status:
                pytest.fail(f"the application failed to deploy:\n{status[-3000:]}")
        return seen

    deploy(serve_config_file(tmp_path, "v1.yaml", port, checkpoint=newer, keys_file=keys))
    first = wait_until(answering, 600, "the RayService's application to answer", interval=1)
    r = httpx.post(f"{url}/v1/chat/completions", json=chat, headers=headers, timeout=60)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["message"]["role"] == "assistant" and r.json()["usage"]["completion_tokens"] > 0
    assert httpx.post(f"{url}/v1/chat/completions", json=chat, timeout=60).status_code == 401

    # clients keep streaming chats while `serve deploy` moves the application to another checkpoint
    results: list[object] = []
    stop = threading.Event()

    def client():
        with httpx.Client(timeout=60) as http:
            while not stop.is_set():
                try:
                    with http.stream(
                        "POST", f"{url}/v1/chat/completions", json={**chat, "stream": True}, headers=headers
                    ) as s:
                        lines = [line for line in s.iter_lines() if line]
                        results.append((s.status_code, lines[-1] if lines else ""))
                except httpx.HTTPError as e:
                    results.append(repr(e))
                stop.wait(0.4)  # three clients, at most 7.5 requests a second: under the 600 a minute per tenant

    threads = [threading.Thread(target=client) for _ in range(3)]
    for t in threads:
        t.start()
    try:
        wait_until(lambda: len(results) >= 3, 60, "the clients' first replies")
        deploy(serve_config_file(tmp_path, "v2.yaml", port, checkpoint=older, keys_file=keys))
        wait_until(
            lambda: (seen := replicas()) and not (seen & first), 600, "replicas of the upgraded config", interval=1
        )
        during = len(results)
        wait_until(lambda: len(results) >= during + 3, 60, "replies from the upgraded replicas")
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=120)
    failed = [r for r in results if r != (200, "data: [DONE]")]
    assert failed == [] and len(results) >= 6, (failed[:5], len(results))
    status = run([ray_cli("serve"), "status", "--address", address], env, timeout=120)
    assert "RUNNING" in status.stdout, status.stdout[-3000:]
