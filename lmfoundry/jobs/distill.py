"""Sequence-level distillation data: a teacher's answers to a prompt pool, harm-filtered and
deduplicated, as supervised fine-tuning conversations.

    lmfoundry distill configs/distill.yaml --output work/distill
"""

import sys

from lmfoundry.align.distill import DistillConfig, run_distill
from lmfoundry.data.dedup import exact_key
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage(
        "distill",
        DistillConfig,
        lambda cfg: run_distill(cfg, exact_key),  # curation's exact-dedup key, wired in here
        argv,
        input_field="prompts",
        description=__doc__,
        needs_ray=False,
    )


if __name__ == "__main__":
    sys.exit(main())
