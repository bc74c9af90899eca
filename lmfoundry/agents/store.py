"""The agent store: runs and their steps in one database (SQLite, or PostgreSQL by DSN), each step
written before the next begins, runs held by workers under leases.

Fencing: every claim of a run increments its `lease_token`, and every write a worker makes for
a run (a step, a state) is conditional on the token it was given (`... WHERE lease_token = ?`),
in the same transaction as the write. A worker whose lease ran out and was taken over writes
nothing, learns it from `LeaseLost`, and stops before calling another tool. Approval decisions
are one conditional transition (`WHERE state = 'waiting_approval'`) committed with the step
that records them, so exactly one decision wins and a crash leaves either none or both."""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass

from lmfoundry.platform.db import Database, Transaction
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.text import storable

logger = get_logger(__name__)

STATES = ("queued", "running", "waiting_approval", "succeeded", "failed", "cancelled")
TERMINAL = ("succeeded", "failed", "cancelled")


SCHEMA = [
    """CREATE TABLE IF NOT EXISTS agent_runs (
        id TEXT PRIMARY KEY, tenant TEXT NOT NULL, workflow TEXT NOT NULL, input TEXT NOT NULL,
        state TEXT NOT NULL, output TEXT, error TEXT, cancel_requested INTEGER NOT NULL DEFAULT 0,
        lease_owner TEXT, lease_until DOUBLE PRECISION, created_at DOUBLE PRECISION, updated_at DOUBLE PRECISION,
        lease_token INTEGER NOT NULL DEFAULT 0, created_by TEXT)""",
    """CREATE TABLE IF NOT EXISTS agent_steps (
        run_id TEXT NOT NULL, n INTEGER NOT NULL, kind TEXT NOT NULL, status TEXT NOT NULL, payload TEXT NOT NULL,
        idempotency_key TEXT, seconds DOUBLE PRECISION, created_at DOUBLE PRECISION, PRIMARY KEY (run_id, n))""",
]
# columns added since the first schema: (name, definition), added to a store created before them
ADDED_COLUMNS = [("lease_token", "INTEGER NOT NULL DEFAULT 0"), ("created_by", "TEXT")]


class LeaseLost(RuntimeError):
    """The run was claimed by another worker (or ended) since this worker's lease was granted:
    this worker's writes are refused and it must stop working on the run."""


@dataclass(frozen=True)
class Lease:
    """A worker's hold on a run: `token` is the fencing token its writes are checked against."""

    run_id: str
    worker: str
    token: int


@dataclass(frozen=True)
class Decision:
    """The answer to an approval request: `won` says whether this call's decision was recorded;
    when it was not, `approved` and `by` are the decision that was (None when there was none)."""

    won: bool
    approved: bool | None
    by: str | None
    state: str | None


class AgentStore:
    def __init__(self, dsn: str):
        self.db = Database(dsn)
        for s in SCHEMA:
            self.db.run(s)
        for name, definition in ADDED_COLUMNS:
            try:
                self.db.run(f"SELECT {name} FROM agent_runs LIMIT 1")
            except Exception:  # a store created before the column existed
                self.db.run(f"ALTER TABLE agent_runs ADD COLUMN {name} {definition}")

    def create(
        self, tenant: str, workflow: str, text: str, created_by: str | None = None, max_active: int | None = None
    ) -> str | None:
        """A queued run; `created_by` is the API key that started it (it may not approve it).
        With `max_active`, None instead when the tenant already has that many runs queued or
        running: counted and inserted in one transaction that holds the tenant's lock (SQLite's
        write lock; a PostgreSQL advisory lock on the tenant), so that concurrent starts, from
        the threads of one replica or from several, cannot all pass the count."""
        run_id = "run_" + uuid.uuid4().hex[:16]
        now = time.time()
        with self.db.transaction() as tx:
            if max_active is not None:
                if self.db.postgres:
                    # read committed whatever the server's default: the count after the lock must
                    # see the runs the last holder committed, not a snapshot taken before it
                    tx.run("SET TRANSACTION ISOLATION LEVEL READ COMMITTED")
                    tx.run("SELECT pg_advisory_xact_lock(hashtext(?))", (f"agent_runs:{tenant}",))
                rows, _ = tx.run(
                    "SELECT COUNT(*) FROM agent_runs WHERE tenant = ? AND state IN ('queued', 'running')", (tenant,)
                )
                if rows[0][0] >= max_active:
                    return None
            tx.run(
                "INSERT INTO agent_runs (id, tenant, workflow, input, state, created_at, updated_at, created_by) "
                "VALUES (?, ?, ?, ?, 'queued', ?, ?, ?)",
                (run_id, tenant, workflow, text, now, now, created_by),
            )
        return run_id

    def get(self, run_id: str, tenant: str | None = None) -> dict | None:
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
            "lease_token",
            "created_by",
        )
        rows, _ = self.db.run(f"SELECT {', '.join(keys)} FROM agent_runs WHERE id = ?", (run_id,))
        if not rows or (tenant is not None and rows[0][1] != tenant):
            return None  # another tenant's run does not exist, as far as this tenant can tell
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

    # --- a worker's writes, each fenced by its lease ----------------------------------------

    @staticmethod
    def _fence(tx: Transaction, lease: Lease) -> None:
        """Refuse the transaction unless `lease` still holds the run. The comparison is in the
        UPDATE's WHERE clause, and on PostgreSQL the row stays locked until COMMIT, so a claim
        by another worker cannot slip between this check and the writes after it."""
        _, held = tx.run(
            "UPDATE agent_runs SET updated_at = ? WHERE id = ? AND lease_token = ? AND state = 'running'",
            (time.time(), lease.run_id, lease.token),
        )
        if held != 1:
            raise LeaseLost(f"run {lease.run_id}: lease {lease.token} of {lease.worker} is no longer valid")

    @staticmethod
    def _put_step(tx: Transaction, run_id: str, n, kind, status, payload, key, seconds) -> None:
        """Insert or complete step n (the primary key makes a duplicate step impossible)."""
        data = json.dumps(payload)
        _, updated = tx.run(
            "UPDATE agent_steps SET status = ?, payload = ?, seconds = ? WHERE run_id = ? AND n = ?",
            (status, data, seconds, run_id, n),
        )
        if updated == 0:
            tx.run(
                "INSERT INTO agent_steps (run_id, n, kind, status, payload, idempotency_key, seconds, "
                "created_at) VALUES (?, ?, ?, ?, ?, ?, ?, ?)",
                (run_id, n, kind, status, data, key, seconds, time.time()),
            )

    def write_step(
        self,
        lease: Lease,
        n: int,
        kind: str,
        status: str,
        payload: dict,
        key: str | None = None,
        seconds: float | None = None,
    ) -> None:
        """Write step n of the leased run; `LeaseLost` (and nothing written) when the lease is stale."""
        with self.db.transaction() as tx:
            self._fence(tx, lease)
            self._put_step(tx, lease.run_id, n, kind, status, payload, key, seconds)

    def set_state(self, lease: Lease, state: str, output: str | None = None, error: str | None = None) -> None:
        """End the leased run (or park it), releasing the lease; `LeaseLost` when it is stale. The
        output is the model's text: a NUL or lone surrogate in it is kept as U+FFFD."""
        if state not in STATES or state == "running":
            raise ValueError(f"state {state!r}: a worker sets one of {[s for s in STATES if s != 'running']}")
        with self.db.transaction() as tx:
            self._fence(tx, lease)
            tx.run(
                "UPDATE agent_runs SET state = ?, output = COALESCE(?, output), error = COALESCE(?, error), "
                "updated_at = ?, lease_owner = NULL, lease_until = NULL WHERE id = ? AND lease_token = ?",
                (state, storable(output), storable(error), time.time(), lease.run_id, lease.token),
            )

    def await_approval(self, lease: Lease, n: int, payload: dict) -> None:
        """Record the pending approval step and park the run, in one transaction: a run that is
        waiting always has a pending step to decide, and a pending step always a waiting run."""
        with self.db.transaction() as tx:
            self._fence(tx, lease)
            self._put_step(tx, lease.run_id, n, "approval", "pending", payload, None, None)
            tx.run(
                "UPDATE agent_runs SET state = 'waiting_approval', updated_at = ?, lease_owner = NULL, "
                "lease_until = NULL WHERE id = ? AND lease_token = ?",
                (time.time(), lease.run_id, lease.token),
            )

    def claim(self, worker: str, lease_s: float, per_tenant: int) -> Lease | None:
        """The oldest runnable run (queued, or running under an expired lease) of a tenant below its
        concurrency limit, leased to `worker` with the next fencing token; None when there is none."""
        now = time.time()
        rows, _ = self.db.run(
            "SELECT id, tenant, lease_token FROM agent_runs "
            "WHERE state = 'queued' OR (state = 'running' AND lease_until < ?) ORDER BY created_at LIMIT 50",
            (now,),
        )
        for run_id, tenant, token in rows:
            busy, _ = self.db.run(
                "SELECT COUNT(*) FROM agent_runs WHERE tenant = ? AND state = 'running' AND lease_until >= ?",
                (tenant, now),
            )
            if busy[0][0] >= per_tenant:
                continue
            # compare-and-set on the token read above: of two workers claiming at once, one wins
            _, won = self.db.run(
                "UPDATE agent_runs SET state = 'running', lease_owner = ?, lease_until = ?, updated_at = ?, "
                "lease_token = ? WHERE id = ? AND lease_token = ? "
                "AND (state = 'queued' OR (state = 'running' AND lease_until < ?))",
                (worker, now + lease_s, now, token + 1, run_id, token, now),
            )
            if won == 1:
                return Lease(run_id, worker, token + 1)
        return None

    def renew(self, lease: Lease, lease_s: float) -> bool:
        _, ok = self.db.run(
            "UPDATE agent_runs SET lease_until = ? WHERE id = ? AND lease_token = ? AND state = 'running'",
            (time.time() + lease_s, lease.run_id, lease.token),
        )
        return ok == 1

    def request_cancel(self, run_id: str) -> None:
        self.db.run("UPDATE agent_runs SET cancel_requested = 1 WHERE id = ?", (run_id,))
        self.db.run(
            "UPDATE agent_runs SET state = 'cancelled', updated_at = ? WHERE id = ? AND state IN "
            "('queued', 'waiting_approval')",
            (time.time(), run_id),
        )

    # --- approvals ---------------------------------------------------------------------------

    def decide(self, run_id: str, approved: bool, who: str) -> Decision:
        """Answer the pending approval of `run_id`: one conditional transition from
        waiting_approval back to the queue, committed together with the approval step that
        records it (so a crash leaves neither). Of concurrent deciders exactly one wins; the
        others get the winning decision back."""
        with self.db.transaction() as tx:
            _, won = tx.run(
                "UPDATE agent_runs SET state = 'queued', lease_owner = NULL, lease_until = NULL, updated_at = ? "
                "WHERE id = ? AND state = 'waiting_approval'",
                (time.time(), run_id),
            )
            if won == 1:
                rows, _ = tx.run(
                    "SELECT n, payload FROM agent_steps WHERE run_id = ? AND kind = 'approval' "
                    "AND status = 'pending' ORDER BY n DESC LIMIT 1",
                    (run_id,),
                )
                if not rows:  # await_approval writes both at once: a broken store, not a race
                    raise RuntimeError(f"run {run_id} waits for an approval but has no pending approval step")
                n, payload = rows[0]
                pending = json.loads(payload)
                decided = {"tool": pending["tool"], "arguments": pending["arguments"], "approved": approved, "by": who}
                self._put_step(tx, run_id, n, "approval", "done", decided, None, None)
                return Decision(True, approved, who, "queued")
        return self._decision_that_won(run_id)

    def _decision_that_won(self, run_id: str) -> Decision:
        rows, _ = self.db.run("SELECT state FROM agent_runs WHERE id = ?", (run_id,))
        state = rows[0][0] if rows else None
        done, _ = self.db.run(
            "SELECT payload FROM agent_steps WHERE run_id = ? AND kind = 'approval' AND status = 'done' "
            "ORDER BY n DESC LIMIT 1",
            (run_id,),
        )
        if not done:
            return Decision(False, None, None, state)
        last = json.loads(done[0][0])
        return Decision(False, last.get("approved"), last.get("by"), state)

    def active_count(self, tenant: str) -> int:
        rows, _ = self.db.run(
            "SELECT COUNT(*) FROM agent_runs WHERE tenant = ? AND state IN ('queued', 'running')", (tenant,)
        )
        return rows[0][0]


# --- one run ---------------------------------------------------------------------------------
