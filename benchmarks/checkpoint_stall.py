"""Checkpoint stall: how long a save blocks the training loop, asynchronous against synchronous.

One DeepSpeed ZeRO-2 engine (one CPU process, gloo), trained two steps so that the optimizer
state exists, saved repeatedly to a run directory on local disk, the two ways side by side:

  synchronous   snapshot, serialise, upload with checksums, commit; the loop waits for all of it
  asynchronous  the loop waits only for the in-memory snapshot (lmfoundry's default); the rest
                runs in the checkpointer's thread (its time is reported as "background")

    python benchmarks/checkpoint_stall.py                   # 12 layers, d_model 768: ~110M parameters
    python benchmarks/checkpoint_stall.py --layers 4 --d-model 256 --repeats 3

Prints a table of medians; writes benchmarks/results/checkpoint_stall.json.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.distributed as dist

from lmfoundry.model.chat_template import DEFAULT_CHAT_TEMPLATE
from lmfoundry.model.transformer import ModelConfig
from lmfoundry.platform.checkpoint import AsyncCheckpointer
from lmfoundry.train.checkpointing import stage_checkpoint
from lmfoundry.train.config import PretrainConfig
from lmfoundry.train.pretrain import build_pretrain_engine

RESULTS = Path(__file__).resolve().parent / "results"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--d-model", type=int, default=768)
    p.add_argument("--vocab", type=int, default=16384)
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--storage", default=None, help="where the run directory goes (default: a temporary one)")
    args = p.parse_args()

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29533")
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1")
    dist.init_process_group("gloo", rank=0, world_size=1)
    seq = 128
    model = ModelConfig(
        vocab_size=args.vocab,
        max_seq_len=seq,
        n_layer=args.layers,
        d_model=args.d_model,
        n_head=args.d_model // 64,
        n_kv_head=max(1, args.d_model // 128),
    )
    cfg = PretrainConfig(
        data="-",
        output="-",
        model=model,
        parallelism={"num_workers": 1, "zero_stage": 2},
        batch={"micro_batch_size": 2, "global_batch_tokens": 2 * seq},
        schedule={"max_steps": 100, "warmup_steps": 1},
    )
    engine, *_ = build_pretrain_engine(cfg, world=1, seq_len=seq)
    for _ in range(2):
        tokens = torch.randint(0, args.vocab, (2, seq + 1))
        engine.backward(engine(tokens[:, :-1], tokens[:, 1:])[1])
        engine.step()

    run_dir = tempfile.mkdtemp(prefix="lmfoundry-ckpt-bench-", dir=args.storage)
    writer = AsyncCheckpointer(run_dir, rank=0, world_size=1, keep_last=2)
    stage_root = Path(
        tempfile.mkdtemp(prefix="lmfoundry-stage-", dir="/dev/shm" if Path("/dev/shm").is_dir() else None)
    )
    state = {"step": 0, "note": "benchmark"}
    sync_s, blocked_s, background_s = [], [], []
    size = 0
    for rep in range(args.repeats):
        for mode in ("synchronous", "asynchronous"):
            step = 2 * rep + (mode == "asynchronous") + 1
            start = time.perf_counter()
            staged, write = stage_checkpoint(
                engine, 0, step, {**state, "step": step}, "{}", DEFAULT_CHAT_TEMPLATE, stage_root
            )
            writer.save(step, staged, {"step": step}, write)
            if mode == "synchronous":
                writer.wait()
                sync_s.append(time.perf_counter() - start)
            else:
                blocked_s.append(time.perf_counter() - start)
                writer.wait()
                background_s.append(writer.last_persist_s)
        size = sum(f.stat().st_size for f in Path(run_dir).rglob("*") if f.is_file()) / 2  # two kept
    out = {
        "machine": f"{platform.processor() or platform.machine()}, {os.cpu_count()} CPUs",
        "parameters": sum(p.numel() for p in engine.module.parameters()),
        "checkpoint_bytes": size,
        "repeats": args.repeats,
        "synchronous_s": sync_s,
        "async_blocked_s": blocked_s,
        "async_background_s": background_s,
        "median_synchronous_s": statistics.median(sync_s),
        "median_async_blocked_s": statistics.median(blocked_s),
    }
    out["blocked_fraction"] = out["median_async_blocked_s"] / out["median_synchronous_s"]
    print(f"{out['parameters'] / 1e6:.1f}M parameters, checkpoint {size / 2**20:.0f} MiB, {args.repeats} saves each")
    print(f"{'save':<14} {'loop blocked, s (median)':>25} {'vs synchronous':>15}")
    print(f"{'synchronous':<14} {out['median_synchronous_s']:25.3f} {1.0:15.3f}")
    print(
        f"{'asynchronous':<14} {out['median_async_blocked_s']:25.3f} {out['blocked_fraction']:15.3f}"
        f"   (background {statistics.median(background_s):.3f} s)"
    )
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "checkpoint_stall.json").write_text(json.dumps(out, indent=2))
    shutil.rmtree(run_dir, ignore_errors=True)
    shutil.rmtree(stage_root, ignore_errors=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
