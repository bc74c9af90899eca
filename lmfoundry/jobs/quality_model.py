"""Train the curation quality classifier: reference text against random web-like text.

python -m lmfoundry.jobs.quality_model configs/quality_model.yaml --output work/quality_model
"""

import sys

from lmfoundry.data.quality import QualityTrainConfig, train_quality_model
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage(
        "quality-model",
        QualityTrainConfig,
        train_quality_model,
        argv,
        input_field="positive",
        description=__doc__,
        needs_ray=False,
    )


if __name__ == "__main__":
    sys.exit(main())
