"""Alignment on real Ray: the preference-pair pipeline (Ray Data, the session's checkpoint as
student and as teacher judge), and DPO on 2 CPU workers with DeepSpeed, a worker killed on the
way, and the evaluation gate before and after."""

import json
import math

import pytest

pytestmark = pytest.mark.timeout(900)

TOPICS = [
    "apples",
    "rivers",
    "gardens",
    "windows",
    "markets",
    "pencils",
    "castles",
    "forests",
    "bridges",
    "candles",
    "rockets",
    "planets",
    "ladders",
    "mirrors",
    "pockets",
    "winters",
]


def test_the_pair_pipeline_judges_routes_and_never_emits_a_tie(pretrained, tmp_path):
    from lmfoundry.align.pairs import PairsConfig, run_pairs
    from lmfoundry.align.review import ReviewStore

    prompts = tmp_path / "prompts.jsonl"
    rows = [{"id": f"t{i}", "prompt": f"Tell me about {t}."} for i, t in enumerate(TOPICS[:8])]
    rows.append({"id": "held", "prompt": "How do I kill a Python process that hangs?"})  # an evaluation prompt
    prompts.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = PairsConfig(
        prompts=str(prompts),
        output=str(tmp_path / "pairs"),
        student={"checkpoint": pretrained[0]},
        judge={"checkpoint": pretrained[0]},
        candidates=3,
        max_tokens=12,
        min_margin=0.05,
        audit_rate=0.5,
    )
    card = run_pairs(cfg)
    out = tmp_path / "pairs"
    accepted = [json.loads(line) for line in (out / "pairs.jsonl").read_text().splitlines()]
    rejected = [json.loads(line) for line in (out / "rejected.jsonl").read_text().splitlines()]
    store = ReviewStore(str(out / "review.sqlite"))
    queued = store.list(kind="review")
    audits = store.list(kind="audit")
    assert card["prompts"] == 9
    assert card["rejected_by_reason"].get("held out: exact of an evaluation prompt") == 1
    assert len(accepted) + len(queued) + len(rejected) == 9  # every prompt is accounted for
    assert all(
        p["chosen"] != p["rejected"] for p in accepted + [q["payload"] for q in queued if "chosen" in q["payload"]]
    )
    assert {a["id"] for a in audits} <= {f"audit-{p['id']}" for p in accepted}
    for p in accepted:
        assert p["agreement"] == 1.0 and p["margin"] >= 0.05 and p["judge"].startswith("checkpoint")
    chat = [json.loads(line) for line in (out / "pairs_chat.jsonl").read_text().splitlines()]
    assert len(chat) == len(accepted)
    assert run_pairs(cfg) == card  # a committed run is not redone


def write_pairs(path):
    rows = [
        {
            "prompt": f"Tell me about {t}.",
            "chosen": f"{t.capitalize()} are useful and good.",
            "rejected": f"I hate {t}. Kill all the {t} now!",
        }
        for t in TOPICS
    ]
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)


def test_dpo_raises_preference_accuracy_survives_a_killed_worker_and_is_gated(
    deepspeed_workers, pretrained, packed, tmp_path
):
    from lmfoundry.eval.suite import EvalSuites
    from lmfoundry.jobs.align import AlignJobConfig, run_align

    cfg = AlignJobConfig(
        checkpoint=pretrained[0],
        pairs=write_pairs(tmp_path / "pairs.jsonl"),
        output=str(tmp_path / "dpo"),
        beta=0.1,
        optimizer={"lr": 2e-3},
        schedule={"warmup_steps": 2, "max_steps": 16},
        batch={"micro_batch_size": 2, "global_batch_pairs": 8},
        # ZeRO-3: the policy and the reference each built partitioned (the reference's matrices
        # gathered for each forward and released after)
        parallelism={"num_workers": 2, "cpus_per_worker": 0.5, "zero_stage": 3},
        checkpointing={"every": 4},
        drills=[{"at_step": 6, "rank": 1}],
        health={"max_failures": 2},
        logging={"every": 1},
        eval=EvalSuites(
            data=packed[0],
            max_sequences=32,
            tasks=["builtin"],
            task_limit=10,
            gate={
                "track": ["task.*"],
                "tolerances": {
                    "task.lmfoundry_arithmetic_mc.acc": 1.0,
                    "task.lmfoundry_arithmetic_mc.acc_norm": 1.0,
                    "task.lmfoundry_common_sense_mc.acc": 1.0,
                    "task.lmfoundry_common_sense_mc.acc_norm": 1.0,
                    "task.lmfoundry_repeat_word.exact_match": 1.0,
                },
            },
        ),
    )
    result = run_align(cfg)
    accuracy = result["preference_accuracy"]
    assert accuracy["before"] == 0.0 and accuracy["after"] >= 0.8
    assert result["final_loss"] < result["first_loss"]
    run = tmp_path / "dpo"
    assert list((run / "_drills").iterdir())  # the worker was killed, and the run resumed
    history = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert [h["step"] for h in history] == list(range(1, 17))  # no step lost or repeated across the restart
    # before the first update the policy is the reference, weight for weight: loss log 2, margin 0
    assert history[0]["loss"] == pytest.approx(math.log(2), abs=1e-6) and abs(history[0]["margin"]) < 1e-6
    assert result["gate"]["passed"] and (run / "eval_before.json").exists() and (run / "eval_after.json").exists()
    from lmfoundry.platform.checkpoint import resolve

    final = resolve(str(run))
    assert (tmp_path / "dpo" / "checkpoints").exists() and final.endswith("step-00000016")
