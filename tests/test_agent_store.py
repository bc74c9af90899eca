"""The agent service's parts without Ray: the durable run store (leases, per-tenant limits,
approvals, cancellation) on SQLite and PostgreSQL, the injection and secret guards on their
corpora, and the conversation a resumed run rebuilds."""

import json
from pathlib import Path

import pytest
from conftest import wait_until

from lmfoundry.agents import worker, workflow
from lmfoundry.agents.store import AgentStore, LeaseLost

pytestmark = pytest.mark.timeout(120)
SUITES = Path(workflow.__file__).parent / "suites"


@pytest.fixture(params=["sqlite", "postgres_dsn"], ids=["sqlite", "postgresql"])
def store(request, tmp_path):
    if request.param == "sqlite":
        return AgentStore(str(tmp_path / "runs.sqlite"))
    dsn = request.getfixturevalue(request.param)  # the server, and its markers
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute("DROP TABLE IF EXISTS agent_runs, agent_steps")
    return AgentStore(dsn)


def test_a_run_is_leased_to_one_worker_and_resumed_by_another_when_the_lease_runs_out(store):
    run = store.create("acme", "orders", "what did acme spend?")
    w1 = store.claim("w1", lease_s=0.3, per_tenant=4)
    assert w1.run_id == run and w1.token == 1
    assert store.claim("w2", lease_s=0.3, per_tenant=4) is None  # held
    store.write_step(w1, 0, "model", "done", {"tool": "sql", "arguments": {"query": "SELECT 1"}})
    store.write_step(w1, 1, "tool", "started", {"tool": "sql", "arguments": {}}, key=f"{run}:1")
    # w1 died: once its lease expires w2 claims the run
    claimed = []
    wait_until(
        lambda: claimed.append(store.claim("w2", lease_s=5, per_tenant=4)) or claimed[-1] is not None,
        5,
        "w1's 0.3 s lease to expire",
    )
    w2 = claimed[-1]
    assert w2.run_id == run and w2.token == 2
    assert not store.renew(w1, 5) and store.renew(w2, 5)
    with pytest.raises(LeaseLost):  # the old holder's writes are fenced off
        store.write_step(w1, 1, "tool", "done", {"tool": "sql", "arguments": {}, "model_view": "stale"})
    store.write_step(w2, 1, "tool", "done", {"tool": "sql", "arguments": {}, "model_view": "[[1]]"}, key=f"{run}:1")
    steps = store.get(run)["steps"]
    assert [(s["n"], s["status"]) for s in steps] == [(0, "done"), (1, "done")]  # completed, not duplicated
    assert steps[1]["idempotency_key"] == f"{run}:1" and steps[1]["model_view"] == "[[1]]"


def test_tenants_are_isolated_and_limited(store):
    a = [store.create("acme", "orders", f"q{i}") for i in range(3)]
    b = store.create("globex", "orders", "q")
    assert store.get(a[0], "globex") is None and store.get(b, "globex")["tenant"] == "globex"
    claimed = [store.claim("w", 30, per_tenant=2) for _ in range(4)]
    assert [c.run_id for c in claimed[:3]] == [a[0], a[1], b] and claimed[3] is None  # acme's third waits
    assert store.active_count("acme") == 3


def test_concurrent_starts_from_threads_and_replicas_never_pass_the_tenants_limit(store):
    """40 starts at once from 8 threads over two stores (two replicas' connections): exactly the
    limit's worth are queued, the rest refused; another tenant is not held up by them."""
    from concurrent.futures import ThreadPoolExecutor

    replicas = [store, AgentStore(store.db.dsn)]
    with ThreadPoolExecutor(8) as pool:
        started = list(pool.map(lambda i: replicas[i % 2].create("acme", "orders", f"q{i}", max_active=10), range(40)))
    assert sum(run is not None for run in started) == 10 and store.active_count("acme") == 10
    assert store.create("globex", "orders", "q", max_active=10) is not None


def test_a_models_output_that_no_store_can_hold_is_kept_with_replacement_characters(store):
    """A byte-level tokenizer can decode a 0x00 byte, which PostgreSQL's text refuses: the run
    ends with its answer kept, not with a worker stuck on the write."""
    store.create("acme", "orders", "q")
    lease = store.claim("w", 30, per_tenant=4)
    store.set_state(lease, "succeeded", output="a\x00b\ud800c", error=None)
    assert store.get(lease.run_id)["output"] == "a\ufffdb\ufffdc"


def test_approvals_and_cancellation(store):
    run = store.create("acme", "refund", "refund 2", created_by="key_caller")
    lease = store.claim("w", 30, 4)
    store.write_step(lease, 0, "model", "done", {"tool": "refund", "arguments": {"order": 2}})
    store.await_approval(lease, 1, {"tool": "refund", "arguments": {"order": 2}})
    assert store.get(run)["state"] == "waiting_approval" and store.get(run)["created_by"] == "key_caller"
    assert store.decide(run, approved=False, who="ana").won
    assert store.get(run)["state"] == "queued" and store.get(run)["steps"][1]["approved"] is False
    late = store.decide(run, approved=True, who="ben")  # nothing is pending any more: the answer names the winner
    assert not late.won and late.approved is False and late.by == "ana"
    store.request_cancel(run)
    assert store.get(run)["state"] == "cancelled"
    running = store.create("acme", "orders", "q")
    store.claim("w", 30, 4)
    store.request_cancel(running)  # a running run stops at its next step
    assert store.get(running)["state"] == "running" and store.get(running)["cancel_requested"] == 1


def test_injected_instructions_are_caught_and_benign_text_passes():
    guard = worker.Guard([])
    injected = [json.loads(line)["text"] for line in (SUITES / "injection.jsonl").read_text().splitlines()]
    benign = [json.loads(line)["text"] for line in (SUITES / "benign.jsonl").read_text().splitlines()]
    block_rate = sum(map(guard.injected, injected)) / len(injected)
    false_positive_rate = sum(map(guard.injected, benign)) / len(benign)
    assert block_rate >= 0.95 and false_positive_rate <= 0.05


def test_secrets_are_redacted_and_tool_outputs_are_marked_untrusted(monkeypatch):
    monkeypatch.setenv("LMFOUNDRY_CANARY", "canary-7f3a9c")
    guard = worker.Guard(["LMFOUNDRY_CANARY"])
    text, found = guard.redact("the key is canary-7f3a9c, keep it")
    assert found and "canary-7f3a9c" not in text and "[redacted]" in text
    wf = workflow.WorkflowConfig(name="w", model_url="http://x", tools={"sql": {"kind": "sql", "dsn": "x"}})
    steps = [
        {"n": 0, "kind": "model", "status": "done", "tool": "sql", "arguments": {"query": "SELECT 1"}},
        {"n": 1, "kind": "tool", "status": "done", "tool": "sql", "model_view": "[[1]]"},
    ]
    messages = worker.conversation(wf, {"input": "hi"}, steps)
    assert workflow.UNTRUSTED_NOTE in messages[0]["content"]
    assert messages[2]["tool_calls"][0]["id"] == messages[3]["tool_call_id"] == "call_0"
    assert messages[3]["content"].startswith("<untrusted-tool-output>")


def test_workflow_files_are_checked(tmp_path):
    f = tmp_path / "w.yaml"
    f.write_text(
        "workflows:\n  w:\n    model_url: http://x\n    tools: {sql: {kind: sql, dsn: db}}\n"
        "    approval_required: [http]\n"
    )
    with pytest.raises(ValueError, match="not among its tools"):
        workflow.load_workflows(str(f))
    f.write_text("workflows:\n  w:\n    model_url: http://x\n    tools: {sql: {kind: shell}}\n")
    with pytest.raises(ValueError, match="kind"):
        workflow.load_workflows(str(f))
