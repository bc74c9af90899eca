"""Evaluate every checkpoint of a training run as it is committed, off the training path.

A thread in the job's driver watches RUN/checkpoints/ for new committed checkpoints and hands
each to a Ray task that runs the fast suite in-process (no nested Ray Data) and writes
RUN/evals/step-NNNNNNNN.json; the training loop merges those files into metrics.jsonl whenever it
writes it, and `finish` merges the last ones once training is over. Training never waits for an
evaluation. A checkpoint that rolling retention deletes before its evaluation could read it is
recorded with the error, not silently passed over.
"""

from __future__ import annotations

import threading
import time

from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


def evaluate_checkpoint(uri: str, step: int, suites_json: dict, run_dir: str) -> dict:
    """Runs in a Ray task: the suites over one checkpoint, the record written to RUN/evals/."""
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
    storage.write_json_atomic(checkpoint.eval_path(run_dir, step), record)
    return record


class CheckpointEvaluator:
    def __init__(self, run_dir: str, suites, num_cpus: float = 1.0, poll_s: float = 1.0):
        self.run_dir, self.suites, self.num_cpus, self.poll_s = run_dir, suites, num_cpus, poll_s
        self.pending: dict = {}  # ObjectRef -> step
        self.seen: set[int] = set()  # steps handed to a task, or evaluated by an earlier attempt of the run
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
        for step, uri in checkpoint.committed_checkpoints(self.run_dir):
            if step in self.seen:
                continue
            self.seen.add(step)  # each step's record is looked for once, not at every poll
            if storage.exists(checkpoint.eval_path(self.run_dir, step)):
                continue
            self.pending[self._task.remote(uri, step, self.suites.model_dump(mode="json"), self.run_dir)] = step
            logger.info("evaluating checkpoint %d in the background", step)

    def _collect(self, timeout: float) -> None:
        import ray

        if not self.pending:
            return
        done, _ = ray.wait(list(self.pending), num_returns=len(self.pending), timeout=timeout)
        for ref in done:
            step = self.pending.pop(ref)
            try:
                record = ray.get(ref)
            except ray.exceptions.RayError as e:  # the task itself died: record that, go on
                record = {"step": step, "error": str(e)}
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

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._submit_new()
            self._collect(timeout=0)
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
