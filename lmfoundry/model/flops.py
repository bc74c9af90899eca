"""Parameter and FLOP counts, for throughput, MFU and the planner.

Training FLOPs per token follow the PaLM appendix B count: 6 per active weight (2 forward,
4 backward) plus 12 * n_layer * d_model * seq_len for the attention scores and weighted sum
(causal masking not discounted). Embedding lookups are not matrix products and are left out;
a tied output head is counted once as the head. For MoE, active weights are the router, the
shared experts and top_k routed experts per token.
"""

from __future__ import annotations

from lmfoundry.model.moe import MoE
from lmfoundry.model.transformer import Transformer


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
