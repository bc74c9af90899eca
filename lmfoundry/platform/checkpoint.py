"""Self-describing checkpoints: a directory of files, a manifest of their checksums written last.

A checkpoint directory holds the weights, the model config, the tokenizer and the training
state; `manifest.json` lists every file with its size and sha256 and is written after them, so a
directory without it (a save cut short) is never taken for a checkpoint. Resume, evaluation and
serving need nothing but the checkpoint path.
"""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

import pyarrow.fs as pafs

from lmfoundry.platform import storage

CHECKPOINT_MANIFEST = "manifest.json"


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


def verify(directory: str | os.PathLike) -> dict:
    """The manifest of a local checkpoint, after checking that every file matches it."""
    directory = Path(directory)
    path = directory / CHECKPOINT_MANIFEST
    if not path.is_file():
        raise FileNotFoundError(f"{directory} is not a checkpoint: it has no {CHECKPOINT_MANIFEST}")
    manifest = storage.read_json(str(path))
    for name, meta in manifest["files"].items():
        f = directory / name
        if not f.is_file():
            raise ValueError(f"checkpoint {directory} is missing {name}")
        if storage.sha256_file(f) != meta["sha256"]:
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


def local_copy(uri: str) -> str:
    """A local directory holding the checkpoint at `uri`, downloading it when it is remote."""
    uri = resolve(uri)
    if not storage.is_remote(uri):
        return uri
    target = tempfile.mkdtemp(prefix="lmfoundry-ckpt-")
    fs, path = storage.filesystem(uri)
    pafs.copy_files(path, target, source_filesystem=fs, destination_filesystem=pafs.LocalFileSystem())
    return target
