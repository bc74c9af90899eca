"""Tenant keys and rate limits without Ray."""

import json
import math

import pytest

from lmfoundry.platform.keys import Authenticator, create_key, digest, read_store, revoke_key
from lmfoundry.serving.ratelimit import RateLimits, TenantBuckets


class Clock:
    def __init__(self):
        self.now = 1000.0

    def __call__(self):
        return self.now


def test_keys_are_stored_hashed_tied_to_tenants_and_revocable(tmp_path):
    store = str(tmp_path / "sub" / "keys.json")
    key_a, rec_a = create_key(store, "acme")
    key_b, _ = create_key(store, "beta-corp")
    text = (tmp_path / "sub" / "keys.json").read_text()
    assert key_a not in text and key_b not in text and rec_a["sha256"] == digest(key_a)
    auth = Authenticator(store, [digest("env-key")], reload_s=0)
    assert auth.principal(f"Bearer {key_a}").tenant == "acme"
    assert auth.principal(f"Bearer {key_b}").tenant == "beta-corp"
    assert auth.principal("Bearer env-key").tenant == "default"
    assert auth.principal(key_a) is None  # not a Bearer header
    assert auth.principal("Bearer sk-lmf-guess") is None and auth.principal(None) is None
    revoke_key(store, rec_a["id"])
    assert auth.principal(f"Bearer {key_a}") is None  # re-read: revoked at once with reload_s=0
    assert auth.principal(f"Bearer {key_b}").tenant == "beta-corp"
    assert [r["revoked"] is not None for r in read_store(store)] == [True, False]


def test_key_store_input_errors_name_what_is_wrong(tmp_path):
    store = str(tmp_path / "keys.json")
    with pytest.raises(ValueError, match="tenant 'a b'"):
        create_key(store, "a b")
    with pytest.raises(ValueError, match="no key with id 'key_x'"):
        revoke_key(store, "key_x")
    (tmp_path / "keys.json").write_text(json.dumps([1, 2]))
    with pytest.raises(ValueError, match="not an lmfoundry key file"):
        read_store(store)


def test_request_and_token_buckets_refill_over_a_minute():
    clock = Clock()
    limits = RateLimits.model_validate(
        {"default": {"requests_per_minute": 3}, "tenants": {"big": {"tokens_per_minute": 600}}}
    )
    buckets = TenantBuckets(limits, clock)
    assert [buckets.admit("small", 10)[0] for _ in range(3)] == [0, 0, 0]
    wait, why = buckets.admit("small", 10)
    assert wait == pytest.approx(20.0) and "3 requests per minute" in why  # one request back every 20 s
    clock.now += 20
    assert buckets.admit("small", 10)[0] == 0
    # tokens: 600 a minute = 10 a second; the request's charge is what it may use
    assert buckets.admit("big", 500)[0] == 0
    wait, why = buckets.admit("big", 200)
    assert wait == pytest.approx(10.0) and "600 tokens per minute" in why
    buckets.refund("big", 100)  # it generated less than max_tokens
    assert buckets.admit("big", 200)[0] == 0
    wait, why = buckets.admit("big", 601)
    assert math.isinf(wait) and "more than tenant 'big'" in why
    assert buckets.admit("other-tenant", 10)[0] == 0  # tenants do not share buckets
    assert not RateLimits().limited() and limits.limited()


def test_traffic_split_by_weight_sticky_per_user_with_rollback_history(tmp_path):
    from lmfoundry.serving.traffic import SplitSource, TrafficSplit, check_weights, rollback, write_split

    split = TrafficSplit({"v1": 90, "v2": 10})
    picks = [split.pick() for _ in range(4000)]
    assert 0.07 < picks.count("v2") / len(picks) < 0.13
    assert len({split.pick("alice") for _ in range(20)}) == 1  # a user stays on one version
    users = [split.pick(f"user-{i}") for i in range(2000)]
    assert 0.07 < users.count("v2") / len(users) < 0.13
    assert TrafficSplit({"v1": 0, "v2": 5}).pick() == "v2"
    with pytest.raises(ValueError, match="unknown versions \\['v3'\\]"):
        check_weights({"v3": 1}, ["v1", "v2"])
    with pytest.raises(ValueError, match="not all 0"):
        check_weights({"v1": 0}, ["v1", "v2"])

    path = str(tmp_path / "split.json")
    source = SplitSource(["v1", "v2"], {"v1": 1, "v2": 0}, path, reload_s=0)
    assert source.current().weights == {"v1": 1}  # no file yet: the config's weights
    write_split(path, {"v1": 50.0, "v2": 50.0})
    write_split(path, {"v1": 0.0, "v2": 100.0})
    assert source.current().weights == {"v2": 100.0}
    rollback(path)
    assert source.current().weights == {"v1": 50.0, "v2": 50.0}
    with pytest.raises(ValueError, match="no earlier split"):
        rollback(path)
    (tmp_path / "split.json").write_text('{"weights": {"v9": 1}, "history": []}')
    assert source.current().weights == {"v1": 50.0, "v2": 50.0}  # a bad file keeps the last good split


def test_serve_config_scaling_and_versions_are_checked(tmp_path):
    from lmfoundry.serving.app import ServeConfig

    cfg = ServeConfig(checkpoint="ckpt", autoscaling={"min_replicas": 1, "max_replicas": 3})
    assert cfg.served_versions()[0].name == "main"
    with pytest.raises(ValueError, match="min_replicas=4 is above max_replicas=2"):
        ServeConfig(checkpoint="ckpt", autoscaling={"min_replicas": 4, "max_replicas": 2})
    with pytest.raises(ValueError, match="either checkpoint .* or versions"):
        ServeConfig(checkpoint="ckpt", versions=[{"name": "v1", "checkpoint": "a", "weight": 1}])
    with pytest.raises(ValueError, match="either checkpoint"):
        ServeConfig()
    with pytest.raises(ValueError, match="names must be unique"):
        ServeConfig(versions=[{"name": "v1", "checkpoint": "a", "weight": 1}, {"name": "v1", "checkpoint": "b"}])
    with pytest.raises(ValueError, match="at least one weight"):
        ServeConfig(versions=[{"name": "v1", "checkpoint": "a"}])
