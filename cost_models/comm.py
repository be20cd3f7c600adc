"""Collective and point-to-point communication times (alpha-beta model).

Ring collectives (Patarasuk & Yuan 2009; NCCL's bus-bandwidth convention): all-reduce moves
2(n-1)/n x S per rank, all-gather and reduce-scatter (n-1)/n x S, over the achieved bus
bandwidth of the slowest link, plus a latency per ring step. A group that spans nodes runs
hierarchically: reduce-scatter inside the node over its k local members, a ring across the N
nodes on S/k bytes per NIC (one NIC per GPU, rail-optimized), all-gather inside the node.

Ranks are ordered tp innermost, then the shard part of dp, then its replicate part, then pp
(Narayanan 2021, Sec. 3.3; Megatron's "tp-dp-pp" order), so a group of `size` ranks with
`stride` between members has min(size, gpus_per_node / stride) members on each node.
"""

from __future__ import annotations

import numpy as np

from planner.specs import ClusterSpec

ALL_REDUCE_PASSES = 2.0  # reduce-scatter + all-gather
HALF_PASSES = 1.0  # all-gather or reduce-scatter alone


def members_per_node(size, stride, gpus_per_node: int):
    """How many members of a group with this size and rank stride share one node."""
    size = np.asarray(size, dtype=float)
    stride = np.asarray(stride, dtype=float)
    per_node = np.floor(gpus_per_node / np.maximum(stride, 1.0))
    return np.clip(np.minimum(size, per_node), 1.0, None)


def collective_time_s(cluster: ClusterSpec, nbytes, size, local, passes, op: str = "all_reduce"):
    """Hierarchical ring time of a collective over `size` ranks with `local` of them per node.

    `passes` is 2 for all-reduce and 1 for all-gather or reduce-scatter; `nbytes` is the full
    (unsharded) buffer size. Each link's measured `op_time_scale` (from `berth profile`) scales
    the bandwidth term of that operation (1.0 unless measured).
    """
    size = np.asarray(size, dtype=float)
    local = np.minimum(np.asarray(local, dtype=float), size)
    nodes = size / local
    intra, inter = cluster.intra_node, cluster.inter_node
    intra_bw = intra.bandwidth_bytes_per_s * intra.collective_efficiency
    inter_bw = inter.bandwidth_bytes_per_s * inter.collective_efficiency
    bandwidth_term = passes * (
        intra.scale(op) * (local - 1.0) / local * nbytes / intra_bw
        + inter.scale(op) * (nodes - 1.0) / nodes * (nbytes / local) / inter_bw
    )
    latency_term = passes * ((local - 1.0) * intra.hop_latency_s + (nodes - 1.0) * inter.hop_latency_s)
    base = np.where(size > 1, cluster.collective_base_latency_s, 0.0)
    return np.where(size > 1, bandwidth_term + latency_term + base, 0.0)


def all_reduce_s(cluster: ClusterSpec, nbytes, size, stride):
    local = members_per_node(size, stride, cluster.gpus_per_node)
    return collective_time_s(cluster, nbytes, size, local, ALL_REDUCE_PASSES)


def all_gather_s(cluster: ClusterSpec, nbytes, size, stride):
    """All-gather of a buffer of `nbytes` in total."""
    local = members_per_node(size, stride, cluster.gpus_per_node)
    return collective_time_s(cluster, nbytes, size, local, HALF_PASSES, "all_gather")


def reduce_scatter_s(cluster: ClusterSpec, nbytes, size, stride):
    """Reduce-scatter of a buffer of `nbytes` in total (the ring cost of an all-gather; NCCL
    matches it, gloo is measured slower or faster through op_time_scale)."""
    local = members_per_node(size, stride, cluster.gpus_per_node)
    return collective_time_s(cluster, nbytes, size, local, HALF_PASSES, "reduce_scatter")


def p2p_s(cluster: ClusterSpec, nbytes, crosses_node):
    """One send/recv between neighbouring pipeline stages."""
    intra, inter = cluster.intra_node, cluster.inter_node
    return np.where(
        crosses_node,
        inter.scale("p2p") * nbytes / inter.bandwidth_bytes_per_s + inter.hop_latency_s,
        intra.scale("p2p") * nbytes / intra.bandwidth_bytes_per_s + intra.hop_latency_s,
    )
