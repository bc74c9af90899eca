"""Each stage on tiny inputs with real Ray, real DeepSpeed (2 CPU workers, gloo, ZeRO-2)."""

import json

import numpy as np
import pyarrow.parquet as pq
import pytest
from tokenizers import Tokenizer

pytestmark = pytest.mark.timeout(900)


def tensorboard_scalars(path: str) -> dict[str, list[tuple[int, float]]]:
    """The scalars of a TensorBoard event file (TFRecord framing: length, its CRC, data, its CRC)."""
    import struct

    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    data = open(path, "rb").read()
    pos = 0
    while pos < len(data):
        (length,) = struct.unpack("<Q", data[pos : pos + 8])
        event = Event.FromString(data[pos + 12 : pos + 12 + length])
        pos += 12 + length + 4
        for value in event.summary.value:
            out.setdefault(value.tag, []).append((event.step, value.simple_value))
    return out


def test_curate_removes_noise_and_records_every_rejection(curated, sample_corpus):
    out, report = curated
    details = sample_corpus[1]
    kept = pq.read_table(f"{out}/kept").to_pandas()
    rejected = pq.read_table(f"{out}/rejected").to_pandas()
    assert len(kept) + len(rejected) == details["documents"] == report["documents_in"]
    assert (rejected["reason"] != "").all() and (kept["reason"] == "").all()
    # the generated noise is gone from kept/: spam, keyword lists, too-short pages
    assert not kept["noise"].isin(["spam", "keyword_list", "too_short"]).any()
    # one copy of each exact duplicate survives, and no text appears twice
    assert kept["text"].is_unique and kept["id"].is_unique
    assert (rejected["reason"] == "exact_duplicate").sum() > 0
    # boilerplate lines were stripped from the real documents that had them
    assert not kept["text"].str.contains("cookie policy|Share on Facebook").any()
    assert report["rejected_by_reason"] == rejected["reason"].value_counts().to_dict()
    assert json.load(open(f"{out}/report.json"))["documents_kept"] == len(kept)


def test_curate_rerun_skips_committed_output(curated, sample_corpus):
    from lmfoundry.data.curate import CurateConfig, run_curate

    out, report = curated
    before = sorted(p.name for p in __import__("pathlib").Path(out, "kept").iterdir())
    again = run_curate(CurateConfig(input=sample_corpus[0], output=out))
    assert again == report
    assert sorted(p.name for p in __import__("pathlib").Path(out, "kept").iterdir()) == before


def test_pack_writes_fixed_length_sequences_and_a_tokenizer(packed, curated):
    out, manifest = packed
    tok = Tokenizer.from_file(f"{out}/tokenizer.json")
    assert tok.get_vocab_size() == manifest["vocab_size"] <= 1024
    text = "def f(x):\n    return x  # überall"
    assert tok.decode(tok.encode(text).ids) == text  # byte-level: lossless
    train = pq.read_table(f"{out}/train").column("tokens").to_numpy(zero_copy_only=False)
    seqs = np.stack(train)
    assert seqs.shape[1] == manifest["seq_len"] + 1 == 65
    assert seqs.max() < manifest["vocab_size"] and (seqs == manifest["eos_id"]).any()
    split = manifest["splits"]["train"]
    assert split["sequences"] == len(seqs)
    assert split["tokens_in"] - split["tokens_dropped"] == seqs.size
    assert manifest["splits"]["val"]["sequences"] > 0


def test_pretrain_with_deepspeed_lowers_the_loss_and_writes_a_self_describing_checkpoint(pretrained, packed):
    from lmfoundry.platform import checkpoint

    out, manifest = pretrained
    assert manifest["steps"] == 40
    assert manifest["final_loss"] < manifest["first_loss"] - 0.5
    ckpt = checkpoint.resolve(out)
    meta = checkpoint.verify(ckpt)
    assert {"model.safetensors", "model_config.json", "tokenizer.json", "train_state.json"} <= set(meta["files"])
    state = json.load(open(f"{ckpt}/train_state.json"))
    assert state["step"] == 40 and state["config"]["parallelism"]["zero_stage"] == 2
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    assert [r["step"] for r in rows] == list(range(1, 41))
    # rolling retention: the newest two of the checkpoints at 10, 20, 30, 40
    assert [step for step, _ in checkpoint.committed_checkpoints(out)] == [30, 40]
    assert all(r["tokens_per_s"] > 0 and r["tflops_per_worker"] > 0 and "mfu" not in r for r in rows)
    assert all(len(r["worker_busy_s"]) == 2 and min(r["worker_busy_s"]) > 0 for r in rows)
    assert open(f"{out}/loss.png", "rb").read(8) == b"\x89PNG\r\n\x1a\n"
    scalars = tensorboard_scalars(f"{out}/tensorboard/events.out.tfevents.lmfoundry")
    assert [step for step, _ in scalars["train/loss"]] == list(range(1, 41))
    assert [v for _, v in scalars["train/loss"]] == pytest.approx([r["loss"] for r in rows], rel=1e-6)
    assert json.load(open(f"{ckpt}/model_config.json"))["vocab_size"] == packed[1]["vocab_size"]


def mlflow_runs(store: str, experiment: str):
    from mlflow.tracking import MlflowClient

    client = MlflowClient(store)
    return client, client.search_runs([client.get_experiment_by_name(experiment).experiment_id])


def test_pretrain_logs_every_step_to_mlflow(pretrained, mlflow_store):
    """MLflow through Ray Train's integration (rank 0). (The run's live series in Ray's metrics
    export are gone by the time this runs: the session's reference run ended long before, and the
    export drops a dead worker's gauges; test_metrics.py reads series back from the export.)"""
    out, manifest = pretrained
    client, runs = mlflow_runs(mlflow_store, "lmfoundry-tests")
    (run,) = [r for r in runs if r.info.run_name == "tiny"]
    rows = [json.loads(line) for line in open(f"{out}/metrics.jsonl")]
    loss = client.get_metric_history(run.info.run_id, "loss")
    assert [(m.step, m.value) for m in loss] == [(r["step"], pytest.approx(r["loss"])) for r in rows]
    assert {"tokens_per_s", "grad_norm", "lr", "checkpoint_blocking_s"} <= set(run.data.metrics)
    assert run.data.params["parallelism.zero_stage"] == "2" and run.data.tags["lmfoundry.resumed_from_step"] == "0"


def test_evaluate_perplexity_beats_uniform_and_logs_to_mlflow(pretrained, packed, mlflow_store, tmp_path):
    from lmfoundry.eval.suite import EvaluateConfig, run_evaluate

    mlflow = {"tracking_uri": mlflow_store, "experiment": "lmfoundry-eval-tests"}
    full = run_evaluate(
        EvaluateConfig(checkpoint=pretrained[0], data=packed[0], output=str(tmp_path / "ev"), mlflow=mlflow)
    )
    _, (run,) = mlflow_runs(mlflow_store, "lmfoundry-eval-tests")
    assert run.info.run_name == "ev" and run.data.metrics == pytest.approx(full["metrics"])
    report = full["language_modelling"]["token_shards"]
    assert report["sequences"] == packed[1]["splits"]["val"]["sequences"]
    assert report["tokens"] == report["sequences"] * 64
    assert report["perplexity"] < 0.5 * report["uniform_perplexity"]
    # bits per byte: the same total log-likelihood over the UTF-8 bytes the tokens decode to
    import pyarrow.parquet as pq
    from tokenizers import Tokenizer

    tok = Tokenizer.from_file(f"{packed[0]}/tokenizer.json")
    seqs = pq.read_table(f"{packed[0]}/val").column("tokens").to_pylist()
    text_bytes = sum(len(tok.decode(s[1:], skip_special_tokens=True).encode()) for s in seqs)
    assert report["bytes"] == text_bytes
    assert report["bits_per_byte"] == pytest.approx(report["loss"] * report["tokens"] / (np.log(2) * text_bytes))
    assert json.load(open(tmp_path / "ev" / "eval.json"))["metrics"]["lm.perplexity"] == report["perplexity"]
    # the fast in-process path (what pretraining runs on each checkpoint) gives the same figure
    from lmfoundry.eval.perplexity import perplexity
    from lmfoundry.platform.checkpoint import resolve

    local = perplexity(resolve(pretrained[0]), packed[0], "val", use_ray=False)
    assert local["perplexity"] == pytest.approx(report["perplexity"], rel=1e-6)


def test_pretrain_moe_with_expert_parallelism_matches_without_and_moves_between_layouts(
    deepspeed_workers, packed, tmp_path
):
    """The same MoE run on 2 DeepSpeed workers with the experts replicated (data parallel), and
    on 2 in one tensor-parallel group with sequence parallelism, each rank routing its half of
    every sequence to the experts the group splits, its worker of rank 1 killed while saving step
    12 and the run resumed from step 6. Same losses and gradient norms within 1e-4 relative,
    step by step, and the same routing decisions.
    And the same again across layout moves through a universal checkpoint, each side's experts
    split its own way: the tensor-parallel run's step 6 finished on 4 workers in 2 pipeline
    stages whose 2 replicas each split their block's experts (ZeRO-1), its worker of rank 1
    killed while saving step 12 and resumed from its own step 9; that step 9 finished in the
    tensor-parallel layout. And the replicated run's step 6 finished by an elastic run
    (min_workers=1) with expert_parallel_size=2 on a cluster of training nodes
    (benchmarks/harness/elastic_drill.py): 2 workers splitting the experts from step 7, a node
    removed after step 9, so one worker holding every expert goes on from step 8, and added back
    after step 11, so 2 workers splitting the experts go on from step 10."""
    import torch
    from conftest import stopped_at
    from harness.elastic_drill import run_elastic_drill

    from lmfoundry.model.checkpoint import load_model_files
    from lmfoundry.model.moe import MoEConfig
    from lmfoundry.model.transformer import ModelConfig
    from lmfoundry.platform import checkpoint
    from lmfoundry.platform.ray_env import init_ray
    from lmfoundry.train.config import FaultDrill, PretrainConfig
    from lmfoundry.train.engine import wsd_schedule
    from lmfoundry.train.pretrain import run_pretrain

    moe = MoEConfig(num_experts=4, top_k=2, score_func="sigmoid", balance="aux_free", bias_update_rate=0.01)
    ep1 = {"num_workers": 2, "zero_stage": 2}
    ep2 = {"num_workers": 2, "zero_stage": 2, "expert_parallel_size": 2}
    pp2_ep2 = {"num_workers": 4, "zero_stage": 1, "pipeline_parallel_size": 2, "expert_parallel_size": 2}
    tp2_ep2 = {"num_workers": 2, "tensor_parallel_size": 2, "sequence_parallel": True, "expert_parallel_size": 2}
    # the step each killed run resumes from: rank 1 is killed while saving step 12, and saves go
    # one at a time, so the one before is committed by then (a kill after a step could beat the
    # save before it, and a move's run would resume from the checkpoint it moved from)
    killed = {"tp2-ep2": 6, "tp2-to-pp2": 9}

    def config(name: str, parallelism: dict, every: int = 6) -> PretrainConfig:
        return PretrainConfig(
            data=packed[0],
            output=str(tmp_path / name),
            model=ModelConfig(n_layer=2, d_model=64, n_head=4, n_kv_head=2, moe=moe),
            parallelism=parallelism,
            batch={"micro_batch_size": 4, "global_batch_tokens": 2 * 4 * 64},
            schedule={"max_steps": 12, "warmup_steps": 2, "kind": "wsd", "decay_fraction": 0.25},
            optimizer={"lr": 5e-3},
            checkpointing={"every": every},
            logging={"every": 1},
            drills=[FaultDrill(at_step=12, rank=1, during_save=True)] if name in killed else [],
        )

    def run(name: str, parallelism: dict, every: int = 6) -> PretrainConfig:
        cfg = config(name, parallelism, every)
        result = run_pretrain(cfg)
        assert result["final_loss"] < result["first_loss"]
        if name in killed:
            assert len(list((tmp_path / name / "_drills").glob("*"))) == 1  # the drill fired
        return cfg

    cfg = run("ep1", ep1)
    run("tp2-ep2", tp2_ep2)
    stopped_at(tmp_path / "tp2-ep2", 6, tmp_path / "tp2-to-pp2")
    run("tp2-to-pp2", pp2_ep2, every=3)  # its own checkpoint of step 9, from which it resumes
    stopped_at(tmp_path / "tp2-to-pp2", 9, tmp_path / "pp2-to-tp2")
    run("pp2-to-tp2", tp2_ep2)
    stopped_at(tmp_path / "ep1", 6, tmp_path / "elastic")
    elastic = {**ep2, "min_workers": 1, "elastic_resize_interval_s": 2}
    try:
        run_elastic_drill(config("elastic", elastic, every=2), remove_after=9, add_after=11)
    finally:
        init_ray()  # the session's local Ray again, for the tests after this one
    names = [p.name for p in tmp_path.iterdir() if (p / "metrics.jsonl").is_file()]
    metrics = {name: [json.loads(line) for line in open(tmp_path / name / "metrics.jsonl")] for name in names}
    assert len(metrics) == 5
    # every step once; the experts replicated, then split over the same 2 workers, whole on the one
    # left, and split again
    splits = [(r["world_size"], r["expert_parallel_size"]) for r in metrics["elastic"]]
    assert splits == [(2, 1)] * 6 + [(2, 2)] * 2 + [(1, 1)] * 2 + [(2, 2)] * 2
    for other in set(metrics) - {"ep1"}:
        for a, b in zip(metrics["ep1"], metrics[other], strict=True):
            assert a["step"] == b["step"]
            assert a["tokens_per_expert"] == b["tokens_per_expert"], (other, a["step"])  # the same routing decisions
            assert sum(a["tokens_per_expert"][0]) == 2 * 4 * 64 * 2  # every token's top-2, both replicas
            assert a["loss"] == pytest.approx(b["loss"], rel=1e-4), (other, a, b)
            assert a["grad_norm"] == pytest.approx(b["grad_norm"], rel=1e-4), (other, a, b)
    # warmup-stable-decay, resumed with the rest of the state after the kill: warmup over steps 1-2,
    # the peak held, then a 1 - sqrt decay over the last 3 of 12 steps
    schedule = wsd_schedule(cfg)
    for name, resumed in killed.items():
        assert [r["lr"] for r in metrics[name]] == pytest.approx([5e-3 * schedule(r["step"]) for r in metrics[name]])
        assert metrics[name][7]["lr"] == pytest.approx(5e-3) and metrics[name][-1]["lr"] < 5e-3 * 0.5
        # the rows up to the resumed step were written before the kill, the next one after it
        [marker] = (tmp_path / name / "_drills").iterdir()
        rows = metrics[name]
        assert rows[resumed - 1]["time"] < marker.stat().st_mtime < rows[resumed]["time"], name
    # the expert-parallel checkpoints hold every expert, gathered from both workers (of each stage
    # or tensor-parallel group), and a moved run ends with the weights of the run it came from
    dense_run = load_model_files(checkpoint.resolve(str(tmp_path / "ep1")))
    tokens = torch.randint(0, dense_run.cfg.vocab_size, (1, 16))
    for name in set(metrics) - {"ep1"}:
        other = load_model_files(checkpoint.resolve(str(tmp_path / name)))
        for layer in other.moe_layers():
            assert layer.w_gate_up.shape[0] == 4 and float(layer.expert_bias.abs().sum()) > 0
        torch.testing.assert_close(other(tokens)[0], dense_run(tokens)[0], atol=1e-3, rtol=1e-3)


def test_continued_pretraining_refuses_a_model_section_and_data_of_another_tokenizer(pretrained, packed, tmp_path):
    """Both refused before any worker starts; the run that continues from a checkpoint is
    tests/test_gates.py's rollback run."""
    import shutil

    from conftest import tiny_pretrain_config

    from lmfoundry.train.config import PretrainConfig
    from lmfoundry.train.pretrain import run_pretrain

    run_dir, _ = pretrained
    settings = tiny_pretrain_config(
        packed[0], str(tmp_path / "more"), schedule={"max_steps": 3, "warmup_steps": 1}, checkpointing={"every": 3}
    )
    with pytest.raises(ValueError, match="remove the model section"):
        run_pretrain(settings.model_copy(update={"init_from": run_dir}))
    cfg = PretrainConfig(**settings.model_dump(exclude={"model", "init_from"}), init_from=run_dir)
    other = tmp_path / "other-tokenizer"
    shutil.copytree(packed[0], other)
    tokenizer = json.loads((other / "tokenizer.json").read_text())
    tokenizer["model"]["vocab"]["Ġother"] = tokenizer["model"]["vocab"].pop(next(iter(tokenizer["model"]["vocab"])))
    (other / "tokenizer.json").write_text(json.dumps(tokenizer))
    with pytest.raises(ValueError, match="pack it with --set tokenizer="):
        run_pretrain(cfg.model_copy(update={"data": str(other)}))
    assert not (tmp_path / "more").exists()
