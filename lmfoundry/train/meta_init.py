"""A model-parallel or ZeRO-3 model built without any rank ever holding the whole of it.

A model built whole on every rank and then split costs each rank the whole model's memory first:
280 GB of fp32 weights per worker for a 70B model, whatever its tensor-parallel size. Instead the
model is built on the meta device (shapes, no storage), and its parameters get their values one
at a time, each its whole initial value (`Transformer.initial_values`, a function of the seed
and the parameter's name only) or that value cut by the parameter's own split layer, with the
same partition code that cuts a whole build:
- before `deepspeed.initialize`, every parameter AutoTP leaves whole (norms, row-split layers'
  biases, and the embedding and head unless they are split by vocabulary) and the untied
  embedding split by vocabulary (train/tensor_parallel.py splits it before the engine); in a
  pipeline, the stage's such parameters and its tables split by vocabulary when DeepSpeed
  places the stage (train/pipeline_parallel.py), the other stages' never;
- inside it, the weights AutoTP splits (its layers keep a meta tensor on the meta device), at the
  start of `_configure_distributed_model`: after the split, before the model is placed on its
  device and before the optimizer is built over it.
Under ZeRO-3 (`partition_as_built`) each parameter gets its whole value and is at once
partitioned by DeepSpeed, one at a time, before `deepspeed.initialize`.
A rank's peak while building is its part plus the largest split parameter whole and cut (at
TP 2, 564 MiB against 786 MiB for a whole build of a 714 MiB model:
benchmarks/parallel_build_memory.py), and its weights are bitwise those of the same rank's part
of a whole build (tests/test_model_parallel.py).

torchtitan does the same with DTensor (meta-device init, then `init_weights` on the sharded
tensors under an RNG tracker that makes each shard draw its slice of the whole); AutoTP's shards
are plain tensors, so here the whole parameter is drawn and cut instead.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator

import torch


def has_meta_parameters(module: torch.nn.Module) -> bool:
    return any(p.is_meta for p in module.parameters())


def materialize(
    module: torch.nn.Module,
    values: dict[str, Callable[[], torch.Tensor]],
    leave: Callable[[str], bool] | None = None,
    model_name: Callable[[str], str] | None = None,
) -> None:
    """Every parameter of `module` still on the meta device given its values on the CPU (or where
    a split layer places its shards): a layer split by DeepSpeed cuts the whole value with its
    own partition; any other parameter takes it whole, unless `leave(its model name)` says to
    leave it (for AutoTP to split later). `values`: the model's initial values by the model's
    names, taken before anything split it; `model_name`: a parameter's name in `module` -> its
    name in the model (a pipeline stage names its parameters by layer)."""
    from deepspeed.module_inject.layers import TensorParallel_Layer

    rename = model_name or (lambda name: name)
    names = {id(p): rename(name) for name, p in module.named_parameters()}  # a tied weight by its first name
    for layer in module.modules():
        own = dict(layer.named_parameters(recurse=False))
        if not any(p.is_meta for p in own.values()):
            continue
        if isinstance(layer, TensorParallel_Layer):
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
                    setattr(layer, attr, value)
            try:
                layer._tp_partition(whole)
            finally:
                for attr, p in own.items():
                    setattr(layer, attr, p)
            for attr, part in zip(slots, whole):
                if part is not None and own[attr].is_meta:
                    _fill(own[attr], part)
        else:
            for p in own.values():
                if p.is_meta and not (leave and leave(names[id(p)])):
                    _fill(p, values[names[id(p)]]())


def partition_as_built(model: torch.nn.Module, values: dict[str, Callable[[], torch.Tensor]], ds_config: dict) -> None:
    """ZeRO-3 without the whole model on any rank: each meta parameter of `model` is given its
    whole value and partitioned over the data-parallel ranks at once, one parameter at a time,
    so a rank holds its partitions plus one whole parameter (two copies of it under bf16: the
    fp32 value and its cast). It is the conversion `deepspeed.initialize` applies to a model
    built whole (`zero.Init(module=...)`, same config; it broadcasts each value from rank 0 in
    place), fed one materialised parameter at a time; `initialize` then finds every parameter
    partitioned, as after a build inside `zero.Init`, and so neither casts nor moves the model:
    every parameter (an adapter's too) is cast to the training dtype here, and the buffers are
    moved to the rank's device. Take the optimizer's parameter groups before: a partitioned
    parameter's own shape is empty."""
    import os

    import deepspeed
    from deepspeed.accelerator import get_accelerator

    dtype = torch.bfloat16 if ds_config.get("bf16", {}).get("enabled") else None  # lmfoundry trains bf16 or fp32
    names = {id(p): name for name, p in model.named_parameters()}  # a tied weight by its first name

    class OneAtATime(torch.nn.Module):
        """What `zero.Init` converts: the model's parameters, each materialised as it is reached."""

        def parameters(self, recurse: bool = True):
            previous = None
            for p in model.parameters():
                # zero.Init partitions each parameter before it asks for the next; were it ever to
                # collect them first, the whole model would be materialised: refused instead
                if previous is not None and getattr(previous, "ds_tensor", None) is None:
                    raise RuntimeError("zero.Init did not partition a parameter before asking for the next")
                if p.is_meta:
                    _fill(p, values[names[id(p)]](), dtype)
                elif dtype is not None and p.is_floating_point() and p.dtype != dtype:
                    p.data = p.data.to(dtype)  # built on the CPU (an adapter): cast as the engine would
                previous = p
                yield p

    deepspeed.init_distributed()  # over torch's process group: the config counts the world from it
    deepspeed.zero.Init(module=OneAtATime(), config_dict_or_path=ds_config)
    if has_meta_parameters(model):
        raise RuntimeError("zero.Init left parameters on the meta device")
    device = torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", 0))))
    for module in model.modules():  # the engine moves a partitioned model's parameters only
        for name, buffer in module.named_buffers(recurse=False):
            setattr(module, name, buffer.to(device))


def _fill(meta: torch.nn.Parameter, value: torch.Tensor, dtype: torch.dtype | None = None) -> None:
    """`meta` holds `value` from now on, the same Python object: the optimizer's parameter
    groups, the engine and the split layers all refer to it (a meta tensor's data cannot be set
    to a tensor on another device, so the two objects' contents are swapped), and it keeps the
    attributes DeepSpeed gave it (the universal checkpoint's description of its split)."""
    real = torch.nn.Parameter(value.detach().to(dtype or meta.dtype), requires_grad=meta.requires_grad)
    real.__dict__.update(meta.__dict__)
    torch.utils.swap_tensors(meta, real)


_PATCHING = threading.Lock()


@contextlib.contextmanager
def materialized_on_placement(
    target: torch.nn.Module,
    values: dict[str, Callable[[], torch.Tensor]],
    model_name: Callable[[str], str] | None = None,
) -> Iterator[None]:
    """Within it, the DeepSpeed engine built over `target` materialises its meta parameters (see
    `materialize`) at the one moment between AutoTP's split and the model's placement on its
    device: the start of `_configure_distributed_model`, before the optimizer is built. An
    engine built over another model meanwhile is left alone. The parameters AutoTP leaves whole
    must be materialised before `initialize` (`materialize` with `leave`): AutoTP hooks the
    gradients of some of them (the norms under sequence parallelism) before this point, and a
    hook registered on a tensor is not one a swap is known to carry. Raises if another engine is
    being built from a meta model meanwhile."""
    from deepspeed.runtime.engine import DeepSpeedEngine
    from deepspeed.utils import debug

    def configure(engine, model):
        if model is target:
            # DeepSpeed's debug maps of names hold weak references to the parameters, which a
            # swap refuses: cleared for the swaps, then made again from the model, split by now
            debug.debug_clear_module_and_param_names()
            try:
                materialize(model, values, model_name=model_name)
            finally:
                debug.debug_extract_module_and_param_names(model)
        return original(engine, model)

    if not _PATCHING.acquire(blocking=False):
        raise RuntimeError("another engine is being built from a meta model: build one at a time")
    try:
        original = DeepSpeedEngine._configure_distributed_model  # read under the lock: the class's own
        DeepSpeedEngine._configure_distributed_model = configure
        try:
            yield
        finally:
            DeepSpeedEngine._configure_distributed_model = original
    finally:
        _PATCHING.release()
