"""Evaluation: lmfoundry's task runner against lm-evaluation-harness on the same task files and
the same weights (the harness runs the Hugging Face export), and the cost of each suite.

    python benchmarks/evaluation.py            # a few minutes on 2 CPU cores
    python benchmarks/evaluation.py --quick    # one repeat, shorter needle grid

The model is Llama-shaped, about 16M parameters (8 layers, d_model 384, an 8,192 BPE vocabulary
trained here on standard-library docstrings, 1,024-token context), with random weights: speed
and agreement do not depend on what the weights know. The shipped tasks (two multiple-choice,
one generation) run under both systems, each run in a fresh spawned process, pair by pair,
`--repeats` times; each timing runs from the call after the imports (loading the model and the
documents, then scoring); the table gives median seconds, the ratio, and the largest difference
between the two systems' per-choice log-likelihoods and metrics. Then each of lmfoundry's other
suites runs once on the same model: helpful/harmless/honest, needle in a haystack up to the
full context, 80 red-team attacks.
Prints a table; writes benchmarks/results/evaluation.json.
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
TASKS = Path(__file__).resolve().parents[1] / "lmfoundry" / "eval" / "suites" / "tasks"
TASK_FILES = [str(TASKS / f) for f in ("arithmetic_mc.yaml", "common_sense_mc.yaml", "repeat_word.yaml")]


def run_ours(ckpt: str, out: mp.Queue) -> None:
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.tasks import load_tasks, run_task

    started = time.perf_counter()
    model = CheckpointModel(ckpt)
    results = {t.name: run_task(t, model) for t in load_tasks(TASK_FILES)}
    out.put(
        {
            "seconds": time.perf_counter() - started,
            "metrics": {n: r["metrics"] for n, r in results.items()},
            "lls": {
                n: [s["loglikelihoods"] for s in r["samples"]]
                for n, r in results.items()
                if r["output_type"] == "multiple_choice"
            },
        }
    )


def run_harness(hf_dir: str, include: str, out: mp.Queue) -> None:
    os.environ.update(HF_HUB_OFFLINE="1", HF_DATASETS_OFFLINE="1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    started = time.perf_counter()
    names = ["lmfoundry_arithmetic_mc", "lmfoundry_common_sense_mc", "lmfoundry_repeat_word"]
    res = lm_eval.simple_evaluate(
        model="hf",
        model_args=f"pretrained={hf_dir},dtype=float32",
        tasks=names,
        task_manager=TaskManager(include_path=include),
        log_samples=True,
        batch_size=16,
        device="cpu",
    )
    metrics = {
        n: {k.split(",")[0]: v for k, v in res["results"][n].items() if k.endswith(",none") and "stderr" not in k}
        for n in names
    }
    lls = {n: [None] * len(res["samples"][n]) for n in names[:2]}
    for n in names[:2]:
        for s in res["samples"][n]:
            lls[n][s["doc_id"]] = [r[0][0] for r in s["resps"]]
    out.put({"seconds": time.perf_counter() - started, "metrics": metrics, "lls": lls})


def in_process(target, *args) -> dict:
    ctx = mp.get_context("spawn")
    q = ctx.Queue()
    p = ctx.Process(target=target, args=(*args, q))
    p.start()
    result = q.get(timeout=1800)
    p.join()
    return result


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    repeats = 1 if args.quick else args.repeats

    from serving import build_checkpoint

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.hhh import HHHConfig, run_hhh
    from lmfoundry.eval.needle import NeedleConfig, run_needle
    from lmfoundry.eval.redteam import RedTeamConfig, run_redteam
    from lmfoundry.eval.tasks import harness_copy
    from lmfoundry.model.export import export_hf

    work = Path(tempfile.mkdtemp(prefix="lmfoundry-bench-eval-"))
    ckpt = work / "ckpt"
    build_checkpoint(ckpt, vocab=8192, context=1024)
    export_hf(ckpt, work / "hf")
    include = harness_copy(TASK_FILES, work / "harness_tasks")

    ours_s, theirs_s, ll_diff, metric_diff = [], [], 0.0, 0.0
    for _ in range(repeats):
        ours = in_process(run_ours, str(ckpt))
        theirs = in_process(run_harness, str(work / "hf"), str(include))
        ours_s.append(ours["seconds"])
        theirs_s.append(theirs["seconds"])
        for n, docs in ours["lls"].items():
            ll_diff = max(ll_diff, max(abs(a - b) for d, e in zip(docs, theirs["lls"][n]) for a, b in zip(d, e)))
        for n, m in ours["metrics"].items():
            metric_diff = max(metric_diff, max(abs(v - theirs["metrics"][n][k]) for k, v in m.items()))
    comparison = {
        "lmfoundry_s": statistics.median(ours_s),
        "harness_s": statistics.median(theirs_s),
        "speedup": statistics.median(theirs_s) / statistics.median(ours_s),
        "repeats": repeats,
        "max_loglikelihood_diff": ll_diff,
        "max_metric_diff": metric_diff,
        "metrics": ours["metrics"],
    }

    model = CheckpointModel(str(ckpt))
    suites = {}
    started = time.perf_counter()
    hhh = run_hhh(model, HHHConfig())
    suites["helpful/harmless/honest (130 prompts, 48 tokens each)"] = time.perf_counter() - started
    lengths = [128, 512, 1000] if args.quick else [128, 256, 512, 768, 1000]
    started = time.perf_counter()
    needle = run_needle(model, NeedleConfig(lengths=lengths, depths=[0, 0.25, 0.5, 0.75, 1.0], trials=2))
    suites[f"needle, loglikelihood, {len(lengths)} lengths x 5 depths x 2"] = time.perf_counter() - started
    started = time.perf_counter()
    red = run_redteam(model, RedTeamConfig(attacks_per_family=8, seed=0))
    suites["red team, 80 attacks (10 families), 64 tokens"] = time.perf_counter() - started

    print(f"\nlm-evaluation-harness agreement and speed, 3 shipped tasks, median of {repeats}:")
    print(f"{'system':<28}{'seconds':>10}")
    print(f"{'lmfoundry':<28}{comparison['lmfoundry_s']:>10.2f}")
    print(f"{'lm-evaluation-harness 0.4.13':<28}{comparison['harness_s']:>10.2f}")
    print(
        f"speedup {comparison['speedup']:.2f}x; largest log-likelihood difference {ll_diff:.2e}; "
        f"largest metric difference {metric_diff:.2e}"
    )
    print(f"\n{'suite':<58}{'seconds':>10}")
    for name, seconds in suites.items():
        print(f"{name:<58}{seconds:>10.2f}")
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "evaluation.json").write_text(
        json.dumps(
            {
                "machine": f"{os.cpu_count()} CPU cores, no GPU",
                "model": "Llama-shaped, 8 layers, d_model 384, random weights",
                "harness_comparison": comparison,
                "suite_seconds": suites,
                "needle_effective_context_length": needle["effective_context_length"],
                "red_team_attack_success_rate": red["attack_success_rate"]["rate"],
                "hhh_refusal_rate": hhh["harmless"]["refusal_rate"]["rate"],
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
