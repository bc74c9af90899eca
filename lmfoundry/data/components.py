"""Connected components of a graph given as a Ray Data dataset of edges (a, b), computed on the
cluster: nothing per node or per edge reaches the driver, which sees only two counts a round.

The algorithm is the alternating large-star / small-star of Kiveris et al., "Connected Components
in MapReduce and Beyond" (SoCC 2014), where each step is one hash-partitioned groupby:

  large-star  every node u links each neighbour v > u to m(u), the smallest of u and its neighbours
  small-star  every node u links itself and each neighbour v < u to the smallest of those

Both keep the components and shrink every node's link towards the component's smallest node;
when neither step changes an edge, the graph is a set of stars, each centred on its component's
smallest node: the result is one row (node, root) per node that is not a root. Components of
near-duplicate documents are small and shallow, so a handful of rounds is the rule.

The group functions work on numpy arrays of many nodes at once (one call per partition, not per
node) and run without Ray, which is how the tests check them against a union-find.
"""

from __future__ import annotations

import numpy as np

GOLDEN = np.uint64(0x9E3779B97F4A7C15)  # spreads doc keys (shard in the high bits) over partitions


def partition_of(keys: np.ndarray, partitions: int) -> np.ndarray:
    return ((keys.astype(np.uint64) * GOLDEN) % np.uint64(partitions)).astype(np.int64)


def _by_node(node: np.ndarray, other: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """Distinct (node, other) rows sorted by node, the start of each node's run and its length."""
    pairs = np.unique(np.stack([node, other], axis=1), axis=0) if len(node) else np.zeros((0, 2), np.int64)
    node, other = pairs[:, 0], pairs[:, 1]
    starts = np.flatnonzero(np.r_[True, node[1:] != node[:-1]]) if len(node) else np.zeros(0, np.int64)
    return node, other, starts, np.diff(np.r_[starts, len(node)])


def large_star(node: np.ndarray, neighbour: np.ndarray) -> dict:
    """Rows (node, neighbour) listing every edge from both ends -> the new edges (a > b) and, per
    edge, whether it is new (`changed`)."""
    node, other, starts, counts = _by_node(node, neighbour)
    if not len(node):
        return _edges(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
    smallest = np.minimum(np.minimum.reduceat(other, starts), node[starts])
    m = np.repeat(smallest, counts)
    up = other > node
    return _edges(other[up], m[up], m[up] != node[up])


def small_star(node: np.ndarray, neighbour: np.ndarray) -> dict:
    """Rows (node, neighbour) with neighbour < node, listing every edge from its larger end -> the
    new edges (a > b): the node and each of its neighbours linked to the smallest of them."""
    node, other, starts, counts = _by_node(node, neighbour)
    if not len(node):
        return _edges(np.zeros(0, np.int64), np.zeros(0, np.int64), np.zeros(0, bool))
    m = np.repeat(np.minimum.reduceat(other, starts), counts)
    several = np.repeat(counts > 1, counts)  # a node with one smaller neighbour keeps its one edge
    leaf = other != m
    a = np.concatenate([node[starts], other[leaf]])
    b = np.concatenate([m[starts], m[leaf]])
    changed = np.concatenate([counts > 1, several[leaf]])
    return _edges(a, b, changed)


def _edges(a: np.ndarray, b: np.ndarray, changed: np.ndarray) -> dict:
    return {"a": a.astype(np.int64), "b": b.astype(np.int64), "changed": changed.astype(np.int64)}


def _both_ends(batch: dict, partitions: int) -> dict:
    a, b = np.asarray(batch["a"], np.int64), np.asarray(batch["b"], np.int64)
    node, other = np.concatenate([a, b]), np.concatenate([b, a])
    return {"node": node, "other": other, "part": partition_of(node, partitions)}


def _larger_end(batch: dict, partitions: int) -> dict:
    a, b = np.asarray(batch["a"], np.int64), np.asarray(batch["b"], np.int64)
    node, other = np.maximum(a, b), np.minimum(a, b)
    return {"node": node, "other": other, "part": partition_of(node, partitions)}


def _without_loops(batch: dict) -> dict:
    a, b = np.asarray(batch["a"], np.int64), np.asarray(batch["b"], np.int64)
    return {"a": a[a != b], "b": b[a != b]}


def _large_group(group: dict) -> dict:
    return large_star(group["node"], group["other"])


def _small_group(group: dict) -> dict:
    return small_star(group["node"], group["other"])


def _step(edges, spread, step, partitions: int):
    """One star step as one groupby; the new edges materialised (they are read twice: for the
    count of changes and by the next step) and the number of changed edges."""
    out = (
        edges.map_batches(spread, fn_kwargs={"partitions": partitions}, batch_format="numpy")
        .groupby("part", num_partitions=partitions)
        .map_groups(step, batch_format="numpy")
        .materialize()
    )
    changed = out.sum("changed") if out.count() else 0
    return out, int(changed or 0)


def connected_components(edges, partitions: int, max_rounds: int = 64):
    """A dataset of edges (columns a, b; self-loops and repeats allowed) -> a dataset (a, b) with
    one row per node that is not the smallest of its component: a the node, b that smallest node."""
    edges = edges.map_batches(_without_loops, batch_format="numpy")
    for _ in range(max_rounds):
        edges, large_changed = _step(edges, _both_ends, _large_group, partitions)
        edges, small_changed = _step(edges, _larger_end, _small_group, partitions)
        if large_changed == 0 and small_changed == 0:
            return edges.select_columns(["a", "b"])
    raise RuntimeError(f"connected components did not converge in {max_rounds} rounds of large- and small-star")
