"""Collective and point-to-point communication times (alpha-beta model over a hierarchy).

Ring collectives (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention): all-reduce moves
2(n-1)/n x S per rank, all-gather and reduce-scatter (n-1)/n x S, over the achieved bus
bandwidth of the slowest link, plus a latency per ring step. A group that spans several fast
domains runs hierarchically, one ring per level of the cluster's hierarchy (`ClusterSpec.levels`:
e.g. NVLink pair, host, leaf switch, cluster): at level k the group's m_k members in one block
form c_k = m_k / m_(k-1) sub-groups and each GPU carries S / m_(k-1) bytes over that level's link
(reduce-scatter up the levels, all-gather down; NCCL's rings cross each level once per channel,
one NIC per GPU). A level's bandwidth is the per-GPU share when all groups of an axis use it at
once (`topology/hierarchy.py`), which is how shared NICs and oversubscribed uplinks slow every group.

A group of `size` ranks with `stride` between members (from the layout's axis order) has
min(size, D / stride) members in a block of D consecutive GPUs.

All-reduce across nodes also has NCCL's tree (NCCL >= 2.4: a chain inside each node, a double binary
tree between nodes), and NCCL runs whichever of ring and tree its tuning model says is faster
(`src/graph/tuning.cc` ncclTopoTuneModel): the ring takes 2 (n - 1) latency steps, the tree
2 (ranks per node - 1) inside the node plus 2 log2(nodes) between them, at 0.92 of the ring's bus
bandwidth and without the ring's (n - 1) / n saving. Over tens of nodes the ring's latency is
what a torch DDP bucket of 25 MiB waits on, and the tree is what runs; reduce-scatter and
all-gather are ring only.
"""

from __future__ import annotations

import numpy as np

from berth.cost_models.arrays import ArrayOrFloat
from berth.specs.hardware import CollectiveOp
from berth.specs.tree import ClusterSpec

ALL_REDUCE_PASSES = 2.0  # reduce-scatter + all-gather
HALF_PASSES = 1.0  # all-gather or reduce-scatter alone
TREE_BANDWIDTH_SHARE = 0.92  # NCCL tuning.cc: a tree all-reduce's bus bandwidth, busBw * .92 of the ring's


def members_per_block(size, stride, block_gpus: int) -> ArrayOrFloat:
    """How many members of a group with this size and rank stride share one block of GPUs."""
    size = np.asarray(size, dtype=float)
    stride = np.asarray(stride, dtype=float)
    per_block = np.floor(block_gpus / np.maximum(stride, 1.0))
    return np.clip(np.minimum(size, per_block), 1.0, None)


def collective_time_s(
    cluster: ClusterSpec, nbytes, size, stride, passes, op: CollectiveOp = "all_reduce"
) -> np.ndarray:
    """Hierarchical ring time of a collective over `size` ranks `stride` apart.

    `passes` is 2 for all-reduce and 1 for all-gather or reduce-scatter; `nbytes` is the full
    (unsharded) buffer size. Each link's measured `op_time_scale` (from `berth profile`) scales
    the bandwidth term of that operation (1.0 unless measured).
    """
    return _hierarchical_s(cluster, nbytes, size, stride, passes, op, tree=False)


def _hierarchical_s(cluster: ClusterSpec, nbytes, size, stride, passes, op: CollectiveOp, tree: bool) -> np.ndarray:
    """The levels' bandwidth and latency terms, summed; with `tree`, the levels between nodes run NCCL's
    double binary tree (floor(log2 c) latency steps, every byte of the level's share crossing, at
    TREE_BANDWIDTH_SHARE of the bandwidth) instead of a ring."""
    size = np.asarray(size, dtype=float)
    below = np.ones_like(size)  # members per block of the level below
    bandwidth_term = np.zeros_like(size)
    latency_term = np.zeros_like(size)
    for level in cluster.levels:
        members = np.minimum(members_per_block(size, stride, level.gpus), size)
        rings = members / below  # sub-groups joined at this level
        link = level.link
        bw = link.bandwidth_bytes_per_s * link.collective_efficiency
        if tree and level.gpus > cluster.gpus_per_node:
            share = np.where(rings > 1.0, 1.0 / TREE_BANDWIDTH_SHARE, 0.0)
            steps = np.floor(np.log2(np.maximum(rings, 1.0)))
        else:
            share, steps = (rings - 1.0) / rings, rings - 1.0
        bandwidth_term = bandwidth_term + link.scale(op) * share * (nbytes / below) / bw
        latency_term = latency_term + steps * link.hop_latency_s
        below = members
    base = np.where(size > 1, cluster.collective_base_latency_s, 0.0)
    return np.where(size > 1, passes * (bandwidth_term + latency_term) + base, 0.0)


def all_reduce_s(cluster: ClusterSpec, nbytes, size, stride) -> np.ndarray:
    """The faster of the ring and, where the group spans nodes, NCCL's tree (module docstring)."""
    ring = collective_time_s(cluster, nbytes, size, stride, ALL_REDUCE_PASSES)
    tree = _hierarchical_s(cluster, nbytes, size, stride, ALL_REDUCE_PASSES, "all_reduce", tree=True)
    return np.minimum(ring, tree)


def all_gather_s(cluster: ClusterSpec, nbytes, size, stride) -> np.ndarray:
    """All-gather of a buffer of `nbytes` in total."""
    return collective_time_s(cluster, nbytes, size, stride, HALF_PASSES, "all_gather")


def reduce_scatter_s(cluster: ClusterSpec, nbytes, size, stride) -> np.ndarray:
    """Reduce-scatter of a buffer of `nbytes` in total (the ring cost of an all-gather; NCCL
    matches it, gloo is measured slower or faster through op_time_scale)."""
    return collective_time_s(cluster, nbytes, size, stride, HALF_PASSES, "reduce_scatter")


def group_level(cluster: ClusterSpec, size, stride) -> np.ndarray:
    """Index into cluster.levels of the smallest domain that holds a whole group."""
    size = np.asarray(size, dtype=float)
    level = np.full(size.shape, len(cluster.levels) - 1, dtype=np.int64)
    for k in range(len(cluster.levels) - 1, -1, -1):
        inside = members_per_block(size, stride, cluster.levels[k].gpus) >= size
        level = np.where(inside, k, level)
    return level


def p2p_s(cluster: ClusterSpec, nbytes, size, stride) -> ArrayOrFloat:
    """One send/recv between neighbouring pipeline stages over the slowest level the pipeline
    group spans (the pipeline runs at the pace of its slowest hop)."""
    level = group_level(cluster, size, stride)
    bandwidth = np.array([lv.link.bandwidth_bytes_per_s / lv.link.scale("p2p") for lv in cluster.levels])
    latency = np.array([lv.link.hop_latency_s for lv in cluster.levels])
    return nbytes / bandwidth[level] + latency[level]


def all_to_all_s(cluster: ClusterSpec, nbytes, size, stride) -> np.ndarray:
    """All-to-all where each rank holds `nbytes` and sends (size-1)/size of it, 1/size to each peer
    (NCCL's alltoall: ncclSend/ncclRecv pairs to every peer at once; nccl-tests' busbw convention for
    alltoall is algbw x (n-1)/n, doc/PERFORMANCE.md). Every rank's traffic leaves through its own link
    at the level the group spans (the smallest domain that holds it, `group_level`): an expert-parallel
    group inside a node runs at NVLink speed, one that spans nodes at the per-GPU network share (the
    share of peers inside the node is sent faster; left out, a bound from above). Latency: one hop
    latency per peer (issued together, counted once per peer as NCCL's p2p channels are few) plus the
    collective's base latency."""
    size = np.asarray(size, dtype=float)
    level = group_level(cluster, size, stride)
    bandwidth = np.array([lv.link.bandwidth_bytes_per_s * lv.link.collective_efficiency for lv in cluster.levels])
    latency = np.array([lv.link.hop_latency_s for lv in cluster.levels])
    moved = nbytes * (size - 1.0) / np.maximum(size, 1.0)
    t = moved / bandwidth[level] + (size - 1.0) * latency[level] + cluster.collective_base_latency_s
    return np.where(size > 1, t, 0.0)
