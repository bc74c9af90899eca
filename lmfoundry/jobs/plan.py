"""Plan a pretraining run: memory, parallel layouts, step time, cost and checkpoint interval.

    lmfoundry plan configs/pretrain_7b_gpu.yaml --gpu H200 --nodes 1 --token-budget 1e11
    lmfoundry plan configs/pretrain_moe_16b_gpu.yaml --gpu H200 --nodes 1 --json plan.json

The model is counted from the recipe's model config (built on PyTorch's meta device, so a 70B
model costs no memory); vocab_size and seq_len come from the flags when the recipe leaves them
to the data. Prints the ranked layouts; --write-config writes the best layout that lmfoundry
pretrain runs (tensor, pipeline with or without virtual stages, data and expert parallelism) as
a recipe.
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import TYPE_CHECKING

import yaml

from lmfoundry.platform.config import ConfigError, load_config

if TYPE_CHECKING:  # imported in main, after parsing: they import torch, and --help answers at once
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.planner.search import Cluster
    from lmfoundry.train.config import PretrainConfig


def recipe_model(cfg: PretrainConfig, vocab_size: int, seq_len: int) -> ModelConfig:
    """The recipe's model with vocab_size and max_seq_len filled where it leaves them to the data."""
    return cfg.model.model_copy(
        update={"vocab_size": cfg.model.vocab_size or vocab_size, "max_seq_len": cfg.model.max_seq_len or seq_len}
    )


def recipe_for(cfg: PretrainConfig, plan) -> dict:
    """The recipe (in the current keys) with the chosen tensor/data/expert-parallel layout filled in.
    Under tensor parallelism the planner splits an MoE model's experts over the tensor-parallel
    group (its `ep` is then 1): the trainer's expert-parallel size counts the group."""
    out = cfg.model_dump(mode="json", exclude_unset=True)
    experts_over_tp = plan.layout.tp if cfg.model.moe is not None else 1
    out.setdefault("parallelism", {}).update(
        num_workers=plan.layout.tp * plan.layout.pp * plan.layout.dp,
        tensor_parallel_size=plan.layout.tp,
        pipeline_parallel_size=plan.layout.pp,
        virtual_stages=plan.layout.virtual_stages,
        expert_parallel_size=plan.layout.ep * experts_over_tp,
        use_gpu=True,
        precision="bf16",
    )
    if cfg.parallelism.vocab_parallel:  # the recipe's ask, kept where the layout splits the vocabulary
        out["parallelism"]["vocab_parallel"] = plan.layout.tp > 1
    out.setdefault("batch", {})["micro_batch_size"] = plan.micro_batch_size
    return out


def planner_layout(cfg: PretrainConfig, world_size: int):
    """The planner's layout for a recipe run on `world_size` workers, the inverse of recipe_for:
    the planner's `ep` counts the ranks that split the experts beyond a tensor-parallel group,
    which splits an MoE model's experts by itself."""
    from lmfoundry.planner.search import Layout

    par = cfg.parallelism.at_world_size(world_size)
    tp, pp = par.tensor_parallel_size, par.pipeline_parallel_size
    experts_over_tp = tp if cfg.model.moe is not None else 1
    return Layout(
        tp=tp,
        pp=pp,
        dp=world_size // (tp * pp),
        ep=par.expert_parallel_size // experts_over_tp,
        virtual_stages=par.virtual_stages,
    )


def runnable_recipe(cfg: PretrainConfig, plan, seq_len: int) -> dict | None:
    """The recipe for `plan` if `lmfoundry pretrain` runs that layout: it fits and the config
    accepts it (tensor parallelism needs key/value heads and an MLP that split evenly and ZeRO
    stages 0-2, and of an MoE model sequence parallelism and its experts over the group alone;
    pipeline stages, virtual or not, ZeRO stage 1, and expert parallelism that divides a stage's
    workers). With
    sequence parallelism the planned `seq_len` must split evenly over the tensor-parallel group."""
    from pydantic import ValidationError

    from lmfoundry.train.config import PretrainConfig

    if not plan.fits:
        return None
    if cfg.parallelism.sequence_parallel and seq_len % plan.layout.tp:
        return None  # sequence parallelism needs the planned sequences to split evenly over the group
    recipe = recipe_for(cfg, plan)
    try:
        PretrainConfig.model_validate(recipe)
    except ValidationError:
        return None
    return recipe


def plot_layouts(plans, cluster: Cluster, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for fits, color in ((True, "tab:blue"), (False, "tab:red")):
        chosen = [pl for pl in plans if pl.fits == fits]
        ax.scatter(
            [pl.memory_gb["total"] for pl in chosen],
            [pl.tokens_per_s for pl in chosen],
            s=14,
            c=color,
            label="fits" if fits else "does not fit",
        )
    ax.axvline(cluster.gpu.memory_gb, color="gray", linestyle="--", label=f"{cluster.gpu.name} memory")
    best = plans[0].layout
    ax.annotate(
        f"tp{best.tp} pp{best.pp} dp{best.dp} ep{best.ep} v{best.virtual_stages}",
        (plans[0].memory_gb["total"], plans[0].tokens_per_s),
    )
    ax.set_xlabel("per-GPU memory, GB")
    ax.set_ylabel("tokens/s")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry plan", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", help="a pretrain recipe")
    p.add_argument("--gpu", default="H100")
    p.add_argument("--gpus-per-node", type=int, default=8)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--price", type=float, default=2.5, help="price per GPU-hour")
    p.add_argument("--failures-per-gpu-day", type=float, default=1e-3)
    p.add_argument("--storage-gbs", type=float, default=10.0, help="checkpoint write bandwidth, GB/s")
    p.add_argument("--token-budget", type=float, default=1e12)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--micro-batch-size", type=int, help="sequences per micro-batch; default: search 1, 2, 4, 8")
    p.add_argument("--top", type=int, default=10, help="layouts to print")
    p.add_argument("--json", help="write every plan as JSON here")
    p.add_argument(
        "--write-config",
        help="write the best layout lmfoundry pretrain runs (tensor x pipeline x data, experts) as a recipe",
    )
    p.add_argument("--plot", help="write a PNG of per-GPU memory against throughput for every layout")
    args = p.parse_args(argv)
    from lmfoundry.model.flops import model_shape
    from lmfoundry.planner.search import Cluster, Recipe, gpu, search
    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.engine import deepspeed_config

    try:
        cfg = load_config(PretrainConfig, args.config)
        cluster = Cluster(
            gpu(args.gpu), args.gpus_per_node, args.nodes, args.price, args.failures_per_gpu_day, args.storage_gbs
        )
        model_cfg = recipe_model(cfg, args.vocab_size, args.seq_len)
        shape = model_shape(model_cfg)
        seq = model_cfg.max_seq_len
        # GPUs train in bf16 unless the recipe insists on fp32
        recipe = Recipe(
            seq_len=seq,
            global_batch_tokens=cfg.batch.global_batch_tokens,
            token_budget=args.token_budget,
            zero_stage=cfg.parallelism.zero_stage,
            activation_checkpointing=cfg.model.activation_checkpointing,
            sequence_parallel=cfg.parallelism.sequence_parallel,
            vocab_parallel=cfg.parallelism.vocab_parallel,
            precision="fp32" if cfg.parallelism.precision == "fp32" else "bf16",
            reduce_bucket_size=cfg.parallelism.reduce_bucket_size,
            offload_optimizer=cfg.parallelism.offload_optimizer,
        )
    except (ConfigError, ValueError) as e:
        print(f"error: plan: {e}", file=sys.stderr)
        return 2
    sizes = (args.micro_batch_size,) if args.micro_batch_size else (1, 2, 4, 8)
    plans = search(shape, recipe, cluster, micro_batch_sizes=sizes)
    if not plans:
        print(
            f"error: plan: no layout divides {cluster.gpus} GPUs, {shape.n_layer} layers and a global batch "
            f"of {recipe.global_batch_tokens} tokens",
            file=sys.stderr,
        )
        return 2
    print(
        f"{args.config}: {shape.total_params / 1e9:.2f}B parameters ({shape.expert_params / 1e9:.2f}B in routed "
        f"experts), {shape.train_flops_per_token / 1e9:.1f} GFLOP per token; {cluster.gpus} x {cluster.gpu.name}; "
        f"ZeRO-{recipe.zero_stage}{', sequence parallel' if recipe.sequence_parallel else ''}"
        f"{', vocabulary-parallel head and embedding' if recipe.vocab_parallel else ''}, "
        f"{recipe.global_batch_tokens} tokens a step, budget {recipe.token_budget:.3g} tokens"
    )
    print(
        f"{'tp':>3} {'pp':>3} {'dp':>4} {'ep':>3} {'v':>2} {'mbs':>3} {'m':>4} {'mem GB':>7} {'fits':>4} {'bubble':>7} "
        f"{'step s':>7} {'tokens/s':>10} {'MFU':>6} {'days':>7} {'cost $':>11} {'ckpt every':>10}"
    )
    best_per_layout: dict = {}  # plans are ranked: the first of a layout has its best micro-batch size
    for pl in plans:
        best_per_layout.setdefault(pl.layout, pl)
    for pl in list(best_per_layout.values())[: args.top]:
        lo = pl.layout
        print(
            f"{lo.tp:>3} {lo.pp:>3} {lo.dp:>4} {lo.ep:>3} {lo.virtual_stages:>2} {pl.micro_batch_size:>3} "
            f"{pl.micro_batches:>4} "
            f"{pl.memory_gb['total']:7.1f} {'yes' if pl.fits else 'no':>4} {pl.bubble:7.1%} {pl.step_s:7.2f} "
            f"{pl.tokens_per_s:10.0f} {pl.mfu:6.1%} {pl.days:7.1f} {pl.cost:11,.0f} "
            f"{pl.checkpoint_interval_s / 60:8.0f} m"
        )
    best = plans[0]
    print(
        f"failures: {best.failures_per_day:.2f} a day at this scale; checkpoint write {best.checkpoint_write_s:.0f} s; "
        f"Young-Daly interval {best.checkpoint_interval_s / 60:.0f} min; expected time lost {best.failure_overhead:.1%}"
    )
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "model": shape.__dict__,
                    "cluster": {"gpu": cluster.gpu.name, "gpus": cluster.gpus},
                    "plans": [pl.as_dict() for pl in plans],
                },
                f,
                indent=2,
            )
    if args.plot:
        plot_layouts(plans, cluster, args.plot)
    if args.write_config:
        runnable = [(pl, written) for pl in plans if (written := runnable_recipe(cfg, pl, recipe.seq_len)) is not None]
        if not runnable:
            print(
                "error: plan: no fitting layout that lmfoundry pretrain runs (tensor, pipeline, data "
                "and expert parallelism; no virtual pipeline stages)",
                file=sys.stderr,
            )
            return 2
        best_runnable, chosen = runnable[0]
        with open(args.write_config, "w") as f:
            yaml.safe_dump(chosen, f, sort_keys=False)
        # what the trainer will derive from that recipe: Ray's ScalingConfig and DeepSpeed's JSON
        derived = PretrainConfig.model_validate(chosen)
        ds_path = args.write_config.rsplit(".", 1)[0] + ".deepspeed.json"
        with open(ds_path, "w") as f:
            json.dump(
                {
                    "scaling_config": {
                        "num_workers": derived.parallelism.num_workers,
                        "use_gpu": derived.parallelism.use_gpu,
                        "resources_per_worker": {"CPU": derived.parallelism.cpus_per_worker, "GPU": 1},
                    },
                    "deepspeed": deepspeed_config(derived, derived.parallelism.num_workers, seq, shape.total_params),
                },
                f,
                indent=2,
            )
        lo = best_runnable.layout
        print(
            f"wrote {args.write_config} (tp={lo.tp}, pp={lo.pp}, virtual stages={lo.virtual_stages}, dp={lo.dp}, "
            f"ep={lo.ep}, micro batch "
            f"{best_runnable.micro_batch_size}) and {ds_path}"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
