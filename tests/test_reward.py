"""Reward models: the losses on hand-computed examples, the data formats and their errors,
automatic step labels, the scorer, and a process reward model trained on Ray Train + DeepSpeed
from labels it made itself."""

import json
import math

import pytest
import torch
from test_export import make_checkpoint

from lmfoundry.reasoning import step_labels
from lmfoundry.train import reward


def test_bradley_terry_and_pointwise_losses_on_hand_computed_examples():
    loss, stats = reward.bradley_terry_loss(torch.tensor([1.0, 0.0]), torch.tensor([0.0, 2.0]))
    expected = (-math.log(1 / (1 + math.exp(-1))) - math.log(1 / (1 + math.exp(2)))) / 2
    assert loss.item() == pytest.approx(expected) and stats["accuracy"] == 0.5 and stats["margin"] == -0.5
    loss, stats = reward.pointwise_loss(torch.tensor([0.0, 2.0, -1.0]), torch.tensor([1.0, 1.0, 0.25]))
    parts = [math.log(2), math.log(1 + math.exp(-2)), -(0.25 * math.log(1 / (1 + math.e)) + 0.75 * math.log(1 - 1 / (1 + math.e)))]  # fmt: skip
    assert loss.item() == pytest.approx(sum(parts) / 3, rel=1e-5)
    assert stats["accuracy"] == pytest.approx(2 / 3)  # 0.0 is not above 0, so the first is wrong


def test_reward_data_must_be_one_format_with_valid_labels(tmp_path):
    f = tmp_path / "data.jsonl"
    f.write_text('{"prompt": "p", "steps": ["a", "b"], "labels": [1, 0]}\n')
    assert reward.read_rows(str(f))[0] == "process"
    cases = {
        '{"prompt": "p", "text": "t"}': "not a reward example",
        '{"prompt": "p", "steps": ["a"], "labels": [1, 0]}': "one number from 0 to 1 per step",
        '{"prompt": "p", "steps": [], "labels": []}': "non-empty list",
        '{"prompt": "p", "reply": "r", "label": 2}': "from 0 to 1",
        '{"prompt": "p", "reply": "r", "label": true}': "from 0 to 1",
    }
    for row, message in cases.items():
        f.write_text(row + "\n")
        with pytest.raises(ValueError, match=message):
            reward.read_rows(str(f))
    f.write_text('{"prompt": "p", "reply": "r", "label": 1}\n{"prompt": "p", "chosen": "a", "rejected": "b"}\n')
    with pytest.raises(ValueError, match=":2: a pairs row among outcome rows"):
        reward.read_rows(str(f))


def test_steps_are_scored_at_their_last_token_and_what_does_not_fit_is_left_out():
    from lmfoundry.clients.reward import encode_steps

    def encode(text):
        return [ord(c) for c in text]

    ids, positions = encode_steps(encode, "Q?", ["1+1=2", "Answer: 2"], max_len=64, eos=0)
    assert ids == encode("Q?1+1=2\nAnswer: 2\n") and positions == [7, 17]
    ids, positions = encode_steps(encode, "Q?", ["1+1=2", "Answer: 2"], max_len=12, eos=0)
    assert positions == [7] and len(ids) == 8


def test_a_new_reward_model_scores_zero_and_cannot_be_served_or_exported(tmp_path):
    from lmfoundry.clients.reward import RewardScorer
    from lmfoundry.model.checkpoint import save_model_files
    from lmfoundry.model.export import export_hf

    make_checkpoint(tmp_path / "lm")
    model = reward.reward_model(str(tmp_path / "lm"))
    assert model.cfg.reward_head and model.lm_head.weight.shape[0] == 1
    out, _ = model(torch.tensor([[1, 2, 3]]))
    assert out.shape == (1, 3, 1) and float(out.abs().max()) == 0.0
    # under ZeRO-3 it is built on the meta device: the values it is given are the whole build's
    meta, values = reward.reward_model_on_meta(str(tmp_path / "lm"))
    whole = dict(model.named_parameters())
    assert meta.cfg == model.cfg and set(values) == set(whole)
    assert all(torch.equal(values[name](), whole[name]) for name in whole)
    with pytest.raises(ValueError, match="not a reward model"):
        RewardScorer(str(tmp_path / "lm"))
    rm = tmp_path / "rm"
    make_checkpoint(rm)
    save_model_files(model, rm)
    scorer = RewardScorer(str(rm))
    assert scorer.score("Q\n", ["a", "b"]) == [0.0, 0.0]
    assert scorer.score_steps("Q\n", [["x"], []]) == [0.0, float("-inf")]
    with pytest.raises(ValueError, match="reward model"):
        export_hf(rm, tmp_path / "hf")


class FromStep:
    """A policy whose completions reach the answer only from the right first step."""

    def continuations(self, prompt, n, max_tokens, temperature, seed, stop=()):
        if prompt.endswith("Compute (2 + 3) * 4.\n"):
            return [("2 + 3 = 5\n5 * 4 = 20\nAnswer: 20", 9), ("2 + 3 = 6\n6 * 4 = 24\nAnswer: 24", 9)][:n]
        right = "2 + 3 = 5\n" in prompt
        return [("Answer: 20" if right else "Answer: 24", 3)] * n


def test_step_labels_come_from_completions_and_are_measured_against_the_truth():
    problem = {"kind": "arithmetic", "expression": "(2 + 3) * 4", "question": "Compute (2 + 3) * 4."}
    rows = step_labels.label_problem(FromStep(), problem, 2, 3, 32, 0.8, 0.25, seed=0)
    assert [r["steps"] for r in rows] == [["2 + 3 = 5", "5 * 4 = 20"], ["2 + 3 = 6", "6 * 4 = 24"]]
    assert [r["labels"] for r in rows] == [[1.0, 1.0], [0.0, 0.0]]
    assert [r["true_labels"] for r in rows] == [[1.0, 1.0], [0.0, 1.0]]  # 6 * 4 = 24 holds on its own
    assert [r["solved"] for r in rows] == [True, False]
    summary = step_labels.agreement(rows)
    assert summary["steps"] == 4 and summary["agreement"] == 0.75
    assert summary["true_steps_labelled_good"] == pytest.approx(2 / 3) and summary["false_steps_labelled_bad"] == 1.0


def test_a_process_reward_model_trains_on_its_own_step_labels(deepspeed_workers, pretrained, tmp_path):
    # a killed worker's resume is the training skeleton's, drilled for pretraining, SFT, DPO and GRPO
    from lmfoundry.align import synth
    from lmfoundry.clients.reward import RewardScorer
    from lmfoundry.jobs.reward import RewardJobConfig, run_reward_job
    from lmfoundry.platform import checkpoint

    synth.run_synth(synth.SynthConfig(output=str(tmp_path / "problems"), kinds={"arithmetic": 4, "algebra": 4}))
    cfg = RewardJobConfig(
        checkpoint=pretrained[0],
        output=str(tmp_path / "prm"),
        step_labels={"problems": str(tmp_path / "problems"), "limit": 8, "solutions": 2, "completions": 2,
                     "max_tokens": 16},
        validation_fraction=0.25,
        optimizer={"lr": 3e-3},
        schedule={"warmup_steps": 1, "max_steps": 8},
        batch={"micro_batch_size": 2, "global_batch_size": 4},
        # one worker starts faster; ranks are the skeleton's. ZeRO-3: the reward model built on the
        # meta device, its decoder read from the checkpoint and its head zeros as it is partitioned
        parallelism={"num_workers": 1, "zero_stage": 3},
        checkpointing={"every": 4},
        logging={"every": 1},
    )  # fmt: skip
    result = run_reward_job(cfg)
    run = tmp_path / "prm"
    rows = [json.loads(line) for line in (run / "step_labels.jsonl").read_text().splitlines()]
    assert rows and all(len(r["labels"]) == len(r["steps"]) == len(r["true_labels"]) for r in rows)
    assert result["kind"] == "process" and result["step_labels"]["steps"] == sum(len(r["steps"]) for r in rows)
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 9))
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6)  # the new head is zeros: every score 0
    assert result["final_loss"] < result["first_loss"]
    scorer = RewardScorer(checkpoint.resolve(str(run)))
    scores = scorer.score_steps(rows[0]["prompt"], [rows[0]["steps"][:1], rows[0]["steps"]])
    assert all(math.isfinite(s) for s in scores) and scores[0] != 0.0
    # the worker measured the held-out accuracy on partitioned models (the starting one with its
    # zero head); the models whole give the same
    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.train.reward import Encoder, ranked_right, read_rows, reward_model, split

    start = checkpoint.resolve(pretrained[0])
    fmt, data = read_rows(str(run / "step_labels.jsonl"))
    encoder = Encoder(start, load_model_files(start).cfg.max_seq_len)
    held = [encoder.encode(fmt, row) for row in split(data, cfg.validation_fraction, cfg.seed)[1]]
    final = load_model_files(checkpoint.resolve(str(run)))
    for when, model in (("before", reward_model(start).eval()), ("after", final)):
        with torch.no_grad():
            hits, scored = ranked_right(model, held, encoder.eos, "cpu")
        assert result["held_out_accuracy"][when] == pytest.approx(hits / scored)
