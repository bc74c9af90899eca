"""Continuous batching without Ray: requests that run together give what each gives alone."""

import queue
import threading
import time

import pytest
import torch

from lmfoundry.model.generate import generate
from lmfoundry.model.transformer import ModelConfig, Transformer
from lmfoundry.serving.sampling import SamplingParams
from lmfoundry.serving.scheduler import ContinuousBatcher, Overloaded

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return Transformer(ModelConfig(vocab_size=97, max_seq_len=64, n_layer=2, d_model=32, n_head=4, n_kv_head=2)).eval()


def collect(batcher, prompt, n, temperature=0.0, seed=None, top_p=1.0):
    """Submit one request; returns a function that waits for its (tokens, finish reason)."""
    q: queue.Queue = queue.Queue()
    req = batcher.submit(prompt, SamplingParams(n, temperature, top_p, seed), q.put)

    def wait():
        tokens = []
        while True:
            item = q.get(timeout=60)
            if isinstance(item, str):
                return tokens, item
            tokens.append(item)

    return req, wait


def test_concurrent_greedy_requests_match_one_at_a_time(model):
    prompts = [[1 + i, 2 + i, 3 * i % 97 + 1][: 1 + i % 3] + list(range(5, 5 + i)) for i in range(10)]
    lengths = [4 + 3 * (i % 5) for i in range(10)]
    alone = [generate(model, p, n, temperature=0).tokens for p, n in zip(prompts, lengths)]
    batcher = ContinuousBatcher(lambda: model, frozenset(), max_batch_size=4)
    try:
        waits = [collect(batcher, p, n)[1] for p, n in zip(prompts, lengths)]
        together = [w() for w in waits]
    finally:
        batcher.close()
    assert [t for t, _ in together] == alone
    assert all(reason == "length" for _, reason in together)
    # more than one request per forward pass, and never more than the slots
    assert batcher.stats["decode_rows"] > 1.5 * batcher.stats["decode_steps"]
    assert batcher.stats["prefills"] == 10
    assert batcher.stats["prefill_passes"] < 10  # prompts that arrived together were prefilled together


def test_seeded_sampling_does_not_depend_on_the_batch_it_ran_in(model):
    alone = ContinuousBatcher(lambda: model, frozenset(), max_batch_size=1)
    try:
        expected = collect(alone, [3, 4, 5], 12, temperature=0.9, seed=11, top_p=0.9)[1]()
    finally:
        alone.close()
    crowded = ContinuousBatcher(lambda: model, frozenset(), max_batch_size=8)
    try:
        others = [collect(crowded, [7, 8], 20, temperature=1.0, seed=s)[1] for s in range(5)]
        mine = collect(crowded, [3, 4, 5], 12, temperature=0.9, seed=11, top_p=0.9)[1]
        assert mine() == expected
        [w() for w in others]
    finally:
        crowded.close()


def test_stop_tokens_cancellation_and_slot_reuse(model):
    first = generate(model, [1, 2, 3], 1, temperature=0).tokens[0]
    batcher = ContinuousBatcher(lambda: model, frozenset({first}), max_batch_size=2)
    try:
        assert collect(batcher, [1, 2, 3], 10)[1]() == ([], "stop")
        seen: list = []

        def emit(item):  # a client that goes away after three tokens
            seen.append(item)
            if len(seen) == 3:
                req.cancel()

        req = batcher.submit([9, 9], SamplingParams(60, 0.0), emit)
        deadline = time.time() + 30
        while not seen or not isinstance(seen[-1], str):
            assert time.time() < deadline
            time.sleep(0.01)
        assert len(seen) == 4 and seen[-1] == "cancelled"
        # both slots are free again: two more requests run to the end
        waits = [collect(batcher, [4, 5], 5)[1] for _ in range(2)]
        assert [w()[1] for w in waits] == ["length", "length"]
        assert batcher.running == 0
    finally:
        batcher.close()


def test_a_model_that_fails_to_load_fails_the_constructor():
    def broken():
        raise FileNotFoundError("no weights here")

    with pytest.raises(FileNotFoundError, match="no weights here"):
        ContinuousBatcher(broken, frozenset())


def test_a_full_queue_is_refused_at_once_and_limits_are_checked(model):
    batcher = ContinuousBatcher(lambda: model, frozenset(), max_batch_size=1, max_waiting=2)
    gate = threading.Event()
    try:
        with pytest.raises(ValueError, match="exceeds the model's context of 64"):
            batcher.submit([1] * 60, SamplingParams(10, 0.0), lambda _: None)
        with pytest.raises(ValueError, match="at least one token"):
            batcher.submit([], SamplingParams(10, 0.0), lambda _: None)
        # one runs, two wait, the fourth is refused
        slow = lambda _: gate.wait(0.01)  # noqa: E731
        reqs = [batcher.submit([1, 2], SamplingParams(60, 0.0), slow)]
        while batcher.running < 1:
            time.sleep(0.001)
        reqs += [batcher.submit([1, 2], SamplingParams(60, 0.0), slow) for _ in range(2)]
        t0 = time.perf_counter()
        with pytest.raises(Overloaded, match="max_waiting=2"):
            batcher.submit([1, 2], SamplingParams(5, 0.0), lambda _: None)
        assert time.perf_counter() - t0 < 0.5
        for r in reqs:
            r.cancel()
    finally:
        gate.set()
        batcher.close()


def test_a_request_that_fails_ends_alone(model):
    class Broken:  # a grammar that breaks after two tokens
        n = 0

        def allowed(self):
            self.n += 1
            if self.n > 2:
                raise RuntimeError("grammar broke")
            return list(range(97))

        def advance(self, token):
            pass

        def done(self):
            return False

    batcher = ContinuousBatcher(lambda: model, frozenset(), max_batch_size=4)
    try:
        healthy = collect(batcher, [1, 2, 3], 20)[1]
        q: queue.Queue = queue.Queue()
        batcher.submit([4, 5], SamplingParams(20, 0.0), q.put, constraint=Broken())
        items = [q.get(timeout=30) for _ in range(3)]
        assert isinstance(items[-1], RuntimeError) and "grammar broke" in str(items[-1])
        assert healthy() == (generate(model, [1, 2, 3], 20, temperature=0).tokens, "length")
        assert batcher.alive() and batcher.running == 0
    finally:
        batcher.close()


def test_the_engine_serves_in_bfloat16_when_asked(tmp_path):
    import asyncio
    import typing

    from test_export import make_checkpoint

    from lmfoundry.serving.app import EngineConfig
    from lmfoundry.serving.engine import DTYPES, InferenceEngine
    from lmfoundry.serving.packed_linear import PackedLinear, supported

    fp32, _ = make_checkpoint(tmp_path / "ckpt")
    engine = InferenceEngine(str(tmp_path / "ckpt"), "cpu", max_batch_size=2, dtype="bfloat16")
    try:
        bf16 = engine.batcher.model
        assert next(bf16.parameters()).dtype == engine.batcher.cache.k.dtype == torch.bfloat16
        if supported(torch.device("cpu"), torch.bfloat16):
            assert isinstance(bf16.lm_head, PackedLinear)
        ids = engine.encode("def add(a, b):")
        with torch.inference_mode():
            want, got = fp32(torch.tensor([ids]))[0], bf16(torch.tensor([ids]))[0]
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), want, atol=0.05, rtol=0.05)  # bfloat16 keeps 8 bits
        reply = asyncio.run(_complete(engine, ids, 6))
        assert 1 <= reply.completion_tokens <= 6 and reply.finish_reason in ("length", "stop")
    finally:
        engine.batcher.close()
    with pytest.raises(ValueError, match="dtype 'float16' is not one of"):
        InferenceEngine(str(tmp_path / "ckpt"), "cpu", dtype="float16")
    # the serve config offers exactly the precisions the engine runs in
    assert set(typing.get_args(EngineConfig.model_fields["dtype"].annotation)) == set(DTYPES)


async def _complete(engine, ids, n):
    return await engine.stream(ids, SamplingParams(n, 0.0)).collect()
