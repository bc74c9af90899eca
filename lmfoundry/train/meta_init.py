"""A tensor-parallel model built without any rank ever holding the whole of it.

A model built whole on every rank and then split costs each rank the whole model's memory first:
280 GB of fp32 weights per worker for a 70B model, whatever its tensor-parallel size. Instead the
model is built on the meta device (shapes, no storage), and its parameters get their values one
at a time, each its whole initial value (`Transformer.initial_values`, a function of the seed
and the parameter's name only) or that value cut by the parameter's own split layer, with the
same partition code that cuts a whole build:
- before `deepspeed.initialize`, every parameter AutoTP leaves whole (norms, and the embedding and
  head unless they are split by vocabulary) and the untied embedding split by vocabulary
  (train/tensor_parallel.py splits it before the engine);
- inside it, the weights AutoTP splits (its layers keep a meta tensor on the meta device), at the
  start of `_configure_distributed_model`: after the split, before the model is placed on its
  device and before the optimizer is built over it.
A rank's peak while building is its shards plus the largest parameter whole and cut (565 MiB
against 848 MiB for a whole build of a 714 MiB model at TP 2: benchmarks/parallel_build_memory.py),
and its weights are bitwise those of the same rank's slice of a whole build
(tests/test_model_parallel.py).

torchtitan does the same with DTensor (meta-device init, then `init_weights` on the sharded
tensors under an RNG tracker that makes each shard draw its slice of the whole); AutoTP's shards
are plain tensors, so here the whole parameter is drawn and cut instead.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator

import torch

from lmfoundry.model.transformer import Transformer


def has_meta_parameters(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(
    model: Transformer, values: dict[str, Callable[[], torch.Tensor]], leave: Callable[[str], bool] | None = None
) -> None:
    """Every parameter of `model` still on the meta device given its values on the CPU (or where
    a split layer places its shards): a layer split by DeepSpeed cuts the whole value with its
    own partition; any other parameter takes it whole, unless `leave(its name)` says to leave it
    (for AutoTP to split later). `values`: the model's initial values, taken before anything
    split it. Then the buffers."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    names = {id(p): name for name, p in model.named_parameters()}  # a tied weight by its first name
    for module in model.modules():
        own = dict(module.named_parameters(recurse=False))
        if not any(p.is_meta for p in own.values()):
            continue
        if isinstance(module, TensorParallel_Layer):
            if set(own) - {"weight", "bias"}:
                raise RuntimeError(f"a split layer with parameters {sorted(own)}: only weight and bias are known")
            slots = ["weight", "bias"]
            whole = [
                torch.nn.Parameter(values[names[id(own[a])]](), requires_grad=False) if a in own else None
                for a in slots
            ]
            # the layer's partition tells its weight from its bias by identity: it is shown the
            # whole values as its own parameters while it cuts them (each tensor's data set to
            # this rank's part), then given its parameters back
            for attr, value in zip(slots, whole):
                if value is not None:
                    setattr(module, attr, value)
            try:
                module._tp_partition(whole)
            finally:
                for attr, p in own.items():
                    setattr(module, attr, p)
            for attr, part in zip(slots, whole):
                if part is not None and own[attr].is_meta:
                    _fill(own[attr], part)
        else:
            for p in own.values():
                if p.is_meta and not (leave and leave(names[id(p)])):
                    _fill(p, values[names[id(p)]]())
    model.reset_buffers("cpu")


def materialize_stage(stage: torch.nn.Module, values: dict[str, Callable[[], torch.Tensor]], model_names: dict) -> None:
    """A pipeline stage's meta parameters given their whole initial values: with a pipeline, a
    rank materialises its own stage's layers whole (1/stages of the model; AutoTP splits them
    afterwards under tensor parallelism). `model_names`: each parameter's name in the stage ->
    its name in the model."""
    for name, p in stage.named_parameters():
        if p.is_meta:
            _fill(p, values[model_names[name]]())


def _fill(meta: torch.nn.Parameter, value: torch.Tensor) -> None:
    """`meta` holds `value` from now on, the same Python object: the optimizer's parameter
    groups, the engine and the split layers all refer to it (a meta tensor's data cannot be set
    to a tensor on another device, so the two objects' contents are swapped), and it keeps the
    attributes DeepSpeed gave it (the universal checkpoint's description of its split).
    DeepSpeed's debug name map holds a weak reference to each parameter, which a swap refuses:
    it is dropped for the swap and made again."""
    from deepspeed.utils import debug

    names = debug.param_names
    name = names[meta] if meta in names else None
    if name is not None:
        names._finalizers.pop(id(meta)).detach()
        names._names.pop(id(meta))
    real = torch.nn.Parameter(value.detach(), requires_grad=meta.requires_grad)
    real.__dict__.update(meta.__dict__)
    torch.utils.swap_tensors(meta, real)
    if name is not None:
        names[meta] = name


@contextlib.contextmanager
def materialized_on_placement(values: dict[str, Callable[[], torch.Tensor]]) -> Iterator[None]:
    """Within it, a DeepSpeed engine being built materialises its model's meta parameters (see
    `materialize`) at the one moment between AutoTP's split and the model's placement on its
    device: the start of `_configure_distributed_model`, before the optimizer is built. The
    parameters AutoTP leaves whole must be materialised before `initialize` (`materialize` with
    `leave`): AutoTP hooks the gradients of some of them (the norms under sequence parallelism)
    before this point, and a hook registered on a tensor is not one a swap is known to carry."""
    from deepspeed.runtime.engine import DeepSpeedEngine

    original = DeepSpeedEngine._configure_distributed_model

    def configure(engine, model):
        materialize(model, values)
        return original(engine, model)

    DeepSpeedEngine._configure_distributed_model = configure
    try:
        yield
    finally:
        DeepSpeedEngine._configure_distributed_model = original
