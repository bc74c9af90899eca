"""Every s3:// URI through the storage client production uses (pyarrow's S3 filesystem, endpoint
and credentials from the usual AWS variables), against a local S3-compatible server over HTTP.
The whole lifecycle in a bucket is tests/test_quickstart.py."""

import json

from lmfoundry.platform import keys, storage
from lmfoundry.serving.traffic import SplitSource, rollback, write_split


def test_a_stage_directory_in_a_bucket_commits_skips_and_clears_like_a_local_one(s3_bucket, tmp_path):
    stage = f"{s3_bucket}/curated"
    assert storage.prepare_output(stage)
    storage.write_bytes_atomic(f"{stage}/partial.parquet", b"half")
    assert storage.prepare_output(stage)  # not committed: cleared and redone
    assert not storage.exists(f"{stage}/partial.parquet")
    storage.write_jsonl_atomic(f"{stage}/part-0.jsonl", [{"text": "ä"}, {"text": "b"}])
    (tmp_path / "big.bin").write_bytes(b"x" * (9 << 20))  # more than one upload chunk
    storage.upload_file(tmp_path / "big.bin", f"{stage}/sub/big.bin")
    storage.commit(stage, "curate", {"n": 2})
    assert not storage.prepare_output(stage)  # committed: a rerun skips
    assert storage.read_manifest(stage)["n"] == 2
    assert storage.list_files(stage) == [f"{stage}/part-0.jsonl", f"{stage}/sub/big.bin"]  # no manifest, no temps
    assert storage.list_dirs(stage) == ["sub"]
    assert storage.read_jsonl(f"{stage}/part-0.jsonl") == [{"text": "ä"}, {"text": "b"}]
    assert storage.size(f"{stage}/sub/big.bin") == 9 << 20
    assert storage.sha256_uri(f"{stage}/sub/big.bin") == storage.sha256_file(tmp_path / "big.bin")
    storage.remove_dir(stage)
    assert not storage.exists(stage) and storage.list_files(stage) == []


def test_the_sample_corpus_is_written_into_the_bucket(s3_bucket):
    from lmfoundry.data.sample_corpus import build_sample_corpus

    details = build_sample_corpus(f"{s3_bucket}/raw", num_clean_docs=20, seed=1, shards=2)
    shards = storage.list_files(f"{s3_bucket}/raw")
    assert [s.rsplit("/", 1)[1] for s in shards] == ["part-00000.jsonl.gz", "part-00001.jsonl.gz"]
    rows = [json.loads(line) for s in shards for line in storage.read_bytes(s).splitlines()]  # .gz: read unzipped
    assert len(rows) == details["documents"]


def test_a_key_file_in_a_bucket_authenticates_and_revokes(s3_bucket):
    uri = f"{s3_bucket}/secrets/keys.json"
    key, record = keys.create_key(uri, "acme", ["admin"])
    auth = keys.Authenticator(uri, [], reload_s=0.0)
    who = auth.principal(f"Bearer {key}")
    assert (who.tenant, set(who.roles)) == ("acme", {"admin"})
    keys.revoke_key(uri, record["id"])
    assert auth.principal(f"Bearer {key}") is None  # re-read from the bucket
    assert auth.reload_failures == 0


def test_a_traffic_file_in_a_bucket_shifts_and_rolls_back_the_split(s3_bucket):
    uri = f"{s3_bucket}/traffic.json"
    source = SplitSource(["v1", "v2"], {"v1": 0.0, "v2": 1.0}, uri, reload_s=0.0)
    assert source.current().pick("anyone") == "v2"  # no file yet: the config's weights
    write_split(uri, {"v1": 1.0, "v2": 0.0})
    assert source.current().pick("anyone") == "v1"
    write_split(uri, {"v1": 0.0, "v2": 1.0})
    assert source.current().pick("anyone") == "v2"
    rollback(uri)
    assert source.current().pick("anyone") == "v1"


def test_red_team_regressions_are_saved_to_and_replayed_from_a_bucket(s3_bucket):
    from test_eval import Parrot

    from lmfoundry.eval import redteam

    cfg = redteam.RedTeamConfig(families=["injection"], attacks_per_family=3, seed=5)
    uri = f"{s3_bucket}/eval/redteam_regression.jsonl"
    first = redteam.run_redteam(Parrot(), cfg, uri)
    saved = storage.read_jsonl(uri)
    assert len(saved) == first["attack_success_rate"]["count"] == 3
    replay = redteam.run_redteam(Parrot(), cfg.model_copy(update={"replay": [uri], "seed": 6}))
    assert replay["replay"]["attacks"] == 3


def test_a_needle_haystack_is_read_from_a_bucket(s3_bucket):
    import random

    from lmfoundry.eval.needle import NeedleConfig, filler_sentences

    storage.write_bytes_atomic(f"{s3_bucket}/haystack.txt", b"The sky is blue. Water is wet. Ice is cold.")
    cfg = NeedleConfig(haystack=f"{s3_bucket}/haystack.txt")
    assert filler_sentences(cfg, random.Random(0)) == ["The sky is blue.", "Water is wet.", "Ice is cold."]
