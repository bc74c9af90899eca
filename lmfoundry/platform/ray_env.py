"""The Ray connection: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import os

from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


# glibc serves every allocation above a threshold (at most 32 MiB) with a fresh mmap and unmaps
# it when freed, so the tensors of a CPU training step larger than that (the logits of a micro-
# batch and their gradients) come back as new pages, zeroed by the kernel, on every step: about
# 33,000 page faults a step for the 4-layer model of benchmarks/orchestration_overhead.py. Fixing
# the threshold at 1 GiB and keeping freed memory (no trim below 2 GiB) lets the heap reuse them:
# under 1,500 faults a step and 7% less time per step there. glibc reads these at process start,
# so they go in the environment a worker process starts with; a preloaded jemalloc or tcmalloc
# ignores them.
CPU_ALLOCATOR_ENV = {"MALLOC_MMAP_THRESHOLD_": str(1 << 30), "MALLOC_TRIM_THRESHOLD_": str(1 << 31)}


def cpu_worker_env() -> dict[str, str]:
    """The allocator settings for worker processes that run torch on the CPU, except those the
    environment already sets (a user's own choice wins)."""
    return {k: v for k, v in CPU_ALLOCATOR_ENV.items() if k not in os.environ}


def local_logical_cpus() -> int:
    # Ray Train workers each hold a CPU for the whole run while Ray Data's ingest tasks need CPUs
    # too; with exactly as many logical CPUs as cores they can wait on each other forever. Twice
    # the cores (at least 4) oversubscribes a little and keeps both moving.
    return max(4, 2 * (os.cpu_count() or 1))


def init_ray(address: str | None = None) -> None:
    """Connect once per process: to `address` / RAY_ADDRESS when given, else start a local Ray."""
    import ray

    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address)
    else:
        cpus = local_logical_cpus()
        logger.info("starting an embedded local Ray with %d logical CPUs", cpus)
        # "local": a new Ray of this process's own even when `ray start` left a cluster running on
        # the machine (ray.init() would join that one, and refuses to be given num_cpus for it)
        ray.init(address="local", num_cpus=cpus)
