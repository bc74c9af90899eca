"""GRPO from verifiable rewards on a policy lmfoundry trained, and GRPO iterations per hour
against TRL's GRPOTrainer on the same model, data and reward.

    python benchmarks/test_time_compute.py --workdir work/ttc     # trains the starting policy
    python benchmarks/test_time_compute.py --workdir work/ttc --write-held-out 200
    python benchmarks/grpo.py --start work/ttc/model --held-out work/ttc/held_out_200.jsonl --held-out-limit 100

1. The start is the small decoder benchmarks/test_time_compute.py trains on synthetic solutions
   in steps (a supervised start: every document is a question and its worked solution).
2. `lmfoundry rl` (jobs/rl.py) runs GRPO on new arithmetic and algebra problems (none of the
   held-out questions): G solutions per problem, reward 1 when the verifier accepts the final
   answer, 2 DeepSpeed learners on Ray Train, each sampling its own rollouts (colocated). It
   measures held-out greedy accuracy before and after; each kept checkpoint is scored on the
   held-out split too, for the curve.
3. The same start, exported to Hugging Face (lmfoundry export), trains under TRL's GRPOTrainer
   with the same problems, group size, completion length, temperature, KL weight, learning
   rate, problems per step and reward function, for a few steps: iterations per hour side by side.

Rollout tokens/s: solution tokens sampled per second of rollout, all learners together; learner
tokens/s: prompt and solution tokens run forward and backward per second of the rest of the step.
Prints a table; writes benchmarks/results/grpo.json and grpo.png (reward, training and held-out
accuracy against steps).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from test_time_compute import SOLUTION_TOKENS  # noqa: E402

RESULTS = Path(__file__).resolve().parent / "results"
GROUP, BETA = 8, 0.04
MAX_TOKENS = SOLUTION_TOKENS  # the start's tokenizer writes an expansion in ~100 tokens
WORKERS, PER_WORKER, PER_STEP = 2, 4, 8  # problems: per learner micro-batch, per optimizer step


def problems(path: Path, n: int, avoid: set[str], seed: int) -> None:
    """n arithmetic and algebra problems (synth's generators) whose questions are not in `avoid`."""
    from lmfoundry.align.synth import gen_algebra, gen_arithmetic

    rng, rows, seen = random.Random(seed), [], set(avoid)
    while len(rows) < n:
        s = (gen_arithmetic if len(rows) % 2 else gen_algebra)(rng)
        if s["question"] not in seen:
            seen.add(s["question"])
            rows.append(s)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))


def held_out_curve(run: Path, held_out: str, limit: int) -> list[dict]:
    """Greedy verified accuracy on the held-out split of every checkpoint the run kept."""
    import torch

    from lmfoundry.clients.checkpoint import CheckpointModel
    from lmfoundry.eval.reasoning import ReasoningConfig, run_reasoning

    torch.set_num_threads(1)  # as test_time_compute.py: one thread decodes faster on a shared machine
    suite = ReasoningConfig(problems=held_out, limit=limit, strategies=["greedy"], max_tokens=MAX_TOKENS)
    points = []
    for ckpt in sorted((run / "checkpoints").glob("step-*")):
        accuracy = run_reasoning(CheckpointModel(str(ckpt)), suite)["strategies"]["greedy"]["1"]["accuracy"]
        points.append({"step": int(ckpt.name.split("-")[1]), "accuracy": accuracy})
    return points


def run_ours(
    start: str, train: Path, held_out: str, out: Path, steps: int, lr: float, limit: int, temperature: float
) -> dict:
    from lmfoundry.jobs.rl import RLJobConfig, run_rl
    from lmfoundry.platform.config import StageFailed

    cfg = RLJobConfig(
        checkpoint=start,
        output=str(out),
        problems=str(train),
        held_out=held_out,
        held_out_limit=limit,
        group_size=GROUP,
        max_tokens=MAX_TOKENS,
        temperature=temperature,
        beta=BETA,
        parallelism={"num_workers": WORKERS, "cpus_per_worker": 1, "zero_stage": 2},
        batch={"micro_batch_size": PER_WORKER, "global_batch_size": PER_STEP},
        schedule={"max_steps": steps, "warmup_steps": min(2, steps - 1)},
        optimizer={"lr": lr},
        checkpointing={"every": max(1, steps // 5), "keep_last": 2, "keep_every": max(1, steps // 5)},
        logging={"every": 1},
    )
    started = time.perf_counter()
    try:
        result = run_rl(cfg)
    except StageFailed as e:  # held-out accuracy fell: the gate failed, and the figure records it
        print(f"rl: {e}")
        result = {"verdict": json.loads((out / "verdict.json").read_text())}
    seconds = time.perf_counter() - started
    state = json.loads(sorted((out / "checkpoints").glob("step-*"))[-1].joinpath("train_state.json").read_text())
    return {"result": result, "history": state["history"], "seconds": seconds}


def throughput(history: list[dict]) -> dict:
    """Medians over the steps after the first: rollout and learner tokens/s, all learners together."""
    rows = history[1:] or history
    accumulation = PER_STEP // (PER_WORKER * WORKERS)
    rollout = [WORKERS * h["rollout_tokens"] / h["rollout_s"] for h in rows]
    learner = [
        WORKERS * h["learner_tokens"] / max(1e-9, h["step_time_s"] / accumulation - h["rollout_s"]) for h in rows
    ]
    return {
        "step_seconds_median": statistics.median(h["step_time_s"] for h in rows),
        "iterations_per_hour": 3600 / statistics.median(h["step_time_s"] for h in rows),
        "rollout_tokens_per_s_median": statistics.median(rollout),
        "learner_tokens_per_s_median": statistics.median(learner),
        "rollout_share_of_step": statistics.median(accumulation * h["rollout_s"] / h["step_time_s"] for h in rows),
    }


def run_trl(start: str, train: Path, work: Path, steps: int, lr: float, threads: int, temperature: float) -> dict:
    """TRL's GRPOTrainer on the exported start, on `threads` torch threads: median seconds per
    optimizer step after the first."""
    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from lmfoundry.model.export import export_hf
    from lmfoundry.platform import checkpoint
    from lmfoundry.reasoning import verifiers

    hf = work / "hf"
    if not (hf / "config.json").exists():
        export_hf(checkpoint.resolve(start), str(hf))
    rows = [json.loads(line) for line in train.read_text().splitlines()]
    data = Dataset.from_list([{"prompt": r["question"] + "\n", "problem": json.dumps(r)} for r in rows])

    def verified(completions, problem, **_) -> list[float]:  # the reward lmfoundry's GRPO gives
        out = []
        for text, p in zip(completions, problem):
            answer = verifiers.answer_of(text)
            out.append(float(answer is not None and verifiers.verify({**json.loads(p), "answer": answer}) is None))
        return out

    class Steps(TrainerCallback):
        def __init__(self):
            self.times, self.t = [], None

        def on_step_begin(self, args, state, control, **kw):
            self.t = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            self.times.append(time.perf_counter() - self.t)

    torch.set_num_threads(threads)
    timer = Steps()
    args = GRPOConfig(
        output_dir=str(work / "trl"),
        num_generations=GROUP,
        max_completion_length=MAX_TOKENS,
        temperature=temperature,
        beta=BETA,
        learning_rate=lr,
        lr_scheduler_type="cosine",
        warmup_steps=2,
        per_device_train_batch_size=PER_WORKER * GROUP,  # completions
        gradient_accumulation_steps=PER_STEP // PER_WORKER,
        max_steps=steps,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=str(hf),
        reward_funcs=verified,
        args=args,
        train_dataset=data,
        processing_class=AutoTokenizer.from_pretrained(str(hf)),
        callbacks=[timer],
    )
    trainer.train()
    logged = [h for h in trainer.state.log_history if "reward" in h]
    later = timer.times[1:] or timer.times
    return {
        "torch_threads": threads,
        "steps": len(timer.times),
        "step_seconds_median": statistics.median(later),
        "iterations_per_hour": 3600 / statistics.median(later),
        "reward": [h["reward"] for h in logged],
    }


def plot(history: list[dict], curve: list[dict], before: float, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    steps = [h["step"] for h in history]
    ax.plot(steps, [h["reward"] for h in history], alpha=0.5, label="reward (training rollouts)")
    window = 5
    smooth = [
        statistics.fmean(h["reward"] for h in history[max(0, i - window + 1) : i + 1]) for i in range(len(history))
    ]
    ax.plot(steps, smooth, label=f"reward, mean of {window} steps")
    ax.plot([0, *[p["step"] for p in curve]], [before, *[p["accuracy"] for p in curve]], marker="o",
            label="held-out greedy accuracy")  # fmt: skip
    ax.set_xlabel("GRPO step")
    ax.set_ylabel("reward / verified accuracy")
    ax.legend()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--start", required=True, help="the starting policy (test_time_compute.py's model)")
    p.add_argument("--held-out", required=True, help="held-out problems (test_time_compute.py's held_out.jsonl)")
    p.add_argument("--held-out-limit", type=int, default=50)
    p.add_argument("--problems", type=int, default=2000, help="training problems")
    p.add_argument("--steps", type=int, default=60, help="GRPO steps")
    p.add_argument("--trl-steps", type=int, default=6, help="GRPOTrainer steps, for its step time")
    p.add_argument("--lr", type=float, default=1e-4)
    p.add_argument("--temperature", type=float, default=1.0, help="of the rollouts (and of TRL's)")
    p.add_argument("--workdir", required=True)
    p.add_argument("--results-name", default="grpo", help="benchmarks/results/NAME.json and NAME.png")
    args = p.parse_args()

    import torch
    from lifecycle import machine, recorded_command

    from lmfoundry.platform.ray_env import init_ray

    work = Path(args.workdir)
    work.mkdir(parents=True, exist_ok=True)
    held = {json.loads(line)["question"] for line in Path(args.held_out).read_text().splitlines()}
    train = work / "problems.jsonl"
    problems(train, args.problems, held, seed=2)
    load_before = os.getloadavg()
    torch.set_num_threads(1)  # the held-out evaluations in this process (the learners are Ray's, on 1 each)
    init_ray()
    ours = run_ours(
        args.start, train, args.held_out, work / "rl", args.steps, args.lr, args.held_out_limit, args.temperature
    )
    verdict = ours["result"]["verdict"]
    curve = held_out_curve(work / "rl", args.held_out, args.held_out_limit)
    ours_speed = throughput(ours["history"])
    load_mid = os.getloadavg()
    # TRL runs in one process: on 2 threads (the cores lmfoundry's two learners use) and on 1
    # (faster on an oversubscribed machine); the faster of the two is compared
    runs = (
        [run_trl(args.start, train, work, args.trl_steps, args.lr, t, args.temperature) for t in (2, 1)]
        if args.trl_steps
        else []
    )
    trl = min(runs, key=lambda r: r["step_seconds_median"]) if runs else None
    load_after = os.getloadavg()

    before, after = verdict["held_out_accuracy"]["before"], verdict["held_out_accuracy"]["after"]
    print(f"\nheld-out greedy accuracy: {before:.3f} -> {after:.3f} ({100 * (after - before):+.1f} points) "
          f"in {ours['seconds'] / 60:.1f} min, {len(ours['history'])} steps")  # fmt: skip
    print(f"{'trainer':<22} {'s/step':>8} {'iterations/hour':>16}")
    print(f"{'lmfoundry rl':<22} {ours_speed['step_seconds_median']:>8.1f} {ours_speed['iterations_per_hour']:>16.0f}")
    if trl:
        print(f"{'TRL GRPOTrainer':<22} {trl['step_seconds_median']:>8.1f} {trl['iterations_per_hour']:>16.0f}")
        print(f"ratio lmfoundry / TRL: {ours_speed['iterations_per_hour'] / trl['iterations_per_hour']:.2f}x")
    print(f"rollout tokens/s {ours_speed['rollout_tokens_per_s_median']:.0f}, "
          f"learner tokens/s {ours_speed['learner_tokens_per_s_median']:.0f}")  # fmt: skip
    history = ours["history"]
    out = {
        "benchmark": "grpo",
        "date": time.strftime("%Y-%m-%d"),
        "command": recorded_command("benchmarks/grpo.py"),
        "machine": machine(),
        "shared_machine_load_average_1min": {
            "before": round(load_before[0], 1),
            "after_grpo": round(load_mid[0], 1),
            "after_trl": round(load_after[0], 1),
        },
        "setup": {
            "training_problems": args.problems,
            "held_out_problems": args.held_out_limit,
            "group_size": GROUP,
            "max_tokens": MAX_TOKENS,
            "temperature": args.temperature,
            "beta": BETA,
            "lr": args.lr,
            "problems_per_step": PER_STEP,
            "learners": WORKERS,
        },
        "lmfoundry": {
            "steps": len(history),
            "minutes": round(ours["seconds"] / 60, 1),
            "held_out_accuracy_before": before,
            "held_out_accuracy_after": after,
            "held_out_gain_points": round(100 * (after - before), 1),
            "held_out_curve": curve,
            "reward_first_5": statistics.fmean(h["reward"] for h in history[:5]),
            "reward_last_5": statistics.fmean(h["reward"] for h in history[-5:]),
            "response_length_first_last": [history[0]["response_length"], history[-1]["response_length"]],
            "kl_last": history[-1]["kl"],
            **ours_speed,
        },
        "trl_grpo_trainer": trl,
        "trl_grpo_trainer_runs": runs,
        "iterations_per_hour_ratio": (ours_speed["iterations_per_hour"] / trl["iterations_per_hour"]) if trl else None,
        "reward_per_step": [round(h["reward"], 4) for h in history],
    }
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / f"{args.results_name}.json").write_text(json.dumps(out, indent=2) + "\n")
    plot(history, curve, before, RESULTS / f"{args.results_name}.png")
    print(f"wrote {RESULTS / args.results_name}.json")


if __name__ == "__main__":
    main()
