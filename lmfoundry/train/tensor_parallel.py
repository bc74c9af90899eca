"""Tensor parallelism for the transformer, applied from outside the model file by DeepSpeed's
AutoTP: the rules that say which of model/transformer.py's linear layers split how.

Megatron's layout (Shoeybi et al. 2019), as torchtitan's and DeepSpeed's also are: in each block
the query and fused key/value projections and the fused gate/up projection split by output
columns (whole heads, whole MLP columns per rank), the attention output and down projections by
input rows, so a block costs one all-reduce forward and one backward for each of attention and
the MLP. The embedding, the norms and the output head stay whole on every rank. The fused
projections are split as two halves (keys|values, gate|up), so each rank keeps its slice of both.
Per-head query/key norms (Qwen3) stay whole, but each rank sees only its heads, so their
gradients are summed over the tensor-parallel group.

DeepSpeed was chosen over DTensor because the training loop already runs on DeepSpeed's engine:
AutoTP composes with its ZeRO stages (lmfoundry runs 0-2: its checkpoint writer gathers either
tensor-parallel shards or ZeRO-3 partitions), checkpoints each rank's shard with its optimizer
partition, and its universal checkpoint merges the shards into a layout-free form that resumes
at any other layout (train/checkpointing.py).
"""

from __future__ import annotations

import contextlib

import torch

_COLUMN, _ROW = "column", "row"
LAYER_SPECS = [
    {"patterns": [r".*\.attn\.wq\.weight$"], "partition_type": _COLUMN},
    {"patterns": [r".*\.attn\.wkv\.weight$"], "partition_type": _COLUMN, "shape": [2, -1], "partition_dim": 0},
    {"patterns": [r".*\.mlp\.w_gate_up\.weight$"], "partition_type": _COLUMN, "shape": [2, -1], "partition_dim": 0},
    {"patterns": [r".*\.attn\.wo\.weight$", r".*\.mlp\.w_down\.weight$"], "partition_type": _ROW},
    {"patterns": [r".*\.attn\.[qk]_norm\.weight$"], "partition_type": "skip", "grad_allreduce": True},
]


def deepspeed_section(tp: int) -> dict:
    """DeepSpeed's `tensor_parallel` config for `tp` ranks per group."""
    return {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": LAYER_SPECS}}


def tensor_parallel_size(engine) -> int:
    return max(engine.autotp_size(), 1)


@contextlib.contextmanager
def gathered(piece: torch.nn.Module):
    """Collective over the tensor-parallel group: within it, `piece`'s split layers hold their
    whole weights (each rank lends its shard); afterwards each holds its shard again."""
    from deepspeed.module_inject.layers import GatherReplacedLayerParams

    with contextlib.ExitStack() as stack:
        for module in piece.modules():
            own = list(module.parameters(recurse=False))
            if own:  # a module with no split weight of its own gathers nothing
                stack.enter_context(GatherReplacedLayerParams(own, module, enabled=True))
        yield
