"""URIs (local paths or s3://...) through pyarrow filesystems, atomic writes and manifests.

A stage's output directory counts as done only when its manifest (`_MANIFEST.json`) exists: the
manifest is written last, so a stage killed midway leaves a directory that a rerun clears and
redoes instead of trusting.
"""

from __future__ import annotations

import hashlib
import json
import os
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow.fs as pafs

MANIFEST = "_MANIFEST.json"


def is_remote(uri: str) -> bool:
    return "://" in uri and not uri.startswith("file://")


def normalize(uri: str) -> str:
    """Absolute local paths (Ray workers may run in another cwd); remote URIs unchanged."""
    if is_remote(uri):
        return uri.rstrip("/")
    if uri.startswith("file://"):
        uri = uri[len("file://") :]
    return str(Path(uri).expanduser().resolve())


def _pafs():
    """pyarrow.fs, imported on first use: `lmfoundry keys --help` must not wait for pyarrow."""
    import pyarrow.fs

    return pyarrow.fs


def filesystem(uri: str) -> tuple[pafs.FileSystem, str]:
    uri = normalize(uri)
    if is_remote(uri):
        return _pafs().FileSystem.from_uri(uri)
    return _pafs().LocalFileSystem(), uri


def join(uri: str, *parts: str) -> str:
    return "/".join([uri.rstrip("/"), *parts])


def exists(uri: str) -> bool:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).type != _pafs().FileType.NotFound


def list_files(uri: str, suffixes: tuple[str, ...] = ()) -> list[str]:
    """Files under `uri` (recursively), sorted, skipping hidden and underscore-prefixed names."""
    fs, path = filesystem(uri)
    info = fs.get_file_info(path)
    if info.type == _pafs().FileType.File:
        return [normalize(uri)]
    if info.type == _pafs().FileType.NotFound:
        return []
    found = fs.get_file_info(_pafs().FileSelector(path, recursive=True))
    prefix = uri.split("://")[0] + "://" if is_remote(uri) else ""
    out = []
    for f in found:
        name = f.base_name
        if f.type != _pafs().FileType.File or name.startswith((".", "_")):
            continue
        if suffixes and not name.endswith(suffixes):
            continue
        out.append(prefix + f.path)
    return sorted(out)


# The most a manifest (a stage's or a checkpoint's) may hold: one lists every file of a
# checkpoint, about 150 bytes each.
MAX_MANIFEST_BYTES = 64 << 20


def read_bytes(uri: str, limit: int | None = None) -> bytes:
    """The file's bytes; with `limit`, a file that is not a regular file or holds more than
    `limit` bytes is refused, reading at most limit + 1 bytes (so a file that grows after a size
    check cannot make the read unbounded)."""
    fs, path = filesystem(uri)
    if limit is not None and fs.get_file_info(path).type != _pafs().FileType.File:
        raise ValueError(f"{uri} is not a regular file")
    with fs.open_input_stream(path) as f:
        return f.read() if limit is None else read_bounded(f, limit, uri)


def read_bounded(stream, limit: int, where: str) -> bytes:
    """At most `limit` bytes of an open stream, reading no more than limit + 1: more is refused."""
    data = stream.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{where} holds more than {limit:,} bytes; at most {limit:,} allowed")
    return data


def write_bytes_atomic(uri: str, data: bytes) -> None:
    """Write under a temporary name, then rename: readers never see half a file."""
    fs, path = filesystem(uri)
    parent = path.rsplit("/", 1)[0]
    fs.create_dir(parent, recursive=True)
    tmp = f"{path}.tmp-{uuid.uuid4().hex[:8]}"
    with fs.open_output_stream(tmp) as f:
        f.write(data)
    fs.move(tmp, path)


def write_json_atomic(uri: str, obj: Any) -> None:
    write_bytes_atomic(uri, (json.dumps(obj, indent=2, sort_keys=True) + "\n").encode())


def read_json(uri: str, limit: int | None = None) -> Any:
    return json.loads(read_bytes(uri, limit))


def numbered_jsonl(uri: str) -> list[tuple[int, object]]:
    """(line number, value) of each line of a JSON-lines file, blank lines skipped; a line that is
    not JSON is an error naming the file and line, so callers can name them too."""
    rows = []
    for n, line in enumerate(read_bytes(normalize(uri)).decode("utf-8").splitlines(), 1):
        if line.strip():
            try:
                rows.append((n, json.loads(line)))
            except json.JSONDecodeError as e:
                raise ValueError(f"{uri}:{n}: not JSON ({e})") from None
    return rows


def read_jsonl(uri: str) -> list[dict]:
    """The values of a JSON-lines file (blank lines skipped); a bad line is an error naming it."""
    return [row for _, row in numbered_jsonl(uri)]


def write_jsonl_atomic(uri: str, rows: list[dict]) -> None:
    write_bytes_atomic(uri, "".join(json.dumps(r, ensure_ascii=False, default=str) + "\n" for r in rows).encode())


def remove_dir(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != _pafs().FileType.NotFound:
        fs.delete_dir(path)


def remove_file(uri: str) -> None:
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type != _pafs().FileType.NotFound:
        fs.delete_file(path)


def list_dirs(uri: str) -> list[str]:
    """Names of the directories directly under `uri`, sorted; none when it does not exist."""
    fs, path = filesystem(uri)
    if fs.get_file_info(path).type == _pafs().FileType.NotFound:
        return []
    found = fs.get_file_info(_pafs().FileSelector(path, recursive=False))
    return sorted(f.base_name for f in found if f.type == _pafs().FileType.Directory)


def upload_file(local_path: str | os.PathLike, uri: str) -> None:
    """Copy a local file to `uri` (a local path or an object-store key)."""
    fs, path = filesystem(uri)
    fs.create_dir(path.rsplit("/", 1)[0], recursive=True)
    with open(local_path, "rb") as src, fs.open_output_stream(path) as dst:
        for chunk in iter(lambda: src.read(8 << 20), b""):
            dst.write(chunk)


def size(uri: str) -> int:
    fs, path = filesystem(uri)
    return fs.get_file_info(path).size


def sha256_file(path: str | os.PathLike) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def sha256_uri(uri: str) -> str:
    h = hashlib.sha256()
    fs, path = filesystem(uri)
    with fs.open_input_stream(path) as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def fingerprint(stage_dir: str, parts: list[str]) -> str:
    """A SHA-256 of a stage's output: every file under the named parts (files or folders of
    `stage_dir`), by relative path and content, in path order. Two runs that wrote the same bytes
    under the same names have the same fingerprint; timings and manifests are not part of it."""
    h = hashlib.sha256()
    root = normalize(stage_dir).rstrip("/")
    for part in parts:
        for f in list_files(join(root, part)):
            h.update(f[len(root) + 1 :].encode() + b"\0")
            h.update(bytes.fromhex(sha256_uri(f)))
    return h.hexdigest()


def is_committed(stage_dir: str) -> bool:
    return exists(join(stage_dir, MANIFEST))


def read_manifest(stage_dir: str) -> dict:
    if not is_committed(stage_dir):
        raise FileNotFoundError(
            f"{stage_dir} has no {MANIFEST}: it is not the committed output of an lmfoundry stage "
            "(the stage did not finish, or the path is wrong)"
        )
    manifest = read_json(join(stage_dir, MANIFEST), MAX_MANIFEST_BYTES)
    if not isinstance(manifest, dict):
        raise ValueError(f"{join(stage_dir, MANIFEST)} is not a JSON object: not a manifest lmfoundry wrote")
    return manifest


def prepare_output(stage_dir: str, overwrite: bool = False) -> bool:
    """Make `stage_dir` ready for a stage. Returns False when committed output already stands
    there and `overwrite` is off, so that a rerun skips finished work instead of redoing it."""
    if is_committed(stage_dir) and not overwrite:
        return False
    remove_dir(stage_dir)  # a partial output of a killed run, or one the user asked to replace
    fs, path = filesystem(stage_dir)
    fs.create_dir(path, recursive=True)
    return True


def commit(stage_dir: str, stage: str, details: dict) -> dict:
    """Write the stage's manifest last: from here on the directory counts as finished."""
    manifest = {"stage": stage, "format_version": 1, **details}
    write_json_atomic(join(stage_dir, MANIFEST), manifest)
    return manifest
