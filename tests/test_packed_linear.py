"""Linear layers packed for oneDNN (serving/packed_linear.py): the same outputs as nn.Linear, on
the layers alone and through the whole model the engine serves."""

import pytest
import torch
import torch.nn as nn

from lmfoundry.model.generate import generate
from lmfoundry.model.transformer import KVCache, ModelConfig, Transformer
from lmfoundry.serving.packed_linear import PackedLinear, pack_linears, supported

needs_onednn = pytest.mark.skipif(not supported(torch.device("cpu"), torch.float32), reason="no oneDNN on this CPU")


@needs_onednn
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("rows", [(1, 48), (5, 48), (3, 7, 48), (64, 48)])
def test_packed_linear_equals_nn_linear(bias, rows):
    torch.manual_seed(0)
    linear = nn.Linear(48, 80, bias=bias)
    x = torch.randn(rows)
    packed = PackedLinear(linear)
    with torch.inference_mode():
        torch.testing.assert_close(packed(x), linear(x), rtol=1e-5, atol=1e-5)
    assert packed(x).shape == (*rows[:-1], 80)


@pytest.mark.skipif(not supported(torch.device("cpu"), torch.bfloat16), reason="no bfloat16 oneDNN on this CPU")
def test_packed_linear_in_bfloat16():
    torch.manual_seed(0)
    linear = nn.Linear(64, 32).to(torch.bfloat16)
    x = torch.randn(9, 64, dtype=torch.bfloat16)
    with torch.inference_mode():
        got = PackedLinear(linear)(x)
        assert got.dtype == torch.bfloat16
        torch.testing.assert_close(got.float(), linear(x).float(), rtol=0.02, atol=0.02)


def _model(**overrides) -> Transformer:
    torch.manual_seed(0)
    cfg = dict(vocab_size=101, max_seq_len=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, attention_bias=True)
    return Transformer(ModelConfig(**(cfg | overrides))).eval()


@needs_onednn
@pytest.mark.parametrize("tied", [True, False])
def test_packed_model_gives_the_same_logits_and_tokens(tied):
    plain, packed = _model(tie_embeddings=tied), _model(tie_embeddings=tied)
    linears = sum(isinstance(m, nn.Linear) for m in plain.modules())
    assert pack_linears(packed) == linears == 2 * 5 + 1  # q, kv, o, gate|up, down per block; the head
    assert not any(type(m) is nn.Linear for m in packed.modules())
    prompt = torch.randint(0, 101, (3, 20))
    with torch.inference_mode():
        torch.testing.assert_close(packed(prompt)[0], plain(prompt)[0], rtol=1e-4, atol=1e-4)
        # decoding with a cache, rows of different lengths in one pass, as the scheduler runs it
        caches = [KVCache(m.cfg, 3, 64, "cpu", torch.float32) for m in (plain, packed)]
        for model, cache in zip((plain, packed), caches):
            model(prompt, cache=cache)
            cache.lengths[1] -= 5
        step = torch.randint(0, 101, (3, 1))
        torch.testing.assert_close(
            packed(step, cache=caches[1])[0], plain(step, cache=caches[0])[0], rtol=1e-4, atol=1e-4
        )
    assert generate(packed, prompt[0].tolist(), 12, temperature=0.0) == generate(
        plain, prompt[0].tolist(), 12, temperature=0.0
    )


def test_pack_linears_leaves_training_models_and_other_precisions_alone():
    model = _model().train()
    assert pack_linears(model) == 0
    assert all(type(b.attn.wq) is nn.Linear for b in model.blocks)
    half = _model().to(torch.float16)  # oneDNN is not asked to run float16
    assert not supported(torch.device("cpu"), torch.float16) and pack_linears(half) == 0
    assert type(half.lm_head) is nn.Linear


@needs_onednn
def test_a_packed_model_refuses_to_be_moved_or_cast():
    model = _model()
    pack_linears(model)
    with pytest.raises(RuntimeError, match="pack it after"):
        model.to(torch.float64)


@needs_onednn
def test_the_engine_runs_packed_layers_on_cpu(tmp_path):
    from test_export import make_checkpoint

    from lmfoundry.serving.engine import InferenceEngine

    plain, _ = make_checkpoint(tmp_path / "ckpt")
    engine = InferenceEngine(str(tmp_path / "ckpt"), "cpu", max_batch_size=2)
    try:
        served = engine.batcher.model
        assert isinstance(served.lm_head, PackedLinear) and isinstance(served.blocks[0].mlp.w_down, PackedLinear)
        ids = engine.encode("def add(a, b):")
        with torch.inference_mode():
            torch.testing.assert_close(
                served(torch.tensor([ids]))[0], plain(torch.tensor([ids]))[0], rtol=1e-4, atol=1e-4
            )
    finally:
        engine.batcher.close()
