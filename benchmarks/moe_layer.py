"""MoE layer forward+backward throughput on CPU, side by side in one run:

  lmfoundry MoE (fused)       sorted dispatch, a chunk of experts at a time through both projections
                              in one autograd node (what `dispatch: auto` runs on CPUs)
  lmfoundry MoE (grouped_mm)  sorted dispatch, all rows gathered, one grouped product per projection
  lmfoundry MoE (sliced)      sorted dispatch, all rows gathered, one dense product per expert slice
  DeepSpeed MoE               deepspeed.moe.layer.MoE, dropless (drop_tokens=False), same experts
  loop over experts + masks   the Mixtral-style reference: gather each expert's tokens by mask
  dense matmul (limit)        one dense product per projection of the same total FLOPs
  expert products alone       the fused layer's own per-expert products, forward and backward, with
                              its router's counts, on operands made beforehand: what the layer would
                              take with no gathering, scattering, routing or elementwise work
  2048x2048 product           one square fp32 matrix product: the reference FLOP rate of the
                              machine, measured in the same run (the dense limit's thin products
                              run well below it)

Each side runs twice, each time in a process of its own: with glibc's allocator defaults, where
every large tensor is a fresh mapping whose pages fault in on first touch, and with the settings
lmfoundry's CPU training workers run with (platform/ray_env.py CPU_ALLOCATOR_ENV), where freed
memory is reused. The gathered forms allocate several tensors of tokens x top-k rows a pass, so
the allocator moves their rates (DeepSpeed's most) while the square product barely moves.

    python benchmarks/moe_layer.py            # 64 experts, top-6, d_model 512, expert hidden 128, 4096 tokens
    python benchmarks/moe_layer.py --quick    # fewer repeats

FLOPs counted for the routed experts only (the router is < 3%): per (token, expert) assignment
a SwiGLU expert does 2*C*2H + 2*H*C = 6*C*H multiply-adds*2 forward; backward is twice forward:
total 18*C*H per assignment. "saved MiB" is what a layer's forward keeps for its backward (the
storages autograd holds, each counted once, the input included, the layer's parameters not).
Prints a table; writes benchmarks/results/moe_layer.json.
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F
from lifecycle import results_header

from lmfoundry.model.moe import MoE, MoEConfig
from lmfoundry.platform.ray_env import CPU_ALLOCATOR_ENV

RESULTS = Path(__file__).resolve().parent / "results"


class SwiGLUExpert(nn.Module):
    def __init__(self, c: int, h: int):
        super().__init__()
        self.gate_up = nn.Linear(c, 2 * h, bias=False)
        self.down = nn.Linear(h, c, bias=False)

    def forward(self, x):
        g, u = self.gate_up(x).chunk(2, dim=-1)
        return self.down(F.silu(g) * u)


class LoopOverExperts(nn.Module):
    """Mixtral's reference shape: for each expert, find its tokens by mask and run them."""

    def __init__(self, c: int, h: int, e: int, k: int):
        super().__init__()
        self.k = k
        self.router = nn.Linear(c, e, bias=False)
        self.experts = nn.ModuleList(SwiGLUExpert(c, h) for _ in range(e))

    def forward(self, x):
        w, ids = self.router(x).softmax(-1).topk(self.k, dim=-1)
        out = torch.zeros_like(x)
        for e, expert in enumerate(self.experts):
            token, slot = torch.where(ids == e)
            if token.numel():
                out.index_add_(0, token, expert(x[token]) * w[token, slot, None])
        return out


def timed(fn, repeats: int) -> list[float]:
    fn()  # warm-up
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return times


def fwd_bwd(layer, x):
    def run():
        layer.zero_grad(set_to_none=True)
        out = layer(x)
        out = out[0] if isinstance(out, tuple) else out
        out.float().pow(2).mean().backward()

    return run


def saved_for_backward_mib(layer, x) -> float:
    """The storages autograd keeps from one forward for its backward, each counted once, the
    layer's own parameters left out."""
    parameters = {p.untyped_storage().data_ptr() for p in layer.parameters()}
    storages = {}

    def pack(t):
        storage = t.untyped_storage()
        if storage.data_ptr() not in parameters:
            storages[storage.data_ptr()] = storage.nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = layer(x)
    del out
    return sum(storages.values()) / 2**20


def deepspeed_moe(c, h, e, k):
    import deepspeed
    from deepspeed.moe.layer import MoE as DSMoE

    from lmfoundry.train.engine import prepare_deepspeed

    if not torch.distributed.is_initialized():
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
        prepare_deepspeed()  # as the training workers start it: nothing compiled
        deepspeed.init_distributed(dist_backend="gloo")
    layer = DSMoE(
        hidden_size=c, expert=SwiGLUExpert(c, h), num_experts=e, ep_size=1, k=k, drop_tokens=False, use_rts=False
    )
    layer.set_deepspeed_parallelism()
    return layer


ALLOCATORS = {
    # glibc's defaults: every large tensor is a fresh mmap, its pages faulted in (and zeroed) on
    # first touch, unmapped again when freed
    "glibc defaults": {},
    # what lmfoundry's CPU training workers run with (platform/ray_env.py): freed memory stays in
    # the heap and is reused
    "lmfoundry's CPU training workers": CPU_ALLOCATOR_ENV,
}


def measure(args) -> dict:
    """Every layer and the square product, interleaved, in this process."""
    repeats = 3 if args.quick else 7
    N, E, K, C, H = args.tokens, args.experts, args.top_k, args.d_model, args.expert_hidden
    torch.manual_seed(0)
    x = torch.randn(N, C, requires_grad=True)
    flops = 18 * C * H * N * K

    layers = {}
    for how in ("fused", "grouped_mm", "sliced"):
        layers[f"lmfoundry MoE ({how})"] = MoE(
            C, 0, MoEConfig(num_experts=E, top_k=K, num_shared_experts=0, expert_hidden=H, dispatch=how, balance="none")
        )
    layers["DeepSpeed MoE (dropless)"] = deepspeed_moe(C, H, E, K)
    layers["loop over experts + masks"] = LoopOverExperts(C, H, E, K)

    # the same FLOPs as one dense product per projection: the machine's practical limit
    a = torch.randn(N * K, C, requires_grad=True)
    w1 = torch.randn(C, 2 * H, requires_grad=True)
    w2 = torch.randn(H, C, requires_grad=True)

    def dense():
        g, u = (a @ w1).chunk(2, dim=-1)
        ((F.silu(g) * u) @ w2).pow(2).mean().backward()

    # the fused layer's own matrix products (forward: gate/up and down; backward: both weight
    # gradients and both input gradients), one per expert over its rows as its router routes x,
    # on operands made beforehand: no gathering, scattering, routing or elementwise work. The
    # ceiling of any dispatch built from torch's products, against which the layer's other work shows
    with torch.no_grad():
        counts = torch.bincount(layers["lmfoundry MoE (fused)"].route(x)[0].flatten(), minlength=E).tolist()
    M = sum(counts)
    xs, gs, hidden, d_pre = torch.randn(M, C), torch.randn(M, C), torch.randn(M, H), torch.randn(M, 2 * H)
    w_gate_up, w_down = torch.randn(E, C, 2 * H), torch.randn(E, H, C)
    pre, ys, d_hidden, dxs = torch.empty(M, 2 * H), torch.empty(M, C), torch.empty(M, H), torch.empty(M, C)
    d_gate_up, d_down = torch.empty(E, C, 2 * H), torch.empty(E, H, C)

    def products():
        start = 0
        for e, m in enumerate(counts):
            rows = slice(start, start + m)
            torch.mm(xs[rows], w_gate_up[e], out=pre[rows])
            torch.mm(hidden[rows], w_down[e], out=ys[rows])
            torch.mm(hidden[rows].t(), gs[rows], out=d_down[e])
            torch.mm(gs[rows], w_down[e].t(), out=d_hidden[rows])
            torch.mm(xs[rows].t(), d_pre[rows], out=d_gate_up[e])
            torch.mm(d_pre[rows], w_gate_up[e].t(), out=dxs[rows])
            start += m

    sq_a, sq_b = torch.randn(2048, 2048), torch.randn(2048, 2048)

    def square():
        torch.mm(sq_a, sq_b)

    saved = {name: saved_for_backward_mib(layer, x) for name, layer in layers.items()}
    runs = {name: fwd_bwd(layer, x) for name, layer in layers.items()}
    runs["dense matmul (limit)"] = dense
    runs["expert products alone"] = products
    runs["2048x2048 product"] = square
    samples: dict[str, list[float]] = {name: [] for name in runs}
    for _ in range(repeats):  # interleaved, so drift in the machine's speed hits every side alike
        for name, fn in runs.items():
            samples[name] += timed(fn, 1)
    rows = []
    dense_s = statistics.median(samples["dense matmul (limit)"])
    ds_s = statistics.median(samples["DeepSpeed MoE (dropless)"])
    square_gflops = 2 * 2048**3 / statistics.median(samples.pop("2048x2048 product")) / 1e9
    for name, ts in samples.items():
        med = statistics.median(ts)
        rows.append(
            {
                "name": name,
                "median_s": med,
                "tokens_per_s": N / med,
                "gflop_per_s": flops / med / 1e9,
                "vs_deepspeed": ds_s / med,
                "vs_dense_limit": dense_s / med,
                "vs_square_product": flops / med / 1e9 / square_gflops,
                "saved_for_backward_mib": saved.get(name),
            }
        )
    return {
        "square_product_gflop_per_s": square_gflops,
        "gflop_per_pass": flops / 1e9,
        "repeats": repeats,
        "threads": torch.get_num_threads(),
        "rows": rows,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true")
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--experts", type=int, default=64)
    p.add_argument("--top-k", type=int, default=6)
    p.add_argument("--d-model", type=int, default=512)
    p.add_argument("--expert-hidden", type=int, default=128)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(measure(args)))
        return
    load_before = os.getloadavg()[0]
    N, E, K, C, H = args.tokens, args.experts, args.top_k, args.d_model, args.expert_hidden
    # glibc reads its allocator settings when a process starts: a process per setting
    # (and nothing else of the caller's that would tune or replace the allocator)
    base_env = {
        k: v for k, v in os.environ.items() if not k.startswith("MALLOC_") and k not in ("GLIBC_TUNABLES", "LD_PRELOAD")
    }
    measured = {}
    for allocator, env in ALLOCATORS.items():
        child = subprocess.run(
            [sys.executable, __file__, "--child", *sys.argv[1:]],
            env={**base_env, **env},
            capture_output=True,
            text=True,
        )
        if child.returncode:
            raise SystemExit(f"the run with {allocator} failed:\n{child.stderr[-4000:]}")
        measured[allocator] = json.loads(child.stdout.strip().splitlines()[-1])
    first = next(iter(measured.values()))
    print(
        f"MoE fwd+bwd, fp32 CPU ({first['threads']} threads): {N} tokens, {E} experts, top-{K}, "
        f"d_model {C}, expert hidden {H}; {first['gflop_per_pass']:.1f} GFLOP per pass; median of {first['repeats']}"
    )
    for allocator, m in measured.items():
        print(f"\nallocator: {allocator}; 2048x2048 fp32 product: {m['square_product_gflop_per_s']:.1f} GFLOP/s")
        print(
            f"{'layer':30s} {'median s':>9s} {'tokens/s':>9s} {'GFLOP/s':>8s} {'x DS':>6s} {'of dense':>8s} "
            f"{'of 2048^2':>9s} {'saved MiB':>9s}"
        )
        for r in m["rows"]:
            print(
                f"{r['name']:30s} {r['median_s']:9.3f} {r['tokens_per_s']:9.0f} {r['gflop_per_s']:8.1f} "
                f"{r['vs_deepspeed']:6.2f} {r['vs_dense_limit']:8.0%} {r['vs_square_product']:9.0%} "
                + (f"{r['saved_for_backward_mib']:9.0f}" if r["saved_for_backward_mib"] is not None else f"{'':9s}")
            )
    rows = [{"allocator": allocator, **r} for allocator, m in measured.items() for r in m["rows"]]
    RESULTS.mkdir(exist_ok=True)
    out = RESULTS / "moe_layer.json"
    out.write_text(
        json.dumps(
            {
                **results_header(
                    "MoE layer forward+backward against DeepSpeed's MoE, the dense limit and a 2048x2048 product",
                    "benchmarks/moe_layer.py",
                    load_before,
                ),
                "square_product_gflop_per_s": {a: m["square_product_gflop_per_s"] for a, m in measured.items()},
                "allocator_env": {
                    a: " ".join(f"{k}={v}" for k, v in env.items()) or "none" for a, env in ALLOCATORS.items()
                },
                "tokens": N,
                "experts": E,
                "top_k": K,
                "d_model": C,
                "expert_hidden": H,
                "gflop_per_pass": first["gflop_per_pass"],
                "repeats": first["repeats"],
                "threads": first["threads"],
                "cpus": os.cpu_count(),
                "rows": rows,
            },
            indent=2,
        )
        + "\n"
    )
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
