"""Evaluate a checkpoint (or a pretrain run's final checkpoint, or an OpenAI-compatible endpoint)
with the suites the config turns on; with --baseline, exit 1 when a tracked metric regressed.

    lmfoundry evaluate configs/evaluate.yaml --input work/pretrain --output work/eval \
        [--baseline work/eval-previous/eval.json]
"""

import sys

from lmfoundry.eval.suite import EvaluateConfig, run_evaluate
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if "--baseline" in argv:  # shorthand for --set gate.baseline=REPORT
        at = argv.index("--baseline")
        if at + 1 >= len(argv):
            print("error: --baseline needs a path to an earlier eval.json", file=sys.stderr)
            return 2
        argv[at : at + 2] = ["--set", f"gate.baseline={argv[at + 1]}"]
    return run_stage(
        "evaluate",
        EvaluateConfig,
        run_evaluate,
        argv,
        input_field="checkpoint",
        description=__doc__,
        needs_ray=lambda cfg: bool(cfg.data),  # Ray Data scores the token shards; the rest runs here
    )


if __name__ == "__main__":
    sys.exit(main())
