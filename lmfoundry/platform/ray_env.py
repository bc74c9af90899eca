"""The Ray connection: an embedded local cluster by default, or an existing one by address."""

from __future__ import annotations

import os

from lmfoundry.platform.log import get_logger

logger = get_logger(__name__)


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
        ray.init(num_cpus=cpus)
