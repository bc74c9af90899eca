"""Expert parallelism under DeepSpeed: each rank of an expert-parallel group keeps 1/ep_size of
every MoE layer's routed experts, and the layer exchanges tokens by all-to-all (model/moe.py).

DeepSpeed must treat those expert weights differently from the rest: their gradients are
reduced only among the ranks that hold the same experts (the expert-data-parallel group), and
they sit in optimizer parameter groups of their own. DeepSpeed recognises an MoE model by its
own `deepspeed.moe.layer.MoE` modules and expert weights by `param.allreduce = False` plus a
`group_name`; `ExpertParallelMarker` is the smallest such module, attached beside each layer.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from deepspeed.moe.layer import MoE as DeepSpeedMoE
from deepspeed.utils import groups

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


def shard_model(model: Transformer, ep_size: int) -> None:
    """Split every MoE layer's experts over the expert-parallel groups. Call on every rank,
    after torch.distributed is up and before deepspeed.initialize builds the optimizer."""
    import deepspeed

    deepspeed.init_distributed(dist_backend=dist.get_backend())  # adopts the existing process group
    name = group_name(ep_size)
    if name not in groups._get_expert_parallel_group_dict():
        groups._create_expert_and_data_parallel(ep_size)
    group = groups._get_expert_parallel_group(name)
    ep_rank = dist.get_rank(group=group)
    for block in model.blocks:
        moe = block.mlp
        if moe not in model.moe_layers():
            continue
        moe.shard_experts(group, ep_size, ep_rank)
        for p in (moe.w_gate_up, moe.w_down):
            p.allreduce = False
            p.group_name = name
        block.ep_marker = ExpertParallelMarker(moe.cfg.num_experts, ep_size)


def full_state(model: Transformer) -> dict[str, torch.Tensor]:
    """The model's state with every MoE layer's experts gathered from its expert-parallel group.
    A collective: every rank calls it; the result is complete on every rank."""
    state = {k: v.detach() for k, v in model.state_dict().items()}
    for i, block in enumerate(model.blocks):
        moe = block.mlp
        if moe not in model.moe_layers() or moe.ep_group is None:
            continue
        for name in ("w_gate_up", "w_down"):
            local = getattr(moe, name).detach().contiguous()
            parts = [torch.empty_like(local) for _ in range(moe.ep_size)]
            dist.all_gather(parts, local, group=moe.ep_group)
            state[f"blocks.{i}.mlp.{name}"] = torch.cat(parts, dim=0)
    return state
