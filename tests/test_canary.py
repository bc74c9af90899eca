"""The canary analysis: the judge alone on a fake clock, and a live replica (uvicorn, no Ray)
that rolls back a canary whose replies the guardrail blocks more often, by itself, while a
stream to the canary is in flight."""

import json

import httpx
import pytest
import torch

from lmfoundry.serving import traffic
from lmfoundry.serving.canary import CanaryConfig, CanaryJudge

pytestmark = pytest.mark.timeout(180)


class Clock:
    now = 0.0

    def __call__(self) -> float:
        return self.now


def test_the_judge_names_each_bound_the_canary_broke_and_forgets_old_requests():
    clock = Clock()
    cfg = CanaryConfig(stable="v1", canary="v2", window_s=60, min_requests=10, max_latency_ratio=2.0)
    judge = CanaryJudge(cfg, clock)
    for i in range(100):
        judge.observe("v1", 200, 0.1)
        judge.observe("v2", 500 if i == 0 else 200, 0.1)
    assert judge.verdict() is None  # 1 error in 100: within +0.02
    for _ in range(200):
        judge.observe("v2", 200, 0.5)
    for _ in range(20):
        judge.blocked("v2")
    why = judge.verdict()
    assert "median latency" in why and "guardrail block rate" in why and "error rate" not in why
    clock.now = 61  # everything is outside the window: too few requests to judge
    assert judge.verdict() is None
    judge.probed("v1", refusal_rate=0.9, harmful_compliance_rate=0.0)
    judge.probed("v2", refusal_rate=0.5, harmful_compliance_rate=0.3)
    assert judge.verdict() is None  # probes are compared only when configured
    with_probes = CanaryConfig(stable="v1", canary="v2", probes={"file": "unused.jsonl"})
    probed = CanaryJudge(with_probes, clock)
    probed.probed("v1", refusal_rate=0.9, harmful_compliance_rate=0.0)
    probed.probed("v2", refusal_rate=0.5, harmful_compliance_rate=0.3)
    assert "refusal rate 0.50" in probed.verdict() and "harmful compliance 0.30" in probed.verdict()


def test_an_error_rate_over_the_bound_rolls_back():
    judge = CanaryJudge(CanaryConfig(stable="v1", canary="v2", min_requests=10), Clock())
    for i in range(10):
        judge.observe("v1", 200, 0.1)
        judge.observe("v2", 500 if i == 0 else 200, 0.1)
    assert "error rate 0.100" in judge.verdict()


def successor_checkpoint(path, trigger: int, after_trigger: int, otherwise: int, tokenizer: str):
    """A one-layer model that answers `after_trigger` to the token `trigger` and `otherwise` to
    every other token (its blocks add nothing; the output layer reads the last embedding)."""
    from lmfoundry.model.checkpoint import TOKENIZER, save_model_files
    from lmfoundry.model.transformer import ModelConfig, Transformer
    from lmfoundry.platform import checkpoint

    cfg = ModelConfig(
        vocab_size=400, max_seq_len=512, n_layer=1, d_model=32, n_head=2, n_kv_head=1, tie_embeddings=False
    )
    model = Transformer(cfg).eval()
    with torch.no_grad():
        for block in model.blocks:
            block.attn.wo.weight.zero_()
            block.mlp.w_down.weight.zero_()
        model.embed.weight.zero_()
        model.embed.weight[:, 1] = 1.0
        model.embed.weight[trigger] = 0.0
        model.embed.weight[trigger, 0] = 1.0
        model.lm_head.weight.zero_()
        model.lm_head.weight[otherwise, 1] = 10.0
        model.lm_head.weight[after_trigger, 0] = 10.0
    save_model_files(model, path)
    (path / TOKENIZER).write_text(tokenizer)
    checkpoint.seal(path, {"step": 0})
    return str(path)


def test_a_canary_with_more_guardrail_blocks_is_rolled_back_without_dropping_a_stream(
    inference_api, tiny_serving_checkpoint, tmp_path, capsys
):
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{tiny_serving_checkpoint}/tokenizer.json")

    def one_token(word: str) -> int:
        (token,) = tok.encode(word, add_special_tokens=False).ids
        return token

    dog, fox, the = one_token(" dog"), one_token(" fox"), one_token(" the")
    text = tok.to_str()
    # both answer " the the ..." to most prompts; after " dog", the canary says " fox" first
    stable = successor_checkpoint(tmp_path / "stable", dog, the, the, text)
    canary = successor_checkpoint(tmp_path / "canary", dog, fox, the, text)
    (tmp_path / "blocklist.txt").write_text("fox\n")
    split = str(tmp_path / "split.json")
    traffic.write_split(split, {"stable": 50.0, "canary": 50.0})
    inference_api.use(
        guardrails={"blocklist": str(tmp_path / "blocklist.txt"), "offensive_language": False},
        versions=[
            {"name": "stable", "checkpoint": stable, "weight": 50.0},
            {"name": "canary", "checkpoint": canary, "weight": 50.0},
        ],
        traffic_file=split,
        canary={
            "stable": "stable",
            "canary": "canary",
            "min_requests": 4,
            "check_every_s": 0.2,
            "max_latency_ratio": 100.0,  # latency is not what this canary gets wrong
        },
    )
    headers = {"Authorization": f"Bearer {inference_api.key}"}
    url = inference_api.url
    with httpx.Client(timeout=60, headers=headers) as client:
        body = {"model": "tiny:canary", "prompt": "The farmer watches", "max_tokens": 300, "stream": True}
        with client.stream("POST", f"{url}/v1/completions", json=body) as stream:
            events = stream.iter_lines()
            first = next(e for e in events if e.startswith("data: "))  # in flight on the canary
            assert json.loads(first[6:])["system_fingerprint"] == "canary"
            answered = []
            for i in range(80):
                prompt = "the lazy dog" if i % 2 else "the farmer"
                r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": prompt, "max_tokens": 3})
                assert r.status_code == 200, r.text
                answered.append(r.headers["x-lmfoundry-version"])
                if traffic.read_split_file(split)["weights"]["canary"] == 0:
                    break
            data = traffic.read_split_file(split)
            assert data["weights"] == {"stable": 100.0, "canary": 0.0}, answered
            rest = [json.loads(e[6:]) for e in events if e.startswith("data: {")]
        # the stream that was in flight on the canary ran to its end
        assert rest[-1]["choices"][0]["finish_reason"] == "length"
        assert "".join(c["choices"][0]["text"] for c in [json.loads(first[6:])] + rest).count(" the") == 300
    assert "automatic rollback" in data["reason"] and "guardrail block rate" in data["reason"]
    assert data["withdrawn"] == ["canary"]
    with httpx.Client(timeout=60, headers=headers) as client:
        pinned = client.post(f"{url}/v1/completions", json={"model": "tiny:canary", "prompt": "a", "max_tokens": 2})
        assert (
            pinned.status_code == 404 and "tiny:canary" not in pinned.json()["error"]["message"].split("available")[1]
        )
        ids = [m["id"] for m in client.get(f"{url}/v1/models").json()["data"]]
        assert ids == ["tiny", "tiny:stable"]
        for _ in range(4):  # within the replica's reload, everything goes to the stable version
            r = client.post(f"{url}/v1/completions", json={"model": "tiny", "prompt": "the lazy dog", "max_tokens": 2})
            assert r.headers["x-lmfoundry-version"] == "stable"
    assert traffic.main(["show", "--file", split]) == 0
    shown = capsys.readouterr().out
    assert "canary=0%  stable=100%" in shown and "why: automatic rollback" in shown and "withdrawn" in shown
    # an operator who gives the canary traffic again makes it pinnable again
    traffic.write_split(split, {"stable": 90.0, "canary": 10.0})
    assert traffic.read_split_file(split)["withdrawn"] == []
    inference_api.use()


def test_the_serve_config_checks_the_canary_names_and_needs_a_traffic_file():
    from pydantic import ValidationError

    from lmfoundry.serving.app import ServeConfig

    versions = [{"name": "v1", "checkpoint": "a", "weight": 1}, {"name": "v2", "checkpoint": "b"}]
    with pytest.raises(ValidationError, match="needs traffic_file"):
        ServeConfig(versions=versions, canary={"stable": "v1", "canary": "v2"})
    with pytest.raises(ValidationError, match=r"\['v3'\] not among the versions served"):
        ServeConfig(versions=versions, traffic_file="s.json", canary={"stable": "v1", "canary": "v3"})
    with pytest.raises(ValidationError, match="name two versions"):
        ServeConfig(versions=versions, traffic_file="s.json", canary={"stable": "v1", "canary": "v1"})
    with pytest.raises(ValidationError, match="must hold at least one block"):
        ServeConfig(checkpoint="a", engine={"prefix_cache": {"max_tokens": 8, "block_tokens": 16}})
