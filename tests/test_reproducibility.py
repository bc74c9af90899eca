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
            PackConfig(
                input=str(relaid), output=str(tmp_path / "packed"), vocab_size=1024, seq_len=64, val_fraction=0.1
            )
        )
    finally:
        ctx.target_max_block_size = block_size
    assert repacked["fingerprint"] == manifest["fingerprint"]
    assert repacked["splits"] == manifest["splits"]
    expected = shard_bytes(packed_dir)  # tokenizer.json, train/ and val/ (not the manifest)
    assert {"/tokenizer.json", "/train/part-00000.parquet", "/val/part-00000.parquet"} <= expected.keys()
    assert shard_bytes(tmp_path / "packed") == expected


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
