"""Reinforcement learning from verifiable rewards (GRPO, train/grpo.py), judged on held-out
problems: the reasoning suite (greedy, verified) runs on the starting policy and on the result.
A run is called better only when its held-out verified accuracy rose; a reward that rose without
it is reported as what it may be, reward hacking, and the run fails its gate.

    lmfoundry rl configs/rl_grpo.yaml --input work/sft --output work/rl \\
        --set problems=work/synth --set held_out=work/synth_heldout
"""

import sys

from pydantic import Field

from lmfoundry.clients.checkpoint import CheckpointModel
from lmfoundry.eval.reasoning import ReasoningConfig, run_reasoning
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.cli import run_stage
from lmfoundry.platform.config import StageFailed
from lmfoundry.platform.log import get_logger
from lmfoundry.train.grpo import RLConfig, run_grpo

logger = get_logger(__name__)


class RLJobConfig(RLConfig):
    held_out: str = Field(..., description="problems the policy never trains on (a synth output of another seed)")
    held_out_limit: int = Field(100, ge=1, le=10_000)


def held_out_accuracy(uri: str, cfg: RLJobConfig) -> float:
    suite = ReasoningConfig(
        problems=cfg.held_out, limit=cfg.held_out_limit, strategies=["greedy"], max_tokens=cfg.max_tokens
    )
    with checkpoint.opened(uri, model_only=True) as (local, _):
        result = run_reasoning(CheckpointModel(local), suite)
    return result["strategies"]["greedy"]["1"]["accuracy"]


def run_rl(cfg: RLJobConfig) -> dict:
    out = storage.normalize(cfg.output)
    before = held_out_accuracy(checkpoint.resolve(cfg.checkpoint), cfg)
    manifest = run_grpo(RLConfig.model_validate(cfg.model_dump(exclude={"held_out", "held_out_limit"})))
    after = held_out_accuracy(checkpoint.resolve(out), cfg)
    reward_rose = (manifest["last"]["reward"] or 0) > (manifest["first"]["reward"] or 0)
    verdict = {
        "held_out_accuracy": {"before": before, "after": after},
        "reward": {"first": manifest["first"]["reward"], "last": manifest["last"]["reward"]},
        "better": after > before,
        "passed": after >= before,
    }
    storage.write_json_atomic(storage.join(out, "verdict.json"), verdict)
    checkpoint.mark_gate(checkpoint.resolve(out), {"passed": verdict["passed"], "held_out_accuracy": after})
    result = {**manifest, "verdict": verdict}
    if reward_rose and after <= before:
        logger.warning(
            "rl: the reward rose (%.3f -> %.3f) but held-out verified accuracy did not (%.3f -> %.3f): "
            "possible reward hacking; the run is not called better",
            verdict["reward"]["first"],
            verdict["reward"]["last"],
            before,
            after,
        )
    if not verdict["passed"]:
        raise StageFailed(f"held-out verified accuracy fell from {before:.3f} to {after:.3f} (verdict in {out})")
    return result


def main(argv=None) -> int:
    return run_stage("rl", RLJobConfig, run_rl, argv, input_field="checkpoint", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
