"""The DeepSpeed engine and its optimizer: the one derivation of DeepSpeed's JSON from a training
config's components, the parameter groups, the learning-rate schedules and the engine itself."""

from __future__ import annotations

import contextlib
import importlib
import math
import sys
from collections.abc import Callable

import torch

from lmfoundry.train import meta_init, tensor_parallel
from lmfoundry.train.config import TrainStageConfig, resolved_precision, world_sizes


def gradient_accumulation(cfg: TrainStageConfig, world_size: int, seq_len: int) -> int:
    """Micro-steps per optimizer step, from the stage's global batch (tokens or pairs): the
    workers of a tensor-parallel group, or the stages of a pipeline, share each micro-batch."""
    return cfg.batch.accumulation(world_size // cfg.parallelism.model_parallel_size, seq_len)


def check_every_world_size(cfg: TrainStageConfig, seq_len: int) -> None:
    """Fail on the driver, not inside the workers, when a world size the run may train at cannot
    share the global batch evenly."""
    from lmfoundry.train.pipeline_schedule import check_micro_batches

    par = cfg.parallelism
    for world in world_sizes(par):
        accumulation = gradient_accumulation(cfg, world, seq_len)
        if par.pipeline_parallel_size > 1:  # the interleaved schedule's groups of micro-batches
            check_micro_batches(par.pipeline_parallel_size, par.virtual_stages, accumulation)


def reduce_bucket_elements(cfg: TrainStageConfig, num_params: int | None) -> int:
    """The configured bucket, but never more than the model: a bigger one holds nothing more."""
    bucket = cfg.parallelism.reduce_bucket_size
    return min(bucket, num_params) if num_params else bucket


def norms_on_sequence_slices(cfg: TrainStageConfig) -> list[str] | None:
    """The norms a sequence-parallel model applies to a slice of the sequence (None without it):
    sequence parallelism needs tensor parallelism, which only pretraining's model runs."""
    if not cfg.parallelism.splits_sequences:
        return None
    return tensor_parallel.sequence_parallel_norms(
        cfg.model.n_layer, cfg.parallelism.pipeline_parallel_size > 1, moe=cfg.model.moe is not None
    )


def deepspeed_config(cfg: TrainStageConfig, world_size: int, seq_len: int, num_params: int | None = None) -> dict:
    """DeepSpeed's JSON for `cfg` at `world_size` workers (seq_len: tokens per sequence, for a
    global batch counted in tokens)."""
    par, opt, schedule = cfg.parallelism, cfg.optimizer, cfg.schedule
    micro = cfg.batch.micro_batch_size
    accum = gradient_accumulation(cfg, world_size, seq_len)
    bucket = reduce_bucket_elements(cfg, num_params)
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    model_parallel = {}
    if tp > 1:
        # AutoTP splits the head of a model by vocabulary; a pipeline's stages are split by
        # lmfoundry (train/pipeline_parallel.py: its head is no layer AutoTP knows as one)
        model_parallel["tensor_parallel"] = tensor_parallel.deepspeed_section(
            tp, norms_on_sequence_slices(cfg), par.splits_vocabulary and pp == 1
        )
    if par.splits_sequences and pp > 1:
        # the ranks of a stage's tensor-parallel group hold different slices of the activations:
        # each sends its own whole to its peer of the next stage (partitioned transfers would
        # send 1/tp of one rank's and gather it as everyone's)
        model_parallel["pipeline"] = {"pipe_partitioned": False, "grad_partitioned": False}
    return {
        "train_micro_batch_size_per_gpu": micro,
        "gradient_accumulation_steps": accum,
        # DeepSpeed checks this product against its world size: every worker, those of one
        # tensor-parallel group too (the rows per step are this over tp), but the data-parallel
        # replicas only under its pipeline engine
        "train_batch_size": micro * accum * (world_size // (pp * tp) if pp > 1 else world_size),
        **model_parallel,
        "gradient_clipping": opt.grad_clip,
        "zero_optimization": {
            "stage": par.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": par.use_gpu,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            **({"offload_optimizer": {"device": "cpu", "pin_memory": par.use_gpu}} if par.offload_optimizer else {}),
        },
        "bf16": {"enabled": resolved_precision(par) == "bf16"},
        # torch's AdamW, except for an offloaded optimizer on GPU machines: there DeepSpeed's CPU Adam
        # (vectorised C++, compiled on first use) steps the partition in host memory many times faster.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": opt.lr,
                "betas": list(opt.betas),
                "eps": 1e-8,
                "weight_decay": opt.weight_decay,
                **({} if par.offload_optimizer and par.use_gpu else {"torch_adam": True}),
            },
        },
        # warmup-stable-decay has no DeepSpeed scheduler: build_engine hands DeepSpeed a WSDSchedule
        **(
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {
                        "total_num_steps": schedule.max_steps,
                        "warmup_num_steps": schedule.warmup_steps,
                        "warmup_type": "linear",
                        "warmup_min_ratio": 0.0,
                        "cos_min_ratio": schedule.min_lr_ratio,
                    },
                }
            }
            if schedule.kind == "cosine"
            else {}
        ),
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


class WSDSchedule:
    """Warmup-stable-decay (Hu et al. 2024, MiniCPM; Hägele et al. 2024): linear warmup to the
    peak, the peak held, then a decay to min_lr_ratio over the last decay_fraction of the steps.
    A LambdaLR multiplier; an object rather than a closure, so its settings are in the scheduler's
    state_dict and in every checkpoint."""

    def __init__(self, max_steps: int, warmup_steps: int, decay_fraction: float, min_lr_ratio: float, shape: str):
        self.max_steps, self.warmup_steps = max_steps, warmup_steps
        self.decay_steps = max(1, round(max_steps * decay_fraction))
        self.min_lr_ratio, self.shape = min_lr_ratio, shape

    def __call__(self, step: int) -> float:
        if step < self.warmup_steps:
            return (step + 1) / self.warmup_steps
        progress = (step - (self.max_steps - self.decay_steps)) / self.decay_steps
        if progress <= 0:
            return 1.0
        drop = min(progress, 1.0) if self.shape == "linear" else min(progress, 1.0) ** 0.5
        return 1.0 - (1.0 - self.min_lr_ratio) * drop


def wsd_schedule(cfg: TrainStageConfig) -> WSDSchedule:
    s = cfg.schedule
    return WSDSchedule(s.max_steps, s.warmup_steps, s.decay_fraction, s.min_lr_ratio, s.decay_shape)


def param_groups(model: torch.nn.Module, weight_decay: float) -> list[dict]:
    """Weight decay on matrices only; norms and embeddings are not decayed (as in GPT-3).
    Named, because DeepSpeed splits named groups further into expert and non-expert groups."""
    decay, no_decay = [], []
    for name, p in model.named_parameters():
        if not p.requires_grad:
            continue
        (decay if p.dim() >= 2 and "embed" not in name else no_decay).append(p)
    groups = [
        {"params": decay, "weight_decay": weight_decay, "name": "decay"},
        {"params": no_decay, "weight_decay": 0.0, "name": "no_decay"},
    ]
    return [g for g in groups if g["params"]]  # a LoRA run's adapters are all matrices


MUON_MODULE = "deepspeed.runtime.zero.muon.muon_optimizer"


def import_deepspeed_muon_uncompiled(name: str = MUON_MODULE) -> None:
    """DeepSpeed's engine and ZeRO optimizers import its Muon optimizer whatever the optimizer,
    and that module wraps its kernels in DeepSpeed's `compiler.compile()` (torch.compile) as it
    loads, which imports TorchInductor: 2-3 s of CPU in every worker of every attempt. lmfoundry
    trains with AdamW and compiles nothing, so the module is imported once with DeepSpeed's
    compile decorator swapped for one that leaves the kernels as plain functions; torch.compile
    itself is untouched. A DeepSpeed without Muon has nothing to import."""
    if name in sys.modules:
        return
    from deepspeed.runtime import compiler

    compile_decorator = compiler.compile
    compiler.compile = lambda *args, **kwargs: lambda fn: fn
    try:
        importlib.import_module(name)
    except ModuleNotFoundError as e:
        if not (e.name and name.startswith(e.name)):
            raise
    finally:
        compiler.compile = compile_decorator


def start_deepspeed_without_inference_op() -> None:
    """DeepSpeed's communication backend, as it starts on the CPU accelerator, loads its
    shared-memory all-reduce op: C++ that torch compiles on first use (a minute or more, and a C++
    compiler on the machine). Only DeepSpeed-Inference's all-reduce calls it; training reduces
    through torch.distributed. So lmfoundry's processes start the backend without it. (The GPU
    accelerators have no such op.)"""
    # by its full name: `from deepspeed.comm import torch` is the torch package itself
    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None


def prepare_deepspeed() -> None:
    """Before DeepSpeed starts its backend or an engine (idempotent): its Muon module imported
    without TorchInductor, and its backend started without the inference op."""
    import_deepspeed_muon_uncompiled()
    start_deepspeed_without_inference_op()


def build_engine(
    model: torch.nn.Module,
    cfg: TrainStageConfig,
    ds_config: dict,
    values: dict[str, Callable[[], torch.Tensor]] | None = None,
):
    """`model` in a DeepSpeed engine that checkpoints asynchronously. Returns engine and scheduler.
    `values`: the initial values of a model built on the meta device, by its parameters' names
    (default: its own `initial_values()`)."""
    import deepspeed

    from lmfoundry.train.snapshot import SnapshotCheckpointEngine  # DeepSpeed's: imported with it

    prepare_deepspeed()

    def wsd(optimizer):
        return torch.optim.lr_scheduler.LambdaLR(optimizer, wsd_schedule(cfg))

    client_scheduler = wsd if cfg.schedule.kind == "wsd" else None  # else DeepSpeed's from the config
    tp, pp = cfg.parallelism.tensor_parallel_size, cfg.parallelism.pipeline_parallel_size
    # a model built on the meta device (train/meta_init.py): its whole initial values are read
    # off it before anything splits it. What AutoTP leaves whole gets its values before
    # `initialize` (a pipeline's stage: when DeepSpeed places it, in its constructor), what
    # AutoTP splits inside `initialize`, after the split; under ZeRO-3 each is partitioned as it
    # gets its value, before `initialize`
    on_meta = meta_init.has_meta_parameters(model)
    if on_meta and values is None:
        values = model.initial_values()
    built, model_name, groups = model, None, None
    if pp > 1:
        from lmfoundry.train.pipeline_parallel import pipeline_module, share_groups_with_tensor_parallelism
        from lmfoundry.train.pipeline_schedule import check_micro_batches

        deepspeed.init_distributed()  # the pipeline's groups are made before the engine: over torch's process group
        virtual = cfg.parallelism.virtual_stages
        check_micro_batches(pp, virtual, ds_config["gradient_accumulation_steps"])
        model = pipeline_module(
            model, pp, tp, values, vocab_parallel=cfg.parallelism.splits_vocabulary, virtual_stages=virtual
        )
        model_name = model.names_in_model.__getitem__
        if tp > 1:
            share_groups_with_tensor_parallelism(model._grid)
    else:
        if cfg.parallelism.splits_vocabulary:  # an untied embedding, before the optimizer is built over its rows
            tensor_parallel.split_embedding_by_vocabulary(model, tp)
        if on_meta and cfg.parallelism.zero_stage == 3:
            groups = param_groups(model, cfg.optimizer.weight_decay)  # while the parameters have their shapes
            model.reset_buffers()
            meta_init.partition_as_built(model, values, ds_config)
        elif on_meta:  # before AutoTP hooks the gradients of some of it
            vocab = cfg.parallelism.splits_vocabulary
            meta_init.materialize(model, values, leave=lambda name: tensor_parallel.autotp_splits(name, vocab))
            model.reset_buffers()
    placing = (
        meta_init.materialized_on_placement(model, values, model_name)
        if meta_init.has_meta_parameters(model)
        else contextlib.nullcontext()
    )
    with placing:
        engine, _, _, scheduler = deepspeed.initialize(
            model=model,
            model_parameters=groups if groups is not None else param_groups(model, cfg.optimizer.weight_decay),
            config=ds_config,
            lr_scheduler=client_scheduler,
        )
    if on_meta:
        if meta_init.has_meta_parameters(engine.module):
            raise RuntimeError("DeepSpeed built the engine without materialising the model's meta parameters")
        built.start_weights = None  # the checkpoint's file, read: not kept open for the run
    if pp > 1 and tp > 1:
        from lmfoundry.train.pipeline_parallel import finish_tensor_parallel_pipeline

        finish_tensor_parallel_pipeline(engine)
    if pp > 1 and cfg.parallelism.virtual_stages > 1:
        from lmfoundry.train.interleaved_pipeline import make_interleaved

        make_interleaved(engine)
    if pp > 1 and built.cfg.moe is not None and built.cfg.moe.balance == "aux_loss":
        from lmfoundry.train.pipeline_parallel import count_router_losses

        count_router_losses(engine)
    if cfg.parallelism.splits_sequences:
        make_sequence_parallel(engine)
    elif tp > 1:
        from deepspeed.utils import groups

        tensor_parallel.reduce_column_inputs_once(engine.module, groups.get_tensor_model_parallel_group())
    engine.checkpoint_engine = SnapshotCheckpointEngine(engine._config)
    keep_fp32_gradient_norm(engine)
    return engine, scheduler


def keep_fp32_gradient_norm(engine) -> None:
    """Without ZeRO and in fp32, DeepSpeed clips the gradients with its `clip_grad_norm_` but
    keeps no norm, and with clipping off measures none: `get_global_grad_norm()` stays None and
    the logged norm would read 0. Here the engine keeps the norm that function measures: in
    DeepSpeed's clip (the same arguments and point in the step), or, with clipping off, just
    before the optimizer step, clipping nothing. Kept as a tensor: read only when logged.

    Nor does DeepSpeed skip a step whose gradients are not finite there, as its ZeRO and
    mixed-precision optimizers do: one rank's NaN gradient would reach every replica's weights.
    Here the optimizer skips it on that norm (the same on every rank: it is reduced over them),
    and the engine then leaves the schedule as it does for theirs (`was_step_applied()` False)."""
    if engine.zero_optimization_stage() or engine.bfloat16_enabled() or engine.fp16_enabled():
        return  # DeepSpeed's own optimizer wrappers keep the norm and skip non-finite steps

    from deepspeed.runtime.utils import clip_grad_norm_

    def measure(max_norm: float) -> None:
        engine._global_grad_norm = clip_grad_norm_(engine.module.parameters(), max_norm=max_norm, mpu=engine.mpu)

    optimizer = engine.optimizer
    take_optimizer_step = optimizer.step

    def step_when_finite(*args, **kwargs):
        # the attribute DeepSpeed's engine reads after the step, as it does from its own optimizers
        optimizer.overflow = not bool(torch.isfinite(engine._global_grad_norm).all())
        if not optimizer.overflow:
            take_optimizer_step(*args, **kwargs)

    optimizer.step = step_when_finite
    if engine.gradient_clipping() > 0:
        engine.clip_fp32_gradients = lambda: measure(engine.gradient_clipping())
        return
    take_model_step = engine._take_model_step

    def measured_step(*args, **kwargs):
        measure(math.inf)
        return take_model_step(*args, **kwargs)

    engine._take_model_step = measured_step


def frozen_zero3_engine(model: torch.nn.Module, ds_config: dict, values: dict | None = None):
    """A frozen model (DPO's reference, an SFT distillation teacher) built on the meta device
    from a checkpoint, partitioned like the trained one under ZeRO-3 (each parameter as it gets
    its value: meta_init.partition_as_built), in a DeepSpeed engine without an optimizer whose
    forward gathers each module's parameters as it runs and releases them after. As TRL
    prepares its reference, only parameters under 10 x d_model elements (the norms) stay whole
    between forwards. Every rank must call this and run its forwards in step (each gather is a
    collective), as the training loop's micro-batches do. `values`: its initial values by name
    (default: its own, read from the checkpoint)."""
    import deepspeed

    if values is None and getattr(model, "start_weights", None) is None:
        raise ValueError("a frozen ZeRO-3 model is read from a checkpoint: build it with load_model_on_meta")
    config = {k: v for k, v in ds_config.items() if k not in ("optimizer", "scheduler")}
    config["zero_optimization"] = {
        **config["zero_optimization"],
        "stage3_param_persistence_threshold": 10 * model.cfg.d_model,
    }
    model.requires_grad_(False).reset_buffers()
    meta_init.partition_as_built(model, model.initial_values() if values is None else values, config)
    model.start_weights = None  # read: the checkpoint's file is not kept open
    engine, *_ = deepspeed.initialize(model=model, config=config)
    engine.eval()  # DeepSpeed's returns None, not the engine
    return engine


def place_frozen(model: torch.nn.Module, engine, values: dict | None = None):
    """A frozen model (DPO's reference, an SFT teacher) beside the engine's. Under ZeRO-3 (the
    model built with load_model_on_meta) partitioned in an engine of its own
    (`frozen_zero3_engine`; every rank must call this). Below it, on the engine's device, its
    parameters in the engine's training dtype (as DeepSpeed casts the trained model: parameters
    only, the rotary tables stay fp32), so that the two agree where their weights do. `values`:
    a meta-built model's initial values by name (default: its own)."""
    if engine.zero_optimization_stage() == 3:
        return frozen_zero3_engine(model, engine.config, values)
    if engine.bfloat16_enabled():  # cast where it was read, so the device never holds it in fp32
        for p in model.parameters():
            p.data = p.data.to(torch.bfloat16)
    return model.to(engine.device)


def make_sequence_parallel(engine) -> None:
    """The engine's model (or pipeline stage), its blocks split by AutoTP, made
    sequence-parallel over its tensor-parallel group (train/tensor_parallel.py)."""
    import torch.distributed as dist
    from deepspeed.utils import groups

    module, group = engine.module, groups.get_tensor_model_parallel_group()
    if hasattr(module, "forward_funcs"):  # a pipeline stage
        from lmfoundry.train.pipeline_parallel import prepare_sequence_parallel_stage

        embeddings, norms, head = prepare_sequence_parallel_stage(module, group)
        if not engine.is_first_stage() and getattr(engine, "first_dataloader_check", None) is not None:
            # DeepSpeed checks once that a tensor-parallel group's ranks start on the same
            # inputs: the token ids, yes, but a later stage's are its ranks' own slices
            engine.first_dataloader_check.remove()
            engine.first_dataloader_check = None
    else:
        embeddings, norms = [module.embed], [module.norm]
        head = module.lm_head if tensor_parallel.splits_vocabulary(engine) else None
    split_head = tensor_parallel.splits_vocabulary(engine)
    tensor_parallel.apply_sequence_parallelism(module, embeddings, norms, group, head, split_head)
    for moe in module.moe_layers():
        # each rank routes its slice of the tokens: the balance loss counts the group's, and the
        # experts, split over the group (each rank's its own), count towards the gradient norm
        # on every rank of it, as tensor-parallel shards do
        if moe.ep_group is None or dist.get_process_group_ranks(moe.ep_group) != dist.get_process_group_ranks(group):
            raise RuntimeError(
                "an MoE layer under tensor parallelism must split its experts over the tensor-parallel group"
            )
        moe.balance_over = tensor_parallel.balance_over(group)
        moe.w_gate_up.model_parallel = moe.w_down.model_parallel = True
