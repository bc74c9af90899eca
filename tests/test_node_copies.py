"""The collectives the training workers run around a run's checkpoints, in two gloo processes:
the final figures' batches in step (every rank runs as many as the busiest, counting only its
own rows), and a remote checkpoint copied once per node, read there by every rank, kept for a
worker group that takes over, and removed once all are done; a failed copy fails every rank. A
copy is used only when its files match the manifest the driver verified. Copies nobody holds
go a day after their last use; a held one stays."""

import os
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp
from test_export import make_checkpoint

from lmfoundry.platform import checkpoint, storage
from lmfoundry.train import held_out
from lmfoundry.train.node_copies import copy_key, node_copy, remove_node_copy


def _worker(rank: int, world: int, port: int, uri: str, nodes: int, present: str, tmp: str, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        downloads = []
        download = checkpoint.download
        checkpoint.download = lambda *args, **kw: (downloads.append(args[1]), download(*args, **kw))[1]

        def measure(some):
            calls.append(list(some))
            return float(sum(some)), float(len(some))

        calls = []
        results[rank, "sums"] = held_out.summed_over_ranks([1, 2, 3, 4, 5], 2, measure, "cpu"), calls
        # two ranks of one node, or the first ranks of two nodes (each its own temporary directory)
        local_rank, node_rank = (0, rank) if nodes == 2 else (rank, 0)
        tempfile.tempdir = os.path.join(tmp, f"node-{node_rank}")
        os.makedirs(tempfile.tempdir, exist_ok=True)
        key = copy_key("s3://runs/run", uri)
        local = node_copy(uri, key, local_rank, node_rank)
        results[rank, "copy"] = local, sorted(p.name for p in Path(local).iterdir())
        dist.barrier()
        if local_rank == 0:
            (Path(local) / "mark").write_text("")
            checkpoint.release_run_copy(local)  # as a worker group that failed lets go of it
        # a worker group that takes over finds the node's copy and reuses it
        results[rank, "again"] = node_copy(uri, key, local_rank, node_rank) == local and (Path(local) / "mark").exists()
        remove_node_copy(local, local_rank)
        dist.barrier()
        results[rank, "left"] = Path(local).exists()
        # on the driver's node the driver's copy is read where it is, and left to the driver
        here = present if node_rank == 0 else None
        mine = node_copy(uri, key, local_rank, node_rank, present=here)
        remove_node_copy(mine, local_rank)
        results[rank, "present"] = mine == present, Path(present).exists()
        try:
            node_copy(uri + "-missing", key + "x", local_rank, node_rank)
        except RuntimeError as e:
            results[rank, "missing"] = str(e)
        results[rank, "downloads"] = len(downloads)
    finally:
        dist.destroy_process_group()


def _run(uri: str, nodes: int, present: str, tmp: Path) -> dict:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    results = mp.Manager().dict()
    mp.spawn(_worker, args=(2, port, uri, nodes, present, str(tmp), results), nprocs=2, join=True)
    return dict(results)


@pytest.fixture
def remote_checkpoint(s3_bucket, tmp_path) -> tuple[str, Path]:
    make_checkpoint(tmp_path / "ckpt")
    uri = f"{s3_bucket}/run/ckpt"
    for f in (tmp_path / "ckpt").iterdir():
        storage.upload_file(f, f"{uri}/{f.name}")
    return uri, tmp_path / "ckpt"


def test_ranks_measure_in_step_and_share_one_copy_of_a_remote_checkpoint_per_node(remote_checkpoint, tmp_path):
    uri, present = remote_checkpoint
    one_node = _run(uri, 1, str(present), tmp_path / "one")
    for rank in (0, 1):
        (total, count), calls = one_node[rank, "sums"]
        assert (total, count) == (15.0, 5.0)
        # rank 0 has rows 1, 3, 5 and rank 1 rows 2, 4: both run two batches, rank 1's second
        # repeats the first row and is not counted
        assert len(calls) == 2
    assert one_node[1, "sums"][1] == [[2, 4], [1]]
    (copy0, files0), (copy1, files1) = one_node[0, "copy"], one_node[1, "copy"]
    assert copy0 == copy1 and files0 == files1 and checkpoint.CHECKPOINT_MANIFEST in files0
    # one download on the node, by its first rank; reused once
    assert (one_node[0, "downloads"], one_node[1, "downloads"]) == (1, 0)
    assert one_node[0, "again"] and one_node[1, "again"]
    assert not one_node[0, "left"] and not one_node[1, "left"]  # removed once both were done
    assert one_node[0, "present"] == one_node[1, "present"] == (True, True)
    assert all(f"{uri}-missing" in one_node[rank, "missing"] for rank in (0, 1))  # both ranks fail

    two_nodes = _run(uri, 2, str(present), tmp_path / "two")
    assert two_nodes[0, "copy"][0] != two_nodes[1, "copy"][0]  # each node its own copy
    assert two_nodes[1, "copy"][1] == files0 and not two_nodes[0, "left"] and not two_nodes[1, "left"]
    assert two_nodes[0, "present"] == (True, True) and two_nodes[1, "present"] == (False, True)
    # node 1 has no driver's copy: it downloaded the checkpoint again for the last reads
    assert (two_nodes[0, "downloads"], two_nodes[1, "downloads"]) == (1, 2)


def test_a_copy_is_made_again_unless_it_matches_the_verified_manifest(remote_checkpoint, tmp_path, monkeypatch):
    uri, present = remote_checkpoint
    verified = storage.sha256_file(present / checkpoint.CHECKPOINT_MANIFEST)
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    target = checkpoint.private_temp_dir() / f"{checkpoint.TEMP_PREFIX}k"
    target.mkdir()
    (target / "model.safetensors").write_bytes(b"cut short")  # no manifest: a download killed midway
    assert checkpoint.run_copy(uri, "k", verified) == str(target)
    checkpoint.verify(str(target), model_only=True)  # every file whole again
    checkpoint.release_run_copy(str(target))
    weights = target / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:-1] + b"\0")  # changed after it was made
    assert checkpoint.run_copy(uri, "k", verified) == str(target)
    checkpoint.verify(str(target), model_only=True)
    with pytest.raises(ValueError, match="changed since"):  # not the checkpoint the driver verified
        checkpoint.run_copy(uri, "other", "0" * 64)
    assert [p.name for p in checkpoint.private_temp_dir().iterdir()] == [target.name]  # nothing left behind
    checkpoint.remove_run_copy(str(target))
    checkpoint.remove_run_copy(str(present))  # a checkpoint used where it is stays
    assert not target.exists() and present.exists()
    os.chmod(checkpoint.private_temp_dir(), 0o777)  # anyone could plant a copy there
    with pytest.raises(PermissionError, match="no one else"):
        checkpoint.run_copy(uri, "k")


HOLD = "import fcntl, os, sys, time; fd = os.open(sys.argv[1], os.O_RDONLY); fcntl.flock(fd, fcntl.LOCK_SH); print(1, flush=True); time.sleep(120)"


def test_copies_nobody_holds_go_a_day_after_their_last_use_and_held_ones_stay(remote_checkpoint, tmp_path, monkeypatch):
    uri, _ = remote_checkpoint
    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    private = checkpoint.private_temp_dir()
    copies = {name: Path(checkpoint.run_copy(uri, name)) for name in ("held", "left", "recent", "other")}
    for name in ("left", "recent", "other"):  # their runs ended, or failed for good
        checkpoint.release_run_copy(str(copies[name]))
    stalled, writing = private / f"{checkpoint.PARTIAL_PREFIX}stalled", private / f"{checkpoint.PARTIAL_PREFIX}now"
    for partial in (stalled, writing):
        partial.mkdir()
        (partial / "model.safetensors").write_bytes(b"part")
    day_ago = time.time() - checkpoint.STALE_RUN_COPY_S - 60
    for path in (copies["held"], copies["left"], copies["other"], stalled, stalled / "model.safetensors"):
        os.utime(path, (day_ago, day_ago))
    # another process reads "other": neither pruned nor removed under it, nor made again when
    # it fails to verify (an I/O error as it is read)
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(copies["other"])], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1"
        new = Path(checkpoint.run_copy(uri, "new"))  # prunes first
        kept = {copies[name].name for name in ("held", "recent", "other")} | {new.name, writing.name}
        assert {p.name for p in private.iterdir()} == kept
        checkpoint.remove_run_copy(str(copies["other"]))
        assert copies["other"].exists()
        with monkeypatch.context() as m:
            m.setattr(checkpoint, "verify", lambda *a, **k: (_ for _ in ()).throw(OSError("read failed")))
            with pytest.raises(RuntimeError, match="it is still read .by another process"):
                checkpoint.run_copy(uri, "other")
        assert (copies["other"] / checkpoint.CHECKPOINT_MANIFEST).exists()
    finally:
        holder.kill()
        holder.wait()
    os.utime(copies["other"], (day_ago, day_ago))
    assert checkpoint.prune_run_copies() == [copies["other"].name]  # nobody holds it now

    # a worker group that takes over after a run of more than a day reuses its predecessor's copy
    downloads = []
    download = checkpoint.download
    monkeypatch.setattr(checkpoint, "download", lambda *a, **k: (downloads.append(a[1]), download(*a, **k))[1])
    os.utime(copies["held"], (day_ago, day_ago))
    assert checkpoint.run_copy(uri, "held") == str(copies["held"]) and downloads == []
    os.utime(copies["held"], (day_ago, day_ago))
    checkpoint.release_run_copy(str(copies["held"]))
    assert copies["held"].stat().st_mtime < time.time() - checkpoint.STALE_RUN_COPY_S  # still used here
    checkpoint.release_run_copy(str(copies["held"]))  # its last use ends: the day starts again
    assert time.time() - copies["held"].stat().st_mtime < 60
    # a copy used twice in one process stays until both uses are done
    assert checkpoint.run_copy(uri, "new") == str(new)
    checkpoint.remove_run_copy(str(new))
    assert new.exists()
    checkpoint.remove_run_copy(str(new))
    checkpoint.remove_run_copy(str(copies["held"]))
    assert not new.exists() and not copies["held"].exists()


def test_a_copy_made_again_meanwhile_is_not_removed_and_a_held_copy_is_kept_fresh(tmp_path, monkeypatch):
    """A removal that locked a copy which another process then removed and made again (the lock
    is on the old directory) leaves the new copy. A copy this process holds is marked used by
    the thread `run_copy` starts, so a holder killed after a long run leaves a recent copy."""
    import fcntl
    import shutil
    import threading

    (tmp_path / "tmp").mkdir()
    monkeypatch.setattr("tempfile.tempdir", str(tmp_path / "tmp"))
    target = checkpoint.private_temp_dir() / f"{checkpoint.TEMP_PREFIX}remade"
    target.mkdir()
    (target / "weights").write_text("old")
    flock = fcntl.flock

    def remade_before_the_lock(fd, op):
        if op & fcntl.LOCK_EX:
            shutil.rmtree(target)
            target.mkdir()
            (target / "weights").write_text("new")
        return flock(fd, op)

    monkeypatch.setattr(checkpoint.fcntl, "flock", remade_before_the_lock)
    assert not checkpoint._remove_unless_held(target)
    monkeypatch.setattr(checkpoint.fcntl, "flock", flock)
    assert (target / "weights").read_text() == "new"

    fd = checkpoint._lock_shared(target)
    held = checkpoint._hold(target, fd)
    assert any(t.name == "lmfoundry-held-copies" and t.daemon for t in threading.enumerate())
    day_ago = time.time() - checkpoint.STALE_RUN_COPY_S - 60
    os.utime(target, (day_ago, day_ago))
    checkpoint.touch_held_copies()
    assert time.time() - target.stat().st_mtime < 60
    checkpoint.remove_run_copy(held)
    assert not target.exists()


def test_the_driver_reads_only_the_figures_of_the_checkpoint_it_committed(tmp_path):
    run = str(tmp_path / "run")
    with pytest.raises(RuntimeError, match="wrote no"):
        held_out.read_report(run, "checkpoints/step-00000008")
    held_out.write_report(run, f"{run}/checkpoints/step-00000008", {"assistant_loss": {"before": 2.0, "after": 1.0}})
    assert held_out.read_report(run, "checkpoints/step-00000008") == {"assistant_loss": {"before": 2.0, "after": 1.0}}
    with pytest.raises(RuntimeError, match="measured 'checkpoints/step-00000008', not checkpoints/step-00000004"):
        held_out.read_report(run, "checkpoints/step-00000004")  # measured on another checkpoint
    (tmp_path / "run" / held_out.REPORT).write_bytes(b" " * (held_out.MAX_REPORT_BYTES + 1))
    with pytest.raises(ValueError):
        held_out.read_report(run, "checkpoints/step-00000008")
