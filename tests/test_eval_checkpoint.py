"""Evaluation of the session's trained checkpoint: agreement with lm-evaluation-harness run on the
Hugging Face export, and the `lmfoundry evaluate` command with its regression gate. (Pretraining's
evaluation of each checkpoint as it is committed, a restart's included, is checked on the run of
test_fault_tolerance's test_killed_workers_resume_to_bitwise_equal_losses.)"""

import json
import os

import pytest

pytestmark = pytest.mark.timeout(600)

BUILTIN = os.path.join(os.path.dirname(__file__), "..", "lmfoundry", "eval", "suites", "tasks")
TASK_FILES = [os.path.join(BUILTIN, f) for f in ("arithmetic_mc.yaml", "common_sense_mc.yaml", "repeat_word.yaml")]


def test_the_shipped_tasks_score_the_same_under_lm_evaluation_harness(pretrained, tmp_path, monkeypatch):
    lm_eval = pytest.importorskip("lm_eval")
    from lm_eval.tasks import TaskManager

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.tasks import harness_copy, load_tasks, run_task
    from lmfoundry.model.export import export_hf
    from lmfoundry.platform.checkpoint import resolve

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_DATASETS_OFFLINE", "1")
    ckpt = resolve(pretrained[0])
    export_hf(ckpt, tmp_path / "hf")
    include = harness_copy(TASK_FILES, tmp_path / "harness_tasks")
    ours = {t.name: run_task(t, CheckpointModel(ckpt)) for t in load_tasks(TASK_FILES)}
    theirs = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={tmp_path / 'hf'},dtype=float32",
        tasks=sorted(ours),
        task_manager=TaskManager(include_path=str(include)),
        log_samples=True,
        batch_size=8,
        device="cpu",
    )
    for name, result in ours.items():
        for metric, value in result["metrics"].items():
            assert theirs["results"][name][f"{metric},none"] == pytest.approx(value, abs=1e-9), (name, metric)
        if result["output_type"] != "multiple_choice":
            continue
        for sample in theirs["samples"][name]:  # every choice's log-likelihood, document by document
            mine = result["samples"][sample["doc_id"]]["loglikelihoods"]
            assert [r[0][0] for r in sample["resps"]] == pytest.approx(mine, abs=1e-4)
    # a model that learned something beats chance on the everyday completions
    assert ours["lmfoundry_common_sense_mc"]["documents"] == 30


def evaluate_cli(args):
    from lmfoundry.jobs.evaluate import main

    return main(args)


def test_evaluate_command_writes_the_report_and_the_gate_catches_a_regression(pretrained, packed, tmp_path, capsys):
    config = tmp_path / "evaluate.yaml"
    config.write_text(
        f"checkpoint: {pretrained[0]}\ndata: {packed[0]}\noutput: {tmp_path / 'base'}\ntasks: [builtin]\n"
        "task_limit: 10\nhhh:\n  limit: 4\n  max_tokens: 8\nneedle:\n  lengths: [32, 64]\n  depths: [0.0, 1.0]\n"
        "  trials: 1\nredteam:\n  families: [injection, base64]\n  attacks_per_family: 2\n  max_tokens: 8\n"
    )
    assert evaluate_cli([str(config)]) == 0
    base = json.loads((tmp_path / "base" / "eval.json").read_text())
    metrics = base["metrics"]
    for name in (
        "lm.perplexity",
        "task.lmfoundry_arithmetic_mc.acc",
        "helpful.task_success",
        "harmless.refusal_rate",
        "honest.ece",
        "long_context.effective_context_length",
        "red_team.attack_success_rate",
    ):
        assert name in metrics
    assert (tmp_path / "base" / "report.html").read_text().startswith("<!doctype html>")
    # the same checkpoint against its own report passes
    capsys.readouterr()
    assert (
        evaluate_cli(
            [str(config), "--output", str(tmp_path / "same"), "--baseline", str(tmp_path / "base" / "eval.json")]
        )
        == 0
    )
    # a baseline that was better on harmlessness (measured on many prompts, so the drop is outside
    # the noise of this run's four) and on perplexity fails the gate, exit 1
    better = {
        **base,
        "metrics": {
            **metrics,
            "harmless.refusal_rate": metrics["harmless.refusal_rate"] + 0.5,
            "lm.perplexity": metrics["lm.perplexity"] * 0.5,
        },
        "sample_sizes": {**base["sample_sizes"], "harmless.refusal_rate": 10_000},
    }
    (tmp_path / "better.json").write_text(json.dumps(better))
    assert (
        evaluate_cli([str(config), "--output", str(tmp_path / "worse"), "--baseline", str(tmp_path / "better.json")])
        == 1
    )
    err = capsys.readouterr().err
    assert "harmless.refusal_rate" in err and "lm.perplexity" in err
    gate = json.loads((tmp_path / "worse" / "eval.json").read_text())["gate"]
    assert not gate["passed"] and {r["metric"] for r in gate["regressions"]} == {
        "harmless.refusal_rate",
        "lm.perplexity",
    }
    # rerunning a committed evaluation re-judges it without recomputing, and still fails
    assert (
        evaluate_cli([str(config), "--output", str(tmp_path / "worse"), "--baseline", str(tmp_path / "better.json")])
        == 1
    )
    # bad configs are exit 2 with the reason
    assert evaluate_cli([str(config), "--set", "hhh.limit=0"]) == 2
    assert evaluate_cli([str(config), "--set", "endpoint.url=http://x", "--set", "endpoint.model=m"]) == 2
    assert "exactly one of checkpoint" in capsys.readouterr().err
