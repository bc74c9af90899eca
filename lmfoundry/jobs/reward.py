"""Train a reward model (Ray Train + DeepSpeed): an outcome model from preference pairs or from
scored replies, or a process model from step labels, which it can make first (Math-Shepherd
style: completions from each step of the policy's own solutions, checked by the verifier).

    lmfoundry reward configs/reward_process.yaml --input POLICY_CHECKPOINT --output work/prm \\
        --set step_labels.problems=work/synth
"""

import sys

from pydantic import Field, model_validator

from lmfoundry.clients.checkpoint import CheckpointModel
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.cli import run_stage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.reasoning import step_labels
from lmfoundry.train.reward import RewardConfig, run_reward

logger = get_logger(__name__)

STEP_LABELS = "step_labels.jsonl"


class StepLabelConfig(StageConfig):
    problems: str = Field(..., description="a synth output (kept.jsonl) or a JSONL of arithmetic/algebra samples")
    limit: int = Field(200, ge=1, le=100_000, description="at most this many problems")
    solutions: int = Field(4, ge=1, le=64, description="sampled solutions per problem")
    completions: int = Field(4, ge=1, le=64, description="completions from each step of each solution")
    max_tokens: int = Field(64, ge=1, le=4096)
    temperature: float = Field(0.8, gt=0, le=2)
    threshold: float = Field(0.25, gt=0, le=1, description="share of completions reaching the answer for a good step")


class RewardJobConfig(RewardConfig):
    data: str | None = Field(
        None, description="JSONL of pairs, of {prompt, reply, label} or of {prompt, steps, labels}"
    )
    step_labels: StepLabelConfig | None = Field(
        None, description="make step labels from the starting checkpoint's own solutions, then train on them"
    )

    @model_validator(mode="after")
    def _one_source(self):
        if (self.data is None) == (self.step_labels is None):
            raise ValueError("give exactly one of data (a labelled JSONL) and step_labels (labels made here)")
        return self


def make_step_labels(cfg: RewardJobConfig) -> str:
    """Writes OUTPUT/step_labels.jsonl (and its summary) from the policy's samples; returns its URI."""
    from lmfoundry.eval.reasoning import read_problems

    out = storage.normalize(cfg.output)
    uri = storage.join(out, STEP_LABELS)
    if storage.exists(uri):
        logger.info("reward: step labels already made (%s)", uri)
        return uri
    s = cfg.step_labels
    problems = read_problems(s.problems, s.limit)
    with checkpoint.opened(checkpoint.resolve(cfg.checkpoint), model_only=True) as (local, _):
        policy = CheckpointModel(local)
        rows = []
        for i, problem in enumerate(problems):
            rows += step_labels.label_problem(
                policy, problem, s.solutions, s.completions, s.max_tokens, s.temperature, s.threshold, cfg.seed + i
            )
    if not rows:
        raise ValueError(f"the policy wrote no solution with a step for the {len(problems)} problems in {s.problems}")
    storage.write_jsonl_atomic(uri, rows)
    summary = {"problems": len(problems), "solutions": len(rows), **step_labels.agreement(rows)}
    storage.write_json_atomic(storage.join(out, "step_labels_summary.json"), summary)
    logger.info("reward: step labels for %d solutions: %s", len(rows), summary)
    return uri


def run_reward_job(cfg: RewardJobConfig) -> dict:
    if cfg.overwrite:  # cleared now, so that the labels made next survive the training run
        storage.remove_dir(storage.normalize(cfg.output))
    data = cfg.data if cfg.step_labels is None else make_step_labels(cfg)
    settings = {**cfg.model_dump(exclude={"step_labels"}), "data": data, "overwrite": False}
    reward = RewardConfig.model_validate(settings)
    manifest = run_reward(reward)
    if cfg.step_labels is not None:
        summary = storage.read_json(storage.join(storage.normalize(cfg.output), "step_labels_summary.json"))
        manifest = {**manifest, "step_labels": summary}
    return manifest


def main(argv=None) -> int:
    return run_stage("reward", RewardJobConfig, run_reward_job, argv, input_field="checkpoint", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
