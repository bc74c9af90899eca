"""Training configs, composed of components: each stage's config (pretraining, SFT, DPO) is its own
few keys plus the same component sections, e.g.

    parallelism: {num_workers: 8, zero_stage: 2}
    schedule: {max_steps: 20000, warmup_steps: 700}
    optimizer: {lr: 6.0e-4}

Recipes written before the components keep working: a flat old key (`max_steps`) is moved to
its section (`schedule.max_steps`) with a warning naming the new key; a key set in both places
is an error. The DeepSpeed JSON is derived from the components in train/engine.py.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar, Literal

from pydantic import BaseModel, Field, model_validator

from lmfoundry.model.transformer import ModelConfig
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracking import MlflowConfig

logger = get_logger(__name__)


MAX_VIRTUAL_STAGES = 64  # chunks of a pipeline stage: far beyond any layout the planner ranks


class FaultDrill(StageConfig):
    """A real failure injected on purpose, to prove recovery: the worker of `rank` kills its own
    process with SIGKILL after optimizer step `at_step` (or, with `during_save`, while that
    step's checkpoint is being written), or (`lr_spike`) every worker takes step `at_step` with
    its learning rate multiplied, which blows the loss up, or (`stall`) the worker of `rank`
    sleeps `seconds` after step `at_step`, as a hung straggler does (the others wait for it in
    the next collective), which holds the run still while an operator or a test acts on the
    cluster, or (`nan_grad`) the worker of `rank` gets non-finite gradients in step `at_step`
    while its loss stays finite, as an overflow in the backward pass does. Once per run unless
    `every_attempt`."""

    at_step: int = Field(..., ge=1)
    rank: int = Field(0, ge=0)
    kind: Literal["kill", "lr_spike", "stall", "nan_grad"] = Field(
        "kill",
        description="kill: SIGKILL the worker; lr_spike: multiply the learning rate of step at_step by "
        "lr_factor; stall: the worker sleeps `seconds`; nan_grad: the worker's gradients of step at_step are NaN",
    )
    lr_factor: float = Field(1e4, gt=0)
    seconds: float = Field(60.0, gt=0, description="stall: how long the worker sleeps")
    during_save: bool = False
    every_attempt: bool = False


# --- the components ------------------------------------------------------------------------------


class ParallelismConfig(StageConfig):
    """The workers, how they split the model's state (ZeRO, experts) and their number format."""

    num_workers: int = Field(2, ge=1, description="workers; with min_workers, the most the run grows to")
    min_workers: int | None = Field(
        None,
        ge=1,
        description="elastic: Ray Train goes on with as few as this many workers when some are lost, and "
        "grows back towards num_workers as resources return (None: a fixed num_workers)",
    )
    elastic_resize_interval_s: float = Field(
        60.0, gt=0, description="elastic: how often a running group checks for resources to grow into"
    )
    cpus_per_worker: float = Field(1.0, gt=0)
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="more Ray resources each worker needs besides CPUs (and a GPU with use_gpu), e.g. a "
        "custom resource that only training nodes have",
    )
    use_gpu: bool = False
    zero_stage: int = Field(2, ge=0, le=3, description="0-3; 3 partitions the weights too (not with MoE)")
    offload_optimizer: bool = Field(
        False,
        description="keep the optimizer's partition (moments, fp32 master weights) in CPU memory and step "
        "it there; ZeRO stages 1-3",
    )
    reduce_bucket_size: int = Field(
        50_000_000,
        ge=1,
        description="elements per ZeRO gradient-reduction bucket; DeepSpeed allocates one (two with "
        "overlapped communication) a micro-step",
    )
    expert_parallel_size: int = Field(
        1,
        ge=1,
        description="workers that split each MoE layer's experts; in an elastic run, at a world size it "
        "does not divide, the largest of its divisors that divides the world (each worker then holds more "
        "experts)",
    )
    tensor_parallel_size: int = Field(
        1,
        ge=1,
        description="workers that split each block's attention heads and MLP columns (DeepSpeed AutoTP; "
        "pretraining, ZeRO stages 0-2; an MoE model's experts are split over the group instead, with "
        "sequence_parallel and expert_parallel_size equal to this); each group of this many consecutive "
        "ranks trains on the same batch",
    )
    pipeline_parallel_size: int = Field(
        1,
        ge=1,
        description="stages the model's blocks are spread over (DeepSpeed's pipeline engine, 1F1B, or "
        "interleaved with virtual_stages; "
        "pretraining, ZeRO stage 1); a step's micro-batches (its gradient accumulation) "
        "flow through them",
    )
    virtual_stages: int = Field(
        1,
        ge=1,
        le=MAX_VIRTUAL_STAGES,
        description="with pipeline_parallel_size > 1: chunks of the blocks each stage holds, run on the "
        "interleaved 1F1B schedule (Megatron's), which cuts the pipeline's idle time this many times for "
        "as many times the transfers between stages; a step's micro-batches must be a multiple of "
        "pipeline_parallel_size",
    )
    sequence_parallel: bool = Field(
        False,
        description="with tensor_parallel_size > 1: each rank of a tensor-parallel group holds 1/tensor_parallel_size "
        "of every sequence between the split layers (the norms and residual adds), as Megatron's sequence "
        "parallelism does; sequences must split evenly over the group. Without tensor parallelism it does "
        "nothing (as in Megatron), so a recipe can ask for it before the planner chooses the layout",
    )
    vocab_parallel: bool = Field(
        False,
        description="with tensor_parallel_size > 1: the output head and the embedding (tied or not) split by "
        "vocabulary rows over the tensor-parallel group, each rank computing the logits of its slice and the "
        "loss by a distributed cross-entropy, and looking up the tokens of its rows (the group sums the "
        "lookups); in a pipeline, on the first and the last stage. Without tensor parallelism it does "
        "nothing, so a recipe can ask for it before the planner chooses the layout",
    )
    precision: Literal["auto", "fp32", "bf16"] = "auto"

    @property
    def splits_sequences(self) -> bool:
        """Whether sequence parallelism runs: asked for, with a tensor-parallel group to run over."""
        return self.sequence_parallel and self.tensor_parallel_size > 1

    @property
    def splits_vocabulary(self) -> bool:
        """Whether the head and the embedding are vocabulary-parallel: asked for, with tensor parallelism."""
        return self.vocab_parallel and self.tensor_parallel_size > 1

    def at_world_size(self, world: int) -> ParallelismConfig:
        """As the run trains at `world` workers: an elastic run, resized to a world size that
        expert_parallel_size does not divide, splits its experts over the largest divisor of
        expert_parallel_size that divides the world (the layout moves through the universal
        checkpoint at each resize, as any resumed layout change does)."""
        ep = math.gcd(world, self.expert_parallel_size)
        return self if ep == self.expert_parallel_size else self.model_copy(update={"expert_parallel_size": ep})

    @property
    def model_parallel_size(self) -> int:
        """Workers that hold one replica of the model between them."""
        return self.tensor_parallel_size * self.pipeline_parallel_size

    @model_validator(mode="after")
    def _check(self) -> ParallelismConfig:
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(
                "offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO-Offload moves the optimizer's partition)"
            )
        if self.min_workers is not None:
            if self.min_workers > self.num_workers:
                raise ValueError(f"min_workers={self.min_workers} must not exceed num_workers={self.num_workers}")
        tp, pp = self.tensor_parallel_size, self.pipeline_parallel_size
        for name, size in (("tensor_parallel_size", tp), ("pipeline_parallel_size", pp)):
            if self.num_workers % size:
                raise ValueError(f"{name}={size} must divide num_workers={self.num_workers}")
        if tp > 1:
            if self.zero_stage == 3:
                raise ValueError(
                    f"tensor_parallel_size={tp} with zero_stage=3: lmfoundry runs tensor parallelism with ZeRO "
                    "stages 0-2 (its checkpoint writer gathers tensor-parallel shards or ZeRO-3 partitions, "
                    "not both)"
                )
            if self.expert_parallel_size not in (1, tp):
                raise ValueError(
                    f"tensor_parallel_size={tp} with expert_parallel_size={self.expert_parallel_size}: with tensor "
                    "parallelism an MoE model's experts are split over each tensor-parallel group; set "
                    f"expert_parallel_size={tp}"
                )
            if self.min_workers is not None:
                raise ValueError(
                    f"min_workers (elastic) with tensor_parallel_size={tp}: a lost worker breaks its whole "
                    "tensor-parallel group; use a fixed num_workers (a checkpoint still resumes at "
                    "another layout)"
                )
        if self.virtual_stages > 1 and pp == 1:
            raise ValueError(
                f"virtual_stages={self.virtual_stages} needs pipeline_parallel_size > 1: virtual stages "
                "are chunks of a pipeline stage"
            )
        if self.num_workers % (tp * pp):
            raise ValueError(
                f"tensor_parallel_size={tp} x pipeline_parallel_size={pp} must divide num_workers={self.num_workers}"
            )
        if pp > 1:
            if self.zero_stage != 1:
                # ZeRO-2/3 the pipeline engine refuses; under ZeRO-0 its gradient clipping counts
                # the unsplit parameters of the first stage only (deepspeed.runtime.utils.clip_grad_norm_
                # keys on the rank in the stage x tensor grid), so the norm would be wrong
                raise ValueError(
                    f"pipeline_parallel_size={pp} with zero_stage={self.zero_stage}: pipeline parallelism runs "
                    "with zero_stage=1 (DeepSpeed's pipeline engine refuses 2-3, and clips by a wrong "
                    "gradient norm at 0)"
                )
            if self.min_workers is not None:
                raise ValueError(
                    f"pipeline_parallel_size={pp} runs without elastic min_workers; use a fixed num_workers"
                )
            if (self.num_workers // pp) % self.expert_parallel_size:
                raise ValueError(
                    f"expert_parallel_size={self.expert_parallel_size} must divide the {self.num_workers // pp} "
                    f"workers of each pipeline stage (num_workers={self.num_workers} / pipeline_parallel_size={pp}): "
                    "a stage's replicas split its layers' experts"
                )
        if self.num_workers % self.expert_parallel_size:
            raise ValueError(
                f"expert_parallel_size={self.expert_parallel_size} must divide num_workers={self.num_workers}"
            )
        if self.expert_parallel_size > 1 and self.zero_stage == 0 and tp == 1:
            # DeepSpeed keeps a ZeRO-0 run's optimizer state in the file of its model-parallel
            # rank, here rank 0's: the other ranks would resume with rank 0's experts' moments
            raise ValueError(
                f"zero_stage=0 with expert_parallel_size={self.expert_parallel_size}: a checkpoint would hold "
                "only rank 0's experts' optimizer state; use zero_stage 1 or 2"
            )
        return self


class TokenBatchConfig(StageConfig):
    """Pretraining's batch: sequences per forward pass, tokens per optimizer step."""

    micro_batch_size: int = Field(8, ge=1, description="sequences per worker per forward pass")
    global_batch_tokens: int = Field(4096, ge=1, description="tokens per optimizer step, all workers")
    shuffle: bool = Field(
        True, description="a seeded order per epoch: shards, their row groups and the rows of each (false: file order)"
    )

    def accumulation(self, world_size: int, seq_len: int) -> int:
        """Micro-steps per optimizer step; world_size: the data-parallel replicas (the workers,
        unless tensor or pipeline parallelism groups them)."""
        per_micro_step = self.micro_batch_size * world_size * seq_len
        terms = (
            f"micro_batch_size x data-parallel replicas x seq_len = {self.micro_batch_size} x {world_size} x {seq_len}"
        )
        return _micro_steps("global_batch_tokens", self.global_batch_tokens, per_micro_step, terms)


def _micro_steps(name: str, global_batch: int, per_micro_step: int, terms: str) -> int:
    if global_batch % per_micro_step:
        raise ValueError(f"{name}={global_batch} must be a multiple of {terms} = {per_micro_step}")
    return global_batch // per_micro_step


class RewardBatchConfig(StageConfig):
    """A reward model's batch: examples (preference pairs, or scored solutions) per forward pass
    and per optimizer step."""

    micro_batch_size: int = Field(8, ge=1, description="examples per worker per forward pass")
    global_batch_size: int = Field(32, ge=1, description="examples per optimizer step, all workers")

    def accumulation(self, world_size: int, seq_len: int | None = None) -> int:
        per_micro_step = self.micro_batch_size * world_size
        terms = f"micro_batch_size x num_workers = {self.micro_batch_size} x {world_size}"
        return _micro_steps("global_batch_size", self.global_batch_size, per_micro_step, terms)


class PairBatchConfig(StageConfig):
    """DPO's batch: preference pairs per forward pass and per optimizer step."""

    micro_batch_size: int = Field(4, ge=1, description="pairs per worker per forward pass")
    global_batch_pairs: int = Field(16, ge=1, description="pairs per optimizer step, all workers")

    def accumulation(self, world_size: int, seq_len: int | None = None) -> int:
        """Micro-steps per optimizer step (pairs, so the sequence length plays no part)."""
        per_micro_step = self.micro_batch_size * world_size
        terms = f"micro_batch_size x num_workers = {self.micro_batch_size} x {world_size}"
        return _micro_steps("global_batch_pairs", self.global_batch_pairs, per_micro_step, terms)


class SequenceBatchConfig(StageConfig):
    """Supervised fine-tuning's batch: packed rows (each several conversations) per forward pass
    and per optimizer step."""

    micro_batch_size: int = Field(4, ge=1, description="packed rows per worker per forward pass")
    global_batch_sequences: int = Field(16, ge=1, description="packed rows per optimizer step, all workers")

    def accumulation(self, world_size: int, seq_len: int | None = None) -> int:
        """Micro-steps per optimizer step (rows, so the sequence length plays no part)."""
        per_micro_step = self.micro_batch_size * world_size
        terms = f"micro_batch_size x num_workers = {self.micro_batch_size} x {world_size}"
        return _micro_steps("global_batch_sequences", self.global_batch_sequences, per_micro_step, terms)


class OptimizerConfig(StageConfig):
    """AdamW."""

    lr: float = Field(3e-3, gt=0, description="the peak learning rate")
    weight_decay: float = Field(0.1, ge=0, description="on matrices only; norms and embeddings are not decayed")
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0)


class ScheduleConfig(StageConfig):
    """How long the run trains and the learning rate over it."""

    max_steps: int = Field(200, ge=1)
    warmup_steps: int = Field(20, ge=0)
    kind: Literal["cosine", "wsd"] = Field(
        "cosine",
        description="warmup + cosine, or warmup-stable-decay (constant after warmup, decayed over the last "
        "decay_fraction)",
    )
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of max_steps spent decaying")
    decay_shape: Literal["linear", "sqrt"] = Field(
        "sqrt", description="wsd: linear, or 1 - sqrt (Hägele et al. 2024 found it better)"
    )

    @model_validator(mode="after")
    def _check(self) -> ScheduleConfig:
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below max_steps={self.max_steps}")
        if self.kind == "cosine" and self.warmup_steps < 1:
            # DeepSpeed's WarmupCosineLR refuses 0, inside every worker once the run has started
            raise ValueError("warmup_steps=0 with kind=cosine: the cosine schedule needs at least 1 warmup step")
        return self


class CheckpointingConfig(StageConfig):
    every: int = Field(100, ge=1, description="optimizer steps between checkpoints")
    keep_last: int = Field(
        2,
        ge=2,
        description="the newest K checkpoints are kept (at least 2, so that a corrupt newest one has a predecessor)",
    )
    keep_every: int = Field(
        0, ge=0, description="also keep every checkpoint whose step is a multiple of this (0: none)"
    )
    stage_dir: str | None = Field(
        None,
        description="local directory where checkpoints are staged before the upload; default: shared "
        "memory (/dev/shm) where there is some",
    )


class HealthConfig(StageConfig):
    """What the run survives: restarts of the worker group, loss spikes, slow workers."""

    max_failures: int = Field(3, ge=0, description="worker-group restarts before the run fails")
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="a step loss above this multiple of the running median rolls back to the last "
        "checkpoint before it and skips the batches since (None: off)",
    )
    spike_window: int = Field(20, ge=2, description="steps in the running median of the loss")
    straggler_factor: float = Field(
        1.5,
        gt=1,
        description="a worker busier than this multiple of the fastest one over a logging interval is "
        "reported as a straggler",
    )


class LoggingConfig(StageConfig):
    every: int = Field(10, ge=1, description="optimizer steps between logged steps (metrics.jsonl, TensorBoard)")
    peak_tflops_per_worker: float | None = Field(
        None, gt=0, description="device peak for MFU; None: the bf16 peak of a known GPU, no MFU on CPU"
    )
    mlflow: MlflowConfig | None = Field(None, description="also log every logged step to MLflow (rank 0)")


# --- the stage configs ------------------------------------------------------------------------------


def _move_legacy_keys(data: Any, legacy: dict[str, str]) -> Any:
    """Flat keys of old recipes moved to their sections, each with a warning naming the new key."""
    if not isinstance(data, dict) or not any(old in data for old in legacy):
        return data
    data = dict(data)
    for old, new in legacy.items():
        if old not in data:
            continue
        section, key = new.split(".")
        current = data.get(section)
        if isinstance(current, BaseModel):
            current = current.model_dump(exclude_unset=True)
        current = dict(current or {})
        if key in current:
            raise ValueError(f"{old} and {new} are both set: {old} is the old name of {new}; keep {new} only")
        logger.warning("config key %s is now %s", old, new)
        current[key] = data.pop(old)
        data[section] = current
    return data


class TrainStageConfig(StageConfig):
    """The components every training stage has, and the old flat keys' new places."""

    output: str = Field(..., description="the run directory: checkpoints, metrics and the run manifest")
    parallelism: ParallelismConfig = ParallelismConfig()
    optimizer: OptimizerConfig = OptimizerConfig()
    schedule: ScheduleConfig = ScheduleConfig()
    checkpointing: CheckpointingConfig = CheckpointingConfig()
    health: HealthConfig = HealthConfig()
    logging: LoggingConfig = LoggingConfig()
    drills: list[FaultDrill] = Field(default_factory=list, description="failures to inject")
    seed: int = 0
    deterministic: bool = Field(
        False,
        description="deterministic kernels and collectives on GPUs (slower; docs/reproducibility.md); "
        "CPU runs are bitwise reproducible either way",
    )
    overwrite: bool = False

    LEGACY_KEYS: ClassVar[dict[str, str]] = {
        **{
            k: f"parallelism.{k}"
            for k in (
                "num_workers",
                "min_workers",
                "elastic_resize_interval_s",
                "cpus_per_worker",
                "worker_resources",
                "use_gpu",
                "zero_stage",
                "offload_optimizer",
                "reduce_bucket_size",
                "expert_parallel_size",
                "tensor_parallel_size",
                "pipeline_parallel_size",
                "precision",
            )
        },
        **{k: f"optimizer.{k}" for k in ("lr", "weight_decay", "betas", "grad_clip")},
        **{k: f"schedule.{k}" for k in ("max_steps", "warmup_steps", "min_lr_ratio", "decay_fraction", "decay_shape")},
        "lr_schedule": "schedule.kind",
        "checkpoint_every": "checkpointing.every",
        "keep_checkpoints": "checkpointing.keep_last",
        "keep_every": "checkpointing.keep_every",
        "stage_dir": "checkpointing.stage_dir",
        **{k: f"health.{k}" for k in ("max_failures", "spike_factor", "spike_window", "straggler_factor")},
        "log_every": "logging.every",
        "peak_tflops_per_worker": "logging.peak_tflops_per_worker",
    }

    @model_validator(mode="before")
    @classmethod
    def _legacy_keys(cls, data: Any) -> Any:
        return _move_legacy_keys(data, cls.LEGACY_KEYS)

    # whether the stage's objective can train with its model split by tensor or pipeline parallelism
    MODEL_PARALLEL: ClassVar[bool] = False

    @model_validator(mode="after")
    def _check_drills(self) -> TrainStageConfig:
        par = self.parallelism
        if par.model_parallel_size > 1 and not self.MODEL_PARALLEL:
            raise ValueError(
                f"parallelism.tensor_parallel_size={par.tensor_parallel_size}, pipeline_parallel_size="
                f"{par.pipeline_parallel_size}: tensor and pipeline parallelism are for pretraining; "
                f"{type(self).__name__} trains with data parallelism (both 1)"
            )
        workers = self.parallelism.num_workers
        for drill in self.drills:
            if drill.rank >= workers:
                raise ValueError(f"drills: rank {drill.rank} does not exist with num_workers={workers}")
            if drill.during_save and drill.at_step % self.checkpointing.every:
                raise ValueError(
                    f"drills: at_step={drill.at_step} with during_save needs a checkpoint at that "
                    f"step (checkpointing.every={self.checkpointing.every})"
                )
        return self


class PretrainConfig(TrainStageConfig):
    data: str = Field(..., description="a pack output directory (train/, val/, tokenizer.json)")
    init_from: str | None = Field(
        None,
        description="continued pretraining: a checkpoint or run (e.g. one `lmfoundry import hf` wrote) whose "
        "model and weights the run starts from; its data packed with that checkpoint's tokenizer",
    )
    model: ModelConfig = ModelConfig()
    batch: TokenBatchConfig = TokenBatchConfig()

    LEGACY_KEYS: ClassVar[dict[str, str]] = {
        **TrainStageConfig.LEGACY_KEYS,
        **{k: f"batch.{k}" for k in ("micro_batch_size", "global_batch_tokens")},
    }
    MODEL_PARALLEL: ClassVar[bool] = True

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        ep, moe = self.parallelism.expert_parallel_size, self.model.moe
        if ep > 1:
            if moe is None:
                raise ValueError(f"expert_parallel_size={ep} needs an MoE model (set model.moe)")
            if moe.num_experts % ep:
                raise ValueError(
                    f"expert_parallel_size={ep} must divide num_workers={self.parallelism.num_workers} "
                    f"and model.moe.num_experts={moe.num_experts}"
                )
        if self.parallelism.zero_stage == 3 and moe is not None:
            raise ValueError("zero_stage=3 with an MoE model: DeepSpeed's MoE layers support ZeRO stages 0-2")
        pp = self.parallelism.pipeline_parallel_size
        if pp > 1:
            virtual = self.parallelism.virtual_stages
            if self.model.n_layer < pp * virtual and virtual == 1:
                raise ValueError(
                    f"pipeline_parallel_size={pp} needs at least one block a stage (n_layer={self.model.n_layer})"
                )
            if self.model.n_layer < pp * virtual:
                raise ValueError(
                    f"pipeline_parallel_size={pp} x virtual_stages={virtual} needs at least one block a "
                    f"virtual stage ({pp * virtual}); the model has n_layer={self.model.n_layer}"
                )
        if self.parallelism.tensor_parallel_size > 1:
            check_tensor_parallel(self.model, self.parallelism)
        return self


def check_tensor_parallel(model: ModelConfig, parallelism: ParallelismConfig) -> None:
    """That `model` splits evenly over the tensor-parallel ranks: whole key/value heads (so whole
    query groups) and whole MLP columns on each. An MoE model's layers are not split: each rank
    routes its slice of the tokens (sequence parallelism) to experts split over the group."""
    tp = parallelism.tensor_parallel_size
    if model.moe is not None and (not parallelism.splits_sequences or parallelism.expert_parallel_size != tp):
        raise ValueError(
            f"tensor_parallel_size={tp} with an MoE model needs sequence_parallel: true and "
            f"expert_parallel_size={tp}: each rank routes its slice of the sequence to the experts, which "
            "the tensor-parallel group splits between its ranks"
        )
    if model.n_kv_head % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's n_kv_head={model.n_kv_head}")
    if model.ffn_hidden % tp:
        raise ValueError(f"tensor_parallel_size={tp} must divide the model's MLP width {model.ffn_hidden}")


def resolved_precision(parallelism: ParallelismConfig) -> str:
    if parallelism.precision == "auto":
        return "bf16" if parallelism.use_gpu else "fp32"
    if parallelism.precision == "bf16" and not parallelism.use_gpu:
        logger.warning("precision=bf16 on CPU workers is slow; fp32 is the CPU default")
    return parallelism.precision


def data_parallel(rank: int, world: int, parallelism: ParallelismConfig) -> tuple[int, int]:
    """The data-parallel rank and size of worker `rank` of `world`, as DeepSpeed lays the ranks
    out (pipeline stage, then data-parallel rank, then tensor-parallel rank): the workers of a
    tensor-parallel group are consecutive ranks and train on one batch; the stages of a pipeline
    are `world / pipeline_parallel_size` ranks apart."""
    dp = world // parallelism.model_parallel_size
    return rank % (world // parallelism.pipeline_parallel_size) // parallelism.tensor_parallel_size, dp


def world_sizes(parallelism: ParallelismConfig) -> range:
    """Every world size the run may train at: num_workers, or min_workers..num_workers when elastic."""
    return range(parallelism.min_workers or parallelism.num_workers, parallelism.num_workers + 1)
