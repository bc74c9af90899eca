"""The planner's formulas checked against DeepSpeed's own estimators, the pipeline engine's
order of work simulated (train/pipeline_schedule.py), and the instantiated model."""

import pytest

from lmfoundry.planner.search import (
    Cluster,
    Layout,
    ModelShape,
    Recipe,
    bubble_fraction,
    gpu,
    model_state_bytes,
    plan,
    search,
)
from lmfoundry.train.pipeline_schedule import simulate


def shape(total: int, largest: int = 0) -> ModelShape:
    return ModelShape(
        total_params=total,
        expert_params=0,
        largest_layer_params=largest or total // 50,
        train_flops_per_token=6 * total,
        n_layer=32,
        d_model=4096,
        n_head=32,
    )


@pytest.mark.parametrize("total", [10**8, 7 * 10**9, 70 * 10**9])
@pytest.mark.parametrize("gpus_per_node, nodes", [(1, 1), (8, 1), (8, 8)])
def test_model_state_memory_agrees_with_deepspeed_estimators(total, gpus_per_node, nodes):
    from deepspeed.runtime.zero.stage3 import estimate_zero3_model_states_mem_needs
    from deepspeed.runtime.zero.stage_1_and_2 import estimate_zero2_model_states_mem_needs

    n = gpus_per_node * nodes
    s = shape(total)
    layout = Layout(tp=1, pp=1, dp=n)
    for stage, offload in ((2, False), (2, True), (3, False)):
        states = model_state_bytes(
            s,
            layout,
            Recipe(seq_len=1, global_batch_tokens=1, token_budget=1, zero_stage=stage, offload_optimizer=offload),
        )
        ours = states["weights"] + states["gradients"] + states["optimizer"]  # DeepSpeed's leave out buckets
        if stage == 2:
            _, theirs = estimate_zero2_model_states_mem_needs(total, gpus_per_node, nodes, cpu_offload=offload)
        else:
            _, theirs, _ = estimate_zero3_model_states_mem_needs(
                total, s.largest_layer_params, gpus_per_node, nodes, cpu_offload=False
            )
        assert ours == pytest.approx(theirs, rel=0.05), (stage, offload)


def simulate_pipeline(p: int, m: int, v: int = 1) -> float:
    """Idle fraction of the order of work the interleaved pipeline engine runs (Megatron's; at
    v = 1, 1F1B with a longer warm-up, whose bubble is 1F1B's), each stage's forward of a chunk
    1 unit and its backward 2, each starting when the stage is free and its input has arrived."""
    return simulate(p, v, m)["bubble"]


@pytest.mark.parametrize("p, m", [(2, 4), (4, 8), (4, 16), (8, 8), (8, 32)])
def test_1f1b_bubble_matches_a_simulated_schedule(p, m):
    assert bubble_fraction(p, m) == pytest.approx(simulate_pipeline(p, m), abs=1e-9)
    assert bubble_fraction(p, m) != pytest.approx((p - 1) / (p + m))  # the formula in circulation is wrong


@pytest.mark.parametrize("p, m, v", [(2, 4, 2), (4, 8, 2), (4, 8, 4), (4, 16, 2)])
def test_interleaved_bubble_matches_a_simulated_schedule(p, m, v):
    assert bubble_fraction(p, m, v) == pytest.approx(simulate_pipeline(p, m, v), abs=1e-9)


def test_bad_layouts_and_gpus_are_clear_errors():
    cluster = Cluster(gpu("H200"), 8, 1)
    recipe = Recipe(seq_len=4096, global_batch_tokens=4096 * 64, token_budget=1e9)
    with pytest.raises(ValueError, match="does not use the cluster's 8 GPUs"):
        plan(shape(10**9), recipe, cluster, Layout(tp=2, pp=2, dp=3))
    with pytest.raises(ValueError, match="unknown GPU type 'H900'; known: A100, B200, H100, H200"):
        gpu("H900")


def test_search_ranks_fitting_layouts_first_and_fastest_first():
    cluster = Cluster(gpu("H200"), 8, 1)
    recipe = Recipe(seq_len=4096, global_batch_tokens=4096 * 256, token_budget=1e11, zero_stage=1)
    plans = search(shape(7 * 10**9), recipe, cluster)
    fitting = [p for p in plans if p.fits]
    assert fitting and all(p.fits for p in plans[: len(fitting)])
    speeds = [p.tokens_per_s for p in fitting]
    assert speeds == sorted(speeds, reverse=True)
    best = fitting[0]
    assert 0.05 < best.mfu <= recipe.achievable_fraction and best.memory_gb["total"] <= 141
    assert best.checkpoint_interval_s > 0 and best.cost > 0


@pytest.mark.parametrize("head", ["tied", "untied", "reward"])
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_the_busiest_pipeline_stage_holds_its_blocks_and_one_vocabulary_table(head, pp):
    """Against the model's own modules, cut as train/pipeline_parallel.py cuts them: the blocks
    evenly over the stages, the embedding on the first, the final norm and the head (or, tied,
    the embedding again) on the last. A reward model's scalar head leaves the first stage the
    busier one."""
    from lmfoundry.model.flops import model_shape
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.planner.search import dense_params_per_gpu

    heads = {"tied": {}, "untied": {"tie_embeddings": False}, "reward": {"tie_embeddings": False, "reward_head": True}}
    cfg = ModelConfig(vocab_size=8192, max_seq_len=64, n_layer=4, d_model=64, n_head=4, n_kv_head=2, **heads[head])
    model = Transformer(cfg)

    def count(*modules) -> int:
        return sum(p.numel() for m in modules for p in m.parameters())

    per_stage = cfg.n_layer // pp
    stages = [count(*model.blocks[s * per_stage : (s + 1) * per_stage]) for s in range(pp)]
    stages[0] += model.embed.weight.numel()
    stages[-1] += count(model.norm) + model.lm_head.weight.numel()  # tied: the embedding itself
    if pp == 1:
        stages = [model.num_params()]
    assert dense_params_per_gpu(model_shape(cfg), Layout(tp=1, pp=pp, dp=1)) == pytest.approx(max(stages), rel=2e-3)


@pytest.mark.parametrize("tied", [True, False])
def test_a_vocabulary_parallel_layout_splits_the_head_and_the_embedding_tied_or_not(tied):
    """At TP 2 with `vocab_parallel`, against the model's own parameters as train/tensor_parallel.py
    splits them: the blocks' linear layers, the head and the embedding (one table when tied)
    halved, the norms whole on each rank. At TP 2 x PP 2, as train/pipeline_parallel.py cuts and
    splits them: each stage's blocks halved and the end stage's table halved too."""
    from lmfoundry.model.flops import model_shape
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.planner.search import dense_params_per_gpu

    cfg = ModelConfig(
        vocab_size=8192, max_seq_len=64, n_layer=4, d_model=64, n_head=4, n_kv_head=2, tie_embeddings=tied
    )
    model = Transformer(cfg)
    split = sum(p.numel() for p in model.parameters() if p.dim() == 2)  # a tied table counted once
    whole = sum(p.numel() for p in model.parameters() if p.dim() < 2)
    recipe = Recipe(seq_len=64, global_batch_tokens=64, token_budget=1, vocab_parallel=True)
    held = dense_params_per_gpu(model_shape(cfg), Layout(tp=2, pp=1, dp=1), recipe)
    assert held == pytest.approx(split / 2 + whole, rel=2e-3)
    assert dense_params_per_gpu(model_shape(cfg), Layout(tp=2, pp=1, dp=1)) > held + cfg.vocab_size * 64 / 4

    def count(*modules, halved: bool) -> float:
        return sum(p.numel() / (2 if halved and p.dim() == 2 else 1) for m in modules for p in m.parameters())

    first = count(*model.blocks[:2], halved=True) + model.embed.weight.numel() / 2
    last = count(*model.blocks[2:], halved=True) + count(model.norm, halved=False) + model.lm_head.weight.numel() / 2
    piped = dense_params_per_gpu(model_shape(cfg), Layout(tp=2, pp=2, dp=1), recipe)
    assert piped == pytest.approx(max(first, last), rel=2e-3)
    unsplit = dense_params_per_gpu(model_shape(cfg), Layout(tp=2, pp=2, dp=1))
    assert unsplit == pytest.approx(piped + model.embed.weight.numel() / 2, rel=2e-3)


def test_tensor_parallel_sizes_keep_whole_key_value_heads_and_mlp_columns():
    """A model with 2 key/value heads is never split 4 or 8 ways, though its 16 query heads
    would allow it: the trainer refuses such a layout (train/config.py check_tensor_parallel)."""
    from lmfoundry.model.flops import model_shape
    from lmfoundry.model.transformer import ModelConfig

    cfg = ModelConfig(vocab_size=32000, max_seq_len=4096, n_layer=16, d_model=2048, n_head=16, n_kv_head=2)
    recipe = Recipe(seq_len=4096, global_batch_tokens=4096 * 256, token_budget=1e11, zero_stage=1)
    plans = search(model_shape(cfg), recipe, Cluster(gpu("H100"), 8, 2))
    assert plans and {p.layout.tp for p in plans} == {1, 2}
