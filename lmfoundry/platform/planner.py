"""The resource planner: for a model, a training recipe and a cluster, every feasible layout
(TP x PP x DP x EP, micro-batches, virtual pipeline stages) with its per-GPU memory, pipeline
bubble, communication, step time, MFU, cost and failure-driven checkpoint interval.

Pure arithmetic on numbers: the model enters as a `ModelShape` (counted from the real model by
the caller), so the planner depends on nothing above `platform/`. Formulas, with sources:
- model states (mixed-precision Adam, DeepSpeed's accounting): 2 bytes bf16 weights + 18 bytes
  (bf16 and fp32 gradients, fp32 master weights, two fp32 Adam moments) per parameter; ZeRO-1
  partitions the 16 optimizer-side bytes, ZeRO-2 all 18, ZeRO-3 the weights too (plus a gathered
  layer); offload moves the partitioned optimizer side to CPU memory.
- activations (Korthikanti et al. 2022, "Reducing Activation Recomputation", with flash
  attention so no s x s score matrix is kept): s*b*h*(10 + 24/t) bytes per layer under tensor
  parallelism t; full recomputation keeps only the 2*s*b*h-byte layer input. 1F1B keeps up to
  p micro-batches in flight on the first stage; interleaving adds (p-1)/(p*v) of that.
- pipeline bubble, as a fraction of the step: (p-1)/(m+p-1) for 1F1B and (p-1)/(v*m+p-1) with v
  virtual stages per GPU (tests check both against a simulated schedule).
- communication, ring algorithms: all-reduce moves 2(n-1)/n of the buffer per GPU, reduce-
  scatter and all-gather (n-1)/n, all-to-all (n-1)/n.
- reliability: Young-Daly checkpoint interval sqrt(2*delta*MTBF), expected time lost
  delta/tau + (tau/2 + restart)/MTBF.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field

BYTES_BF16 = 2
BYTES_OPTIMIZER_SIDE = 18  # per parameter: 2 bf16 grad + 4 fp32 grad + 4 fp32 master + 8 Adam m, v


@dataclass(frozen=True)
class GPU:
    name: str
    memory_gb: float
    bf16_tflops: float  # dense peak
    fp8_tflops: float | None
    intra_node_gbs: float  # GB/s per GPU per direction (NVLink/NVSwitch)
    inter_node_gbs: float  # GB/s per GPU per direction (InfiniBand / RoCE NIC)


# Vendors' data sheets (SXM parts, dense, no sparsity); one 400 Gb/s NIC per GPU on H100/H200/A100
# clusters, 800 Gb/s on B200.
GPUS = {
    "A100": GPU("A100-80GB", 80, 312, None, 300, 25),
    "H100": GPU("H100-SXM", 80, 989, 1979, 450, 50),
    "H200": GPU("H200-SXM", 141, 989, 1979, 450, 50),
    "B200": GPU("B200", 192, 2250, 4500, 900, 100),
}


def gpu(name: str) -> GPU:
    if name not in GPUS:
        raise ValueError(f"unknown GPU type {name!r}; known: {', '.join(sorted(GPUS))}")
    return GPUS[name]


@dataclass(frozen=True)
class ModelShape:
    total_params: int
    expert_params: int  # routed-expert weights, all experts (0 for a dense model)
    largest_layer_params: int  # the biggest single module, gathered whole under ZeRO-3
    train_flops_per_token: int  # at seq_len, forward + backward
    n_layer: int
    d_model: int
    n_head: int
    top_k: int = 0
    num_experts: int = 0


@dataclass(frozen=True)
class Cluster:
    gpu: GPU
    gpus_per_node: int
    nodes: int
    price_per_gpu_hour: float = 2.5
    failures_per_gpu_day: float = 1e-3  # hardware and software interruptions per GPU per day
    storage_gbs: float = 10.0  # checkpoint write bandwidth, GB/s, whole job
    restart_s: float = 300.0

    @property
    def gpus(self) -> int:
        return self.gpus_per_node * self.nodes


@dataclass(frozen=True)
class Recipe:
    seq_len: int
    global_batch_tokens: int
    token_budget: float
    zero_stage: int = 1
    offload_optimizer: bool = False
    activation_checkpointing: bool = False
    micro_batch_size: int = 1
    achievable_fraction: float = 0.6  # of the peak a well-tuned kernel mix reaches for matmuls


@dataclass(frozen=True)
class Layout:
    tp: int
    pp: int
    dp: int
    ep: int = 1
    virtual_stages: int = 1


@dataclass
class Plan:
    layout: Layout
    micro_batches: int  # per pipeline per step, per data-parallel replica
    memory_gb: dict = field(default_factory=dict)
    fits: bool = False
    headroom_gb: float = 0.0
    bubble: float = 0.0
    comm_gb_per_step: dict = field(default_factory=dict)
    comm_s: dict = field(default_factory=dict)
    exposed_comm_s: float = 0.0
    step_s: float = 0.0
    tokens_per_s: float = 0.0
    mfu: float = 0.0
    days: float = 0.0
    gpu_hours: float = 0.0
    cost: float = 0.0
    failures_per_day: float = 0.0
    checkpoint_write_s: float = 0.0
    checkpoint_interval_s: float = 0.0
    failure_overhead: float = 0.0

    def as_dict(self) -> dict:
        return asdict(self)


def bubble_fraction(p: int, m: int, v: int = 1) -> float:
    """Idle share of a pipeline step: (p-1)/(v*m + p-1) in units of one virtual stage's work."""
    if p < 1 or m < 1 or v < 1:
        raise ValueError(f"pipeline stages p={p}, micro-batches m={m}, virtual stages v={v} must be >= 1")
    return (p - 1) / (v * m + p - 1)


def model_state_bytes(shape: ModelShape, layout: Layout, recipe: Recipe) -> dict:
    """Per-GPU bytes of weights, gradients and optimizer state."""
    dense = shape.total_params - shape.expert_params
    local_dense = dense / (layout.tp * layout.pp)
    local_expert = shape.expert_params / (layout.ep * layout.pp * layout.tp)
    dp_dense, dp_expert = layout.dp, max(layout.dp // layout.ep, 1)  # ZeRO partitions over these

    def states(psi: float, n: int) -> tuple[float, float]:
        # DeepSpeed's accounting (its estimate_zero*_model_states_mem_needs): 2 + 18 bytes per
        # parameter below stage 3, 18 partitioned bytes in all at stage 3
        if recipe.zero_stage == 0:
            weights, rest = BYTES_BF16 * psi, BYTES_OPTIMIZER_SIDE * psi
        elif recipe.zero_stage == 1:
            weights, rest = BYTES_BF16 * psi, 2 * psi + 16 * psi / n  # bf16 grads whole, fp32 side split
        elif recipe.zero_stage == 2:
            weights, rest = BYTES_BF16 * psi, BYTES_OPTIMIZER_SIDE * psi / n
        else:
            weights, rest = BYTES_BF16 * psi / n, (BYTES_OPTIMIZER_SIDE - BYTES_BF16) * psi / n
        if recipe.offload_optimizer:  # the fp32 side lives in CPU memory; bf16 grads stay whole below stage 2
            rest = 2 * psi if recipe.zero_stage < 2 else 0.0
        return weights, rest

    w1, r1 = states(local_dense, dp_dense)
    w2, r2 = states(local_expert, dp_expert)
    gathered = 4 * shape.largest_layer_params if recipe.zero_stage == 3 else 0.0
    return {"weights": w1 + w2 + gathered, "grads_and_optimizer": r1 + r2}


def activation_bytes(shape: ModelShape, layout: Layout, recipe: Recipe, micro_batches: int) -> float:
    s, b, h = recipe.seq_len, recipe.micro_batch_size, shape.d_model
    t, p, v = layout.tp, layout.pp, layout.virtual_stages
    per_layer = 2 * s * b * h if recipe.activation_checkpointing else s * b * h * (10 + 24 / t)
    if shape.num_experts:  # top-k copies of the MoE hidden input and output per token
        per_layer += 0 if recipe.activation_checkpointing else 4 * s * b * h * shape.top_k / t
    layers_per_gpu = shape.n_layer / p
    in_flight = min(micro_batches, p) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    return per_layer * layers_per_gpu * in_flight


def _ring(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {"all_reduce": 2 * (n - 1) / n, "reduce_scatter": (n - 1) / n, "all_gather": (n - 1) / n,
            "all_to_all": (n - 1) / n}[kind]


def _bandwidth(cluster: Cluster, span: int) -> float:
    """GB/s per GPU of a group whose members are `span` consecutive GPUs."""
    return cluster.gpu.intra_node_gbs if span <= cluster.gpus_per_node else cluster.gpu.inter_node_gbs


def plan(shape: ModelShape, recipe: Recipe, cluster: Cluster, layout: Layout) -> Plan:
    if layout.tp * layout.pp * layout.dp != cluster.gpus:
        raise ValueError(f"layout tp={layout.tp} x pp={layout.pp} x dp={layout.dp} = "
                         f"{layout.tp * layout.pp * layout.dp} does not use the cluster's {cluster.gpus} GPUs")
    if layout.ep > 1 and (layout.dp % layout.ep or shape.num_experts % layout.ep):
        raise ValueError(f"ep={layout.ep} must divide dp={layout.dp} and the {shape.num_experts} experts")
    if shape.n_layer % (layout.pp * layout.virtual_stages):
        raise ValueError(f"{shape.n_layer} layers do not split into pp={layout.pp} x virtual "
                         f"{layout.virtual_stages} stages")
    tokens_per_micro = recipe.seq_len * recipe.micro_batch_size
    per_replica = recipe.global_batch_tokens / layout.dp
    if per_replica % tokens_per_micro:
        raise ValueError(f"global_batch_tokens={recipe.global_batch_tokens} is not a whole number of "
                         f"micro-batches ({tokens_per_micro} tokens) per data-parallel replica (dp={layout.dp})")
    m = int(per_replica // tokens_per_micro)
    result = Plan(layout=layout, micro_batches=m)

    states = model_state_bytes(shape, layout, recipe)
    acts = activation_bytes(shape, layout, recipe, m)
    buffers = 0.1 * cluster.gpu.memory_gb * 2**30  # allocator fragmentation, comm buffers, workspace
    mem = {**states, "activations": acts, "buffers": buffers}
    result.memory_gb = {k: v / 2**30 for k, v in mem.items()}
    total_gb = sum(result.memory_gb.values())
    result.memory_gb["total"] = total_gb
    result.headroom_gb = cluster.gpu.memory_gb - total_gb
    result.fits = result.headroom_gb >= 0

    # compute: the step's FLOPs spread over all GPUs, at the achievable share of the peak
    step_flops = shape.train_flops_per_token * recipe.global_batch_tokens
    if recipe.activation_checkpointing:
        step_flops *= 4 / 3  # one more forward pass
    compute_s = step_flops / cluster.gpus / (cluster.gpu.bf16_tflops * 1e12 * recipe.achievable_fraction)
    result.bubble = bubble_fraction(layout.pp, m, layout.virtual_stages)
    pipelined_s = compute_s / (1 - result.bubble)

    # communication per GPU per step, GB
    s, b, h = recipe.seq_len, recipe.micro_batch_size, shape.d_model
    dense_local = (shape.total_params - shape.expert_params) / (layout.tp * layout.pp)
    expert_local = shape.expert_params / (layout.ep * layout.pp * layout.tp)
    grad_kind = "all_reduce" if recipe.zero_stage <= 1 else "reduce_scatter"
    dp_gb = BYTES_BF16 * (dense_local * _ring(grad_kind, layout.dp)
                          + expert_local * _ring(grad_kind, max(layout.dp // layout.ep, 1))) / 1e9
    if recipe.zero_stage >= 2:  # updated weights gathered back (stage 2), or gathered per use (stage 3)
        gathers = 1 if recipe.zero_stage == 2 else 2
        dp_gb += gathers * BYTES_BF16 * dense_local * _ring("all_gather", layout.dp) / 1e9
    layers_local = shape.n_layer / layout.pp
    tp_gb = 4 * layers_local * m * BYTES_BF16 * s * b * h * _ring("all_reduce", layout.tp) / 1e9
    pp_gb = 2 * m * BYTES_BF16 * s * b * h / layout.tp / 1e9 if layout.pp > 1 else 0.0
    a2a_gb = (4 * layers_local * m * BYTES_BF16 * s * b * h * shape.top_k * _ring("all_to_all", layout.ep) / 1e9
              if shape.num_experts else 0.0)
    result.comm_gb_per_step = {"data_parallel": dp_gb, "tensor_parallel": tp_gb, "pipeline": pp_gb,
                               "expert_all_to_all": a2a_gb}
    # groups are laid out tp innermost, then ep within dp, then pp: a group spans its size times
    # the product of the inner dimensions' sizes
    bw = {"data_parallel": _bandwidth(cluster, layout.tp * layout.dp), "tensor_parallel": _bandwidth(cluster, layout.tp),
          "pipeline": _bandwidth(cluster, layout.tp * layout.dp * layout.pp), "expert_all_to_all":
          _bandwidth(cluster, layout.tp * layout.ep)}
    result.comm_s = {k: gb / bw[k] for k, gb in result.comm_gb_per_step.items()}
    # gradient reduction overlaps the backward pass (2/3 of compute); the rest is on the critical path
    exposed_dp = max(0.0, result.comm_s["data_parallel"] - (2 / 3) * compute_s)
    result.exposed_comm_s = exposed_dp + result.comm_s["tensor_parallel"] + result.comm_s["pipeline"] \
        + result.comm_s["expert_all_to_all"]
    result.step_s = pipelined_s + result.exposed_comm_s
    result.tokens_per_s = recipe.global_batch_tokens / result.step_s
    model_flops = shape.train_flops_per_token * recipe.global_batch_tokens
    result.mfu = model_flops / result.step_s / cluster.gpus / (cluster.gpu.bf16_tflops * 1e12)

    # reliability: Young-Daly
    state_bytes = shape.total_params * (BYTES_BF16 + 12)  # weights + fp32 master and Adam moments
    result.checkpoint_write_s = state_bytes / (cluster.storage_gbs * 1e9)
    result.failures_per_day = cluster.gpus * cluster.failures_per_gpu_day
    mtbf_s = 86400 / result.failures_per_day
    tau = math.sqrt(2 * result.checkpoint_write_s * mtbf_s)
    result.checkpoint_interval_s = tau
    result.failure_overhead = min(1.0, result.checkpoint_write_s / tau + (tau / 2 + cluster.restart_s) / mtbf_s)

    train_s = recipe.token_budget / result.tokens_per_s / (1 - result.failure_overhead)
    result.days = train_s / 86400
    result.gpu_hours = train_s / 3600 * cluster.gpus
    result.cost = result.gpu_hours * cluster.price_per_gpu_hour
    return result


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(shape: ModelShape, recipe: Recipe, cluster: Cluster, max_virtual_stages: int = 4) -> list[Plan]:
    """Every layout that divides the cluster and the model, fitting ones first, fastest first."""
    plans = []
    tps = [t for t in _divisors(cluster.gpus_per_node) if shape.n_head % t == 0]
    for tp, pp in itertools.product(tps, _divisors(cluster.gpus)):
        if cluster.gpus % (tp * pp) or shape.n_layer % pp:
            continue
        dp = cluster.gpus // (tp * pp)
        eps = [e for e in _divisors(dp) if shape.num_experts % e == 0] if shape.num_experts else [1]
        vs = [v for v in range(1, max_virtual_stages + 1) if shape.n_layer % (pp * v) == 0] if pp > 1 else [1]
        for ep, v in itertools.product(eps, vs):
            try:
                plans.append(plan(shape, recipe, cluster, Layout(tp, pp, dp, ep, v)))
            except ValueError:
                continue  # e.g. the global batch does not split into whole micro-batches
    plans.sort(key=lambda p: (not p.fits, -p.tokens_per_s))
    return plans
