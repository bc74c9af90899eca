"""Shared-prefix reuse in the continuous batcher, without Ray: the same tokens with and without
it, a pool that never grows, and a prefix reused only by the same scope on an exact token match."""

import queue

import pytest
import torch

from lmfoundry.model.generate import generate
from lmfoundry.model.transformer import KVCache, ModelConfig, Transformer
from lmfoundry.serving.prefix_cache import PrefixCache, block_keys, scope_root
from lmfoundry.serving.sampling import SamplingParams
from lmfoundry.serving.scheduler import ContinuousBatcher

pytestmark = pytest.mark.timeout(120)

CFG = ModelConfig(vocab_size=97, max_seq_len=128, n_layer=2, d_model=32, n_head=4, n_kv_head=2)
SYSTEM = [(7 * i) % 90 + 3 for i in range(40)]  # a shared 40-token "system prompt": 5 blocks of 8


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(CFG).eval()


def submit(batcher, prompt, n, scope="acme"):
    q: queue.Queue = queue.Queue()
    batcher.submit(prompt, SamplingParams(n, 0.0), q.put, cache_scope=scope)

    def wait():
        tokens = []
        while not isinstance(item := q.get(timeout=60), str):
            tokens.append(item)
        return tokens

    return wait


def test_greedy_output_is_the_same_with_and_without_reuse(model):
    prompts = [SYSTEM + [11 + i, 12 + i, 13 + (5 * i) % 50][: 1 + i % 3] for i in range(8)]
    prompts += [SYSTEM[:20], SYSTEM + SYSTEM[:10]]  # a prompt inside a cached block; one past the prefix
    alone = [generate(model, p, 6, temperature=0).tokens for p in prompts]
    batcher = ContinuousBatcher(
        lambda: model, frozenset(), max_batch_size=4, prefix_cache_tokens=64, prefix_block_tokens=8
    )
    try:
        first = submit(batcher, prompts[0], 6)()  # computes the prefix's blocks
        rest = [submit(batcher, p, 6) for p in prompts[1:]]  # arrive together, reuse them
        together = [first] + [w() for w in rest]
    finally:
        batcher.close()
    assert together == alone
    # every later prompt reused the system prompt's blocks it holds whole (one token always computed)
    assert batcher.stats["prefix_reused_tokens"] >= 7 * 40 + 16
    assert batcher.stats["prefill_tokens"] < sum(map(len, prompts)) - 7 * 40


def test_the_pool_is_bounded_and_evicts_the_least_recently_used(model):
    batcher = ContinuousBatcher(
        lambda: model, frozenset(), max_batch_size=2, prefix_cache_tokens=32, prefix_block_tokens=8
    )
    try:
        pool = batcher.prefix_cache
        size = pool.k.numel()
        for i in range(12):  # 12 distinct 3-block prompts through a 4-block pool
            submit(batcher, [(i * 13 + j) % 90 + 3 for j in range(25)], 1)()
        submit(batcher, [1, 2], 1, scope=None)()  # the step that stored the last prompt's blocks has ended
        assert len(pool) <= 4 and pool.k.numel() == size
        assert pool.stats["stored_blocks"] >= 30
        assert pool.stats["evicted_blocks"] == pool.stats["stored_blocks"] - len(pool)
        # the latest prompt's chain is what is left: its first blocks are found
        last = [(11 * 13 + j) % 90 + 3 for j in range(25)]
        assert len(pool.match(block_keys(last, 8, "acme"), last, scope_root("acme"))) >= 1
    finally:
        batcher.close()


def test_reuse_needs_the_same_scope_and_the_exact_tokens(model):
    batcher = ContinuousBatcher(
        lambda: model, frozenset(), max_batch_size=2, prefix_cache_tokens=64, prefix_block_tokens=8
    )
    try:
        submit(batcher, SYSTEM + [5], 2, scope="acme")()
        reused = lambda: batcher.stats["prefix_reused_tokens"]  # noqa: E731
        submit(batcher, SYSTEM + [6], 2, scope="globex")()
        assert reused() == 0  # another tenant's prompt finds nothing, though the tokens are the same
        submit(batcher, SYSTEM + [6], 2, scope=None)()
        assert reused() == 0  # a request outside any scope neither reuses nor is reused
        changed = SYSTEM[:12] + [SYSTEM[12] + 1] + SYSTEM[13:] + [6]  # one token differs in block 2
        submit(batcher, changed, 2, scope="acme")()
        assert reused() == 8  # block 1 only: block 2 and every block after it name a different prefix
    finally:
        batcher.close()


def test_a_hash_collision_cannot_hand_over_another_prompts_blocks():
    pool = PrefixCache(CFG, 64, 8, "cpu", torch.float32)
    cache = KVCache(CFG, 1, CFG.max_seq_len, "cpu", torch.float32)
    root = scope_root("acme")
    theirs = SYSTEM[:17]
    pool.store(cache, 0, block_keys(theirs, 8, "acme"), theirs, root)
    mine = [t + 1 for t in theirs]
    # as if my prompt's blocks hashed to their keys: the tokens kept with each block refuse it
    assert pool.match(block_keys(theirs, 8, "acme"), mine, root) == []
    assert len(pool.match(block_keys(theirs, 8, "acme"), theirs, root)) == 2
