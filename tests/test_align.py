"""Alignment data: pair routing with a scripted judge (ties, low confidence, disagreement), audit
sampling, held-out exclusion, the review queue on a real SQLite database (and its CLI), the
verifiers of synthetic data, and the DPO loss and batching."""

import json
import math

import pytest
import torch

from lmfoundry.align import pairs, review, synth
from lmfoundry.align.judge import DIMENSIONS
from lmfoundry.reasoning import verifiers

pytestmark = pytest.mark.timeout(120)


def cfg(tmp_path, **kw):
    return pairs.PairsConfig(
        prompts="p.jsonl", output=str(tmp_path / "out"), student={"checkpoint": "s"}, judge={"checkpoint": "j"}, **kw
    )


class ScriptedJudge:
    """Scores a reply by a table; prefers by the same table, or always the first shown (a judge
    with position bias)."""

    name = "scripted"

    def __init__(self, table, position_bias=False, noisy=None):
        self.table, self.position_bias, self.noisy = table, position_bias, noisy or {}

    def score(self, prompt, reply, seed):
        value = self.noisy.get((reply, seed), self.table[reply])
        return {d: float(value) for d in DIMENSIONS}

    def prefer(self, prompt, first, second, seed):
        if self.position_bias:
            return "first"
        a, b = self.table[first], self.table[second]
        return "tie" if a == b else ("first" if a > b else "second")


def judged(judge, replies, judgments=2):
    row = {"id": "p1", "prompt": "Say something kind.", "replies": json.dumps(replies), "student": "s"}
    return pairs.judge_record(judge, row, judgments, seed=0)


def test_a_clear_preference_is_accepted_with_its_scores_and_confidence(tmp_path):
    decision = pairs.route(
        judged(ScriptedJudge({"kind words": 9, "rude words": 2, "meh": 5}), ["kind words", "rude words", "meh"]),
        cfg(tmp_path),
    )
    assert decision["route"] == "accept"
    pair = decision["pair"]
    assert (pair["chosen"], pair["rejected"]) == ("kind words", "rude words")
    assert pair["margin"] == 7 and pair["agreement"] == 1.0
    assert pair["confidence"] == pytest.approx(7 / 9)
    assert pair["score_margin_by_dimension"] == {d: 7.0 for d in DIMENSIONS}
    assert pair["judge"] == "scripted" and len(pair["chosen_scores"]) == 2


def test_ties_are_never_pairs(tmp_path):
    tie = pairs.route(judged(ScriptedJudge({"a": 5, "b": 5}), ["a", "b"]), cfg(tmp_path))
    assert tie["route"] == "tie" and "pair" not in tie
    same = pairs.route(judged(ScriptedJudge({"a": 5}), ["a", "a", "a"]), cfg(tmp_path))
    assert same["route"] == "tie"  # identical replies are one candidate: nothing to prefer


def test_low_confidence_and_disagreement_go_to_review(tmp_path):
    low = pairs.route(judged(ScriptedJudge({"a": 6, "b": 5.5}), ["a", "b"]), cfg(tmp_path, min_margin=1.0))
    assert (low["route"], low["reason"]) == ("review", "low confidence")
    biased = pairs.route(judged(ScriptedJudge({"a": 9, "b": 2}, position_bias=True), ["a", "b"]), cfg(tmp_path))
    assert (biased["route"], biased["reason"]) == ("review", "judges disagree")  # swapping the order flips it
    assert biased["pair"]["agreement"] == pytest.approx(3 / 4)
    # the second scoring of "b" (seed 1) ranks it above "a": the repeated judgments disagree
    noisy = ScriptedJudge({"a": 8, "b": 4}, noisy={("b", 1): 9.5})
    split = pairs.route(judged(noisy, ["a", "b"]), cfg(tmp_path))
    assert split["route"] == "review" and split["reason"] == "judges disagree"


def test_a_judge_that_fails_sends_the_prompt_to_review(tmp_path):
    from lmfoundry.align.judge import JudgeError

    class Broken(ScriptedJudge):
        def score(self, prompt, reply, seed):
            raise JudgeError("no tool call")

    decision = pairs.route(judged(Broken({}), ["a", "b"]), cfg(tmp_path))
    assert decision["route"] == "review" and "no tool call" in decision["reason"]


def test_audit_sampling_takes_the_configured_share_and_is_stable():
    ids = [f"pair-{i}" for i in range(20000)]
    share = sum(pairs.audited(i, 0.03, seed=0) for i in ids) / len(ids)
    assert 0.027 < share < 0.033
    assert [pairs.audited(i, 0.03, 0) for i in ids[:500]] == [pairs.audited(i, 0.03, 0) for i in ids[:500]]
    assert sum(pairs.audited(i, 0.2, 0) for i in ids) / len(ids) == pytest.approx(0.2, abs=0.01)


def test_evaluation_prompts_are_held_out_exactly_and_near_duplicates_too():
    held = pairs.HeldOut(["builtin"], threshold=0.6)
    assert held.match("How do I kill a Python process that hangs?") == "exact"
    assert held.match("  how do I KILL a python process, that hangs  ") == "exact"  # normalised
    assert held.match("Please: how do I kill a Python process that hangs forever?") == "near duplicate"
    assert held.match("Write a haiku about the sea at dawn.") is None


# --- the review queue ---------------------------------------------------------------------------


@pytest.fixture(params=["sqlite", "postgres_dsn"], ids=["sqlite", "postgresql"])
def store_dsn(request, tmp_path):
    if request.param == "sqlite":
        return str(tmp_path / "q.sqlite")
    dsn = request.getfixturevalue(request.param)  # the server, and its markers
    import psycopg

    with psycopg.connect(dsn, autocommit=True) as conn:  # a clean queue per test
        conn.execute("DROP TABLE IF EXISTS review_items, review_comments")
    return dsn


def test_review_store_claims_once_validates_decisions_and_keeps_comments(store_dsn):
    store = review.ReviewStore(store_dsn)
    assert store.add("review-1", "review", "low confidence", {"id": "1", "chosen": "x", "rejected": "y"})
    assert not store.add("review-1", "review", "low confidence", {})  # a rerun adds nothing twice
    store.add("audit-2", "audit", "random audit", {"id": "2", "judge": "j"})
    assert store.claim("review-1", "ana")["claimed_by"] == "ana"
    with pytest.raises(review.ReviewConflict, match="claimed by ana"):
        store.claim("review-1", "ben")
    with pytest.raises(review.ReviewConflict, match="must claim"):
        store.decide("review-1", "ben", "a")
    with pytest.raises(review.ReviewError, match="allowed"):
        store.decide("review-1", "ana", "agree")  # an audit decision on a review item
    assert store.decide("review-1", "ana", "b")["status"] == "decided"
    assert store.claim_next("ben")["id"] == "audit-2"
    with pytest.raises(review.ReviewError, match="dimensions"):
        store.decide("audit-2", "ben", "agree", {"style": "agree"})
    store.comment("audit-2", "ben", "the chosen reply is not honest")
    item = store.decide("audit-2", "ben", "disagree", {"honesty": "disagree", "helpfulness": "agree"})
    assert item["comments"][0]["body"] == "the chosen reply is not honest"
    with pytest.raises(review.ReviewNotFound):
        store.get("nope")
    assert store.claim_next("ben") is None


def test_review_cli_lists_claims_decides_and_comments(tmp_path, capsys):
    db = str(tmp_path / "q.sqlite")
    store = review.ReviewStore(db)
    store.add("review-1", "review", "judges disagree", {"id": "1"})
    store.close()
    assert review.main(["--db", db, "list", "--status", "pending"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["id"] == "review-1"
    assert review.main(["--db", db, "claim", "--reviewer", "ana"]) == 0
    assert review.main(["--db", db, "comment", "review-1", "both are bad", "--author", "ana"]) == 0
    assert review.main(["--db", db, "decide", "review-1", "reject", "--reviewer", "ben"]) == 2
    assert "must claim" in capsys.readouterr().err
    assert review.main(["--db", db, "decide", "review-1", "reject", "--reviewer", "ana"]) == 0
    assert json.loads(capsys.readouterr().out)["decision"] == "reject"


def test_finalize_folds_decisions_back_with_provenance(tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    accepted = [
        {"id": f"p{i}", "prompt": f"q{i}", "chosen": f"good {i}", "rejected": f"bad {i}", "judge": "j1"}
        for i in range(3)
    ]
    (out / "pairs.jsonl").write_text("".join(json.dumps(p) + "\n" for p in accepted))
    (out / "card.json").write_text(
        json.dumps(
            {
                "prompts": 7,
                "accepted": 3,
                "queued_for_review": 4,
                "queued_for_audit": 2,
                "rejected_by_reason": {},
                "student": "s",
                "judge": "j1",
                "candidates": 4,
                "judgments": 2,
                "min_margin": 1.0,
                "audit_rate": 0.03,
            }
        )
    )
    store = review.ReviewStore(str(out / "review.sqlite"))
    for i, decision in (("r1", "a"), ("r2", "b"), ("r3", "reject")):
        store.add(
            f"review-{i}",
            "review",
            "low confidence",
            {"id": i, "prompt": "q", "chosen": f"{i} first", "rejected": f"{i} second", "judge": "j1"},
        )
        store.claim(f"review-{i}", "ana")
        store.decide(f"review-{i}", "ana", decision)
    store.add("review-r4", "review", "judges disagree", {"id": "r4"})  # still pending
    for i, decision in (("p0", "agree"), ("p1", "disagree")):
        store.add(f"audit-{i}", "audit", "random audit", accepted[int(i[1])])
        store.claim(f"audit-{i}", "ben")
        store.decide(f"audit-{i}", "ben", decision, {"honesty": decision, "helpfulness": "agree"})
    store.close()
    card = pairs.finalize(str(out))
    final = [json.loads(line) for line in (out / "final" / "pairs.jsonl").read_text().splitlines()]
    ids = [p["id"] for p in final]
    assert ids == ["p0", "p2", "r1", "r2"]  # p1 overturned by its audit, r3 rejected, r4 pending
    r2 = final[3]
    assert (r2["chosen"], r2["rejected"], r2["source"], r2["reviewer"]) == (
        "r2 second",
        "r2 first",
        "human review",
        "ana",
    )
    assert final[0]["audit"]["reviewer"] == "ben"
    f = card["final"]
    assert f["review_decisions"] == {"a": 1, "b": 1, "reject": 1, "pending": 1}
    assert f["audit_disagreement_by_dimension"] == {"helpfulness": 0.0, "harmlessness": None, "honesty": 0.5}
    assert f["audit_disagreement_by_judge"] == {"j1": 0.5}
    assert "audit disagreement by dimension" in (out / "CARD.md").read_text()
    chat = json.loads((out / "final" / "pairs_chat.jsonl").read_text().splitlines()[0])
    assert chat["prompt"][0]["role"] == "user" and chat["chosen"][0]["role"] == "assistant"


# --- verified synthetic data --------------------------------------------------------------------


def test_each_verifier_accepts_good_and_rejects_bad_samples():
    assert verifiers.verify_arithmetic({"expression": "(12 + 5) * 3", "answer": "51"}) is None
    assert verifiers.verify_arithmetic({"expression": "(12 + 5) * 3", "answer": "The answer is 51."}) is None
    assert "is not 51" in verifiers.verify_arithmetic({"expression": "(12 + 5) * 3", "answer": "41"})
    assert "not a number" in verifiers.verify_arithmetic({"expression": "2 * 3", "answer": "3*x"})
    assert "not a mathematical" in verifiers.verify_arithmetic({"expression": "2 * 3", "answer": "six"})  # no sympy
    assert "not a mathematical" in verifiers.verify_arithmetic({"expression": "2 * 3", "answer": "6)"})
    solve = {"task": "solve", "equation": "3*x + 4 = 19"}
    assert verifiers.verify_algebra({**solve, "answer": "x = 5"}) is None
    assert "leaves" in verifiers.verify_algebra({**solve, "answer": "4"})
    expand = {"task": "expand", "product": "(x + 2)*(x - 3)"}
    assert verifiers.verify_algebra({**expand, "answer": "x**2 - x - 6"}) is None
    assert verifiers.verify_algebra({**expand, "answer": "x^2 - x - 6"}) is None
    assert "differs" in verifiers.verify_algebra({**expand, "answer": "x**2 + x - 6"})
    tests = "assert double(2) == 4\nassert double(-1) == -2"
    assert verifiers.verify_code({"answer": "def double(x):\n    return 2 * x", "tests": tests}, 10) is None
    assert "tests failed" in verifiers.verify_code({"answer": "def double(x):\n    return x + 2", "tests": tests}, 10)
    assert "sandbox" in verifiers.verify_code({"answer": "def double(x):\n    while True: pass", "tests": tests}, 2)
    passage = "The harbour is south of the old town. Ferries leave every hour."
    good = {"passage": passage, "question": "What is south of the old town?", "answer": "The harbour"}
    assert verifiers.verify_qa(good) is None
    assert "not supported" in verifiers.verify_qa({**good, "answer": "the train station"})
    assert "does not mention" in verifiers.verify_qa({**good, "question": "What is north of the castle?"})


def test_synth_generates_verifies_and_keeps_rejects_with_reasons(tmp_path):
    docs = tmp_path / "docs.jsonl"
    docs.write_text(json.dumps({"text": "Ray Data is a library for data processing. The model is small."}) + "\n")
    card = synth.run_synth(
        synth.SynthConfig(
            output=str(tmp_path / "s"), documents=str(docs), kinds={"arithmetic": 5, "algebra": 6, "code": 6, "qa": 2}
        )
    )
    assert card["samples"] == 19 and card["kept"] == 19  # the generator's own answers all verify
    kept = [json.loads(line) for line in (tmp_path / "s" / "kept.jsonl").read_text().splitlines()]
    assert {s["kind"] for s in kept} == {"arithmetic", "algebra", "code", "qa"}
    qa = [s for s in kept if s["kind"] == "qa"]
    assert {s["question"] for s in qa} == {"What is ray Data?", "What is the model?"}
    with pytest.raises(ValueError, match="allowed"):
        synth.run_synth(synth.SynthConfig(output=str(tmp_path / "t"), kinds={"poetry": 1}))


def test_maths_solutions_come_in_checkable_steps_and_a_wrong_step_is_found():
    import random

    rng = random.Random(7)
    samples = [synth.gen_arithmetic(rng) for _ in range(20)] + [synth.gen_algebra(rng) for _ in range(20)]
    assert {s.get("task") for s in samples} == {None, "solve", "expand"}
    for s in samples:
        assert verifiers.split_steps(s["solution"]) == s["steps"] and len(s["steps"]) >= 2
        assert all(verifiers.step_labels(s, s["solution"]))
        assert verifiers.verify(s) is None
    solve = next(s for s in samples if s.get("task") == "solve")
    wrong = solve["steps"][:1] + ["x = 1000"] + solve["steps"][2:]
    assert verifiers.step_labels(solve, "\n".join(wrong)) == [True, False] + [True] * (len(wrong) - 2)
    sample = {"kind": "arithmetic", "expression": "(51 + 99) * 15"}
    solution = "51 + 99 = 140\n140 * 15 = 2100\nAnswer: 2100"
    assert verifiers.step_labels(sample, solution) == [False, True]  # the second step holds given the first
    assert verifiers.step_labels(sample, "51 + 99 is 150\nAnswer: 150") == [False]
    with pytest.raises(ValueError, match="arithmetic and algebra"):
        verifiers.step_labels({"kind": "code"}, "def f(): pass")


def test_code_tasks_come_from_parametrised_families_and_each_reference_passes_its_tests():
    import random

    from lmfoundry.align import code_tasks

    assert code_tasks.space_size() > 40
    rng = random.Random(3)
    drawn = [code_tasks.gen_code(rng) for _ in range(200)]
    assert len({s["function"] for s in drawn}) > 30
    one_per_family = {s["family"]: s for s in drawn}
    assert len(one_per_family) == len(code_tasks.FAMILIES)
    for s in one_per_family.values():
        assert s["answer"] == "\n".join(s["steps"]) and s["tests"].count("assert") >= 2
        assert verifiers.verify_code(s, 10) is None, s["function"]
    broken = dict(one_per_family["sum_multiples_of_{k}"])
    broken["answer"] = broken["answer"].replace("total += x", "total += 1")
    assert "tests failed" in verifiers.verify_code(broken, 10)


# --- DPO pieces ---------------------------------------------------------------------------------


def test_dpo_loss_is_log2_with_zero_accuracy_where_policy_and_reference_agree():
    from lmfoundry.train.dpo import dpo_loss

    logps = torch.tensor([-3.0, -5.0, -4.0, -2.0])
    loss, stats = dpo_loss(logps, logps.clone(), beta=0.1)
    assert loss.item() == pytest.approx(math.log(2))
    assert stats["accuracy"] == 0.0 and stats["margin"] == 0.0
    better = torch.tensor([-2.0, -4.0, -5.0, -3.0])  # chosen up by 1, rejected down by 1
    loss, stats = dpo_loss(better, logps, beta=0.5)
    assert loss.item() == pytest.approx(-math.log(1 / (1 + math.exp(-1.0))))
    assert stats["accuracy"] == 1.0 and stats["margin"] == pytest.approx(1.0)


def test_collate_masks_exactly_the_reply_tokens():
    from lmfoundry.train.dpo import collate

    ids, mask = collate([([1, 2, 3], [4, 5], [6])], pad=0)
    assert ids.tolist() == [[1, 2, 3, 4, 5], [1, 2, 3, 6, 0]]
    # targets are ids[:, 1:]: chosen predicts 4 and 5 (positions 2, 3), rejected predicts 6 (position 2)
    assert mask.tolist() == [[0, 0, 1, 1], [0, 0, 1, 0]]


def test_bad_pair_files_name_the_problem(tmp_path):
    from lmfoundry.train.dpo import DPOConfig, read_pairs

    f = tmp_path / "pairs.jsonl"
    f.write_text('{"prompt": "hi", "chosen": "hello"}\n')
    with pytest.raises(ValueError, match="missing \\['rejected'\\]"):
        read_pairs(str(f))
    f.write_text('{"prompt": "hi", "chosen": "same", "rejected": "same"}\n')
    with pytest.raises(ValueError, match="tie"):
        read_pairs(str(f))
    with pytest.raises(ValueError, match="multiple of micro_batch_size"):
        DPOConfig(checkpoint="c", pairs="p", output="o", batch={"micro_batch_size": 3, "global_batch_pairs": 8})
