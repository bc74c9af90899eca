"""The resource planner: for a model, a training recipe and a cluster, every feasible layout
(TP x PP x DP x EP, micro-batches, virtual pipeline stages) with its per-GPU memory, pipeline
bubble, communication, step time, MFU, cost and failure-driven checkpoint interval.

Pure arithmetic on numbers: the model enters as a `ModelShape` (counted from the real model by
the caller), so the planner depends on nothing above `platform/`. Formulas, with sources:
- model states (Adam, DeepSpeed's accounting, STATE_BYTES): bf16 mixed precision keeps 2 bytes
  of bf16 weights + 18 bytes (bf16 and fp32 gradients, fp32 master weights, two fp32 Adam
  moments) per parameter; fp32 keeps 4 + 16 (gradients, DeepSpeed's fp32 partition copy, two
  moments), 4 + 12 without ZeRO. ZeRO-1 partitions the optimizer side but the gradients, ZeRO-2
  all of it, ZeRO-3 the weights too (plus a gathered layer); offload moves the partitioned
  optimizer side to CPU memory. ZeRO-1/2 add the gradient-reduction bucket DeepSpeed allocates
  (two with overlapped communication). Counted on the busiest GPU: tensor parallelism splits the
  blocks' linear layers, the pipeline the blocks, and an end stage keeps a vocabulary table
  (whole, or split by t when vocabulary-parallel).
- activations: what autograd keeps for this project's block (model/transformer.py), counted
  per token in elements: the block input, the two RMSNorm outputs, q, k and v (key/value heads
  repeated for attention under GQA), the attention output and its reshaped copy, the residual
  sum and the second norm's two outputs = 11 h, plus 4 f for the SwiGLU MLP (gate/up, SiLU,
  product); an MoE layer keeps 2 h + 5 f_e per routed row and 4 f_s for shared experts. Under
  tensor parallelism t the norm side (6 h) stays whole and the rest splits by t (Korthikanti et
  al. 2022, "Reducing Activation Recomputation", the same split for Megatron's GPT); with
  sequence parallelism the norm side and the blocks' inputs split by t too. The output
  layer keeps 3 h + V (its norm and the log-probabilities; the head is whole on every rank
  unless it is vocabulary-parallel, which splits V by t); backward briefly holds two V-wide gradients
  more, or with activation checkpointing (which keeps only each block's input) one block's
  recomputed activations. 1F1B keeps up to p micro-batches in flight on the first stage
  (interleaving adds (p-1)/(p*v) of that) and one on the last ((v-1)p + 1 chunks of 1/v of
  one, interleaved), which also holds the output layer and the logits DeepSpeed's 1F1B engine
  keeps (the interleaved engine keeps none): the busier of the two counts. tests/test_planner_memory.py checks the sum
  against the measured peak of real DeepSpeed runs.
- pipeline bubble, as a fraction of the step: (p-1)/(m+p-1) for 1F1B and (p-1)/(v*m+p-1) with v
  virtual stages per GPU (tests check both against the interleaved engine's order, simulated).
  Pipeline transfers: each micro-batch's activations cross each of a stage's v chunk boundaries
  forward and their gradients backward, 1/t of them a rank (whole, on the interleaved engine
  without sequence parallelism), so virtual stages multiply the bytes by v.
- communication, ring algorithms: all-reduce moves 2(n-1)/n of the buffer per GPU, reduce-
  scatter and all-gather (n-1)/n, all-to-all (n-1)/n. Tensor parallelism costs 4 all-reduces of
  the activations a layer (2 forward, 2 backward); sequence parallelism turns each into a
  reduce-scatter and an all-gather and adds one all-gather a norm in backward (the gathered
  input is recomputed rather than held): 1.25 times the bytes. An MoE block costs its
  attention's half of that, and its router's and shared experts' gradients summed over the
  group each micro-batch: its experts are split over the tp x ep ranks (the trainer runs tensor
  parallelism of an MoE model only with sequence parallelism and ep 1, each rank routing its
  1/t of the tokens to experts split over its group), and each routed row goes to its expert
  and back by all-to-all within them, forward and backward.
- reliability: Young-Daly checkpoint interval sqrt(2*delta*MTBF), expected time lost
  delta/tau + (tau/2 + restart)/MTBF.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import asdict, dataclass, field, replace

from lmfoundry.model.shape import ModelShape

BYTES_BF16 = 2
WORKSPACE_FRACTION = 0.10  # of GPU memory, see plan()
# bytes per parameter, DeepSpeed's accounting: (weights, whole gradients, gradient partitions,
# fp32 master copy and Adam's two moments). bf16 keeps bf16 gradients whole below ZeRO-2 and
# reduces them into fp32 partitions; fp32 keeps one set of fp32 gradients.
STATE_BYTES = {"bf16": (2, 2, 4, 12), "fp32": (4, 4, 0, 12)}


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
    sequence_parallel: bool = False  # under tensor parallelism (see activation_bytes)
    vocab_parallel: bool = False  # the head and the embedding split by t (on the end stages of a pipeline)
    micro_batch_size: int = 1
    precision: str = "bf16"  # or "fp32"
    reduce_bucket_size: int = 50_000_000  # elements, as in the pretrain config
    overlap_comm: bool = True
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
    micro_batch_size: int = 1
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


def vocab_split(layout: Layout, recipe: Recipe | None) -> bool:
    """Whether the output head and the embedding (tied or not) are split by vocabulary rows over
    the tensor-parallel group (in a pipeline, on the end stages): asked for, with tensor parallelism."""
    return recipe is not None and recipe.vocab_parallel and layout.tp > 1


def dense_params_per_gpu(shape: ModelShape, layout: Layout, recipe: Recipe | None = None) -> float:
    """The dense parameters the busiest GPU holds. Tensor parallelism splits the blocks' linear
    layers (the embedding, an untied head and the norms stay whole on each rank, as
    train/tensor_parallel.py lays the model out), and with `recipe.vocab_parallel` the head and
    the embedding (one table when tied) too. The pipeline spreads the blocks evenly over its
    stages but keeps the embedding on the first and the head (or, tied, the embedding again) on
    the last (train/pipeline_parallel.py), whole or, vocabulary-parallel, split by the tensor
    parallelism: the busier end stage holds one of them beside its blocks."""
    dense = shape.total_params - shape.expert_params
    whole = shape.replicated_params
    if layout.pp == 1:
        vocab = shape.embedding_params + shape.head_params if vocab_split(layout, recipe) else 0
        return (dense - whole + vocab) / layout.tp + whole - vocab
    first, last = shape.embedding_params, shape.head_params or shape.embedding_params
    norms = whole - shape.embedding_params - shape.head_params
    table = max(first, last) / (layout.tp if vocab_split(layout, recipe) else 1)
    return ((dense - whole) / layout.tp + norms) / layout.pp + table


def model_state_bytes(shape: ModelShape, layout: Layout, recipe: Recipe) -> dict:
    """Per-GPU bytes of weights, gradients, optimizer state (master copy and moments) and
    DeepSpeed's gradient-reduction buckets."""
    if recipe.precision not in STATE_BYTES:
        raise ValueError(f"precision {recipe.precision!r}; allowed: {', '.join(STATE_BYTES)}")
    w_bytes, g_whole, g_part, opt_bytes = STATE_BYTES[recipe.precision]
    if recipe.zero_stage == 0 and recipe.precision == "fp32":
        opt_bytes = 8  # torch's optimizer steps the fp32 weights themselves: no master copy
    local_dense = dense_params_per_gpu(shape, layout, recipe)
    local_expert = shape.expert_params / (layout.ep * layout.pp * layout.tp)
    dp_dense, dp_expert = layout.dp, max(layout.dp // layout.ep, 1)  # ZeRO partitions over these

    def states(psi: float, n: int) -> tuple[float, float, float]:
        stage = recipe.zero_stage
        weights = w_bytes * psi / (n if stage == 3 else 1)
        if stage == 0:
            grads = (g_whole + g_part) * psi
        elif stage == 1:
            grads = g_whole * psi + g_part * psi / n
        elif stage == 2:
            grads = (g_whole + g_part) * psi / n
        else:  # reduced straight into the fp32 partitions
            grads = (g_part or g_whole) * psi / n
        optimizer = opt_bytes * psi / (n if stage else 1)
        if recipe.offload_optimizer:  # partitions and moments live in CPU memory
            grads, optimizer = (g_whole * psi if stage < 2 else 0.0), 0.0
        return weights, grads, optimizer

    parts = [a + b for a, b in zip(states(local_dense, dp_dense), states(local_expert, dp_expert))]
    gathered = 2 * w_bytes * shape.largest_layer_params if recipe.zero_stage == 3 else 0.0
    buckets = 0.0
    if recipe.zero_stage in (1, 2):  # ZeRO-1 stages the fp32 accumulator, ZeRO-2 the training dtype
        bucket = min(recipe.reduce_bucket_size, local_dense + local_expert)
        buckets = bucket * (4 if recipe.zero_stage == 1 else w_bytes) * (2 if recipe.overlap_comm else 1)
    return {"weights": parts[0] + gathered, "gradients": parts[1], "optimizer": parts[2], "buckets": buckets}


def activation_bytes(shape: ModelShape, layout: Layout, recipe: Recipe, micro_batches: int) -> dict:
    """Per-GPU activation bytes: what the forward pass keeps for backward (for the micro-batches
    the schedule holds in flight) and what backward briefly adds on top (see the module doc)."""
    e = BYTES_BF16 if recipe.precision == "bf16" else 4
    tokens = recipe.seq_len * recipe.micro_batch_size
    h, t, p, v = shape.d_model, layout.tp, layout.pp, layout.virtual_stages
    # sequence parallelism splits by t what tensor parallelism keeps whole: the norm side and
    # each block's input (kept under checkpointing); the output layer's norm runs on a slice
    # and its whole output is gathered for the head
    split = t if recipe.sequence_parallel else 1
    attention_side = 6 * h / split + 5 * h / t  # per token, elements
    dense_layer = attention_side + 4 * shape.dense_ffn / t
    moe_layer = (
        attention_side
        + (shape.top_k * (2 * h + 5 * shape.expert_hidden) + 4 * shape.shared_hidden + shape.num_experts) / t
    )
    layers = (shape.n_layer - shape.moe_layers) * dense_layer + shape.moe_layers * moe_layer
    biggest_layer = moe_layer if shape.moe_layers else dense_layer
    # the logits are whole on every tensor-parallel rank, or each rank's slice of the vocabulary
    vocab = shape.vocab_size / (t if vocab_split(layout, recipe) else 1)
    output = h + 2 * h / split + vocab
    if recipe.activation_checkpointing:  # each block keeps its input; backward recomputes one block
        kept, backward = shape.n_layer * h / split, max(2 * vocab, biggest_layer)
    else:
        kept, backward = layers, 2 * vocab
    in_flight = min(micro_batches, p) * (1 + (p - 1) / (p * v) if v > 1 else 1)
    # in a pipeline the busiest stage is the first, which holds up to p micro-batches of its
    # layers' activations, or the last, which holds one, the output layer's and the logits
    # themselves, and in backward the logits' gradients; checkpointing recomputes a block on
    # either. DeepSpeed's pipeline engine keeps the last stage's outputs in two buffers it
    # never clears, so two micro-batches' logits can be alive; one counted matches the
    # measured peaks of the last stage better (benchmarks/peak_memory.py: within 6%, two
    # would give 6-13% above)
    first = (kept / p * in_flight, biggest_layer if recipe.activation_checkpointing else 0.0)
    last_chunks = min(micro_batches * v, (v - 1) * p + 1)  # Megatron's interleaved warm-up; 1 at v = 1
    # the interleaved engine (v > 1) keeps no copy of the logits beside autograd's
    engine_logits = vocab if v == 1 else 0.0
    last = (kept / (p * v) * last_chunks + output + engine_logits, backward)
    kept_now, transient = max(first, last, key=sum) if p > 1 else (kept + output, backward)
    return {"activations": kept_now * tokens * e, "backward_transient": transient * tokens * e}


def training_memory_bytes(shape: ModelShape, layout: Layout, recipe: Recipe, micro_batches: int = 1) -> dict:
    """Per-GPU bytes by part, and the peak: the larger of what is resident when backward starts
    (activations at their largest; gradients only where DeepSpeed keeps them between steps:
    ZeRO-1's accumulator and bucket, or any stage accumulating over micro-batches) and when the
    optimizer steps (every state, the activations gone). Measured against real runs in
    tests/test_planner_memory.py."""
    states = model_state_bytes(shape, layout, recipe)
    acts = activation_bytes(shape, layout, recipe, micro_batches)
    kept_grads = 0.0
    if recipe.zero_stage == 1:
        kept_grads = states["gradients"] + states["buckets"]
    elif micro_batches > 1:
        kept_grads = states["gradients"]
    backward_start = states["weights"] + states["optimizer"] + kept_grads + sum(acts.values())
    optimizer_step = sum(states.values())
    return {
        **states,
        **acts,
        "at_backward_start": backward_start,
        "at_optimizer_step": optimizer_step,
        "total": max(backward_start, optimizer_step),
    }


def _ring(kind: str, n: int) -> float:
    if n <= 1:
        return 0.0
    return {
        "all_reduce": 2 * (n - 1) / n,
        "reduce_scatter": (n - 1) / n,
        "all_gather": (n - 1) / n,
        "all_to_all": (n - 1) / n,
    }[kind]


def _bandwidth(cluster: Cluster, span: int) -> float:
    """GB/s per GPU of a group whose members are `span` consecutive GPUs."""
    return cluster.gpu.intra_node_gbs if span <= cluster.gpus_per_node else cluster.gpu.inter_node_gbs


def plan(shape: ModelShape, recipe: Recipe, cluster: Cluster, layout: Layout) -> Plan:
    if layout.tp * layout.pp * layout.dp != cluster.gpus:
        raise ValueError(
            f"layout tp={layout.tp} x pp={layout.pp} x dp={layout.dp} = "
            f"{layout.tp * layout.pp * layout.dp} does not use the cluster's {cluster.gpus} GPUs"
        )
    if layout.ep > 1 and (layout.dp % layout.ep or shape.num_experts % layout.ep):
        raise ValueError(f"ep={layout.ep} must divide dp={layout.dp} and the {shape.num_experts} experts")
    if shape.n_layer % (layout.pp * layout.virtual_stages):
        raise ValueError(
            f"{shape.n_layer} layers do not split into pp={layout.pp} x virtual {layout.virtual_stages} stages"
        )
    tokens_per_micro = recipe.seq_len * recipe.micro_batch_size
    per_replica = recipe.global_batch_tokens / layout.dp
    if per_replica % tokens_per_micro:
        raise ValueError(
            f"global_batch_tokens={recipe.global_batch_tokens} is not a whole number of "
            f"micro-batches ({tokens_per_micro} tokens) per data-parallel replica (dp={layout.dp})"
        )
    m = int(per_replica // tokens_per_micro)
    if layout.virtual_stages > 1 and m % layout.pp:
        raise ValueError(  # the interleaved schedule's groups of pp micro-batches (train/pipeline_schedule.py)
            f"virtual stages run a step's micro-batches in groups of pp={layout.pp}: {m} micro-batches "
            f"per replica are not a multiple of {layout.pp}"
        )
    result = Plan(layout=layout, micro_batches=m, micro_batch_size=recipe.micro_batch_size)

    mem = training_memory_bytes(shape, layout, recipe, m)
    # an allowance, not derived: CUDA context, NCCL buffers, kernel workspaces, allocator fragmentation
    mem["workspace"] = WORKSPACE_FRACTION * cluster.gpu.memory_gb * 2**30
    mem["total"] += mem["workspace"]  # the two moments' figures leave it out
    result.memory_gb = {k: v / 2**30 for k, v in mem.items()}
    total_gb = result.memory_gb["total"]
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
    dense_local = dense_params_per_gpu(shape, layout, recipe)
    expert_local = shape.expert_params / (layout.ep * layout.pp * layout.tp)
    grad_kind = "all_reduce" if recipe.zero_stage <= 1 else "reduce_scatter"
    dp_gb = (
        BYTES_BF16
        * (dense_local * _ring(grad_kind, layout.dp) + expert_local * _ring(grad_kind, max(layout.dp // layout.ep, 1)))
        / 1e9
    )
    if recipe.zero_stage >= 2:  # updated weights gathered back (stage 2), or gathered per use (stage 3)
        gathers = 1 if recipe.zero_stage == 2 else 2
        dp_gb += gathers * BYTES_BF16 * dense_local * _ring("all_gather", layout.dp) / 1e9
    layers_local, moe_local = shape.n_layer / layout.pp, shape.moe_layers / layout.pp
    # a dense block all-reduces its activations 4 times (2 forward, 2 backward); an MoE block 2,
    # its attention's: its MoE layer routes the rank's own slice of the tokens
    tp_gb = (4 * layers_local - 2 * moe_local) * m * BYTES_BF16 * s * b * h * _ring("all_reduce", layout.tp) / 1e9
    if recipe.sequence_parallel:  # backward gathers each of the 2 norms' outputs a layer again
        tp_gb *= 1.25
    if shape.num_experts:  # the routers' and shared experts' gradients, summed over the group each micro-batch
        routers = moe_local * shape.d_model * (shape.num_experts + 3 * shape.shared_hidden)
        tp_gb += m * BYTES_BF16 * routers * _ring("all_reduce", layout.tp) / 1e9
    # each micro-batch crosses each of a stage's v chunk boundaries forward and backward; a rank
    # sends 1/t of the activations (DeepSpeed's partitioned transfers; its own slice under
    # sequence parallelism), or, on the interleaved engine without it, the whole
    shard = layout.tp if layout.virtual_stages == 1 or recipe.sequence_parallel else 1
    pp_gb = 2 * layout.virtual_stages * m * BYTES_BF16 * s * b * h / shard / 1e9 if layout.pp > 1 else 0.0
    # each MoE layer's routed rows go to their experts and back, forward and backward, within the
    # tp x ep ranks that split the experts; under tensor parallelism a rank routes 1/tp of the tokens
    a2a_gb = (
        4
        * moe_local
        * m
        * BYTES_BF16
        * s
        * b
        * h
        * shape.top_k
        / layout.tp
        * _ring("all_to_all", layout.tp * layout.ep)
        / 1e9
        if shape.num_experts
        else 0.0
    )
    result.comm_gb_per_step = {
        "data_parallel": dp_gb,
        "tensor_parallel": tp_gb,
        "pipeline": pp_gb,
        "expert_all_to_all": a2a_gb,
    }
    # groups are laid out tp innermost, then ep within dp, then pp: a group spans its size times
    # the product of the inner dimensions' sizes
    bw = {
        "data_parallel": _bandwidth(cluster, layout.tp * layout.dp),
        "tensor_parallel": _bandwidth(cluster, layout.tp),
        "pipeline": _bandwidth(cluster, layout.tp * layout.dp * layout.pp),
        "expert_all_to_all": _bandwidth(cluster, layout.tp * layout.ep),
    }
    result.comm_s = {k: gb / bw[k] for k, gb in result.comm_gb_per_step.items()}
    # gradient reduction overlaps the backward pass (2/3 of compute); the rest is on the critical path
    exposed_dp = max(0.0, result.comm_s["data_parallel"] - (2 / 3) * compute_s)
    result.exposed_comm_s = (
        exposed_dp + result.comm_s["tensor_parallel"] + result.comm_s["pipeline"] + result.comm_s["expert_all_to_all"]
    )
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


def search(
    shape: ModelShape,
    recipe: Recipe,
    cluster: Cluster,
    max_virtual_stages: int = 4,
    micro_batch_sizes: tuple[int, ...] = (1, 2, 4, 8),
) -> list[Plan]:
    """Every layout and micro-batch size that divides the cluster, the model and the batch:
    fitting ones first, fastest first, and of equally fast ones the largest micro-batch (this
    model of step time does not see that bigger matmuls run closer to the peak; kernels do)."""
    plans = []
    # whole heads, whole key/value heads and whole MLP columns on each rank (the trainer refuses
    # other sizes: `plan --write-config` checks the config for that)
    tps = [
        t
        for t in _divisors(cluster.gpus_per_node)
        if shape.n_head % t == 0 and shape.kv_heads % t == 0 and shape.dense_ffn % t == 0
    ]
    for tp, pp in itertools.product(tps, _divisors(cluster.gpus)):
        if cluster.gpus % (tp * pp) or shape.n_layer % pp:
            continue
        dp = cluster.gpus // (tp * pp)
        eps = [e for e in _divisors(dp) if shape.num_experts % e == 0] if shape.num_experts else [1]
        if shape.num_experts and tp > 1:
            # the trainer splits an MoE model's experts over the tensor-parallel group alone, each
            # rank routing its slice of the sequence: with sequence parallelism only
            if not recipe.sequence_parallel:
                continue
            eps = [1]
        vs = [v for v in range(1, max_virtual_stages + 1) if shape.n_layer % (pp * v) == 0] if pp > 1 else [1]
        for ep, v, mbs in itertools.product(eps, vs, micro_batch_sizes):
            try:
                plans.append(plan(shape, replace(recipe, micro_batch_size=mbs), cluster, Layout(tp, pp, dp, ep, v)))
            except ValueError:
                continue  # e.g. the global batch does not split into whole micro-batches
    plans.sort(key=lambda p: (not p.fits, -float(f"{p.tokens_per_s:.9g}"), -p.micro_batch_size))
    return plans
