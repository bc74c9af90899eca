"""Alignment data and DPO: what each piece costs and what DPO achieves on its training pairs.

    python benchmarks/alignment.py            # about 5 minutes on 2 CPU cores
    python benchmarks/alignment.py --quick    # fewer prompts, pairs and steps

The model is Llama-shaped, 8 layers, d_model 384, a 8,192 BPE vocabulary trained here on
standard-library docstrings, a 256-token context, random weights (benchmarks/serving.py builds
it). Parts, one run each:
- the sandbox: wall time of a trivial script, median of 20 (process start, limits, namespace);
- verified synthetic data: arithmetic, algebra and code samples generated and verified;
- the review queue: add, claim and decide 300 items on SQLite and on PostgreSQL (when the
  machine has PostgreSQL: a throwaway server is started for it);
- preference pairs: prompts through the Ray Data pipeline, the same checkpoint as student (4
  sampled replies) and as teacher judge (2 scorings each, then both orders);
- DPO on 2 CPU workers (gloo, ZeRO-2): preference accuracy on the training pairs before and after.
Prints a table; writes benchmarks/results/alignment.json.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

RESULTS = Path(__file__).resolve().parent / "results"
TOPICS = [
    "apples",
    "rivers",
    "gardens",
    "windows",
    "markets",
    "pencils",
    "castles",
    "forests",
    "bridges",
    "candles",
    "rockets",
    "planets",
    "ladders",
    "mirrors",
    "pockets",
    "winters",
    "islands",
    "engines",
    "letters",
    "kettles",
    "violins",
    "harbours",
    "meadows",
    "lanterns",
    "tunnels",
    "orchards",
    "glaciers",
    "bakeries",
    "museums",
    "stations",
    "compasses",
    "telescopes",
]


def bench_sandbox() -> dict:
    from lmfoundry.safety.sandbox import run_python

    times = [run_python("print(1)").seconds for _ in range(20)]
    return {"median_s": statistics.median(times), "isolation": run_python("pass").network_isolation}


def bench_synth(work: Path, n: int) -> dict:
    from lmfoundry.align.synth import SynthConfig, run_synth

    started = time.perf_counter()
    card = run_synth(SynthConfig(output=str(work / "synth"), kinds={"arithmetic": n, "algebra": n, "code": 6}))
    return {**card, "seconds": time.perf_counter() - started}


def start_postgres(root: Path):
    initdb, pg_ctl = shutil.which("initdb"), shutil.which("pg_ctl")
    if not initdb or not pg_ctl:
        return None, None
    run_as = []
    if os.geteuid() == 0:
        import pwd

        user = pwd.getpwnam("postgres")
        os.chown(root, user.pw_uid, user.pw_gid)
        run_as = ["runuser", "-u", "postgres", "--"]
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    data = root / "data"
    subprocess.run(
        [*run_as, initdb, "-D", str(data), "-U", "lmfoundry", "--auth=trust"], check=True, capture_output=True
    )
    subprocess.run(
        [
            *run_as,
            pg_ctl,
            "-D",
            str(data),
            "-l",
            str(root / "log"),
            "-w",
            "-o",
            f"-p {port} -k {root} -c listen_addresses=127.0.0.1",
            "start",
        ],
        check=True,
        capture_output=True,
    )
    return f"postgresql://lmfoundry@127.0.0.1:{port}/postgres", lambda: subprocess.run(
        [*run_as, pg_ctl, "-D", str(data), "-m", "immediate", "stop"], capture_output=True
    )


def bench_queue(dsn: str, n: int = 300) -> dict:
    from lmfoundry.align.review import ReviewStore

    store = ReviewStore(dsn)
    started = time.perf_counter()
    for i in range(n):
        store.add(f"review-{i}", "review", "low confidence", {"id": str(i), "chosen": "a", "rejected": "b"})
    added = time.perf_counter()
    for i in range(n):
        store.claim(f"review-{i}", "ana")
        store.decide(f"review-{i}", "ana", "a")
    done = time.perf_counter()
    store.close()
    return {"items": n, "add_per_s": n / (added - started), "claim_and_decide_per_s": n / (done - added)}


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    n_prompts, n_pairs, steps = (8, 16, 8) if args.quick else (24, 32, 24)

    from serving import build_checkpoint

    from lmfoundry.align.pairs import PairsConfig, run_pairs
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.train.dpo import DPOConfig, run_dpo

    work = Path(tempfile.mkdtemp(prefix="lmfoundry-bench-align-"))
    ckpt = work / "ckpt"
    build_checkpoint(ckpt, vocab=8192, context=256)
    results: dict = {
        "machine": f"{os.cpu_count()} CPU cores, no GPU",
        "model": "Llama-shaped, 8 layers, d_model 384, 256-token context, random weights",
    }
    results["sandbox"] = bench_sandbox()
    results["synth"] = bench_synth(work, 100 if not args.quick else 20)
    results["queue"] = {"sqlite": bench_queue(str(work / "q.sqlite"))}
    pg_root = Path(tempfile.mkdtemp(prefix="lmfoundry-pg-"))
    dsn, stop = start_postgres(pg_root)
    if dsn:
        try:
            results["queue"]["postgresql"] = bench_queue(dsn)
        finally:
            stop()

    init_ray()
    prompts = work / "prompts.jsonl"
    prompts.write_text(
        "".join(
            json.dumps({"id": f"p{i}", "prompt": f"Tell me about {t}."}) + "\n"
            for i, t in enumerate(TOPICS[:n_prompts])
        )
    )
    started = time.perf_counter()
    card = run_pairs(
        PairsConfig(
            prompts=str(prompts),
            output=str(work / "pairs"),
            student={"checkpoint": str(ckpt)},
            judge={"checkpoint": str(ckpt)},
            candidates=4,
            judgments=2,
            max_tokens=24,
            min_margin=0.05,
        )
    )
    seconds = time.perf_counter() - started
    results["pairs"] = {
        "prompts": n_prompts,
        "seconds": seconds,
        "prompts_per_s": n_prompts / seconds,
        "accepted": card["accepted"],
        "to_review": card["queued_for_review"],
        "rejected": card["rejected_by_reason"],
    }

    pairs = work / "dpo_pairs.jsonl"
    pairs.write_text(
        "".join(
            json.dumps(
                {
                    "prompt": f"Tell me about {t}.",
                    "chosen": f"{t.capitalize()} are useful.",
                    "rejected": f"I hate {t}. Kill all the {t} now!",
                }
            )
            + "\n"
            for t in TOPICS[:n_pairs]
        )
    )
    started = time.perf_counter()
    manifest = run_dpo(
        DPOConfig(
            checkpoint=str(ckpt),
            pairs=str(pairs),
            output=str(work / "dpo"),
            beta=0.1,
            optimizer={"lr": 1e-3},
            schedule={"warmup_steps": 2, "max_steps": steps},
            batch={"micro_batch_size": 2, "global_batch_pairs": 8},
            parallelism={"num_workers": 2, "cpus_per_worker": 0.5},
            checkpointing={"every": steps},
            logging={"every": 4},
        )
    )
    seconds = time.perf_counter() - started
    results["dpo"] = {
        "pairs": n_pairs,
        "steps": steps,
        "seconds": seconds,
        "preference_accuracy": manifest["preference_accuracy"],
        "first_loss": manifest["first_loss"],
        "final_loss": manifest["final_loss"],
    }

    print(f"\n{'part':<44}{'figure':>36}")
    print(
        f"{'sandbox, trivial script (median of 20)':<44}{results['sandbox']['median_s'] * 1000:>30.0f} ms  "
        f"({results['sandbox']['isolation']})"
    )
    s = results["synth"]
    print(f"{'synthetic data, generated -> kept':<44}{s['samples']:>20} -> {s['kept']:<5} in {s['seconds']:.2f} s")
    for name, q in results["queue"].items():
        print(
            f"{'review queue, ' + name + ' (add; claim+decide /s)':<44}{q['add_per_s']:>20.0f}; "
            f"{q['claim_and_decide_per_s']:.0f}"
        )
    p = results["pairs"]
    print(
        f"{'preference pairs (prompts/s; accepted)':<44}{p['prompts_per_s']:>20.2f}; {p['accepted']} of "
        f"{p['prompts']}, {p['to_review']} to review"
    )
    d = results["dpo"]
    print(
        f"{'DPO, preference accuracy before -> after':<44}{d['preference_accuracy']['before']:>20.3f} -> "
        f"{d['preference_accuracy']['after']:.3f} ({d['steps']} steps, {d['seconds']:.1f} s, loss "
        f"{d['first_loss']:.3f} -> {d['final_loss']:.3f})"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "alignment.json").write_text(json.dumps(results, indent=2, default=str))
    shutil.rmtree(pg_root, ignore_errors=True)


if __name__ == "__main__":
    main()
