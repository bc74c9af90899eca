"""Checkpoints that survive crashes, and training that survives killed workers.

Unit tests of the checkpoint store (atomic commit, retention, corruption), then fault drills on
real DeepSpeed workers under Ray Train: a worker killed with SIGKILL mid-save resumes to losses
bitwise equal to the uninterrupted session run, a crash loop ends FAILED, a ZeRO-3 run resumes at
another world size, and an elastic run shrinks and grows back.
"""

from __future__ import annotations

import json
import logging
import math
from pathlib import Path

import pytest
from conftest import stopped_at, tiny_pretrain_config

from lmfoundry.platform import checkpoint
from lmfoundry.train.config import FaultDrill


def stage(tmp_path: Path, rank: int, step: int, payload: bytes) -> Path:
    staged = tmp_path / f"stage-{rank}-{step}"
    (staged / "deepspeed").mkdir(parents=True)
    (staged / "deepspeed" / f"part-{rank}.bin").write_bytes(payload)
    return staged


def save(run: Path, tmp_path: Path, step: int, world: int = 2, keep_last: int = 2, keep_every: int = 0) -> None:
    writers = [checkpoint.AsyncCheckpointer(str(run), r, world, keep_last, keep_every) for r in range(world)]
    for r, w in enumerate(writers):
        w.save(step, stage(tmp_path, r, step, f"rank {r} step {step}".encode()), {"step": step})
    for w in writers:
        w.wait()


def test_a_checkpoint_commits_only_when_every_rank_has_written(tmp_path):
    run = tmp_path / "run"
    rank1 = checkpoint.AsyncCheckpointer(str(run), 1, 2, keep_last=2)
    rank1.save(5, stage(tmp_path, 1, 5, b"one"), {"step": 5})
    rank1.wait()
    assert checkpoint.committed_checkpoints(str(run)) == []  # rank 0 has not written: no manifest
    rank0 = checkpoint.AsyncCheckpointer(str(run), 0, 2, keep_last=2)
    rank0.save(5, stage(tmp_path, 0, 5, b"zero"), {"step": 5})
    rank0.wait()
    [(step, uri)] = checkpoint.committed_checkpoints(str(run))
    manifest = checkpoint.verify(uri)
    assert step == 5 and set(manifest["files"]) == {"deepspeed/part-0.bin", "deepspeed/part-1.bin"}
    assert not any((tmp_path / f"stage-{r}-5").exists() for r in (0, 1))  # staging cleared


def test_a_save_cut_short_is_never_taken_for_a_checkpoint(tmp_path):
    run = tmp_path / "run"
    save(run, tmp_path, 10)

    def crash(step):
        raise KeyboardInterrupt("killed mid-save")

    writer = checkpoint.AsyncCheckpointer(str(run), 0, 1, keep_last=2, before_commit=crash)
    writer.save(20, stage(tmp_path, 0, 20, b"half"), {"step": 20})
    with pytest.raises(RuntimeError, match="persisting a checkpoint failed: killed mid-save"):
        writer.wait()
    assert (run / "checkpoints" / "step-00000020").is_dir()
    assert checkpoint.latest_valid(str(run)).endswith("step-00000010")
    assert [Path(u).name for u in checkpoint.remove_uncommitted(str(run))] == ["step-00000020"]


def test_retention_keeps_the_last_k_every_mth_and_always_the_newest(tmp_path):
    assert checkpoint.to_delete([100, 200, 300, 400, 500], keep_last=2) == [100, 200, 300]
    assert checkpoint.to_delete([100, 200, 300, 400, 500], keep_last=2, keep_every=200) == [100, 300]
    assert checkpoint.to_delete([7], keep_last=2) == []
    run = tmp_path / "run"
    for step in (10, 20, 30, 40, 50):
        save(run, tmp_path, step, keep_last=2, keep_every=20)
    assert [s for s, _ in checkpoint.committed_checkpoints(str(run))] == [20, 40, 50]


def test_a_corrupt_checkpoint_is_skipped_loudly(tmp_path, caplog):
    run = tmp_path / "run"
    save(run, tmp_path, 10)
    save(run, tmp_path, 20)
    part = run / "checkpoints" / "step-00000020" / "deepspeed" / "part-1.bin"
    part.write_bytes(b"bit rot" + part.read_bytes()[7:])
    with caplog.at_level(logging.ERROR, logger="lmfoundry.platform.checkpoint"):
        assert checkpoint.latest_valid(str(run)).endswith("step-00000010")
    assert "step 20 is corrupt" in caplog.text and "part-1.bin does not match its checksum" in caplog.text


def test_stragglers_are_named_by_rank_and_host():
    from lmfoundry.train.health import stragglers

    busy = [(2.0, "node-a"), (2.2, "node-a"), (4.1, "node-b"), (2.9, "node-c")]
    assert [(rank, host) for rank, host, _ in stragglers(busy, 1.4)] == [(2, "node-b"), (3, "node-c")]
    assert stragglers(busy, 2.1) == []
    assert stragglers([(0.0, "a"), (1.0, "b")], 1.5) == []  # nothing measured yet


def test_killed_workers_resume_to_bitwise_equal_losses(deepspeed_workers, packed, pretrained, tmp_path):
    """The session's reference run again, with rank 0 killed while step 30's checkpoint is being
    written: the half-written checkpoint is passed over and the run resumes from step 20. (A
    worker killed between checkpoints is drilled in the SFT, DPO, GRPO and quickstart tests.)
    The run is a job with an eval section: each checkpoint is evaluated in the background as it
    is committed, step 30's once, after the restart wrote it again."""
    from lmfoundry.eval.suite import EvalSuites
    from lmfoundry.jobs.pretrain import PretrainJobConfig, run_pretrain_job
    from lmfoundry.train.config import FaultDrill

    out = tmp_path / "drilled"
    drills = [FaultDrill(at_step=30, rank=0, during_save=True)]
    cfg = tiny_pretrain_config(
        packed[0], str(out), drills=drills, health={"max_failures": 1}, checkpointing={"keep_last": 4}
    )
    suites = EvalSuites(data=packed[0], max_sequences=32, tasks=["builtin"], task_limit=10)
    manifest = run_pretrain_job(PretrainJobConfig(**cfg.model_dump(), eval=suites, eval_cpus=0.5))
    assert len(list((out / "_drills").iterdir())) == 1  # the drill fired
    reference = [json.loads(line) for line in open(Path(pretrained[0]) / "metrics.jsonl")]
    drilled = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in drilled] == list(range(1, 41))  # every step once: none skipped or repeated
    assert [r["loss"] for r in drilled] == [r["loss"] for r in reference]  # bitwise
    assert [r["grad_norm"] for r in drilled] == [r["grad_norm"] for r in reference]
    assert manifest["final_loss"] == pretrained[1]["final_loss"]
    state = json.loads((out / manifest["final_checkpoint"] / "train_state.json").read_text())
    assert state["step"] == 40 and state["tokens_seen"] == 40 * 2 * 4 * 64 * 2
    # every committed checkpoint evaluated once, beside it and in metrics.jsonl at its step
    evaluations = manifest["evaluations"]
    assert [e["step"] for e in evaluations] == [10, 20, 30, 40]
    assert all("error" not in e for e in evaluations)
    ppl = [e["metrics"]["lm.perplexity"] for e in evaluations]
    assert ppl[-1] < ppl[0]  # it learns, and the per-checkpoint evaluation sees it
    for step in (10, 20, 30, 40):
        record = json.loads((out / "evals" / f"step-{step:08d}.json").read_text())
        assert record["metrics"]["task.lmfoundry_arithmetic_mc.acc"] >= 0
    with_eval = {r["step"]: r["eval"]["metrics"]["lm.perplexity"] for r in drilled if "eval" in r}
    assert with_eval == dict(zip((10, 20, 30, 40), ppl))


def test_a_crash_loop_ends_failed_after_max_failures(deepspeed_workers, packed, tmp_path):
    from lmfoundry.train.config import FaultDrill
    from lmfoundry.train.pretrain import run_pretrain

    out = tmp_path / "crashloop"
    cfg = tiny_pretrain_config(
        packed[0],
        str(out),
        parallelism={"num_workers": 1},  # the loop ends the same with one worker, which starts faster
        schedule={"max_steps": 6, "warmup_steps": 1},
        checkpointing={"every": 3},
        health={"max_failures": 1},
        drills=[FaultDrill(at_step=4, rank=0, every_attempt=True)],
    )
    with pytest.raises(RuntimeError, match="pretraining failed after 1 restarts at most"):
        run_pretrain(cfg)
    assert len(list((out / "_drills").iterdir())) == 2  # the first attempt and its one restart
    assert not (out / "_MANIFEST.json").exists()
    assert [s for s, _ in checkpoint.committed_checkpoints(str(out))] == [3]  # the work that survived


def test_a_nonfinite_gradient_skips_its_step_and_a_loss_spike_rolls_back(deepspeed_workers, packed, tmp_path):
    """Rank 1's gradients of step 3 are NaN (its loss is finite): that optimizer step is not
    taken and its 2 micro-batches are passed over. Step 12 runs with its learning rate multiplied
    by 10^4: step 13's loss explodes, the run goes back to the checkpoint of step 10 and trains on
    past the batches of steps 11-13."""
    from lmfoundry.train.config import FaultDrill
    from lmfoundry.train.pretrain import run_pretrain

    out = tmp_path / "spike"
    drills = [FaultDrill(at_step=3, rank=1, kind="nan_grad"), FaultDrill(at_step=12, kind="lr_spike", lr_factor=1e4)]
    cfg = tiny_pretrain_config(
        packed[0],
        str(out),
        schedule={"max_steps": 20},
        checkpointing={"every": 5},
        health={"spike_factor": 3.0, "spike_window": 6},
        drills=drills,
    )
    manifest = run_pretrain(cfg)
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 21))  # the spiked steps were rolled back
    assert [r["skipped_batches"] for r in rows] == [0, 0] + [2] * 18  # accumulation: 2 micro-batches a step
    assert all(math.isfinite(r["loss"]) and math.isfinite(r["grad_norm"]) for r in rows)
    assert [r["rollbacks"] for r in rows] == [0] * 10 + [1] * 10
    losses = [r["loss"] for r in rows]
    assert max(losses[10:]) < 1.5 * losses[9]  # no trace of the spike after the rollback
    assert manifest["final_loss"] < manifest["first_loss"] - 0.5


def test_zero3_and_offload_train_checkpoint_whole_weights_and_resume_at_another_size(
    deepspeed_workers, packed, tmp_path
):
    """ZeRO-3: each rank holds half the weights; the servable checkpoint gathers them, and a run
    stopped at step 4 finishes at 1 worker (a killed ZeRO-3 run resuming at its own world size:
    test_sft_ray's LoRA run). ZeRO-2 with the optimizer offloaded gives the same losses."""
    from safetensors.torch import load_file

    from lmfoundry.model.checkpoint import WEIGHTS, load_model_files
    from lmfoundry.train.pretrain import run_pretrain

    settings = dict(
        parallelism={"zero_stage": 3}, schedule={"max_steps": 8, "warmup_steps": 2}, checkpointing={"every": 4}
    )
    clean = run_pretrain(tiny_pretrain_config(packed[0], str(tmp_path / "clean"), **settings))
    rows = {"clean": [json.loads(line) for line in open(tmp_path / "clean" / "metrics.jsonl")]}
    assert rows["clean"][-1]["loss"] < rows["clean"][0]["loss"]
    final = tmp_path / "clean" / clean["final_checkpoint"]
    model = load_model_files(final)  # whole weights, the shapes the config promises
    assert model.num_params() > 0
    weights = load_file(str(final / WEIGHTS))
    assert all(t.numel() > 0 for t in weights.values())
    # stopped after step 4 at 2 workers, finished by 1 (the partitions regathered through a
    # universal checkpoint): the clean run's losses, up to the other summation order
    # the clean run as if it had stopped after step 4's checkpoint: its newest checkpoint and its
    # manifest removed (a run killed at 2 workers resumes the same way: test_killed_workers_...)
    shrunk = stopped_at(tmp_path / "clean", 4, tmp_path / "shrunk")
    run_pretrain(
        tiny_pretrain_config(packed[0], str(shrunk), **{**settings, "parallelism": {"zero_stage": 3, "num_workers": 1}})
    )
    rows["shrunk"] = [json.loads(line) for line in open(shrunk / "metrics.jsonl")]
    assert [r["step"] for r in rows["shrunk"]] == list(range(1, 9))
    assert [r["loss"] for r in rows["shrunk"]] == pytest.approx([r["loss"] for r in rows["clean"]], rel=1e-5)
    # ZeRO-2 with the optimizer offloaded to CPU memory trains the same model to the same losses
    run_pretrain(
        tiny_pretrain_config(
            packed[0],
            str(tmp_path / "offload"),
            **{**settings, "parallelism": {"zero_stage": 2, "offload_optimizer": True}},
        )
    )
    offload = [json.loads(line)["loss"] for line in open(tmp_path / "offload" / "metrics.jsonl")]
    assert offload == pytest.approx([r["loss"] for r in rows["clean"]], rel=1e-4)


def losses(run: Path) -> list[float]:
    rows = [json.loads(line) for line in open(run / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step once
    return [r["loss"] for r in rows]


def final_weights(run: Path, names: list[str]) -> list[list[float]]:
    """The named tensors of the run's final checkpoint's servable weights."""
    from safetensors import safe_open

    final = run / json.loads((run / "_MANIFEST.json").read_text())["final_checkpoint"]
    with safe_open(str(final / "model.safetensors"), "pt") as weights:
        return [weights.get_tensor(name).tolist() for name in names]


def finish(data: str, run: Path, parallelism: dict, **overrides) -> list[float]:
    """The reference run's config at `parallelism`, a checkpoint every 5 steps, run (or resumed)
    in `run`: its losses."""
    from lmfoundry.train.pretrain import run_pretrain

    checkpointing = {"every": 5, **overrides.pop("checkpointing", {})}
    run_pretrain(
        tiny_pretrain_config(data, str(run), parallelism=parallelism, checkpointing=checkpointing, **overrides)
    )
    return losses(run)


@pytest.mark.parametrize(
    "parallelism, own_files",
    [
        # each rank of the tensor-parallel group saves its own shard of the weights (the head and
        # the tied embedding split by vocabulary rows; the sequence split between the layers)
        (
            {"num_workers": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "vocab_parallel": True},
            ("mp_rank_0[01]_model_states.pt", 2),
        ),
        # each stage saves its own layers, each split over its stage's 2 tensor-parallel ranks:
        # the embedding, 2 blocks, the norm (the tied head is the embedding, split by vocabulary
        # rows); 4 micro-batches a step through DeepSpeed's 1F1B schedule
        (
            {
                "num_workers": 4,
                "tensor_parallel_size": 2,
                "pipeline_parallel_size": 2,
                "zero_stage": 1,
                "vocab_parallel": True,
            },
            ("layer_0[0-4]-model_0[01]-model_states.pt", 8),
        ),
    ],
    ids=["tensor-parallel", "tensor-parallel-pipelined"],
)
def test_a_model_parallel_run_resumes_exactly_after_a_kill_and_moves_between_layouts(
    parallelism, own_files, deepspeed_workers, packed, pretrained, tmp_path
):
    """The reference run (2 workers, data parallel) stopped after step 30 and finished at TP 2
    (with sequence parallelism and a vocabulary-parallel head) or at TP 2 in each of 2 pipeline
    stages (the end stages' tied table split by vocabulary): its losses, up to the rounding of the
    other summation order. That run stopped after step 35 and finished again in its layout with
    the second worker killed after step 38: bitwise its own losses. The TP 2 run, stopped after
    step 35, also finishes as plain TP 2 (its head whole, no sequence split): its losses, up to
    rounding; the pipelined run, stopped after step 35, is finished by one worker holding the
    whole model: its losses, up to rounding (a TP 2 run's move to one worker is the untied
    test's below). Each move between layouts goes through a universal checkpoint (a pipeline's
    parameters renamed between its layers and the model)."""
    reference = losses(Path(pretrained[0]))
    moved = tmp_path / "from-dp"
    from_dp = finish(packed[0], stopped_at(Path(pretrained[0]), 30, moved), parallelism)
    pattern, count = own_files
    assert len(list(moved.glob(f"checkpoints/step-00000040/**/{pattern}"))) == count
    assert from_dp[:30] == reference[:30]
    assert from_dp[30:] == pytest.approx(reference[30:], abs=1e-4)
    killed = stopped_at(moved, 35, tmp_path / "killed")
    drills = [FaultDrill(at_step=38, rank=1)]
    assert finish(packed[0], killed, parallelism, drills=drills, health={"max_failures": 1}) == from_dp  # bitwise
    assert len(list((killed / "_drills").iterdir())) == 1  # the drill fired
    # the same layout, plain: the head whole, through the universal checkpoint (a pipeline's
    # split tables go through the same conversion into and out of it above and below)
    if parallelism.get("vocab_parallel") and "pipeline_parallel_size" not in parallelism:
        plain = {**parallelism, "vocab_parallel": False, "sequence_parallel": False}
        whole = finish(packed[0], stopped_at(moved, 35, tmp_path / "whole-head"), plain)
        assert whole == pytest.approx(from_dp, abs=1e-4)
        return  # (its move to one worker: test_an_untied_vocabulary_parallel_run_moves_to_one_worker)
    to_dp = finish(packed[0], stopped_at(moved, 35, tmp_path / "to-dp"), {"num_workers": 1})
    assert to_dp == pytest.approx(from_dp, abs=1e-4)
    final = tmp_path / "to-dp" / json.loads((tmp_path / "to-dp" / "_MANIFEST.json").read_text())["final_checkpoint"]
    state = json.loads((final / "train_state.json").read_text())
    assert (state["tensor_parallel_size"], state["pipeline_parallel_size"]) == (1, 1)


def test_an_interleaved_pipeline_resumes_exactly_after_a_kill_and_moves_between_layouts(
    deepspeed_workers, packed, tmp_path
):
    """A 4-block model, its last 3 blocks MoE layers with aux-free balancing, trained 20 steps by
    one worker, stopped after step 10 and finished in 2 pipeline stages of 2 virtual stages each
    (stage 0 holds blocks 0 and 2, stage 1 blocks 1 and 3; 4 micro-batches a step on the
    interleaved schedule): the one worker's losses, up to the rounding of the other summation
    order, and the routing biases (buffers, which DeepSpeed's universal load leaves as built)
    those of the one worker's last step. That run, stopped after step 15 and finished again
    with its second worker killed after step 18: bitwise its own losses; and finished by the same
    2 workers in 2 stages without virtual stages, where only which blocks a stage holds changed:
    its losses, up to rounding (DeepSpeed would load each stage's optimizer state by position, so
    stage 0's blocks 0 and 2 into blocks 0 and 1, were the change not seen). Each move goes
    through a universal checkpoint, and each moved run ends with the routing biases of the run it
    came from."""
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig

    routed = MoEConfig(
        num_experts=4,
        top_k=2,
        expert_hidden=32,
        first_dense_layers=1,
        score_func="sigmoid",
        balance="aux_free",
        bias_update_rate=0.02,  # enough to change the routing within the steps
    )
    sized = {
        "model": ModelConfig(n_layer=4, d_model=64, n_head=4, n_kv_head=2, moe=routed),
        "schedule": {"max_steps": 20},
        "checkpointing": {"keep_every": 5},
    }
    interleaved = {"num_workers": 2, "pipeline_parallel_size": 2, "virtual_stages": 2, "zero_stage": 1}
    one = tmp_path / "one"
    reference = finish(packed[0], one, {"num_workers": 1}, **sized)
    moved = tmp_path / "to-interleaved"
    from_one = finish(packed[0], stopped_at(one, 10, moved), interleaved, **sized)
    # the embedding, 4 blocks and the norm, each in the file of its index in the model
    assert len(list(moved.glob("checkpoints/step-00000020/**/layer_0[0-5]-model_00-model_states.pt"))) == 6
    assert from_one[:10] == reference[:10]
    assert from_one[10:] == pytest.approx(reference[10:], abs=1e-4)
    biases = [final_weights(run, [f"blocks.{i}.mlp.expert_bias" for i in (1, 2, 3)]) for run in (one, moved)]
    assert biases[0] == biases[1] and biases[0] != [[0.0] * 4] * 3
    killed = stopped_at(moved, 15, tmp_path / "killed")
    drills = [FaultDrill(at_step=18, rank=1)]
    assert finish(packed[0], killed, interleaved, drills=drills, health={"max_failures": 1}, **sized) == from_one
    assert len(list((killed / "_drills").iterdir())) == 1  # the drill fired
    plain = {**interleaved, "virtual_stages": 1}
    assert finish(packed[0], stopped_at(moved, 15, tmp_path / "plain"), plain, **sized) == pytest.approx(
        from_one, abs=1e-4
    )
    # (a pipeline's checkpoint back to a model without stages, its biases read from its layer
    # files: tests/test_stages.py moves an MoE pipeline to tensor parallelism)
    names = [f"blocks.{i}.mlp.expert_bias" for i in (1, 2, 3)]
    assert final_weights(tmp_path / "plain", names) == biases[1]


def test_an_untied_vocabulary_parallel_run_moves_to_one_worker(deepspeed_workers, packed, tmp_path):
    """An untied model at TP 2 with its embedding and its head each split by vocabulary rows (and
    the sequence split), stopped after step 5 and finished by one worker holding the whole model:
    the losses of the run that went on at TP 2, up to rounding. The universal checkpoint merges
    the embedding's rows, which lmfoundry splits, as it merges the head's, which AutoTP splits."""
    from lmfoundry.model.transformer import ModelConfig

    untied = {
        "model": ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, tie_embeddings=False),
        "schedule": {"max_steps": 10, "warmup_steps": 2},
    }
    split = {"num_workers": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "vocab_parallel": True}
    at_tp = finish(packed[0], tmp_path / "split", split, **untied)
    stopped = stopped_at(tmp_path / "split", 5, tmp_path / "whole")
    [(_, uri)] = checkpoint.committed_checkpoints(str(stopped))
    state = json.loads((Path(uri) / "train_state.json").read_text())
    assert state["vocab_parallel"] and state["vocab_parallel_embedding"]
    assert len(list(Path(uri).glob("**/mp_rank_0[01]_model_states.pt"))) == 2  # each rank its rows
    whole = finish(packed[0], stopped, {"num_workers": 1}, **untied)
    assert whole[:5] == at_tp[:5] and whole[5:] == pytest.approx(at_tp[5:], abs=1e-4)


def test_an_elastic_run_shrinks_when_a_node_is_lost_and_grows_back_when_it_returns(
    deepspeed_workers, packed, pretrained, tmp_path
):
    """The reference run with min_workers=1 on a Ray cluster of three nodes on this machine
    (benchmarks/harness/elastic_drill.py): a training node removed after step 12, so the group goes on with one
    worker from step 10, and added back after step 25, so it grows back to 2 workers from step
    20. Every step once, on the reference's batches: its losses, bitwise before the first change
    and up to the rounding of the other summation order after it."""
    from harness.elastic_drill import run_elastic_drill

    from lmfoundry.platform.ray_env import init_ray

    out = tmp_path / "elastic"
    cfg = tiny_pretrain_config(
        packed[0],
        str(out),
        parallelism={"min_workers": 1, "elastic_resize_interval_s": 2},
        health={"max_failures": 2},
    )
    try:
        run_elastic_drill(cfg, remove_after=12, add_after=25)
    finally:
        init_ray()  # the session's local Ray again, for the tests after this one
    rows = [json.loads(line) for line in open(out / "metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 41))
    assert [r["world_size"] for r in rows] == [2] * 10 + [1] * 10 + [2] * 20
    reference = [json.loads(line) for line in open(Path(pretrained[0]) / "metrics.jsonl")]
    assert [r["loss"] for r in rows[:10]] == [r["loss"] for r in reference[:10]]
    assert [r["loss"] for r in rows] == pytest.approx([r["loss"] for r in reference], rel=1e-5)


@pytest.mark.parametrize(
    "layout",
    [
        {"world_size": 0},
        {"world_size": 2, "tensor_parallel_size": 0},
        {"world_size": 2, "pipeline_parallel_size": "2"},
        {"world_size": 3, "tensor_parallel_size": 2},
        {"world_size": True},
        {"world_size": 2, "pipeline_parallel_size": 2, "virtual_stages": 0},
        {"world_size": 2, "virtual_stages": 2},  # virtual stages without a pipeline
        {"world_size": 2, "pipeline_parallel_size": 2, "virtual_stages": 2.0},
        {"world_size": 2, "pipeline_parallel_size": 2, "virtual_stages": 10**9},
        {},
    ],
)
def test_a_training_state_with_an_impossible_layout_is_refused_before_any_arithmetic(layout):
    from lmfoundry.train.checkpointing import _written_layout

    with pytest.raises(ValueError, match="each must be a positive integer"):
        _written_layout({"step": 10, **layout}, "run/checkpoints/step-00000010")


def test_older_training_states_name_only_their_workers():
    from lmfoundry.train.checkpointing import _written_layout

    assert _written_layout({"world_size": 2}, "uri") == (2, 1, 1, 1)
    assert _written_layout({"world_size": 4, "tensor_parallel_size": 2}, "uri") == (4, 2, 1, 1)
    assert _written_layout({"world_size": 4, "pipeline_parallel_size": 2}, "uri") == (4, 1, 2, 1)


def test_older_training_states_say_which_vocabulary_tables_were_split():
    """(head, embedding) split by vocabulary rows. Before heads were split: neither. Before
    untied embeddings were split: the embedding only when tied to the split head, so an untied
    run of then resumes into today's split embedding through the universal checkpoint."""
    from lmfoundry.train.checkpointing import written_vocabulary_split

    assert written_vocabulary_split({"world_size": 2}, tied=True) == (False, False)
    assert written_vocabulary_split({"vocab_parallel": True}, tied=True) == (True, True)
    assert written_vocabulary_split({"vocab_parallel": True}, tied=False) == (True, False)
    state = {"vocab_parallel": True, "vocab_parallel_embedding": True}
    assert written_vocabulary_split(state, tied=False) == (True, True)
    off = {"vocab_parallel": False, "vocab_parallel_embedding": False}
    assert written_vocabulary_split(off, tied=True) == (False, False)


@pytest.mark.parametrize("key", ["vocab_parallel", "vocab_parallel_embedding"])
@pytest.mark.parametrize("bad", ["false", 1, 0, None, [], {"x": 1}])
def test_a_training_state_whose_vocabulary_split_is_not_a_boolean_is_refused(key, bad):
    """The file comes from storage: a string "false", which Python reads as true, must not
    decide whether the checkpoint is loaded as split."""
    from lmfoundry.train.checkpointing import written_vocabulary_split

    with pytest.raises(ValueError, match=f"train_state.json: {key} is .*; allowed: true or false"):
        written_vocabulary_split({"vocab_parallel": True, key: bad}, tied=False)
