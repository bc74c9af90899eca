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

import contextlib
import fcntl
import json
import math
import os
import re
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
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
GATE_ACTION = "gate_action.json"  # under a run directory: what the failed gates ask training to do


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


# --- what a checkpoint may name ------------------------------------------------------------------
#
# A manifest comes from storage an attacker may write to, and its file names become local paths
# when a checkpoint is verified, copied down or resumed. Every name is checked before anything is
# read or written: relative, forward slashes, at most a few components of letters, digits, dot,
# dash and underscore, none of them "." or "..". Files on a local filesystem must be plain files
# reached through plain directories: a symlink (to /etc/passwd, or out of the checkpoint) is refused.

_NAME_PART = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
MAX_NAME_DEPTH = 6
MAX_NAME_CHARS = 512
_SHA256 = re.compile(r"[0-9a-f]{64}")


def check_name(name: object) -> str:
    """`name` when it is a safe relative file name inside a checkpoint; a ValueError naming what
    is wrong and what is allowed otherwise."""
    allowed = (
        "allowed: a relative path of at most "
        f"{MAX_NAME_DEPTH} '/'-separated parts of letters, digits, '.', '-', '_' (not '.' or '..')"
    )
    if not isinstance(name, str) or not name:
        raise ValueError(f"checkpoint file name {name!r} is not a non-empty string; {allowed}")
    if "\x00" in name or "\\" in name or name.startswith("/") or re.match(r"[A-Za-z]:", name):
        raise ValueError(
            f"checkpoint file name {name!r} is absolute or has a NUL, backslash or drive letter; {allowed}"
        )
    parts = name.split("/")
    if len(name) > MAX_NAME_CHARS or len(parts) > MAX_NAME_DEPTH:
        raise ValueError(f"checkpoint file name {name[:80]!r}... is too long or too deep; {allowed}")
    for part in parts:
        if part in (".", "..") or not _NAME_PART.fullmatch(part):
            raise ValueError(f"checkpoint file name {name!r} has the part {part!r}; {allowed}")
    return name


def checked_files(manifest: object, where: str) -> dict[str, dict]:
    """The manifest's `files`, after checking its shape and every name (nothing is touched yet)."""
    if not isinstance(manifest, dict) or not isinstance(manifest.get("files"), dict):
        raise ValueError(f"{where}: {CHECKPOINT_MANIFEST} is not an object with a 'files' object")
    files = manifest["files"]
    for name, meta in files.items():
        check_name(name)
        if name == CHECKPOINT_MANIFEST or name.startswith(PARTS + "/"):
            raise ValueError(f"{where}: the manifest lists {name!r}, a name reserved for the checkpoint's bookkeeping")
        if (
            not isinstance(meta, dict)
            or not isinstance(meta.get("bytes"), int)
            or isinstance(meta.get("bytes"), bool)
            or meta["bytes"] < 0
            or not isinstance(meta.get("sha256"), str)
            or not _SHA256.fullmatch(meta["sha256"])
        ):
            raise ValueError(
                f"{where}: the entry for {name!r} must be {{'bytes': a size >= 0, 'sha256': 64 hex digits}}"
            )
    return files


def refuse_links(directory: str | os.PathLike, name: str) -> Path:
    """The local path of `name` under `directory`, when every part of it is a plain directory or
    file (no symlink anywhere) and it stays inside `directory`."""
    root = Path(directory)
    path = root
    for part in name.split("/"):
        path = path / part
        if path.is_symlink():
            raise ValueError(f"checkpoint {root}: {name} goes through a symbolic link ({path}); links are refused")
    if path.exists() and not path.is_file():
        raise ValueError(f"checkpoint {root}: {name} is not a regular file")
    if not path.resolve().is_relative_to(root.resolve()):
        raise ValueError(f"checkpoint {root}: {name} resolves outside the checkpoint")
    return path


def refuse_any_link(directory: str | os.PathLike) -> None:
    """A local checkpoint holds no symbolic link at all: a loader that opens a fixed name (the
    tokenizer, the model config) must never be led out of the checkpoint."""
    root = Path(directory)
    if root.is_symlink():
        raise ValueError(f"checkpoint {root} is itself a symbolic link; links are refused")
    for parent, dirs, files in os.walk(root, followlinks=False):
        for entry in (*dirs, *files):
            if Path(parent, entry).is_symlink():
                raise ValueError(f"checkpoint {root}: {Path(parent, entry)} is a symbolic link; links are refused")


# --- safetensors files: the header must describe the file ---------------------------------------

MAX_SAFETENSORS_HEADER = 100 << 20  # the limit safetensors itself applies
_DTYPE_BYTES = {
    "BOOL": 1,
    "U8": 1,
    "I8": 1,
    "F8_E5M2": 1,
    "F8_E4M3": 1,
    "I16": 2,
    "U16": 2,
    "F16": 2,
    "BF16": 2,
    "I32": 4,
    "U32": 4,
    "F32": 4,
    "I64": 8,
    "U64": 8,
    "F64": 8,
}


def check_safetensors(path: str | os.PathLike) -> None:
    """Refuse a safetensors file whose header lies: a header length past the end of the file,
    tensors whose byte ranges overlap, leave gaps, run past the data or do not match their
    dtype and shape. Read before any tensor is loaded, so a crafted header never drives an
    allocation or a read."""
    size = os.path.getsize(path)
    with open(path, "rb") as f:
        prefix = f.read(8)
        if len(prefix) < 8:
            raise ValueError(f"{path}: not a safetensors file (shorter than its 8-byte header length)")
        n = int.from_bytes(prefix, "little")
        if n > MAX_SAFETENSORS_HEADER or 8 + n > size:
            raise ValueError(f"{path}: header length {n} runs past the end of the {size}-byte file")
        try:
            header = json.loads(f.read(n))
        except (json.JSONDecodeError, UnicodeDecodeError) as e:
            raise ValueError(f"{path}: the safetensors header is not JSON ({e})") from None
    if not isinstance(header, dict):
        raise ValueError(f"{path}: the safetensors header is not an object")
    data_bytes = size - 8 - n
    spans = []
    for key, t in header.items():
        if key == "__metadata__":
            continue
        try:
            dtype, shape, (start, end) = t["dtype"], t["shape"], t["data_offsets"]
            count = math.prod(int(d) for d in shape)
            if any(not isinstance(d, int) or d < 0 for d in shape) or not all(isinstance(o, int) for o in (start, end)):
                raise TypeError
        except (KeyError, TypeError, ValueError):
            raise ValueError(f"{path}: tensor {key!r} needs dtype, shape (sizes >= 0) and data_offsets") from None
        if dtype not in _DTYPE_BYTES:
            raise ValueError(f"{path}: tensor {key!r} has dtype {dtype!r}; allowed: {', '.join(_DTYPE_BYTES)}")
        if not 0 <= start <= end <= data_bytes or end - start != count * _DTYPE_BYTES[dtype]:
            raise ValueError(
                f"{path}: tensor {key!r} claims bytes [{start}, {end}) for {dtype} {shape}; "
                f"it needs {count * _DTYPE_BYTES[dtype]} bytes inside the {data_bytes} data bytes"
            )
        spans.append((start, end))
    covered = 0
    for start, end in sorted(spans):
        if start != covered:
            raise ValueError(f"{path}: tensor byte ranges overlap or leave a gap at byte {covered}")
        covered = end
    if covered != data_bytes:
        raise ValueError(f"{path}: tensors cover {covered} of the {data_bytes} data bytes")


# --- reading checkpoints ----------------------------------------------------------------------


def verify(directory: str, model_only: bool = False) -> dict:
    """The manifest of a checkpoint (local or remote), after checking every name it lists and
    that every file matches it (size, then sha256; safetensors headers too, for local files);
    `model_only` leaves out the training state that only resuming reads."""
    directory = storage.normalize(str(directory))
    path = storage.join(directory, CHECKPOINT_MANIFEST)
    if not storage.exists(path):
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no {CHECKPOINT_MANIFEST}")
    local = not storage.is_remote(directory)
    if local:
        refuse_any_link(directory)
    manifest = storage.read_json(path, storage.MAX_MANIFEST_BYTES)
    for name, meta in checked_files(manifest, directory).items():
        if model_only and name.startswith(TRAINING_STATE):
            continue
        f = storage.join(directory, name)
        if local:
            refuse_links(directory, name)
        if not storage.exists(f):
            raise ValueError(f"checkpoint {directory} is missing {name}")
        if storage.size(f) != meta["bytes"]:
            raise ValueError(f"checkpoint {directory}: {name} is not the {meta['bytes']} bytes its manifest says")
        if storage.sha256_uri(f) != meta["sha256"]:
            raise ValueError(f"checkpoint {directory}: {name} does not match its checksum (corrupt)")
        if local and name.endswith(".safetensors"):
            check_safetensors(f)
    return manifest


def resolve(uri: str) -> str:
    """A checkpoint directory, or the final checkpoint of a pretrain run directory."""
    uri = storage.normalize(uri)
    if storage.exists(storage.join(uri, CHECKPOINT_MANIFEST)):
        return uri
    if storage.is_committed(uri):
        manifest = storage.read_manifest(uri)
        if manifest.get("final_checkpoint"):
            return storage.join(uri, check_name(manifest["final_checkpoint"]))
    raise FileNotFoundError(
        f"{uri} is neither a checkpoint (no {CHECKPOINT_MANIFEST}) nor a finished pretrain run "
        "(no _MANIFEST.json naming a final_checkpoint)"
    )


def download(fs: pafs.FileSystem, path: str, target: str | os.PathLike, model_only: bool = False) -> None:
    """Copy the checkpoint at `path` on `fs` into the empty local directory `target`. Every name
    in its manifest is checked before the first byte is written, and each file is written only
    at its checked name under `target`."""
    with fs.open_input_stream(f"{path}/{CHECKPOINT_MANIFEST}") as f:
        manifest_bytes = storage.read_bounded(f, storage.MAX_MANIFEST_BYTES, f"{path}/{CHECKPOINT_MANIFEST}")
    names = list(checked_files(json.loads(manifest_bytes), path))
    target = Path(target)
    for name in names:
        if model_only and name.startswith(TRAINING_STATE):
            continue
        source = f"{path}/{name}"
        if fs.get_file_info(source).type != pafs.FileType.File:
            raise ValueError(f"checkpoint {path}: {name} is missing or not a regular file")
        if isinstance(fs, pafs.LocalFileSystem):
            refuse_links(path, name)  # a local "remote" would follow a link when read
        dest = refuse_links(target, name)
        dest.parent.mkdir(parents=True, exist_ok=True)
        with fs.open_input_stream(source) as src, open(dest, "xb") as out:
            for chunk in iter(lambda: src.read(8 << 20), b""):
                out.write(chunk)
    (target / CHECKPOINT_MANIFEST).write_bytes(manifest_bytes)


def local_copy(uri: str, model_only: bool = False) -> str:
    """A local directory holding the checkpoint at `uri`, downloading it into a new temporary
    directory when it is remote (without the training state when `model_only`); the caller
    removes a downloaded copy (`opened` does). A failed download leaves nothing behind."""
    uri = resolve(uri)
    if not storage.is_remote(uri):
        return uri
    return copy_down(*storage.filesystem(uri), model_only)


TEMP_PREFIX = "lmfoundry-ckpt-"


def copy_down(fs: pafs.FileSystem, path: str, model_only: bool = False) -> str:
    """A new temporary local directory holding the checkpoint at `path` on `fs`; removed again
    when the copy fails, so a refused or broken checkpoint leaves nothing on local disk."""
    target = tempfile.mkdtemp(prefix=TEMP_PREFIX)
    try:
        download(fs, path, target, model_only)
    except BaseException:
        shutil.rmtree(target, ignore_errors=True)
        raise
    return target


def name_in_run(uri: str) -> str:
    """A checkpoint's name inside its run directory (`checkpoints/step-NNNNNNNN`), as a run's
    manifest records it."""
    return f"{CHECKPOINTS}/{uri.rstrip('/').rsplit('/', 1)[-1]}"


# A node's copies (run_copy) are kept for a worker group that takes over; one that no process
# holds and no run has used for this long is removed by the next run_copy on the node (a run that
# failed for good and was not rerun), and so is a download that has written nothing for as long.
STALE_RUN_COPY_S = 24 * 3600
# while a process holds a copy it marks it used this often, so that a holder killed after a long
# run (which never lets go) leaves a copy that looks used an hour before it died at most
HELD_COPY_TOUCH_S = 3600
PARTIAL_PREFIX = "lmfoundry-partial-"
# the copies this process reads: the path -> (a descriptor holding a shared lock on it, its uses here)
_HELD: dict[str, tuple[int, int]] = {}
_TOUCHING = threading.Lock()
_toucher: threading.Thread | None = None


def run_copy(uri: str, key: str, manifest_sha256: str | None = None) -> str:
    """A local copy of the checkpoint at `uri` (model files only) at a path that `key` fixes, in
    a directory of this user's that no one else can write: a worker group that takes over after
    a failure reuses the copy its predecessor made instead of leaving that one behind and
    downloading another. A copy is used only when every file matches its manifest (and, given
    `manifest_sha256`, the manifest is the one the caller verified, so that every node trains
    from the checkpoint the driver checked); otherwise it is made again, into a directory of its
    own that is renamed into place when complete. A local checkpoint is used where it is.

    The process holds a shared lock (flock) on the copy until `release_run_copy` or
    `remove_run_copy`: `prune_run_copies`, which runs first, removes only copies nobody holds.
    The private directory must be on the node's own disk: a network filesystem's directory lock
    would lock the node only."""
    uri = resolve(uri)
    if not storage.is_remote(uri):
        return uri
    private = private_temp_dir()
    target = private / f"{TEMP_PREFIX}{key}"
    fd = _lock_shared(target)  # before pruning: a group that takes over keeps its predecessor's copy
    try:
        prune_run_copies(private)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    if fd is not None:
        try:
            verified = _verified_copy(target, manifest_sha256)
        except BaseException:
            os.close(fd)
            raise
        if verified:
            return _hold(target, fd)
        os.close(fd)
        if not _remove_unless_held(target) and target.exists():
            raise RuntimeError(
                f"the node's copy of {uri} at {target} does not match the manifest it was verified with, "
                "and it is still read (by another process, or by another use in this one)"
            )
    partial = Path(tempfile.mkdtemp(prefix=PARTIAL_PREFIX, dir=private))
    try:
        download(*storage.filesystem(uri), partial, model_only=True)
        if not _verified_copy(partial, manifest_sha256):
            raise ValueError(f"checkpoint {uri} does not match the manifest it was verified with: it changed since")
        try:
            partial.rename(target)
        except OSError:  # another process made the copy meanwhile (a temporary directory shared by nodes)
            if not _verified_copy(target, manifest_sha256):
                raise
            shutil.rmtree(partial, ignore_errors=True)
    except BaseException:
        shutil.rmtree(partial, ignore_errors=True)
        raise
    fd = _lock_shared(target)
    if fd is None:
        raise RuntimeError(f"the copy of {uri} at {target} was removed as it was made")
    return _hold(target, fd)


def _verified_copy(directory: Path, manifest_sha256: str | None) -> bool:
    try:
        if manifest_sha256 is not None and storage.sha256_file(directory / CHECKPOINT_MANIFEST) != manifest_sha256:
            return False
        verify(str(directory), model_only=True)
    except (OSError, ValueError):
        return False
    return True


def _open_dir(path: Path) -> int | None:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW)
    except OSError:  # not there, or not a directory
        return None


def _lock_shared(path: Path) -> int | None:
    """A descriptor holding a shared lock on the directory at `path`, or None when there is none
    (or a prune removed it while this waited for the lock)."""
    fd = _open_dir(path)
    if fd is None:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_SH)  # waits while a prune holds it
    except BaseException:
        os.close(fd)
        raise
    if _still_at(path, fd):
        return fd
    os.close(fd)
    return None


def _still_at(path: Path, fd: int) -> bool:
    """Whether `path` still names the directory `fd` was opened on (not removed, or removed and
    made again by another process, since)."""
    try:
        here, held = os.stat(path, follow_symlinks=False), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (here.st_dev, here.st_ino) == (held.st_dev, held.st_ino)


def _hold(target: Path, fd: int) -> str:
    try:
        os.utime(target)  # its last use, which prune_run_copies goes by
    except BaseException:
        os.close(fd)
        raise
    earlier = _HELD.get(str(target))
    if earlier is not None:  # the same copy again, or one made again in its place: one lock, counted
        os.close(earlier[0])
    _HELD[str(target)] = (fd, (earlier[1] if earlier else 0) + 1)
    _keep_touching_held_copies()
    return str(target)


def touch_held_copies() -> None:
    """Mark every copy this process holds as used now (through the held descriptor: the
    directory it locked, wherever its path points now)."""
    for fd, _ in list(_HELD.values()):
        with contextlib.suppress(OSError):  # let go and closed meanwhile
            os.utime(fd)


def _keep_touching_held_copies() -> None:
    """Start, once per process, the thread that touches the copies it holds every
    HELD_COPY_TOUCH_S seconds."""
    global _toucher
    with _TOUCHING:
        if _toucher is not None and _toucher.is_alive():
            return

        def touch_forever() -> None:
            while True:
                time.sleep(HELD_COPY_TOUCH_S)
                touch_held_copies()

        _toucher = threading.Thread(target=touch_forever, name="lmfoundry-held-copies", daemon=True)
        _toucher.start()


def release_run_copy(local: str) -> None:
    """This process is done with a copy `run_copy` gave it (nothing for any other directory);
    the copy stays on disk."""
    held = _HELD.pop(str(local), None)
    if held is None:
        return
    fd, uses = held
    if uses > 1:
        _HELD[str(local)] = (fd, uses - 1)
        return
    with contextlib.suppress(OSError):  # its last use ends now: a day from here, prune_run_copies may remove it
        os.utime(fd)
    os.close(fd)


def is_run_copy(local: str) -> bool:
    """Whether `local` is a copy `run_copy` made (verified when made, in this user's private
    directory), decided by where it is, not a checkpoint used where it is. Any other path is
    answered without making the private directory."""
    path = Path(local)
    if path.parent != _private_path() or not path.name.startswith(TEMP_PREFIX):
        return False
    private_temp_dir()  # still this user's alone, which is what a copy there is trusted for
    return True


def remove_run_copy(local: str) -> None:
    """Remove a copy `run_copy` made (nothing for a checkpoint it used where it is): decided by
    where the directory is, without asking the storage again. A copy that another process, or
    another use in this one, still holds is left to that holder."""
    path = Path(local)
    if is_run_copy(local):
        release_run_copy(local)
        if str(local) not in _HELD:
            _remove_unless_held(path)


def _remove_unless_held(path: Path, unused_for: float = 0.0) -> bool:
    """Remove the directory at `path` when no process holds it and it was last used at least
    `unused_for` seconds ago; True when it did."""
    fd = _open_dir(path)
    if fd is None:
        return False
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # held by another process (or a lock this filesystem refuses: counted as held)
            return False
        if not _still_at(path, fd):  # removed and made again meanwhile: the lock is on the old one
            return False
        if time.time() - os.fstat(fd).st_mtime < unused_for:
            return False
        shutil.rmtree(path, ignore_errors=True)
        return True
    finally:
        os.close(fd)


def prune_run_copies(private: Path | None = None, unused_for: float = STALE_RUN_COPY_S) -> list[str]:
    """Remove the node's copies that no process holds and no run has used for `unused_for`
    seconds, and downloads into them that have written nothing for as long. Returns their names."""
    private = private or private_temp_dir()
    now, removed = time.time(), []
    for entry in private.iterdir():
        try:
            if entry.name.startswith(PARTIAL_PREFIX):
                if now - _last_written(entry) >= unused_for:
                    shutil.rmtree(entry, ignore_errors=True)
                    removed.append(entry.name)
            elif entry.name.startswith(TEMP_PREFIX) and _remove_unless_held(entry, unused_for):
                removed.append(entry.name)
        except FileNotFoundError:  # renamed into place or removed by its maker meanwhile
            continue
    return removed


def _last_written(directory: Path) -> float:
    """The newest modification time of `directory` and everything in it."""
    newest = os.lstat(directory).st_mtime
    for root, dirs, files in os.walk(directory):
        for name in dirs + files:
            with contextlib.suppress(FileNotFoundError):
                newest = max(newest, os.lstat(os.path.join(root, name)).st_mtime)
    return newest


def _private_path() -> Path:
    return Path(tempfile.gettempdir()) / f"lmfoundry-{os.getuid()}"


def private_temp_dir() -> Path:
    """TMPDIR/lmfoundry-UID, made with mode 0700; refused when it is a link, another user's, or
    writable by others (a predictable name in a shared directory is only safe so)."""
    path = _private_path()
    try:
        path.mkdir(mode=0o700)
    except FileExistsError:
        pass
    info = os.lstat(path)
    if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid() or info.st_mode & 0o077:
        raise PermissionError(f"{path} must be a directory of this user's that no one else can read or write")
    return path


def remove_copy(local: str, uri: str) -> None:
    """Remove `local` when it is a temporary copy of the checkpoint at `uri` (not the checkpoint)."""
    if str(local) != resolve(uri):
        shutil.rmtree(local, ignore_errors=True)


@contextlib.contextmanager
def opened(uri: str, model_only: bool = True) -> Iterator[tuple[str, dict]]:
    """(local directory, manifest) of the verified checkpoint at `uri`; a temporary copy of a
    remote checkpoint is removed when the block ends, also on error."""
    source = resolve(uri)
    local = local_copy(source, model_only)
    try:
        yield local, verify(local, model_only)
    finally:
        if local != source:
            shutil.rmtree(local, ignore_errors=True)


# --- training state without pickle --------------------------------------------------------------
#
# Resuming must not unpickle: a .pt written by torch.save is a pickle, and loading one from
# storage an attacker can write to runs their code. The RNG states are saved as JSON (Python's
# and numpy's are tuples of integers) and a safetensors tensor (torch's byte state).

RNG_JSON = "rng.json"
RNG_TENSORS = "rng.safetensors"


def save_json_state(path: str | os.PathLike, state: dict) -> None:
    """Counters and other plain training state as JSON (strict: no NaN, nothing but JSON types)."""
    storage.write_json_atomic(str(path), json.loads(json.dumps(state, allow_nan=False)))


def load_json_state(path: str | os.PathLike) -> dict:
    state = json.loads(Path(path).read_text())
    if not isinstance(state, dict):
        raise ValueError(f"{path}: training state must be a JSON object")
    return state


def capture_rng_state() -> tuple[dict, dict]:
    """Python's, numpy's and torch's (CPU, and CUDA's when it is in use) RNG states now, as
    (JSON-able dict, tensors): taken at a step boundary, written later by `write_rng_state`."""
    import random

    import numpy as np
    import torch

    version, internal, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "python": {"version": version, "internal": list(internal), "gauss": gauss},
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss), "cached": cached},
    }
    tensors = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        tensors["cuda"] = torch.cuda.get_rng_state()
    return state, tensors


def write_rng_state(directory: str | os.PathLike, captured: tuple[dict, dict], suffix: str = "") -> None:
    """`rng{suffix}.json` and `rng{suffix}.safetensors` in `directory`."""
    from safetensors.torch import save_file

    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    state, tensors = captured
    save_json_state(directory / f"rng{suffix}.json", state)
    save_file(tensors, str(directory / f"rng{suffix}.safetensors"))


def save_rng_state(directory: str | os.PathLike, suffix: str = "") -> None:
    """The RNG states now, written to `directory` (see `capture_rng_state`)."""
    write_rng_state(directory, capture_rng_state(), suffix)


def load_rng_state(directory: str | os.PathLike, suffix: str = "") -> None:
    """Restore what `save_rng_state` wrote; a ValueError naming the file when it is malformed."""
    import random

    import numpy as np
    import torch
    from safetensors.torch import load_file

    directory = Path(directory)
    json_path, tensor_path = directory / f"rng{suffix}.json", directory / f"rng{suffix}.safetensors"
    check_safetensors(tensor_path)
    tensors = load_file(str(tensor_path))
    state = load_json_state(json_path)
    try:
        py, npy = state["python"], state["numpy"]
        python_state = (int(py["version"]), tuple(int(x) for x in py["internal"]), py["gauss"])
        numpy_state = (
            str(npy["kind"]),
            np.asarray(npy["keys"], dtype=np.uint32),
            int(npy["pos"]),
            int(npy["has_gauss"]),
            float(npy["cached"]),
        )
        torch_state = tensors["torch"]
        # checked in full before anything is set, so a bad file never leaves the state half restored
        if len(python_state[1]) != 625 or numpy_state[1].shape != (624,) or numpy_state[0] != "MT19937":
            raise ValueError("the Python state needs 625 words and the numpy MT19937 state 624 keys")
        if torch_state.dtype != torch.uint8 or torch_state.dim() != 1:
            raise ValueError("the torch RNG state must be a 1-D uint8 tensor")
        random.setstate(python_state)
        np.random.set_state(numpy_state)
        torch.set_rng_state(torch_state)
    except (KeyError, TypeError, ValueError, IndexError, OverflowError, RuntimeError) as e:
        raise ValueError(f"{directory}: malformed RNG state ({type(e).__name__}: {e})") from None
    if "cuda" in tensors and torch.cuda.is_available():
        torch.cuda.set_rng_state(tensors["cuda"])


def torch_load_weights(path: str | os.PathLike, map_location="cpu"):
    """`torch.load` that can only rebuild tensors and plain containers (never runs pickled code)."""
    import torch

    return torch.load(path, map_location=map_location, weights_only=True)


# --- the evaluation gate's verdict, and the tools that act on it --------------------------------
#
# A checkpoint's evaluation writes the gate's verdict into its manifest (`gate`: passed, the
# metrics that regressed or went missing, the baseline). `serve`, `export` and `traffic` refuse a
# checkpoint whose verdict is anything but passed, unless forced; a forced use is logged. A
# checkpoint never evaluated against a baseline carries no verdict and is not refused.


class GateFailed(ValueError):
    """A checkpoint that failed its evaluation gate, used without being forced."""


def mark_gate(uri: str, gate: dict) -> dict:
    """Record the gate's verdict (suite.apply_gate's result) in the manifest of the committed
    checkpoint at `uri`; the manifest as written."""
    path = storage.join(uri, CHECKPOINT_MANIFEST)
    manifest = storage.read_json(path, storage.MAX_MANIFEST_BYTES)
    manifest["gate"] = {
        "passed": bool(gate["passed"]),
        "baseline": gate.get("baseline"),
        "regressions": [r["metric"] for r in gate.get("regressions", [])],
        "missing": list(gate.get("missing", [])),
        "judged_at": time.time(),
    }
    storage.write_json_atomic(path, manifest)
    return manifest


def gate_verdict(manifest: dict) -> dict | None:
    """The gate verdict a manifest records, or None when the checkpoint was never gated."""
    gate = manifest.get("gate")
    return gate if isinstance(gate, dict) else ({"passed": False} if gate is not None else None)


def check_gate(uri: str, force: bool, tool: str) -> dict | None:
    """Refuse the checkpoint at `uri` for `tool` when it failed its gate (GateFailed, naming the
    regressions and the flag that overrides), or log the override when `force`. A malformed
    verdict counts as failed: the manifest may have been edited by hand."""
    uri = resolve(uri)
    verdict = gate_verdict(storage.read_json(storage.join(uri, CHECKPOINT_MANIFEST), storage.MAX_MANIFEST_BYTES))
    if verdict is None or verdict.get("passed") is True:
        return verdict
    worse = ", ".join(map(str, verdict.get("regressions") or [])) or "no metric named"
    if not force:
        raise GateFailed(
            f"{tool}: checkpoint {uri} FAILED its evaluation gate (regressed: {worse}; baseline "
            f"{verdict.get('baseline')}); refusing it. Pass --force-gate-failed to use it anyway (logged)."
        )
    logger.warning(
        "%s: using checkpoint %s although it FAILED its evaluation gate (regressed: %s): forced with "
        "--force-gate-failed",
        tool,
        uri,
        worse,
    )
    return verdict


def last_passing(run_dir: str) -> tuple[int, str] | None:
    """(step, uri) of the newest committed checkpoint of the run whose gate passed."""
    for step, uri in reversed(committed_checkpoints(run_dir)):
        verdict = gate_verdict(storage.read_json(storage.join(uri, CHECKPOINT_MANIFEST), storage.MAX_MANIFEST_BYTES))
        if verdict is not None and verdict.get("passed") is True:
            return step, uri
    return None


def read_gate_action(run_dir: str) -> dict | None:
    """The action the failed gates ask of training (`{"action": "stop"|"rollback", "to_step",
    ...}`), or None when there is none or it was carried out."""
    action = _gate_action_file(run_dir)
    return None if action is None or action.get("done") else action


def carried_out_stop(run_dir: str) -> dict | None:
    """The stop the failed gates asked for, once training carried it out (None otherwise): the
    run is over, whatever worker group reads it next."""
    action = _gate_action_file(run_dir)
    return action if action is not None and action.get("done") and action.get("action") == "stop" else None


def _gate_action_file(run_dir: str) -> dict | None:
    path = storage.join(run_dir, GATE_ACTION)
    return storage.read_json(path) if storage.exists(path) else None


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
        passing = last_passing(self.run_dir)  # what a rollback after failed gates returns to: kept
        for old in to_delete([s for s, _ in committed], self.keep_last, self.keep_every):
            if passing is None or old != passing[0]:
                storage.remove_dir(storage.join(self.run_dir, CHECKPOINTS, step_name(old)))
