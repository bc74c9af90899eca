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


def deepspeed_section(tp: int, sequence_parallel_norms: list[str] | None = None, vocab_parallel: bool = False) -> dict:
    """DeepSpeed's `tensor_parallel` config for `tp` ranks per group. `sequence_parallel_norms`:
    patterns of the names of the norms' weights that see a slice of the sequence under sequence
    parallelism (their gradients are summed over the group), None without it. `vocab_parallel`:
    AutoTP splits the output head (`lm_head`) by vocabulary rows, a tied embedding with it, and
    puts its distributed cross-entropy in the model's `loss_function`."""
    specs = LAYER_SPECS
    if sequence_parallel_norms:
        specs = [*specs, {"patterns": sequence_parallel_norms, "partition_type": "skip", "grad_allreduce": True}]
    section = {"autotp_size": tp, "partition_config": {"use_default_specs": False, "layer_specs": specs}}
    return {**section, "vocab_parallel_lm_head": True} if vocab_parallel else section


def sequence_parallel_norms(n_layer: int, pipelined: bool) -> list[str]:
    """Patterns of the names of the norms' weights a sequence-parallel model applies to a slice
    of the sequence (every block's two and the final one), in the model or in its pipeline
    module (train/pipeline_parallel.py numbers the blocks from 1, the final norm n_layer + 1,
    and the untied head, which must not match, n_layer + 2)."""
    if pipelined:
        return [r"^\d+\.block\.(attn|mlp)_norm\.weight$", rf"^{n_layer + 1}\.module\.weight$"]
    return [r"^blocks\.\d+\.(attn|mlp)_norm\.weight$", r"^norm\.weight$"]


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


# Sequence parallelism (Korthikanti et al. 2022, "Reducing Activation Recomputation in Large
# Transformer Models"), as Megatron-LM runs it: between the tensor-parallel regions of a block
# (the norms, the residual adds) each rank of the group holds 1/T of the sequence instead of the
# whole of it, so those activations, which tensor parallelism alone keeps whole on every rank,
# are split T ways too. Each all-reduce of a row-parallel layer becomes a reduce-scatter along
# the sequence, and each column-parallel layer all-gathers the sequence before its product:
# the same bytes on the wire (an all-reduce is a reduce-scatter and an all-gather). The norms'
# weights see 1/T of the tokens, so their gradients are summed over the group. The model has no
# dropout; with it, the dropout regions would be the split ones too.
COLUMN_LAYERS = ("attn.wq", "attn.wkv", "mlp.w_gate_up")
ROW_LAYERS = ("attn.wo", "mlp.w_down")
SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    shards = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = shards.new_empty((world * shards.shape[0], *shards.shape[1:]))
    dist.all_gather_single(out, shards, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    whole = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // world, *whole.shape[1:]))
    dist.reduce_scatter_tensor(out, whole, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    if x.shape[SEQUENCE_DIM] % world:
        raise ValueError(
            f"sequence parallelism splits each sequence over the {world} ranks of a tensor-parallel group: "
            f"a sequence of {x.shape[SEQUENCE_DIM]} tokens does not split evenly (use a multiple of {world})"
        )
    return x.chunk(world, dim=SEQUENCE_DIM)[rank].contiguous()


class ScatterSequence(torch.autograd.Function):
    """Into the sequence-parallel region: each rank keeps its slice of a whole (replicated)
    activation; backward gathers the slices' gradients into the whole's."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class ReduceScatterSequence(torch.autograd.Function):
    """A row-parallel product's partial sums into the sequence-parallel region: summed over the
    group, each rank keeping its slice; backward gathers the slices' gradients."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None


class GatherSequenceForReplicated(torch.autograd.Function):
    """Out of the sequence-parallel region into a replicated computation (the output head and
    the loss, the same on every rank): the whole sequence; every rank back-propagates the same
    gradient of the whole, so backward keeps its own slice."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _own_slice(grad, ctx.group), None


class GatheredColumnLinear(torch.autograd.Function):
    """A column-parallel product of the whole sequence from a rank's slice of it, keeping only the
    slice for backward (as Megatron does): the gathered input is rebuilt by a second all-gather
    in backward instead of being held, which is where sequence parallelism saves the memory of
    the norms' outputs. Backward reduce-scatters the input's gradient: each rank's product
    gives a partial gradient of the whole sequence."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.group, ctx.has_bias = group, bias is not None
        ctx.save_for_backward(x, weight)
        return torch.nn.functional.linear(_gather_sequence(x, group), weight, bias)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        whole = _gather_sequence(x, ctx.group)
        grad_x = _reduce_scatter_sequence(grad @ weight, ctx.group)
        grad_weight = grad.reshape(-1, grad.shape[-1]).T @ whole.reshape(-1, whole.shape[-1])
        grad_bias = grad.reshape(-1, grad.shape[-1]).sum(0) if ctx.has_bias else None
        return grad_x, grad_weight, grad_bias, None


def _column_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return GatheredColumnLinear.apply(x, layer.weight, layer.bias, layer.mp_group)


def _row_forward(layer, x: torch.Tensor) -> torch.Tensor:
    out = ReduceScatterSequence.apply(torch.nn.functional.linear(x, layer.weight), layer.mp_group)
    return out if layer.bias is None else out + layer.bias


def apply_sequence_parallelism(module: torch.nn.Module, embeddings: list, final_norms: list, group) -> int:
    """Makes `module`, whose blocks AutoTP has split over `group`, sequence-parallel: the
    column-parallel layers gather the sequence before their product and the row-parallel layers
    reduce-scatter it after theirs (their own collectives replaced), each embedding lookup in
    `embeddings` keeps its rank's slice and each norm in `final_norms` (the one before the
    output head) gathers the whole sequence back. Returns the number of layers changed, which is
    zero when `module` holds none (a pipeline stage with only the head)."""
    import types

    from deepspeed.module_inject.layers import TensorParallel_Layer

    changed = 0
    for name, layer in module.named_modules():
        kind = _column_forward if name.endswith(COLUMN_LAYERS) else _row_forward if name.endswith(ROW_LAYERS) else None
        if kind is None:
            continue
        if not isinstance(layer, TensorParallel_Layer):
            raise RuntimeError(f"sequence parallelism needs {name} split by tensor parallelism; it is {type(layer)}")
        # the instance's forward, not the class's: AutoTP's layers reduce in forward or backward
        # over the whole activation, which the sequence-parallel collectives replace
        layer.forward = types.MethodType(kind, layer)
        changed += 1
    for embedding in embeddings:
        embedding.register_forward_hook(lambda _m, _args, out: ScatterSequence.apply(out, group))
    for norm in final_norms:
        norm.register_forward_hook(lambda _m, _args, out: GatherSequenceForReplicated.apply(out, group))
    return changed
