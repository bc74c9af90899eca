"""Accelerator facts that throughput and MFU figures are measured against."""

from __future__ import annotations

# Dense bf16 tensor-core peaks from the vendors' data sheets (SXM parts, without sparsity).
GPU_BF16_PEAK_TFLOPS = {"B200": 2250.0, "H200": 989.0, "H100": 989.0, "A100": 312.0, "L40S": 362.0, "A10G": 125.0}


def device_peak_tflops(device_name: str | None) -> float | None:
    """The bf16 peak of a known GPU by (a part of) its name; None when unknown or a CPU."""
    if not device_name:
        return None
    return next((peak for key, peak in GPU_BF16_PEAK_TFLOPS.items() if key in device_name), None)
