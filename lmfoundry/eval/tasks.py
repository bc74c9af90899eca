"""Tasks defined in the YAML format of EleutherAI's lm-evaluation-harness, run locally and offline.

A task file names its documents (`dataset_path: json` with `dataset_kwargs.data_files`, relative
paths resolved next to the YAML), how a document becomes a prompt (`doc_to_text`), its answer
(`doc_to_target`) and, for multiple choice, its choices (`doc_to_choice`): each a field name or
a Jinja template, rendered as the harness renders them. Supported output types and metrics:

- `multiple_choice`: `acc` (the choice of highest log-likelihood is the gold one) and `acc_norm`
  (log-likelihood per character of the choice);
- `generate_until`: `exact_match` (with `ignore_case`, `ignore_punctuation`) of the greedy
  generation, cut at `generation_kwargs.until`;
- `loglikelihood`: `acc` (the target is the greedy continuation) and `perplexity`.

Keys of the harness this runner does not implement (`process_docs`, `filter_list`, `!function`,
hub datasets) are refused with an error naming them, never ignored. Few-shot examples are the
first `num_fewshot` of the few-shot split (the harness's `first_n` sampler).
"""

from __future__ import annotations

import ast
import json
import math
import re
import string
from dataclasses import dataclass, field
from pathlib import Path

import yaml

from lmfoundry.clients.checkpoint import EvalModel
from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)

OUTPUT_TYPES = ("multiple_choice", "generate_until", "loglikelihood")
METRICS = {
    "multiple_choice": ("acc", "acc_norm"),
    "generate_until": ("exact_match",),
    "loglikelihood": ("acc", "perplexity"),
}
SUPPORTED_KEYS = {
    "task",
    "tag",
    "group",
    "dataset_path",
    "dataset_name",
    "dataset_kwargs",
    "test_split",
    "validation_split",
    "training_split",
    "fewshot_split",
    "output_type",
    "doc_to_text",
    "doc_to_target",
    "doc_to_choice",
    "target_delimiter",
    "fewshot_delimiter",
    "description",
    "num_fewshot",
    "fewshot_config",
    "generation_kwargs",
    "metric_list",
    "metadata",
    "should_decontaminate",
    "doc_to_decontamination_query",
    "repeats",
}
LOCAL_FORMATS = ("json", "csv", "parquet")


class _HarnessLoader(yaml.SafeLoader):
    pass


def _refuse_function(loader, node):
    raise ValueError(
        f"'!function {loader.construct_scalar(node)}': Python hooks in task files are not supported "
        "(write the prompt as a Jinja template or a field name)"
    )


_HarnessLoader.add_constructor("!function", _refuse_function)


def _jinja():
    from jinja2 import BaseLoader, StrictUndefined
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    # the harness's environment (strict, trailing newline kept, its regex_replace filter), sandboxed
    env = ImmutableSandboxedEnvironment(loader=BaseLoader, undefined=StrictUndefined, keep_trailing_newline=True)
    env.filters["regex_replace"] = lambda s, pattern, repl, count=0: re.sub(pattern, repl, s, count=count)
    return env


JINJA = _jinja()


def render(template: str, doc: dict) -> str:
    return JINJA.from_string(template).render(**doc)


@dataclass
class Task:
    name: str
    output_type: str
    docs: list[dict]
    fewshot_docs: list[dict]
    doc_to_text: str
    doc_to_target: str | int
    doc_to_choice: str | list | None
    metrics: dict[str, dict]
    target_delimiter: str = " "
    fewshot_delimiter: str = "\n\n"
    description: str = ""
    num_fewshot: int = 0
    until: list[str] = field(default_factory=lambda: ["\n\n"])
    max_gen_toks: int = 32
    source: str = ""

    # --- rendering, as the harness does it -----------------------------------------------------

    def text(self, doc: dict) -> str:
        if self.doc_to_text in doc:
            return str(doc[self.doc_to_text])
        return render(self.doc_to_text, doc)

    def choices(self, doc: dict) -> list[str]:
        spec = self.doc_to_choice
        if isinstance(spec, list):
            return [render(c, doc) for c in spec]
        if isinstance(spec, dict):
            return list(spec.values())
        if spec in doc:
            return list(doc[spec])
        rendered = ast.literal_eval(render(spec, doc))
        if not isinstance(rendered, list):
            raise ValueError(f"task {self.name}: doc_to_choice rendered {rendered!r}, not a list")
        return [str(c) for c in rendered]

    def target(self, doc: dict):
        spec = self.doc_to_target
        if isinstance(spec, int):
            return spec
        if spec in doc:
            return doc[spec]
        value = render(spec, doc)
        if value.isdigit() and self.doc_to_choice is not None:
            return int(value)
        if len(value) >= 2 and value[0] == "[" and value[-1] == "]":
            return ast.literal_eval(value)
        return value

    def gold_index(self, doc: dict) -> int:
        target, choices = self.target(doc), self.choices(doc)
        if isinstance(target, int):
            if not 0 <= target < len(choices):
                raise ValueError(f"task {self.name}: target index {target} is outside the {len(choices)} choices")
            return target
        if str(target) not in choices:
            raise ValueError(f"task {self.name}: target {target!r} is none of the choices {choices}")
        return choices.index(str(target))

    def target_text(self, doc: dict) -> str:
        if self.output_type == "multiple_choice":
            return self.choices(doc)[self.gold_index(doc)]
        target = self.target(doc)
        return str(target[0] if isinstance(target, list) else target)

    def context(self, doc: dict) -> str:
        shots = [d for d in self.fewshot_docs if d is not doc][: self.num_fewshot]
        examples = "".join(
            self.text(d) + self.target_delimiter + self.target_text(d) + self.fewshot_delimiter for d in shots
        )
        return self.description + examples + self.text(doc)


def _read_records(path: Path) -> list[dict]:
    if not path.exists():
        raise FileNotFoundError(f"task data file {path} does not exist")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        return pq.read_table(path).to_pylist()
    if path.suffix == ".csv":
        import csv

        with path.open(newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    text = path.read_text(encoding="utf-8")
    if path.suffix == ".json" and text.lstrip().startswith("["):
        return json.loads(text)
    return [json.loads(line) for line in text.splitlines() if line.strip()]


def _split_files(spec: dict, base: Path) -> dict[str, list[Path]]:
    files = (spec.get("dataset_kwargs") or {}).get("data_files")
    if files is None:
        raise ValueError(
            f"task {spec.get('task')}: dataset_kwargs.data_files is required (local files only; "
            "hub datasets cannot be fetched offline)"
        )
    if isinstance(files, (str, list)):
        files = {"train": files}
    resolved = {}
    for split, names in files.items():
        names = [names] if isinstance(names, str) else names
        resolved[split] = [
            p if p.is_absolute() else (base / p if (base / p).exists() else Path.cwd() / p) for p in map(Path, names)
        ]
    return resolved


def load_task(path: str | Path) -> Task:
    path = Path(path)
    spec = yaml.load(path.read_text(encoding="utf-8"), Loader=_HarnessLoader)
    if not isinstance(spec, dict) or "task" not in spec:
        raise ValueError(f"{path}: a task file is a mapping with at least 'task', 'output_type' and 'doc_to_text'")
    name = spec["task"]
    unknown = sorted(set(spec) - SUPPORTED_KEYS)
    if unknown:
        raise ValueError(f"{path}: task {name}: keys {unknown} are not supported; supported: {sorted(SUPPORTED_KEYS)}")
    output_type = spec.get("output_type", "generate_until")
    if output_type not in OUTPUT_TYPES:
        raise ValueError(f"{path}: output_type {output_type!r}; allowed: {list(OUTPUT_TYPES)}")
    if spec.get("dataset_path") not in LOCAL_FORMATS:
        raise ValueError(
            f"{path}: dataset_path {spec.get('dataset_path')!r}; allowed (local files): {list(LOCAL_FORMATS)}"
        )
    if spec.get("dataset_name"):
        raise ValueError(f"{path}: dataset_name is for hub datasets; local files need none")
    if (spec.get("repeats") or 1) != 1:
        raise ValueError(f"{path}: repeats={spec['repeats']} is not supported (only 1)")
    sampler = (spec.get("fewshot_config") or {}).get("sampler", "first_n")
    if sampler != "first_n":
        raise ValueError(f"{path}: fewshot_config.sampler {sampler!r} is not supported; allowed: ['first_n']")
    if output_type == "multiple_choice" and spec.get("doc_to_choice") is None:
        raise ValueError(f"{path}: a multiple_choice task needs doc_to_choice")
    splits = {
        split: [r for f in files for r in _read_records(f)] for split, files in _split_files(spec, path.parent).items()
    }
    eval_split = spec.get("test_split") or spec.get("validation_split")
    if eval_split not in splits:
        raise ValueError(
            f"{path}: split {eval_split!r} (test_split or validation_split) is not among the data "
            f"files' splits {sorted(splits)}"
        )
    fewshot_split = spec.get("fewshot_split") or spec.get("training_split") or spec.get("validation_split")
    num_fewshot = int(spec.get("num_fewshot") or 0)
    if num_fewshot and fewshot_split not in splits:
        raise ValueError(f"{path}: num_fewshot={num_fewshot} needs a fewshot_split among {sorted(splits)}")
    allowed = METRICS[output_type]
    metrics = {}
    for entry in spec.get("metric_list") or [{"metric": m} for m in allowed]:
        metric = entry["metric"]
        if metric not in allowed:
            raise ValueError(f"{path}: metric {metric!r} for {output_type}; allowed: {list(allowed)}")
        metrics[metric] = entry
    gen = spec.get("generation_kwargs") or {}
    fewshot_delimiter = spec.get("fewshot_delimiter", "\n\n")
    until = gen.get("until", [fewshot_delimiter])
    return Task(
        name=name,
        output_type=output_type,
        docs=splits[eval_split],
        fewshot_docs=splits.get(fewshot_split, []),
        doc_to_text=spec["doc_to_text"],
        doc_to_target=spec.get("doc_to_target", ""),
        doc_to_choice=spec.get("doc_to_choice"),
        metrics=metrics,
        target_delimiter=spec.get("target_delimiter", " "),
        fewshot_delimiter=fewshot_delimiter,
        description=spec.get("description") or "",
        num_fewshot=num_fewshot,
        until=[until] if isinstance(until, str) else list(until),
        max_gen_toks=int(gen.get("max_gen_toks", 32)),
        source=str(path),
    )


def load_tasks(paths: list[str]) -> list[Task]:
    """Task files, or folders of them (every *.yaml inside)."""
    files = []
    for p in map(Path, paths):
        files.extend(sorted(p.glob("*.yaml")) if p.is_dir() else [p])
    if not files:
        raise ValueError(f"no task files found in {paths}")
    return [load_task(f) for f in files]


def _normalise(text: str, entry: dict) -> str:
    text = text.strip()
    if entry.get("ignore_case"):
        text = text.lower()
    if entry.get("ignore_punctuation"):
        text = text.translate(str.maketrans("", "", string.punctuation))
    return text


def run_task(task: Task, model: EvalModel, limit: int | None = None) -> dict:
    """{"metrics": {name: value}, "samples": [per document]}, the harness's aggregates (means)."""
    docs = task.docs[:limit] if limit else task.docs
    samples = []
    if task.output_type == "multiple_choice":
        requests, spans = [], []
        for doc in docs:
            context, choices = task.context(doc), task.choices(doc)
            spans.append((len(requests), choices))
            requests.extend((context, task.target_delimiter + c) for c in choices)
        scored = model.loglikelihood(requests)
        for doc, (start, choices) in zip(docs, spans):
            lls = [scored[start + k][0] for k in range(len(choices))]
            gold = task.gold_index(doc)
            normed = [ll / max(len(c), 1) for ll, c in zip(lls, choices)]
            samples.append(
                {
                    "loglikelihoods": lls,
                    "gold": gold,
                    "acc": float(max(range(len(lls)), key=lls.__getitem__) == gold),
                    "acc_norm": float(max(range(len(normed)), key=normed.__getitem__) == gold),
                }
            )
    elif task.output_type == "loglikelihood":
        scored = model.loglikelihood([(task.context(d), task.target_text(d)) for d in docs])
        for ll, greedy in scored:
            samples.append({"loglikelihood": ll, "acc": float(greedy)})
    else:
        outputs = model.complete([task.context(d) for d in docs], task.max_gen_toks, task.until)
        entry = task.metrics.get("exact_match", {})
        for doc, out in zip(docs, outputs):
            target = task.target(doc)
            golds = target if isinstance(target, list) else [target]
            hit = any(_normalise(out, entry) == _normalise(str(g), entry) for g in golds)
            samples.append({"output": out, "target": golds, "exact_match": float(hit)})
    metrics = {}
    for name in task.metrics:
        if name == "perplexity":
            metrics[name] = math.exp(-sum(s["loglikelihood"] for s in samples) / max(len(samples), 1))
        else:
            metrics[name] = sum(s[name] for s in samples) / max(len(samples), 1)
    return {
        "task": task.name,
        "output_type": task.output_type,
        "documents": len(docs),
        "metrics": metrics,
        "samples": samples,
    }


def harness_copy(task_files: list[str], directory: str | Path) -> Path:
    """Copies of task files with their data paths made absolute, so that lm-evaluation-harness
    (`--include_path DIRECTORY`), which resolves data files against its working directory, finds
    them."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    for f in map(Path, task_files):
        spec = yaml.safe_load(f.read_text(encoding="utf-8"))
        spec["dataset_kwargs"]["data_files"] = {
            split: [str(p.resolve()) for p in paths] for split, paths in _split_files(spec, f.parent).items()
        }
        (directory / f.name).write_text(yaml.safe_dump(spec, sort_keys=False), encoding="utf-8")
    return directory
