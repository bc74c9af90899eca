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
    # the measurement sees what the planner claims: ZeRO-2 needs less than ZeRO-1, and
    # checkpointing far less than keeping every activation
    ordered = dict(zip(cases, measured))
    assert ordered["dense ZeRO-2"] < ordered["dense ZeRO-1"]
    assert ordered["dense ZeRO-2, checkpointing"] < 0.6 * ordered["dense ZeRO-2"]


def test_measuring_needs_the_model_sized():
    cfg = next(iter(reference_cases().values()))
    unsized = cfg.model_copy(update={"model": cfg.model.model_copy(update={"vocab_size": 0})})
    with pytest.raises(ValueError, match="vocab_size"):
        measure_peak_bytes([unsized], SEQ_LEN)
