"""Expert parallelism under DeepSpeed: each rank of an expert-parallel group keeps 1/ep_size of
every MoE layer's routed experts, and the layer exchanges tokens by all-to-all: `shard_experts`
cuts a single-device MoE layer (model/moe.py) down to its rank's experts and installs
`exchange_tokens` as the layer's dispatch.

DeepSpeed must treat those expert weights differently from the rest: their gradients are
reduced only among the ranks that hold the same experts (the expert-data-parallel group), and
they sit in optimizer parameter groups of their own. DeepSpeed recognises an MoE model by its
own `deepspeed.moe.layer.MoE` modules and expert weights by `param.allreduce = False` plus a
`group_name`; `ExpertParallelMarker` is the smallest such module, attached beside each layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups

from lmfoundry.model.moe import MoE
from lmfoundry.model.transformer import Transformer


class ExpertParallelMarker(DeepSpeedMoE):
    """Tells DeepSpeed's engine that the model has expert-parallel layers. It holds no weights
    and does no work: the lmfoundry MoE layer beside it does both."""

    def __init__(self, num_experts: int, ep_size: int):
        torch.nn.Module.__init__(self)  # not DeepSpeedMoE.__init__: it would build its own experts
        self.num_experts = num_experts
        self.ep_size = ep_size
        self.num_local_experts = num_experts // ep_size
        self.expert_group_name = group_name(ep_size)

    def set_deepspeed_parallelism(self, use_data_before_expert_parallel_: bool = False) -> None:
        pass  # the groups exist already: shard_model made them before the engine was built

    def forward(self, *args, **kwargs):
        raise RuntimeError("ExpertParallelMarker is a marker for DeepSpeed, not a layer to call")


def group_name(ep_size: int) -> str:
    return f"ep_size_{ep_size}"


def shard_model(model: Transformer, ep_size: int, pipeline_stages: int = 1) -> None:
    """Split every MoE layer's experts over the expert-parallel groups. Call on every rank,
    after torch.distributed is up and before deepspeed.initialize builds the optimizer. With
    pipeline stages the groups lie within each stage's ranks (consecutive: a stage's ranks are
    `world / pipeline_stages` consecutive ones), whose replicas hold the same layers. A model on
    the meta device is cut as it is; its initial values are cut alike when they are made
    (Transformer.initial_values)."""
    import deepspeed

    from lmfoundry.train.engine import prepare_deepspeed

    prepare_deepspeed()
    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size, pp_size=pipeline_stages)
    group = groups._get_expert_parallel_group(name)
    ep_rank = dist.get_rank(group=group)
    for block in model.blocks:
        moe = block.mlp
        if moe not in model.moe_layers():
            continue
        shard_experts(moe, group, ep_size, ep_rank)
        for p in (moe.w_gate_up, moe.w_down):
            p.allreduce = False
            p.group_name = name
        block.ep_marker = ExpertParallelMarker(moe.cfg.num_experts, ep_size)


def shard_experts(moe: MoE, group, ep_size: int, ep_rank: int) -> None:
    """Keep only this rank's slice of the layer's routed experts; tokens will travel to their expert."""
    E = moe.cfg.num_experts
    if E % ep_size:
        raise ValueError(f"num_experts={E} must be divisible by the expert-parallel size {ep_size}")
    El = E // ep_size
    keep = slice(ep_rank * El, (ep_rank + 1) * El)
    moe.w_gate_up = nn.Parameter(moe.w_gate_up.data[keep].clone())
    moe.w_down = nn.Parameter(moe.w_down.data[keep].clone())
    moe.ep_group, moe.ep_size, moe.ep_rank = group, ep_size, ep_rank
    moe.exchange = exchange_tokens


def exchange_tokens(moe: MoE, xs: torch.Tensor, counts: torch.Tensor, row_weights: torch.Tensor) -> torch.Tensor:
    """The expert-parallel dispatch of an MoE layer: send each row to the rank that holds its
    expert, run the local experts, send back. xs is sorted by global expert id, so rows bound for
    each rank are already contiguous."""
    from torch.distributed.nn.functional import all_to_all_single

    P, El = moe.ep_size, moe.cfg.num_experts // moe.ep_size
    send_per_expert = counts.view(P, El)  # [r, j]: rows this rank sends to rank r's expert j
    recv_per_expert = torch.empty_like(send_per_expert)
    dist.all_to_all_single(recv_per_expert, send_per_expert, group=moe.ep_group)  # [s, j]: from rank s
    send_splits = send_per_expert.sum(1).tolist()
    recv_splits = recv_per_expert.sum(1).tolist()
    # the routing weight travels with its row, as one extra column
    rows = torch.cat([xs, row_weights], dim=1)
    recv = all_to_all_single(
        rows.new_empty(sum(recv_splits), rows.shape[1]), rows, recv_splits, send_splits, group=moe.ep_group
    )  # grouped by source rank
    # regroup the received rows by local expert (stable, so rows keep their source order)
    local_expert = torch.arange(El, device=xs.device).repeat(P).repeat_interleave(recv_per_expert.flatten())
    perm = local_expert.argsort(stable=True)
    recv = recv[perm]
    ys_local = moe._experts(recv[:, :-1], recv_per_expert.sum(0), recv[:, -1:])
    back = ys_local[perm.argsort()]  # undo the regrouping
    return all_to_all_single(xs.new_empty(xs.shape), back, send_splits, recv_splits, group=moe.ep_group)


def gathered_experts(moe: MoE) -> dict[str, torch.Tensor]:
    """The layer's routed-expert tensors, every expert's, gathered from its expert-parallel group
    (a collective of the group: each of its ranks calls it)."""
    whole = {}
    for name in ("w_gate_up", "w_down"):
        local = getattr(moe, name).detach().contiguous()
        parts = [torch.empty_like(local) for _ in range(moe.ep_size)]
        dist.all_gather(parts, local, group=moe.ep_group)
        whole[name] = torch.cat(parts, dim=0)
    return whole


def full_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's state with every MoE layer's experts gathered from its expert-parallel group.
    A collective: every rank calls it; the result is complete on every rank."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        moe = block.mlp
        if moe not in model.moe_layers() or moe.ep_group is None:
            continue
        for name, whole in gathered_experts(moe).items():
            state[f"blocks.{i}.mlp.{name}"] = whole
    return state
