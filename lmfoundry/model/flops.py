"""Parameter and FLOP counts, for throughput, MFU and the planner.

Training FLOPs per token follow the PaLM appendix B count: 6 per active weight (2 forward,
4 backward) plus 12 * n_layer * d_model * seq_len for the attention scores and weighted sum
(causal masking not discounted). Embedding lookups are not matrix products and are left out;
a tied output head is counted once as the head. For MoE, active weights are the router, the
shared experts and top_k routed experts per token.
"""

from __future__ import annotations

from lmfoundry.model.moe import MoE
from lmfoundry.model.shape import ModelShape
from lmfoundry.model.transformer import ModelConfig, RMSNorm, Transformer, build_on_meta


def matmul_params(model: Transformer) -> int:
    """Weights that take part in a matrix product for every token (routed experts: top_k of them)."""
    c = model.cfg
    total = c.vocab_size * c.d_model  # the output head (tied or not, one product per token)
    for block in model.blocks:
        attn = block.attn
        total += attn.wq.weight.numel() + attn.wkv.weight.numel() + attn.wo.weight.numel()
        mlp = block.mlp
        if isinstance(mlp, MoE):
            per_expert = mlp.w_gate_up[0].numel() + mlp.w_down[0].numel()
            total += mlp.router.weight.numel() + mlp.cfg.top_k * per_expert
            if mlp.shared_gate_up is not None:
                total += mlp.shared_gate_up.weight.numel() + mlp.shared_down.weight.numel()
        else:
            total += mlp.w_gate_up.weight.numel() + mlp.w_down.weight.numel()
    return total


def attention_flops_per_token(model: Transformer, seq_len: int) -> int:
    """Forward + backward FLOPs of QK^T and AV per token at this sequence length."""
    c = model.cfg
    return 12 * c.n_layer * c.n_head * c.head_dim * seq_len


def train_flops_per_token(model: Transformer, seq_len: int) -> int:
    return 6 * matmul_params(model) + attention_flops_per_token(model, seq_len)


def model_shape(model_cfg: ModelConfig) -> ModelShape:
    """The planner's numbers, counted from the model built on the meta device."""
    model = build_on_meta(model_cfg)
    moe_layers = model.moe_layers()
    experts = sum(layer.w_gate_up.numel() + layer.w_down.numel() for layer in moe_layers)
    largest = max(sum(p.numel() for p in m.parameters(recurse=False)) for m in model.modules())
    moe = model_cfg.moe
    expert_hidden = moe_layers[0].expert_hidden if moe_layers else 0
    whole = [model.embed, model.norm, *(m for m in model.modules() if isinstance(m, RMSNorm))]
    if not model_cfg.tie_embeddings:
        whole.append(model.lm_head)
    replicated = sum(p.numel() for p in {p for m in whole for p in m.parameters(recurse=False)})
    # an MoE layer's router and shared experts: whole on every tensor-parallel rank, which routes
    # and runs its own slice of the tokens (its routed experts are split over the group instead)
    replicated += sum(p.numel() for layer in moe_layers for n, p in layer.named_parameters() if not n.startswith("w_"))
    return ModelShape(
        total_params=model.num_params(),
        expert_params=experts,
        largest_layer_params=largest,
        train_flops_per_token=train_flops_per_token(model, model_cfg.max_seq_len),
        n_layer=model_cfg.n_layer,
        d_model=model_cfg.d_model,
        n_head=model_cfg.n_head,
        n_kv_head=model_cfg.n_kv_head,
        top_k=moe.top_k if moe else 0,
        num_experts=moe.num_experts if moe else 0,
        vocab_size=model_cfg.vocab_size,
        ffn_hidden=model_cfg.ffn_hidden,
        moe_layers=len(moe_layers),
        expert_hidden=expert_hidden,
        shared_hidden=moe.num_shared_experts * expert_hidden if moe else 0,
        replicated_params=replicated,
        embedding_params=model.embed.weight.numel(),
        head_params=0 if model_cfg.tie_embeddings else model.lm_head.weight.numel(),
    )
