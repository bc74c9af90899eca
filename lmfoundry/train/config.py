"""The pretraining config and the one function that derives DeepSpeed's JSON from it."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, model_validator

from lmfoundry.model.transformer import ModelConfig
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


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


class PretrainConfig(StageConfig):
    data: str = Field(..., description="a pack output directory (train/, val/, tokenizer.json)")
    output: str = Field(..., description="the run directory: checkpoints and the run manifest")
    model: ModelConfig = ModelConfig()
    num_workers: int = Field(2, ge=1, description="workers; with min_workers, the most the run grows to")
    min_workers: int | None = Field(
        None,
        ge=1,
        description="elastic: Ray Train goes on with as few as this "
        "many workers when some are lost, and grows back towards num_workers as "
        "resources return (None: a fixed num_workers)",
    )
    elastic_resize_interval_s: float = Field(
        60.0, gt=0, description="elastic: how often a running group checks for resources to grow into"
    )
    cpus_per_worker: float = Field(1.0, gt=0)
    worker_resources: dict[str, float] = Field(
        default_factory=dict,
        description="more Ray resources each worker "
        "needs besides CPUs (and a GPU with use_gpu), e.g. a custom resource "
        "that only training nodes have",
    )
    use_gpu: bool = False
    zero_stage: int = Field(2, ge=0, le=3, description="0-3; 3 partitions the weights too (not with MoE)")
    offload_optimizer: bool = Field(
        False,
        description="keep the optimizer's partition (moments, fp32 master "
        "weights) in CPU memory and step it there; ZeRO stages 1-3",
    )
    reduce_bucket_size: int = Field(
        50_000_000,
        ge=1,
        description="elements per ZeRO gradient-reduction "
        "bucket; DeepSpeed allocates one (two with overlapped communication) a micro-step",
    )
    expert_parallel_size: int = Field(1, ge=1, description="workers that split each MoE layer's experts")
    precision: Literal["auto", "fp32", "bf16"] = "auto"
    micro_batch_size: int = Field(8, ge=1, description="sequences per worker per forward pass")
    global_batch_tokens: int = Field(4096, ge=1, description="tokens per optimizer step, all workers")
    max_steps: int = Field(200, ge=1)
    lr: float = Field(3e-3, gt=0)
    min_lr_ratio: float = Field(0.1, ge=0, le=1)
    warmup_steps: int = Field(20, ge=0)
    lr_schedule: Literal["cosine", "wsd"] = Field(
        "cosine",
        description="warmup + cosine, or warmup-stable-"
        "decay (constant after warmup, decayed over the last decay_fraction)",
    )
    decay_fraction: float = Field(0.2, gt=0, le=1, description="wsd: share of max_steps spent decaying")
    decay_shape: Literal["linear", "sqrt"] = Field(
        "sqrt", description="wsd: linear, or 1 - sqrt (Hägele et al. 2024 found it better)"
    )
    weight_decay: float = Field(0.1, ge=0)
    betas: tuple[float, float] = (0.9, 0.95)
    grad_clip: float = Field(1.0, ge=0)
    checkpoint_every: int = Field(100, ge=1)
    keep_checkpoints: int = Field(
        2,
        ge=2,
        description="the newest K checkpoints are kept (at least 2, so that a corrupt newest one has a predecessor)",
    )
    keep_every: int = Field(
        0, ge=0, description="also keep every checkpoint whose step is a multiple of this (0: none)"
    )
    max_failures: int = Field(3, ge=0, description="worker-group restarts before the run fails")
    shuffle_buffer: int = Field(1024, ge=0, description="sequences in the seeded local shuffle (0: file order)")
    stage_dir: str | None = Field(
        None,
        description="local directory where checkpoints are staged before "
        "the upload; default: shared memory (/dev/shm) where there is some",
    )
    spike_factor: float | None = Field(
        None,
        gt=1,
        description="a step loss above this multiple of the "
        "running median rolls back to the last checkpoint before it and skips the "
        "batches since (None: off)",
    )
    spike_window: int = Field(20, ge=2, description="steps in the running median of the loss")
    straggler_factor: float = Field(
        1.5,
        gt=1,
        description="a worker busier than this multiple of the "
        "fastest one over a logging interval is reported as a straggler",
    )
    drills: list[FaultDrill] = Field(default_factory=list, description="failures to inject")
    log_every: int = Field(10, ge=1)
    peak_tflops_per_worker: float | None = Field(
        None, gt=0, description="device peak for MFU; None: the bf16 peak of a known GPU, no MFU on CPU"
    )
    seed: int = 0
    overwrite: bool = False

    @model_validator(mode="after")
    def _check(self) -> PretrainConfig:
        ep = self.expert_parallel_size
        if ep > 1:
            if self.model.moe is None:
                raise ValueError(f"expert_parallel_size={ep} needs an MoE model (set model.moe)")
            if self.num_workers % ep or self.model.moe.num_experts % ep:
                raise ValueError(
                    f"expert_parallel_size={ep} must divide num_workers={self.num_workers} "
                    f"and model.moe.num_experts={self.model.moe.num_experts}"
                )
        if self.offload_optimizer and self.zero_stage == 0:
            raise ValueError(
                "offload_optimizer needs zero_stage 1, 2 or 3 (ZeRO-Offload moves the optimizer's partition)"
            )
        if self.zero_stage == 3 and self.model.moe is not None:
            raise ValueError("zero_stage=3 with an MoE model: DeepSpeed's MoE layers support ZeRO stages 0-2")
        if self.min_workers is not None:
            if self.min_workers > self.num_workers:
                raise ValueError(f"min_workers={self.min_workers} must not exceed num_workers={self.num_workers}")
            if ep > 1:
                raise ValueError(
                    f"min_workers (elastic) with expert_parallel_size={ep}: a change of world size "
                    "needs every expert's state in one checkpoint format, which expert parallelism "
                    "does not write; use a fixed num_workers"
                )
        for drill in self.drills:
            if drill.rank >= self.num_workers:
                raise ValueError(f"drills: rank {drill.rank} does not exist with num_workers={self.num_workers}")
            if drill.during_save and drill.at_step % self.checkpoint_every:
                raise ValueError(
                    f"drills: at_step={drill.at_step} with during_save needs a checkpoint at that "
                    f"step (checkpoint_every={self.checkpoint_every})"
                )
        if self.warmup_steps >= self.max_steps:
            raise ValueError(f"warmup_steps={self.warmup_steps} must be below max_steps={self.max_steps}")
        return self


def resolved_precision(cfg: PretrainConfig) -> str:
    if cfg.precision == "auto":
        return "bf16" if cfg.use_gpu else "fp32"
    if cfg.precision == "bf16" and not cfg.use_gpu:
        logger.warning("precision=bf16 on CPU workers is slow; fp32 is the CPU default")
    return cfg.precision


def world_sizes(cfg: PretrainConfig) -> range:
    """Every world size the run may train at: num_workers, or min_workers..num_workers when elastic."""
    return range(cfg.min_workers or cfg.num_workers, cfg.num_workers + 1)


def gradient_accumulation(cfg: PretrainConfig, world_size: int, seq_len: int) -> int:
    """Micro-steps per optimizer step, from the global batch in tokens."""
    per_micro_step = cfg.micro_batch_size * world_size * seq_len
    if cfg.global_batch_tokens % per_micro_step:
        raise ValueError(
            f"global_batch_tokens={cfg.global_batch_tokens} must be a multiple of micro_batch_size "
            f"x workers x seq_len = {cfg.micro_batch_size} x {world_size} x {seq_len} = {per_micro_step}"
        )
    return cfg.global_batch_tokens // per_micro_step


def reduce_bucket_elements(cfg: PretrainConfig, num_params: int | None) -> int:
    """The configured bucket, but never more than the model: a bigger one holds nothing more."""
    return min(cfg.reduce_bucket_size, num_params) if num_params else cfg.reduce_bucket_size


def deepspeed_config(cfg: PretrainConfig, world_size: int, seq_len: int, num_params: int | None = None) -> dict:
    accum = gradient_accumulation(cfg, world_size, seq_len)
    bucket = reduce_bucket_elements(cfg, num_params)
    return {
        "train_micro_batch_size_per_gpu": cfg.micro_batch_size,
        "gradient_accumulation_steps": accum,
        "train_batch_size": cfg.micro_batch_size * accum * world_size,
        "gradient_clipping": cfg.grad_clip,
        "zero_optimization": {
            "stage": cfg.zero_stage,
            "contiguous_gradients": True,
            "overlap_comm": cfg.use_gpu,
            "reduce_bucket_size": bucket,
            "allgather_bucket_size": bucket,
            **({"offload_optimizer": {"device": "cpu", "pin_memory": cfg.use_gpu}} if cfg.offload_optimizer else {}),
        },
        "bf16": {"enabled": resolved_precision(cfg) == "bf16"},
        # torch's AdamW, except for an offloaded optimizer on GPU machines: there DeepSpeed's CPU Adam
        # (vectorised C++, compiled on first use) steps the partition in host memory many times faster.
        "optimizer": {
            "type": "AdamW",
            "params": {
                "lr": cfg.lr,
                "betas": list(cfg.betas),
                "eps": 1e-8,
                "weight_decay": cfg.weight_decay,
                **({} if cfg.offload_optimizer and cfg.use_gpu else {"torch_adam": True}),
            },
        },
        # warmup-stable-decay has no DeepSpeed scheduler: build_engine hands DeepSpeed a WSDSchedule
        **(
            {
                "scheduler": {
                    "type": "WarmupCosineLR",
                    "params": {
                        "total_num_steps": cfg.max_steps,
                        "warmup_num_steps": cfg.warmup_steps,
                        "warmup_type": "linear",
                        "warmup_min_ratio": 0.0,
                        "cos_min_ratio": cfg.min_lr_ratio,
                    },
                }
            }
            if cfg.lr_schedule == "cosine"
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


def wsd_schedule(cfg: PretrainConfig) -> WSDSchedule:
    return WSDSchedule(cfg.max_steps, cfg.warmup_steps, cfg.decay_fraction, cfg.min_lr_ratio, cfg.decay_shape)
