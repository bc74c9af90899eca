"""The evaluation stage: the suites a config turns on, run against a checkpoint or an endpoint,
written as `eval.json` and `report.html`, and judged by the regression gate.

    lmfoundry evaluate configs/evaluate.yaml --input work/pretrain --output work/eval [--baseline OLD/eval.json]

`metrics` in the report is the flat table the gate tracks (`lm.perplexity`, `task.NAME.acc`,
`harmless.refusal_rate`, ...); the rest of the report holds each suite's full result.
"""

from __future__ import annotations

import contextlib
import time
from collections.abc import Iterator
from pathlib import Path

from pydantic import Field, model_validator

from lmfoundry.clients.checkpoint import CheckpointModel, EvalModel
from lmfoundry.clients.openai import EndpointModel
from lmfoundry.eval import gate, hhh, needle, perplexity, redteam, tasks
from lmfoundry.eval.gate import GateConfig
from lmfoundry.eval.hhh import HHHConfig
from lmfoundry.eval.needle import NeedleConfig
from lmfoundry.eval.redteam import RedTeamConfig
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracking import MlflowConfig, log_run

logger = get_logger(__name__)

BUILTIN_TASKS = Path(__file__).parent / "suites" / "tasks"


class EndpointConfig(StageConfig):
    url: str = Field(..., description="base URL of an OpenAI-compatible server, e.g. http://127.0.0.1:8000")
    model: str
    api_key_env: str | None = Field(None, description="environment variable holding the API key")
    concurrency: int = Field(8, ge=1)
    tokenizer: str | None = Field(None, description="tokenizer.json to count context lengths with")


class EvalSuites(StageConfig):
    """Which suites run, and how. Each is off when left out (null)."""

    data: str | None = Field(None, description="a pack output directory: perplexity on its token shards")
    split: str = "val"
    batch_size: int = Field(16, ge=1)
    max_sequences: int | None = Field(None, ge=1)
    text: list[str] = Field([], description="raw held-out text files (.jsonl with 'text', or .txt): bits per byte")
    tasks: list[str] = Field([], description="harness-format task files or folders; 'builtin' for the shipped ones")
    task_limit: int | None = Field(None, ge=1, description="at most this many documents per task")
    hhh: HHHConfig | None = None
    needle: NeedleConfig | None = None
    redteam: RedTeamConfig | None = None
    gate: GateConfig = GateConfig()


class EvaluateConfig(EvalSuites):
    checkpoint: str | None = Field(None, description="a checkpoint directory or a pretrain run directory")
    endpoint: EndpointConfig | None = None
    output: str
    overwrite: bool = False
    mlflow: MlflowConfig | None = Field(None, description="also log the report's metrics as an MLflow run")

    @model_validator(mode="after")
    def _one_model(self):
        if (self.checkpoint is None) == (self.endpoint is None):
            raise ValueError(
                "set exactly one of checkpoint (a local checkpoint) and endpoint (an OpenAI-compatible server)"
            )
        if self.endpoint is not None and self.data:
            raise ValueError("data (token-shard perplexity) needs a checkpoint, not an endpoint")
        return self


def task_files(entries: list[str]) -> list[str]:
    return [str(BUILTIN_TASKS) if e == "builtin" else e for e in entries]


def flatten(report: dict) -> dict[str, float]:
    """The tracked metrics of a report, by dotted name."""
    m: dict[str, float] = {}
    lm = report.get("language_modelling") or {}
    if "token_shards" in lm:
        m["lm.perplexity"] = lm["token_shards"]["perplexity"]
        m["lm.bits_per_byte"] = lm["token_shards"]["bits_per_byte"]
    if "text" in lm:
        m["lm.text_bits_per_byte"] = lm["text"]["bits_per_byte"]
    for name, result in (report.get("tasks") or {}).items():
        for metric, value in result["metrics"].items():
            m[f"task.{name}.{metric}"] = value
    if "helpful" in report:
        m["helpful.task_success"] = report["helpful"]["task_success"]["rate"]
        for key in ("refusal_rate", "over_refusal_rate", "harmful_reply_rate"):
            m[f"harmless.{key}"] = report["harmless"][key]["rate"]
        for key in ("abstention_rate", "over_abstention_rate"):
            m[f"honest.{key}"] = report["honest"][key]["rate"]
        calibration = report["honest"]["calibration"]
        if "ece" in calibration:
            m["honest.ece"] = calibration["ece"]
            m["honest.calibration_accuracy"] = calibration["accuracy"]
    if "long_context" in report:
        lc = report["long_context"]
        m["long_context.effective_context_length"] = lc["effective_context_length"]
        m["long_context.retrieval"] = sum(map(sum, lc["heatmap"])) / sum(map(len, lc["heatmap"]))
    if "red_team" in report:
        m["red_team.attack_success_rate"] = report["red_team"]["attack_success_rate"]["rate"]
        for family, r in report["red_team"]["by_family"].items():
            m[f"red_team.{family}"] = r["rate"]
        if report["red_team"].get("replay"):
            m["red_team.replay_success_rate"] = report["red_team"]["replay"]["attack_success_rate"]["rate"]
    return m


def evaluate(
    model: EvalModel,
    suites: EvalSuites,
    checkpoint_dir: str | None = None,
    out_dir: str | None = None,
    use_ray: bool = True,
) -> dict:
    """Run the suites `suites` turns on; the report (without gate or timing)."""
    report: dict = {"model": model.name, "suites": {}}

    def timed(name, fn):
        started = time.perf_counter()
        result = fn()
        report["suites"][name] = round(time.perf_counter() - started, 3)
        logger.info("evaluate: %s done in %.1f s", name, report["suites"][name])
        return result

    lm = {}
    if suites.data:
        lm["token_shards"] = timed(
            "perplexity",
            lambda: perplexity.perplexity(
                checkpoint_dir, suites.data, suites.split, suites.batch_size, suites.max_sequences, use_ray=use_ray
            ),
        )
        lm["token_shards"]["uniform_perplexity"] = model.model.cfg.vocab_size
    if suites.text:
        lm["text"] = timed("text", lambda: perplexity.text_bits_per_byte(model, suites.text))
    if lm:
        report["language_modelling"] = lm
    if suites.tasks:
        loaded = tasks.load_tasks(task_files(suites.tasks))
        report["tasks"] = {}
        for task in loaded:
            result = timed(f"task:{task.name}", lambda task=task: tasks.run_task(task, model, suites.task_limit))
            report["tasks"][task.name] = {k: v for k, v in result.items() if k != "samples"}
    if suites.hhh is not None:
        report.update(timed("hhh", lambda: hhh.run_hhh(model, suites.hhh)))
    if suites.needle is not None:
        report["long_context"] = timed("needle", lambda: needle.run_needle(model, suites.needle))
    if suites.redteam is not None:
        regression = storage.join(out_dir, "redteam_regression.jsonl") if out_dir else None
        report["red_team"] = timed("redteam", lambda: redteam.run_redteam(model, suites.redteam, regression))
    if getattr(model, "errors", None):
        report["endpoint_errors"] = dict(model.errors)  # requests it could not serve: empty replies in the suites
        logger.warning("evaluate: the endpoint refused %d requests: %s", sum(model.errors.values()), model.errors)
    report["metrics"] = flatten(report)
    return report


def apply_gate(report: dict, cfg: GateConfig) -> dict | None:
    if not cfg.baseline:
        return None
    baseline = storage.read_json(storage.normalize(cfg.baseline))
    if "metrics" not in baseline:
        raise ValueError(f"baseline {cfg.baseline} is not an eval.json (it has no 'metrics')")
    return {"baseline": cfg.baseline, **gate.compare(report["metrics"], baseline["metrics"], cfg)}


@contextlib.contextmanager
def open_model(cfg: EvaluateConfig) -> Iterator[tuple[EvalModel, str | None, dict]]:
    """The model under test, its local checkpoint directory (None for an endpoint), and what
    identifies it in the report; a temporary copy of a remote checkpoint goes when the block ends."""
    if cfg.endpoint is not None:
        import os

        e = cfg.endpoint
        key = os.environ.get(e.api_key_env) if e.api_key_env else None
        if e.api_key_env and not key:
            raise ValueError(f"endpoint.api_key_env: environment variable {e.api_key_env} is not set")
        yield EndpointModel(e.url, e.model, key, e.concurrency, tokenizer=e.tokenizer), None, {"endpoint": e.url}
        return
    uri = checkpoint.resolve(cfg.checkpoint)
    with checkpoint.opened(uri, model_only=True) as (local, manifest):
        yield CheckpointModel(local, cfg.batch_size), local, {"checkpoint": uri, "step": manifest.get("step")}


def run_evaluate(cfg: EvaluateConfig) -> dict:
    from lmfoundry.eval.html import write_html
    from lmfoundry.platform.config import StageFailed

    out = storage.normalize(cfg.output)
    if not storage.prepare_output(out, cfg.overwrite):
        logger.info("evaluate: %s is already committed; not rerun (set overwrite=true to redo)", out)
        report = storage.read_json(storage.join(out, "eval.json"))
        report["gate"] = apply_gate(report, cfg.gate)
    else:
        started = time.time()
        with open_model(cfg) as (model, local, identity):
            report = {**identity, **evaluate(model, cfg, local, out)}
        report["gate"] = apply_gate(report, cfg.gate)
        report["seconds"] = round(time.time() - started, 2)
        storage.write_json_atomic(storage.join(out, "eval.json"), report)
        storage.write_bytes_atomic(storage.join(out, "report.html"), write_html(report).encode())
        storage.commit(out, "evaluate", {"model": identity, "report": "eval.json", "html": "report.html"})
        for name, value in sorted(report["metrics"].items()):
            logger.info("evaluate: %-45s %.4g", name, value)
        if cfg.mlflow:
            params = {"checkpoint": cfg.checkpoint, "endpoint": cfg.endpoint and cfg.endpoint.url, "output": out}
            run_id = log_run(cfg.mlflow, out.rstrip("/").rsplit("/", 1)[-1], params, report["metrics"])
            logger.info("evaluate: metrics logged to MLflow run %s (%s)", run_id, cfg.mlflow.tracking_uri)
    if report["gate"] and not report["gate"]["passed"]:
        worse = ", ".join(
            f"{r['metric']} {r['baseline']:.4g} -> {r['value']:.4g}" for r in report["gate"]["regressions"]
        )
        gone = ", ".join(report["gate"]["missing"])
        raise StageFailed(
            f"the gate failed against {cfg.gate.baseline}: regressed: {worse or 'none'}"
            f"{'; missing: ' + gone if gone else ''} (report in {out})"
        )
    return report
