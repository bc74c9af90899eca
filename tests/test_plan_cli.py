"""`lmfoundry plan` end to end, and the worked examples of docs/planning.md regenerated and compared."""

import re
import shlex
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from lmfoundry.jobs.plan import main

ROOT = Path(__file__).resolve().parents[1]


def worked_examples() -> list[tuple[str, str]]:
    text = (ROOT / "docs" / "planning.md").read_text()
    return re.findall(r"```\n\$ lmfoundry plan (.+?)\n(.+?)```", text, flags=re.S)


def test_the_planning_page_has_the_three_worked_examples():
    commands = [c for c, _ in worked_examples()]
    assert [c.split()[0] for c in commands] == [
        "configs/pretrain_7b_gpu.yaml",
        "configs/pretrain_moe_16b_gpu.yaml",
        "configs/pretrain_70b_gpu.yaml",
    ]


@pytest.mark.parametrize("index", [0, 1, 2])
def test_the_worked_examples_are_what_the_command_prints(index, capsys, monkeypatch):
    command, shown = worked_examples()[index]
    monkeypatch.chdir(ROOT)
    assert main(shlex.split(command)) == 0
    assert capsys.readouterr().out == shown


def test_plan_writes_json_plot_and_a_runnable_recipe(tmp_path, monkeypatch):
    from lmfoundry.platform.config import load_config
    from lmfoundry.train.config import PretrainConfig

    monkeypatch.chdir(ROOT)
    out = tmp_path / "best.yaml"
    assert (
        main(
            [
                "configs/pretrain_moe_16b_gpu.yaml",
                "--gpu",
                "H200",
                "--json",
                str(tmp_path / "p.json"),
                "--plot",
                str(tmp_path / "p.png"),
                "--write-config",
                str(out),
            ]
        )
        == 0
    )
    cfg = load_config(PretrainConfig, out)
    assert cfg.parallelism.num_workers == 8 and cfg.parallelism.use_gpu and cfg.model.moe.num_experts == 64
    assert (tmp_path / "p.png").read_bytes()[:4] == b"\x89PNG"
    derived = yaml.safe_load((tmp_path / "best.deepspeed.json").read_text())
    assert derived["scaling_config"]["num_workers"] == 8
    assert derived["deepspeed"]["train_batch_size"] * 4096 == cfg.batch.global_batch_tokens
    assert derived["deepspeed"]["bf16"]["enabled"] and derived["deepspeed"]["zero_optimization"]["stage"] == 2
    assert yaml.safe_load((tmp_path / "p.json").read_text())["plans"]


def test_the_70b_recipe_on_1024_gpus_gets_its_fastest_layout_written_with_sequence_parallelism(tmp_path, monkeypatch):
    """The recipe asks for sequence parallelism and the vocabulary split: on 1,024 GPUs its
    fastest layout is then TP 4 x DP 256 (without either, TP 4 x PP 2 x DP 128 with 4 virtual
    stages a GPU). The written recipe says so,
    and its DeepSpeed JSON shards with AutoTP and sums the norms' gradients over each
    tensor-parallel group."""
    from lmfoundry.platform.config import load_config
    from lmfoundry.train.config import PretrainConfig

    monkeypatch.chdir(ROOT)
    out = tmp_path / "70b.yaml"
    assert main(["configs/pretrain_70b_gpu.yaml", "--gpu", "H100", "--nodes", "128", "--write-config", str(out)]) == 0
    cfg = load_config(PretrainConfig, out)
    par = cfg.parallelism
    assert (par.tensor_parallel_size, par.pipeline_parallel_size, par.num_workers) == (4, 1, 1024)
    assert par.splits_sequences and par.splits_vocabulary
    derived = yaml.safe_load((tmp_path / "70b.deepspeed.json").read_text())
    assert derived["deepspeed"]["tensor_parallel"]["autotp_size"] == 4
    assert derived["deepspeed"]["tensor_parallel"]["partition_config"]["layer_specs"][-1]["grad_allreduce"]
    assert derived["deepspeed"]["tensor_parallel"]["vocab_parallel_lm_head"]
    # 256 data-parallel replicas of micro-batches of 2 sequences of 4,096 tokens: 2 micro-steps
    assert derived["deepspeed"]["gradient_accumulation_steps"] == 4194304 // (256 * 2 * 4096)
    # the same recipe without sequence parallelism: TP 4 x DP 256 fits only with the head and the
    # embedding split by vocabulary rows, and then only at one sequence a micro-batch
    recipe = (ROOT / "configs/pretrain_70b_gpu.yaml").read_text()
    assert "sequence_parallel: true" in recipe and "vocab_parallel: true" in recipe

    def tp4_fitting(text: str) -> list[int]:
        path = tmp_path / "70b-variant.yaml"
        path.write_text(text)
        assert main([str(path), "--gpu", "H100", "--nodes", "128", "--json", str(tmp_path / "p.json")]) == 0
        plans = yaml.safe_load((tmp_path / "p.json").read_text())["plans"]
        tp4 = [p for p in plans if (p["layout"]["tp"], p["layout"]["pp"]) == (4, 1)]
        assert tp4
        return [p["micro_batch_size"] for p in tp4 if p["fits"]]

    unsplit = recipe.replace("sequence_parallel: true", "sequence_parallel: false")
    assert tp4_fitting(unsplit) == [1]
    neither = unsplit.replace("vocab_parallel: true", "vocab_parallel: false")
    assert tp4_fitting(neither) == []
    # without either, the recipe written interleaves 4 virtual stages on each of 2 pipeline stages
    (tmp_path / "70b-neither.yaml").write_text(neither)
    written = tmp_path / "70b-neither-written.yaml"
    assert (
        main([str(tmp_path / "70b-neither.yaml"), "--gpu", "H100", "--nodes", "128", "--write-config", str(written)])
        == 0
    )
    par = load_config(PretrainConfig, written).parallelism
    assert (par.tensor_parallel_size, par.pipeline_parallel_size, par.virtual_stages, par.num_workers) == (
        4,
        2,
        4,
        1024,
    )


def test_on_64_gpus_the_70b_recipe_written_interleaves_virtual_pipeline_stages(tmp_path, monkeypatch, capsys):
    """Eight nodes do not hold 128 replicas of TP 8: the fastest layout, which the trainer runs,
    is PP 8 x DP 8 with 2 virtual stages a GPU (its bubble 2.7% of the step against 5.2% without
    them), and the DeepSpeed JSON derived from it counts the 8 replicas only, whose 128
    micro-batches a step the interleaved schedule takes in groups of 8."""
    from lmfoundry.platform.config import load_config
    from lmfoundry.train.config import PretrainConfig

    monkeypatch.chdir(ROOT)
    out = tmp_path / "70b.yaml"
    assert main(["configs/pretrain_70b_gpu.yaml", "--gpu", "H100", "--nodes", "8", "--write-config", str(out)]) == 0
    assert "(tp=1, pp=8, virtual stages=2, dp=8, ep=1, micro batch 1)" in capsys.readouterr().out
    par = load_config(PretrainConfig, out).parallelism
    assert (par.tensor_parallel_size, par.pipeline_parallel_size, par.virtual_stages) == (1, 8, 2)
    assert par.num_workers == 64 and not par.splits_vocabulary  # nothing to split it over
    ds = yaml.safe_load((tmp_path / "70b.deepspeed.json").read_text())["deepspeed"]
    assert ds["zero_optimization"]["stage"] == 1 and "tensor_parallel" not in ds
    assert ds["train_batch_size"] == ds["train_micro_batch_size_per_gpu"] * ds["gradient_accumulation_steps"] * 8
    assert ds["train_batch_size"] * 4096 == 4194304
    assert ds["gradient_accumulation_steps"] == 128


def test_unknown_gpu_is_a_clear_error(capsys, monkeypatch):
    monkeypatch.chdir(ROOT)
    assert main(["configs/pretrain_7b_gpu.yaml", "--gpu", "V100"]) == 2
    assert "unknown GPU type 'V100'; known: A100, B200, H100, H200" in capsys.readouterr().err


def test_a_layout_whose_sequences_do_not_split_over_its_group_is_not_written(monkeypatch):
    """With sequence parallelism each sequence splits over the tensor-parallel group: a layout
    whose group does not divide the planned sequence length is not a recipe `pretrain` runs."""
    from lmfoundry.jobs.plan import runnable_recipe
    from lmfoundry.planner.search import Layout, Plan
    from lmfoundry.platform.config import load_config
    from lmfoundry.train.config import PretrainConfig

    monkeypatch.chdir(ROOT)
    cfg = load_config(PretrainConfig, "configs/pretrain_70b_gpu.yaml")
    plan = Plan(layout=Layout(tp=4, pp=1, dp=256), micro_batches=2, micro_batch_size=2, fits=True)
    assert runnable_recipe(cfg, plan, 4096)["parallelism"]["tensor_parallel_size"] == 4
    assert runnable_recipe(cfg, plan, 4098) is None


def test_an_moe_models_tensor_parallel_layouts_are_planned_as_the_trainer_runs_them(monkeypatch):
    """The trainer splits an MoE model over a tensor-parallel group only with sequence
    parallelism and its experts over the group alone: without it no such layout is ranked, with
    it each has ep 1, and the recipe written for it validates with expert_parallel_size = tp."""
    from lmfoundry.jobs.plan import planner_layout, recipe_for, recipe_model, runnable_recipe
    from lmfoundry.model.flops import model_shape
    from lmfoundry.planner.search import Cluster, Recipe, gpu, search
    from lmfoundry.platform.config import load_config
    from lmfoundry.train.config import PretrainConfig

    monkeypatch.chdir(ROOT)
    cfg = load_config(PretrainConfig, "configs/pretrain_moe_16b_gpu.yaml")
    shape, cluster = model_shape(recipe_model(cfg, 102400, 4096)), Cluster(gpu("H100"), 8, 1)
    recipe = Recipe(seq_len=4096, global_batch_tokens=cfg.batch.global_batch_tokens, token_budget=1e12, zero_stage=2)
    assert not [p for p in search(shape, recipe, cluster) if p.layout.tp > 1]
    split = [p for p in search(shape, replace(recipe, sequence_parallel=True), cluster) if p.layout.tp > 1]
    assert split and {p.layout.ep for p in split} == {1}
    sequence_parallel = cfg.model_copy(
        update={"parallelism": cfg.parallelism.model_copy(update={"sequence_parallel": True})}
    )
    fitting = next(p for p in split if p.fits and p.layout.pp == 1)
    written = PretrainConfig.model_validate(runnable_recipe(sequence_parallel, fitting, 4096))
    assert written.parallelism.expert_parallel_size == written.parallelism.tensor_parallel_size == fitting.layout.tp
    # and read back, the recipe is the layout the planner ranked (memory figures of a run use it)
    assert planner_layout(written, written.parallelism.num_workers) == fitting.layout
    expert_parallel = next(p for p in search(shape, recipe, cluster) if p.layout.ep > 1 and p.layout.pp == 1)
    written = PretrainConfig.model_validate(recipe_for(cfg, expert_parallel))
    assert planner_layout(written, written.parallelism.num_workers) == expert_parallel.layout
