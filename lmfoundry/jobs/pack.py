"""Train the tokenizer on curated text and pack it into fixed-length token sequences.

python -m lmfoundry.jobs.pack configs/pack.yaml --input work/curated --output work/packed
"""

import sys

from lmfoundry.data.pack import PackConfig, run_pack
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    return run_stage("pack", PackConfig, run_pack, argv, description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
