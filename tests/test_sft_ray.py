"""Supervised fine-tuning on real Ray Train + DeepSpeed workers: a run with every checkpoint
evaluated, the same run with a worker killed (bitwise-equal losses after the resume), both with
one layer's attention frozen, and a LoRA
run under ZeRO-3 whose checkpoints hold the adapter only and whose before-and-after figures, measured
by the workers on partitioned models, equal those of the models whole."""

import json
from pathlib import Path

import pytest
import torch
from sft_chats import build_chat_checkpoint, write_chats

from lmfoundry.model.checkpoint import WEIGHTS, load_model_files
from lmfoundry.model.lora import ADAPTER_CONFIG, ADAPTER_WEIGHTS

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module")
def base(tmp_path_factory):
    """A small random model with a tokenizer that knows the chats and lmfoundry's chat template."""
    root = tmp_path_factory.mktemp("sft")
    chats = write_chats(root / "chats.jsonl", 96)
    ckpt = build_chat_checkpoint(root / "base", Path(chats).read_text().splitlines())
    return ckpt, chats


def sft_config(base, out, **overrides):
    from lmfoundry.jobs.sft import SFTJobConfig

    settings = dict(
        checkpoint=base[0],
        data=base[1],
        output=str(out),
        optimizer={"lr": 3e-3},
        schedule={"warmup_steps": 2, "max_steps": 12},
        batch={"micro_batch_size": 2, "global_batch_sequences": 4},
        parallelism={"num_workers": 2, "zero_stage": 1, "cpus_per_worker": 0.5},
        checkpointing={"every": 4, "keep_last": 3},  # every checkpoint stays for its evaluation
        logging={"every": 1},
    )
    return SFTJobConfig(**{**settings, **overrides})


def losses(run: Path) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())]


def test_sft_learns_the_assistant_turns_and_resumes_bitwise_after_a_killed_worker(deepspeed_workers, base, tmp_path):
    from lmfoundry.eval.suite import EvalSuites
    from lmfoundry.jobs.sft import run_sft_job

    held_out = tmp_path / "held_out.jsonl"
    held_out.write_text("".join(json.dumps({"text": f"What is {i} + {i}? {2 * i}."}) + "\n" for i in range(20)))
    # kept at the base's values through the kill and the resume too: one layer's attention, and the
    # head untied from the embedding (which trains)
    frozen = dict(freeze=["blocks.0.attn.*", "lm_head.weight"], untie_embeddings=True)
    reference = run_sft_job(
        sft_config(base, tmp_path / "ref", eval=EvalSuites(text=[str(held_out)]), eval_cpus=0.5, **frozen)
    )
    # (less than a whole run would learn in 12 steps: the random base's head stays as it was drawn)
    assert reference["assistant_loss"]["after"] < reference["assistant_loss"]["before"] - 0.5
    report = reference["data_report"]
    assert report["conversations"] == report["trained"] == 96 and report["truncated"] == 0
    assert [e["step"] for e in reference["evaluations"]] == [4, 8, 12]
    assert all("lm.text_bits_per_byte" in e["metrics"] for e in reference["evaluations"])

    drilled = run_sft_job(
        sft_config(base, tmp_path / "drilled", drills=[{"at_step": 6, "rank": 1}], health={"max_failures": 1}, **frozen)
    )
    assert list((tmp_path / "drilled" / "_drills").iterdir())  # the worker was killed, and the run resumed
    assert [s for s, _ in losses(tmp_path / "drilled")] == list(range(1, 13))
    assert losses(tmp_path / "drilled") == losses(tmp_path / "ref")  # bitwise
    assert drilled["fingerprint"] == reference["fingerprint"]
    start = dict(load_model_files(base[0]).named_parameters())
    start["lm_head.weight"] = start["embed.weight"]  # the tied base's head
    final = load_model_files(tmp_path / "drilled" / drilled["final_checkpoint"])
    assert not final.cfg.tie_embeddings
    for name, param in final.named_parameters():
        assert torch.equal(param, start[name]) == name.startswith(("blocks.0.attn.", "lm_head.")), name


def test_a_lora_run_under_zero3_trains_and_saves_the_adapter_only(deepspeed_workers, base, tmp_path):
    from lmfoundry.jobs.sft import run_sft_job

    base_weights = (Path(base[0]) / WEIGHTS).read_bytes()
    cfg = sft_config(
        base,
        tmp_path / "lora",
        lora={"rank": 8, "alpha": 16, "targets": ["wq", "wkv", "wo", "w_gate_up", "w_down"]},
        optimizer={"lr": 1e-2},
        # the base as a token-level teacher: under ZeRO-3 partitioned too, in a frozen engine
        distill={"teacher": base[0], "weight": 0.5},
        parallelism={"num_workers": 2, "zero_stage": 3, "cpus_per_worker": 0.5},
        schedule={"warmup_steps": 1, "max_steps": 8},
        drills=[{"at_step": 5, "rank": 0}],
        health={"max_failures": 1},
    )
    result = run_sft_job(cfg)
    assert result["assistant_loss"]["after"] < result["assistant_loss"]["before"] - 0.2
    assert [s for s, _ in losses(tmp_path / "lora")] == list(range(1, 9))  # resumed from step 4's adapter
    logged = [json.loads(line) for line in open(tmp_path / "lora" / "metrics.jsonl")]
    assert all("kl" in row for row in logged if "loss" in row)  # the teacher ran beside the student
    assert logged[0]["kl"] < 1e-6  # at step 1 the adapters add nothing (B = 0): the student is its base
    assert max(row["kl"] for row in logged) > 1e-4  # and it moved away from it
    final = tmp_path / "lora" / result["final_checkpoint"]
    assert (final / ADAPTER_WEIGHTS).exists() and not (final / WEIGHTS).exists()
    ref = json.loads((final / ADAPTER_CONFIG).read_text())
    assert ref["base"] == base[0] and ref["base_sha256"] == result["base_sha256"]
    # DeepSpeed's own files hold the adapter and its optimizer state, not the frozen base
    state_bytes = sum(f.stat().st_size for f in (final / "deepspeed").rglob("*") if f.is_file())
    assert state_bytes < len(base_weights)
    assert (Path(base[0]) / WEIGHTS).read_bytes() == base_weights
    merged = load_model_files(final)
    assert any(
        not torch.equal(p, q) for p, q in zip(merged.parameters(), load_model_files(base[0]).parameters(), strict=True)
    )
    # the workers measured the figures on partitioned models; one process holding each model
    # whole finds the same
    from lmfoundry.train.sft import assistant_loss_sum, row_length, sample_rows
    from lmfoundry.train.sft_data import prepare

    packed, _ = prepare(base[1], base[0], row_length(cfg, merged.cfg.max_seq_len))
    rows = list(sample_rows(len(packed)))
    for when, model in (("before", load_model_files(base[0])), ("after", merged)):
        with torch.no_grad():
            total, count = assistant_loss_sum(model, packed, rows, "cpu")
        assert result["assistant_loss"][when] == pytest.approx(total / count, rel=1e-5)
    assert result["assistant_loss"]["rows"] == len(rows)
