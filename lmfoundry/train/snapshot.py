"""Asynchronous checkpoints under DeepSpeed: the loop pays for an in-memory snapshot only.

DeepSpeed writes a checkpoint through its engine's `checkpoint_engine`, calling `save(state,
path)` once per file (module and scheduler state, this rank's optimizer partition, expert
shards). `SnapshotCheckpointEngine` takes the place of its default torch.save engine: `save`
keeps a private copy of the state in memory (tensors cloned, so the optimizer steps that follow
cannot change it) with the path it belongs to, and `write_pending` serialises those copies
later, from the checkpointer's background thread (platform/checkpoint.py). The files are
DeepSpeed's own, so `engine.load_checkpoint` reads them back unchanged.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


def snapshot(obj):
    """A copy of a (nested) state dict whose tensors share no memory with the originals."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        return type(obj)((k, snapshot(v)) for k, v in obj.items())
    if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
        return type(obj)(snapshot(v) for v in obj)
    return obj


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.pending: list[tuple[str, object]] = []

    def save(self, state_dict, path: str) -> None:
        self.pending.append((path, snapshot(state_dict)))

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone first: save() copies anyway

    def take_writer(self) -> Callable[[], None]:
        """The pending snapshots, as one function that writes them (and forgets them)."""
        pending, self.pending = self.pending, []

        def write() -> None:
            for path, state in pending:
                torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization)

        return write
