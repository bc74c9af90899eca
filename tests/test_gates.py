"""Gates that act: a checkpoint's gate verdict in its manifest, refused by serve, export and the
traffic tool unless forced (and the override logged); training that stops, or rolls back to the
last checkpoint that passed, after failed gates."""

import json
import logging

import pytest
import yaml
from test_export import make_checkpoint

from lmfoundry.eval import watch
from lmfoundry.platform import checkpoint

pytestmark = pytest.mark.timeout(300)

FAILED = {"passed": False, "baseline": "old/eval.json", "regressions": [{"metric": "harmless.refusal_rate"}]}


@pytest.fixture
def gated(tmp_path):
    """Two real checkpoints: one that passed its gate, one that failed it."""
    good, bad = tmp_path / "good", tmp_path / "bad"
    make_checkpoint(good)
    make_checkpoint(bad)
    checkpoint.mark_gate(str(good), {"passed": True, "regressions": [], "missing": []})
    checkpoint.mark_gate(str(bad), FAILED)
    return str(good), str(bad)


def test_the_verdict_is_in_the_manifest_and_a_failed_checkpoint_is_refused_unless_forced(gated, caplog):
    good, bad = gated
    manifest = checkpoint.verify(bad)  # the files still match their checksums
    assert manifest["gate"]["passed"] is False and manifest["gate"]["regressions"] == ["harmless.refusal_rate"]
    assert checkpoint.check_gate(good, False, "serve")["passed"] is True
    with pytest.raises(checkpoint.GateFailed, match="harmless.refusal_rate.*--force-gate-failed"):
        checkpoint.check_gate(bad, False, "serve")
    with caplog.at_level(logging.WARNING, logger="lmfoundry"):
        checkpoint.check_gate(bad, True, "serve")
    assert "FAILED its evaluation gate" in caplog.text and "forced" in caplog.text
    # a verdict edited into something else is not a pass
    path = f"{bad}/{checkpoint.CHECKPOINT_MANIFEST}"
    for edited in ({"passed": "yes"}, "passed", []):
        data = json.loads(open(path).read())
        data["gate"] = edited
        open(path, "w").write(json.dumps(data))
        with pytest.raises(checkpoint.GateFailed):
            checkpoint.check_gate(bad, False, "export")


def test_export_refuses_a_gate_failed_checkpoint_and_forced_says_so(gated, tmp_path, capsys, caplog):
    from lmfoundry.jobs.export import main as export

    _, bad = gated
    assert export([bad, str(tmp_path / "hf")]) == 2
    assert "FAILED its evaluation gate" in capsys.readouterr().err and not (tmp_path / "hf").exists()
    with caplog.at_level(logging.WARNING, logger="lmfoundry"):
        assert export([bad, str(tmp_path / "hf"), "--force-gate-failed"]) == 0
    assert "forced with --force-gate-failed" in caplog.text and (tmp_path / "hf" / "config.json").exists()


def test_serve_and_traffic_refuse_a_gate_failed_version(gated, tmp_path):
    from lmfoundry.serving.app import ServeConfig, build_app
    from lmfoundry.serving.traffic import main as traffic

    good, bad = gated
    versions = [{"name": "v1", "checkpoint": good, "weight": 1}, {"name": "v2", "checkpoint": bad, "weight": 0}]
    with pytest.raises(checkpoint.GateFailed, match="version v2"):
        build_app(ServeConfig(versions=versions), [])
    assert build_app(ServeConfig(versions=versions, force_gate_failed=True), []) is not None
    config, split = tmp_path / "serve.yaml", tmp_path / "split.json"
    config.write_text(yaml.safe_dump({"versions": versions}))
    assert traffic(["set", "v1=100", "--file", str(split), "--config", str(config)]) == 0
    assert traffic(["set", "v1=50", "v2=50", "--file", str(split), "--config", str(config)]) == 2
    assert json.loads(split.read_text())["weights"] == {"v1": 100.0, "v2": 0.0}  # unchanged
    assert traffic(["set", "v1=50", "v3=50", "--file", str(split), "--config", str(config)]) == 2  # not served
    forced = ["set", "v1=50", "v2=50", "--file", str(split), "--config", str(config), "--force-gate-failed"]
    assert traffic(forced) == 0
    assert traffic(["set", "v1=100", "--file", str(split), "--config", str(config)]) == 0
    # rolling back to a split that sent traffic to the failed version is refused the same way
    assert traffic(["rollback", "--file", str(split), "--config", str(config)]) == 2


def record(step, passed):
    return {"step": step, "gate_passed": passed} if passed is not None else {"step": step, "error": "gone"}


def test_failed_gates_in_a_row_ask_to_stop_or_roll_back():
    policy = watch.FailedGatesPolicy(after=2, action="rollback", max_rollbacks=1)
    records = [record(5, True), record(10, False), record(15, None), record(20, False)]
    assert watch.failed_in_a_row(records) == ([10, 20], 5)  # an error neither breaks nor extends the run
    assert watch.decide(records, policy, 0) == {"action": "rollback", "to_step": 5, "failed_steps": [10, 20]}
    assert watch.decide(records, policy, 1)["action"] == "stop"  # the rollback did not mend it
    assert watch.decide(records[:2], policy, 0) is None
    assert watch.decide([record(5, False), record(10, False)], policy, 0)["action"] == "stop"  # nothing passed
    assert watch.decide([*records, record(25, True)], policy, 0) is None
    with pytest.raises(ValueError):
        watch.FailedGatesPolicy(after=0)


def test_the_evaluator_asks_training_to_act_and_drops_what_a_rollback_overtook(tmp_path):
    import time

    from lmfoundry.platform import storage

    run = tmp_path / "run"
    (run / "evals").mkdir(parents=True)
    for step, passed in ((5, True), (10, False), (15, False)):
        (run / "evals" / f"step-{step:08d}.json").write_text(json.dumps(record(step, passed)))
    policy = watch.FailedGatesPolicy(after=2, action="rollback", max_rollbacks=1)
    evaluator = watch.CheckpointEvaluator(str(run), suites=None, policy=policy)
    evaluator._act()
    action = checkpoint.read_gate_action(str(run))
    assert action["action"] == "rollback" and action["to_step"] == 5 and action["failed_steps"] == [10, 15]
    evaluator._act()  # training has not read it yet: asked once
    assert len(evaluator.actions) == 1
    # training rolled back: an evaluation that began before, of a step after 5, is not recorded
    done = {**action, "done": True, "done_at": time.time()}
    storage.write_json_atomic(str(run / checkpoint.GATE_ACTION), done)
    assert checkpoint.read_gate_action(str(run)) is None
    assert evaluator._rolled_back(10, submitted=time.time() - 60)
    assert not evaluator._rolled_back(10, submitted=time.time() + 60) and not evaluator._rolled_back(5, 0.0)
    assert checkpoint.carried_out_stop(str(run)) is None  # a rollback carried out does not end the run
    # failing again after the rollback: the next action is a stop
    evaluator._act()
    stop = checkpoint.read_gate_action(str(run))
    assert stop["action"] == "stop" and checkpoint.carried_out_stop(str(run)) is None  # asked, not yet done
    # once training carried it out, a worker group that takes over later trains no further
    storage.write_json_atomic(str(run / checkpoint.GATE_ACTION), {**stop, "done": True})
    assert checkpoint.read_gate_action(str(run)) is None and checkpoint.carried_out_stop(str(run))["action"] == "stop"


@pytest.mark.timeout(900)  # three short runs, after the session's corpus fixtures
def test_continued_training_rolls_back_to_the_checkpoint_that_passed_then_stops(
    deepspeed_workers, packed, pretrained, tmp_path
):
    """Continued pretraining from the session's reference run, whose gates then act: it starts
    where the reference ended (not from a fresh initialisation), rolls back to the checkpoint that
    passed, and stops when asked."""
    from conftest import tiny_pretrain_config

    from lmfoundry.platform import storage
    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    run = tmp_path / "run"
    settings = tiny_pretrain_config(
        packed[0],
        str(run),
        parallelism={"num_workers": 1},  # one worker: the gates act the same, and it starts faster
        schedule={"max_steps": 4, "warmup_steps": 1},
        checkpointing={"every": 2},
    )
    reference_dir, reference = pretrained
    cfg = PretrainConfig(**settings.model_dump(exclude={"model", "init_from"}), init_from=reference_dir)
    first = run_pretrain(cfg)
    assert first["init_from"] == checkpoint.resolve(reference_dir) and first["model"] == reference["model"]
    assert abs(first["first_loss"] - reference["final_loss"]) < 0.5 < reference["first_loss"] - first["first_loss"]
    (run / "_MANIFEST.json").unlink()  # as if the run were still going when its gates came in
    checkpoint.mark_gate(str(run / "checkpoints" / "step-00000002"), {"passed": True})
    checkpoint.mark_gate(str(run / "checkpoints" / "step-00000004"), FAILED)
    action = {"action": "rollback", "to_step": 2, "failed_steps": [4]}
    storage.write_json_atomic(str(run / checkpoint.GATE_ACTION), action)
    (run / "evals").mkdir()
    (run / "evals" / "step-00000004.json").write_text(json.dumps(record(4, False)))
    manifest = run_pretrain(cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"max_steps": 6})}))
    done = json.loads((run / checkpoint.GATE_ACTION).read_text())
    assert done["done"] and done["carried_out_at_step"] == 2
    assert not (run / "evals" / "step-00000004.json").exists()  # the failed checkpoint's record went with it
    state = json.loads((run / manifest["final_checkpoint"] / "train_state.json").read_text())
    assert state["step"] == 6 and state["rollbacks"] == 1
    retrained = json.loads((run / "checkpoints" / "step-00000004" / checkpoint.CHECKPOINT_MANIFEST).read_text())
    assert "gate" not in retrained  # step 4 was trained again: a new checkpoint, not yet gated
    assert "stopped_by_gate" not in manifest
    # a stop: training ends at the next logged step and the run says why
    (run / "_MANIFEST.json").unlink()
    storage.write_json_atomic(
        str(run / checkpoint.GATE_ACTION), {"action": "stop", "to_step": None, "failed_steps": [6]}
    )
    stopped = run_pretrain(cfg.model_copy(update={"schedule": cfg.schedule.model_copy(update={"max_steps": 40})}))
    assert stopped["stopped_by_gate"]["carried_out_at_step"] == 7 and stopped["steps"] < 40
