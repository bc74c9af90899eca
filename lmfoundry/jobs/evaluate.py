"""Held-out perplexity of a checkpoint (or of a pretrain run's final checkpoint).

    python -m lmfoundry.jobs.evaluate configs/evaluate.yaml --input work/pretrain --output work/eval \
        --set data=work/packed
"""

import sys

from lmfoundry.eval.perplexity import EvaluateConfig, run_evaluate
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage("evaluate", EvaluateConfig, run_evaluate, argv, input_field="checkpoint", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
