"""Evaluate every checkpoint of a training run as it is committed, off the training path.

A thread in the job's driver watches RUN/checkpoints/ for new committed checkpoints and hands
each to a Ray task that runs the fast suite in-process (no nested Ray Data); the driver writes
its record to RUN/evals/step-NNNNNNNN.json and the gate's verdict into the checkpoint's manifest
(platform/checkpoint.py: serve, export and traffic refuse a checkpoint that failed). The training
loop merges the records into metrics.jsonl whenever it writes it, and `finish` merges the last
ones once training is over. Training never waits for an evaluation. A checkpoint that rolling
retention deletes before its evaluation could read it is recorded with the error, not silently
passed over.

With a `FailedGatesPolicy`, N failed gates in a row (evaluation errors neither break nor extend
a run of failures) write RUN/gate_action.json, which the training loop reads at its next logged
step (train/skeleton.py): `stop` ends training there; `rollback` resumes from the newest
checkpoint that passed, drops the failed ones after it, and goes on with fresh batches (after
`max_rollbacks` rollbacks, or with no passing checkpoint to return to, it stops instead).
"""

from __future__ import annotations

import threading
import time
from typing import Literal

from pydantic import Field

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


class FailedGatesPolicy(StageConfig):
    after: int = Field(3, ge=1, description="act after this many failed gates in a row")
    action: Literal["stop", "rollback"] = "stop"
    max_rollbacks: int = Field(1, ge=0, description="rollbacks before a further run of failures stops training")


def failed_in_a_row(records: list[dict]) -> tuple[list[int], int | None]:
    """(steps of the trailing run of failed gates, step of the last passed gate) of the records."""
    failed: list[int] = []
    for record in sorted(records, key=lambda r: r["step"]):
        if record.get("gate_passed") is True:
            failed = []
        elif record.get("gate_passed") is False:
            failed.append(record["step"])
    passed = [r["step"] for r in records if r.get("gate_passed") is True]
    return failed, max(passed) if passed else None


def decide(records: list[dict], policy: FailedGatesPolicy, rollbacks_done: int) -> dict | None:
    """The action N failed gates in a row call for, or None."""
    failed, last_passed = failed_in_a_row(records)
    if len(failed) < policy.after:
        return None
    action = policy.action
    if action == "rollback" and (last_passed is None or rollbacks_done >= policy.max_rollbacks):
        action = "stop"  # nothing that passed to return to, or the rollbacks did not mend it
    return {"action": action, "to_step": last_passed if action == "rollback" else None, "failed_steps": failed}


def evaluate_checkpoint(uri: str, step: int, suites_json: dict) -> dict:
    """Runs in a Ray task: the suites over one checkpoint; its record."""
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.suite import EvalSuites, apply_gate, evaluate

    suites = EvalSuites.model_validate(suites_json)
    started = time.perf_counter()
    record: dict = {"step": step, "checkpoint": uri}
    try:
        with checkpoint.opened(uri, model_only=True) as (local, _):
            report = evaluate(CheckpointModel(local, suites.batch_size), suites, local, use_ray=False)
        gate = apply_gate(report, suites.gate)
        record.update(metrics=report["metrics"], report=report, gate=gate)
        if gate is not None:
            record["gate_passed"] = gate["passed"]
    except (FileNotFoundError, ValueError, OSError) as e:
        record["error"] = f"{type(e).__name__}: {e}"
    record["seconds"] = round(time.perf_counter() - started, 2)
    return record


class CheckpointEvaluator:
    def __init__(
        self,
        run_dir: str,
        suites,
        num_cpus: float = 1.0,
        poll_s: float = 1.0,
        policy: FailedGatesPolicy | None = None,
    ):
        self.run_dir, self.suites, self.num_cpus, self.poll_s = run_dir, suites, num_cpus, poll_s
        self.policy = policy
        self.pending: dict = {}  # ObjectRef -> (step, its manifest's sha256, when it was submitted)
        self.actions: list[dict] = []  # what the failed gates asked of training
        self._task = None
        self.records: list[dict] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="checkpoint-evaluator", daemon=True)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def _submit_new(self) -> None:
        import ray

        if self._task is None:
            self._task = ray.remote(num_cpus=self.num_cpus, max_retries=1)(evaluate_checkpoint)
        if checkpoint.read_gate_action(self.run_dir):
            return  # training is about to stop or roll back: what it commits now may be undone
        in_flight = {step for step, _, _ in self.pending.values()}
        for step, uri in checkpoint.committed_checkpoints(self.run_dir):
            if step in in_flight or storage.exists(checkpoint.eval_path(self.run_dir, step)):
                continue
            identity = storage.sha256_uri(storage.join(uri, checkpoint.CHECKPOINT_MANIFEST))
            ref = self._task.remote(uri, step, self.suites.model_dump(mode="json"))
            self.pending[ref] = (step, identity, time.time())
            logger.info("evaluating checkpoint %d in the background", step)

    def _rolled_back(self, step: int, submitted: float) -> bool:
        """Whether a rollback to before `step` was carried out after its evaluation began (the
        checkpoint evaluated is gone, and the step will be trained and evaluated again)."""
        path = storage.join(self.run_dir, checkpoint.GATE_ACTION)
        if not storage.exists(path):
            return False
        action = storage.read_json(path)
        return (
            action.get("action") == "rollback"
            and action.get("done") is True
            and isinstance(action.get("to_step"), int)
            and action["to_step"] < step
            and action.get("done_at", 0) >= submitted
        )

    def _collect(self, timeout: float) -> int:
        """Record the evaluations that finished; how many."""
        import ray

        if not self.pending:
            return 0
        done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout)
        for ref in done:
            step, identity, submitted = self.pending.pop(ref)
            try:
                record = ray.get(ref)
            except ray.exceptions.RayError as e:  # the task itself died: record that, go on
                record = {"step": step, "error": str(e)}
            uri = storage.join(self.run_dir, checkpoint.CHECKPOINTS, checkpoint.step_name(step))
            manifest = storage.join(uri, checkpoint.CHECKPOINT_MANIFEST)
            replaced = storage.exists(manifest) and storage.sha256_uri(manifest) != identity
            if replaced or self._rolled_back(step, submitted):
                continue  # a rollback removed or replaced this step's checkpoint while it was evaluated
            if record.get("gate") is not None and storage.exists(manifest):
                checkpoint.mark_gate(uri, record["gate"])
            storage.write_json_atomic(checkpoint.eval_path(self.run_dir, step), record)
            self.records.append(record)
            if "error" in record:
                logger.warning("evaluation of checkpoint %d failed: %s", step, record["error"])
            else:
                shown = {k: round(v, 4) for k, v in list(record["metrics"].items())[:4]}
                logger.info(
                    "checkpoint %d evaluated in %.1f s: %s%s",
                    step,
                    record["seconds"],
                    shown,
                    "" if record.get("gate_passed", True) else " (the gate FAILED)",
                )
        return len(done)

    def _act(self) -> None:
        """Write the action a run of failed gates calls for, unless one is waiting already."""
        if self.policy is None or checkpoint.read_gate_action(self.run_dir):
            return
        on_disk = [
            storage.read_json(uri)
            for uri in storage.list_files(storage.join(self.run_dir, checkpoint.EVALS), (".json",))
        ]
        rollbacks = sum(a["action"] == "rollback" for a in self.actions)
        action = decide(on_disk, self.policy, rollbacks)
        if action is None:
            return
        action["issued_at"] = time.time()
        storage.write_json_atomic(storage.join(self.run_dir, checkpoint.GATE_ACTION), action)
        self.actions.append(action)
        if action["action"] == "rollback":  # training removes the failed records after to_step
            self.records = [r for r in self.records if r["step"] <= action["to_step"]]
        logger.error(
            "the gate failed at steps %s in a row: training is asked to %s%s",
            action["failed_steps"],
            action["action"],
            f" to step {action['to_step']}" if action["to_step"] is not None else "",
        )

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._submit_new()
            if self._collect(timeout=0):
                self._act()
            self._stop.wait(self.poll_s)

    def finish(self, timeout_s: float = 600.0) -> list[dict]:
        """Stop watching, evaluate what was committed since the last look, wait for every
        evaluation; the records, oldest first."""
        self._stop.set()
        self._thread.join()
        self._submit_new()
        deadline = time.monotonic() + timeout_s
        while self.pending and time.monotonic() < deadline:
            self._collect(timeout=min(5.0, max(deadline - time.monotonic(), 0.1)))
        if self.pending:
            logger.warning("%d checkpoint evaluations were still running after %.0f s", len(self.pending), timeout_s)
        return sorted(self.records, key=lambda r: r["step"])
