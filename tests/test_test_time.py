"""Test-time compute strategies (clients/test_time.py): each on hand-made samples whose right
result is worked out by hand, then on a real checkpoint for token counts, budgets and seeds."""

import itertools

import pytest
from test_export import make_checkpoint

from lmfoundry.reasoning import test_time, verifiers


def answer_of(text: str) -> str | None:
    for line in text.splitlines():
        if line.startswith("Answer: "):
            return line[len("Answer: ") :].strip()
    return None


class Scripted:
    """Continuations read from a table per prompt, in turn, each `tokens` tokens long."""

    def __init__(self, table: dict[str, list[str]], tokens: int = 10):
        self.turns = {prompt: itertools.cycle(texts) for prompt, texts in table.items()}
        self.tokens = tokens
        self.asked = []

    def continuations(self, prompt, n, max_tokens, temperature, seed, stop=()):
        self.asked.append((prompt, n, temperature))
        return [(next(self.turns[prompt]), self.tokens) for _ in range(n)]


class ByTable:
    def __init__(self, scores: dict[str, float]):
        self.scores = scores

    def score(self, prompt, solutions):
        return [self.scores.get(answer_of(s), 0.0) for s in solutions]


SAMPLES = ["x\nAnswer: 5", "y\nAnswer: 7", "z\nAnswer: 5", "no answer", "w\nAnswer: 7", "v\nAnswer: 5"]


def test_majority_vote_counts_final_answers_and_ignores_samples_without_one():
    sampler = Scripted({"Q": SAMPLES})
    result = test_time.majority_vote(sampler, "Q", answer_of, n=6, budget_tokens=1000, max_tokens=10)
    assert result.answer == "5" and result.votes == {"5": 3.0, "7": 2.0}
    assert result.samples == 6 and result.tokens == 60
    assert all(t > 0 for _, _, t in sampler.asked)  # sampled, not greedy


def test_weighted_vote_and_best_of_n_follow_the_scorer():
    scorer = ByTable({"5": 0.1, "7": 0.9})
    weighted = test_time.weighted_vote(Scripted({"Q": SAMPLES}), scorer, "Q", answer_of, 6, 1000, 10)
    assert weighted.answer == "7" and weighted.votes == pytest.approx({"5": 0.3, "7": 1.8})
    best = test_time.best_of_n(Scripted({"Q": SAMPLES}), scorer, "Q", answer_of, 6, 1000, 10)
    assert best.answer == "7" and best.solution == "y\nAnswer: 7"  # the first of the best-scored


def test_a_strategy_stops_drawing_once_its_token_budget_is_spent():
    sampler = Scripted({"Q": SAMPLES})
    result = test_time.majority_vote(sampler, "Q", answer_of, n=16, budget_tokens=35, max_tokens=10)
    # three samples fit the budget at 10 tokens each; one more is drawn for the 5 tokens left
    assert [n for _, n, _ in sampler.asked] == [3, 1]
    assert result.samples == 4 and result.tokens == 40


def test_step_beam_search_keeps_the_steps_a_process_scorer_rates_and_finds_the_right_answer():
    """Each step offers a right and a wrong continuation; the scorer is the step checker of
    synthetic maths (every step so far must hold), so the search must keep the right path."""
    sample = {"kind": "arithmetic", "expression": "(12 + 5) * 3"}
    prompt = "Compute (12 + 5) * 3.\n"
    table = {
        prompt: ["12 + 5 = 16", "12 + 5 = 17"],
        prompt + "12 + 5 = 17\n": ["17 * 3 = 51", "17 * 3 = 41"],
        prompt + "12 + 5 = 16\n": ["16 * 3 = 48"],
        prompt + "12 + 5 = 17\n17 * 3 = 51\n": ["Answer: 51", "Answer: 41"],
        prompt + "12 + 5 = 17\n17 * 3 = 41\n": ["Answer: 41"],
    }

    class Steps:
        def score_steps(self, prompt, partials):
            return [
                float(all(verifiers.step_is_correct(sample, s) for s in steps if not s.startswith("Answer")))
                + (0.5 if answer_of(steps[-1]) == "51" else 0.0)
                for steps in partials
            ]

    result = test_time.step_beam_search(
        Scripted(table, tokens=4), Steps(), prompt, answer_of, beam_width=1, expand=2, budget_tokens=100,
        max_step_tokens=8, max_steps=5,
    )  # fmt: skip
    assert result.answer == "51" and result.solution == "12 + 5 = 17\n17 * 3 = 51\nAnswer: 51"
    assert result.tokens == 3 * 2 * 4  # three rounds of two samples


def test_on_a_checkpoint_sampling_is_seeded_cut_at_stop_strings_and_counted(tmp_path):
    from lmfoundry.clients.checkpoint import CheckpointModel

    make_checkpoint(tmp_path / "ckpt")
    model = CheckpointModel(str(tmp_path / "ckpt"))
    first = model.continuations("Compute 2 + 2.\n", 3, 12, 1.0, seed=5)
    again = model.continuations("Compute 2 + 2.\n", 3, 12, 1.0, seed=5)
    assert first == again and len({text for text, _ in first}) > 1  # seeded per sample, and sampled
    assert all(0 < tokens <= 12 for _, tokens in first)
    stopped = model.continuations("Compute 2 + 2.\n", 4, 12, 1.0, seed=5, stop=["e"])
    assert all("e" not in text for text, _ in stopped)
    greedy = test_time.greedy(model, "Compute 2 + 2.\n", answer_of, max_tokens=12)
    assert greedy.samples == 1 and 0 < greedy.tokens <= 12 and greedy.answer is None  # random weights
    voted = test_time.majority_vote(model, "Compute 2 + 2.\n", answer_of, n=8, budget_tokens=30, max_tokens=12)
    assert voted.tokens >= 30 and voted.samples < 8  # the budget, not n, ended it


def test_the_reasoning_suite_reports_accuracy_and_tokens_at_each_budget(tmp_path):
    from lmfoundry.align import synth
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval import gate
    from lmfoundry.eval.reasoning import ReasoningConfig
    from lmfoundry.eval.suite import EvalSuites, evaluate

    synth.run_synth(synth.SynthConfig(output=str(tmp_path / "held"), kinds={"arithmetic": 3, "code": 1}, seed=9))
    make_checkpoint(tmp_path / "ckpt")
    suites = EvalSuites(
        reasoning=ReasoningConfig(
            problems=str(tmp_path / "held"), strategies=["greedy", "majority_vote", "best_of_n"], samples=[1, 4],
            max_tokens=6,
        )
    )  # fmt: skip
    report = evaluate(CheckpointModel(str(tmp_path / "ckpt")), suites, out_dir=str(tmp_path / "eval"))
    rows = report["reasoning"]["strategies"]
    assert report["reasoning"]["problems"] == 3  # the code sample is not a maths problem
    assert set(rows) == {"greedy", "majority_vote", "best_of_n"} and set(rows["greedy"]) == {"1"}
    assert rows["majority_vote"]["4"]["tokens_per_problem"] > rows["majority_vote"]["1"]["tokens_per_problem"]
    assert report["metrics"]["reasoning.best_of_n.n4.acc"] == rows["best_of_n"]["4"]["accuracy"]
    assert report["sample_sizes"]["reasoning.best_of_n.n4.acc"] == 3
    assert gate.rule("reasoning.best_of_n.n4.acc")[0] == "higher"
    assert (tmp_path / "eval" / "reasoning.png").stat().st_size > 1000


def test_reasoning_settings_and_problem_files_are_checked(tmp_path):
    from lmfoundry.eval.reasoning import ReasoningConfig, read_problems

    with pytest.raises(ValueError, match="allowed"):
        ReasoningConfig(problems="p", strategies=["mcts"])
    with pytest.raises(ValueError, match="between 1 and 1024"):
        ReasoningConfig(problems="p", samples=[0])
    bad = tmp_path / "p.jsonl"
    bad.write_text('{"kind": "code", "question": "q"}\n')
    with pytest.raises(ValueError, match="no arithmetic or algebra"):
        read_problems(str(bad), 10)
    bad.write_text("{not json\n")
    with pytest.raises(ValueError, match=":1: not JSON"):
        read_problems(str(bad), 10)


def test_samples_decoded_together_equal_each_seed_decoded_alone(tmp_path):
    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.model.generate import generate, sample_groups, sample_many

    make_checkpoint(tmp_path / "ckpt")
    model = load_model_files(str(tmp_path / "ckpt"))
    prompt = [5, 9, 2, 7]
    together = sample_many(model, prompt, 4, 10, 1.0, [11, 12, 13, 14], stop_tokens=frozenset({3}))
    alone = [generate(model, prompt, 10, 1.0, stop_tokens=frozenset({3}), seed=s) for s in (11, 12, 13, 14)]
    assert [g.tokens for g in together] == [g.tokens for g in alone]
    assert [g.finish_reason for g in together] == [g.finish_reason for g in alone]
    cut = sample_many(model, prompt, 2, 10, 1.0, [1, 2], finished=lambda tokens: len(tokens) == 3)
    assert all(len(g.tokens) == 3 and g.finish_reason == "stop" for g in cut)
    with pytest.raises(ValueError, match="2 seeds for 3 samples"):
        sample_many(model, prompt, 3, 10, 1.0, [1, 2])
    # several prompts of different lengths in one batch (GRPO's groups): each group is what its
    # prompt gives alone
    prompts, seeds = [[5, 9], [4, 8, 1, 6, 2], [7]], [[1, 2], [3, 4], [5, 6]]
    groups = sample_groups(model, prompts, 2, 8, 1.0, seeds, stop_tokens=frozenset({3}))
    for p, s, group in zip(prompts, seeds, groups):
        assert [g.tokens for g in group] == [g.tokens for g in sample_many(model, p, 2, 8, 1.0, s, frozenset({3}))]
