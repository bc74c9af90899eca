"""Train the pretraining model under tensor and pipeline parallelism and under data parallelism
alone, on spawned gloo processes, to hold the layouts to the same losses.

Each rank builds the model and its DeepSpeed engine as the training loop does
(train/pretrain.py's build_pretrain_engine) and trains on seeded tokens: every step's global
batch is the same whatever the layout, and the ranks of a tensor-parallel group or of a pipeline
read the rows of their data-parallel rank. A pipelined step goes through DeepSpeed's pipeline
engine whole (train_batch), as the training loop's does. Afterwards the servable weights are
written as a checkpoint writes them (piece by piece, or layer by layer from each stage), and rank 0
keeps the engine's logits on one batch (not under pipeline stages, whose logits only the last
stage sees), so a caller can load the file into the single-device model and compare.
"""

from __future__ import annotations

import contextlib
import inspect
from pathlib import Path

import torch
import torch.distributed as dist

from harness.peak_memory import release_deepspeed_groups, spawn_ranks, start_rank
from lmfoundry.train.config import PretrainConfig, data_parallel
from lmfoundry.train.expert_load import ExpertLoad

SEQ_LEN, STEPS = 32, 20


def vocabulary_table(name: str, n_layer: int) -> bool:
    """Whether the parameter `name` (of a model or of a pipeline stage) is a vocabulary table:
    the embedding and the head, a pipeline's embedding layer (tied: on the last stage too) and
    its untied head, the last of n_layer + 3 layers."""
    tables = ("embed.weight", "lm_head.weight", f"{n_layer + 2}.module.weight")
    return any(name == table or name.endswith("." + table) for table in tables)


# name: (tensor parallel, pipeline stages, workers, options of small_config); a layout with an
# untied head is held to the one-worker run of the untied model, one of 4 or 8 layers to that of
# the model of as many layers
LAYOUTS = {
    "one worker": (1, 1, 1, {}),
    "one worker, 4 layers": (1, 1, 1, {"n_layer": 4}),
    "one worker, 8 layers": (1, 1, 1, {"n_layer": 8}),
    # without ZeRO, where DeepSpeed's own clip keeps no norm (train/engine.py: keep_fp32_gradient_norm)
    "one worker, untied": (1, 1, 1, {"tied": False, "zero_stage": 0}),
    "TP 2 x DP 2, vocab parallel": (2, 1, 4, {"vocab_parallel": True}),
    "TP 2, vocab + sequence parallel, recompute": (
        2,
        1,
        2,
        {"vocab_parallel": True, "sequence_parallel": True, "recompute": True},
    ),
    "TP 2, vocab + sequence parallel, untied": (
        2,
        1,
        2,
        {"vocab_parallel": True, "sequence_parallel": True, "tied": False},
    ),
    "PP 2": (1, 2, 2, {}),
    "PP 2 x DP 2, recompute": (1, 2, 4, {"recompute": True}),
    "TP 2 x PP 2, vocab + sequence parallel, untied, recompute": (
        2,
        2,
        4,
        {"vocab_parallel": True, "sequence_parallel": True, "tied": False, "recompute": True},
    ),
    "TP 2 x PP 2, sequence parallel": (2, 2, 4, {"sequence_parallel": True}),
    # without sequence parallelism, the split head's input gradient is all-reduced by the head
    "TP 2 x PP 2, vocab parallel, untied": (2, 2, 4, {"vocab_parallel": True, "tied": False}),
    "TP 2 x PP 2, vocab + sequence parallel": (2, 2, 4, {"vocab_parallel": True, "sequence_parallel": True}),
    # interleaved: each stage holds 2 chunks of one block (train/interleaved_pipeline.py)
    "PP 2 x 2 virtual stages": (1, 2, 2, {"n_layer": 4, "virtual_stages": 2}),
    # activations from the last stage back to the first between chunks, past two stages between
    "PP 4 x 2 virtual stages": (1, 4, 4, {"n_layer": 8, "virtual_stages": 2}),
    "TP 2 x PP 2 x 2 virtual stages, vocab + sequence parallel, recompute": (
        2,
        2,
        4,
        {"n_layer": 4, "virtual_stages": 2, "vocab_parallel": True, "sequence_parallel": True, "recompute": True},
    ),
    # MoE blocks in the stages: the load-balancing loss of a layer on the first stage, and the
    # aux-free routing bias updated from each stage's loads
    "one worker, MoE": (1, 1, 1, {"n_layer": 4, "moe": "aux_loss"}),
    "one worker, MoE aux-free": (1, 1, 1, {"n_layer": 4, "moe": "aux_free"}),
    "PP 2, MoE": (1, 2, 2, {"n_layer": 4, "moe": "aux_loss"}),
    "PP 2 x DP 2, MoE aux-free, recompute": (1, 2, 4, {"n_layer": 4, "moe": "aux_free", "recompute": True}),
    # each stage's 2 replicas split its layers' experts, tokens exchanged within the stage
    "PP 2 x EP 2, MoE": (1, 2, 4, {"n_layer": 4, "moe": "aux_loss", "expert_parallel": 2}),
    # each rank routes its slice of the sequence to experts split over the tensor-parallel group
    "TP 2, sequence parallel, MoE": (
        2,
        1,
        2,
        {"n_layer": 4, "moe": "aux_loss", "expert_parallel": 2, "sequence_parallel": True},
    ),
    # the expert-data-parallel groups (the same experts' ranks) across the replicas
    "TP 2 x DP 2, sequence parallel, MoE, recompute": (
        2,
        1,
        4,
        {"n_layer": 4, "moe": "aux_loss", "expert_parallel": 2, "sequence_parallel": True, "recompute": True},
    ),
    "TP 2 x PP 2, sequence parallel, MoE aux-free": (
        2,
        2,
        4,
        {"n_layer": 4, "moe": "aux_free", "expert_parallel": 2, "sequence_parallel": True},
    ),
    "PP 2 x 2 virtual stages, MoE, recompute": (
        1,
        2,
        2,
        {"n_layer": 4, "virtual_stages": 2, "moe": "aux_loss", "recompute": True},
    ),
}


def reference_layout(options: dict) -> str:
    """The one-worker run a layout's losses are held to: of the same model."""
    if options.get("moe"):
        return "one worker, MoE" + (" aux-free" if options["moe"] == "aux_free" else "")
    if options.get("n_layer", 2) > 2:
        if not options.get("tied", True):
            raise ValueError("LAYOUTS has no one-worker run of an untied model of more than 2 layers")
        return f"one worker, {options['n_layer']} layers"
    return "one worker" if options.get("tied", True) else "one worker, untied"


def small_config(
    tp: int,
    pp: int,
    workers: int,
    recompute: bool = False,
    sequence_parallel: bool = False,
    vocab_parallel: bool = False,
    tied: bool = True,
    zero_stage: int = 1,
    n_layer: int = 2,
    virtual_stages: int = 1,
    moe: str | None = None,
    expert_parallel: int = 1,
) -> PretrainConfig:
    """A model of `n_layer` blocks with grouped-query attention, per-head query/key norms and q/k/v biases
    (Qwen2/3), so that each of the split or summed parts is exercised, and a tied head (on the
    last stage, the first stage's embedding) unless `tied` is false; 8 sequences a step, in
    micro-batches of 2 (4 per step through a pipeline of one replica). `recompute`: activation
    checkpointing; `sequence_parallel`: Megatron's sequence parallelism over the tensor-parallel
    group; `vocab_parallel`: the head and the embedding split by vocabulary rows; `zero_stage`: 0
    or 1; `virtual_stages`: chunks of the blocks each pipeline stage holds; `moe`: every block
    but the first an MoE layer (4 experts, top 2, one shared), balanced by `moe` (aux_loss or
    aux_free); `expert_parallel`: workers that split each MoE layer's experts."""
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig

    routed = None
    if moe is not None:  # a coefficient large enough that the balance loss moves the router
        routed = MoEConfig(
            num_experts=4,
            top_k=2,
            expert_hidden=32,
            first_dense_layers=1,
            balance=moe,
            score_func="sigmoid" if moe == "aux_free" else "softmax",  # aux-free balancing's scores
            aux_loss_coef=0.1,
            bias_update_rate=0.01,
        )

    model = ModelConfig(
        vocab_size=96,
        max_seq_len=SEQ_LEN,
        n_layer=n_layer,
        d_model=64,
        n_head=4,
        n_kv_head=2,
        qk_norm=True,
        attention_bias=True,
        activation_checkpointing=recompute,
        tie_embeddings=tied,
        moe=routed,
    )
    return PretrainConfig(
        data="-",
        output="-",
        model=model,
        parallelism={
            "num_workers": workers,
            "tensor_parallel_size": tp,
            "pipeline_parallel_size": pp,
            "virtual_stages": virtual_stages,
            "expert_parallel_size": expert_parallel,
            "zero_stage": zero_stage,
            "sequence_parallel": sequence_parallel,
            "vocab_parallel": vocab_parallel,
        },
        batch={"micro_batch_size": 2, "global_batch_tokens": 8 * SEQ_LEN},
        schedule={"max_steps": STEPS, "warmup_steps": 2},
        optimizer={"lr": 3e-3},
    )


def compare_layouts(out: str, steps: int = STEPS) -> dict:
    """Each of LAYOUTS trained `steps` steps of its schedule of STEPS (train_losses, model files
    under out/NAME): its
    losses and gradient norms (the whole model's, which clipping uses) and their largest
    differences from the one-worker run's, and the largest difference of
    the logits of its written weights, loaded into the single-device model, from those of the
    one-worker engine and of its own engine (None through a pipeline)."""
    from lmfoundry.model.checkpoint import load_model_files

    configs = {name: small_config(tp, pp, workers, **options) for name, (tp, pp, workers, options) in LAYOUTS.items()}
    directories = {name: str(Path(out) / name.replace(" ", "").replace(",", "-").replace("+", "")) for name in LAYOUTS}
    runs = {}
    for world in sorted({workers for _, _, workers, _ in LAYOUTS.values()}):
        names = [name for name, (_, _, workers, _) in LAYOUTS.items() if workers == world]
        trained = train_losses([configs[n] for n in names], world, SEQ_LEN, steps, [directories[n] for n in names])
        runs.update(zip(names, trained))
    rows = {}
    for name, (tp, pp, workers, options) in LAYOUTS.items():
        with torch.no_grad():
            reloaded = load_model_files(directories[name])(probe_batch(configs[name]))[0]
        reference = reference_layout(options)
        rows[name] = {
            "name": name,
            "tensor_parallel": tp,
            "pipeline_stages": pp,
            "workers": workers,
            **options,
            "reference": reference,
            **runs[name],
            "reloaded": reloaded,
        }
    for row in rows.values():
        reference = rows[row["reference"]]
        row["loss_max_abs_diff"] = max(abs(a - b) for a, b in zip(row["losses"], reference["losses"]))
        row["grad_norm_max_rel_diff"] = max(abs(a / b - 1) for a, b in zip(row["grad_norms"], reference["grad_norms"]))
        # every step's load of every expert of every layer, as the one worker's
        row["expert_loads_equal"] = (
            row["tokens_per_expert"] == reference["tokens_per_expert"] if row["tokens_per_expert"] else None
        )
    logits = {name: row.pop("logits") for name, row in rows.items()}
    for row in rows.values():
        reloaded, own = row.pop("reloaded"), logits[row["name"]]
        # the written weights against the one-worker engine, and against the run's own engine
        # (a vocabulary-parallel engine's logits are rank 0's slice of the vocabulary: its first)
        row["reloaded_vs_one_worker_logits"] = float((reloaded - logits[row["reference"]]).abs().max())
        row["reloaded_vs_own_engine_logits"] = (
            None if own is None else float((reloaded[..., : own.shape[-1]] - own).abs().max())
        )
        row["engine_logits_width"] = None if own is None else own.shape[-1]
    return rows


def probe_batch(cfg: PretrainConfig) -> torch.Tensor:
    return global_batches(cfg, SEQ_LEN, 1, seed=1)[0, :2, :-1]


def global_batches(cfg: PretrainConfig, seq_len: int, steps: int, seed: int = 0):
    """Each step's rows, the same for every layout: steps x (rows per step, seq_len + 1). A row
    counts from a random start by a random stride of 1-3 (modulo the vocabulary): a pattern a
    small model learns within a few steps, so the losses fall and a layout that trains wrongly
    shows."""
    rows, vocab = cfg.batch.global_batch_tokens // seq_len, cfg.model.vocab_size
    generator = torch.Generator().manual_seed(seed)
    start = torch.randint(0, vocab, (steps, rows, 1), generator=generator)
    stride = torch.randint(1, 4, (steps, rows, 1), generator=generator)
    return (start + stride * torch.arange(seq_len + 1)) % vocab


# the ring-algorithm bytes of each collective, in units of an all-reduce of its whole buffer
ALL_REDUCE_SHARE = {
    "all_reduce": 1.0,
    "all_gather_into_tensor": 0.5,
    "all_gather_single": 0.5,
    "reduce_scatter_tensor": 0.5,
}


@contextlib.contextmanager
def tensor_parallel_traffic(activation_elements: int, counts: dict):
    """While inside: counts["forward" or "backward"] (the phase is counts["phase"]) gathers the
    activation-sized collectives over the tensor-parallel group (buffers of `activation_elements`
    or more, an all-gather's output or a reduce-scatter's input), in all-reduces of the
    activation. Smaller ones (a per-head norm's gradient, the loss's sums) are left out."""
    from deepspeed.utils import groups

    group = groups.get_tensor_model_parallel_group()
    originals = {name: getattr(dist, name) for name in ALL_REDUCE_SHARE if hasattr(dist, name)}

    def counted(name, collective):
        signature = inspect.signature(collective)

        def call(*args, **kwargs):
            bound = signature.bind(*args, **kwargs).arguments  # the group passed by keyword or not
            if bound.get("group") is group:
                tensors = [a for a in bound.values() if isinstance(a, torch.Tensor)]
                whole = max(t.numel() for t in tensors)
                if whole >= activation_elements:
                    phase = counts["phase"]
                    counts[phase] = counts.get(phase, 0) + ALL_REDUCE_SHARE[name] * whole / activation_elements
            return collective(*args, **kwargs)

        return call

    for name, collective in originals.items():
        setattr(dist, name, counted(name, collective))
    try:
        yield counts
    finally:
        for name, collective in originals.items():
            setattr(dist, name, collective)


def _worker(
    rank: int, port: int, world: int, configs: list[dict], seq_len: int, steps: int, outs: list[str], results
) -> None:
    start_rank(rank, world, port)
    try:
        # the layouts of one world size one after another in the same processes: each spawn
        # imports torch and DeepSpeed anew, which takes most of a short run's time
        results[rank] = [
            _train_layout(rank, world, PretrainConfig.model_validate(raw), seq_len, steps, out)
            for raw, out in zip(configs, outs)
        ]
    finally:
        dist.destroy_process_group()


def _train_layout(rank: int, world: int, cfg: PretrainConfig, seq_len: int, steps: int, out: str) -> dict:
    """One layout's run on this rank (train_losses says what it returns)."""
    from lmfoundry.model.checkpoint import WEIGHTS, save_model_config, save_model_files
    from lmfoundry.train.checkpointing import stream_servable_weights
    from lmfoundry.train.pipeline_parallel import write_servable_weights as write_pipeline_weights
    from lmfoundry.train.pretrain import build_pretrain_engine
    from lmfoundry.train.tensor_parallel import gathered

    engine, _, ds_config = build_pretrain_engine(cfg, world, seq_len)
    dp_rank, dp_world = data_parallel(rank, world, cfg.parallelism)
    micro, accum = cfg.batch.micro_batch_size, ds_config["gradient_accumulation_steps"]
    pipelined = cfg.parallelism.pipeline_parallel_size > 1
    losses, grad_norms, traffic, loads = [], [], None, []
    expert_load = ExpertLoad(engine.module)  # as the training loop counts and balances the experts' load
    for batch in global_batches(cfg, seq_len, steps):
        # micro-batch i of the step is rows [i * dp_world + dp_rank] * micro: the rows a
        # data-parallel rank reads interleave, as the training loop's do
        rows = [batch[(i * dp_world + dp_rank) * micro :][:micro] for i in range(accum)]
        if pipelined:  # the step's mean over every micro-batch and replica, on every rank
            losses.append(float(engine.train_batch(iter([(r[:, :-1], r[:, 1:]) for r in rows]))))
            grad_norms.append(float(engine.get_global_grad_norm()))
            if expert_load:
                expert_load.end_step()
                loads.append(expert_load.last_step)
            continue
        step_loss = torch.zeros(())
        for tokens in rows:
            # the tensor-parallel collectives of the run's first micro-batch
            record = traffic is None and cfg.parallelism.tensor_parallel_size > 1
            activation = tokens[:, :-1].numel() * cfg.model.d_model
            counts = {"phase": "forward"}
            with tensor_parallel_traffic(activation, counts) if record else contextlib.nullcontext():
                loss = engine(tokens[:, :-1], tokens[:, 1:])[1]
                counts["phase"] = "backward"
                engine.backward(loss)
            traffic = counts if record else traffic
            if expert_load:
                expert_load.add_micro_batch()
            engine.step()
            step_loss += loss.detach() / accum
        if expert_load:
            expert_load.end_step()
            loads.append(expert_load.last_step)
        dist.all_reduce(step_loss)
        losses.append(step_loss.item() / world)  # every rank holds its replica's mean
        grad_norms.append(float(engine.get_global_grad_norm()))  # the whole model's, before clipping
    logits = None
    if not pipelined:
        with torch.no_grad():
            logits = engine(probe_batch(cfg))[0]
    Path(out).mkdir(parents=True, exist_ok=True)
    path = Path(out) / WEIGHTS if rank == 0 else None
    if pipelined:  # the checkpoint's write, layer by layer from each stage
        write_pipeline_weights(engine, path)
    elif cfg.parallelism.tensor_parallel_size > 1:  # the checkpoint's streamed write
        stream_servable_weights(engine.module, path, gathered)
    elif rank == 0:
        save_model_files(engine.module, out)
    if rank == 0:
        save_model_config(engine.module, out)
    dist.barrier()  # every rank done with this layout's engine before the next is built
    release_deepspeed_groups()
    return {
        "losses": losses,
        "grad_norms": grad_norms,
        "tokens_per_expert": loads,  # each step's, per MoE layer (every layer's on every rank)
        "logits": logits if rank == 0 else None,
        # the rows of each vocabulary table this rank holds (a pipeline's first stage holds
        # the embedding, its last the head: untied, or the embedding's weight again, tied)
        "vocabulary_rows": sorted(
            p.shape[0] for n, p in engine.module.named_parameters() if vocabulary_table(n, cfg.model.n_layer)
        ),
        **(
            {"tensor_parallel_all_reduces": {k: traffic.get(k, 0.0) for k in ("forward", "backward")}}
            if traffic
            else {}
        ),
    }


def train_losses(configs: list[PretrainConfig], world: int, seq_len: int, steps: int, outs: list[str]) -> list[dict]:
    """For each of `configs` (each at `world` processes, trained one after another in the same
    processes): the mean loss of each of `steps` optimizer steps, rank 0's logits (2 rows of a
    probe batch) after them, and the rows of the vocabulary tables each rank holds; its
    servable model files go to its entry of `outs`."""
    results = spawn_ranks(_worker, (world, [c.model_dump() for c in configs], seq_len, steps, outs), world)
    return [
        {**results[0][i], "vocabulary_rows": [results[rank][i]["vocabulary_rows"] for rank in range(world)]}
        for i in range(len(configs))
    ]
