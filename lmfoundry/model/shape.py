"""A model's shape in plain numbers: what the planner and the FLOP counts need to know of a network,
counted from the real model by `model/flops.py: model_shape`. No torch, so the planner stays light."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class ModelShape:
    total_params: int
    expert_params: int  # routed-expert weights, all experts (0 for a dense model)
    largest_layer_params: int  # the biggest single module, gathered whole under ZeRO-3
    train_flops_per_token: int  # at seq_len, forward + backward
    n_layer: int
    d_model: int
    n_head: int
    n_kv_head: int = 0  # 0: as many as n_head
    top_k: int = 0
    num_experts: int = 0
    vocab_size: int = 32000
    ffn_hidden: int = 0  # the dense SwiGLU width; 0: 8/3 d_model
    moe_layers: int = 0  # layers with a routed MLP
    expert_hidden: int = 0
    shared_hidden: int = 0  # all shared experts' width together
    # whole on every tensor-parallel rank (train/tensor_parallel.py splits the blocks' linear
    # layers only, and the vocabulary tables with `vocab_parallel`): the embedding, an untied
    # output head, the norms, the MoE layers' routers and shared experts
    replicated_params: int = 0
    # Under pipeline parallelism the first stage holds the input embedding and the last the
    # output head: an untied head's own parameters, or (0 here) the tied embedding again
    embedding_params: int = 0
    head_params: int = 0

    @property
    def kv_heads(self) -> int:
        return self.n_kv_head or self.n_head

    @property
    def dense_ffn(self) -> int:
        return self.ffn_hidden or 8 * self.d_model // 3
