"""Verified synthetic data: arithmetic, algebra, code and QA samples that enter the dataset only
when their verifier passes them.

    lmfoundry synth configs/synth.yaml --output work/synth
"""

import sys

from lmfoundry.align.synth import SynthConfig, run_synth
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage("synth", SynthConfig, run_synth, argv, input_field=None, description=__doc__, needs_ray=False)


if __name__ == "__main__":
    sys.exit(main())
