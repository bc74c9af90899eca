"""The agent service's parts without Ray: the durable run store (leases, per-tenant limits,
approvals, cancellation) on SQLite and PostgreSQL, the injection and secret guards on their
corpora, and the conversation a resumed run rebuilds."""

import json
from pathlib import Path

import pytest
from conftest import wait_until

from lmfoundry.serving import agents

pytestmark = pytest.mark.timeout(120)
SUITES = Path(agents.__file__).parent / "suites"


@pytest.fixture(params=["sqlite", "postgres_dsn"], ids=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        return agents.AgentStore(str(tmp_path / "runs.sqlite"))
    dsn = request.getfixturevalue(request.param)  # the server, and its markers
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS agent_runs, agent_steps")
    return agents.AgentStore(dsn)


def test_a_run_is_leased_to_one_worker_and_resumed_by_another_when_the_lease_runs_out(store):
    run = store.create("acme", "orders", "what did acme spend?")
    assert store.claim("w1", lease_s=0.3, per_tenant=4) == run
    assert store.claim("w2", lease_s=0.3, per_tenant=4) is None  # held
    store.write_step(run, 0, "model", "done", {"tool": "sql", "arguments": {"query": "SELECT 1"}})
    store.write_step(run, 1, "tool", "started", {"tool": "sql", "arguments": {}}, key=f"{run}:1")
    # w1 died: once its lease expires w2 claims the run
    wait_until(lambda: store.claim("w2", lease_s=5, per_tenant=4) == run, 5, "w1's 0.3 s lease to expire")
    assert not store.renew(run, "w1", 5) and store.renew(run, "w2", 5)
    store.write_step(run, 1, "tool", "done", {"tool": "sql", "arguments": {}, "model_view": "[[1]]"}, key=f"{run}:1")
    steps = store.get(run)["steps"]
    assert [(s["n"], s["status"]) for s in steps] == [(0, "done"), (1, "done")]  # completed, not duplicated
    assert steps[1]["idempotency_key"] == f"{run}:1"


def test_tenants_are_isolated_and_limited(store):
    a = [store.create("acme", "orders", f"q{i}") for i in range(3)]
    b = store.create("globex", "orders", "q")
    assert store.get(a[0], "globex") is None and store.get(b, "globex")["tenant"] == "globex"
    claimed = [store.claim("w", 30, per_tenant=2) for _ in range(4)]
    assert claimed[:3] == [a[0], a[1], b] and claimed[3] is None  # acme's third waits for a free slot
    assert store.active_count("acme") == 3


def test_approvals_and_cancellation(store):
    run = store.create("acme", "refund", "refund 2")
    store.claim("w", 30, 4)
    store.write_step(run, 0, "model", "done", {"tool": "refund", "arguments": {"order": 2}})
    store.write_step(run, 1, "approval", "pending", {"tool": "refund", "arguments": {"order": 2}})
    store.set_state(run, "waiting_approval", release=True)
    assert store.decide(run, approved=False, who="ana")
    assert store.get(run)["state"] == "queued" and store.get(run)["steps"][1]["approved"] is False
    assert not store.decide(run, approved=True, who="ana")  # nothing is pending any more
    store.request_cancel(run)
    assert store.get(run)["state"] == "cancelled"
    running = store.create("acme", "orders", "q")
    store.claim("w", 30, 4)
    store.request_cancel(running)  # a running run stops at its next step
    assert store.get(running)["state"] == "running" and store.get(running)["cancel_requested"] == 1


def test_injected_instructions_are_caught_and_benign_text_passes():
    guard = agents.Guard([])
    injected = [json.loads(line)["text"] for line in (SUITES / "injection.jsonl").read_text().splitlines()]
    benign = [json.loads(line)["text"] for line in (SUITES / "benign.jsonl").read_text().splitlines()]
    block_rate = sum(map(guard.injected, injected)) / len(injected)
    false_positive_rate = sum(map(guard.injected, benign)) / len(benign)
    assert block_rate >= 0.95 and false_positive_rate <= 0.05


def test_secrets_are_redacted_and_tool_outputs_are_marked_untrusted(monkeypatch):
    monkeypatch.setenv("LMFOUNDRY_CANARY", "canary-7f3a9c")
    guard = agents.Guard(["LMFOUNDRY_CANARY"])
    text, found = guard.redact("the key is canary-7f3a9c, keep it")
    assert found and "canary-7f3a9c" not in text and "[redacted]" in text
    wf = agents.WorkflowConfig(name="w", model_url="http://x", tools={"sql": {"kind": "sql", "dsn": "x"}})
    steps = [
        {"n": 0, "kind": "model", "status": "done", "tool": "sql", "arguments": {"query": "SELECT 1"}},
        {"n": 1, "kind": "tool", "status": "done", "tool": "sql", "model_view": "[[1]]"},
    ]
    messages = agents.conversation(wf, {"input": "hi"}, steps)
    assert agents.UNTRUSTED_NOTE in messages[0]["content"]
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"] == "call_0"
    assert messages[3]["content"].startswith("<untrusted-tool-output>")


def test_workflow_files_are_checked(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text(
        "workflows:\n  w:\n    model_url: http://x\n    tools: {sql: {kind: sql, dsn: db}}\n"
        "    approval_required: [http]\n"
    )
    with pytest.raises(ValueError, match="not among its tools"):
        agents.load_workflows(str(f))
    f.write_text("workflows:\n  w:\n    model_url: http://x\n    tools: {sql: {kind: shell}}\n")
    with pytest.raises(ValueError, match="kind"):
        agents.load_workflows(str(f))
