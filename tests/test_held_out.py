"""The final figures' collectives on their own, in two gloo processes: every rank runs as many
batches as the busiest, counting only its own rows; a remote checkpoint is copied once per node,
read there by every rank, removed once all are done, and a failed copy fails every rank."""

import os
import socket
from pathlib import Path

import torch.distributed as dist
import torch.multiprocessing as mp
from test_export import make_checkpoint

from lmfoundry.platform import checkpoint, storage
from lmfoundry.train import held_out


def _worker(rank: int, world: int, port: int, uri: str, nodes: int, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        calls = []

        def measure(some):
            calls.append(list(some))
            return float(sum(some)), float(len(some))

        results[rank, "sums"] = held_out.summed_over_ranks([1, 2, 3, 4, 5], 2, measure, "cpu"), calls
        # two ranks of one node, or the first ranks of two nodes
        local_rank, node_rank = (0, rank) if nodes == 2 else (rank, 0)
        local = held_out.node_copy(uri, local_rank, node_rank)
        results[rank, "copy"] = local, sorted(p.name for p in Path(local).iterdir())
        held_out.remove_node_copy(local, uri, local_rank)
        dist.barrier()
        results[rank, "left"] = Path(local).exists()
        try:
            held_out.node_copy(uri + "-missing", local_rank, node_rank)
        except RuntimeError as e:
            results[rank, "missing"] = str(e)
    finally:
        dist.destroy_process_group()


def _run(uri: str, nodes: int) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, uri, nodes, results), nprocs=2, join=True)
    return dict(results)


def test_ranks_measure_in_step_and_share_one_copy_of_a_remote_checkpoint_per_node(s3_bucket, tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    uri = f"{s3_bucket}/run/ckpt"
    for f in (tmp_path / "ckpt").iterdir():
        storage.upload_file(f, f"{uri}/{f.name}")

    one_node = _run(uri, nodes=1)
    for rank in (0, 1):
        (total, count), calls = one_node[rank, "sums"]
        assert (total, count) == (15.0, 5.0)
        # rank 0 has rows 1, 3, 5 and rank 1 rows 2, 4: both run two batches, rank 1's second
        # repeats the first row and is not counted
        assert len(calls) == 2
    assert one_node[1, "sums"][1] == [[2, 4], [1]]
    (copy0, files0), (copy1, files1) = one_node[0, "copy"], one_node[1, "copy"]
    assert copy0 == copy1 and Path(copy0).name.startswith(checkpoint.TEMP_PREFIX)  # one download
    assert files0 == files1 and checkpoint.CHECKPOINT_MANIFEST in files0
    assert not one_node[0, "left"] and not one_node[1, "left"]  # removed once both were done
    assert all(f"{uri}-missing" in one_node[rank, "missing"] for rank in (0, 1))  # both ranks fail

    two_nodes = _run(uri, nodes=2)
    assert two_nodes[0, "copy"][0] != two_nodes[1, "copy"][0]  # each node its own copy
    assert two_nodes[0, "copy"][1] == files0 and not two_nodes[0, "left"] and not two_nodes[1, "left"]
