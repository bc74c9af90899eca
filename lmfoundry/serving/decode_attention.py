"""Attention for decoding with a KV cache on CPU: the serving engine's kernel for one new
position per row, which the scheduler hands its KVCache (`KVCache(..., attention=engine_attention(...))`)
where it was timed faster than scaled_dot_product_attention on the machine at load.
"""

from __future__ import annotations

import statistics
import time

import torch

from lmfoundry.model import transformer

# rows x cache positions from which decode_attention may be chosen (below it, SDPA always: at
# 1-4 rows it was well ahead on every machine measured)
DECODE_ATTENTION_MIN_WORK = 2048


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """One query position per row: q (B, H, 1, D) against the cache's k, v (B, K, L, D), mask
    (B, 1, 1, L). Two batched products with each key/value head's G = H / K query heads as the
    rows of one product, so the cache is read once and, in float32, nothing is copied."""
    B, H, _, D = q.shape
    K = k.shape[1]
    scores = q.reshape(B, K, H // K, D) @ k.transpose(-1, -2) * D**-0.5  # (B, K, G, L)
    scores = scores.masked_fill(~mask, float("-inf"))  # (B, 1, 1, L) broadcasts over K and G
    return (scores.softmax(-1) @ v).reshape(B, H, 1, D)


def decode_kernel_is_faster(
    n_head: int, n_kv_head: int, head_dim: int, dtype: torch.dtype, rows: int = 16, positions: int = 128
) -> bool:
    """Whether decode_attention beats scaled_dot_product_attention on this machine, timed on
    the calling thread (the engine's) at `rows` x `positions` of a cache laid out as the
    engine's is (a view of a longer buffer), interleaved, median of 5 rounds of 10 calls (about
    30 ms). Which is faster depends on the CPU and the precision: on this project's 2-core
    machines decode_attention was 1.3-1.7x ahead in float32 on one host and 0.9x on another, and
    3.5x ahead in bfloat16 on the second where SDPA had been ahead on the first."""
    gen = torch.Generator().manual_seed(0)
    q = torch.randn(rows, n_head, 1, head_dim, generator=gen).to(dtype)
    k, v = (torch.randn(rows, n_kv_head, 2 * positions, head_dim, generator=gen).to(dtype) for _ in range(2))
    k, v = k[:, :, :positions], v[:, :, :positions]
    mask = torch.ones(rows, 1, 1, positions, dtype=torch.bool)
    kernels = [lambda: transformer.cached_attention(q, k, v, mask), lambda: decode_attention(q, k, v, mask)]
    times: list[list[float]] = [[], []]
    with torch.inference_mode():
        for fn in kernels:
            fn()
        for _ in range(5):
            for fn, ts in zip(kernels, times):
                start = time.perf_counter()
                for _ in range(10):
                    fn()
                ts.append(time.perf_counter() - start)
    return statistics.median(times[1]) < statistics.median(times[0])


def engine_attention(
    n_head: int, n_kv_head: int, head_dim: int, dtype: torch.dtype, device, decode_kernel: bool | None = None
):
    """The cached attention the engine's KVCache runs: the model's (SDPA), except for one position
    per row on CPU from DECODE_ATTENTION_MIN_WORK rows x cache positions on, where decode_attention
    is used if it was timed faster here (decode_kernel_is_faster, once, at load; `decode_kernel`
    True or False decides without timing)."""
    if torch.device(device).type != "cpu":
        return transformer.cached_attention
    if decode_kernel is None:
        decode_kernel = decode_kernel_is_faster(n_head, n_kv_head, head_dim, dtype)
    if not decode_kernel:
        return transformer.cached_attention

    def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        B, _, T, _ = q.shape
        if T == 1 and B * k.shape[2] >= DECODE_ATTENTION_MIN_WORK:
            return decode_attention(q, k, v, mask)
        return transformer.cached_attention(q, k, v, mask)

    return attention
