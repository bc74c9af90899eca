"""Curate a raw corpus with Ray Data.

python -m lmfoundry.jobs.curate configs/curate.yaml --input data/raw --output work/curated
"""

import sys

from lmfoundry.data.curate import CurateConfig, run_curate
from lmfoundry.platform.cli import run_stage
from lmfoundry.platform.ray_env import curation_worker_env


def main(argv=None) -> int:
    return run_stage("curate", CurateConfig, run_curate, argv, description=__doc__, worker_env=curation_worker_env())


if __name__ == "__main__":
    sys.exit(main())
