"""Asynchronous checkpoints under DeepSpeed: the loop pays for an in-memory snapshot only.

DeepSpeed writes a checkpoint through its engine's `checkpoint_engine`, calling `save(state,
path)` once per file (module and scheduler state, this rank's optimizer partition, expert
shards). `SnapshotCheckpointEngine` takes the place of its default torch.save engine: `save`
keeps a private copy of the state in memory (tensors cloned, so the optimizer steps that follow
cannot change it) with the path it belongs to, and `write_pending` serialises those copies
later, from the checkpointer's background thread (platform/checkpoint.py). The files are
DeepSpeed's own, so `engine.load_checkpoint` reads them back unchanged.

The copies go into buffers kept from the previous save (`SnapshotPool`): copying into memory
that is already mapped costs a quarter of allocating it afresh, which is most of what the loop
waits for. A pool's buffers are reused only once the previous save's writer has finished.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import torch
from deepspeed.runtime.checkpoint_engine.torch_checkpoint_engine import TorchCheckpointEngine


class SnapshotPool:
    """CPU buffers for snapshots, kept by where each tensor sits in its state dict."""

    def __init__(self):
        self.buffers: dict[tuple, torch.Tensor] = {}
        self.busy = False  # a writer still reads the buffers

    def snapshot(self, obj, key: tuple = ()):
        """A copy of a (nested) state dict whose tensors share no memory with the originals."""
        if self.busy:
            raise RuntimeError("snapshot taken while the previous checkpoint is still being written")
        if isinstance(obj, torch.Tensor):
            buf = self.buffers.get(key)
            if buf is None or buf.shape != obj.shape or buf.dtype != obj.dtype:
                buf = self.buffers[key] = torch.empty(obj.shape, dtype=obj.dtype, device="cpu")
            return buf.copy_(obj.detach())
        if isinstance(obj, dict):
            return type(obj)((k, self.snapshot(v, (*key, k))) for k, v in obj.items())
        if isinstance(obj, (list, tuple)) and not hasattr(obj, "_fields"):
            return type(obj)(self.snapshot(v, (*key, i)) for i, v in enumerate(obj))
        return obj


def deepspeed_checkpoint_classes() -> list[type]:
    """The only classes DeepSpeed's checkpoint files hold besides tensors and plain containers:
    what a weights-only load of them allows, and nothing else."""
    from deepspeed.runtime.fp16.loss_scaler import LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [LossScaler, ZeroStageEnum, fragment_address]


def load_deepspeed_file(path, map_location=None, mmap: bool = False):
    """A DeepSpeed checkpoint file. DeepSpeed's own load unpickles anything (`weights_only=False`);
    this one rebuilds only tensors, plain containers and the three DeepSpeed classes its files
    hold. With `mmap` the tensors' bytes are mapped, not read: read where a tensor is touched."""
    with torch.serialization.safe_globals(deepspeed_checkpoint_classes()):
        return torch.load(path, map_location=map_location, weights_only=True, mmap=mmap)


class SnapshotCheckpointEngine(TorchCheckpointEngine):
    def __init__(self, config_params=None):
        super().__init__(config_params)
        self.pool = SnapshotPool()
        self.pending: list[tuple[str, object]] = []

    def save(self, state_dict, path: str) -> None:
        self.pending.append((path, self.pool.snapshot(state_dict, (Path(path).name,))))

    def load(self, path: str, map_location=None):
        return load_deepspeed_file(path, map_location)

    def preserves_storage_sharing(self) -> bool:
        return False  # DeepSpeed need not clone first: save() copies anyway

    def take_writer(self) -> Callable[[], None]:
        """The pending snapshots, as one function that writes them (and forgets them)."""
        pending, self.pending = self.pending, []
        self.pool.busy = True

        def write() -> None:
            try:
                for path, state in pending:
                    torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization)
            finally:
                self.pool.busy = False

        return write
