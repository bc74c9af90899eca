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
from lmfoundry.eval import gate, hhh, models, needle, perplexity, reasoning, redteam, tasks
from lmfoundry.eval.garak import GarakConfig, run_garak
from lmfoundry.eval.gate import GateConfig
from lmfoundry.eval.hhh import HHHConfig
from lmfoundry.eval.judge import GenerativeJudge
from lmfoundry.eval.models import EndpointConfig
from lmfoundry.eval.needle import NeedleConfig
from lmfoundry.eval.reasoning import ReasoningConfig
from lmfoundry.eval.redteam import RedTeamConfig
from lmfoundry.platform import checkpoint, storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger
from lmfoundry.platform.tracking import MlflowConfig, log_run

logger = get_logger(__name__)

BUILTIN_TASKS = Path(__file__).parent / "suites" / "tasks"


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
    garak: GarakConfig | None = Field(None, description="garak's probes against the endpoint (needs endpoint)")
    reasoning: ReasoningConfig | None = Field(None, description="accuracy at several test-time budgets (a checkpoint)")
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
        if self.garak is not None and self.endpoint is None:
            raise ValueError("garak probes an OpenAI-compatible server: set endpoint (serve the checkpoint first)")
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
        for key in ("abstention_rate", "over_abstention_rate", "false_premise_rate", "contradiction_rate"):
            if key in report["honest"]:
                m[f"honest.{key}"] = report["honest"][key]["rate"]
        calibration = report["honest"]["calibration"]
        if "ece" in calibration:
            m["honest.ece"] = calibration["ece"]
            m["honest.calibration_accuracy"] = calibration["accuracy"]
    if "long_context" in report:
        lc = report["long_context"]
        m["long_context.effective_context_length"] = lc["effective_context_length"]
        m["long_context.retrieval"] = sum(map(sum, lc["heatmap"])) / sum(map(len, lc["heatmap"]))
    for name, r in red_team_rates(report.get("red_team") or {}).items():
        m[name] = r["rate"]
    for strategy, rows in (report.get("reasoning") or {}).get("strategies", {}).items():
        for n, row in rows.items():
            m[f"reasoning.{strategy}.n{n}.acc"] = row["accuracy"]
    return m


def red_team_rates(rt: dict) -> dict[str, dict]:
    """The red team's tracked rates (each with its count and n), by metric name."""
    rates = {}
    if "attack_success_rate" in rt:
        rates["red_team.attack_success_rate"] = rt["attack_success_rate"]
        # families are fixed by the config; goal categories are drawn at random each run, so a
        # category missing from one run must not fail the gate: they stay in the report only
        rates.update({f"red_team.{family}": r for family, r in rt["by_family"].items()})
    if rt.get("replay"):
        rates["red_team.replay_success_rate"] = rt["replay"]["attack_success_rate"]
    if rt.get("search"):
        rates["red_team.search.attack_success_rate"] = rt["search"]["attack_success_rate"]
        rates["red_team.search.goal_success_rate"] = rt["search"]["goal_success_rate"]
    rates.update({f"red_team.garak.{probe}": r for probe, r in (rt.get("garak") or {}).get("by_probe", {}).items()})
    return rates


BINARY_TASK_METRICS = ("acc", "acc_norm", "exact_match")  # means of 0/1 per document


def sample_sizes(report: dict) -> dict[str, int]:
    """The number of trials behind each tracked rate (the gate tests a drop against it)."""
    n: dict[str, int] = {}
    for name, result in (report.get("tasks") or {}).items():
        for metric in result["metrics"]:
            if metric in BINARY_TASK_METRICS:
                n[f"task.{name}.{metric}"] = result["documents"]
    if "helpful" in report:
        n["helpful.task_success"] = report["helpful"]["task_success"]["n"]
        for key in ("refusal_rate", "over_refusal_rate", "harmful_reply_rate"):
            n[f"harmless.{key}"] = report["harmless"][key]["n"]
        for key, value in report["honest"].items():
            if isinstance(value, dict) and "n" in value and "rate" in value:
                n[f"honest.{key}"] = value["n"]
    for name, r in red_team_rates(report.get("red_team") or {}).items():
        n[name] = r["n"]
    for strategy, rows in (report.get("reasoning") or {}).get("strategies", {}).items():
        for count in rows:
            n[f"reasoning.{strategy}.n{count}.acc"] = report["reasoning"]["problems"]
    return n


def red_team(model: EvalModel, cfg: RedTeamConfig, regression: str | None) -> dict:
    """lmfoundry's own attacks, with the attacker and the generative judge the config names."""
    with contextlib.ExitStack() as stack:
        attacker = stack.enter_context(models.opened(cfg.attacker)) if cfg.attacker else None
        judge = GenerativeJudge(stack.enter_context(models.opened(cfg.judge))) if cfg.judge else None
        result = redteam.run_redteam(model, cfg, regression, attacker, judge)
    if judge is not None:
        result["judge"] = {"model": judge.model.name, "malformed_verdicts": judge.malformed}
    return result


def evaluate(
    model: EvalModel,
    suites: EvalSuites,
    checkpoint_dir: str | None = None,
    out_dir: str | None = None,
    use_ray: bool = True,
    endpoint: EndpointConfig | None = None,
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
        report["red_team"] = timed("redteam", lambda: red_team(model, suites.redteam, regression))
    if suites.garak is not None:
        if endpoint is None:
            raise ValueError("garak probes an OpenAI-compatible server: set endpoint")
        garak = timed("garak", lambda: run_garak(endpoint, suites.garak, out_dir))
        report.setdefault("red_team", {})["garak"] = garak
    if suites.reasoning is not None:
        if not hasattr(model, "continuations"):
            raise ValueError("the reasoning suite samples in process: evaluate a checkpoint, not an endpoint")
        report["reasoning"] = timed("reasoning", lambda: reasoning.run_reasoning(model, suites.reasoning))
        if out_dir:
            reasoning.plot(report["reasoning"], storage.join(out_dir, "reasoning.png"))
    if getattr(model, "errors", None):
        report["endpoint_errors"] = dict(model.errors)  # requests it could not serve: empty replies in the suites
        logger.warning("evaluate: the endpoint refused %d requests: %s", sum(model.errors.values()), model.errors)
    report["metrics"] = flatten(report)
    report["sample_sizes"] = sample_sizes(report)
    return report


def apply_gate(report: dict, cfg: GateConfig) -> dict | None:
    if not cfg.baseline:
        return None
    baseline = storage.read_json(storage.normalize(cfg.baseline))
    if "metrics" not in baseline:
        raise ValueError(f"baseline {cfg.baseline} is not an eval.json (it has no 'metrics')")
    sizes = gate.check_sizes(report.get("sample_sizes", {}), "the report")
    baseline_sizes = gate.check_sizes(baseline.get("sample_sizes", {}), f"baseline {cfg.baseline}")
    return {
        "baseline": cfg.baseline,
        **gate.compare(report["metrics"], baseline["metrics"], cfg, sizes, baseline_sizes),
    }


@contextlib.contextmanager
def open_model(cfg: EvaluateConfig) -> Iterator[tuple[EvalModel, str | None, dict]]:
    """The model under test, its local checkpoint directory (None for an endpoint), and what
    identifies it in the report; a temporary copy of a remote checkpoint goes when the block ends."""
    if cfg.endpoint is not None:
        yield cfg.endpoint.open(), None, {"endpoint": cfg.endpoint.url}
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
            report = {**identity, **evaluate(model, cfg, local, out, endpoint=cfg.endpoint)}
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
