"""Reproducible by construction: the same inputs, config and seed give byte-identical shards,
whatever the parallelism, the number of blocks or the layout of the input files."""

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lmfoundry.data.pack import ShardWriter, order_key
from lmfoundry.platform import storage

pytestmark = pytest.mark.timeout(600)


def shard_bytes(root) -> dict[str, bytes]:
    return {f[len(str(root)) :]: open(f, "rb").read() for f in storage.list_files(str(root))}


def test_the_shards_depend_on_the_document_order_alone_not_on_how_it_is_batched(tmp_path):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 500, size=int(rng.integers(1, 40)), dtype=np.int32) for _ in range(300)]
    outputs = []
    for name, cuts in (("one", [300]), ("many", [1, 7, 50, 51, 120, 299, 300])):
        writer = ShardWriter(str(tmp_path / name), sample_len=17, per_shard=40, per_group=8)
        start = 0
        for end in cuts:
            writer.add(pa.array(docs[start:end], pa.list_(pa.int32())))
            start = end
        outputs.append((writer.close(), shard_bytes(tmp_path / name)))
    (stats, files), (stats_again, files_again) = outputs
    assert stats == stats_again and files == files_again
    total = sum(len(d) for d in docs)
    assert stats["sequences"] == total // 17 and stats["tokens_dropped"] == total % 17
    assert stats["shards"] == len(files) == -(-stats["sequences"] // 40)
    rows = np.concatenate(
        [np.stack(pq.read_table(f"{tmp_path}/one{f}").column("tokens").to_numpy(False)) for f in sorted(files)]
    )
    assert np.array_equal(rows.ravel(), np.concatenate(docs)[: stats["sequences"] * 17])


def test_a_writer_resumed_after_a_kill_keeps_the_full_shards_and_writes_the_same_bytes(tmp_path):
    """A pack killed while writing: the full shards stay, the short last one and anything after a
    gap go, and a writer given the same stream from the start writes the rest byte for byte."""
    from lmfoundry.data.pack import full_shards

    rng = np.random.default_rng(0)
    docs = pa.array(
        [rng.integers(0, 500, size=int(rng.integers(1, 40)), dtype=np.int32) for _ in range(300)], pa.list_(pa.int32())
    )
    whole = ShardWriter(str(tmp_path / "whole"), sample_len=17, per_shard=40, per_group=8)
    whole.add(docs)
    stats, expected = whole.close(), shard_bytes(tmp_path / "whole")
    last = f"/part-{stats['shards'] - 1:05d}.parquet"
    assert stats["shards"] >= 5 and pq.read_metadata(f"{tmp_path}/whole{last}").num_rows < 40
    killed = tmp_path / "killed"
    for name, data in expected.items():  # every shard but 2 and the short last one was written
        if name not in ("/part-00002.parquet", last):
            (killed / name.lstrip("/")).parent.mkdir(exist_ok=True)
            (killed / name.lstrip("/")).write_bytes(data)
    assert full_shards(str(killed), 40) == 2 and not (killed / "part-00003.parquet").exists()
    resumed = ShardWriter(str(killed), sample_len=17, per_shard=40, per_group=8, shards_done=2)
    for start in range(0, 300, 64):
        resumed.add(docs[start : start + 64])
    assert resumed.close() == stats and shard_bytes(killed) == expected


def test_the_tokenised_files_merge_into_the_order_of_one_sort(tmp_path):
    """Each input file's documents sorted by (order key, id) on their own, then merged: the order a
    sort of the whole corpus gives."""
    from lmfoundry.data.pack import ORDER, merged

    rng = np.random.default_rng(1)
    keys = rng.integers(0, 1000, 200).astype(np.uint64)  # repeated keys: the id breaks the tie
    ids = [f"doc-{i:03d}" for i in rng.permutation(200)]
    table = pa.table(
        {
            ORDER: pa.array(keys, pa.uint64()),
            "id": ids,
            "ids": pa.array([np.full(3, i, np.int32) for i in range(200)], pa.list_(pa.int32())),
            "val": pa.array(rng.random(200) < 0.2),
        }
    )
    files = []
    for n, part in enumerate(np.array_split(rng.permutation(200), 4)):
        piece = table.take(part).sort_by([(ORDER, "ascending"), ("id", "ascending")])
        files.append(str(tmp_path / f"{n}.parquet"))
        pq.write_table(piece, files[-1], row_group_size=9)
    expected = table.sort_by([(ORDER, "ascending"), ("id", "ascending")])
    got = list(merged(files, "id", batch_rows=5))
    assert [int(t[0]) for t, _ in got] == [row[0] for row in expected.column("ids").to_pylist()]
    assert [v for _, v in got] == expected.column("val").to_pylist()


def test_the_order_key_is_seeded_and_tells_apart_documents_that_share_an_id():
    assert order_key(0, "a", "x") == order_key(0, "a", "x")
    assert order_key(0, "a", "x") != order_key(1, "a", "x")
    assert order_key(0, "a", "x") != order_key(0, "a", "y")
    assert order_key(0, "ab", "c") != order_key(0, "a", "bc")


def test_curate_and_pack_again_with_other_parallelism_and_blocks_give_byte_identical_shards(
    curated, packed, sample_corpus, tmp_path
):
    import ray

    from lmfoundry.data.curate import CurateConfig, run_curate
    from lmfoundry.data.pack import PackConfig, run_pack

    curated_dir, _ = curated
    packed_dir, manifest = packed
    # curate again with one worker and other batch sizes: the same kept and rejected bytes
    again = run_curate(CurateConfig(input=sample_corpus[0], output=str(tmp_path / "curated"), workers=1, batch_rows=37))
    assert again["documents_kept"] == pq.read_table(f"{curated_dir}/kept").num_rows
    first, second = storage.read_manifest(curated_dir), storage.read_manifest(str(tmp_path / "curated"))
    assert first["fingerprint"] == second["fingerprint"]
    assert shard_bytes(f"{curated_dir}/kept") == shard_bytes(tmp_path / "curated" / "kept")

    # the kept documents shuffled into five files, read in small blocks: the same packed bytes
    kept = pq.read_table(f"{curated_dir}/kept")
    kept = kept.take(np.random.default_rng(1).permutation(kept.num_rows))
    relaid = tmp_path / "relaid"
    relaid.mkdir()
    for i, part in enumerate(np.array_split(np.arange(kept.num_rows), 5)):
        pq.write_table(kept.take(part), relaid / f"{i}.parquet", row_group_size=7)
    ctx = ray.data.DataContext.get_current()
    block_size = ctx.target_max_block_size
    ctx.target_max_block_size = 32 * 1024
    try:
        repacked = run_pack(
            PackConfig(**{**pack_settings(manifest), "input": str(relaid), "output": str(tmp_path / "packed")})
        )
    finally:
        ctx.target_max_block_size = block_size
    assert repacked["fingerprint"] == manifest["fingerprint"]
    assert repacked["splits"] == manifest["splits"]
    expected = shard_bytes(packed_dir)  # tokenizer.json, train/ and val/ (not the manifest)
    assert {"/tokenizer.json", "/train/part-00000.parquet", "/val/part-00000.parquet"} <= expected.keys()
    assert shard_bytes(tmp_path / "packed") == expected


def test_a_killed_pack_resumes_and_writes_the_bytes_of_an_uninterrupted_run(packed, tmp_path, monkeypatch, caplog):
    """A pack that dies while writing its second shard (an error raised there), rerun: the input
    files tokenised before stay tokenised, the shard written before stays, and the output is the
    uninterrupted run's (the session's packed data) byte for byte."""
    import logging

    from lmfoundry.data import pack
    from lmfoundry.data.pack import PackConfig, run_pack

    packed_dir, manifest = packed
    assert manifest["splits"]["train"]["shards"] >= 2
    cfg = PackConfig(**{**pack_settings(manifest), "output": str(tmp_path / "packed")})
    write = pack.ShardWriter._write
    writes = []

    def dies_on_the_second_shard(self, n_tokens):
        if self.out_dir.endswith("train"):
            writes.append(n_tokens)
            if len(writes) == 2:
                raise RuntimeError("the driver died here")
        write(self, n_tokens)

    monkeypatch.setattr(pack.ShardWriter, "_write", dies_on_the_second_shard)
    with pytest.raises(RuntimeError, match="died"):
        run_pack(cfg)
    monkeypatch.setattr(pack.ShardWriter, "_write", write)
    out = tmp_path / "packed"
    first = out / "train" / "part-00000.parquet"
    written_at = first.stat().st_mtime_ns
    tokens = sorted((out / "_work" / "tokens").iterdir())
    assert len(tokens) == 2 and not (out / "_MANIFEST.json").exists()
    tokens[1].unlink()  # as if killed while tokenising the second file
    with caplog.at_level(logging.INFO, logger="lmfoundry.data.pack"):
        resumed = run_pack(cfg)
    assert "1 of 2 files tokenised now, 1 by the run resumed" in caplog.text
    assert first.stat().st_mtime_ns == written_at
    assert resumed["fingerprint"] == manifest["fingerprint"] and resumed["splits"] == manifest["splits"]
    assert shard_bytes(out) == shard_bytes(packed_dir)


def pack_settings(manifest: dict) -> dict:
    """The session's pack config, from its manifest and conftest's fixture."""
    return {
        "input": manifest["input"],
        "vocab_size": 1024,
        "seq_len": manifest["seq_len"],
        "val_fraction": 0.1,
        "rows_per_group": manifest["rows_per_group"],
        "sequences_per_shard": manifest["sequences_per_shard"],
    }


def test_synthetic_data_is_byte_identical_for_the_same_seed(tmp_path):
    from lmfoundry.align.synth import SynthConfig, run_synth

    def fingerprint(name: str, seed: int) -> str:
        run_synth(SynthConfig(output=str(tmp_path / name), kinds={"arithmetic": 30, "algebra": 30}, seed=seed))
        return storage.read_manifest(str(tmp_path / name))["fingerprint"]

    assert fingerprint("a", 0) == fingerprint("b", 0) != fingerprint("c", 1)


def test_deterministic_mode_sets_the_gpu_workers_environment_and_the_models_run_under_it(monkeypatch):
    import torch

    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.train.launch import DETERMINISTIC_GPU_ENV, worker_env
    from lmfoundry.train.skeleton import use_deterministic_kernels

    monkeypatch.delenv("NCCL_ALGO", raising=False)
    assert worker_env(use_gpu=True) == {}
    assert worker_env(use_gpu=True, deterministic=True) == DETERMINISTIC_GPU_ENV
    monkeypatch.setenv("NCCL_ALGO", "Tree")  # the user's deterministic choice wins
    assert worker_env(use_gpu=True, deterministic=True)["NCCL_ALGO"] == "Tree"
    monkeypatch.setenv("NCCL_ALGO", "NVLS")  # not one of them: replaced
    assert worker_env(use_gpu=True, deterministic=True)["NCCL_ALGO"] == "Ring"

    # every op of the dense and MoE model has a deterministic implementation: none raises
    cfg = ModelConfig(
        vocab_size=64,
        max_seq_len=16,
        n_layer=2,
        d_model=32,
        n_head=4,
        n_kv_head=2,
        moe=MoEConfig(num_experts=4, top_k=2),
    )
    try:
        use_deterministic_kernels()
        losses = []
        for _ in range(2):
            torch.manual_seed(0)
            model = Transformer(cfg)
            x = torch.randint(0, 64, (2, 17))
            _, loss = model(x[:, :-1], x[:, 1:])
            loss.backward()
            losses.append((loss.item(), model.embed.weight.grad.sum().item()))
        assert losses[0] == losses[1]
    finally:
        torch.use_deterministic_algorithms(False)
        torch.backends.cudnn.deterministic = False
