"""Ray Train + DeepSpeed pretraining: config, DeepSpeed config derivation, the worker loop."""

import importlib.abc
import sys


class _NoMLflowForDeepSpeedsAutotuner(importlib.abc.MetaPathFinder):
    """DeepSpeed's autotuner imports MLflow when it is installed, only to log autotuning
    experiments, which lmfoundry never runs; the import is half of a training worker's start
    (2.4 s of 6 s on 2 cores, every worker of every attempt). While that module is being
    imported, MLflow is reported missing; everywhere else it imports as usual."""

    def find_spec(self, name, path=None, target=None):
        tuner = sys.modules.get("deepspeed.autotuning.autotuner")
        if name == "mlflow" and tuner is not None and not hasattr(tuner, "Autotuner"):
            raise ModuleNotFoundError("MLflow is not imported for DeepSpeed's autotuner", name=name)
        return None


if not any(isinstance(f, _NoMLflowForDeepSpeedsAutotuner) for f in sys.meta_path):
    sys.meta_path.insert(0, _NoMLflowForDeepSpeedsAutotuner())
