"""Pipeline parallelism for the transformer, applied from outside the model file: the model's own
modules cut into DeepSpeed pipeline layers (the embedding, each block, the final norm, the output
head), the blocks spread evenly over `pipeline_parallel_size` stages, and DeepSpeed's pipeline
engine running them on its 1F1B schedule (Narayanan et al. 2021, PipeDream-Flush): after a
warm-up of forwards, each stage alternates one forward and one backward, so stage s of p holds at
most p - s micro-batches' activations, and the gradients of a step's micro-batches are
accumulated before the one optimizer step.

A tied output head is the embedding's weight on the last stage: DeepSpeed keeps a copy on the
first and the last stage, in step (broadcast at the start, gradients summed across the two).

With `vocab_parallel` under tensor parallelism, the embedding and the head are split by
vocabulary rows over each stage's tensor-parallel group, as Megatron's are: each rank looks up
the tokens of its rows (the group sums the lookups), computes the logits of its rows only, and
the loss is a cross-entropy distributed over the group (the maximum, the sum of exponentials
and the target's logit each reduced). AutoTP splits only a linear layer named as a head, which a
pipeline's head is not (a tied head is the embedding's weight), so lmfoundry splits both with
DeepSpeed's own layers when the stage is placed: the same shards and checkpoint files as AutoTP's,
each split parameter carrying the description a universal checkpoint merges its rows by. A tied
table is split on the first and the last stage alike,
and DeepSpeed keeps each rank's rows in step with its peer's on the other stage.

With tensor parallelism as well (Megatron's 3D layout, as Megatron-DeepSpeed composes it), the
ranks are laid out stage, then data-parallel replica, then tensor-parallel rank, and AutoTP
(train/tensor_parallel.py) splits each stage's blocks over the stage's consecutive ranks: the
pipeline grid's groups are handed to AutoTP before the engine is built, and the engine is
given the grid back afterwards (`share_groups_with_tensor_parallelism`,
`finish_tensor_parallel_pipeline`). Between stages each rank of a group sends a 1/T part of the
activations (DeepSpeed's partitioned pipeline transfers), and the next stage's group gathers
them; with virtual stages each sends its whole activations (its own slice under sequence
parallelism).

With `virtual_stages` v > 1 each rank holds v chunks of the blocks instead of one run of them
(chunk c of stage s is virtual stage c * stages + s of the model's layers cut stages * v ways),
built into the one stage module, whose forward runs the chunk the engine names; its layers keep
their names and checkpoint files by their index in the model, so a checkpoint's layer files are
the same at any v. DeepSpeed's engine runs one stage a rank on 1F1B, so the interleaved schedule
is lmfoundry's (train/interleaved_pipeline.py, train/pipeline_schedule.py).

DeepSpeed's pipeline engine rather than torch.distributed.pipelining, because the loop already
runs on DeepSpeed's engine: its ZeRO-1 partitions the optimizer within each stage's data-parallel
group and its checkpoints hold each layer's file.
"""

from __future__ import annotations

import functools
import glob
import os

import torch
import torch.nn as nn
import torch.nn.functional as F

from lmfoundry.model.checkpoint import TIED_HEAD
from lmfoundry.model.moe import MoE
from lmfoundry.model.tensor_files import write_safetensors
from lmfoundry.model.transformer import RMSNorm, Transformer, build_on_meta, persistent_buffers, rope_tables
from lmfoundry.train import meta_init
from lmfoundry.train.tensor_parallel import IntoTensorParallel, autotp_splits, vocab_parallel_embedding


class Embedding(nn.Module):
    """The first stage's embedding (and, tied, the last stage's copy of it for the head), built
    on each stage that holds it from the model's weight. Its weight is named `embed.weight`, as
    in the model, so that the optimizer's groups exempt it from weight decay there too."""

    def __init__(self, weight: torch.Tensor):
        super().__init__()
        self.embed = nn.Embedding.from_pretrained(weight.detach().clone(), freeze=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.embed(idx)

    def split_by_vocabulary(self, group) -> None:
        """This rank's rows of the table, looked up over `group`."""
        self.embed = vocab_parallel_embedding(self.embed, group)
        # under sequence parallelism the final norm's gather sums the head's partial input
        # gradients over the group (tensor_parallel.OutOfSequenceSlices): the head must not
        self.head_input_summed = False


def tied_head(embedding: Embedding, x: torch.Tensor) -> torch.Tensor:
    """The logits of the tied table's rows: all of them, or this rank's under `vocab_parallel`,
    where each rank's input gradient is a part of the whole and the group sums them."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    table = embedding.embed
    if isinstance(table, TensorParallel_Layer) and not embedding.head_input_summed:
        x = IntoTensorParallel.apply(x, table.mp_group)
    return F.linear(x, table.weight)


class RouterLossGradient(torch.autograd.Function):
    """The activations unchanged forward; backward, their gradient and the gradient of an MoE
    layer's load-balancing loss, `scale` times d(loss)/d(loss) (Megatron's MoEAuxLossAutoScaler):
    the loss of a layer on an early stage gets its gradient when backward reaches the layer,
    instead of travelling to the last stage's loss and back."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, router_loss: torch.Tensor, scale: float) -> torch.Tensor:
        ctx.save_for_backward(router_loss)
        ctx.scale = scale
        return x

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        (router_loss,) = ctx.saved_tensors
        return grad, torch.full_like(router_loss, ctx.scale), None


class BlockLayer(nn.Module):
    """One block, positions 0..T-1 (pretraining's rows hold one stream each); with the model's
    activation checkpointing, recomputed in backward as the model recomputes it.

    A block with an MoE layer adds the layer's load-balancing loss to the step's objective as
    the single-device model adds it to its loss: its gradient joins the block's in backward
    (RouterLossGradient), divided by the step's micro-batches as DeepSpeed divides the loss
    (`router_loss_scale`, set when the engine is built), and its value is kept for the step's
    reported loss (`router_loss_sum`, over the step's forwards)."""

    def __init__(self, model: Transformer, index: int):
        super().__init__()
        self.block = model.blocks[index]
        self.index = index  # in the model's blocks
        self.recompute = model.cfg.activation_checkpointing
        self.sequence_shards = 1  # under sequence parallelism x holds 1/shards of each sequence
        self.register_buffer("cos", model.rope_cos, persistent=False)
        self.register_buffer("sin", model.rope_sin, persistent=False)
        self.router_loss_scale = 1.0
        self.router_loss_sum = torch.zeros((), dtype=torch.float64)

    @property
    def moe(self) -> MoE | None:
        return self.block.mlp if isinstance(self.block.mlp, MoE) else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        T = x.shape[1] * self.sequence_shards  # the attention sees the whole sequence
        cos, sin = self.cos[None, :T], self.sin[None, :T]
        if self.recompute and self.training:
            out = torch.utils.checkpoint.checkpoint(self.block, x, cos, sin, use_reentrant=False)
        else:
            out = self.block(x, cos, sin)
        if self.moe is not None and self.training and self.moe.cfg.balance == "aux_loss":
            # read here, after the forward: a recomputation in backward sets the layer's loss again
            router_loss = self.moe.aux_loss
            # kept where the loss is: no device-to-host copy a forward
            self.router_loss_sum = self.router_loss_sum.to(router_loss.device) + router_loss.detach().double()
            if router_loss.requires_grad and torch.is_grad_enabled():
                out = RouterLossGradient.apply(out, router_loss, self.router_loss_scale)
        return out


class Wrapped(nn.Module):
    """A module of the model (the final norm, an untied head) as a pipeline layer."""

    def __init__(self, module: nn.Module):
        super().__init__()
        self.module = module

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.module(x)


def split_head_by_vocabulary(layer: Wrapped, group) -> None:
    """An untied head as this rank's rows of it over `group` (DeepSpeed's column-parallel layer,
    which keeps its rank's logits and sums its input's gradient over the group)."""
    from deepspeed.module_inject.layers import LinearLayer, set_autotp_mode

    set_autotp_mode(training=True)
    split = LinearLayer(layer.module, group, gather_output=False, name="lm_head")
    split.replaced = True
    layer.module = split


def next_token_loss(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().view(-1, logits.size(-1)), targets.reshape(-1))


def vocab_parallel_next_token_loss(
    logits: torch.Tensor, targets: torch.Tensor, group, start: int, end: int, vocab_size: int
) -> torch.Tensor:
    """The mean next-token cross-entropy of logits split by vocabulary over `group`, this rank's
    rows [start, end) of `vocab_size` (DeepSpeed's distributed cross-entropy, the one AutoTP gives
    a vocabulary-parallel head)."""
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy

    return vocab_parallel_cross_entropy(
        logits.float(),
        targets,
        tp_group=group,
        vocab_start_index=start,
        vocab_end_index=end,
        global_vocab_size=vocab_size,
    )


def pipeline_module(
    model: Transformer,
    stages: int,
    tensor_parallel: int = 1,
    values: dict | None = None,
    vocab_parallel: bool = False,
    virtual_stages: int = 1,
):
    """`model` (the same on every rank) as a DeepSpeed PipelineModule over `stages` stages, each
    stage's layers split over `tensor_parallel` consecutive ranks (with `vocab_parallel`, the
    embedding and the head by vocabulary rows too, when each stage is placed). Every layer knows the prefix
    of its tensors' names in the model's state (`state_prefixes`), so the servable weights are
    written under the single-device model's names. A model built on the meta device comes with
    its initial `values` (Transformer.initial_values): each rank materialises its own stage's
    layers only (train/meta_init.py), before DeepSpeed places them on its device."""
    import torch.distributed as dist
    from deepspeed.pipe import LayerSpec, PipelineModule, TiedLayerSpec
    from deepspeed.runtime.pipe.topology import PipeModelDataParallelTopology

    buffers = model.initial_buffers() if values is not None else {}
    if model.cfg.n_layer < stages * virtual_stages:
        raise ValueError(
            f"{stages} pipeline stages x {virtual_stages} virtual stages need at least one block each; "
            f"the model has {model.cfg.n_layer}"
        )

    class TransformerPipe(PipelineModule):
        cfg = model.cfg
        splits_vocabulary = False
        state_prefixes = ["embed.", *(f"blocks.{i}." for i in range(model.cfg.n_layer)), "norm.", "lm_head."]
        # each parameter's (and buffer's) name in the stage -> its name in the model
        names_in_model = {pipe: name for name, pipe in pipeline_parameter_names(model.cfg).items()}

        def moe_blocks(self) -> list[BlockLayer]:
            """This rank's blocks with an MoE layer, in the model's order."""
            return [layer for layer in self.forward_funcs if isinstance(layer, BlockLayer) and layer.moe is not None]

        def moe_layers(self) -> list[MoE]:
            return [layer.moe for layer in self.moe_blocks()]

        def moe_layer_positions(self) -> list[int]:
            """Where each of this rank's MoE layers stands among the whole model's MoE layers."""
            # the model's MoE layers are its blocks past the dense ones
            return [b.index - self.cfg.moe.first_dense_layers for b in self.moe_blocks()]

        def _partition_layers(self, method: str = "uniform") -> None:
            # DeepSpeed's split of the layers, over stages x virtual stages: `parts` bounds the
            # virtual stages, of which this rank holds chunk c's, virtual stage c * stages + stage
            pipe = self.num_stages
            self.num_stages = pipe * virtual_stages
            try:
                super()._partition_layers(method)
            finally:
                self.num_stages = pipe

        def _build(self) -> None:
            """This rank's layers, chunk by chunk (each chunk one virtual stage's contiguous
            layers); `chunk_layers` bounds each chunk's in `forward_funcs`, and `layer_indices`
            gives each local layer's index in the whole model, which names its parameters and
            its checkpoint file as in a pipeline without virtual stages."""
            stage, self.chunk_layers, self.layer_indices = self.stage_id, [], []
            for chunk in range(virtual_stages):
                start, stop = (
                    self.parts[chunk * self.num_stages + stage],
                    self.parts[chunk * self.num_stages + stage + 1],
                )
                self._set_bounds(start, stop)
                first = len(self.forward_funcs)
                super()._build()
                self.chunk_layers.append((first, len(self.forward_funcs)))
                self.layer_indices += range(start, stop)
            self._set_bounds(self.layer_indices[0], self.layer_indices[-1] + 1)  # DeepSpeed logs the span
            self.chunk = 0

        def forward(self, x):
            if virtual_stages == 1:
                return super().forward(x)
            start, stop = self.chunk_layers[self.chunk]  # the chunk the interleaved engine runs
            for layer in self.forward_funcs[start:stop]:
                x = layer(x)
            return x

        def sequence_shards(self) -> int:
            """How many slices each sequence's activations are cut into between the blocks."""
            return next(layer.sequence_shards for layer in self.forward_funcs if isinstance(layer, BlockLayer))

        def stage_owner(self, layer_idx: int) -> int:
            for virtual in range(len(self.parts) - 1):
                if self.parts[virtual] <= layer_idx < self.parts[virtual + 1]:
                    return virtual % self.num_stages
            raise RuntimeError(f"layer {layer_idx} is in no stage: the stages' bounds are {self.parts}")

        def ckpt_layer_path(self, ckpt_dir, local_layer_idx: int) -> str:
            # DeepSpeed's file name, by the layer's index in the whole model (not the span's)
            path = os.path.join(ckpt_dir, f"layer_{self.layer_indices[local_layer_idx]:02d}")
            rank = self._grid._topo.get_rank_repr(rank=self.global_rank)
            return path + (f"-{rank}" if rank else "") + "-model_states.pt"

        def ckpt_layer_path_list(self, ckpt_dir, local_layer_idx: int) -> list[str]:
            index = self.layer_indices[local_layer_idx]
            return sorted(glob.glob(os.path.join(ckpt_dir, f"layer_{index:02d}-") + "*model_states.pt"))

        def split_vocabulary(self) -> None:
            """The stage's embedding (the first stage's, and a tied head's table on the last) and
            untied head split by vocabulary rows over its tensor-parallel group, and its loss
            distributed over them."""
            group = self._grid.get_slice_parallel_group()
            tables = {id(m): m for m in [*self.forward_funcs, *self.tied_modules.values()] if isinstance(m, Embedding)}
            for table in tables.values():
                table.split_by_vocabulary(group)
            heads = [m for m in self.forward_funcs if isinstance(m, Wrapped) and isinstance(m.module, nn.Linear)]
            for head in heads:
                split_head_by_vocabulary(head, group)
            rows = [t.embed for t in tables.values()] + [h.module for h in heads]
            if rows:  # every split cuts the vocabulary the same way
                start = sum(rows[0]._partition_sizes[: rows[0].tp_index])
                end = start + rows[0]._partition_sizes[rows[0].tp_index]
                self.loss_fn = functools.partial(
                    vocab_parallel_next_token_loss, group=group, start=start, end=end, vocab_size=self.cfg.vocab_size
                )

        def to(self, *args, **kwargs):
            # DeepSpeed places the stage right after building its layers: the first moment a
            # stage built from a meta model can get its values. What AutoTP will split stays on
            # the meta device (train/meta_init.py gives it its values inside `initialize`) and
            # is left where it is; the rest moves.
            if vocab_parallel and not self.splits_vocabulary:
                self.splits_vocabulary = True  # on every stage: what a checkpoint records of the run
                self.split_vocabulary()
            blocks = [layer for layer in self.forward_funcs if isinstance(layer, BlockLayer)]
            if values is not None and any(layer.cos.is_meta for layer in blocks):
                cfg = self.cfg
                cos, sin = rope_tables(cfg.head_dim, cfg.max_seq_len, cfg.rope_theta, cfg.rope_scaling)
                for layer in blocks:
                    layer.cos, layer.sin = cos, sin
            for layer in blocks:  # an MoE layer's routing bias: the start checkpoint's, or zeros
                if layer.moe is not None and layer.moe.expert_bias.is_meta:
                    layer.moe.expert_bias = buffers[f"blocks.{layer.index}.mlp.expert_bias"]()
            if values is not None and meta_init.has_meta_parameters(self):
                split = (lambda name: autotp_splits(name, vocab_parallel=False)) if tensor_parallel > 1 else None
                meta_init.materialize(self, values, leave=split, model_name=self.names_in_model.__getitem__)
            if not meta_init.has_meta_parameters(self):
                return super().to(*args, **kwargs)
            device, dtype, non_blocking, _ = torch._C._nn._parse_to(*args, **kwargs)
            if dtype is not None and not (dtype.is_floating_point or dtype.is_complex):
                raise TypeError(
                    f"nn.Module.to only accepts floating point or complex dtypes, but got desired dtype={dtype}"
                )

            def move(t: torch.Tensor) -> torch.Tensor:
                cast = dtype if t.is_floating_point() or t.is_complex() else None
                if t.is_meta:  # cast, not moved: materialised later, in that dtype
                    return t.to(dtype=cast) if cast is not None else t
                return t.to(device, cast, non_blocking)

            return self._apply(move)

    TransformerPipe.virtual_stages = virtual_stages  # each rank's chunks (train/pipeline_schedule.py)
    tied = model.cfg.tie_embeddings
    weight = model.embed.weight
    if tied:
        first = TiedLayerSpec("embed", Embedding, weight, tied_weight_attr="embed.weight")
        head = TiedLayerSpec("embed", Embedding, weight, forward_fn=tied_head, tied_weight_attr="embed.weight")
    else:
        first, head = LayerSpec(Embedding, weight), LayerSpec(Wrapped, model.lm_head)
    blocks = [LayerSpec(BlockLayer, model, i) for i in range(model.cfg.n_layer)]
    # ranks laid out stage, then data-parallel replica, then tensor-parallel rank (innermost)
    replicas = dist.get_world_size() // (stages * tensor_parallel)
    return TransformerPipe(
        layers=[first, *blocks, LayerSpec(Wrapped, model.norm), head],
        topology=PipeModelDataParallelTopology(num_pp=stages, num_mp=tensor_parallel, num_dp=replicas),
        loss_fn=next_token_loss,
        partition_method="type:BlockLayer",  # the blocks evenly; the embedding first, the head last
    )


def prepare_sequence_parallel_stage(module, group) -> tuple[list, list, nn.Module | None]:
    """A pipeline stage made ready for sequence parallelism over `group`: its blocks told that
    they hold a slice of each sequence. Returns the stage's embedding lookups (whose output
    each rank slices: a vocabulary-parallel table's partial lookups are reduce-scattered), its
    final norm (whose output is gathered whole for the head) and its untied vocabulary-parallel
    head, if any (a tied one, the table's weight, is told that the gather sums its input's
    gradients)."""
    import torch.distributed as dist

    embeddings, norms, head = [], [], None
    for layer in module.forward_funcs:
        if isinstance(layer, BlockLayer):
            layer.sequence_shards = dist.get_world_size(group)
        elif isinstance(layer, Embedding):
            embeddings.append(layer.embed if module.splits_vocabulary else layer)
        elif isinstance(layer, Wrapped) and isinstance(layer.module, RMSNorm):
            norms.append(layer)  # the final norm (the untied head is the other wrapped layer)
        elif isinstance(layer, Wrapped) and module.splits_vocabulary:
            head = layer.module
    if module.splits_vocabulary:
        for table in module.tied_modules.values():
            table.head_input_summed = True
    return embeddings, norms, head


def share_groups_with_tensor_parallelism(grid) -> None:
    """Before the engine is built: DeepSpeed's AutoTP takes its groups from
    `deepspeed.utils.groups`, which it would otherwise lay out as data x tensor parallel over the
    whole world: its tensor-parallel groups (consecutive ranks) are the grid's, but its
    data-parallel and model-parallel groups would span the pipeline's stages. Seeded with the
    grid's groups, the engine averages gradients over the stage's replicas only and sums the
    gradient norm over the whole model (every stage and every shard)."""
    from deepspeed.utils import groups

    groups._TENSOR_MODEL_PARALLEL_GROUP = grid.get_slice_parallel_group()
    groups._DATA_PARALLEL_GROUP = grid.get_data_parallel_group()
    groups._MODEL_PARALLEL_GROUP = grid.get_model_parallel_group()


class TensorParallelGrid:
    """The pipeline grid as the engine's model-parallel unit under tensor parallelism too: AutoTP
    makes DeepSpeed's `groups` module the engine's, which has none of the pipeline's groups, and
    the grid has none of the two tensor-parallel queries the engine's first forward makes."""

    def __init__(self, grid):
        self.grid = grid

    def __getattr__(self, name: str):
        return getattr(self.grid, name)

    def get_tensor_model_parallel_group(self):
        return self.grid.get_slice_parallel_group()

    def get_tensor_model_parallel_src_rank(self) -> int:
        return self.grid.slice_group[0]  # the global rank of the group's first member


def _merged(a, b):
    """Two stages' universal-checkpoint descriptions as one: dicts united key by key, lists
    united keeping the first one's order."""
    if isinstance(a, dict) and isinstance(b, dict):
        return {k: _merged(a[k], b[k]) if k in a and k in b else a.get(k, b.get(k)) for k in {**a, **b}}
    if isinstance(a, list) and isinstance(b, list):
        return a + [x for x in b if x not in a]
    return a


def share_universal_checkpoint_info(module) -> None:
    """Collective over each pipeline: AutoTP describes how to merge the tensor-parallel shards of
    the parameters a stage holds (which split by rows, which by columns, which are whole), and
    each stage's checkpoint files carry its own description; DeepSpeed's universal conversion
    reads one file's. Every stage gets the description of the whole model."""
    import functools

    import torch.distributed as dist
    from deepspeed.checkpoint.constants import UNIVERSAL_CHECKPOINT_INFO

    grid = module._grid
    infos = [None] * grid.get_pipe_parallel_world_size()
    dist.all_gather_object(
        infos, getattr(module, UNIVERSAL_CHECKPOINT_INFO, None), group=grid.get_pipe_parallel_group()
    )
    setattr(module, UNIVERSAL_CHECKPOINT_INFO, functools.reduce(_merged, infos))


def finish_tensor_parallel_pipeline(engine) -> None:
    """After the engine of a pipeline whose stages AutoTP split (collective): the grid as its
    model-parallel unit again, its checkpoint files named by the rank in the stage x
    tensor-parallel grid, as in a pipeline alone (`groups` gives the tensor-parallel rank, and
    the stages' files would clash), and the whole model's universal-checkpoint description."""
    from deepspeed.utils import groups

    grid = engine.module._grid
    if groups.get_data_parallel_group() is not grid.get_data_parallel_group():
        # lmfoundry relies on DeepSpeed 0.19 keeping groups set before the engine is built
        raise RuntimeError(
            "DeepSpeed replaced the pipeline grid's groups while building the engine: tensor x pipeline "
            "parallelism needs the DeepSpeed release pyproject.toml names"
        )
    engine.mpu = TensorParallelGrid(grid)
    engine.mp_world_size = grid.get_model_parallel_world_size()
    engine.checkpoint_mp_rank = grid.get_model_parallel_rank()
    share_universal_checkpoint_info(engine.module)


def count_router_losses(engine) -> None:
    """After the engine of a pipeline over an MoE model: each MoE layer's load-balancing loss
    joins the step's objective as in the single-device model. Its gradient is divided by the
    step's micro-batches, as DeepSpeed divides the loss's, and the step's reported loss
    (DeepSpeed's: the last stage's next-token loss) gets the layers' losses added: summed over
    the layers of every stage, averaged over the step's micro-batches and the data-parallel
    replicas, as the data-parallel run reports them. Each step adds one all-reduce of a scalar
    over the world (every rank takes part, a stage without MoE layers with zero)."""
    import torch.distributed as dist

    module = engine.module
    blocks = module.moe_blocks()
    for block in blocks:
        block.router_loss_scale = 1.0 / engine.gradient_accumulation_steps()
    aggregate = getattr(engine, "_aggregate_total_loss", None)  # the step's loss, at the end of train_batch
    if aggregate is None:
        raise RuntimeError(
            "DeepSpeed's pipeline engine has no _aggregate_total_loss: MoE layers in a pipeline need the "
            "DeepSpeed release pyproject.toml names"
        )
    # every rank of a stage holds a copy of its layers' losses (a replica's, or under tensor
    # parallelism its group's same value): the world's sum over the ranks of a stage
    replicas = dist.get_world_size() // module.num_stages

    def with_router_losses() -> torch.Tensor:
        loss = aggregate()
        total = torch.zeros((), dtype=torch.float64, device=engine.device)
        for block in blocks:
            total += block.router_loss_sum.to(engine.device)
            block.router_loss_sum = torch.zeros_like(block.router_loss_sum)
        dist.all_reduce(total)
        return loss + (total / (replicas * engine.gradient_accumulation_steps())).to(loss.dtype)

    engine._aggregate_total_loss = with_router_losses


def pipeline_parameter_names(cfg) -> dict[str, str]:
    """Each parameter's (and persistent buffer's) name in the model (as the single-device model
    names it) -> its name in the pipeline module: the layers are numbered embedding 0, blocks
    1..n, norm n+1, head n+2, and a tied embedding is DeepSpeed's `tied_modules.embed`. A
    universal checkpoint's folders are renamed with it, to move optimizer state (and buffers)
    between pipelined and other layouts."""
    model = build_on_meta(cfg)
    # a tied head is the embedding; the persistent buffers (MoE routing biases) are renamed alike
    params = [name for name, _ in model.named_parameters()] + list(persistent_buffers(model))
    n, names = cfg.n_layer, {}
    for name in params:
        top, rest = name.split(".", 1)
        if top == "embed":
            names[name] = ("tied_modules.embed.embed." if cfg.tie_embeddings else "0.embed.") + rest
        elif top == "blocks":
            index, rest = rest.split(".", 1)
            names[name] = f"{int(index) + 1}.block.{rest}"
        else:
            names[name] = f"{n + 1 if top == 'norm' else n + 2}.module.{rest}"
    return names


def _layer_state(layer: nn.Module, prefix: str) -> dict[str, torch.Tensor]:
    """A pipeline layer's tensors under the model's names, an MoE block's experts gathered from
    its expert-parallel group (a collective of the group)."""
    from lmfoundry.train.expert_parallel import gathered_experts

    own = {Wrapped: "module.", BlockLayer: "block.", Embedding: "embed."}[type(layer)]
    state = {prefix + k.removeprefix(own): v for k, v in layer.state_dict().items()}
    if isinstance(layer, BlockLayer) and layer.moe is not None and layer.moe.ep_group is not None:
        state.update({f"{prefix}mlp.{name}": whole for name, whole in gathered_experts(layer.moe).items()})
    return state


def write_servable_weights(engine, path) -> None:
    """Collective: the servable weights under the single-device model's names, written by rank 0
    (stage 0, data-parallel rank 0, tensor-parallel rank 0) to `path` layer by layer; each layer
    that another stage holds is sent by that stage's first rank of data-parallel replica 0 while
    it is written. Under tensor parallelism a stage's layers are gathered one at a time over its
    group (a collective of the group) while they are read, and an MoE layer's experts over the
    stage's expert-parallel group (each replica of the stage takes part). Rank 0 holds one layer
    of another stage at a time. If rank 0's write fails, it still receives what the other stages send and
    takes part in its group's gathers, so none is left waiting, and then raises."""
    import contextlib

    import torch.distributed as dist

    from lmfoundry.train.tensor_parallel import gathered

    module = engine.module
    grid = module._grid
    tied, last = module.cfg.tie_embeddings, len(module.state_prefixes) - 1
    owner_of = [module.stage_owner(i) for i in range(len(module.state_prefixes))]
    whole = build_on_meta(module.cfg).state_dict()
    if tied:
        del whole[TIED_HEAD]
    dtype = next(module.parameters()).dtype
    specs = [(name, dtype, tuple(t.shape)) for name, t in whole.items()]
    # the pipeline layer each tensor belongs to (prefixes end in ".": "blocks.1." is not "blocks.10.")
    layer_of = {name: next(i for i, p in enumerate(module.state_prefixes) if name.startswith(p)) for name in whole}
    split = grid.get_slice_parallel_world_size() > 1

    def local_layers():
        """(index, tensors) of each of this rank's layers, whole while it is read."""
        for offset, layer in enumerate(module.forward_funcs):
            index = module.layer_indices[offset]  # in the model's order: a rank's chunks are ascending
            if isinstance(layer, nn.Module) and not (tied and index == last):
                with gathered(layer) if split else contextlib.nullcontext():
                    yield index, _layer_state(layer, module.state_prefixes[index])

    if dist.get_rank() == 0:
        own = local_layers()
        held: tuple[int, dict] = (-1, {})

        def tensors():
            nonlocal held
            for name, dtype_, shape in specs:
                index = layer_of[name]
                source = grid.stage_to_global(stage_id=owner_of[index], data=0, model=0)
                if source == 0:
                    while held[0] != index:
                        held = next(own)
                    yield held[1][name]
                else:
                    received = torch.empty(shape, dtype=dtype_, device=engine.device)  # NCCL receives on the GPU
                    dist.recv(received, src=source)
                    yield received

        received = tensors()
        try:
            write_safetensors(path, specs, received)
        finally:
            for _ in received:  # what the other stages still send
                pass
            for _ in own:  # the gathers its group still runs
                pass
    elif grid.data_parallel_id == 0:
        sends = grid.get_stage_id() != 0 and grid.get_slice_parallel_rank() == 0
        for index, state in local_layers():
            for name, _, _ in specs:
                if sends and layer_of[name] == index:
                    dist.send(state[name].contiguous(), dst=0)
    elif any(layer.ep_group is not None for layer in module.moe_layers()):
        for _ in local_layers():  # the gathers of the experts this replica holds
            pass
