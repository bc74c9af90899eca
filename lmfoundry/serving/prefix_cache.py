"""Reuse of a shared prompt prefix's keys and values across requests (a system prompt, a
workflow's instructions, few-shot examples), so that only the rest of a prompt is prefilled.

As vLLM's automatic prefix caching: a prompt is cut into blocks of `block_tokens` tokens, and
block i is named by a hash chained over every token before it, so a block's name stands for the
whole prefix that ends with it, not for its own tokens alone. The chain starts from the request's
scope (the tenant, unless the serve config shares the cache: vLLM's `cache_salt`), so one
tenant's prompts never find another's blocks. A hit is also checked token by token against what
the block was built from, so a hash collision, crafted or not, can never hand one prompt the
keys and values of another.

The batcher's KV cache holds one whole context per slot (no paged memory), so a hit is a copy:
the matched blocks are copied from this pool into the request's slot, and the new full blocks of
a prefilled prompt are copied into the pool. The pool is allocated once, `max_tokens` tokens of
keys and values for every layer, and never grows: when it is full the least recently used block
goes. A chain is touched from its last block back to its first, so a block always outlives the
blocks that continue it (a block whose parent is gone could never be reached again).

Only the scheduler thread calls `match`, `load` and `store`; `block_keys` is pure and runs on
the caller's thread when a request is submitted.
"""

from __future__ import annotations

import collections
import hashlib
from array import array
from dataclasses import dataclass

import torch

from lmfoundry.model.transformer import KVCache, ModelConfig


@dataclass
class _Block:
    index: int  # where its keys and values are in the pool
    parent: bytes  # the key of the block before it (the scope's root for the first)
    tokens: tuple[int, ...]


def scope_root(scope: str) -> bytes:
    return hashlib.sha256(b"lmfoundry-prefix-scope\0" + scope.encode()).digest()


def block_keys(prompt: list[int], block_tokens: int, scope: str) -> list[bytes]:
    """The chained key of every full block of the prompt."""
    keys, parent = [], scope_root(scope)
    for start in range(0, len(prompt) - block_tokens + 1, block_tokens):
        h = hashlib.sha256(parent)
        h.update(array("q", prompt[start : start + block_tokens]).tobytes())
        parent = h.digest()
        keys.append(parent)
    return keys


class PrefixCache:
    def __init__(self, cfg: ModelConfig, max_tokens: int, block_tokens: int, device, dtype):
        if block_tokens < 1 or max_tokens < block_tokens:
            raise ValueError(f"prefix cache: max_tokens={max_tokens} must hold at least one block of {block_tokens}")
        self.block_tokens = block_tokens
        self.capacity = max_tokens // block_tokens
        shape = (cfg.n_layer, self.capacity, cfg.n_kv_head, block_tokens, cfg.head_dim)
        self.k = torch.zeros(shape, device=device, dtype=dtype)
        self.v = torch.zeros(shape, device=device, dtype=dtype)
        self._blocks: collections.OrderedDict[bytes, _Block] = collections.OrderedDict()  # least recent first
        self._free = list(range(self.capacity))
        self.stats = collections.Counter()  # lookups, hit_tokens, stored_blocks, evicted_blocks

    def __len__(self) -> int:
        return len(self._blocks)

    def match(self, keys: list[bytes], prompt: list[int], scope_key: bytes) -> list[int]:
        """Pool indices of the longest run of the prompt's leading blocks held here, stopping
        one token short of the prompt's end (its last position must be computed for its logits)."""
        usable = min(len(keys), (len(prompt) - 1) // self.block_tokens)
        found, parent = [], scope_key
        for i in range(usable):
            block = self._blocks.get(keys[i])
            start = i * self.block_tokens
            if (
                block is None
                or block.parent != parent
                or block.tokens != tuple(prompt[start : start + self.block_tokens])
            ):
                break
            found.append(keys[i])
            parent = keys[i]
        self._touch(found)
        self.stats["lookups"] += 1
        self.stats["hit_tokens"] += len(found) * self.block_tokens
        return [self._blocks[k].index for k in found]

    def load(self, cache: KVCache, slot: int, indices: list[int]) -> int:
        """Copy the blocks into the slot's first positions; returns how many positions they fill."""
        if not indices:
            return 0
        n = len(indices) * self.block_tokens
        idx = torch.tensor(indices, device=self.k.device)
        for pool, dest in ((self.k, cache.k), (self.v, cache.v)):
            L, _, K, B, D = pool.shape
            # (L, m, K, B, D) -> (L, K, m * B, D): the blocks side by side along positions
            dest[:, slot, :, :n] = pool[:, idx].permute(0, 2, 1, 3, 4).reshape(L, K, n, D)
        return n

    def store(self, cache: KVCache, slot: int, keys: list[bytes], prompt: list[int], scope_key: bytes) -> None:
        """Keep the prompt's full blocks that the pool does not hold yet, from the slot's keys and
        values (computed by the prefill that just ran), evicting the least recently used."""
        B = self.block_tokens
        keys = keys[: self.capacity]  # a chain longer than the pool keeps its first blocks
        new = [i for i, key in enumerate(keys) if key not in self._blocks]
        if new:
            self._touch(keys[: new[0]])  # the part already held must not be evicted for its own continuation
        indices = []
        for i in new:
            index = self._free.pop() if self._free else self._evict()
            start = i * B
            self._blocks[keys[i]] = _Block(index, keys[i - 1] if i else scope_key, tuple(prompt[start : start + B]))
            indices.append(index)
        if indices:
            idx = torch.tensor(indices, device=self.k.device)
            positions = torch.tensor([i * B + j for i in new for j in range(B)], device=self.k.device)
            for pool, src in ((self.k, cache.k), (self.v, cache.v)):
                L, _, K, _, D = pool.shape
                # (L, K, m * B, D) -> (L, m, K, B, D)
                pool[:, idx] = src[:, slot, :, positions].reshape(L, K, len(new), B, D).permute(0, 2, 1, 3, 4)
            self.stats["stored_blocks"] += len(new)
        self._touch(keys)

    def _touch(self, chain: list[bytes]) -> None:
        """Most recent use: the chain's last block first, its first block last (so a block is
        never evicted before the blocks that continue it)."""
        for key in reversed(chain):
            if key in self._blocks:
                self._blocks.move_to_end(key)

    def _evict(self) -> int:
        _, block = self._blocks.popitem(last=False)
        self.stats["evicted_blocks"] += 1
        return block.index
