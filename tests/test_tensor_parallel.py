"""Tensor parallelism (train/tensor_parallel.py) trains the model the data-parallel run trains:
on gloo processes (benchmarks/harness/tensor_parallel.py), the losses of 20 steps at TP=2
(2 workers) and TP=2 x DP=2 (4 workers) are those of one worker holding the whole model, and the
weights a TP run writes, piece by piece, are whole: loaded into the single-device model they give
the engine's own logits."""

from harness.tensor_parallel import compare_layouts


def test_tensor_parallel_runs_give_the_data_parallel_losses_and_whole_weights(deepspeed_processes, tmp_path):
    rows = compare_layouts(str(tmp_path))
    reference = rows["one worker"]["losses"]
    assert reference[-1] < reference[0] - 1.0, reference  # it learns
    for name, row in rows.items():
        assert row["loss_max_abs_diff"] <= 1e-4, (name, row["losses"], reference)
        assert row["reloaded_logits_max_abs_diff"] <= 1e-5, name
