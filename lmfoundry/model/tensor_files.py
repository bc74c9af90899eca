"""Safetensors files read and written one tensor at a time, so that converting a model between
layouts (hf_import.py, export.py) never holds more of it than the tensor being converted.

`write_safetensors` writes the header first, from the names, dtypes and shapes alone, then each
tensor's bytes as it is produced; `SafetensorsDir` reads a Hugging Face model directory (one
`model.safetensors`, or shards named by `model.safetensors.index.json`) through `safe_open`,
opening a file only for the tensors asked for and closing it again, so no shard stays mapped.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterable
from pathlib import Path

import torch
from safetensors import safe_open

SINGLE = "model.safetensors"
INDEX = "model.safetensors.index.json"

DTYPE_NAMES = {
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float64: "F64",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}
DTYPES_BY_NAME = {v: k for k, v in DTYPE_NAMES.items()}

TensorSpec = tuple[str, torch.dtype, tuple[int, ...]]  # name, dtype, shape

# The most a model directory's JSON or template file may hold: a tokenizer.json is 2 to 35 MB
# (model/tokenizer.py MAX_TOKENIZER_BYTES), the index of a 400B model's shards under 1 MB
MAX_SOURCE_FILE_BYTES = 64 << 20


def read_source_file(directory: Path, name: str, limit: int = MAX_SOURCE_FILE_BYTES) -> bytes | None:
    """The bytes of the file `name` of a model directory from outside (a Hugging Face checkpoint),
    None when there is none: a link is refused, not followed (it could reach any file the process
    can read, which an import would then seal into its checkpoint), and so is a file that is not
    a regular one or holds more than `limit` bytes (read at most limit + 1)."""
    path = directory / name
    try:  # O_NOFOLLOW: a link is refused when opened, not checked first and swapped in after
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        return None
    except OSError as e:
        if e.errno == errno.ELOOP:
            raise ValueError(
                f"{directory}: {name} is a symbolic link; a model directory's files must be its own"
            ) from None
        raise
    with open(fd, "rb") as f:
        if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):  # a FIFO or a device would never end
            raise ValueError(f"{directory}: {name} is not a regular file")
        data = f.read(limit + 1)
    if len(data) > limit:
        raise ValueError(f"{directory}: {name} holds more than {limit:,} bytes; at most {limit:,} allowed")
    return data


def write_safetensors(
    path: str | os.PathLike, specs: list[TensorSpec], tensors: Iterable[torch.Tensor], metadata: dict | None = None
) -> int:
    """Write `tensors` (produced in the order of `specs`, each matching its spec) to `path`,
    through a temporary name renamed at the end. Returns the bytes of tensor data written."""
    header: dict = {"__metadata__": {"format": "pt", **(metadata or {})}}
    offset = 0
    for name, dtype, shape in specs:
        if dtype not in DTYPE_NAMES:
            raise ValueError(f"tensor {name}: dtype {dtype} cannot be written; allowed: {list(DTYPE_NAMES)}")
        size = torch.Size(shape).numel() * dtype.itemsize
        header[name] = {"dtype": DTYPE_NAMES[dtype], "shape": list(shape), "data_offsets": [offset, offset + size]}
        offset += size
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-byte aligned, as safetensors writes it
    path = Path(path)
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        f.write(len(raw).to_bytes(8, "little"))
        f.write(raw)
        for (name, dtype, shape), t in zip(specs, tensors, strict=True):
            if t.dtype != dtype or tuple(t.shape) != tuple(shape):
                raise AssertionError(f"tensor {name}: produced {t.dtype} {tuple(t.shape)}, declared {dtype} {shape}")
            f.write(t.detach().to("cpu").contiguous().reshape(-1).view(torch.uint8).numpy().data)
    partial.replace(path)
    return offset


class SafetensorsDir:
    """The tensors of a model directory by name: their shapes and dtypes from the headers, their
    values on request."""

    def __init__(self, directory: str | os.PathLike):
        self.directory = Path(directory)
        index = self.directory / INDEX
        text = read_source_file(self.directory, INDEX)
        if text is not None:
            weight_map = json.loads(text)
            weight_map = weight_map.get("weight_map") if isinstance(weight_map, dict) else None
            if (
                not isinstance(weight_map, dict)
                or not weight_map
                or not all(isinstance(v, str) for v in weight_map.values())
            ):
                raise ValueError(f"{index}: needs a non-empty 'weight_map' object of tensor name -> file name")
            files = set(weight_map.values())
        elif (self.directory / SINGLE).exists():
            files = {SINGLE}
        else:
            raise FileNotFoundError(f"{self.directory} has neither {SINGLE} nor {INDEX}")
        self.file_of: dict[str, str] = {}
        self.meta: dict[str, tuple[torch.dtype, tuple[int, ...]]] = {}
        for name in sorted(files):
            path = self._path(name)
            with safe_open(str(path), framework="pt") as f:
                for key in f.keys():
                    sl = f.get_slice(key)
                    dtype = sl.get_dtype()
                    if dtype not in DTYPES_BY_NAME:
                        raise ValueError(f"{path}: tensor {key} has dtype {dtype}; allowed: {list(DTYPES_BY_NAME)}")
                    self.file_of[key] = name
                    self.meta[key] = (DTYPES_BY_NAME[dtype], tuple(sl.get_shape()))

    def _path(self, name: object) -> Path:
        # the index is input: its file names must be plain files of this directory
        if not isinstance(name, str) or "/" in name or "\\" in name or name in ("", ".", ".."):
            raise ValueError(f"{self.directory / INDEX}: shard name {name!r} must be a file name in the directory")
        path = self.directory / name
        if path.is_symlink() or not path.is_file():
            raise ValueError(f"{self.directory}: shard {name} is missing, not a file, or a symbolic link")
        return path

    def __contains__(self, name: str) -> bool:
        return name in self.file_of

    def shape(self, name: str) -> tuple[int, ...]:
        return self._meta(name)[1]

    def dtype(self, name: str) -> torch.dtype:
        return self._meta(name)[0]

    def _meta(self, name: str) -> tuple[torch.dtype, tuple[int, ...]]:
        if name not in self.meta:
            raise ValueError(f"{self.directory}: tensor {name} is missing from the checkpoint")
        return self.meta[name]

    def get(self, names: list[str]) -> list[torch.Tensor]:
        """The tensors, each file opened once for the ones it holds and closed before returning."""
        by_file: dict[str, list[str]] = {}
        for name in names:
            self._meta(name)
            by_file.setdefault(self.file_of[name], []).append(name)
        got: dict[str, torch.Tensor] = {}
        for file, keys in by_file.items():
            with safe_open(str(self.directory / file), framework="pt") as f:
                for key in keys:
                    got[key] = f.get_tensor(key)
        return [got[name] for name in names]
