"""A live elasticity drill on one machine, for the test suite and benchmarks/recovery.py.

A Ray cluster of three nodes on this machine (`ray.cluster_utils.Cluster`): a head for the
driver, Ray Train's controller and the data, and two training nodes with one `trainer` slot
each. A run with `min_workers` below `num_workers` and `worker_resources={"trainer": 1}`
carries two stall drills: while rank 0 stalls after the first, a training node is removed (its
worker dies with it; Ray restarts the group with the workers that fit); while rank 0 stalls
after the second, the node is added back (Ray grows the group at its next resize check). Each
change is a restart of the group, which resumes from the newest checkpoint at its new size.
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass

from lmfoundry.platform.log import get_logger
from lmfoundry.train.config import FaultDrill, PretrainConfig

logger = get_logger(__name__)

SLOT = "trainer"  # the custom resource that only the training nodes have


@dataclass
class ElasticDrill:
    manifest: dict
    removed_at: float  # wall time of the node's removal
    added_at: float  # wall time of the node's return


def run_elastic_drill(
    cfg: PretrainConfig,
    remove_after: int,
    add_after: int,
    cpus_per_node: int = 1,
    start_timeout_s: int = 15,
    wait_s: float = 600,
) -> ElasticDrill:
    """Runs `cfg` (a 2-worker run with min_workers=1) through the drill described above, with the
    node removed after step `remove_after` and added after step `add_after` (the second must come
    after a checkpoint the shrunk group wrote, or growing back repeats the shrunk group's work).
    Shuts down whatever Ray this process had and leaves none running. `start_timeout_s`: how long
    a restart waits for workers that cannot start (right after a loss Ray's view of the cluster
    may still count the lost node; Ray's default is 60 s)."""
    import ray
    from ray.cluster_utils import Cluster

    from lmfoundry.train.pretrain import run_pretrain

    par = cfg.parallelism
    if par.num_workers != 2 or par.min_workers != 1:
        raise ValueError(
            f"the drill runs 2 workers with min_workers=1 (got num_workers={par.num_workers}, "
            f"min_workers={par.min_workers})"
        )
    stall = 2 * wait_s  # longer than any wait here: the group's restart ends it
    drills = [
        FaultDrill(at_step=remove_after, kind="stall", seconds=stall),
        FaultDrill(at_step=add_after, kind="stall", seconds=stall),
    ]
    first = len(cfg.drills)
    cfg = cfg.model_copy(
        update={
            "drills": [*cfg.drills, *drills],
            "parallelism": par.model_copy(update={"worker_resources": {SLOT: 1}}),
        }
    )

    ray.shutdown()
    previous = os.environ.get("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S")
    os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = str(start_timeout_s)  # the nodes' processes inherit it
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 2})
    result: dict = {}

    def train():
        try:
            result["manifest"] = run_pretrain(cfg)
        except BaseException as e:  # raised in the caller's thread below
            result["error"] = e

    def wait_for_drill(index: int) -> None:
        deadline = time.monotonic() + wait_s
        markers = os.path.join(cfg.output, "_drills")
        while not (os.path.isdir(markers) and any(f.startswith(f"drill-{index}-") for f in os.listdir(markers))):
            if not thread.is_alive() or time.monotonic() > deadline:
                raise RuntimeError(
                    f"elastic drill: the stall after step {drills[index - first].at_step} never "
                    f"came: {result.get('error', 'the run is still going')}"
                )
            time.sleep(0.2)

    try:
        nodes = [cluster.add_node(num_cpus=cpus_per_node, resources={SLOT: 1}) for _ in range(2)]
        ray.init(address=cluster.address)
        cluster.wait_for_nodes()
        thread = threading.Thread(target=train, name="elastic-drill-run")  # nodes change from this thread
        thread.start()
        wait_for_drill(first)
        cluster.remove_node(nodes[1])
        removed_at = time.time()
        logger.info("elastic drill: removed a training node after step %d", remove_after)
        wait_for_drill(first + 1)
        cluster.add_node(num_cpus=cpus_per_node, resources={SLOT: 1})
        added_at = time.time()
        logger.info("elastic drill: added a training node after step %d", add_after)
        thread.join(timeout=wait_s)
    finally:
        ray.shutdown()
        cluster.shutdown()
        if previous is None:
            os.environ.pop("RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S", None)
        else:
            os.environ["RAY_TRAIN_WORKER_GROUP_START_TIMEOUT_S"] = previous
    if "manifest" not in result:
        raise RuntimeError(f"elastic drill: the run did not finish: {result.get('error', 'still going')}")
    return ElasticDrill(result["manifest"], removed_at, added_at)
