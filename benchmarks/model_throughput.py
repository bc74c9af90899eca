"""Dense and MoE decoder forward+backward throughput: tokens/s, achieved FLOP/s, MFU.

    python benchmarks/model_throughput.py --quick                 # CPU, fp32, small models
    python benchmarks/model_throughput.py --device cuda --dtype bf16 --size gpu   # MFU vs bf16 peak

FLOPs per token: 6 x active matmul weights + 12 x n_layer x d_model x seq_len (PaLM appendix B;
lmfoundry.model.flops, checked against torch's FLOP counter in tests/test_flops.py). MFU is
achieved FLOP/s over the device peak: --peak-tflops, or the bf16 dense peak of a known GPU.
Prints a table; writes benchmarks/results/model_throughput.json.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from lmfoundry.model.flops import train_flops_per_token
from lmfoundry.model.moe import MoEConfig
from lmfoundry.model.transformer import ModelConfig, Transformer
from lmfoundry.platform.hardware import device_peak_tflops

RESULTS = Path(__file__).resolve().parent / "results"
SIZES = {
    "cpu": dict(n_layer=4, d_model=256, n_head=8, n_kv_head=4, vocab_size=4096, max_seq_len=256),
    "gpu": dict(n_layer=12, d_model=1024, n_head=16, n_kv_head=8, vocab_size=32768, max_seq_len=2048),
}


def peak_tflops(device: str, given: float | None) -> float | None:
    if given:
        return given
    return device_peak_tflops(torch.cuda.get_device_name()) if device == "cuda" else None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--device", default="cpu")
    p.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32")
    p.add_argument("--size", choices=sorted(SIZES), default="cpu")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--peak-tflops", type=float)
    args = p.parse_args()
    repeats = 3 if args.quick else 7
    shape = SIZES[args.size]
    seq = shape["max_seq_len"]
    dtype = torch.bfloat16 if args.dtype == "bf16" else torch.float32
    ffn = ModelConfig(**shape).ffn_hidden
    models = {
        "dense": ModelConfig(**shape),
        # same active FLOPs per token as dense: 2 of 8 routed experts at a quarter width, plus 1 shared
        "moe 8x(1/4), top-2, 1 shared": ModelConfig(
            **shape, moe=MoEConfig(num_experts=8, top_k=2, num_shared_experts=1, expert_hidden=ffn // 4)
        ),
    }
    peak = peak_tflops(args.device, args.peak_tflops)
    rows = []
    for name, cfg in models.items():
        torch.manual_seed(0)
        model = Transformer(cfg).to(args.device, dtype).train()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
        x = torch.randint(0, cfg.vocab_size, (args.batch, seq + 1), device=args.device)

        def step():
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            opt.step()
            opt.zero_grad(set_to_none=True)
            if args.device == "cuda":
                torch.cuda.synchronize()

        step()
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            step()
            times.append(time.perf_counter() - t)
        med = statistics.median(times)
        tokens = args.batch * seq
        flops = train_flops_per_token(model, seq) * tokens
        rows.append(
            {
                "model": name,
                "params": model.num_params(),
                "flops_per_token": flops / tokens,
                "median_step_s": med,
                "tokens_per_s": tokens / med,
                "tflop_per_s": flops / med / 1e12,
                "mfu": flops / med / 1e12 / peak if peak else None,
            }
        )
    print(
        f"forward+backward+AdamW, {args.device} {args.dtype}, batch {args.batch} x {seq} tokens, "
        f"median of {repeats}" + (f", peak {peak} TFLOP/s" if peak else "")
    )
    print(f"{'model':30s} {'params':>8s} {'tokens/s':>10s} {'TFLOP/s':>8s} {'MFU':>6s}")
    for r in rows:
        mfu = f"{r['mfu']:.1%}" if r["mfu"] is not None else "-"
        print(f"{r['model']:30s} {r['params'] / 1e6:7.1f}M {r['tokens_per_s']:10.0f} {r['tflop_per_s']:8.3f} {mfu:>6s}")
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / f"model_throughput_{args.device}.json"
    out.write_text(
        json.dumps(
            {
                "benchmark": "model_throughput",
                "device": args.device,
                "dtype": args.dtype,
                "size": args.size,
                "batch": args.batch,
                "seq_len": seq,
                "threads": torch.get_num_threads(),
                "cpus": os.cpu_count(),
                "peak_tflops": peak,
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
