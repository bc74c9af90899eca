"""Experiment tracking in MLflow, switched on by a stage's `mlflow` section: training logs its
metrics at every logged step (through Ray Train's MLflow integration, from rank 0: train/metrics.py),
evaluation logs its scores once. The tracking URI is an MLflow server (http://...), or a local
folder for one machine (MLflow asks for MLFLOW_ALLOW_FILE_STORE=true to use a folder)."""

from __future__ import annotations

import math

from pydantic import Field

from lmfoundry.platform.config import StageConfig


class MlflowConfig(StageConfig):
    tracking_uri: str = Field(..., min_length=1, description="an MLflow server (http://host:5000) or file:///folder")
    experiment: str = Field("lmfoundry", min_length=1, description="created when it does not exist")
    run_name: str | None = Field(None, description="default: the stage's output directory name")


def require_mlflow():
    try:
        import mlflow
    except ImportError:
        raise ImportError(
            "the mlflow section needs MLflow: pip install 'lmfoundry[tracking]' (mlflow-skinny)"
        ) from None
    return mlflow


def _flatten(values: dict, leaf, prefix: str = "") -> dict:
    """A nested dict as dotted names -> leaf(value), leaving out values leaf maps to None."""
    out = {}
    for key, value in values.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(_flatten(value, leaf, f"{name}."))
        elif (kept := leaf(value)) is not None:
            out[name] = kept
    return out


def _finite_number(value) -> float | None:
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok else None


def numeric(values: dict, prefix: str = "") -> dict[str, float]:
    """The finite numbers of a (nested) metrics dict, with dotted names: what MLflow can plot."""
    return _flatten(values, _finite_number, prefix)


def scalar_params(values: dict, prefix: str = "") -> dict[str, str]:
    """A config's scalar settings with dotted names, as MLflow run parameters."""
    return _flatten(values, lambda v: str(v)[:500] if isinstance(v, (str, int, float, bool)) else None, prefix)


def log_run(cfg: MlflowConfig, run_name: str, params: dict, metrics: dict) -> str:
    """One finished MLflow run with `params` and `metrics` (nested dicts flattened); its id."""
    mlflow = require_mlflow()
    mlflow.set_tracking_uri(cfg.tracking_uri)
    mlflow.set_experiment(cfg.experiment)
    with mlflow.start_run(run_name=cfg.run_name or run_name) as run:
        mlflow.log_params(scalar_params(params))
        mlflow.log_metrics(numeric(metrics))
        return run.info.run_id
