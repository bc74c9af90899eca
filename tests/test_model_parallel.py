"""Tensor parallelism (train/tensor_parallel.py) and pipeline parallelism
(train/pipeline_parallel.py) train the model the data-parallel run trains: on gloo processes
(benchmarks/harness/model_parallel.py), the losses of 20 steps at TP 2 x DP 2 (4 workers), PP 2
(2 workers, 4 micro-batches a step) and PP 2 x DP 2 (4 workers, activation checkpointing) are
those of one worker holding the whole model, and the weights each run writes (piece by piece, or
layer by layer from each stage) are whole: loaded into the single-device model they give the
engines' logits."""

from harness.model_parallel import compare_layouts


def test_tensor_and_pipeline_parallel_runs_give_the_one_worker_losses_and_whole_weights(deepspeed_processes, tmp_path):
    rows = compare_layouts(str(tmp_path))
    reference = rows["one worker"]["losses"]
    assert reference[-1] < reference[0] - 1.0, reference  # it learns
    for name, row in rows.items():
        assert row["loss_max_abs_diff"] <= 1e-4, (name, row["losses"], reference)
        assert row["grad_norm_max_rel_diff"] <= 1e-4, (name, row["grad_norms"])  # clipping sees the whole model
        assert row["reloaded_vs_one_worker_logits"] <= 1e-4, name
        assert row["reloaded_vs_own_engine_logits"] is None or row["reloaded_vs_own_engine_logits"] <= 1e-5, name
