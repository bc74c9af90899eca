"""The `lmfoundry` command: one subcommand per stage, each a thin job in `lmfoundry.jobs`.

lmfoundry curate|pack|pretrain|evaluate|serve CONFIG [--input URI] [--output URI] [--set k=v ...]
lmfoundry align CONFIG [--input CHECKPOINT] [--output RUN] [--set pairs=PAIRS.jsonl]
lmfoundry pairs CONFIG [--output DIR]      (teacher-judged preference pairs)
lmfoundry synth CONFIG [--output DIR]      (verified synthetic data)
lmfoundry review --db DSN list|claim|decide|comment|serve ...
lmfoundry agents CONFIG | agents demo-data [--out DIR]
lmfoundry quickstart [--workdir DIR] [--keep-serving]
lmfoundry export CHECKPOINT OUTPUT [--format hf] [--dtype bfloat16|float32]
lmfoundry import hf SRC OUT [--max-seq-len N]   (a local Hugging Face checkpoint)
lmfoundry plan PRETRAIN_CONFIG [--gpu H200] [--nodes N] [--token-budget T]
lmfoundry quality-model CONFIG [--output DIR] [--set positive=URI --set negative=URI]
lmfoundry harm-audit CURATED --labels FILE (reviewers' labels -> the checklist's violation rate)
lmfoundry keys create --tenant NAME | list | revoke KEY_ID [--file KEYS]
lmfoundry traffic show | set V1=90 V2=10 | rollback --file SPLIT
"""

from __future__ import annotations

import argparse
import importlib
import json
import sys
from collections.abc import Callable

from lmfoundry.platform import storage
from lmfoundry.platform.config import ConfigError, StageConfig, StageFailed, load_config
from lmfoundry.platform.log import get_logger

STAGES = (
    "curate",
    "pack",
    "pretrain",
    "evaluate",
    "align",
    "serve",
    "quickstart",
    "export",
    "import",
    "plan",
    "quality-model",
    "harm-audit",
    "keys",
    "traffic",
    "pairs",
    "synth",
    "review",
    "agents",
)
logger = get_logger(__name__)


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog=f"lmfoundry {stage}", description=description)
    p.add_argument("config", help=f"YAML recipe, e.g. configs/{stage}.yaml")
    p.add_argument("--input", help="overrides the config's input URI")
    p.add_argument("--output", help="overrides the config's output URI")
    p.add_argument(
        "--set",
        dest="overrides",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="override a config key, e.g. --set filters.gopher_quality.min_words=20 (repeatable)",
    )
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS, else an embedded local Ray)")
    return p


def load_stage_config(
    args: argparse.Namespace, cls: type[StageConfig], input_field: str | None, output_field: str | None
) -> StageConfig:
    """The config with --input/--output applied, its input checked to exist: all before Ray starts."""
    overrides = list(args.overrides)
    if args.input is not None:
        if input_field is None:
            raise ConfigError("this stage takes no --input")
        overrides.append(f"{input_field}={args.input}")
    if args.output is not None:
        if output_field is None:
            raise ConfigError("this stage takes no --output")
        overrides.append(f"{output_field}={args.output}")
    cfg = load_config(cls, args.config, overrides)
    if input_field is not None:
        uri = getattr(cfg, input_field)
        if not storage.exists(uri):
            raise ConfigError(f"config {args.config}: key {input_field!r}: input {uri!r} does not exist")
    return cfg


def run_stage(
    stage: str,
    cls: type[StageConfig],
    fn: Callable[[StageConfig], dict],
    argv: list[str] | None,
    input_field: str | None = "input",
    output_field: str | None = "output",
    description: str = "",
    needs_ray: bool = True,
) -> int:
    """Parse, validate, connect to Ray, run the stage, print its result as JSON; exit 2 on bad
    input, 1 on a failure during the run."""
    args = stage_parser(stage, description).parse_args(argv)
    try:
        cfg = load_stage_config(args, cls, input_field, output_field)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if needs_ray:
        from lmfoundry.platform.ray_env import init_ray

        init_ray(args.address)
    try:
        result = fn(cfg)
    except (ValueError, FileNotFoundError, FileExistsError) as e:
        print(f"error: {stage}: {e}", file=sys.stderr)
        return 2
    except StageFailed as e:
        print(f"error: {stage}: {e}", file=sys.stderr)
        return 1
    print(json.dumps(result, indent=2, default=str))
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0] in ("-h", "--help") or argv[0] not in STAGES:
        print(__doc__.strip(), file=sys.stderr)
        if argv and argv[0] not in ("-h", "--help"):
            print(f"\nerror: unknown command {argv[0]!r}; choose one of {', '.join(STAGES)}", file=sys.stderr)
            return 2
        return 0 if argv else 2
    module = {"import": "import_model"}.get(argv[0], argv[0].replace("-", "_"))  # `import` is a keyword
    job = importlib.import_module(f"lmfoundry.jobs.{module}")
    return job.main(argv[1:])


if __name__ == "__main__":
    sys.exit(main())
