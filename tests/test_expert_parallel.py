"""Expert parallelism: two processes over gloo, each holding half the experts, give the same
outputs and gradients as one process holding them all."""

import os
import socket

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from lmfoundry.model.moe import MoE, MoEConfig
from lmfoundry.train.expert_parallel import shard_experts


def _worker(rank: int, world: int, port: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)  # the same weights on every rank
        cfg = MoEConfig(num_experts=8, top_k=3, num_shared_experts=1, expert_hidden=16)
        full = MoE(32, 64, cfg)
        ep = MoE(32, 64, cfg)
        ep.load_state_dict(full.state_dict())
        shard_experts(ep, dist.group.WORLD, world, rank)
        torch.manual_seed(100 + rank)  # different tokens on every rank
        x = torch.randn(37 + 5 * rank, 32)
        y_full, y_ep = full(x), ep(x)
        g = torch.randn_like(y_full)
        (y_full * g).sum().backward()
        (y_ep * g).sum().backward()
        # an expert's gradient sums the contributions of the tokens of every rank
        for p in (full.w_gate_up, full.w_down):
            dist.all_reduce(p.grad)
        El = cfg.num_experts // world
        mine = slice(rank * El, (rank + 1) * El)
        results[rank] = {
            "out": (y_full - y_ep).abs().max().item(),
            "w_gate_up": (full.w_gate_up.grad[mine] - ep.w_gate_up.grad).abs().max().item(),
            "w_down": (full.w_down.grad[mine] - ep.w_down.grad).abs().max().item(),
            "router": (full.router.weight.grad - ep.router.weight.grad).abs().max().item(),
            "local_experts": ep.w_gate_up.shape[0],
        }
        # The graphs and the sharded layer hold the process group: free them, and let neither
        # rank tear its group down while the other may still be sending.
        del full, ep, y_full, y_ep
        dist.barrier()
    finally:
        dist.destroy_process_group()


def test_two_ranks_with_half_the_experts_each_match_one_rank_with_all():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, results), nprocs=2, join=True)
    for rank in (0, 1):
        r = results[rank]
        assert r["local_experts"] == 4
        assert r["out"] < 1e-5 and r["w_gate_up"] < 1e-4 and r["w_down"] < 1e-4 and r["router"] < 1e-4, r
