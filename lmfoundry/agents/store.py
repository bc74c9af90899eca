"""The agent store: runs and their steps in one database (SQLite, or PostgreSQL by DSN), each step
written before the next begins, runs held by workers under leases."""

from __future__ import annotations

import json
import time
import uuid

from lmfoundry.platform.db import Database
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

STATES = ("queued", "running", "waiting_approval", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")


SCHEMA = [
    """CREATE TABLE IF NOT EXISTS agent_runs (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, workflow TEXT NOT NULL, input TEXT NOT NULL,
        state TEXT NOT NULL, output TEXT, error TEXT, cancel_requested INTEGER NOT NULL DEFAULT 0,
        lease_owner TEXT, lease_until DOUBLE PRECISION, created_at DOUBLE PRECISION, updated_at DOUBLE PRECISION)""",
    """CREATE TABLE IF NOT EXISTS agent_steps (
        run_id TEXT NOT NULL, n INTEGER NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL, payload TEXT NOT NULL,
        idempotency_key TEXT, seconds DOUBLE PRECISION, created_at DOUBLE PRECISION, PRIMARY KEY (run_id, n))""",
]


class AgentStore:
    def __init__(self, dsn: str):
        self.db = Database(dsn)
        for s in SCHEMA:
            self.db.run(s)

    def create(self, tenant: str, workflow: str, text: str) -> str:
        run_id = "run_" + uuid.uuid4().hex[:16]
        now = time.time()
        self.db.run(
            "INSERT INTO agent_runs (id, tenant, workflow, input, state, created_at, updated_at) "
            "VALUES (?, ?, ?, ?, 'queued', ?, ?)",
            (run_id, tenant, workflow, text, now, now),
        )
        return run_id

    def get(self, run_id: str, tenant: str | None = None) -> dict | None:
        rows, _ = self.db.run(
            "SELECT id, tenant, workflow, input, state, output, error, cancel_requested, created_at, "
            "updated_at FROM agent_runs WHERE id = ?",
            (run_id,),
        )
        if not rows or (tenant is not None and rows[0][1] != tenant):
            return None  # another tenant's run does not exist, as far as this tenant can tell
        keys = (
            "id",
            "tenant",
            "workflow",
            "input",
            "state",
            "output",
            "error",
            "cancel_requested",
            "created_at",
            "updated_at",
        )
        return {**dict(zip(keys, rows[0])), "steps": self.steps(run_id)}

    def steps(self, run_id: str, after: int = -1) -> list[dict]:
        rows, _ = self.db.run(
            "SELECT n, kind, status, payload, idempotency_key, seconds, created_at FROM agent_steps "
            "WHERE run_id = ? AND n > ? ORDER BY n",
            (run_id, after),
        )
        return [
            {"n": n, "kind": k, "status": s, **json.loads(p), "idempotency_key": key, "seconds": sec, "at": at}
            for n, k, s, p, key, sec, at in rows
        ]

    def write_step(
        self,
        run_id: str,
        n: int,
        kind: str,
        status: str,
        payload: dict,
        key: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Insert or complete step n (the primary key makes a duplicate step impossible)."""
        data = json.dumps(payload)
        _, updated = self.db.run(
            "UPDATE agent_steps SET status = ?, payload = ?, seconds = ? WHERE run_id = ? AND n = ?",
            (status, data, seconds, run_id, n),
        )
        if updated == 0:
            self.db.run(
                "INSERT INTO agent_steps (run_id, n, kind, status, payload, idempotency_key, seconds, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, n, kind, status, data, key, seconds, time.time()),
            )

    def set_state(
        self, run_id: str, state: str, output: str | None = None, error: str | None = None, release: bool = False
    ) -> None:
        sql = (
            "UPDATE agent_runs SET state = ?, output = COALESCE(?, output), error = COALESCE(?, error), updated_at = ?"
        )
        if release:
            sql += ", lease_owner = NULL, lease_until = NULL"
        self.db.run(sql + " WHERE id = ?", (state, output, error, time.time(), run_id))

    def claim(self, worker: str, lease_s: float, per_tenant: int) -> str | None:
        """The oldest runnable run (queued, or running under an expired lease) of a tenant below its
        concurrency limit, leased to `worker`; None when there is none."""
        now = time.time()
        rows, _ = self.db.run(
            "SELECT id, tenant FROM agent_runs WHERE state = 'queued' OR (state = 'running' AND lease_until < ?) "
            "ORDER BY created_at LIMIT 50",
            (now,),
        )
        for run_id, tenant in rows:
            busy, _ = self.db.run(
                "SELECT COUNT(*) FROM agent_runs WHERE tenant = ? AND state = 'running' AND lease_until >= ?",
                (tenant, now),
            )
            if busy[0][0] >= per_tenant:
                continue
            _, won = self.db.run(
                "UPDATE agent_runs SET state = 'running', lease_owner = ?, lease_until = ?, updated_at = ? "
                "WHERE id = ? AND (state = 'queued' OR (state = 'running' AND lease_until < ?))",
                (worker, now + lease_s, now, run_id, now),
            )
            if won == 1:
                return run_id
        return None

    def renew(self, run_id: str, worker: str, lease_s: float) -> bool:
        _, ok = self.db.run(
            "UPDATE agent_runs SET lease_until = ? WHERE id = ? AND lease_owner = ? AND state = 'running'",
            (time.time() + lease_s, run_id, worker),
        )
        return ok == 1

    def request_cancel(self, run_id: str) -> None:
        self.db.run("UPDATE agent_runs SET cancel_requested = 1 WHERE id = ?", (run_id,))
        self.db.run(
            "UPDATE agent_runs SET state = 'cancelled', updated_at = ? WHERE id = ? AND state IN "
            "('queued', 'waiting_approval')",
            (time.time(), run_id),
        )

    def decide(self, run_id: str, approved: bool, who: str) -> bool:
        """Answer a pending approval: the run goes back to the queue to carry on."""
        steps = self.steps(run_id)
        if not steps or steps[-1]["kind"] != "approval" or steps[-1]["status"] != "pending":
            return False
        last = steps[-1]
        self.write_step(
            run_id,
            last["n"],
            "approval",
            "done",
            {**{k: last[k] for k in ("tool", "arguments")}, "approved": approved, "by": who},
        )
        _, ok = self.db.run(
            "UPDATE agent_runs SET state = 'queued', lease_owner = NULL, lease_until = NULL, "
            "updated_at = ? WHERE id = ? AND state = 'waiting_approval'",
            (time.time(), run_id),
        )
        return ok == 1

    def active_count(self, tenant: str) -> int:
        rows, _ = self.db.run(
            "SELECT COUNT(*) FROM agent_runs WHERE tenant = ? AND state IN ('queued', 'running')", (tenant,)
        )
        return rows[0][0]


# --- one run ---------------------------------------------------------------------------------
