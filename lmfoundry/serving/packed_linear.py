"""Linear layers for CPU inference with each weight reordered once, at load, into oneDNN's
blocked layout: the reorder that `nn.Linear` otherwise leaves to the GEMM on every call is paid
once, and the products that decoding runs (a few rows against a whole weight) ran 1.1-3.7x
faster at the serving benchmark's shapes on this project's 2-core CPU machine, the whole decode
step 1.4-1.8x in float32 (benchmarks/serving.py times the decode step both ways). It
is what PyTorch Inductor's freezing pass does to a CPU graph's linear layers, applied here to
the eager model so that the engine keeps its dynamic shapes without compiling.

The serving engine packs the model it loads (engine.load_for_serving): the model file itself
stays plain PyTorch, and training and evaluation never see a packed layer.
"""

from __future__ import annotations

import torch
import torch.nn as nn


def supported(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN runs on the CPU; bfloat16 only where the CPU has bfloat16 instructions."""
    if device.type != "cpu" or not (torch.backends.mkldnn.enabled and torch.backends.mkldnn.is_available()):
        return False
    if dtype == torch.bfloat16:
        return torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return dtype == torch.float32


class PackedLinear(nn.Module):
    """`linear` for inference only: its weight as oneDNN's packed tensor (opaque: no gradient, no
    storage to copy, save or move), its bias as a buffer. A tied output head packs a copy of the
    embedding it shares. Pack a model after moving and casting it: it cannot be moved after."""

    def __init__(self, linear: nn.Linear, rows_hint: int = 16):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        # rows_hint: the number of input rows the layout is chosen for; any number runs
        self.packed = torch.ops.mkldnn._reorder_linear_weight(linear.weight.detach(), rows_hint)
        self.register_buffer("bias", None if linear.bias is None else linear.bias.detach(), persistent=False)

    def _apply(self, fn, recurse=True):
        raise RuntimeError("a model with packed linear layers cannot be moved or cast: pack it after .to()")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}"


def pack_linears(model: nn.Module, rows_hint: int = 16) -> int:
    """Replace every `nn.Linear` of `model` (in eval mode, on a supported device and dtype) by a
    PackedLinear; returns how many were replaced (0 where oneDNN does not apply)."""
    param = next(model.parameters())
    if model.training or not supported(param.device, param.dtype):
        return 0
    replaced = 0
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if type(child) is nn.Linear:
                setattr(module, name, PackedLinear(child, rows_hint))
                replaced += 1
    return replaced
