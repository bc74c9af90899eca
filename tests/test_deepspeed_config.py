import pytest
import torch

from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.engine import deepspeed_config, gradient_accumulation


def cfg(**kw) -> PretrainConfig:
    return PretrainConfig(data="d", output="o", **kw)


def test_accumulation_is_derived_from_global_batch_tokens():
    c = cfg(batch={"micro_batch_size": 4, "global_batch_tokens": 4 * 2 * 128 * 3})
    ds = deepspeed_config(c, world_size=2, seq_len=128)
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 4 * 3 * 2
    assert ds["zero_optimization"]["stage"] == 2
    assert ds["bf16"]["enabled"] is False  # CPU default is fp32
    assert ds["scheduler"]["params"]["total_num_steps"] == c.schedule.max_steps


def test_indivisible_global_batch_is_a_clear_error():
    with pytest.raises(ValueError, match="global_batch_tokens=1000 must be a multiple"):
        gradient_accumulation(cfg(batch={"global_batch_tokens": 1000}), 2, 128)


def test_bf16_on_gpu_by_default():
    assert (
        deepspeed_config(cfg(parallelism={"use_gpu": True}, batch={"global_batch_tokens": 2048}), 2, 128)["bf16"][
            "enabled"
        ]
        is True
    )


def test_warmup_must_be_shorter_than_training():
    with pytest.raises(ValueError, match="warmup_steps"):
        cfg(schedule={"max_steps": 10, "warmup_steps": 10})


def test_no_warmup_is_refused_for_the_cosine_schedule_that_cannot_take_it_and_allowed_for_wsd():
    with pytest.raises(ValueError, match="warmup_steps=0 with kind=cosine"):
        cfg(schedule={"max_steps": 10, "warmup_steps": 0})
    assert cfg(schedule={"max_steps": 10, "warmup_steps": 0, "kind": "wsd"}).schedule.warmup_steps == 0


def test_too_little_data_for_one_micro_batch_is_refused_before_training(tmp_path):
    import json

    from tokenizers import Tokenizer, models

    from lmfoundry.train.pretrain import run_pretrain

    (tmp_path / "tokenizer.json").write_text(Tokenizer(models.WordLevel({"a": 0}, unk_token="a")).to_str())
    (tmp_path / "_MANIFEST.json").write_text(
        json.dumps(
            {
                "stage": "pack",
                "seq_len": 128,
                "vocab_size": 512,
                "tokenizer": "tokenizer.json",
                "sequences_per_shard": 16,
                "rows_per_group": 4,
                "splits": {"train": {"sequences": 10, "shards": 1}},
            }
        )
    )
    with pytest.raises(ValueError, match="holds 10 training sequences, fewer than one global micro-batch"):
        run_pretrain(
            PretrainConfig(data=str(tmp_path), output=str(tmp_path / "run"), batch={"global_batch_tokens": 2 * 8 * 128})
        )
    assert not (tmp_path / "run").exists()


def test_warmup_stable_decay_schedule():
    from lmfoundry.train.engine import wsd_schedule

    c = cfg(
        schedule={
            "max_steps": 100,
            "warmup_steps": 10,
            "kind": "wsd",
            "decay_fraction": 0.2,
            "min_lr_ratio": 0.1,
            "decay_shape": "linear",
        }
    )
    f = wsd_schedule(c)
    assert [f(s) for s in (0, 4, 9)] == pytest.approx([0.1, 0.5, 1.0])
    assert f(10) == f(50) == f(80) == 1.0  # stable until the last 20 steps
    assert f(90) == pytest.approx(0.55) and f(100) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    sqrt = wsd_schedule(c.model_copy(update={"schedule": c.schedule.model_copy(update={"decay_shape": "sqrt"})}))
    assert sqrt(85) == pytest.approx(1 - 0.9 * 0.25**0.5)
    assert "scheduler" not in deepspeed_config(c, 1, 128)  # the engine gets the schedule itself
    assert deepspeed_config(cfg(), 1, 128)["scheduler"]["type"] == "WarmupCosineLR"


def test_offloaded_optimizer_and_zero3_are_derived_and_checked():
    import pytest

    base = dict(data="d", output="o")
    cpu = deepspeed_config(PretrainConfig(**base, parallelism={"zero_stage": 3, "offload_optimizer": True}), 2, 64)
    assert cpu["zero_optimization"]["stage"] == 3
    assert cpu["zero_optimization"]["offload_optimizer"] == {"device": "cpu", "pin_memory": False}
    assert cpu["optimizer"]["params"]["torch_adam"] is True  # no compiled op on CPU-only machines
    gpu = deepspeed_config(PretrainConfig(**base, parallelism={"offload_optimizer": True, "use_gpu": True}), 2, 64)
    assert "torch_adam" not in gpu["optimizer"]["params"]  # DeepSpeed's CPU Adam steps the host partition
    assert gpu["zero_optimization"]["offload_optimizer"]["pin_memory"] is True
    assert "offload_optimizer" not in deepspeed_config(PretrainConfig(**base), 2, 64)["zero_optimization"]
    with pytest.raises(ValueError, match="offload_optimizer needs zero_stage 1, 2 or 3"):
        PretrainConfig(**base, parallelism={"zero_stage": 0, "offload_optimizer": True})
    with pytest.raises(ValueError, match="zero_stage=3 with an MoE model"):
        PretrainConfig(**base, parallelism={"zero_stage": 3}, model={"moe": {"num_experts": 4, "top_k": 1}})


def test_cpu_training_workers_start_with_the_allocator_settings_and_a_users_own_win(monkeypatch):
    from lmfoundry.platform.ray_env import CPU_ALLOCATOR_ENV
    from lmfoundry.train.launch import run_config

    cpu = run_config("/runs/a", max_failures=1, use_gpu=False).worker_runtime_env["env_vars"]
    assert cpu == CPU_ALLOCATOR_ENV and int(cpu["MALLOC_MMAP_THRESHOLD_"]) >= 1 << 30
    assert run_config("/runs/a", max_failures=1, use_gpu=True).worker_runtime_env["env_vars"] == {}
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "65536")
    assert "MALLOC_MMAP_THRESHOLD_" not in run_config("/runs/a", 1, False).worker_runtime_env["env_vars"]


def test_deepspeed_loads_without_mlflow_torchinductor_or_a_compiled_op_and_still_checks_adamw_for_zero(tmp_path):
    """MLflow (for DeepSpeed's autotuner) and TorchInductor (for the Muon optimizer's compiled
    kernels) are a large share of a worker's start, and DeepSpeed's shared-memory all-reduce op
    (for its inference engine) is compiled on first use: none loads with lmfoundry's engine, and
    nothing is compiled. MLflow still imports for lmfoundry's tracking, torch.compile and
    DeepSpeed's compile decorator still work elsewhere, torch's AdamW still passes DeepSpeed's
    ZeRO check, and a DeepSpeed without the Muon module is no error."""
    import os
    import subprocess
    import sys

    program = """
import os, sys, torch
from lmfoundry.train.engine import import_deepspeed_muon_uncompiled, prepare_deepspeed
import deepspeed
import deepspeed.autotuning.autotuner as tuner
from deepspeed.runtime import compiler
from deepspeed.runtime.zero.utils import is_zero_supported_optimizer
decorator = compiler.compile
import_deepspeed_muon_uncompiled("deepspeed.runtime.zero.no_such_optimizer.module")  # an older DeepSpeed
prepare_deepspeed()
torch.distributed.init_process_group("gloo", init_method="tcp://127.0.0.1:0", rank=0, world_size=1)
deepspeed.init_distributed(dist_backend="gloo")
from deepspeed.comm import comm
assert comm.cdb.shm_comm_op is None
assert tuner.has_mlflow is False and compiler.compile is decorator
assert is_zero_supported_optimizer(torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))]))
assert "deepspeed.runtime.zero.muon.muon_optimizer" in sys.modules
assert "torch._inductor.compile_fx" not in sys.modules
identity = lambda x: x
assert torch.compile(identity) is not identity  # TorchDynamo is not switched off for the rest
import mlflow
print("ok")
"""
    env = {**os.environ, "TORCH_EXTENSIONS_DIR": str(tmp_path / "ops")}
    out = subprocess.run([sys.executable, "-c", program], capture_output=True, text=True, timeout=300, env=env)
    assert out.stdout.splitlines()[-1:] == ["ok"], out.stdout[-1000:] + out.stderr[-2000:]
    assert not (tmp_path / "ops").exists() or not any((tmp_path / "ops").iterdir())  # nothing compiled


def test_tensor_and_pipeline_parallel_replicas_share_the_global_batch_and_lay_out_as_deepspeed_does():
    from lmfoundry.train.config import data_parallel

    batch = {"micro_batch_size": 2, "global_batch_tokens": 2 * 2 * 128 * 3}  # 2 replicas x 3 micro-steps
    tp = cfg(parallelism={"num_workers": 4, "tensor_parallel_size": 2}, batch=batch)
    ds = deepspeed_config(tp, 4, 128)
    assert ds["gradient_accumulation_steps"] == 3
    assert ds["train_batch_size"] == 2 * 3 * 4  # DeepSpeed counts the group's workers here
    assert ds["tensor_parallel"]["autotp_size"] == 2
    # a tensor-parallel group is consecutive ranks: ranks 0, 1 read replica 0's rows
    assert [data_parallel(r, 4, tp.parallelism) for r in range(4)] == [(0, 2), (0, 2), (1, 2), (1, 2)]
    pp = cfg(parallelism={"num_workers": 4, "pipeline_parallel_size": 2, "zero_stage": 1}, batch=batch)
    ds = deepspeed_config(pp, 4, 128)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 2 * 3 * 2  # replicas only
    assert "tensor_parallel" not in ds
    # a pipeline's stages are world / stages ranks apart: ranks 0, 2 are replica 0's stages
    assert [data_parallel(r, 4, pp.parallelism) for r in range(4)] == [(0, 2), (1, 2), (0, 2), (1, 2)]
    # both: stage, then replica, then tensor-parallel rank; ranks 0, 1, 4, 5 are replica 0
    both = cfg(
        parallelism={"num_workers": 8, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1},
        batch=batch,
    )
    ds = deepspeed_config(both, 8, 128)
    assert ds["gradient_accumulation_steps"] == 3 and ds["train_batch_size"] == 2 * 3 * 2  # replicas only
    assert "tensor_parallel" in ds
    assert [data_parallel(r, 8, both.parallelism) for r in range(8)] == [(0, 2), (0, 2), (1, 2), (1, 2)] * 2


@pytest.mark.parametrize(
    "parallelism, model, refused",
    [
        ({"num_workers": 3, "tensor_parallel_size": 2}, {}, "tensor_parallel_size=2 must divide num_workers=3"),
        ({"tensor_parallel_size": 2, "zero_stage": 3}, {}, "runs tensor parallelism with ZeRO stages 0-2"),
        ({"tensor_parallel_size": 2, "min_workers": 1}, {}, "breaks its whole tensor-parallel group"),
        ({"tensor_parallel_size": 2}, {"n_head": 4, "n_kv_head": 1}, "must divide the model's n_kv_head=1"),
        ({"tensor_parallel_size": 2}, {"moe": {"num_experts": 4, "top_k": 1}}, "with an MoE model needs sequence"),
        (
            {"tensor_parallel_size": 2, "sequence_parallel": True},
            {"moe": {"num_experts": 4, "top_k": 1}},
            "and expert_parallel_size=2: each rank routes its slice",
        ),
        (
            {"num_workers": 4, "tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 4},
            {"moe": {"num_experts": 4, "top_k": 1}},
            "experts are split over each tensor-parallel group; set expert_parallel_size=2",
        ),
        (
            {"num_workers": 6, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1},
            {},
            "tensor_parallel_size=2 x pipeline_parallel_size=2 must divide num_workers=6",
        ),
        ({"pipeline_parallel_size": 2, "zero_stage": 2}, {}, "runs with zero_stage=1"),
        ({"pipeline_parallel_size": 2, "zero_stage": 0}, {}, "clips by a wrong gradient norm at 0"),
        (
            {"num_workers": 4, "tensor_parallel_size": 2, "pipeline_parallel_size": 2, "zero_stage": 1},
            {"moe": {"num_experts": 4, "top_k": 1}},
            "tensor_parallel_size=2 with an MoE model",
        ),
        ({"num_workers": 4, "pipeline_parallel_size": 4, "zero_stage": 1}, {"n_layer": 2}, "one block a stage"),
        (
            {"num_workers": 4, "pipeline_parallel_size": 2, "expert_parallel_size": 4, "zero_stage": 1},
            {"moe": {"num_experts": 4, "top_k": 1}},
            "must divide the 2 workers of each pipeline stage",
        ),
        ({"num_workers": 4, "pipeline_parallel_size": 2, "min_workers": 2, "zero_stage": 1}, {}, "without elastic"),
        (
            {"num_workers": 2, "expert_parallel_size": 2, "zero_stage": 0},
            {"moe": {"num_experts": 4, "top_k": 1}},
            "only rank 0's experts' optimizer state",
        ),
    ],
)
def test_model_parallel_layouts_the_trainer_cannot_run_are_refused_with_the_reason(parallelism, model, refused):
    with pytest.raises(ValueError, match=refused):
        cfg(parallelism=parallelism, model=model)


def test_sequence_parallelism_sums_the_norms_gradients_and_sends_whole_slices_between_stages():
    """Under sequence parallelism the norms (every block's two and the final one, not the
    untied head) see a slice of each sequence, so AutoTP sums their gradients over the group;
    and a pipeline's partitioned transfers, which assume a group's ranks hold the same
    activations, are off."""
    import re

    from lmfoundry.train.tensor_parallel import sequence_parallel_norms

    # without tensor parallelism it does nothing (a recipe may ask for it before the plan's layout)
    alone = cfg(parallelism={"sequence_parallel": True})
    assert not alone.parallelism.splits_sequences and "tensor_parallel" not in deepspeed_config(alone, 2, 128)
    plain = cfg(parallelism={"num_workers": 2, "tensor_parallel_size": 2})
    sp = cfg(parallelism={"num_workers": 2, "tensor_parallel_size": 2, "sequence_parallel": True})
    assert deepspeed_config(plain, 2, 128)["tensor_parallel"]["partition_config"]["layer_specs"][-1]["patterns"] == [
        r".*\.attn\.[qk]_norm\.weight$"
    ]
    summed = deepspeed_config(sp, 2, 128)["tensor_parallel"]["partition_config"]["layer_specs"][-1]
    assert summed["grad_allreduce"] and summed["partition_type"] == "skip"
    assert "pipeline" not in deepspeed_config(sp, 2, 128)

    def matched(names, patterns):
        return [n for n in names if any(re.match(p, n) for p in patterns)]

    model = ["embed.weight", "blocks.0.attn_norm.weight", "blocks.11.mlp_norm.weight", "blocks.0.attn.q_norm.weight"]
    assert matched([*model, "norm.weight", "lm_head.weight"], sequence_parallel_norms(12, False)) == [
        "blocks.0.attn_norm.weight",
        "blocks.11.mlp_norm.weight",
        "norm.weight",
    ]
    # the pipeline numbers the blocks 1..12, the final norm 13 and the untied head 14
    stage = ["1.block.attn_norm.weight", "12.block.mlp_norm.weight", "13.module.weight", "14.module.weight"]
    assert (
        matched([*stage, "0.embed.weight", "2.block.attn.k_norm.weight"], sequence_parallel_norms(12, True))
        == (stage[:3])
    )
    both = cfg(
        parallelism={
            "num_workers": 4,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "zero_stage": 1,
            "sequence_parallel": True,
        }
    )
    assert deepspeed_config(both, 4, 128)["pipeline"] == {"pipe_partitioned": False, "grad_partitioned": False}
    # the packed sequences must split evenly over the group, checked before any worker starts
    from lmfoundry.train.pretrain import resolve_model_shape

    with pytest.raises(ValueError, match="seq_len=127 must be a multiple of 2"):
        resolve_model_shape(sp, {"vocab_size": 100, "seq_len": 127})
    with pytest.raises(ValueError, match="sequence_parallel"):
        cfg(parallelism={"tensor_parallel_size": 2, "sequence_parallel": "yes please"})
    assert resolve_model_shape(sp, {"vocab_size": 100, "seq_len": 128}).model.max_seq_len >= 128


def test_a_vocabulary_parallel_head_is_asked_of_autotp_only_where_it_runs():
    """With tensor parallelism and no pipeline AutoTP splits the head by vocabulary rows; in a
    pipeline the head and the embedding are split too, by lmfoundry (train/pipeline_parallel.py),
    so AutoTP is not asked; without tensor parallelism the setting does nothing."""
    tp = cfg(parallelism={"num_workers": 2, "tensor_parallel_size": 2, "vocab_parallel": True})
    assert tp.parallelism.splits_vocabulary
    assert deepspeed_config(tp, 2, 128)["tensor_parallel"]["vocab_parallel_lm_head"] is True
    alone = cfg(parallelism={"vocab_parallel": True})
    assert not alone.parallelism.splits_vocabulary and "tensor_parallel" not in deepspeed_config(alone, 2, 128)
    piped = cfg(
        parallelism={
            "num_workers": 4,
            "tensor_parallel_size": 2,
            "pipeline_parallel_size": 2,
            "zero_stage": 1,
            "vocab_parallel": True,
        }
    )
    assert piped.parallelism.splits_vocabulary
    assert "vocab_parallel_lm_head" not in deepspeed_config(piped, 4, 128)["tensor_parallel"]
    with pytest.raises(ValueError, match="vocab_parallel"):
        cfg(parallelism={"tensor_parallel_size": 2, "vocab_parallel": "all of it"})
    # every rank needs a row of the vocabulary, checked before any worker starts
    from lmfoundry.train.pretrain import resolve_model_shape

    tiny = cfg(
        parallelism={"num_workers": 4, "tensor_parallel_size": 4, "vocab_parallel": True}, model={"n_kv_head": 4}
    )
    with pytest.raises(ValueError, match="splits the 3 vocabulary rows over tensor_parallel_size=4"):
        resolve_model_shape(tiny, {"vocab_size": 3, "seq_len": 128})


def test_tensor_and_pipeline_parallelism_are_refused_outside_pretraining():
    from lmfoundry.train.dpo import DPOConfig

    with pytest.raises(ValueError, match="tensor and pipeline parallelism are for pretraining"):
        DPOConfig(output="o", checkpoint="c", pairs="p", parallelism={"tensor_parallel_size": 2})


def test_a_frozen_model_beside_a_bf16_engine_takes_its_parameter_dtype_and_keeps_fp32_rotary_tables():
    # DPO's reference and an SFT teacher below ZeRO-3: cast as DeepSpeed casts the trained model
    # (parameters only), so that policy and reference agree exactly where their weights do
    from types import SimpleNamespace

    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.engine import place_frozen

    model = Transformer(ModelConfig(vocab_size=32, max_seq_len=8, n_layer=1, d_model=16, n_head=2, n_kv_head=1))
    engine = SimpleNamespace(
        device=torch.device("cpu"), bfloat16_enabled=lambda: True, zero_optimization_stage=lambda: 2
    )
    assert place_frozen(model, engine) is model
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert {b.dtype for b in model.buffers()} == {torch.float32}
    fp32 = Transformer(ModelConfig(vocab_size=32, max_seq_len=8, n_layer=1, d_model=16, n_head=2, n_kv_head=1))
    place_frozen(
        fp32,
        SimpleNamespace(device=torch.device("cpu"), bfloat16_enabled=lambda: False, zero_optimization_stage=lambda: 1),
    )
    assert {p.dtype for p in fp32.parameters()} == {torch.float32}


def test_an_moe_model_under_tensor_parallelism_sums_its_routers_gradients_over_the_group():
    """With sequence parallelism each rank routes its own slice of the tokens: the routers' and
    shared experts' gradients, like the norms', are summed over the tensor-parallel group; the
    routed experts are split over it (expert_parallel_size = tensor_parallel_size) and are not."""
    import re

    moe = cfg(
        parallelism={"num_workers": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2},
        model={"n_layer": 2, "vocab_size": 32, "max_seq_len": 8, "moe": {"num_experts": 4, "top_k": 2}},
    )
    summed = deepspeed_config(moe, 2, 128)["tensor_parallel"]["partition_config"]["layer_specs"][-1]["patterns"]
    names = [name for name, _ in build_model_for(moe).named_parameters()]
    matched = {name for name in names if any(re.match(p, name) for p in summed)}
    assert "blocks.1.mlp.router.weight" in matched and "blocks.1.mlp.shared_down.weight" in matched
    assert "blocks.1.mlp_norm.weight" in matched and "norm.weight" in matched
    assert not {name for name in matched if name.endswith(("mlp.w_gate_up", "mlp.w_down"))}


def build_model_for(c: PretrainConfig):
    from lmfoundry.model.transformer import build_on_meta

    return build_on_meta(c.model)
