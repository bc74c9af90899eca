"""The Ray connection: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import json
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


# A task's result smaller than this many bytes goes back inline to its owner, the driver, and lives
# in the driver's own heap while a reference to it does (Ray's default: 100 KiB). Curation's
# sort shuffles cut data into partitions x partitions pieces, most of them small, so inline
# results grew the driver with the square of the corpus's partitions: 150 MiB above its start
# at a million documents, against 69 MiB with only results under 1 KiB inline, for 62 s of
# dedup instead of 41 s (benchmarks/dedup_memory.py; dedup.shuffle v2 keeps it flat, slower).
# Ray reads the setting when a worker process starts, so it goes in the environment of the
# job's workers.
CURATION_WORKER_ENV = {"RAY_max_direct_call_object_size": "1024"}


def curation_worker_env() -> dict[str, str]:
    """The settings above for a curation job's workers. A value the driver's environment already
    has wins (a cluster reached by address does not inherit it otherwise), and a key the
    submitted job's runtime environment sets is left to it: Ray refuses the same variable from
    both the job and `ray.init`."""
    from ray._private.runtime_env.constants import RAY_JOB_CONFIG_JSON_ENV_VAR

    job = json.loads(os.environ.get(RAY_JOB_CONFIG_JSON_ENV_VAR) or "{}")
    submitted = (job.get("runtime_env") or {}).get("env_vars") or {}
    return {k: os.environ.get(k, v) for k, v in CURATION_WORKER_ENV.items() if k not in submitted}


def local_logical_cpus() -> int:
    # Ray Train workers each hold a CPU for the whole run while Ray Data's ingest tasks need CPUs
    # too; with exactly as many logical CPUs as cores they can wait on each other forever. Twice
    # the cores (at least 4) oversubscribes a little and keeps both moving.
    return max(4, 2 * (os.cpu_count() or 1))


def init_ray(address: str | None = None, worker_env: dict[str, str] | None = None) -> None:
    """Connect once per process: to `address` / RAY_ADDRESS when given, else start a local Ray.
    `worker_env`: environment variables for every worker process of this job (a process that is
    already connected keeps the job it has)."""
    import ray

    if ray.is_initialized():
        return
    runtime_env = {"env_vars": worker_env} if worker_env else None
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        logger.info("connecting to the Ray cluster at %s", address)
        ray.init(address=address, runtime_env=runtime_env)
    else:
        cpus = local_logical_cpus()
        logger.info("starting an embedded local Ray with %d logical CPUs", cpus)
        # "local": a new Ray of this process's own even when `ray start` left a cluster running on
        # the machine (ray.init() would join that one, and refuses to be given num_cpus for it)
        ray.init(address="local", num_cpus=cpus, runtime_env=runtime_env)
