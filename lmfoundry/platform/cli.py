"""The `lmfoundry` command: one subcommand per stage, each a thin job in `lmfoundry.jobs`.

lmfoundry curate|pack|pretrain|evaluate|serve CONFIG [--input URI] [--output URI] [--set k=v ...]
lmfoundry sft CONFIG [--input CHECKPOINT] [--output RUN] [--set data=CHATS.jsonl]
lmfoundry align CONFIG [--input CHECKPOINT] [--output RUN] [--set pairs=PAIRS.jsonl]
lmfoundry pairs CONFIG [--output DIR]      (teacher-judged preference pairs)
lmfoundry synth CONFIG [--output DIR]      (verified synthetic data)
lmfoundry distill CONFIG [--output DIR]    (a teacher's answers as fine-tuning data)
lmfoundry tool-data CONFIG [--output DIR]  (verified tool-use conversations for an agent workflow)
lmfoundry reward CONFIG [--input CHECKPOINT] [--output RUN]   (outcome or process reward model)
lmfoundry rl CONFIG [--input CHECKPOINT] [--output RUN]       (GRPO with verifiable rewards)
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
lmfoundry config show STAGE                (a stage's config keys: types, defaults, descriptions)
lmfoundry STAGE --help | --version
"""

from __future__ import annotations

import argparse
import ast
import importlib
import importlib.util
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass

# Only light imports here: `lmfoundry --help` and `lmfoundry STAGE --help` answer without Ray,
# torch or pyarrow (tests/test_packaging.py measures it); a stage's own imports wait for its run.
from lmfoundry.platform.config import ConfigError, StageConfig, StageFailed, load_config
from lmfoundry.platform.log import get_logger


@dataclass(frozen=True)
class Command:
    """One `lmfoundry` subcommand, run by `lmfoundry.jobs.<name>`. A stage (parsed by
    stage_parser) also names its config class (`module:Class`, for `lmfoundry config show`) and
    the shipped recipe its help points to."""

    config: str | None = None
    recipe: str | None = None

    @property
    def is_stage(self) -> bool:
        return self.config is not None


COMMANDS = {
    "curate": Command("lmfoundry.data.curate:CurateConfig", "configs/curate.yaml"),
    "pack": Command("lmfoundry.data.pack:PackConfig", "configs/pack.yaml"),
    "pretrain": Command("lmfoundry.jobs.pretrain:PretrainJobConfig", "configs/pretrain_tiny_cpu.yaml"),
    "evaluate": Command("lmfoundry.eval.suite:EvaluateConfig", "configs/evaluate.yaml"),
    "sft": Command("lmfoundry.jobs.sft:SFTJobConfig", "configs/sft_tiny_cpu.yaml"),
    "align": Command("lmfoundry.jobs.align:AlignJobConfig", "configs/align_dpo.yaml"),
    "serve": Command("lmfoundry.serving.app:ServeConfig", "configs/serve.yaml"),
    "pairs": Command("lmfoundry.align.pairs:PairsConfig", "configs/pairs.yaml"),
    "synth": Command("lmfoundry.align.synth:SynthConfig", "configs/synth.yaml"),
    "distill": Command("lmfoundry.align.distill:DistillConfig", "configs/distill.yaml"),
    "tool-data": Command("lmfoundry.agents.tool_data:ToolDataConfig", "configs/tool_data.yaml"),
    "reward": Command("lmfoundry.jobs.reward:RewardJobConfig", "configs/reward_process.yaml"),
    "rl": Command("lmfoundry.jobs.rl:RLJobConfig", "configs/rl_grpo.yaml"),
    "quality-model": Command("lmfoundry.data.quality:QualityTrainConfig", "configs/quality_model.yaml"),
    "agents": Command("lmfoundry.jobs.agents:AgentsJobConfig", "configs/agents.yaml"),
    "quickstart": Command(),
    "export": Command(),
    "import": Command(),
    "plan": Command(),
    "harm-audit": Command(),
    "keys": Command(),
    "traffic": Command(),
    "review": Command(),
    "config": Command(),
}
logger = get_logger(__name__)


def version() -> str:
    from lmfoundry import __version__

    return __version__


def job_module(command: str) -> str:
    module = {"import": "import_model"}.get(command, command.replace("-", "_"))  # `import` is a keyword
    return f"lmfoundry.jobs.{module}"


def job_docstring(command: str) -> str:
    """The job module's docstring, read from its source: importing the job would import its stage."""
    spec = importlib.util.find_spec(job_module(command))
    with open(spec.origin, encoding="utf-8") as f:
        return ast.get_docstring(ast.parse(f.read())) or ""


def stage_parser(stage: str, description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog=f"lmfoundry {stage}", description=description, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    recipe = COMMANDS[stage].recipe
    p.add_argument("config", help=f"YAML recipe, e.g. {recipe} (`lmfoundry config show {stage}` lists its keys)")
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
        from lmfoundry.platform import storage

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
    needs_ray: bool | Callable[[StageConfig], bool] = True,
    worker_env: dict[str, str] | None = None,
) -> int:
    """Parse, validate, connect to Ray, run the stage, print its result as JSON; exit 2 on bad
    input, 1 on a failure during the run. `needs_ray` may be a function of the config, for a
    stage that uses Ray for some of its work only: a local Ray takes seconds to start and stop.
    `worker_env`: environment variables for the job's Ray workers (platform/ray_env.py)."""
    args = stage_parser(stage, description).parse_args(argv)
    try:
        cfg = load_stage_config(args, cls, input_field, output_field)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if needs_ray(cfg) if callable(needs_ray) else needs_ray:
        from lmfoundry.platform.ray_env import init_ray

        init_ray(args.address, worker_env)
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
    if argv[:1] in (["-h"], ["--help"]):
        print(__doc__.strip())
        return 0
    if argv[:1] in (["-V"], ["--version"]):
        print(f"lmfoundry {version()}")
        return 0
    if not argv or argv[0] not in COMMANDS:
        print(__doc__.strip(), file=sys.stderr)
        if argv:
            print(f"\nerror: unknown command {argv[0]!r}; choose one of {', '.join(COMMANDS)}", file=sys.stderr)
        return 2
    command, rest = argv[0], argv[1:]
    if COMMANDS[command].is_stage and rest[:1] in (["-h"], ["--help"]):
        stage_parser(command, job_docstring(command)).print_help()  # the job's own parser, unimported
        return 0
    return importlib.import_module(job_module(command)).main(rest)


if __name__ == "__main__":
    sys.exit(main())
