import math

import pytest
import torch

from lmfoundry.model.moe import MoE, MoEConfig, reference_moe
from lmfoundry.model.transformer import ModelConfig, Transformer


def grads(out, moe, x, gy):
    return torch.autograd.grad(
        out, [x, moe.w_gate_up, moe.w_down, moe.router.weight, moe.shared_gate_up.weight, moe.shared_down.weight], gy
    )


@pytest.mark.parametrize("dispatch", ["grouped_mm", "fused", "sliced"])
@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
@pytest.mark.parametrize("hidden", [16, 20])  # 20: rows not 16-byte aligned, grouped_mm falls back
def test_dispatch_matches_the_token_by_token_reference_forward_and_backward(dispatch, score_func, hidden):
    torch.manual_seed(0)
    moe = MoE(
        32,
        64,
        MoEConfig(
            num_experts=8, top_k=3, num_shared_experts=1, score_func=score_func, dispatch=dispatch, expert_hidden=hidden
        ),
    )
    x = torch.randn(3, 11, 32, requires_grad=True)
    y, ref = moe(x), reference_moe(moe, x)
    torch.testing.assert_close(y, ref, atol=1e-5, rtol=1e-4)
    gy = torch.randn_like(y)
    for a, b in zip(grads(y, moe, x, gy), grads(ref, moe, x, gy)):
        torch.testing.assert_close(a, b, atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("rows", [1, 3])
def test_grouped_experts_take_rows_sliced_from_a_wider_tensor(rows):
    """An expert-parallel rank's received rows carry their routing weight as one extra column,
    sliced off before the experts: a slice of one row counts as contiguous but keeps the wide
    row's stride (65 floats, not a multiple of 16 bytes), which torch._grouped_mm refuses. The
    product falls back to one product per expert and gives the same rows."""
    from lmfoundry.model.moe import expert_matmul

    torch.manual_seed(0)
    received = torch.randn(rows, 65)
    x, w = received[:, :-1], torch.randn(2, 64, 32)
    counts = [rows - 1, 1]
    offsets = torch.tensor([rows - 1, rows], dtype=torch.int32)
    expected = torch.cat([x[: rows - 1] @ w[0], x[rows - 1 :] @ w[1]])
    torch.testing.assert_close(expert_matmul(x, w, offsets, counts, "grouped_mm"), expected)


def skewed_input(n: int) -> torch.Tensor:
    x = torch.randn(n, 16)
    x[:, 0] = 1.0  # a constant feature the router can key on
    return x


def skew_router(moe: MoE) -> None:
    with torch.no_grad():
        moe.router.weight[0, 0] += 5.0  # expert 0 wins (nearly) every token


def test_every_token_reaches_top_k_experts_when_dropless():
    moe = MoE(16, 32, MoEConfig(num_experts=6, top_k=2))
    moe(torch.randn(50, 16))
    assert int(moe.stats.tokens_per_expert.sum()) == 100 and moe.stats.dropped == 0


def test_capacity_factor_drops_overflow_and_ample_capacity_equals_dropless():
    torch.manual_seed(1)
    x = torch.randn(64, 16)
    tight = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5))
    tight(x)
    capacity = math.ceil(0.5 * 64 * 2 / 4)
    assert int(tight.stats.tokens_per_expert.max()) <= capacity
    assert tight.stats.dropped == 128 - int(tight.stats.tokens_per_expert.sum()) > 0
    ample = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, capacity_factor=2.0))
    ample.load_state_dict(tight.state_dict())
    torch.testing.assert_close(ample(x), reference_moe(ample, x), atol=1e-5, rtol=1e-4)
    # the dropped assignments are dropped alike by every dispatch, forward and backward
    x.requires_grad_()
    outs = {}
    for dispatch in ("fused", "grouped_mm", "sliced"):
        layer = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, capacity_factor=0.5, dispatch=dispatch))
        layer.load_state_dict(tight.state_dict())
        y = layer(x)
        outs[dispatch] = (y, *torch.autograd.grad(y.square().sum(), [x, layer.w_gate_up, layer.w_down]))
    for other in ("grouped_mm", "sliced"):
        for a, b in zip(outs["fused"], outs[other]):
            torch.testing.assert_close(a, b, atol=1e-6, rtol=1e-5)


def test_aux_loss_is_lowest_for_even_routing_and_only_in_training():
    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=4, top_k=1, aux_loss_coef=1.0))
    x = skewed_input(256)
    moe.train()
    moe(x)
    even = moe.aux_loss.item()
    assert abs(even - 1.0) < 0.3  # E * sum f*P is 1 for perfectly even routing
    skew_router(moe)
    moe(x)
    assert moe.aux_loss.item() > 3.0 and moe.aux_loss.item() > 2 * even
    moe.eval()
    moe(x)
    assert moe.aux_loss.item() == 0.0


def test_aux_free_bias_evens_a_skewed_router():
    torch.manual_seed(0)
    # DeepSeek-V3 pairs the bias method with sigmoid scores
    moe = MoE(
        16, 32, MoEConfig(num_experts=8, top_k=2, balance="aux_free", score_func="sigmoid", bias_update_rate=0.01)
    )
    skew_router(moe)
    x = skewed_input(512)
    moe(x)
    start = moe.stats.imbalance
    for _ in range(100):  # within 100 updates
        moe(x)
        moe.update_bias(moe.stats.tokens_per_expert)
    assert start > 3.0 and moe.stats.imbalance < 1.2
    # the bias steers selection only: routing weights still come from the unbiased scores
    ids, weights, scores = moe.route(x)
    chosen = scores.gather(1, ids)
    torch.testing.assert_close(weights, chosen / chosen.sum(-1, keepdim=True))
    assert moe.expert_bias.abs().max() > 0.1


def test_moe_transformer_trains_and_reports_stats():
    torch.manual_seed(0)
    cfg = ModelConfig(
        vocab_size=64,
        max_seq_len=32,
        n_layer=2,
        d_model=32,
        n_head=4,
        n_kv_head=2,
        moe=MoEConfig(num_experts=4, top_k=2, first_dense_layers=1),
        activation_checkpointing=True,
    )
    model = Transformer(cfg)
    assert [type(b.mlp).__name__ for b in model.blocks] == ["SwiGLU", "MoE"]
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    x = torch.randint(0, 64, (4, 33))
    losses = []
    for _ in range(40):
        _, loss = model(x[:, :-1], x[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0]
    assert model.moe_layers()[0].stats.tokens_per_expert.sum() == 4 * 32 * 2


@pytest.mark.parametrize("dispatch", ["grouped_mm", "sliced"])
def test_experts_with_no_rows_still_give_shaped_outputs_and_zero_gradients(dispatch):
    from lmfoundry.model.moe import expert_matmul

    w = torch.randn(2, 16, 32, requires_grad=True)
    out = expert_matmul(torch.zeros(0, 16), w, torch.tensor([0, 0], dtype=torch.int32), [0, 0], dispatch)
    assert out.shape == (0, 32)
    out.sum().backward()
    assert w.grad is not None and float(w.grad.abs().sum()) == 0.0


def test_expert_chunks_cover_every_expert_in_order_within_the_row_limit():
    from lmfoundry.model.moe import expert_chunks

    counts = [3, 0, 5, 2, 9, 0, 0, 1]
    chunks = expert_chunks(counts, 6)
    assert chunks == [(0, 2, 0, 3), (2, 3, 3, 8), (3, 4, 8, 10), (4, 5, 10, 19), (5, 8, 19, 20)]
    assert expert_chunks([0, 0, 0], 4) == [(0, 3, 0, 0)]
    assert expert_chunks([7], 1) == [(0, 1, 0, 7)]  # an expert over the limit is a chunk of its own


def test_fused_experts_have_exact_first_derivatives_across_chunks_and_empty_experts(monkeypatch):
    """The fused dispatch's hand-written backward against finite differences in float64, with
    chunks of a few rows (so rows of one chunk, experts of several and experts with no rows all
    occur) and against the token-by-token reference."""
    import lmfoundry.model.moe as moe_module

    torch.manual_seed(0)
    monkeypatch.setattr(moe_module, "CHUNK_ELEMENTS", 4 * 8)  # 4 rows of 8 per chunk
    C, H, E = 8, 6, 5
    x = torch.randn(7, C, dtype=torch.float64, requires_grad=True)
    w_gate_up = torch.randn(E, C, 2 * H, dtype=torch.float64, requires_grad=True)
    w_down = torch.randn(E, H, C, dtype=torch.float64, requires_grad=True)
    counts = [4, 0, 6, 0, 4]  # 14 assignments: 7 tokens, top-2
    token = torch.tensor([0, 2, 3, 6, 0, 1, 2, 4, 5, 6, 1, 3, 4, 5])
    row_weights = torch.rand(14, 1, dtype=torch.float64, requires_grad=True)
    assert len(moe_module.expert_chunks(counts, 4)) == 3

    def fused(x, w_gate_up, w_down, row_weights):
        return moe_module._FusedExperts.apply(x, w_gate_up, w_down, row_weights, token, counts)

    assert torch.autograd.gradcheck(fused, (x, w_gate_up, w_down, row_weights))
    expert = torch.repeat_interleave(torch.arange(E), torch.tensor(counts))
    gate, up = torch.einsum("mc,mch->mh", x[token], w_gate_up[expert]).chunk(2, dim=-1)
    rows = torch.einsum("mh,mhc->mc", torch.nn.functional.silu(gate) * up * row_weights, w_down[expert])
    torch.testing.assert_close(fused(x, w_gate_up, w_down, row_weights), torch.zeros_like(x).index_add(0, token, rows))
    y = fused(x, w_gate_up, w_down, row_weights)
    d_gate_up, d_down = torch.autograd.grad(y.sum(), [w_gate_up, w_down])
    assert float(d_gate_up[1].abs().sum()) == float(d_down[3].abs().sum()) == 0.0  # experts with no rows
    # a frozen part (LoRA freezes the experts) is skipped, and the rest stays exact
    inputs = (x, w_gate_up, w_down, row_weights)
    for needed in ((0,), (1,), (2,), (3,), (0, 3), (1, 2)):
        subset = tuple(t.detach().requires_grad_(i in needed) for i, t in enumerate(inputs))
        assert torch.autograd.gradcheck(fused, subset)
    # a gradient of the gradient is refused, not silently wrong
    with pytest.raises(RuntimeError, match="first derivatives only.*grouped_mm or sliced"):
        torch.autograd.grad(fused(*inputs), x, torch.ones(7, C, dtype=torch.float64), create_graph=True)


def test_fused_dispatch_takes_no_tokens_and_inference_mode():
    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, dispatch="fused"))
    x = torch.zeros(0, 16, requires_grad=True)
    y = moe(x)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert float(moe.w_gate_up.grad.abs().sum()) == 0.0
    x = torch.randn(9, 16)
    with torch.inference_mode():
        torch.testing.assert_close(moe(x), reference_moe(moe, x), atol=1e-5, rtol=1e-4)


def test_the_dispatch_gather_and_combine_differentiate_like_index_select_and_index_add():
    """The MoE's row gather and row sum (index_select and index_add into outputs they allocate)
    have exact first and second derivatives, on non-contiguous 3-D rows and an empty index."""
    from lmfoundry.model.moe import _GatherRows, _SumRows

    torch.manual_seed(0)
    x = torch.randn(5, 4, 3, dtype=torch.float64).transpose(1, 2).requires_grad_()  # non-contiguous
    index = torch.tensor([4, 0, 0, 2, 4, 1])
    y = torch.randn(6, 3, 4, dtype=torch.float64, requires_grad=True)
    assert torch.equal(_GatherRows.apply(x, index), x.index_select(0, index))
    assert torch.equal(_SumRows.apply(y, index, 5), torch.zeros(5, 3, 4, dtype=torch.float64).index_add_(0, index, y))
    for fn, inputs in ((lambda t: _GatherRows.apply(t, index), x), (lambda t: _SumRows.apply(t, index, 5), y)):
        assert torch.autograd.gradcheck(fn, (inputs,))
        assert torch.autograd.gradgradcheck(fn, (inputs,))
    assert _GatherRows.apply(x, index[:0]).shape == (0, 3, 4)


def test_an_unknown_dispatch_is_refused_naming_the_allowed_ones():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="'auto', 'grouped_mm', 'fused' or 'sliced'"):
        MoEConfig(dispatch="../fused")


def test_a_model_whose_experts_were_split_gets_its_rows_of_the_whole_layers_initial_values(tmp_path):
    """Expert parallelism cuts a meta-built model's layers from outside (train/expert_parallel.py):
    its initial values, random or read from a start checkpoint, are the whole layer's cut to the
    experts it holds, so every layout starts from the single-device model's weights."""
    import torch.nn as nn

    from lmfoundry.model.checkpoint import load_model_on_meta, save_model_files
    from lmfoundry.model.transformer import build_on_meta

    cfg = ModelConfig(
        vocab_size=32,
        max_seq_len=8,
        n_layer=2,
        d_model=16,
        n_head=2,
        n_kv_head=1,
        moe=MoEConfig(num_experts=4, top_k=2),
    )

    def split(model: Transformer, rank: int) -> Transformer:
        for moe in model.moe_layers():
            moe.w_gate_up = nn.Parameter(moe.w_gate_up.data[2 * rank : 2 * rank + 2])
            moe.w_down = nn.Parameter(moe.w_down.data[2 * rank : 2 * rank + 2])
            moe.ep_size, moe.ep_rank = 2, rank
        return model

    torch.manual_seed(0)  # a build draws its init seed from torch's generator: the same for both
    whole = Transformer(cfg)
    save_model_files(whole, tmp_path)
    for rank in (0, 1):
        torch.manual_seed(0)
        for model in (split(build_on_meta(cfg), rank), split(load_model_on_meta(str(tmp_path)), rank)):
            values = model.initial_values()
            for name in ("blocks.1.mlp.w_gate_up", "blocks.0.mlp.w_down"):
                expected = dict(whole.named_parameters())[name].detach()[2 * rank : 2 * rank + 2]
                assert torch.equal(values[name](), expected), (rank, name)
            assert torch.equal(values["blocks.0.mlp.router.weight"](), whole.blocks[0].mlp.router.weight.detach())
        bad = split(build_on_meta(cfg), rank)
        bad.blocks[0].mlp.w_down = nn.Parameter(torch.empty(2, 3, 16, device="meta"))
        bad.start_weights = load_model_on_meta(str(tmp_path)).start_weights
        with pytest.raises(ValueError, match="blocks.0.mlp.w_down has shape"):
            bad.initial_values()


def test_the_balance_loss_over_ranks_slices_is_the_whole_batchs_and_so_are_its_summed_gradients():
    """Under sequence parallelism each rank routes half the tokens and `balance_over` adds the
    other half's counts, score sums (their gradient stays on the rank that computed them) and
    tokens: each half's loss is the whole batch's, and the two halves' router gradients sum to
    the whole batch's, as the group's gradient sum makes them."""
    torch.manual_seed(0)
    moe = MoE(16, 32, MoEConfig(num_experts=4, top_k=2, aux_loss_coef=0.1, dispatch="sliced")).train()
    x = torch.randn(12, 16)
    moe(x)
    whole = moe.aux_loss.detach()
    whole_grad = torch.autograd.grad(moe.aux_loss, moe.router.weight)[0]

    def stats(part: torch.Tensor):
        ids, _, scores = moe.route(part)
        counts = torch.bincount(ids.flatten(), minlength=4).float()
        return counts, (scores / scores.sum(-1, keepdim=True)).sum(0).detach(), torch.tensor(float(len(part)))

    grads = []
    for mine, other in ((x[:6], x[6:]), (x[6:], x[:6])):
        theirs = stats(other)
        moe.balance_over = lambda c, s, n, theirs=theirs: (c + theirs[0], s + theirs[1], n + theirs[2])
        moe(mine)
        assert torch.allclose(moe.aux_loss, whole, atol=1e-6)
        grads.append(torch.autograd.grad(moe.aux_loss, moe.router.weight)[0])
    assert torch.allclose(grads[0] + grads[1], whole_grad, atol=1e-6)
