"""The whole lifecycle on one machine: sample corpus -> curate -> pack -> pretrain -> evaluate -> serve.

    lmfoundry quickstart --workdir work/quickstart            # about 5 minutes on 2 CPU cores
    lmfoundry quickstart --keep-serving                       # leave the API running afterwards

Every stage writes under the work directory; a rerun skips the stages already committed there.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from lmfoundry.platform.config import ConfigError

DEFAULT_CONFIG = Path(__file__).resolve().parents[2] / "configs" / "quickstart.yaml"


def main(argv=None) -> int:
    p = argparse.ArgumentParser(
        prog="lmfoundry quickstart", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("config", nargs="?", help="quickstart recipe (default configs/quickstart.yaml)")
    p.add_argument("--workdir", help="where every stage writes (default work/quickstart)")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE")
    p.add_argument("--keep-serving", action="store_true", help="leave the API running at the end")
    p.add_argument("--address", help="Ray cluster address (default: an embedded local Ray)")
    args = p.parse_args(argv)
    # every stage's imports (torch, Ray, DeepSpeed) after parsing: --help answers at once
    from lmfoundry.jobs.lifecycle import load_quickstart_config, run_quickstart

    try:
        cfg = load_quickstart_config(args.config, args.workdir, args.overrides)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    from lmfoundry.platform.ray_env import init_ray

    init_ray(args.address)
    run_quickstart(cfg, args.keep_serving)
    return 0


if __name__ == "__main__":
    sys.exit(main())
