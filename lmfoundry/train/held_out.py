"""The before-and-after figures of a fine-tuning run (SFT's assistant loss, DPO's preference
accuracy, a reward model's held-out accuracy), computed by the training workers once the run has
finished rather than by the driver, so that a model that trains only partitioned is measured
partitioned too.

Each worker takes every world-th row, the models are built as the run built its own (under
ZeRO-3 on the meta device and partitioned in frozen engines, so no process holds a whole model;
below it whole on each worker, in the training dtype: engine.place_frozen), and the sums are
added over the workers. Rank 0 writes them to RUN/final_figures.json with the name of the
checkpoint they measured; the driver reads that file and refuses one written for another.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import torch

from lmfoundry.platform import checkpoint, storage

REPORT = "final_figures.json"
MAX_REPORT_BYTES = 1 << 20  # a few numbers: anything near this is not a report


def final_checkpoint(run_dir: str) -> str:
    """The run's newest valid checkpoint, as the driver finds it after training (launch.py):
    looked up by rank 0 (it reads every file's checksum) and sent to the others."""
    import torch.distributed as dist

    found = [checkpoint.latest_valid(run_dir) if dist.get_rank() == 0 else None]
    dist.broadcast_object_list(found, src=0)
    if found[0] is None:
        raise RuntimeError(f"the run in {run_dir} finished without a checkpoint")
    return found[0]


@torch.no_grad()
def summed_over_ranks(
    items: Sequence, batch: int, measure: Callable[[list], tuple[float, float]], device
) -> tuple[float, float]:
    """(sum, count) over all `items`: `measure(some_items)` gives a batch's, each rank measures
    every world-th item, and the totals are added over the ranks. Every rank runs as many
    batches as the busiest: under ZeRO-3 a forward gathers each layer's weights (a collective),
    so a rank with nothing left measures its first item again and counts nothing."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    mine = list(items[rank::world])
    batches = math.ceil(math.ceil(len(items) / world) / batch)
    totals = torch.zeros(2, dtype=torch.float64, device=device)
    for b in range(batches):
        some = mine[b * batch : (b + 1) * batch]
        value, count = measure(some or [items[0]])
        if some:
            totals += torch.tensor([value, count], dtype=torch.float64, device=device)
    dist.all_reduce(totals)
    total, count = totals.tolist()
    return total, count


def frozen(model: torch.nn.Module, engine, values: dict | None = None):
    """`model` beside the engine, frozen and in eval mode, placed as engine.place_frozen places
    it: partitioned in an engine of its own under ZeRO-3 (a model built on the meta device, with
    its initial `values` unless its own), on the engine's device below it."""
    from lmfoundry.train.engine import place_frozen

    return place_frozen(model.eval().requires_grad_(False), engine, values)


def frozen_from(directory: str, engine, base_copies: Mapping[str, str] | None = None):
    """A checkpoint's model as `frozen` places it: read on the meta device under ZeRO-3, whole
    below it. `base_copies`: local copies of an adapter checkpoint's base (model/checkpoint.py
    adapter_base)."""
    from lmfoundry.model.checkpoint import load_model_files, load_model_on_meta

    if engine.zero_optimization_stage() == 3:
        return frozen(load_model_on_meta(directory, base_copies), engine)
    return frozen(load_model_files(directory, base_copies=base_copies), engine)


def write_report(run_dir: str, final_uri: str, figures: dict) -> None:
    storage.write_json_atomic(
        storage.join(run_dir, REPORT), {"checkpoint": checkpoint.name_in_run(final_uri), "figures": figures}
    )


def read_report(run_dir: str, final: str) -> dict:
    """The figures the workers measured on the run's final checkpoint `final` (its name)."""
    path = storage.join(run_dir, REPORT)
    if not storage.exists(path):
        raise RuntimeError(f"the workers wrote no {REPORT} in {run_dir}: the run's figures are missing")
    report = storage.read_json(path, limit=MAX_REPORT_BYTES)
    if not isinstance(report, dict) or report.get("checkpoint") != final or not isinstance(report.get("figures"), dict):
        raise RuntimeError(
            f"{path} measured {report.get('checkpoint') if isinstance(report, dict) else report!r}, not {final}"
        )
    return report["figures"]
