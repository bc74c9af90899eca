"""Checkpoints the training workers read (the starting checkpoint, an SFT teacher, the final
checkpoint the run's figures measure) as local directories, one copy per node: the node's first
local rank downloads a remote checkpoint and the node's other ranks read its copy. The driver's
own copy lives on the driver's node only: the workers there read it, the others their node's.

The copy's path is fixed by the run and the checkpoint (checkpoint.run_copy), so a worker group
that takes over after a failure reuses its predecessor's copy instead of leaving that one behind
and downloading another; the copies go when the run finishes. A local checkpoint is read where it
is."""

from __future__ import annotations

import contextlib
import hashlib
from collections.abc import Iterator
from pathlib import Path

from lmfoundry.platform import checkpoint


def copy_key(run_dir: str, uri: str) -> str:
    return hashlib.sha256(f"{run_dir}\n{uri}".encode()).hexdigest()[:24]


def node_copy(uri: str, key: str, local_rank: int, node_rank: int, present: str | None = None) -> str:
    """Collective: a local directory holding the checkpoint at `uri` (model files only), the
    node's one copy: `present` where this node has that directory (the driver's copy, on the
    driver's node), else checkpoint.run_copy at `key`. A failed download fails every rank."""
    import torch.distributed as dist

    path = error = None
    if local_rank == 0:
        try:
            path = present if present and Path(present).is_dir() else checkpoint.run_copy(uri, key)
        except Exception as e:  # sent to every rank, raised below
            error = f"{type(e).__name__}: {e}"
    found = [None] * dist.get_world_size()
    dist.all_gather_object(found, (node_rank, path, error))
    errors = [e for _, _, e in found if e is not None]
    if errors:
        raise RuntimeError(f"copying the checkpoint {uri} failed: {errors[0]}")
    return next(p for node, p, _ in found if node == node_rank and p is not None)


def remove_node_copy(local: str, uri: str, local_rank: int, present: str | None = None) -> None:
    """Collective: once every rank is done with the node's copy, its first local rank removes it
    (nothing, when the checkpoint is local or the copy is `present`, which its maker removes)."""
    import torch.distributed as dist

    dist.barrier()
    if local_rank == 0 and local != present:
        checkpoint.remove_copy(local, uri)


@contextlib.contextmanager
def on_each_node(run_dir: str, uri: str, present: str | None = None) -> Iterator[str]:
    """Collective, in a Ray Train worker of the run in `run_dir`: the checkpoint at `uri` as
    this node's local copy for the block (`present`: the driver's copy, used on its node);
    removed after it, unless the block failed (a worker group that takes over reuses it)."""
    import ray.train

    ctx = ray.train.get_context()
    local_rank = ctx.get_local_rank()
    local = node_copy(uri, copy_key(run_dir, uri), local_rank, ctx.get_node_rank(), present)
    yield local
    remove_node_copy(local, uri, local_rank, present)
