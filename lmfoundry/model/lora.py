"""Low-rank adapters (LoRA, Hu et al. 2021) applied to the model from outside it.

`apply_lora` freezes every weight and wraps the chosen projections (nn.Linear) in `LoRALinear`,
which adds `scale * B(A(dropout(x)))` with A (rank, in) drawn as nn.Linear draws its weights and B
(out, rank) zero, so the adapted model starts exactly where the base model is. Only A and B
train. An adapter checkpoint holds A and B (`adapter.safetensors`) and `adapter_config.json`: the
adapter's settings and a reference to its base checkpoint (its URI and the sha256 of its weights).
`load_model_files` (checkpoint.py) loads such a checkpoint by loading the base, checking its
fingerprint and merging `W + scale * B @ A` into each wrapped weight, so serving, evaluation and
export see a plain model.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import torch
import torch.nn as nn
import torch.nn.functional as F
from pydantic import Field, field_validator

from lmfoundry.platform.config import StageConfig

ADAPTER_WEIGHTS = "adapter.safetensors"
ADAPTER_CONFIG = "adapter_config.json"
# the projections an adapter may wrap: attention's query, key/value and output; the dense MLP's
TARGETS = ("wq", "wkv", "wo", "w_gate_up", "w_down")


class LoraConfig(StageConfig):
    rank: int = Field(8, ge=1, le=1024, description="the rank r of each adapter")
    alpha: float = Field(16.0, gt=0, description="the update is scaled by alpha / rank")
    dropout: float = Field(0.0, ge=0, lt=1, description="dropout on the adapter's input (training only)")
    targets: list[Literal[TARGETS]] = Field(
        ["wq", "wkv", "wo"], min_length=1, description=f"the projections to adapt, of {', '.join(TARGETS)}"
    )

    @field_validator("targets")
    @classmethod
    def _unique(cls, targets: list[str]) -> list[str]:
        if len(set(targets)) != len(targets):
            raise ValueError(f"targets lists a projection twice: {targets}")
        return targets


class LoRALinear(nn.Module):
    def __init__(self, base: nn.Linear, cfg: LoraConfig):
        super().__init__()
        self.base = base.requires_grad_(False)
        self.lora_a = nn.Parameter(torch.empty(cfg.rank, base.in_features, dtype=base.weight.dtype))
        self.lora_b = nn.Parameter(torch.zeros(base.out_features, cfg.rank, dtype=base.weight.dtype))
        nn.init.kaiming_uniform_(self.lora_a, a=math.sqrt(5))  # as nn.Linear initialises a weight
        self.scale = cfg.alpha / cfg.rank
        self.dropout = nn.Dropout(cfg.dropout) if cfg.dropout else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.base(x) + F.linear(F.linear(self.dropout(x), self.lora_a), self.lora_b) * self.scale

    @torch.no_grad()
    def merged(self) -> nn.Linear:
        self.base.weight += delta(self.lora_a, self.lora_b, self.scale).to(self.base.weight.dtype)
        return self.base


def delta(a: torch.Tensor, b: torch.Tensor, scale: float) -> torch.Tensor:
    """What an adapter adds to its projection's weight when merged: scale * B @ A, in fp32."""
    return b.float() @ a.float() * scale


def target_projections(model: nn.Module, cfg: LoraConfig) -> dict[str, tuple[nn.Module, str, nn.Linear]]:
    """Each projection an adapter wraps, by its name in the model: (its parent, its attribute,
    the projection). Refused when a target names no projection of the model."""
    found = {}
    for name, module in model.named_modules():
        for target in cfg.targets:
            child = getattr(module, target, None)
            if isinstance(child, nn.Linear):
                found[f"{name}.{target}" if name else target] = (module, target, child)
    missing = set(cfg.targets) - {target for _, target, _ in found.values()}
    if missing:
        raise ValueError(
            f"lora.targets: the model has no {sorted(missing)} projection (an MoE model's experts are not)"
        )
    return found


def apply_lora(model: nn.Module, cfg: LoraConfig) -> nn.Module:
    """Freeze `model` and wrap its target projections in adapters (in place); returns it."""
    model.requires_grad_(False)
    for module, target, child in target_projections(model, cfg).values():
        setattr(module, target, LoRALinear(child, cfg))
    return model


def check_adapter_fits(where: str, adapter: dict[str, torch.Tensor], model: nn.Module, cfg: LoraConfig) -> None:
    """An adapter file's tensors against the model they adapt (not yet wrapped): exactly an A
    (rank, in) and a B (out, rank) for each target projection, each a finite float."""
    shapes = {}
    for prefix, (_, _, linear) in target_projections(model, cfg).items():
        shapes[f"{prefix}.lora_a"] = (cfg.rank, linear.in_features)
        shapes[f"{prefix}.lora_b"] = (linear.out_features, cfg.rank)
    if set(adapter) != set(shapes):
        raise ValueError(
            f"adapter {where} does not fit its base: missing {sorted(set(shapes) - set(adapter))[:4]}, "
            f"unexpected {sorted(set(adapter) - set(shapes))[:4]}"
        )
    for name, shape in shapes.items():
        if tuple(adapter[name].shape) != shape:
            raise ValueError(f"adapter {where}: {name} has shape {tuple(adapter[name].shape)}, not {shape}")
    for name, t in adapter.items():
        if t.dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"adapter {where}: {name} is {t.dtype}; adapters are float32, bfloat16 or float16")
        if not bool(torch.isfinite(t).all()):
            raise ValueError(f"adapter {where}: {name} holds NaN or infinite values")


def adapter_state(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The adapter's tensors of a model's state dict."""
    return {k: v for k, v in state.items() if k.endswith((".lora_a", ".lora_b"))}


def merge_lora(model: nn.Module) -> nn.Module:
    """Fold every adapter into its projection (in place); returns the plain model."""
    for module in list(model.modules()):
        for name, child in list(module.named_children()):
            if isinstance(child, LoRALinear):
                setattr(module, name, child.merged())
    return model


def is_adapter(directory: str | Path) -> bool:
    return (Path(directory) / ADAPTER_CONFIG).exists()


@dataclass(frozen=True)
class AdapterRef:
    """What an adapter checkpoint records: its settings and its base (URI and weights' sha256)."""

    lora: LoraConfig
    base: str
    base_sha256: str


def write_adapter_config(directory: str | Path, ref: AdapterRef) -> None:
    text = json.dumps({"lora": ref.lora.model_dump(), "base": ref.base, "base_sha256": ref.base_sha256}, indent=2)
    (Path(directory) / ADAPTER_CONFIG).write_text(text)


def read_adapter_config(directory: str | Path) -> AdapterRef:
    path = Path(directory) / ADAPTER_CONFIG
    data = json.loads(path.read_text())
    if not isinstance(data, dict) or set(data) != {"lora", "base", "base_sha256"}:
        raise ValueError(f"{path}: expected an object with lora, base and base_sha256")
    if not isinstance(data["base"], str) or not isinstance(data["base_sha256"], str):
        raise ValueError(f"{path}: base and base_sha256 must be strings")
    return AdapterRef(LoraConfig.model_validate(data["lora"]), data["base"], data["base_sha256"])
