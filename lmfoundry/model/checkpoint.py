"""Model weights and config in and out of a checkpoint directory (safetensors, no pickle)."""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file, save_file

from lmfoundry.model.transformer import ModelConfig, Transformer

WEIGHTS = "model.safetensors"
MODEL_CONFIG = "model_config.json"
TOKENIZER = "tokenizer.json"
_TIED = "lm_head.weight"


def model_state(model: Transformer, state: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
    """Owned, contiguous CPU copies (DeepSpeed's parameters are views into flat buffers) of
    `state` (default: the model's own); a tied output head is stored once, as the embedding."""
    state = model.state_dict() if state is None else state
    state = {k: v.detach().to("cpu").clone().contiguous() for k, v in state.items()}
    if model.cfg.tie_embeddings:
        state.pop(_TIED, None)
    return state


def save_model_files(model: Transformer, directory: str | Path, state: dict[str, torch.Tensor] | None = None) -> None:
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    save_file(model_state(model, state), str(directory / WEIGHTS), metadata={"format": "pt"})
    (directory / MODEL_CONFIG).write_text(model.cfg.model_dump_json(indent=2))


def load_model_files(directory: str | Path, device: str | torch.device = "cpu") -> Transformer:
    directory = Path(directory)
    cfg = ModelConfig.model_validate(json.loads((directory / MODEL_CONFIG).read_text()))
    model = Transformer(cfg)
    missing, unexpected = model.load_state_dict(load_file(str(directory / WEIGHTS)), strict=False)
    allowed_missing = {_TIED} if cfg.tie_embeddings else set()
    if set(missing) - allowed_missing or unexpected:
        raise ValueError(
            f"checkpoint {directory} does not fit its model config: missing "
            f"{sorted(set(missing) - allowed_missing)}, unexpected {sorted(unexpected)}"
        )
    return model.to(device).eval()
