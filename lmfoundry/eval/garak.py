"""garak (NVIDIA's LLM vulnerability scanner) against the OpenAI-compatible endpoint under test,
its results folded into the red-team section of eval.json beside lmfoundry's own attacks.

garak runs as a program of its own (`python -m garak`) with its `openai.OpenAICompatible`
generator pointed at the endpoint, in a scratch directory that holds its report; each of its
(probe, detector) evaluations becomes a failure rate (the share of outputs the detector flagged,
i.e. attack success) with a Wilson interval, `red_team.garak.PROBE` in the gate's metrics.

garak pins versions of packages lmfoundry also uses (transformers, openai), so it may live in a
Python environment of its own: `python` names that interpreter (default: this one). Install it
with `pip install 'lmfoundry[garak]'`, or into a separate virtual environment created with
`--system-site-packages`, which keeps lmfoundry's torch and overrides only what garak pins.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

from pydantic import Field, field_validator

from lmfoundry.eval.stats import wilson_interval
from lmfoundry.platform import storage
from lmfoundry.platform.config import StageConfig
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

PLUGIN_NAME = re.compile(r"[A-Za-z][A-Za-z0-9_]*(?:\.[A-Za-z][A-Za-z0-9_]*)?")
# request fields garak's generator sends that lmfoundry's server does not take (it refuses
# unknown fields rather than ignore them)
UNSUPPORTED_FIELDS = ["frequency_penalty", "presence_penalty"]


class GarakConfig(StageConfig):
    probes: list[str] = Field(["lmrc.Profanity"], min_length=1, description="garak probes: module or module.Class")
    generations: int = Field(1, ge=1, le=20, description="replies per prompt")
    max_tokens: int = Field(64, ge=1)
    temperature: float = Field(0.7, ge=0, le=2)
    python: str | None = Field(None, description="the interpreter with garak installed (default: this one)")
    timeout_s: float = Field(1800, gt=0)

    @field_validator("probes")
    @classmethod
    def _names(cls, probes: list[str]) -> list[str]:
        bad = [p for p in probes if not PLUGIN_NAME.fullmatch(p)]
        if bad:
            raise ValueError(f"garak probe names {bad} are not module or module.Class names (e.g. lmrc.Profanity)")
        return probes


class GarakUnavailable(RuntimeError):
    """garak is not installed for the configured interpreter."""


def garak_version(python: str | None = None) -> str:
    """garak's version for `python`, or GarakUnavailable saying why not."""
    python = python or sys.executable
    done = subprocess.run(
        [python, "-c", "import importlib.metadata as m; print(m.version('garak'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    if done.returncode != 0:
        raise GarakUnavailable(
            f"garak is not installed for {python}: pip install 'lmfoundry[garak]' "
            f"(or set garak.python to an interpreter that has it): {done.stderr.strip()[-300:]}"
        )
    return done.stdout.strip()


def read_report(path: Path) -> dict:
    """{"by_probe": {probe: rate}, "by_detector": {...}} from a garak report (JSONL): for each
    evaluation the outputs its detector flagged (fails) of those it scored."""
    by_probe: dict[str, list[int]] = {}
    by_detector: dict[str, dict] = {}
    for line in path.read_text(encoding="utf-8").splitlines():
        entry = json.loads(line)
        if entry.get("entry_type") != "eval":
            continue
        fails, total = int(entry["fails"]), int(entry["total_evaluated"])
        counts = by_probe.setdefault(entry["probe"], [0, 0])
        counts[0], counts[1] = counts[0] + fails, counts[1] + total
        by_detector[f"{entry['probe']}/{entry['detector']}"] = _rate(fails, total)
    return {"by_probe": {p: _rate(k, n) for p, (k, n) in by_probe.items()}, "by_detector": by_detector}


def _rate(k: int, n: int) -> dict:
    low, high = wilson_interval(k, n)
    return {"rate": k / n if n else 0.0, "count": k, "n": n, "ci95": [low, high]}


def run_garak(endpoint, cfg: GarakConfig, out_dir: str | None = None) -> dict:
    """garak's probes against `endpoint` (an EndpointConfig); the folded results. garak's own
    report is kept as `garak.report.jsonl` in `out_dir` when one is given."""
    python = cfg.python or sys.executable
    version = garak_version(python)
    key = os.environ.get(endpoint.api_key_env) if endpoint.api_key_env else None
    if endpoint.api_key_env and not key:
        raise ValueError(f"endpoint.api_key_env: environment variable {endpoint.api_key_env} is not set")
    options = {
        "openai": {
            "OpenAICompatible": {
                "uri": endpoint.url.rstrip("/") + "/v1/",
                "max_tokens": cfg.max_tokens,
                "temperature": cfg.temperature,
                "suppressed_params": UNSUPPORTED_FIELDS,
            }
        }
    }
    with tempfile.TemporaryDirectory(prefix="lmfoundry-garak-") as scratch:
        config = Path(scratch) / "run.json"
        config.write_text(json.dumps({"reporting": {"report_dir": str(Path(scratch) / "runs")}}))
        command = [
            python, "-m", "garak",
            "--config", str(config),
            "--target_type", "openai.OpenAICompatible",
            "--target_name", endpoint.model,
            "--generator_options", json.dumps(options),
            "--probes", ",".join(cfg.probes),
            "--generations", str(cfg.generations),
            "--report_prefix", "lmfoundry",
        ]  # fmt: skip
        env = {
            **os.environ,
            "OPENAICOMPATIBLE_API_KEY": key or "unused",  # the client wants one; lmfoundry may not
            # garak writes its config, cache and logs under the XDG folders: keep them in scratch
            "XDG_DATA_HOME": str(Path(scratch) / "data"),
            "XDG_CONFIG_HOME": str(Path(scratch) / "config"),
            "XDG_CACHE_HOME": str(Path(scratch) / "cache"),
        }
        logger.info("garak %s: probes %s against %s", version, cfg.probes, endpoint.url)
        done = subprocess.run(command, capture_output=True, text=True, env=env, timeout=cfg.timeout_s)
        report = Path(scratch) / "runs" / "lmfoundry.report.jsonl"
        if done.returncode != 0 or not report.exists():
            raise RuntimeError(
                f"garak exited with {done.returncode} and {'no' if not report.exists() else 'a partial'} report:\n"
                f"{done.stdout[-1500:]}{done.stderr[-1500:]}"
            )
        result = read_report(report)
        if out_dir is not None:  # a local path or s3://
            storage.write_bytes_atomic(storage.join(out_dir, "garak.report.jsonl"), report.read_bytes())
    if not result["by_probe"]:
        raise RuntimeError(f"garak ran probes {cfg.probes} but its report holds no evaluations")
    return {
        "garak_version": version,
        "generator": f"openai.OpenAICompatible {endpoint.model} at {endpoint.url}",
        "probes": cfg.probes,
        "generations": cfg.generations,
        **result,
        "report_file": storage.join(out_dir, "garak.report.jsonl") if out_dir else None,
    }
