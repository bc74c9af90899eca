"""The planner's per-GPU memory against the measured peak of real small DeepSpeed runs on CPU
(two gloo processes each; see benchmarks/harness/peak_memory.py and benchmarks/peak_memory.py)."""

import pytest
from harness.peak_memory import SEQ_LEN, WORLD, measure_peak_bytes, predicted_peak_bytes, reference_cases


def test_predicted_peak_memory_is_within_15_percent_of_measured(deepspeed_processes):
    cases = reference_cases()
    measured = measure_peak_bytes(list(cases.values()), SEQ_LEN, WORLD)
    report = {}
    for (name, cfg), peak in zip(cases.items(), measured):
        predicted = predicted_peak_bytes(cfg, SEQ_LEN, WORLD)["total"]
        report[name] = round(predicted / peak, 3)
    assert all(0.85 <= ratio <= 1.15 for ratio in report.values()), report
    # the measurement sees what the planner claims: partitioning the optimizer states saves
    # memory, and checkpointing saves far more than keeping every activation. This peak does not
    # see ZeRO-2's gradient partitioning: at these sizes it falls early in the backward pass,
    # before most gradients exist, and ZeRO-1's and ZeRO-2's peaks lie within about 1 MiB of each
    # other (the planner counts ZeRO-1's whole gradients there and predicts it 9% above its
    # measurement; docs/figures.md). The last bound only says ZeRO-2 costs no more than ZeRO-1.
    ordered = dict(zip(cases, measured))
    for zero in ("dense ZeRO-1", "dense ZeRO-2"):
        assert ordered[zero] < 0.99 * ordered["dense ZeRO-0"], (zero, ordered)
    assert ordered["dense ZeRO-2"] < 1.005 * ordered["dense ZeRO-1"], ordered
    assert ordered["dense ZeRO-2, checkpointing"] < 0.6 * ordered["dense ZeRO-2"]


def test_measuring_needs_the_model_sized():
    cfg = next(iter(reference_cases().values()))
    unsized = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 0})})
    with pytest.raises(ValueError, match="vocab_size"):
        measure_peak_bytes([unsized], SEQ_LEN)
