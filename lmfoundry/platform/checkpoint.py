"""Self-describing checkpoints: a directory of files, a manifest of their checksums written last.

A checkpoint directory holds the weights, the model config, the tokenizer and the training
state; `manifest.json` lists every file with its size and sha256 and is written after them, so a
directory without it (a save cut short) is never taken for a checkpoint. Resume, evaluation and
serving need nothing but the checkpoint path.

A training run keeps its checkpoints in `RUN/checkpoints/step-NNNNNNNN/`. They are written
asynchronously by `AsyncCheckpointer`: the training loop stages the state on fast local storage
(shared memory where there is some) and goes on; a thread on every worker uploads that worker's
files and records them in `_parts/rank-R.json`; rank 0's thread, once every rank's part is
there, writes the manifest (the commit) and applies the retention policy. On resume the newest
committed checkpoint whose files match their checksums wins; a corrupt one is reported and
skipped.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
import time
from collections.abc import Callable
from pathlib import Path

import pyarrow.fs as pafs

from lmfoundry.platform import storage
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

CHECKPOINT_MANIFEST = "manifest.json"
CHECKPOINTS = "checkpoints"  # under a run directory
PARTS = "_parts"  # per-rank file lists inside a checkpoint being written
TRAINING_STATE = "deepspeed/"  # files only resuming needs; serving and evaluation skip them
EVALS = "evals"  # under a run directory: step-NNNNNNNN.json, the evaluation of each checkpoint


def seal(directory: str | os.PathLike, details: dict) -> dict:
    """Checksum every file in a local checkpoint directory and write the manifest last."""
    directory = Path(directory)
    files = {
        str(p.relative_to(directory)): {"bytes": p.stat().st_size, "sha256": storage.sha256_file(p)}
        for p in sorted(directory.rglob("*"))
        if p.is_file() and p.name != CHECKPOINT_MANIFEST
    }
    manifest = {"format_version": 1, "files": files, **details}
    storage.write_json_atomic(str(directory / CHECKPOINT_MANIFEST), manifest)
    return manifest


def verify(directory: str, model_only: bool = False) -> dict:
    """The manifest of a checkpoint (local or remote), after checking that every file matches
    it; `model_only` leaves out the training state that only resuming reads."""
    directory = storage.normalize(str(directory))
    path = storage.join(directory, CHECKPOINT_MANIFEST)
    if not storage.exists(path):
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no {CHECKPOINT_MANIFEST}")
    manifest = storage.read_json(path)
    for name, meta in manifest["files"].items():
        if model_only and name.startswith(TRAINING_STATE):
            continue
        f = storage.join(directory, name)
        if not storage.exists(f):
            raise ValueError(f"checkpoint {directory} is missing {name}")
        if storage.sha256_uri(f) != meta["sha256"]:
            raise ValueError(f"checkpoint {directory}: {name} does not match its checksum (corrupt)")
    return manifest


def resolve(uri: str) -> str:
    """A checkpoint directory, or the final checkpoint of a pretrain run directory."""
    uri = storage.normalize(uri)
    if storage.exists(storage.join(uri, CHECKPOINT_MANIFEST)):
        return uri
    if storage.is_committed(uri):
        manifest = storage.read_manifest(uri)
        if manifest.get("final_checkpoint"):
            return storage.join(uri, manifest["final_checkpoint"])
    raise FileNotFoundError(
        f"{uri} is neither a checkpoint (no {CHECKPOINT_MANIFEST}) nor a finished pretrain run "
        "(no _MANIFEST.json naming a final_checkpoint)"
    )


def local_copy(uri: str, model_only: bool = False) -> str:
    """A local directory holding the checkpoint at `uri`, downloading it when it is remote
    (without the training state when `model_only`)."""
    uri = resolve(uri)
    if not storage.is_remote(uri):
        return uri
    target = tempfile.mkdtemp(prefix="lmfoundry-ckpt-")
    fs, path = storage.filesystem(uri)
    names = [CHECKPOINT_MANIFEST, *storage.read_json(storage.join(uri, CHECKPOINT_MANIFEST))["files"]]
    for name in names:
        if model_only and name.startswith(TRAINING_STATE):
            continue
        Path(target, name).parent.mkdir(parents=True, exist_ok=True)
        pafs.copy_files(
            f"{path}/{name}",
            str(Path(target, name)),
            source_filesystem=fs,
            destination_filesystem=pafs.LocalFileSystem(),
        )
    return target


# --- a training run's rolling checkpoints -------------------------------------------------------


def step_name(step: int) -> str:
    return f"step-{step:08d}"


def eval_path(run_dir: str, step: int) -> str:
    return storage.join(run_dir, EVALS, f"{step_name(step)}.json")


def attach_evals(history: list[dict], run_dir: str) -> list[dict]:
    """The logged steps of a run, each checkpoint's step with the evaluation of that checkpoint
    (`eval`: its tracked metrics and gate verdict, or the error that stopped it) where one is
    recorded in RUN/evals/."""
    found = {}
    for uri in storage.list_files(storage.join(run_dir, EVALS), (".json",)):
        record = storage.read_json(uri)
        found[record["step"]] = {k: record[k] for k in ("metrics", "gate_passed", "error") if k in record}
    return [{**h, "eval": found[h["step"]]} if h.get("step") in found else h for h in history]


def committed_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """(step, uri) of every checkpoint of the run that has its manifest, oldest first."""
    root = storage.join(run_dir, CHECKPOINTS)
    found = []
    for name in storage.list_dirs(root):
        uri = storage.join(root, name)
        if name.startswith("step-") and storage.exists(storage.join(uri, CHECKPOINT_MANIFEST)):
            found.append((int(name.removeprefix("step-")), uri))
    return sorted(found)


def latest_valid(run_dir: str, before_step: int | None = None) -> str | None:
    """The newest committed checkpoint (older than `before_step`, when given) whose files match
    their checksums; corrupt ones are reported loudly and passed over."""
    for step, uri in reversed(committed_checkpoints(run_dir)):
        if before_step is not None and step >= before_step:
            continue
        try:
            verify(uri)
            return uri
        except (ValueError, FileNotFoundError, KeyError) as e:
            logger.error("checkpoint at step %d is corrupt and will not be resumed from: %s", step, e)
    return None


def remove_uncommitted(run_dir: str) -> list[str]:
    """Delete checkpoint directories that never got their manifest (saves cut short)."""
    root = storage.join(run_dir, CHECKPOINTS)
    committed = {uri for _, uri in committed_checkpoints(run_dir)}
    removed = [storage.join(root, n) for n in storage.list_dirs(root) if storage.join(root, n) not in committed]
    for uri in removed:
        storage.remove_dir(uri)
    return removed


def to_delete(steps: list[int], keep_last: int, keep_every: int = 0) -> list[int]:
    """Rolling retention: keep the newest `keep_last`, every step that is a multiple of
    `keep_every` (0: none), and always the newest; the rest go."""
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last} must be >= 1")
    steps = sorted(steps)
    keep = set(steps[-keep_last:]) | {s for s in steps if keep_every and s % keep_every == 0}
    return [s for s in steps if s not in keep]


class AsyncCheckpointer:
    """One per worker: persists staged checkpoint files in a background thread, one save at a
    time. `save` returns at once; `wait` blocks until the save in flight is done and re-raises
    its error. `before_commit` is a hook for fault drills: it runs in the thread after this
    rank's first file is uploaded."""

    def __init__(
        self,
        run_dir: str,
        rank: int,
        world_size: int,
        keep_last: int,
        keep_every: int = 0,
        commit_timeout_s: float = 600.0,
        before_commit: Callable[[int], None] | None = None,
    ):
        self.run_dir, self.rank, self.world_size = run_dir, rank, world_size
        self.keep_last, self.keep_every = keep_last, keep_every
        self.commit_timeout_s = commit_timeout_s
        self.before_commit = before_commit
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None
        self.last_persist_s = 0.0

    def save(self, step: int, staged: Path, details: dict, write: Callable[[], None] | None = None) -> None:
        """Persist checkpoint `step` from the local directory `staged`, after `write` (which
        serialises an in-memory snapshot into it) has run, in the background."""
        self.wait()
        self._thread = threading.Thread(
            target=self._persist, args=(step, Path(staged), details, write), name=f"checkpoint-{step}", daemon=True
        )
        self._thread.start()

    def wait(self) -> None:
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if self._error is not None:
            error, self._error = self._error, None
            raise RuntimeError(f"rank {self.rank}: persisting a checkpoint failed: {error}") from error

    def _persist(self, step: int, staged: Path, details: dict, write: Callable[[], None] | None) -> None:
        started = time.perf_counter()
        try:
            if write is not None:
                write()
            target = storage.join(self.run_dir, CHECKPOINTS, step_name(step))
            files = {}
            for p in sorted(staged.rglob("*")):
                if not p.is_file():
                    continue
                name = str(p.relative_to(staged))
                storage.upload_file(p, storage.join(target, name))
                files[name] = {"bytes": p.stat().st_size, "sha256": storage.sha256_file(p)}
                if self.before_commit is not None and len(files) == 1:
                    self.before_commit(step)
            storage.write_json_atomic(storage.join(target, PARTS, f"rank-{self.rank}.json"), files)
            shutil.rmtree(staged, ignore_errors=True)
            if self.rank == 0:
                self._commit(step, target, details)
        except BaseException as e:  # surfaced by wait()
            self._error = e
        finally:
            self.last_persist_s = time.perf_counter() - started

    def _commit(self, step: int, target: str, details: dict) -> None:
        parts = [storage.join(target, PARTS, f"rank-{r}.json") for r in range(self.world_size)]
        deadline = time.monotonic() + self.commit_timeout_s
        while not all(storage.exists(p) for p in parts):
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"checkpoint {target}: not every rank wrote its part within {self.commit_timeout_s:.0f} s"
                )
            time.sleep(0.05)
        files = {}
        for p in parts:
            files.update(storage.read_json(p))
        storage.write_json_atomic(
            storage.join(target, CHECKPOINT_MANIFEST), {"format_version": 1, "files": files, **details}
        )
        committed = committed_checkpoints(self.run_dir)
        for old in to_delete([s for s, _ in committed], self.keep_last, self.keep_every):
            storage.remove_dir(storage.join(self.run_dir, CHECKPOINTS, step_name(old)))
