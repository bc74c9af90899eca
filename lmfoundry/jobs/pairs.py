"""Teacher-judged preference pairs (Ray Data), with a human review queue; `finalize` folds the
reviewers' decisions back in.

    lmfoundry pairs configs/pairs.yaml --output work/pairs
    lmfoundry pairs finalize work/pairs [--db DSN]
"""

import argparse
import json
import sys

from lmfoundry.align.pairs import PairsConfig, finalize, run_pairs
from lmfoundry.platform.cli import run_stage


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["finalize"]:
        p = argparse.ArgumentParser(prog="lmfoundry pairs finalize")
        p.add_argument("output")
        p.add_argument("--db", help="the review queue's DSN (default: OUTPUT/review.sqlite)")
        args = p.parse_args(argv[1:])
        try:
            print(json.dumps(finalize(args.output, args.db), indent=2))
        except (ValueError, FileNotFoundError) as e:
            print(f"error: pairs finalize: {e}", file=sys.stderr)
            return 2
        return 0
    return run_stage("pairs", PairsConfig, run_pairs, argv, input_field="prompts", description=__doc__)


if __name__ == "__main__":
    sys.exit(main())
