"""Test-time compute on a model lmfoundry trains here: accuracy on held-out arithmetic and algebra
at 1, 4, 16 and 64 samples for greedy decoding, majority voting, best-of-N and step-level beam
search.

    python benchmarks/test_time_compute.py                 # about 20 minutes on 2 CPU cores
    python benchmarks/test_time_compute.py --steps 200 --problems 20 --samples 1,4   # a smoke run

1. `synth`'s generators write the training corpus: questions with their solutions in steps
   ("Compute (12 + 5) * 3." / "12 + 5 = 17" / "17 * 3 = 51" / "Answer: 51"), one document each;
2. `pack` trains a small BPE tokenizer on it (digits and spaces are tokens of their own:
   `copyable_tokens`) and packs it; `pretrain` trains a 4-layer decoder on 2 CPU workers
   (DeepSpeed ZeRO-2);
3. held-out problems come from another seed, with every question seen in training removed;
4. the reasoning suite (eval/reasoning.py) answers each at each sample count. The scorer of
   best-of-N and the step scorer of beam search is the verifier (an oracle: the upper bound of a
   learned reward model on the same samples).
Prints a table; writes benchmarks/results/test_time_compute.json and test_time_compute.png.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
# the longest solution, an expansion, is ~100 tokens: digits are tokens of their own (pack's
# copyable_tokens), which the model needs to copy and combine numbers, and spaces too
SOLUTION_TOKENS = 112


def corpus(path: Path, n: int, seed: int) -> set[str]:
    """n solved problems as a folder of Parquet (id, text); the set of their questions."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lmfoundry.align.synth import gen_algebra, gen_arithmetic

    rng = random.Random(seed)
    samples = [(gen_arithmetic if i % 2 else gen_algebra)(rng) for i in range(n)]
    if path.exists():  # a kept workdir: the same seed wrote the same corpus
        return {s["question"] for s in samples}
    path.mkdir(parents=True)
    texts = [f"{s['question']}\n{s['solution']}" for s in samples]
    pq.write_table(pa.table({"id": [f"p{i:07d}" for i in range(n)], "text": texts}), path / "part-00000.parquet")
    return {s["question"] for s in samples}


def held_out(path: Path, n: int, seen: set[str], seed: int) -> int:
    from lmfoundry.align.synth import gen_algebra, gen_arithmetic

    rng = random.Random(seed)
    rows = []
    while len(rows) < n:
        s = (gen_arithmetic if len(rows) % 2 else gen_algebra)(rng)
        if s["question"] not in seen and all(r["question"] != s["question"] for r in rows):
            rows.append(s)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return len(rows)


def reward_models(work: Path, policy: str, avoid: set[str], problems: int, steps: int) -> tuple[str, str, dict]:
    """An outcome reward model trained on the policy's own solutions to training problems, each
    labelled by the verifier (pointwise), and a process reward model on step labels made from the
    policy's completions (Math-Shepherd); both start from the policy. Their URIs and manifests."""
    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.jobs.reward import RewardJobConfig, run_reward_job
    from lmfoundry.platform import checkpoint
    from lmfoundry.reasoning import verifiers

    train = work / "reward_problems.jsonl"
    held_out(train, problems, avoid, seed=3)
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    data = work / "orm_rows.jsonl"
    if not data.exists():
        model = CheckpointModel(checkpoint.resolve(policy))
        labelled = []
        for i, problem in enumerate(rows):
            prompt = problem["question"] + verifiers.STEP_DELIMITER
            for text, _ in model.continuations(prompt, 4, SOLUTION_TOKENS, 0.8, 1000 * i):
                answer = verifiers.answer_of(text)
                right = answer is not None and verifiers.verify({**problem, "answer": answer}) is None
                labelled.append({"prompt": prompt, "reply": text, "label": float(right)})
        data.write_text("".join(json.dumps(r) + "\n" for r in labelled))
    common = dict(
        checkpoint=policy,
        parallelism={"num_workers": 2, "cpus_per_worker": 1, "zero_stage": 2},
        batch={"micro_batch_size": 8, "global_batch_size": 32},
        schedule={"max_steps": steps, "warmup_steps": max(1, steps // 10)},
        optimizer={"lr": 3e-4},
        checkpointing={"every": steps},
    )
    orm = run_reward_job(RewardJobConfig(output=str(work / "orm"), data=str(data), **common))
    prm = run_reward_job(
        RewardJobConfig(
            output=str(work / "prm"),
            step_labels={
                "problems": str(train),
                "limit": problems // 2,
                "solutions": 2,
                "completions": 4,
                "max_tokens": SOLUTION_TOKENS,
                "threshold": 0.25,
            },  # fmt: skip
            **common,
        )
    )
    return str(work / "orm"), str(work / "prm"), {"outcome": orm, "process": prm}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--documents", type=int, default=40_000, help="solved problems to train on")
    p.add_argument("--steps", type=int, default=1500, help="pretraining steps")
    p.add_argument("--problems", type=int, default=100, help="held-out problems")
    p.add_argument("--samples", default="1,4,16,64")
    p.add_argument("--strategies", default="greedy,majority_vote,best_of_n,step_beam_search")
    p.add_argument("--more-steps", type=int, default=0, help="then continue pretraining for this many steps")
    p.add_argument("--workdir", default=None, help="keep the corpus, model and report here")
    p.add_argument(
        "--learned-scorers",
        type=int,
        default=0,
        metavar="PROBLEMS",
        help="also train an outcome and a process reward model on this many training problems and run "
        "best-of-N and beam search with them; adds to an existing results file of the same workdir",
    )
    p.add_argument(
        "--write-held-out",
        type=int,
        default=0,
        metavar="N",
        help="only write N held-out problems to WORKDIR/held_out_N.jsonl (the first --problems of them are the "
        "suite's) and stop: a larger held-out split for benchmarks/grpo.py",
    )
    args = p.parse_args()
    if args.write_held_out:
        work = Path(args.workdir or ".")
        path = work / f"held_out_{args.write_held_out}.jsonl"
        held_out(path, args.write_held_out, corpus(work / "docs", args.documents, seed=0), seed=1)
        print(f"wrote {path}")
        return

    import torch
    from lifecycle import machine, recorded_command

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.data.pack import PackConfig, run_pack
    from lmfoundry.eval.reasoning import ReasoningConfig, plot, run_reasoning
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.platform import checkpoint, storage
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    work = Path(args.workdir or tempfile.mkdtemp(prefix="lmf-ttc-"))
    trained = storage.is_committed(str(work / "model"))
    if not trained or args.learned_scorers:  # a kept workdir's model needs no Ray to evaluate
        init_ray()
    started = time.perf_counter()
    seen = corpus(work / "docs", args.documents, seed=0)
    if not trained:
        run_pack(
            PackConfig(
                input=str(work / "docs"), output=str(work / "packed"), vocab_size=512, seq_len=128, copyable_tokens=True
            )
        )
    manifest = (
        storage.read_manifest(str(work / "model"))
        if trained
        else run_pretrain(
            PretrainConfig(
                data=str(work / "packed"),
                output=str(work / "model"),
                model=ModelConfig(n_layer=4, d_model=192, n_head=6, n_kv_head=2),
                parallelism={"num_workers": 2, "zero_stage": 2},
                batch={"micro_batch_size": 16, "global_batch_tokens": 2 * 16 * 128},
                schedule={"max_steps": args.steps, "warmup_steps": max(1, args.steps // 20)},
                optimizer={"lr": 3e-3},
                checkpointing={"every": args.steps},
                logging={"every": max(1, args.steps // 10)},
            )
        )
    )
    policy = work / "model"
    continued = None
    if args.more_steps:  # continued pretraining of the same model on the same corpus, larger batches
        policy = work / "model_more"
        if not storage.is_committed(str(policy)):
            init_ray()
        continued = storage.read_manifest(str(policy)) if storage.is_committed(str(policy)) else run_pretrain(
            PretrainConfig(
                data=str(work / "packed"),
                init_from=str(work / "model"),
                output=str(policy),
                parallelism={"num_workers": 2, "zero_stage": 2},
                batch={"micro_batch_size": 32, "global_batch_tokens": 2 * 32 * 128},
                schedule={"max_steps": args.more_steps, "warmup_steps": max(1, args.more_steps // 20)},
                optimizer={"lr": 2e-3},
                checkpointing={"every": args.more_steps},
                logging={"every": max(1, args.more_steps // 10)},
            )
        )  # fmt: skip
    problems = held_out(work / "held_out.jsonl", args.problems, seen, seed=1)
    cfg = ReasoningConfig(
        problems=str(work / "held_out.jsonl"),
        limit=problems,
        strategies=args.strategies.split(","),
        samples=[int(n) for n in args.samples.split(",")],
        max_tokens=SOLUTION_TOKENS,
        max_steps=6,
    )
    # one thread: on a shared, oversubscribed machine two threads decode this small model several
    # times slower than one (each waits for the other at every matmul)
    torch.set_num_threads(1)
    model = CheckpointModel(checkpoint.resolve(str(policy)))
    if args.learned_scorers:
        learned(args, work, policy, cfg, model, seen)
        return
    load_at_start = os.getloadavg()[0]
    started = time.perf_counter()
    result = run_reasoning(model, cfg)
    eval_seconds = time.perf_counter() - started

    print(f"\n{'strategy':<18} {'N':>4} {'accuracy':>9} {'tokens/problem':>15}")
    for strategy, rows in result["strategies"].items():
        for n, row in rows.items():
            print(f"{strategy:<18} {n:>4} {row['accuracy']:>9.2f} {row['tokens_per_problem']:>15.1f}")
    greedy = result["strategies"].get("greedy", {}).get("1", {}).get("accuracy")
    at16 = {s: rows["16"]["accuracy"] for s, rows in result["strategies"].items() if "16" in rows}
    best = max(at16.items(), key=lambda kv: kv[1]) if at16 else None
    if greedy is not None and best:
        print(f"best at 16 samples: {best[0]} {best[1]:.2f} against greedy {greedy:.2f}: "
              f"{100 * (best[1] - greedy):+.0f} points")  # fmt: skip
    RESULTS.mkdir(exist_ok=True)
    out = {
        "benchmark": "test_time_compute",
        "date": time.strftime("%Y-%m-%d"),
        "command": recorded_command("benchmarks/test_time_compute.py"),
        "machine": machine(),
        "load_average_1min_at_eval_start": round(load_at_start, 1),  # the machine may be shared
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        "training": {
            "documents": args.documents,
            "steps": args.steps,
            "final_loss": manifest["final_loss"],
            "model": manifest["model"],
            "seconds": manifest["seconds"],  # of the pretraining run, also when a kept workdir skipped it
            "tokens_seen": manifest["tokens_seen"],
            "continued": None
            if continued is None
            else {k: continued[k] for k in ("steps", "first_loss", "final_loss", "seconds", "tokens_seen")},
        },
        "held_out_problems": problems,
        "eval_seconds": round(eval_seconds, 1),
        "result": result,
        "best_at_16": {"strategy": best[0], "accuracy": best[1]} if best else None,
        "greedy_accuracy": greedy,
    }
    (RESULTS / "test_time_compute.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(result, str(RESULTS / "test_time_compute.png"))
    print(f"wrote {RESULTS / 'test_time_compute.json'}")


def learned(args, work: Path, policy: Path, cfg, model, seen: set[str]) -> None:
    """best_of_n with the outcome reward model and step_beam_search with the process reward model,
    added to the results file of an earlier run on the same workdir."""
    from lifecycle import recorded_command

    from lmfoundry.eval.reasoning import plot, run_reasoning

    held = {json.loads(line)["question"] for line in (work / "held_out.jsonl").read_text().splitlines()}
    started = time.perf_counter()
    orm, prm, manifests = reward_models(work, str(policy), seen | held, args.learned_scorers, 60)
    train_seconds = time.perf_counter() - started
    cfg = cfg.model_copy(update={"strategies": ["best_of_n", "step_beam_search"], "scorer": orm, "step_scorer": prm})
    started = time.perf_counter()
    result = run_reasoning(model, cfg)
    path = RESULTS / "test_time_compute.json"
    out = json.loads(path.read_text())
    out["learned_scorers"] = {
        "command": recorded_command("benchmarks/test_time_compute.py"),
        "load_average_1min_at_end": round(os.getloadavg()[0], 1),
        "reward_model_training_seconds": round(train_seconds, 1),
        "eval_seconds": round(time.perf_counter() - started, 1),
        "outcome_model": {
            k: manifests["outcome"].get(k)
            for k in ("examples", "first_loss", "final_loss", "held_out_accuracy", "steps")
        },
        "process_model": {
            k: manifests["process"].get(k)
            for k in ("examples", "first_loss", "final_loss", "held_out_accuracy", "steps", "step_labels")
        },
        "strategies": {
            "best_of_n (outcome RM)": result["strategies"]["best_of_n"],
            "step_beam_search (process RM)": result["strategies"]["step_beam_search"],
        },
    }
    for name, rows in out["learned_scorers"]["strategies"].items():
        for n, row in rows.items():
            print(f"{name:<32} {n:>4} {row['accuracy']:>9.2f} {row['tokens_per_problem']:>15.1f}")
    path.write_text(json.dumps(out, indent=2) + "\n")
    both = {
        "problems": out["result"]["problems"],
        "strategies": {**out["result"]["strategies"], **out["learned_scorers"]["strategies"]},
    }
    plot(both, str(RESULTS / "test_time_compute.png"))
    print(f"wrote {path}")


if __name__ == "__main__":
    main()
