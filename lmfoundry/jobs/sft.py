"""Supervised fine-tuning of a checkpoint on conversations (Ray Train + DeepSpeed); with an `eval`
section, every committed checkpoint is evaluated in the background (results in RUN/evals/ and
metrics.jsonl) and, with `on_failed_gates`, training stops or rolls back after N failed gates in a
row, as in pretraining.

    lmfoundry sft configs/sft_tiny_cpu.yaml --input work/pretrain --output work/sft --set data=work/chats.jsonl
"""

import sys

from pydantic import Field

from lmfoundry.eval.suite import EvalSuites
from lmfoundry.eval.watch import CheckpointEvaluator, FailedGatesPolicy
from lmfoundry.platform import storage
from lmfoundry.platform.cli import run_stage
from lmfoundry.train.metrics import MetricsFiles
from lmfoundry.train.sft import SFTConfig, run_sft


class SFTJobConfig(SFTConfig):
    eval: EvalSuites | None = Field(
        None,
        description="the fast suite run on each checkpoint as it is committed (the keys of configs/evaluate.yaml "
        "but the model's)",
    )
    eval_cpus: float = Field(1.0, gt=0, description="CPUs of the Ray task that evaluates a checkpoint")
    on_failed_gates: FailedGatesPolicy | None = Field(
        None, description="stop, or roll back to the last checkpoint that passed, after N failed gates in a row"
    )


def run_sft_job(cfg: SFTJobConfig) -> dict:
    train_cfg = SFTConfig.model_validate(cfg.model_dump(exclude={"eval", "eval_cpus", "on_failed_gates"}))
    if cfg.eval is None:
        if cfg.on_failed_gates is not None:
            raise ValueError("on_failed_gates acts on the evaluation gate: set eval (with eval.gate.baseline) too")
        return run_sft(train_cfg)
    if cfg.on_failed_gates is not None and not cfg.eval.gate.baseline:
        raise ValueError("on_failed_gates needs eval.gate.baseline: without a baseline no gate passes or fails")
    run_dir = storage.normalize(cfg.output)
    with CheckpointEvaluator(run_dir, cfg.eval, cfg.eval_cpus, policy=cfg.on_failed_gates) as evaluator:
        manifest = run_sft(train_cfg)
        records = evaluator.finish()
    # the last checkpoints' evaluations end after training did: merge them into metrics.jsonl now
    files = MetricsFiles(run_dir)
    files.write(storage.read_jsonl(storage.join(run_dir, "metrics.jsonl")))
    files.wait()
    return {
        **manifest,
        "evaluations": [{k: r.get(k) for k in ("step", "metrics", "gate_passed", "error") if k in r} for r in records],
    }


def main(argv=None) -> int:
    return run_stage("sft", SFTJobConfig, run_sft_job, argv, input_field="checkpoint", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
