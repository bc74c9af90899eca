import pytest

from lmfoundry.platform import checkpoint, storage


def test_prepare_output_skips_committed_and_clears_partial(tmp_path):
    d = str(tmp_path / "stage")
    assert storage.prepare_output(d)
    (tmp_path / "stage" / "partial.bin").write_bytes(b"x")
    assert storage.prepare_output(d)  # not committed: cleared and redone
    assert not (tmp_path / "stage" / "partial.bin").exists()
    storage.commit(d, "curate", {"n": 1})
    assert not storage.prepare_output(d)  # committed: a rerun skips
    assert storage.read_manifest(d)["n"] == 1
    assert storage.prepare_output(d, overwrite=True) and not storage.is_committed(d)


def test_read_manifest_of_unfinished_stage_is_a_clear_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="not the committed output"):
        storage.read_manifest(str(tmp_path))


def test_atomic_write_leaves_no_temporary_files(tmp_path):
    storage.write_json_atomic(str(tmp_path / "a" / "r.json"), {"k": 1})
    assert [p.name for p in (tmp_path / "a").iterdir()] == ["r.json"]
    assert storage.read_json(str(tmp_path / "a" / "r.json")) == {"k": 1}


def test_list_files_filters_suffix_and_hidden(tmp_path):
    for name in ("b.parquet", "a.parquet", "_MANIFEST.json", ".x.parquet", "c.txt"):
        (tmp_path / name).write_text("x")
    assert [p.rsplit("/", 1)[1] for p in storage.list_files(str(tmp_path), (".parquet",))] == ["a.parquet", "b.parquet"]


def test_checkpoint_seal_verify_detects_corruption_and_missing_manifest(tmp_path):
    (tmp_path / "w.bin").write_bytes(b"weights")
    checkpoint.seal(tmp_path, {"step": 3})
    assert checkpoint.verify(tmp_path)["step"] == 3
    (tmp_path / "w.bin").write_bytes(b"weightz")
    with pytest.raises(ValueError, match="checksum"):
        checkpoint.verify(tmp_path)
    (tmp_path / "manifest.json").unlink()
    with pytest.raises(FileNotFoundError, match="not a checkpoint"):
        checkpoint.verify(tmp_path)


def test_a_bounded_read_refuses_what_is_not_a_regular_file_and_what_holds_more_than_the_limit(tmp_path):
    import os

    from lmfoundry.platform import storage

    fifo = tmp_path / "tokenizer.json"
    os.mkfifo(fifo)  # a read of it would block forever: refused before it is opened
    with pytest.raises(ValueError, match="is not a regular file"):
        storage.read_bytes(str(fifo), limit=10)
    with pytest.raises(ValueError, match="is not a regular file"):
        storage.read_bytes(str(tmp_path), limit=10)
    big = tmp_path / "big.json"
    big.write_bytes(b"x" * 11)
    with pytest.raises(ValueError, match="holds more than 10 bytes"):
        storage.read_bytes(str(big), limit=10)
    assert storage.read_bytes(str(big), limit=11) == b"x" * 11
