"""Checkpoints the training workers read (the starting checkpoint, an SFT teacher, the final
checkpoint the run's figures measure) as local directories, one copy per node: the node's first
local rank downloads a remote checkpoint and the node's other ranks read its copy. The driver's
own copy lives on the driver's node only: the workers there read it, the others their node's.

A copy's path is fixed by the run and the checkpoint (checkpoint.run_copy), so a worker group
that takes over after a failure reuses its predecessor's copy instead of leaving that one behind
and downloading another; a copy is used only when its files match the manifest the driver
verified. The copies go when the run finishes; a run that fails leaves them in
TMPDIR/lmfoundry-UID, where a rerun of it finds them, until a copy made on the node a day after
their last use removes them (checkpoint.prune_run_copies: never one that a process holds). A
local checkpoint is read where it is."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from lmfoundry.platform import checkpoint, storage


def copy_key(run_dir: str, uri: str) -> str:
    return hashlib.sha256(f"{run_dir}\n{uri}".encode()).hexdigest()[:24]


def driver_copy(uri: str, local: str) -> dict:
    """What the workers need to read the checkpoint at `uri` that the driver verified in its
    copy `local`: the keyword arguments of `on_each_node`."""
    import ray

    return {
        "uri": uri,
        "driver_copy": local,
        # not connected yet (Ray Train connects when it starts): no node reads the driver's copy
        "driver_node": ray.get_runtime_context().get_node_id() if ray.is_initialized() else None,
        "manifest_sha256": storage.sha256_file(Path(local) / checkpoint.CHECKPOINT_MANIFEST),
    }


def node_copy(
    uri: str, key: str, local_rank: int, node_rank: int, present: str | None = None, manifest_sha256: str | None = None
) -> str:
    """Collective: a local directory holding the checkpoint at `uri` (model files only), the
    node's one copy: `present` (the driver's copy, given on the driver's node only), else
    checkpoint.run_copy at `key`, checked against `manifest_sha256`. A failed copy fails every
    rank."""
    import torch.distributed as dist

    path = error = None
    if local_rank == 0:
        try:
            path = present if present is not None else checkpoint.run_copy(uri, key, manifest_sha256)
        except Exception as e:  # sent to every rank, raised below
            error = f"{type(e).__name__}: {e}"
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (node_rank, path, error))
    errors = [e for _, _, e in found if e is not None]
    if errors:
        if path is not None and path != present:  # this node's copy is kept, no longer held here
            checkpoint.release_run_copy(path)
        raise RuntimeError(f"copying the checkpoint {uri} failed: {errors[0]}")
    return next(p for node, p, _ in found if node == node_rank and p is not None)


def remove_node_copy(local: str, local_rank: int) -> None:
    """Collective: once every rank is done with the node's copy, its first local rank removes it
    (nothing for a local checkpoint or the driver's copy, which its maker removes)."""
    import torch.distributed as dist

    dist.barrier()
    if local_rank == 0:
        checkpoint.remove_run_copy(local)


@contextlib.contextmanager
def on_each_node(
    run_dir: str,
    uri: str,
    driver_copy: str | None = None,
    driver_node: str | None = None,
    manifest_sha256: str | None = None,
) -> Iterator[str]:
    """Collective, in a Ray Train worker of the run in `run_dir`: the checkpoint at `uri` as
    this node's local copy for the block (the driver's copy on the driver's node); removed
    after it, unless the block failed (a worker group that takes over reuses it)."""
    import ray
    import ray.train

    ctx = ray.train.get_context()
    local_rank = ctx.get_local_rank()
    here = driver_copy if driver_node is not None and ray.get_runtime_context().get_node_id() == driver_node else None
    local = node_copy(uri, copy_key(run_dir, uri), local_rank, ctx.get_node_rank(), here, manifest_sha256)
    try:
        yield local
    except BaseException:
        if local_rank == 0:  # kept for the worker group that takes over, no longer held by this one
            checkpoint.release_run_copy(local)
        raise
    remove_node_copy(local, local_rank)
