import subprocess
import sys

import pytest

from lmfoundry.data.curate import CurateConfig
from lmfoundry.platform.config import ConfigError, apply_overrides, load_config
from lmfoundry.train.config import PretrainConfig


def write(tmp_path, text: str):
    p = tmp_path / "c.yaml"
    p.write_text(text)
    return p


def test_unknown_key_names_file_key_and_allowed_keys(tmp_path):
    p = write(tmp_path, "input: a\noutput: b\nfilters:\n  gopher_quality:\n    min_wrds: 3\n")
    with pytest.raises(ConfigError) as e:
        load_config(CurateConfig, p)
    msg = str(e.value)
    assert str(p) in msg and "filters.gopher_quality.min_wrds" in msg and "min_words" in msg and "unknown key" in msg


def test_wrong_type_names_key_and_value(tmp_path):
    p = write(tmp_path, "data: a\noutput: b\nschedule: {max_steps: many}\n")
    with pytest.raises(ConfigError) as e:
        load_config(PretrainConfig, p)
    assert "schedule.max_steps" in str(e.value) and "'many'" in str(e.value)


def test_missing_required_key(tmp_path):
    with pytest.raises(ConfigError, match="'output'.*Field required"):
        load_config(CurateConfig, write(tmp_path, "input: a\n"))


def test_overrides_are_typed_and_nested(tmp_path):
    cfg = load_config(
        PretrainConfig,
        write(tmp_path, "data: a\noutput: b\n"),
        ["model.n_layer=3", "optimizer.lr=1e-3", "optimizer.betas=[0.9, 0.99]", "schedule.max_steps=100"],
    )
    assert cfg.model.n_layer == 3 and cfg.optimizer.lr == 1e-3 and cfg.optimizer.betas == (0.9, 0.99)
    assert cfg.schedule.max_steps == 100


def test_override_without_equals_is_an_error():
    with pytest.raises(ConfigError, match="expected key=value"):
        apply_overrides({}, ["model.n_layer"])


def test_model_shape_is_validated():
    with pytest.raises(ConfigError, match="n_head"):
        from lmfoundry.platform.config import build_config

        build_config(PretrainConfig, {"data": "a", "output": "b", "model": {"d_model": 100, "n_head": 3}})


@pytest.mark.parametrize(
    "text, expect",
    [
        ("input: {inp}\noutput: {out}\nbogus: 1\n", "bogus"),
        ("input: {inp}/does-not-exist\noutput: {out}\n", "does not exist"),
    ],
)
def test_cli_rejects_bad_config_before_ray_starts(tmp_path, text, expect):
    p = write(tmp_path, text.format(inp=tmp_path, out=tmp_path / "out"))
    r = subprocess.run(
        [sys.executable, "-m", "lmfoundry.jobs.curate", str(p)], capture_output=True, text=True, timeout=120
    )
    assert r.returncode == 2
    assert expect in r.stderr and str(p) in r.stderr
    assert "Started a local Ray" not in r.stderr  # failed before any Ray work


def test_every_recipe_in_configs_validates():
    from pathlib import Path

    from lmfoundry.agents.tool_data import ToolDataConfig
    from lmfoundry.align.distill import DistillConfig
    from lmfoundry.align.pairs import PairsConfig
    from lmfoundry.align.synth import SynthConfig
    from lmfoundry.data.pack import PackConfig
    from lmfoundry.data.quality import QualityTrainConfig
    from lmfoundry.eval.suite import EvaluateConfig
    from lmfoundry.jobs.agents import AgentsJobConfig
    from lmfoundry.jobs.align import AlignJobConfig
    from lmfoundry.jobs.lifecycle import load_quickstart_config
    from lmfoundry.jobs.pretrain import PretrainJobConfig
    from lmfoundry.jobs.reward import RewardJobConfig
    from lmfoundry.jobs.rl import RLJobConfig
    from lmfoundry.jobs.sft import SFTJobConfig
    from lmfoundry.serving.app import ServeConfig

    root = Path(__file__).resolve().parents[1] / "configs"
    models = {
        "curate.yaml": CurateConfig,
        "pack.yaml": PackConfig,
        "pretrain_tiny_cpu.yaml": PretrainJobConfig,
        "pretrain_gpu.yaml": PretrainConfig,
        "pretrain_moe_cpu.yaml": PretrainConfig,
        "pretrain_7b_gpu.yaml": PretrainConfig,
        "pretrain_moe_16b_gpu.yaml": PretrainConfig,
        "pretrain_70b_gpu.yaml": PretrainConfig,
        "evaluate.yaml": EvaluateConfig,
        "serve.yaml": ServeConfig,
        "quality_model.yaml": QualityTrainConfig,
        "pairs.yaml": PairsConfig,
        "synth.yaml": SynthConfig,
        "distill.yaml": DistillConfig,
        "tool_data.yaml": ToolDataConfig,
        "align_dpo.yaml": AlignJobConfig,
        "sft_tiny_cpu.yaml": SFTJobConfig,
        "sft_agent_cpu.yaml": SFTJobConfig,
        "agents.yaml": AgentsJobConfig,
        "reward_process.yaml": RewardJobConfig,
        "reward_outcome.yaml": RewardJobConfig,
        "rl_grpo.yaml": RLJobConfig,
    }
    for name, cls in models.items():
        assert isinstance(load_config(cls, root / name), cls)
    q = load_quickstart_config(str(root / "quickstart.yaml"), "/tmp/qs-work", [])
    assert q.pretrain.data == "/tmp/qs-work/packed" and q.pretrain.parallelism.zero_stage == 2
    agent = load_quickstart_config(str(root / "quickstart_agent.yaml"), "/tmp/qs-agent", [])
    assert agent.pack.seq_len == 1024 and agent.pretrain.model == q.pretrain.model  # quickstart-sized, longer context
    assert sorted(p.name for p in root.glob("*.yaml")) == sorted([*models, "quickstart.yaml", "quickstart_agent.yaml"])


@pytest.mark.parametrize(
    "recipe, vocab, seq, low, high, active_high",
    [
        ("pretrain_7b_gpu.yaml", 32000, 4096, 6.5e9, 7.0e9, None),
        ("pretrain_moe_16b_gpu.yaml", 102400, 4096, 15.5e9, 17.0e9, 3.2e9),
        ("pretrain_70b_gpu.yaml", 32000, 4096, 68e9, 70e9, None),
    ],
)
def test_large_recipes_have_the_sizes_their_names_promise(recipe, vocab, seq, low, high, active_high):
    """Built on the meta device: shapes and counts without allocating the weights."""
    from pathlib import Path

    import torch

    from lmfoundry.model.flops import matmul_params
    from lmfoundry.model.transformer import Transformer

    cfg = load_config(PretrainConfig, Path(__file__).resolve().parents[1] / "configs" / recipe)
    model_cfg = cfg.model.model_copy(update={"vocab_size": vocab, "max_seq_len": seq})
    with torch.device("meta"):
        model = Transformer(model_cfg)
    assert low < model.num_params() < high, model.num_params()
    if active_high:  # parameters a token passes through, embedding included
        assert matmul_params(model) + vocab * model_cfg.d_model < active_high


def test_an_elastic_range_is_checked_and_every_size_in_it_must_divide_the_global_batch(caplog):
    import logging

    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.train.config import world_sizes
    from lmfoundry.train.engine import gradient_accumulation
    from lmfoundry.train.pretrain import log_expert_splits

    base = dict(data="d", output="o")
    with pytest.raises(ValueError, match="min_workers=5 must not exceed num_workers=4"):
        PretrainConfig(**base, parallelism={"num_workers": 4, "min_workers": 5})
    # an elastic run's experts split as each world size allows: over the largest divisor of
    # expert_parallel_size that divides it
    moe = PretrainConfig(
        **base,
        parallelism={"num_workers": 8, "min_workers": 1, "expert_parallel_size": 4},
        model=ModelConfig(moe=MoEConfig(num_experts=8, top_k=1)),
    )
    split = [moe.parallelism.at_world_size(w).expert_parallel_size for w in world_sizes(moe.parallelism)]
    assert split == [1, 2, 1, 4, 1, 2, 1, 4]
    assert moe.parallelism.at_world_size(8) is moe.parallelism  # the size it was set for: unchanged
    with caplog.at_level(logging.INFO, logger="lmfoundry"):
        log_expert_splits(moe.parallelism)
    assert "{1: 1, 2: 2, 3: 1, 4: 4, 5: 1, 6: 2, 7: 1, 8: 4}" in caplog.text
    assert "at 1, 2, 3, 5, 6, 7 workers the experts split fewer than expert_parallel_size=4 ways" in caplog.text
    cfg = PretrainConfig(
        **base,
        parallelism={"num_workers": 4, "min_workers": 2},
        batch={"micro_batch_size": 1, "global_batch_tokens": 12 * 64},
    )
    assert list(world_sizes(cfg.parallelism)) == [2, 3, 4]
    assert [gradient_accumulation(cfg, w, 64) for w in world_sizes(cfg.parallelism)] == [6, 4, 3]
    odd = cfg.model_copy(update={"batch": cfg.batch.model_copy(update={"global_batch_tokens": 8 * 64})})
    with pytest.raises(ValueError, match="x 3 x 64"):  # 3 workers cannot share 8 sequences evenly
        [gradient_accumulation(odd, w, 64) for w in world_sizes(odd.parallelism)]
    assert list(world_sizes(PretrainConfig(**base, parallelism={"num_workers": 4}).parallelism)) == [4]


def test_old_flat_keys_move_to_their_sections_with_a_warning_naming_the_new_key(tmp_path, caplog):
    import logging

    from lmfoundry.train.dpo import DPOConfig

    old = "data: a\noutput: b\nmax_steps: 50\nzero_stage: 1\nlr: 1.0e-3\ncheckpoint_every: 25\nlr_schedule: wsd\n"
    with caplog.at_level(logging.WARNING, logger="lmfoundry.train.config"):
        cfg = load_config(PretrainConfig, write(tmp_path, old), ["micro_batch_size=4"])
    assert cfg.schedule.max_steps == 50 and cfg.schedule.kind == "wsd"
    assert cfg.parallelism.zero_stage == 1 and cfg.optimizer.lr == 1e-3
    assert cfg.checkpointing.every == 25 and cfg.batch.micro_batch_size == 4
    for moved in (
        "max_steps is now schedule.max_steps",
        "zero_stage is now parallelism.zero_stage",
        "lr is now optimizer.lr",
        "checkpoint_every is now checkpointing.every",
        "lr_schedule is now schedule.kind",
        "micro_batch_size is now batch.micro_batch_size",
    ):
        assert moved in caplog.text
    # an old key beside a section keeps the section's other keys
    cfg = PretrainConfig(data="a", output="b", warmup_steps=5, schedule={"max_steps": 30})
    assert (cfg.schedule.warmup_steps, cfg.schedule.max_steps) == (5, 30)
    # DPO's components keep DPO's defaults where an old key sets only one of their keys
    dpo = DPOConfig(checkpoint="c", pairs="p", output="o", lr=1e-5, global_batch_pairs=32)
    assert dpo.optimizer.lr == 1e-5 and dpo.optimizer.weight_decay == 0.0 and dpo.batch.global_batch_pairs == 32


def test_a_key_in_both_its_old_and_new_place_is_an_error_naming_both(tmp_path):
    from lmfoundry.train.dpo import DPOConfig

    p = write(tmp_path, "data: a\noutput: b\nmax_steps: 50\nschedule: {max_steps: 60}\n")
    with pytest.raises(ConfigError, match="max_steps and schedule.max_steps are both set"):
        load_config(PretrainConfig, p)
    with pytest.raises(ConfigError, match="zero_stage and parallelism.zero_stage are both set"):
        load_config(
            PretrainConfig, write(tmp_path, "data: a\noutput: b\nparallelism: {zero_stage: 1}\n"), ["zero_stage=2"]
        )
    with pytest.raises(ValueError, match="lr and optimizer.lr are both set"):
        DPOConfig(checkpoint="c", pairs="p", output="o", lr=1e-5, optimizer={"lr": 2e-5})


def test_workers_get_the_data_paths_of_every_post_training_stage_made_absolute(tmp_path, monkeypatch):
    """A Ray Train worker runs in a directory of its own: a data path relative to where the user
    ran the command must reach it absolute; an object-store URI reaches it unchanged."""
    from lmfoundry.train.dpo import DPOConfig
    from lmfoundry.train.grpo import RLConfig
    from lmfoundry.train.launch import worker_config
    from lmfoundry.train.reward import RewardConfig
    from lmfoundry.train.sft import SFTConfig

    monkeypatch.chdir(tmp_path)
    common = {"checkpoint": "ckpt", "output": "out"}
    for cls, field in ((SFTConfig, "data"), (DPOConfig, "pairs"), (RewardConfig, "data"), (RLConfig, "problems")):
        for given, expected in (("sub/rows.jsonl", str(tmp_path / "sub" / "rows.jsonl")), ("s3://b/rows.jsonl",) * 2):
            cfg = cls(**{**common, field: given})
            assert worker_config(cfg, field)[field] == expected, cls.__name__
            assert cls.model_validate(worker_config(cfg, field)) is not None
    rl = RLConfig(**common, problems="p.jsonl", reward_model="rm", reward_model_weight=0.5)
    assert worker_config(rl, "problems", "reward_model")["reward_model"] == str(tmp_path / "rm")
    assert worker_config(RLConfig(**common, problems="p.jsonl"), "reward_model")["reward_model"] is None
