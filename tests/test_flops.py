import pytest
import torch
from torch.utils.flop_counter import FlopCounterMode

from lmfoundry.model.flops import matmul_params, train_flops_per_token
from lmfoundry.model.moe import MoEConfig
from lmfoundry.model.transformer import ModelConfig, Transformer


def math_attention(q, k, v, attn_mask=None, is_causal=False):
    # SDPA's fused CPU kernel has no FLOP formula registered; spelled out in matmuls it is counted
    scores = q @ k.transpose(-2, -1) / q.shape[-1] ** 0.5
    if is_causal:
        t = q.shape[-2]
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
    return scores.softmax(-1) @ v


def counted_train_flops(model: Transformer, batch: int, seq_len: int) -> int:
    x = torch.randint(0, model.cfg.vocab_size, (batch, seq_len))
    with FlopCounterMode(display=False) as counter:
        _, loss = model(x, x)
        loss.backward()
    return counter.get_total_flops()


@pytest.mark.parametrize("moe", [None, MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, dispatch="sliced")])
def test_flops_formula_matches_counted_forward_backward(moe, monkeypatch):
    monkeypatch.setattr(torch.nn.functional, "scaled_dot_product_attention", math_attention)
    torch.manual_seed(0)
    model = Transformer(
        ModelConfig(vocab_size=512, max_seq_len=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, moe=moe)
    )
    batch, seq = 4, 64
    counted = counted_train_flops(model, batch, seq)
    predicted = train_flops_per_token(model, seq) * batch * seq
    # neither side counts elementwise work (norms, softmax, SiLU); attention is counted in full
    assert counted == predicted


def test_dense_matmul_params_equal_the_model_weights_but_the_embedding_and_norms():
    model = Transformer(
        ModelConfig(vocab_size=512, max_seq_len=64, n_layer=2, d_model=64, n_head=4, n_kv_head=2, tie_embeddings=False)
    )
    norms = sum(p.numel() for n, p in model.named_parameters() if "norm" in n)
    assert matmul_params(model) == model.num_params() - model.embed.weight.numel() - norms
