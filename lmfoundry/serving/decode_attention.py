"""Attention for decoding with a KV cache on CPU: the serving engine's kernel for one new
position per row, which the scheduler hands its KVCache (`KVCache(..., attention=cached_attention)`).
"""

from __future__ import annotations

import torch

from lmfoundry.model import transformer

# rows x cache positions from which decode_attention beats scaled_dot_product_attention on CPU
# in float32 (2 cores: even at 4 rows x 128 and 16 x 64, ahead from 16 x 128; well behind at 1-4
# rows). Not in bfloat16: its batched products copy the strided cache first, and SDPA was ahead
# by 1.3-1.8x at 16 and 64 rows x 128-200 positions.
DECODE_ATTENTION_MIN_WORK = 2048


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query position per row: q (B, H, 1, D) against the cache's k, v (B, K, L, D), mask
    (B, 1, 1, L). Two batched products with each key/value head's G = H / K query heads as the
    rows of one product, so the cache is read once and, in float32, nothing is copied. Used on
    CPU in float32 from DECODE_ATTENTION_MIN_WORK on, where it beats scaled_dot_product_attention
    (benchmarks/serving.py times the two side by side); below that, and in bfloat16, SDPA is
    faster."""
    B, H, _, D = q.shape
    K = k.shape[1]
    scores = q.reshape(B, K, H // K, D) @ k.transpose(-1, -2) * D**-0.5  # (B, K, G, L)
    scores = scores.masked_fill(~mask, float("-inf"))  # (B, 1, 1, L) broadcasts over K and G
    return (scores.softmax(-1) @ v).reshape(B, H, 1, D)


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """The model's cached attention (SDPA), except for one position per row on CPU in float32
    from DECODE_ATTENTION_MIN_WORK rows x cache positions on, where decode_attention is faster."""
    B, _, T, _ = q.shape
    if T == 1 and q.device.type == "cpu" and q.dtype == torch.float32 and B * k.shape[2] >= DECODE_ATTENTION_MIN_WORK:
        return decode_attention(q, k, v, mask)
    return transformer.cached_attention(q, k, v, mask)
