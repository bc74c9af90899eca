"""Adversarial tests of API keys, roles and the gate in front of every app.

The apps are the real ones (inference, agents, review queue), each instantiated the way a Serve
replica does it (the ingress class's own __init__), and reached over ASGI or a real uvicorn
server on 127.0.0.1; only Ray's replica context, which a route's `self` is looked up in, is
pointed at the instance (there is no replica process outside Ray).
"""

import asyncio
import json
import logging
import multiprocessing
import os
import socket
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from types import SimpleNamespace

import httpx
import pytest
import uvicorn
from fastapi.routing import APIRoute

from lmfoundry.platform.keys import Authenticator, create_key, digest, read_store, revoke_key

pytestmark = pytest.mark.timeout(120)

ROOT = Path(__file__).resolve().parents[2]


# ---- the apps, as a Serve replica builds them ----


def replica_app(deployment, *args, **kwargs):
    """The FastAPI app of a Serve ingress deployment, with the instance its __init__ made."""
    cls = deployment.func_or_class
    instance = cls.__new__(cls)
    asyncio.run(cls.__init__(instance, *args, **kwargs))
    instance.app.state.replica = instance
    return instance.app


def serving(app):
    """Make `app`'s instance the one Ray's route wrapper finds as `self`: outside a replica, Ray's
    replica context is unset, and this is the one object the wrapper reads from it."""
    import ray.serve.context

    ray.serve.context._INTERNAL_REPLICA_CONTEXT = SimpleNamespace(servable_object=app.state.replica)
    return app.state.replica


def api_routes(app) -> list[APIRoute]:
    """Every route, also those Serve nests under included routers."""
    from ray.serve._private.http_util import _walk_fastapi_routes

    return [r for r, _, _ in _walk_fastapi_routes(app) if isinstance(r, APIRoute)]


def make_checkpoint(path: Path) -> str:
    import torch

    from lmfoundry.data.tokenizer import train_bpe
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    torch.manual_seed(0)
    tok = train_bpe(["The quick brown fox jumps over the lazy dog."] * 20, vocab_size=300)
    model = Transformer(
        ModelConfig(vocab_size=tok.get_vocab_size(), max_seq_len=64, n_layer=1, d_model=32, n_head=2, n_kv_head=1)
    )
    path.mkdir(parents=True)
    save_model_files(model.eval(), path)
    (path / TOKENIZER).write_text(tok.to_str())
    checkpoint.seal(path, {"step": 0})
    return str(path)


@pytest.fixture(scope="module")
def keys(tmp_path_factory):
    """One key file with a key per role, and one per tenant for the cross-tenant checks."""
    path = str(tmp_path_factory.mktemp("keys") / "keys.json")
    made = {}
    for name, tenant, roles in [
        ("user", "acme", ["user"]),
        ("user_b", "beta", ["user"]),
        ("reviewer", "acme", ["reviewer"]),
        ("approver", "acme", ["approver"]),
        ("admin", "ops", ["admin"]),
        ("everything_but_admin", "acme", ["user,reviewer", "approver"]),
    ]:
        made[name], _ = create_key(path, tenant, roles)
    return path, made


@pytest.fixture(scope="module")
def review_app(keys, tmp_path_factory):
    from lmfoundry.align.review import ReviewStore
    from lmfoundry.align.review_api import ReviewAPI

    db = str(tmp_path_factory.mktemp("review") / "review.sqlite")
    store = ReviewStore(db)
    store.add("review-1", "review", "judges disagree", {"id": "1", "chosen": "x", "rejected": "y"})
    store.close()
    return replica_app(ReviewAPI, db, keys[0], [])


@pytest.fixture(scope="module")
def agents_app(keys, tmp_path_factory):
    from lmfoundry.agents.api import AgentAPI

    root = tmp_path_factory.mktemp("agents")
    workflows = root / "workflows.yaml"
    workflows.write_text("workflows:\n  w:\n    model_url: http://127.0.0.1:9\n    model: m\n    tools: {}\n")
    return replica_app(AgentAPI, str(root / "runs.sqlite"), str(workflows), keys[0], [], 10, None)


@pytest.fixture(scope="module")
def inference_app(keys, tmp_path_factory):
    from lmfoundry.serving.api import LLMServer

    ckpt = make_checkpoint(tmp_path_factory.mktemp("inference") / "ckpt")
    engine = {"max_batch_size": 2, "max_waiting": 4, "max_prefill_tokens": 64, "dtype": "float32"}
    limits = {"max_body_bytes": 1 << 16, "max_n": 1, "request_timeout_s": 30.0}
    versions = [{"name": "main", "checkpoint": ckpt, "weight": 1.0}]
    return replica_app(LLMServer, versions, "tiny", keys[0], [], engine, limits, None, device="cpu")


def bearer(key: str) -> dict:
    return {"Authorization": f"Bearer {key}"}


def client(app) -> httpx.Client:
    from starlette.testclient import TestClient

    serving(app)
    return TestClient(app, base_url="http://app")


def routes(app) -> list[tuple[str, str]]:
    found = [(m, r.path) for r in api_routes(app) for m in sorted(r.methods) if m != "HEAD"]
    assert len(found) >= 3
    return found


def concrete(path: str) -> str:
    return path.replace("{item_id}", "review-1").replace("{run_id}", "run-x")


# ---- role boundaries ----


def test_no_key_forged_key_and_non_bearer_get_401_on_every_route_of_every_app(review_app, agents_app, inference_app):
    for app in (review_app, agents_app, inference_app):
        with client(app) as c:
            for method, path in routes(app):
                if path == "/health":
                    continue
                for headers in ({}, bearer("sk-lmf-forged"), {"Authorization": "Basic dXNlcjpwYXNz"}):
                    r = c.request(method, concrete(path), headers=headers, json={})
                    assert r.status_code == 401, (method, path, headers, r.text)
                    assert r.headers["www-authenticate"] == "Bearer"


def test_user_key_cannot_decide_review_items_or_touch_any_review_route_403(review_app, keys):
    _, k = keys
    from lmfoundry.align.review import ReviewStore

    with client(review_app) as c:
        for method, path in routes(review_app):
            if path in ("/health", "/openapi.json"):
                continue
            body = {"decision": "a"} if path.endswith("/decide") else {"body": "x"} if "comments" in path else {}
            r = c.request(method, concrete(path), headers=bearer(k["user"]), json=body)
            assert r.status_code == 403, (method, path, r.text)
            assert "'reviewer' role" in r.json()["error"]["message"]
        for role in ("admin", "approver"):  # roles do not imply one another
            r = c.post("/v1/review/items/review-1/decide", headers=bearer(k[role]), json={"decision": "a"})
            assert r.status_code == 403
        db = review_app.state.replica.store
        assert db.get("review-1")["decision"] is None  # nothing was decided by the refused keys
        assert isinstance(db, ReviewStore)
        ok = c.get("/v1/review/items", headers=bearer(k["reviewer"]))
        assert ok.status_code == 200 and [i["id"] for i in ok.json()["items"]] == ["review-1"]
        ok = c.get("/v1/review/items", headers=bearer(k["everything_but_admin"]))  # comma list + repeated --role
        assert ok.status_code == 200


def test_user_key_cannot_approve_or_reject_agent_tool_calls_403(agents_app, keys):
    _, k = keys
    with client(agents_app) as c:
        for action in ("approve", "reject"):
            for role in ("user", "reviewer", "admin"):
                r = c.post(f"/v1/agents/runs/run-x/{action}", headers=bearer(k[role]))
                assert r.status_code == 403, (action, role, r.text)
                assert "'approver' role" in r.json()["error"]["message"]
            r = c.post(f"/v1/agents/runs/run-x/{action}", headers=bearer(k["approver"]))
            assert r.status_code == 404  # past the role check: the run does not exist
        started = c.post("/v1/agents/runs", headers=bearer(k["user"]), json={"workflow": "w", "input": "hi"})
        assert started.status_code == 200  # a user key still starts runs
        run_id = started.json()["id"]
        assert c.get(f"/v1/agents/runs/{run_id}", headers=bearer(k["user_b"])).status_code == 404  # tenant scoped


def test_text_no_store_can_hold_is_a_json_4xx_naming_the_field_on_the_agents_and_review_apis(
    agents_app, review_app, keys
):
    """JSON carries lone UTF-16 surrogates and NULs; SQLite's driver cannot encode the first,
    PostgreSQL's text the second. Each API refuses them before its store sees them, in a JSON
    error that does not echo the value back (echoed, it made the error itself a 500)."""
    _, k = keys
    for bad in (b"x\\ud800", b"x\\u0000"):
        with client(agents_app) as c:
            body = b'{"workflow": "w", "input": "' + bad + b'"}'
            r = c.post(
                "/v1/agents/runs", headers={**bearer(k["user"]), "Content-Type": "application/json"}, content=body
            )
            assert r.status_code == 422 and "input" in r.json()["error"]["message"], r.text
        with client(review_app) as c:
            body = b'{"body": "' + bad + b'"}'
            r = c.post(
                "/v1/review/items/review-1/comments",
                headers={**bearer(k["reviewer"]), "Content-Type": "application/json"},
                content=body,
            )
            assert r.status_code == 422 and "body" in r.json()["error"]["message"], r.text


def test_metrics_need_admin_so_tenant_a_never_sees_tenant_b_series(inference_app, keys):
    _, k = keys
    with client(inference_app) as c:
        for _ in range(3):  # tenant beta makes traffic and a labelled series
            c.post("/v1/completions", headers=bearer(k["user_b"]), json={"prompt": "The", "max_tokens": 1})
        instance = inference_app.state.replica
        instance.metrics.rate_limited.labels(tenant="beta").inc()
        for who in ("user", "reviewer", "approver"):
            r = c.get("/metrics", headers=bearer(k[who]))
            assert r.status_code == 403 and "beta" not in r.text and "lmfoundry_" not in r.text
        r = c.get("/metrics", headers=bearer(k["admin"]))
        assert r.status_code == 200 and 'tenant="beta"' in r.text
        assert "lmfoundry_key_store_reload_failures" in r.text


def test_revoked_key_is_refused_on_the_very_next_request(review_app, keys):
    path, _ = keys
    key, record = create_key(path, "acme", ["reviewer"])
    with client(review_app) as c:
        assert c.get("/v1/review/items", headers=bearer(key)).status_code == 200
        revoke_key(path, record["id"])
        assert c.get("/v1/review/items", headers=bearer(key)).status_code == 401


# ---- docs, schema, health ----


def test_docs_redoc_and_openapi_are_never_public_in_any_app(review_app, agents_app, inference_app, keys):
    _, k = keys
    for app in (review_app, agents_app, inference_app):
        with client(app) as c:
            for path in ("/docs", "/redoc", "/openapi.json", "/docs/oauth2-redirect"):
                assert c.get(path).status_code == 401, path
            for path in ("/docs", "/redoc"):
                assert c.get(path, headers=bearer(k["user"])).status_code == 404  # not served at all
            schema = c.get("/openapi.json", headers=bearer(k["user"]))
            assert schema.status_code == 200 and "paths" in schema.json()
            health = c.get("/health")
            assert health.status_code == 200 and health.json() == {"status": "ok"}  # says nothing else
            assert c.post("/health").status_code == 401  # only GET is open


# ---- Bearer parsing ----


def test_bearer_scheme_any_case_but_whitespace_and_extras_are_refused(keys, review_app):
    path, k = keys
    auth = Authenticator(path, [])
    key = k["reviewer"]
    for header in (f"Bearer {key}", f"bearer {key}", f"BEARER {key}", f"BeArEr {key}"):
        assert auth.principal(header).roles == {"reviewer"}, header
    for header in (
        f"Bearer  {key}",
        f"Bearer\t{key}",
        f" Bearer {key}",
        f"Bearer {key} ",
        f"Bearer {key}\n",
        f"Bearer {key} extra",
        f"Bearer {key},Bearer {key}",
        f"Bearer{key}",
        f"Token {key}",
        key,
        "Bearer ",
        "Bearer",
    ):
        assert auth.principal(header) is None, repr(header)
    with client(review_app) as c:
        assert c.get("/v1/review/items", headers={"Authorization": f"BEARER {key}"}).status_code == 200
        assert c.get("/v1/review/items", headers={"Authorization": f"Bearer  {key}"}).status_code == 401


# ---- the key store under attack ----


def test_corrupt_or_unreadable_key_file_keeps_last_good_keys_and_never_fails_open(tmp_path, caplog):
    path = tmp_path / "keys.json"
    good, _ = create_key(str(path), "acme")
    revoked, rec = create_key(str(path), "acme")
    revoke_key(str(path), rec["id"])
    auth = Authenticator(str(path), [], reload_s=0)
    assert auth.principal(f"Bearer {good}") is not None and auth.principal(f"Bearer {revoked}") is None
    attacker = "sk-lmf-attacker"
    records = json.loads(path.read_text())["keys"]
    corruptions = [
        b"{not json",
        b"\x00\xff" * 100,
        b"",
        json.dumps([1, 2]).encode(),
        # a crafted record without 'revoked' (or with junk roles) must not become a live key
        json.dumps({"keys": [{"id": "k", "tenant": "evil", "sha256": digest(attacker)}]}).encode(),
        json.dumps({"keys": [*records, {**records[0], "sha256": digest(attacker), "roles": ["root"]}]}).encode(),
        json.dumps({"keys": [{**records[0], "sha256": "ab"}]}).encode(),
    ]
    with caplog.at_level(logging.ERROR, logger="lmfoundry"):
        for n, data in enumerate(corruptions, 1):
            path.write_bytes(data)
            assert auth.principal(f"Bearer {good}").tenant == "acme", data  # last good table in force
            assert auth.principal(f"Bearer {revoked}") is None, data  # a revoked key does not come back
            assert auth.principal(f"Bearer {attacker}") is None, data
            assert auth.reload_failures >= n
    assert any("not reloaded, keeping the last good keys" in r.getMessage() for r in caplog.records)
    if os.geteuid() != 0:  # root reads any file: the unreadable case needs an ordinary user
        path.write_text(json.dumps({"keys": records}))
        path.chmod(0)
        assert auth.principal(f"Bearer {good}") is not None
    path.chmod(0o600)
    path.write_text(json.dumps({"keys": [{**records[0], "revoked": "now"}, records[1]]}))
    assert auth.principal(f"Bearer {good}") is None  # a good file again: its revocation applies at once
    # a replica that starts on a corrupt file has no file keys at all (closed), and does not crash
    path.write_bytes(b"{")
    fresh = Authenticator(str(path), [digest("env-key")])
    assert fresh.principal(f"Bearer {good}") is None and fresh.principal("Bearer env-key").tenant == "default"


def _create_and_revoke(uri: str, worker: int, n: int) -> list[tuple[str, bool]]:
    """n keys from one worker, every other one revoked at once: (key id, revoked?)."""
    done = []
    for i in range(n):
        _, rec = create_key(uri, f"t{worker}")
        if i % 2 == 0:
            revoke_key(uri, rec["id"])
        done.append((rec["id"], i % 2 == 0))
    return done


def _process_worker(uri: str, worker: int, n: int, out) -> None:
    with ThreadPoolExecutor(3) as pool:
        results = list(pool.map(lambda t: _create_and_revoke(uri, worker * 10 + t, n), range(3)))
    out.put([x for r in results for x in r])


def test_concurrent_create_and_revoke_from_processes_and_threads_lose_nothing(tmp_path):
    uri = str(tmp_path / "keys.json")
    ctx = multiprocessing.get_context("fork")
    out = ctx.Queue()
    procs = [ctx.Process(target=_process_worker, args=(uri, p, 8, out)) for p in range(4)]
    for p in procs:
        p.start()
    expected = dict(x for _ in procs for x in out.get(timeout=100))
    for p in procs:
        p.join(timeout=30)
        assert p.exitcode == 0
    stored = {r["id"]: r["revoked"] is not None for r in read_store(uri)}
    assert len(expected) == 4 * 3 * 8
    assert stored == expected  # every create kept, every revocation kept


# ---- bodies: never read before the key, never past the cap ----


@pytest.fixture(scope="module")
def live_review(review_app):
    """The review app on a real uvicorn server on 127.0.0.1 (raw sockets need a real server)."""
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    serving(review_app)
    server = uvicorn.Server(uvicorn.Config(review_app, log_level="warning", timeout_keep_alive=2))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.05)
    yield port
    server.should_exit = True
    thread.join(timeout=10)


def _send_and_read_status(port: int, head: bytes, body_chunk: bytes, budget_bytes: int, wait_s: float = 5.0):
    """Send the head, then body bytes up to budget_bytes (never the whole declared body), and return
    the status line the server answers with, the bytes sent, and the seconds it took."""
    started = time.perf_counter()
    conn = socket.create_connection(("127.0.0.1", port))
    conn.settimeout(0.01)
    conn.sendall(head)
    sent, reply = 0, b""
    deadline = time.monotonic() + wait_s
    while time.monotonic() < deadline and b"\r\n" not in reply:
        if sent < budget_bytes:
            try:
                conn.sendall(body_chunk)
                sent += len(body_chunk)
            except OSError:
                sent = budget_bytes  # the server closed its side: stop sending
        try:
            data = conn.recv(4096)
            if not data:
                break
            reply += data
        except (TimeoutError, BlockingIOError):
            pass
    conn.close()
    return reply.split(b"\r\n", 1)[0].decode(), sent, time.perf_counter() - started


def test_a_1gb_body_with_a_bad_key_gets_401_without_being_read(live_review):
    for framing in (b"Content-Length: 1073741824\r\n", b"Transfer-Encoding: chunked\r\n"):
        head = (
            b"POST /v1/review/items/review-1/decide HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            + framing
            + b"Authorization: Bearer sk-lmf-forged\r\n\r\n"
        )
        chunk = b"1000\r\n" + b"a" * 4096 + b"\r\n" if b"chunked" in framing else b"a" * 4096
        status, sent, took = _send_and_read_status(live_review, head, chunk, budget_bytes=64 * 4096)
        assert status.startswith("HTTP/1.1 401"), status
        assert took < 3 and sent < 1 << 30  # answered long before a gigabyte could have come


def test_oversized_bodies_lying_content_length_and_chunked_get_413(live_review, keys):
    _, k = keys
    key = k["reviewer"].encode()
    url = b"POST /v1/review/next HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
    # a declared length over the cap: refused before a byte of body is read
    head = url + b"Content-Length: 1073741824\r\nAuthorization: Bearer " + key + b"\r\n\r\n"
    status, _, took = _send_and_read_status(live_review, head, b"a" * 4096, budget_bytes=16 * 4096)
    assert status.startswith("HTTP/1.1 413") and took < 3, status
    # chunked, no length: counted as it arrives, refused once past the cap (1 MiB)
    head = url + b"Transfer-Encoding: chunked\r\nAuthorization: Bearer " + key + b"\r\n\r\n"
    chunk = b"10000\r\n" + b" " * 65536 + b"\r\n"
    status, sent, _ = _send_and_read_status(live_review, head, chunk, budget_bytes=64 << 20, wait_s=20)
    assert status.startswith("HTTP/1.1 413"), status
    assert sent < 32 << 20  # the server stopped it near the cap, not at the end of 64 MiB
    small = httpx.post(f"http://127.0.0.1:{live_review}/v1/review/next", json={}, headers=bearer(k["reviewer"]))
    assert small.status_code in (200, 404)  # under the cap the route runs


# ---- keys never in logs ----


def test_generated_key_never_reaches_logs_of_keys_create_or_the_server(live_review, keys, tmp_path, caplog):
    uri = str(tmp_path / "keys.json")
    env = {**os.environ, "PYTHONPATH": str(ROOT), "LMFOUNDRY_LOG_LEVEL": "DEBUG"}
    made = subprocess.run(
        [
            sys.executable,
            "-m",
            "lmfoundry.jobs.keys",
            "create",
            "--tenant",
            "acme",
            "--role",
            "reviewer",
            "--file",
            uri,
        ],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert made.returncode == 0, made.stderr
    key = made.stdout.strip()
    assert key.startswith("sk-lmf-") and key not in made.stderr and key not in Path(uri).read_text()
    bad = subprocess.run(
        [sys.executable, "-m", "lmfoundry.jobs.keys", "create", "--tenant", "acme", "--role", "root", "--file", uri],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert bad.returncode == 2 and "role 'root' is unknown; roles are user, reviewer, approver, admin" in bad.stderr
    _, k = keys
    with caplog.at_level(logging.DEBUG):
        for header in (bearer(k["reviewer"]), bearer(k["user"]), bearer(k["reviewer"] + "x")):
            httpx.get(f"http://127.0.0.1:{live_review}/v1/review/items", headers=header)
    logged = "\n".join(r.getMessage() for r in caplog.records)
    for secret in (k["reviewer"], k["user"]):
        assert secret not in logged
