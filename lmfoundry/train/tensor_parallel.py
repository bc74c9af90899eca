"""Tensor parallelism for the transformer, applied from outside the model file by DeepSpeed's
AutoTP: the rules that say which of model/transformer.py's linear layers split how.

Megatron's layout (Shoeybi et al. 2019), as torchtitan's and DeepSpeed's also are: in each block
the query and fused key/value projections and the fused gate/up projection split by output
columns (whole heads, whole MLP columns per rank), the attention output and down projections by
input rows, so a block costs one all-reduce forward and one backward for each of attention and
the MLP (AutoTP's layers each all-reduce their input's gradient; `reduce_column_inputs_once`
makes the query and key/value projections share one, as Megatron's fused layer does). The
norms stay whole on every rank, and so do the embedding and the output head unless
`vocab_parallel` splits them by vocabulary rows (`split_embedding_by_vocabulary` for an untied
embedding, which AutoTP leaves whole). The fused projections are
split as two halves (keys|values, gate|up), so each rank keeps its slice of both. Per-head
query/key norms (Qwen3) stay whole, but each rank sees only its heads, so their gradients are
summed over the tensor-parallel group.

DeepSpeed was chosen over DTensor because the training loop already runs on DeepSpeed's engine:
AutoTP composes with its ZeRO stages (lmfoundry runs 0-2: its checkpoint writer gathers either
tensor-parallel shards or ZeRO-3 partitions), checkpoints each rank's shard with its optimizer
partition, and its universal checkpoint merges the shards into a layout-free form that resumes
at any other layout (train/checkpointing.py).
"""

from __future__ import annotations

import contextlib
import re

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


def autotp_splits(name: str, vocab_parallel: bool) -> bool:
    """Whether AutoTP, set up by `deepspeed_section`, splits the model's parameter called `name`
    (as the model, not a pipeline stage, names it): the weights LAYER_SPECS split by columns or
    rows and the biases of the column-split ones (a row-split layer keeps its bias whole), and
    with `vocab_parallel` the head (and the embedding tied to it)."""
    if vocab_parallel and name in ("lm_head.weight", "embed.weight"):
        return True
    kinds = {_COLUMN, _ROW}
    if name.endswith(".bias"):
        name, kinds = name.removesuffix(".bias") + ".weight", {_COLUMN}
    specs = [spec for spec in LAYER_SPECS if spec["partition_type"] in kinds]
    return any(re.match(pattern, name) for spec in specs for pattern in spec["patterns"])


def sequence_parallel_norms(n_layer: int, pipelined: bool, moe: bool = False) -> list[str]:
    """Patterns of the names of the replicated weights a sequence-parallel model applies to a
    slice of the sequence (every block's two norms and the final one; with `moe`, each MoE
    layer's router and shared experts, which route and run the rank's own tokens), in the model
    or in its pipeline module (train/pipeline_parallel.py numbers the blocks from 1, the final
    norm n_layer + 1, and the untied head, which must not match, n_layer + 2). Their gradients
    are summed over the group. An MoE layer's routed experts are split over the group instead."""
    routers = [r".*\.mlp\.(router|shared_gate_up|shared_down)\.weight$"] if moe else []
    if pipelined:
        return [r"^\d+\.block\.(attn|mlp)_norm\.weight$", rf"^{n_layer + 1}\.module\.weight$", *routers]
    return [r"^blocks\.\d+\.(attn|mlp)_norm\.weight$", r"^norm\.weight$", *routers]


class SumForward(torch.autograd.Function):
    """The sum over `group` forward; backward, this rank's gradient as it is. For a quantity
    every rank computes from the group's sum and backpropagates: each rank's backward then
    gives its own inputs' part of one gradient (the parameters' sum over the group, as for the
    norms, makes it whole), not the group's size times it."""

    @staticmethod
    def forward(ctx, x, group):
        import torch.distributed as dist

        x = x.clone()
        dist.all_reduce(x, group=group)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def balance_over(group):
    """An MoE layer's `balance_over` under sequence parallelism: the balance loss's assignment
    counts, score sums (differentiably) and tokens summed over the ranks of `group`, so every
    rank's loss is the whole batch's, as the single-device model's."""
    import functools

    return functools.partial(_balance_over, group=group)


def _balance_over(counts: torch.Tensor, score_sums: torch.Tensor, tokens: torch.Tensor, group):
    # one all-reduce a layer: the counts and tokens travel with the score sums, in fp32 (bf16
    # counts past 256 would round), and only the score sums' part carries a gradient back
    experts = score_sums.numel()
    totals = SumForward.apply(torch.cat([score_sums.float(), counts.float(), tokens.float().reshape(1)]), group)
    return totals[experts:-1], totals[:experts].to(score_sums.dtype), totals[-1]


def tensor_parallel_size(engine) -> int:
    return max(engine.autotp_size(), 1)


def splits_vocabulary(engine) -> bool:
    """Whether the engine's output head is split by vocabulary rows: by AutoTP, or in a pipeline
    by lmfoundry, on every stage alike (train/pipeline_parallel.py: a stage may hold no head)."""
    from deepspeed.module_inject.layers import VocabParallelLinear

    if hasattr(engine.module, "forward_funcs"):
        return engine.module.splits_vocabulary
    return any(isinstance(m, VocabParallelLinear) for m in engine.module.modules())


def splits_embedding_vocabulary(engine) -> bool:
    """Whether the engine's embedding is split by vocabulary rows (tied to a vocabulary-parallel
    head by AutoTP, or untied by `split_embedding_by_vocabulary`; in a pipeline, with the head)."""
    from deepspeed.module_inject.layers import VocabParallelEmbedding

    if hasattr(engine.module, "forward_funcs"):
        return engine.module.splits_vocabulary
    return any(isinstance(m, VocabParallelEmbedding) for m in engine.module.modules())


def split_embedding_by_vocabulary(model: torch.nn.Module, tp: int) -> None:
    """Splits an untied embedding by vocabulary rows over the tensor-parallel groups of `tp`
    ranks (Megatron's VocabParallelEmbedding): each rank keeps 1/T of the rows, looks up the
    tokens of its rows and zeros the others, and the group sums the lookups. AutoTP splits a tied
    embedding with the vocabulary-parallel head that shares its weight (nothing to do here), but
    an untied one only along the hidden dimension (or not at all with lmfoundry's layer specs).
    So it is split here, with DeepSpeed's own layer, before `deepspeed.initialize` builds the
    optimizer over the parameters: the groups are made first (the engine finds them made and
    keeps them), the layer is marked replaced so that AutoTP leaves it, and it carries the
    universal checkpoint's description of its split (rows, dim 0) like AutoTP's layers."""
    import deepspeed
    from deepspeed.utils import groups

    embedding = model.embed
    if model.lm_head.weight is embedding.weight:
        return
    if not isinstance(embedding, torch.nn.Embedding):
        raise RuntimeError(
            f"the embedding must be a torch.nn.Embedding to split by vocabulary; it is {type(embedding)}"
        )
    deepspeed.init_distributed()
    groups._init_tp_mesh_device(tensor_model_parallel_size=tp)
    model.embed = vocab_parallel_embedding(embedding, groups.get_tensor_model_parallel_group())


def vocab_parallel_embedding(embedding: torch.nn.Embedding, group) -> torch.nn.Module:
    """`embedding` as this rank's rows of it, looked up over `group` (DeepSpeed's
    VocabParallelEmbedding), marked replaced so that AutoTP leaves it; a meta weight is cut
    when `meta_init` gives it its value."""
    from deepspeed.module_inject.layers import VocabParallelEmbedding, set_autotp_mode

    set_autotp_mode(training=True)  # as `deepspeed.initialize` sets it: else the layer freezes its weight
    split = VocabParallelEmbedding(embedding, group, name="embed")
    split.replaced = True
    return split


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
# the sequence, and the column-parallel layers that read one norm's output (attention's query and
# key/value projections; the MLP's gate/up) all-gather it once before their products. Forward
# moves the bytes tensor parallelism alone does (an all-reduce is a reduce-scatter and an
# all-gather); backward gathers each norm's output again rather than holding it: 1.25 times the
# bytes of tensor parallelism alone (four all-reduces a block). The norms' weights see 1/T of the
# tokens, so their gradients are summed over the group. The model has no dropout; with it, the
# dropout regions would be the split ones too.
SEQUENCE_DIM = 1  # activations are (batch, sequence, features)


def _gather_sequence(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    shards = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = shards.new_empty((world * shards.shape[0], *shards.shape[1:]))
    # torch 2.13 renamed all_gather_into_tensor (deprecated there) to all_gather_single
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, shards, group=group)
    return out.movedim(0, SEQUENCE_DIM).contiguous()  # one copy here, not one in each product


def _check_splits(length: int, world: int) -> None:
    if length % world:
        raise ValueError(
            f"sequence parallelism splits each sequence over the {world} ranks of a tensor-parallel group: "
            f"a sequence of {length} tokens does not split evenly (use a multiple of {world})"
        )


def _reduce_scatter_sequence(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world = dist.get_world_size(group)
    _check_splits(x.shape[SEQUENCE_DIM], world)  # the first split, for a vocabulary-parallel embedding
    whole = x.movedim(SEQUENCE_DIM, 0).contiguous()
    out = whole.new_empty((whole.shape[0] // world, *whole.shape[1:]))
    dist.reduce_scatter_tensor(out, whole, group=group)
    return out.movedim(0, SEQUENCE_DIM)


def _own_slice(x: torch.Tensor, group) -> torch.Tensor:
    import torch.distributed as dist

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    _check_splits(x.shape[SEQUENCE_DIM], world)  # the first split, for a whole embedding
    return x.chunk(world, dim=SEQUENCE_DIM)[rank].contiguous()


class IntoSequenceSlices(torch.autograd.Function):
    """Into the sequence-parallel region, each rank keeping its slice of the sequence: of a whole
    activation that every rank holds (`summed` false: a whole embedding's output), or of the sum
    of the ranks' partial activations (`summed` true, a reduce-scatter: a row-parallel product's,
    or a vocabulary-parallel embedding's lookups).
    Backward gathers the slices' gradients into the whole's."""

    @staticmethod
    def forward(ctx, x, group, summed: bool):
        ctx.group = group
        return _reduce_scatter_sequence(x, group) if summed else _own_slice(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather_sequence(grad, ctx.group), None, None


def _into_sequence_slices(_module, _args, out: torch.Tensor, group, summed: bool) -> torch.Tensor:
    # the residual stream starts here: contiguous, so that the sums along it are too (a
    # pipeline stage sends its output as it is, and a send takes contiguous tensors only)
    return IntoSequenceSlices.apply(out, group, summed).contiguous()


class OutOfSequenceSlices(torch.autograd.Function):
    """Out of the sequence-parallel region, the whole sequence gathered from the ranks' slices:
    into a replicated computation (`partial` false: a whole head and the loss, the same on every
    rank, so every rank back-propagates the same gradient of the whole and backward keeps its
    own slice), or into a column-parallel layer that reads the whole sequence alone (`partial`
    true: a vocabulary-parallel head, each rank giving a partial gradient of the whole, summed
    over the group and scattered in one reduce-scatter, where the head's own all-reduce and
    then a slice would move twice the bytes; Megatron's gather with `tensor_parallel_output_grad`)."""

    @staticmethod
    def forward(ctx, x, group, partial: bool):
        ctx.group, ctx.partial = group, partial
        return _gather_sequence(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_reduce_scatter_sequence(grad, ctx.group) if ctx.partial else _own_slice(grad, ctx.group)), None, None


class GatheredColumnLinears(torch.autograd.Function):
    """The column-parallel products of the layers that read one input (`weights`, `biases`, in
    pairs) of the whole sequence, from a rank's slice of it gathered once. Only the slice is kept
    for backward (as Megatron does): the whole is gathered again in backward instead of being
    held, which is where sequence parallelism saves the memory of the norms' outputs. Backward
    sums the layers' gradients of the whole and reduce-scatters them once: each rank's products
    give a partial gradient of the whole sequence."""

    @staticmethod
    def forward(ctx, x, group, *params):
        ctx.group, ctx.has_bias = group, [b is not None for b in params[1::2]]
        weights = params[0::2]
        ctx.save_for_backward(x, *weights)
        whole = _gather_sequence(x, group)
        return tuple(torch.nn.functional.linear(whole, w, b) for w, b in zip(weights, params[1::2]))

    @staticmethod
    def backward(ctx, *grads):
        x, *weights = ctx.saved_tensors
        whole = _gather_sequence(x, ctx.group).reshape(-1, x.shape[-1])
        grad_whole, grad_params = None, []
        for grad, weight, has_bias in zip(grads, weights, ctx.has_bias):
            part = grad @ weight
            grad_whole = part if grad_whole is None else grad_whole + part
            flat = grad.reshape(-1, grad.shape[-1])
            grad_params += [flat.T @ whole, flat.sum(0) if has_bias else None]
        return _reduce_scatter_sequence(grad_whole, ctx.group), None, *grad_params


def _gather_for_columns(parent: torch.nn.Module, args: tuple, columns: tuple, group) -> None:
    """A forward pre-hook on the module whose column-parallel layers `columns` read its input:
    their products, computed together from one gather, left for each layer's forward."""
    x = args[0]
    layers = [getattr(parent, name) for name in columns]
    params = [p for layer in layers for p in (layer.weight, layer.bias)]
    for layer, out in zip(layers, GatheredColumnLinears.apply(x, group, *params)):
        layer.sequence_parallel_output = (x, out)


def _column_forward(layer, x: torch.Tensor) -> torch.Tensor:
    """The product its parent's pre-hook computed for this input (once: a second call, or another
    input, finds none and fails loudly rather than compute it without the gather)."""
    held, layer.sequence_parallel_output = getattr(layer, "sequence_parallel_output", None), None
    if held is None or held[0] is not x:
        raise RuntimeError("a sequence-parallel column layer runs only on its parent module's input")
    return held[1]


def _row_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return IntoSequenceSlices.apply(torch.nn.functional.linear(x, layer.weight), layer.mp_group, True)


def _split_layers():
    """Per module type: the column-parallel layers that read its input, and its row-parallel layer."""
    from lmfoundry.model.transformer import Attention, SwiGLU

    return {Attention: (("wq", "wkv"), "wo"), SwiGLU: (("w_gate_up",), "w_down")}


def _replace_forward(name: str, layer, forward, group) -> None:
    """The instance's forward, not the class's: AutoTP's layers reduce in forward or backward over
    the whole activation, which the collectives placed here over `group` replace. Once per
    layer: a second replacement would add a second set of collectives (a gradient summed twice)."""
    import types

    from deepspeed.module_inject.layers import TensorParallel_Layer

    if not isinstance(layer, TensorParallel_Layer):
        raise RuntimeError(f"{name} must be split by tensor parallelism; it is {type(layer)}")
    if "forward" in vars(layer):
        raise RuntimeError(f"{name}'s tensor-parallel collectives were already replaced")
    if layer.mp_group is not group:
        raise RuntimeError(f"{name} is split over another group than the one its collectives would use")
    if getattr(layer, "bias", None) is not None and forward is _row_forward:
        # a replicated bias after the reduce-scatter would see 1/T of the tokens, unsummed
        raise RuntimeError(f"sequence parallelism runs row-parallel layers without a bias; {name} has one")
    layer.forward = types.MethodType(forward, layer)


class IntoTensorParallel(torch.autograd.Function):
    """Into the tensor-parallel region (Megatron's f): the input as it is forward; backward, the
    sum over the group of the ranks' partial gradients of it. Placed once before the
    column-parallel layers that read one input, it all-reduces their summed gradient once, where
    AutoTP's layers each all-reduce their own. DeepSpeed's ColumnParallel is the same function
    but all-reduces a contiguous copy of a gradient that is not contiguous and returns the
    original, unreduced."""

    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        import torch.distributed as dist

        grad = grad.contiguous()
        dist.all_reduce(grad, group=ctx.group)
        return grad, None


def _into_tensor_parallel(parent: torch.nn.Module, args: tuple, group) -> tuple:
    return (IntoTensorParallel.apply(args[0], group), *args[1:])


def _local_column_forward(layer, x: torch.Tensor) -> torch.Tensor:
    return torch.nn.functional.linear(x, layer.weight, layer.bias)


def _local_lookup_forward(layer, ids: torch.Tensor) -> torch.Tensor:
    """A vocabulary-parallel embedding's partial lookup, unsummed: this rank's rows, zeros for
    the tokens of the other ranks' rows (the sum over the group is the whole lookup)."""
    outside = (ids < layer.vocab_start_index) | (ids >= layer.vocab_end_index)
    local = (ids - layer.vocab_start_index).masked_fill(outside, 0)
    out = torch.nn.functional.embedding(local, layer.weight, padding_idx=layer.padding_idx)
    out = out.masked_fill(outside.unsqueeze(-1), 0.0)
    return out if layer.embed_scale is None else out * layer.embed_scale.to(out.dtype)


def reduce_column_inputs_once(module: torch.nn.Module, group) -> None:
    """Makes `module`, whose blocks AutoTP has split over `group`, all-reduce in backward once per
    input of column-parallel layers (the attention's, read by the query and key/value
    projections; the MLP's) rather than once per layer: a block costs four all-reduces, two
    forward and two backward, as Megatron's fused query/key/value layer does (AutoTP alone: five)."""
    import functools

    split_layers = _split_layers()
    for name, parent in module.named_modules():
        if type(parent) not in split_layers:
            continue
        for column in split_layers[type(parent)][0]:
            _replace_forward(f"{name}.{column}", getattr(parent, column), _local_column_forward, group)
        parent.register_forward_pre_hook(functools.partial(_into_tensor_parallel, group=group))


def apply_sequence_parallelism(
    module: torch.nn.Module,
    embeddings: list,
    final_norms: list,
    group,
    vocab_parallel_head=None,
    split_head: bool = False,
) -> None:
    """Makes `module`, whose blocks AutoTP has split over `group`, sequence-parallel: each
    attention and MLP gathers its input's sequence once for its column-parallel layers, the
    row-parallel layers reduce-scatter it after their products (their own collectives
    replaced), each embedding lookup in `embeddings` keeps its rank's slice (a
    vocabulary-parallel one reduce-scatters its partial lookups into the slices, where its own
    all-reduce and then a slice would move twice the bytes, as Megatron's does) and each norm in
    `final_norms` (the one before the output head) gathers the whole sequence back: for a
    replicated head, or for a vocabulary-parallel one (`split_head`; then the gather's backward
    reduce-scatters the head's partial input gradients, and the all-reduce of
    `vocab_parallel_head`, its layer if it is one, is gone)."""
    import functools

    from deepspeed.module_inject.layers import VocabParallelEmbedding

    split_layers = _split_layers()
    for name, parent in module.named_modules():
        if type(parent) not in split_layers:
            continue
        columns, row = split_layers[type(parent)]
        for column in columns:
            _replace_forward(f"{name}.{column}", getattr(parent, column), _column_forward, group)
        parent.register_forward_pre_hook(functools.partial(_gather_for_columns, columns=columns, group=group))
        _replace_forward(f"{name}.{row}", getattr(parent, row), _row_forward, group)
    for embedding in embeddings:
        summed = isinstance(embedding, VocabParallelEmbedding)
        if summed:
            _replace_forward("the vocabulary-parallel embedding", embedding, _local_lookup_forward, group)
        embedding.register_forward_hook(functools.partial(_into_sequence_slices, group=group, summed=summed))
    partial = split_head or vocab_parallel_head is not None
    if vocab_parallel_head is not None:
        _replace_forward("the vocabulary-parallel head", vocab_parallel_head, _local_column_forward, group)
    for norm in final_norms:
        norm.register_forward_hook(lambda _m, _args, out: OutOfSequenceSlices.apply(out, group, partial))
