"""Tensor parallelism (train/tensor_parallel.py) trains the model the data-parallel run trains:
on gloo processes, the losses of 20 steps at TP=2 (2 workers) and TP=2 x DP=2 (4 workers) are
those of one worker holding the whole model, and the weights a TP run writes, piece by piece, are
whole: loaded into the single-device model they give the engine's own logits."""

import pytest
import torch
from harness.tensor_parallel import global_batches, train_losses

from lmfoundry.model.checkpoint import load_model_files
from lmfoundry.model.transformer import ModelConfig
from lmfoundry.train.config import PretrainConfig

SEQ_LEN, STEPS = 32, 20


def config(tp: int, workers: int) -> PretrainConfig:
    # query/key norms and q/k/v biases (Qwen2/3) split or summed with the heads too
    model = ModelConfig(
        vocab_size=96,
        max_seq_len=SEQ_LEN,
        n_layer=2,
        d_model=64,
        n_head=4,
        n_kv_head=2,
        qk_norm=True,
        attention_bias=True,
        tie_embeddings=True,
    )
    return PretrainConfig(
        data="-",
        output="-",
        model=model,
        parallelism={"num_workers": workers, "tensor_parallel_size": tp, "zero_stage": 1},
        batch={"micro_batch_size": 2, "global_batch_tokens": 8 * SEQ_LEN},
        schedule={"max_steps": STEPS, "warmup_steps": 2},
        optimizer={"lr": 3e-3},
    )


def test_tensor_parallel_runs_give_the_data_parallel_losses_and_whole_weights(deepspeed_processes, tmp_path):
    runs = {}
    for name, tp, workers in (("dp1", 1, 1), ("tp2", 2, 2), ("tp2xdp2", 2, 4)):
        runs[name] = train_losses(config(tp, workers), workers, SEQ_LEN, STEPS, str(tmp_path / name))
    reference = runs["dp1"]["losses"]
    assert reference[-1] < reference[0] - 1.0, reference  # it learns
    for name in ("tp2", "tp2xdp2"):
        assert runs[name]["losses"] == pytest.approx(reference, abs=1e-4), name
        model = load_model_files(tmp_path / name)
        probe = global_batches(config(1, 1), SEQ_LEN, 1, seed=1)[0, :2, :-1]
        with torch.no_grad():
            logits = model(probe)[0]
        assert torch.allclose(logits, runs[name]["logits"], atol=1e-5), name
