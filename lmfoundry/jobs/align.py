"""Fine-tune a checkpoint with DPO on preference pairs (Ray Train + DeepSpeed), with the evaluation
gate run on the starting checkpoint and on the result: exit 1 when the tuned model regressed, and
the result's manifest marked so (serve, export and traffic then refuse it unless forced). With
`on_failed_gates`, every checkpoint of the run is also gated against the starting checkpoint as it
is committed, and training stops, or rolls back to the last one that passed, after N failures in a
row (eval/watch.py), as in pretraining.

    lmfoundry align configs/align_dpo.yaml --input work/pretrain --output work/dpo --set pairs=work/pairs/pairs.jsonl
"""

import sys

from pydantic import Field

from lmfoundry.clients.checkpoint import CheckpointModel
from lmfoundry.eval.suite import EvalSuites, apply_gate, evaluate
from lmfoundry.eval.watch import CheckpointEvaluator, FailedGatesPolicy
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.cli import run_stage
from lmfoundry.platform.config import StageFailed
from lmfoundry.train.dpo import DPOConfig, run_dpo


class AlignJobConfig(DPOConfig):
    eval: EvalSuites | None = Field(
        None, description="suites run before and after; the result is gated against the starting checkpoint's report"
    )
    eval_cpus: float = Field(1.0, gt=0, description="CPUs of the Ray task that evaluates a checkpoint")
    on_failed_gates: FailedGatesPolicy | None = Field(
        None, description="gate every checkpoint as it is committed; stop or roll back after N failures in a row"
    )


def _evaluate(uri: str, suites: EvalSuites) -> dict:
    with checkpoint.opened(uri) as (local, _):
        return evaluate(CheckpointModel(local, suites.batch_size), suites, local)


def run_align(cfg: AlignJobConfig) -> dict:
    dpo = DPOConfig.model_validate(cfg.model_dump(exclude={"eval", "eval_cpus", "on_failed_gates"}))
    if cfg.eval is None:
        if cfg.on_failed_gates is not None:
            raise ValueError("on_failed_gates acts on the evaluation gate: set eval too")
        return run_dpo(dpo)
    out = storage.normalize(cfg.output)
    before = _evaluate(checkpoint.resolve(cfg.checkpoint), cfg.eval)
    if cfg.on_failed_gates is None:
        manifest = run_dpo(dpo)
    else:
        if dpo.overwrite:  # cleared now, so that the baseline written next survives run_dpo
            storage.remove_dir(out)
            dpo = dpo.model_copy(update={"overwrite": False})
        storage.write_json_atomic(storage.join(out, "eval_before.json"), before)
        gated = cfg.eval.model_copy(
            update={"gate": cfg.eval.gate.model_copy(update={"baseline": storage.join(out, "eval_before.json")})}
        )
        with CheckpointEvaluator(out, gated, cfg.eval_cpus, policy=cfg.on_failed_gates) as evaluator:
            manifest = run_dpo(dpo)
            records = evaluator.finish()
        action = storage.join(out, checkpoint.GATE_ACTION)
        manifest = {
            **manifest,
            "evaluations": [{k: r[k] for k in ("step", "gate_passed", "error") if k in r} for r in records],
            **({"gate_action": storage.read_json(action)} if storage.exists(action) else {}),
        }
    after = _evaluate(checkpoint.resolve(out), cfg.eval)
    storage.write_json_atomic(storage.join(out, "eval_before.json"), before)
    storage.write_json_atomic(storage.join(out, "eval_after.json"), after)
    gate_cfg = cfg.eval.gate.model_copy(update={"baseline": storage.join(out, "eval_before.json")})
    gate = apply_gate(after, gate_cfg)
    storage.write_json_atomic(storage.join(out, "gate.json"), gate)
    checkpoint.mark_gate(checkpoint.resolve(out), gate)  # serve, export and traffic read the verdict there
    result = {**manifest, "gate": gate}
    if not gate["passed"]:
        worse = ", ".join(f"{r['metric']} {r['baseline']:.4g} -> {r['value']:.4g}" for r in gate["regressions"])
        raise StageFailed(f"the tuned model regressed against its starting checkpoint: {worse} (reports in {out})")
    return result


def main(argv=None) -> int:
    return run_stage("align", AlignJobConfig, run_align, argv, input_field="checkpoint", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
