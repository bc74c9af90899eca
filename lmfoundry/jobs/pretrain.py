"""Pretrain on packed token shards with Ray Train + DeepSpeed.

    python -m lmfoundry.jobs.pretrain configs/pretrain_tiny_cpu.yaml --input work/packed --output work/pretrain
"""

import sys

from lmfoundry.platform.cli import run_stage
from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.pretrain import run_pretrain


def main(argv=None) -> int:
    return run_stage("pretrain", PretrainConfig, run_pretrain, argv, input_field="data", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
