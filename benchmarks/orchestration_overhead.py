"""Orchestration overhead: the Ray Train + DeepSpeed training loop against plain PyTorch DDP on
the same cores, world size, model and global batch, and against one process using all cores.

  PyTorch DDP, 2 processes   torch.nn.parallel.DistributedDataParallel over gloo, AdamW, one
                             thread each, batches already in memory: the floor of overhead
  the same DDP, with lmfoundry's allocator settings
                             the glibc malloc settings lmfoundry gives its CPU training workers
                             (platform/ray_env.py: CPU_ALLOCATOR_ENV): what is left between the
                             two is orchestration proper
  one process, 2 threads     no communication at all, the whole batch in one forward pass
  lmfoundry pretrain         Ray Train TorchTrainer, 2 workers, DeepSpeed, each worker reading
                             its row groups of the packed shards (train/shards.py), metrics,
                             checkpoints; a row per ZeRO stage (--zero-stages): ZeRO-0 is the
                             same algorithm as DDP (replicated optimizer, gradients all-reduced),
                             so it measures orchestration alone; ZeRO-2 adds sharding's own
                             cost, the all-gather of the updated weights after every step
  DeepSpeed engine alone     2 spawned processes over gloo stepping the engine lmfoundry builds
                             (train/pretrain.py: build_pretrain_engine) on batches in memory,
                             with the workers' allocator settings and no Ray: a row per ZeRO
                             stage, so that DeepSpeed's cost and the rest of the run's separate

While each lmfoundry run and each run of the engine alone trains, the benchmark samples every
process's CPU time (/proc) once a second. In each second the two processes that used the most
are the training workers; "others' CPU share" is the median, over the seconds in which each of
them used at least half a core (for lmfoundry, within its measured windows), of the share of the
CPU time of the cores the benchmark may use (all of them, here) that went to every other
process. Ray's daemons (GCS, raylet, dashboard, log monitor) run beside both loops, as the
benchmark's Ray is up throughout; an lmfoundry run adds Ray Train's controller and helper
actors and the driver's polling. On a machine with as many cores as training workers, the
others' share is taken from training; on a machine with cores to spare it is not.

Model: 4 layers, d_model 256, 8 heads (2 key/value heads); 16 sequences x 256 tokens per step.
Every loop's tokens/s is the median over windows of 5 consecutive steps after warm-up (steps
6-10, 11-15, ...), each window's wall time from its first step's start to its last step's end
(on 2 processes, the slower rank's steps). lmfoundry logs every 5 steps, as a run would, and its
windows are the times between consecutive logged steps (the `time` of each metrics row), so
they include everything the run does between them: the logged step's collectives, the report
to Ray Train, the metrics files; a window that ends in a checkpoint is left out.

The loops run one after another, --repeats rounds (interleaved); the table gives each loop's
median over the rounds, and the ratios of each round: lmfoundry and the engine alone against
both DDP rows, lmfoundry against the engine alone.

    python benchmarks/orchestration_overhead.py --steps 40 --repeats 3 --zero-stages 0 2

Prints a table; writes benchmarks/results/orchestration_overhead.json.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import socket
import statistics
import tempfile
import threading
import time
from pathlib import Path
from unittest import mock

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

RESULTS = Path(__file__).resolve().parent / "results"
SEQ, GLOBAL_SEQS, WARMUP = 256, 16, 5
WINDOW = 5  # steps: lmfoundry's logging interval, over which every loop is measured


def windowed_tokens_per_s(step_s: list[float]) -> float:
    """tokens/s over the median window of WINDOW consecutive steps after warm-up."""
    after = step_s[WARMUP:]
    windows = [sum(after[i : i + WINDOW]) for i in range(0, len(after) - WINDOW + 1, WINDOW)]
    return WINDOW * GLOBAL_SEQS * SEQ / statistics.median(windows)


def model_config(vocab: int):
    from lmfoundry.model.transformer import ModelConfig

    return ModelConfig(vocab_size=vocab, max_seq_len=SEQ, n_layer=4, d_model=256, n_head=8, n_kv_head=2)


def timed_steps(model, batches) -> list[float]:
    """Seconds per optimizer step (forward, backward, clipping, AdamW) over the batches."""
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    times = []
    for tokens in batches:
        start = time.perf_counter()
        loss = model(tokens[:, :-1], tokens[:, 1:])[1]
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        loss.item()
        times.append(time.perf_counter() - start)
    return times


def _ddp_worker(rank: int, world: int, port: int, vocab: int, steps: int, results) -> None:
    from harness.peak_memory import start_rank

    from lmfoundry.model.transformer import Transformer

    start_rank(rank, world, port)  # one thread, gloo
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(Transformer(model_config(vocab)))
    batches = torch.randint(
        0, vocab, (steps, GLOBAL_SEQS // world, SEQ + 1), generator=torch.Generator().manual_seed(rank)
    )
    results[rank] = timed_steps(model, batches)
    dist.destroy_process_group()


def _engine_worker(rank: int, world: int, port: int, raw: dict, steps: int, results) -> None:
    from harness.peak_memory import start_rank

    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import build_pretrain_engine

    start_rank(rank, world, port)  # the environment DeepSpeed reads, one thread, gloo
    cfg = PretrainConfig.model_validate(raw)
    engine, _, _ = build_pretrain_engine(cfg, world, SEQ)
    batches = torch.randint(
        0, cfg.model.vocab_size, (steps, GLOBAL_SEQS // world, SEQ + 1), generator=torch.Generator().manual_seed(rank)
    )
    times = []
    for tokens in batches:
        start = time.perf_counter()
        loss = engine(tokens[:, :-1], tokens[:, 1:])[1]
        engine.backward(loss)
        engine.step()
        loss.item()
        times.append(time.perf_counter() - start)
    results[rank] = times
    engine.destroy()
    dist.destroy_process_group()


def _spawn_pair(worker, args: tuple, env: dict[str, str]) -> float:
    """tokens/s of `worker` on 2 spawned processes, windowed (windowed_tokens_per_s) over the
    slower rank's step times."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.get_context("spawn").Manager().dict()
    with mock.patch.dict(os.environ, env):  # spawned processes start with it: glibc reads it at start
        mp.spawn(worker, args=(2, port, *args, results), nprocs=2, join=True)
    return windowed_tokens_per_s([max(a, b) for a, b in zip(results[0], results[1])])


def deepspeed_alone(vocab: int, steps: int, zero_stage: int, env: dict[str, str]) -> tuple[float, OthersCpuShare]:
    """tokens/s of the engine alone and what the other processes took of the machine's CPU
    meanwhile (Ray's daemons idle beside it: the benchmark's Ray is up)."""
    from lmfoundry.train.config import PretrainConfig

    cfg = PretrainConfig(
        data="-",
        output="-",
        model=model_config(vocab),
        parallelism={"num_workers": 2, "cpus_per_worker": 1, "zero_stage": zero_stage},
        batch={"micro_batch_size": GLOBAL_SEQS // 2, "global_batch_tokens": GLOBAL_SEQS * SEQ},
        schedule={"max_steps": steps, "warmup_steps": 2},
    )
    with OthersCpuShare(workers=2) as others:
        tokens_per_s = _spawn_pair(_engine_worker, (cfg.model_dump(), steps), env)
    return tokens_per_s, others


def ddp(vocab: int, steps: int, env: dict[str, str]) -> float:
    return _spawn_pair(_ddp_worker, (vocab, steps), env)


def one_process(vocab: int, steps: int) -> float:
    from lmfoundry.model.transformer import Transformer

    torch.set_num_threads(2)
    torch.manual_seed(0)
    batches = torch.randint(0, vocab, (steps, GLOBAL_SEQS, SEQ + 1))
    return windowed_tokens_per_s(timed_steps(Transformer(model_config(vocab)), batches))


def _cpu_ticks() -> dict[int, tuple[str, int]]:
    """Every process's name and CPU time so far (user + system, in clock ticks)."""
    ticks = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as f:
                text = f.read()
        except OSError:  # gone meanwhile
            continue
        name, rest = text[text.index("(") + 1 : text.rindex(")")], text[text.rindex(")") + 2 :].split()
        ticks[int(entry)] = (name, int(rest[11]) + int(rest[12]))  # fields 14 and 15 of stat(5)
    return ticks


class OthersCpuShare(threading.Thread):
    """Samples every process's CPU time once a second while a loop trains (a context manager).
    In each second, the `workers` processes that used the most CPU are the training workers;
    `share()` is the median, over the seconds in which each of them used at least half a core
    (the loop was training; given `between`, a window of wall time, only the seconds that end
    in it), of the share of the CPU time of the cores this benchmark may use that went to every
    other process, and `seconds` is how many seconds were kept."""

    BUSY = 0.5  # of a core, each worker

    def __init__(self, workers: int):
        super().__init__(daemon=True)
        self.workers, self.samples, self.stop = workers, [], threading.Event()
        self.between: tuple[float, float] | None = None
        self.cores = len(os.sched_getaffinity(0))  # the cores this benchmark and its children may use
        self.ticks_per_s = os.sysconf("SC_CLK_TCK")

    def run(self) -> None:
        before, then = _cpu_ticks(), time.monotonic()
        while not self.stop.wait(1.0):
            now, at = _cpu_ticks(), time.monotonic()
            # a process that started since counts from 0 (a pid is not reused within a second)
            used = sorted((t - before.get(pid, (name, 0))[1] for pid, (name, t) in now.items()), reverse=True)
            core = self.ticks_per_s * (at - then)
            workers, others = used[: self.workers], used[self.workers :]
            if len(workers) == self.workers and min(workers) >= self.BUSY * core:
                self.samples.append((time.time(), sum(max(t, 0) for t in others) / (core * self.cores)))
            before, then = now, at

    def __enter__(self) -> OthersCpuShare:
        self.start()
        return self

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.join()

    @property
    def shares(self) -> list[float]:
        low, high = self.between or (-math.inf, math.inf)
        return [share for at, share in self.samples if low <= at <= high]

    def share(self) -> float | None:
        return statistics.median(self.shares) if self.shares else None

    @property
    def seconds(self) -> int:
        return len(self.shares)


def lmfoundry_pretrain(packed: str, out: str, steps: int, zero_stage: int) -> tuple[float, OthersCpuShare]:
    """tokens/s of the run (the median over the windows between its logged steps after warm-up,
    by the rows' `time`) and what the other processes took of the machine's CPU while it trained."""
    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    cfg = PretrainConfig(
        data=packed,
        output=out,
        model=model_config(0).model_copy(update={"vocab_size": 0}),
        parallelism={"num_workers": 2, "cpus_per_worker": 1, "zero_stage": zero_stage},
        batch={"micro_batch_size": GLOBAL_SEQS // 2, "global_batch_tokens": GLOBAL_SEQS * SEQ},
        schedule={"max_steps": steps, "warmup_steps": 2},
        checkpointing={"every": steps},
        logging={"every": 5},
    )
    with OthersCpuShare(workers=2) as others:
        run_pretrain(cfg)
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    measured = [
        (before, now)
        for before, now in zip(rows, rows[1:])
        if before["step"] >= WARMUP and "checkpoint_blocking_s" not in now
    ]
    windows = [
        (now["step"] - before["step"]) * GLOBAL_SEQS * SEQ / (now["time"] - before["time"]) for before, now in measured
    ]
    others.between = (measured[0][0]["time"], measured[-1][1]["time"])  # the seconds it trained, measured
    return statistics.median(windows), others


DDP, ONE = "PyTorch DDP, 2 processes", "one process, 2 threads"
DDP_ALLOC = "PyTorch DDP, 2 processes, lmfoundry's allocator settings"


def lmfoundry_row(stage: int) -> str:
    return f"lmfoundry pretrain (Ray Train + DeepSpeed ZeRO-{stage})"


def engine_row(stage: int) -> str:
    return f"DeepSpeed engine alone, ZeRO-{stage} (2 processes, no Ray)"


def by_round(runs: dict[str, list[float]], name: str, base: str) -> list[float]:
    return [a / b for a, b in zip(runs[name], runs[base])]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--steps", type=int, default=40)
    p.add_argument("--repeats", type=int, default=3, help="rounds of the loops, one after another")
    p.add_argument(
        "--zero-stages",
        type=int,
        nargs="+",
        default=[0, 2],
        choices=[0, 1, 2, 3],
        help="the DeepSpeed ZeRO stages to run lmfoundry and the engine alone with, a row each",
    )
    args = p.parse_args()

    from lmfoundry.data.curate import CurateConfig, run_curate
    from lmfoundry.data.pack import PackConfig, run_pack
    from lmfoundry.data.sample_corpus import build_sample_corpus
    from lmfoundry.platform.ray_env import CPU_ALLOCATOR_ENV, init_ray

    init_ray()
    lmf_rows = {stage: lmfoundry_row(stage) for stage in args.zero_stages}
    engine_rows = {stage: engine_row(stage) for stage in args.zero_stages}
    runs: dict[str, list[float]] = {
        **{row: [] for row in lmf_rows.values()},
        **{row: [] for row in engine_rows.values()},
        DDP: [],
        DDP_ALLOC: [],
        ONE: [],
    }
    others: dict[str, dict[str, list]] = {
        row: {"share": [], "seconds": []} for rows in (lmf_rows, engine_rows) for row in rows.values()
    }
    with tempfile.TemporaryDirectory(prefix="lmf-overhead-") as work:
        build_sample_corpus(f"{work}/raw", seed=1, shards=2)
        run_curate(CurateConfig(input=f"{work}/raw", output=f"{work}/curated"))
        packed = run_pack(PackConfig(input=f"{work}/curated", output=f"{work}/packed", vocab_size=4096, seq_len=SEQ))
        vocab = packed["vocab_size"]
        # interleaved, so that a change in the machine's state over the run touches every loop alike
        for r in range(args.repeats):
            for stage in args.zero_stages:
                out = f"{work}/run-{r}-zero{stage}"
                for row, (tokens_per_s, sampled) in (
                    (lmf_rows[stage], lmfoundry_pretrain(f"{work}/packed", out, args.steps, stage)),
                    (engine_rows[stage], deepspeed_alone(vocab, args.steps, stage, CPU_ALLOCATOR_ENV)),
                ):
                    runs[row].append(tokens_per_s)
                    others[row]["share"].append(sampled.share())
                    others[row]["seconds"].append(sampled.seconds)
            runs[DDP].append(ddp(vocab, args.steps, {}))
            runs[DDP_ALLOC].append(ddp(vocab, args.steps, CPU_ALLOCATOR_ENV))
            runs[ONE].append(one_process(vocab, args.steps))
            print(f"round {r + 1}: " + ", ".join(f"{name} {v[-1]:.0f}" for name, v in runs.items()), flush=True)
    figures = {name: statistics.median(v) for name, v in runs.items()}
    base = figures[DDP]
    # side by side within a round: the figures to quote (the pooled medians mix different rounds)
    rounds = {
        row: {
            "vs DDP": by_round(runs, row, DDP),
            "vs DDP with the same allocator": by_round(runs, row, DDP_ALLOC),
            **(
                {"vs the DeepSpeed engine alone": by_round(runs, row, engine_rows[stage])}
                if row in lmf_rows.values()
                else {}
            ),
        }
        for stage in args.zero_stages
        for row in (lmf_rows[stage], engine_rows[stage])
    }
    print(f"\n{'loop':<58} {'tokens/s':>9} {'vs DDP':>7}   (medians of {args.repeats} interleaved rounds)")
    for name, tps in figures.items():
        print(f"{name:<58} {tps:9.0f} {tps / base:7.3f}")
    for row, against in rounds.items():
        for what, ratios in against.items():
            print(
                f"{row} {what}, round by round: "
                + ", ".join(f"{x:.3f}" for x in ratios)
                + f" (median {statistics.median(ratios):.3f})"
            )
    for row, sampled in others.items():
        known = [x for x in sampled["share"] if x is not None]
        print(
            f"{row}: other processes' share of the machine's CPU while it trained, round by round: "
            + ", ".join("—" if x is None else f"{x:.3f}" for x in sampled["share"])
            + (f" (median {statistics.median(known):.3f})" if known else "")
            + f"; seconds sampled: {', '.join(map(str, sampled['seconds']))}"
        )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "orchestration_overhead.json").write_text(
        json.dumps(
            {
                "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
                "steps": args.steps,
                "seq_len": SEQ,
                "sequences_per_step": GLOBAL_SEQS,
                "repeats": args.repeats,
                "tokens_per_s_runs": runs,
                "tokens_per_s": figures,
                "ratio_to_ddp": {k: v / base for k, v in figures.items()},
                "by_round": rounds,
                "median_of_rounds": {
                    row: {what: statistics.median(ratios) for what, ratios in against.items()}
                    for row, against in rounds.items()
                },
                "others_cpu_share_while_training": others,
            },
            indent=2,
        )
    )


if __name__ == "__main__":
    main()
