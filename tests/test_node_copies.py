"""The collectives the training workers run around a run's checkpoints, in two gloo processes:
the final figures' batches in step (every rank runs as many as the busiest, counting only its
own rows), and a remote checkpoint copied once per node, read there by every rank, kept for a
worker group that takes over, and removed once all are done; a failed copy fails every rank."""

import os
import socket
import tempfile
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from test_export import make_checkpoint

from lmfoundry.platform import checkpoint, storage
from lmfoundry.train import held_out
from lmfoundry.train.node_copies import copy_key, node_copy, remove_node_copy


def _worker(rank: int, world: int, port: int, uri: str, nodes: int, present: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        calls = []

        def measure(some):
            calls.append(list(some))
            return float(sum(some)), float(len(some))

        results[rank, "sums"] = held_out.summed_over_ranks([1, 2, 3, 4, 5], 2, measure, "cpu"), calls
        # two ranks of one node, or the first ranks of two nodes (each with a temporary directory of its own)
        local_rank, node_rank = (0, rank) if nodes == 2 else (rank, 0)
        if nodes == 2:
            tempfile.tempdir = str(Path(present).parent / f"node-{rank}")
            os.makedirs(tempfile.tempdir, exist_ok=True)
        key = copy_key("s3://runs/run", uri)
        local = node_copy(uri, key, local_rank, node_rank)
        results[rank, "copy"] = local, sorted(p.name for p in Path(local).iterdir())
        dist.barrier()
        if local_rank == 0:
            (Path(local) / "mark").write_text("")
        # a worker group that takes over finds the node's copy and reuses it
        results[rank, "again"] = node_copy(uri, key, local_rank, node_rank) == local and (Path(local) / "mark").exists()
        remove_node_copy(local, uri, local_rank)
        dist.barrier()
        results[rank, "left"] = Path(local).exists()
        # on the driver's node its copy is read where it is, and left to it
        mine = node_copy(uri, key, local_rank, node_rank, present=present if node_rank == 0 else None)
        remove_node_copy(mine, uri, local_rank, present=present if node_rank == 0 else None)
        results[rank, "present"] = mine == present, Path(present).exists()
        try:
            node_copy(uri + "-missing", key + "x", local_rank, node_rank)
        except RuntimeError as e:
            results[rank, "missing"] = str(e)
    finally:
        dist.destroy_process_group()


def _run(uri: str, nodes: int, present: str) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, uri, nodes, present, results), nprocs=2, join=True)
    return dict(results)


def test_ranks_measure_in_step_and_share_one_copy_of_a_remote_checkpoint_per_node(s3_bucket, tmp_path):
    make_checkpoint(tmp_path / "ckpt")
    uri = f"{s3_bucket}/run/ckpt"
    for f in (tmp_path / "ckpt").iterdir():
        storage.upload_file(f, f"{uri}/{f.name}")
    present = str(tmp_path / "ckpt")

    one_node = _run(uri, nodes=1, present=present)
    for rank in (0, 1):
        (total, count), calls = one_node[rank, "sums"]
        assert (total, count) == (15.0, 5.0)
        # rank 0 has rows 1, 3, 5 and rank 1 rows 2, 4: both run two batches, rank 1's second
        # repeats the first row and is not counted
        assert len(calls) == 2
    assert one_node[1, "sums"][1] == [[2, 4], [1]]
    (copy0, files0), (copy1, files1) = one_node[0, "copy"], one_node[1, "copy"]
    assert copy0 == copy1 and Path(copy0).parent == checkpoint.private_temp_dir()  # one download
    assert files0 == files1 and checkpoint.CHECKPOINT_MANIFEST in files0
    assert one_node[0, "again"] and one_node[1, "again"]
    assert not one_node[0, "left"] and not one_node[1, "left"]  # removed once both were done
    assert one_node[0, "present"] == one_node[1, "present"] == (True, True)
    assert all(f"{uri}-missing" in one_node[rank, "missing"] for rank in (0, 1))  # both ranks fail

    two_nodes = _run(uri, nodes=2, present=present)
    assert two_nodes[0, "copy"][0] != two_nodes[1, "copy"][0]  # each node its own copy
    assert two_nodes[1, "copy"][1] == files0 and not two_nodes[0, "left"] and not two_nodes[1, "left"]
    assert two_nodes[0, "present"] == (True, True) and two_nodes[1, "present"] == (False, True)


def test_a_copy_cut_short_is_made_again_and_a_shared_directory_is_refused(s3_bucket, tmp_path, monkeypatch):
    make_checkpoint(tmp_path / "ckpt")
    uri = f"{s3_bucket}/ckpt"
    for f in (tmp_path / "ckpt").iterdir():
        storage.upload_file(f, f"{uri}/{f.name}")
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    partial = checkpoint.private_temp_dir() / f"{checkpoint.TEMP_PREFIX}k"
    partial.mkdir()
    (partial / "model.safetensors").write_bytes(b"cut short")  # no manifest: a download killed midway
    local = checkpoint.run_copy(uri, "k")
    assert local == str(partial) and (partial / checkpoint.CHECKPOINT_MANIFEST).is_file()
    checkpoint.verify(local, model_only=True)  # every file whole again
    checkpoint.remove_copy(local, uri)
    assert not partial.exists()
    os.chmod(checkpoint.private_temp_dir(), 0o777)  # anyone could plant a copy there
    with pytest.raises(PermissionError, match="no one else"):
        checkpoint.run_copy(uri, "k")
