"""The network alone: a single-device PyTorch decoder and generation. No Ray, no DeepSpeed."""

from lmfoundry.model.transformer import ModelConfig, Transformer

__all__ = ["ModelConfig", "Transformer"]
