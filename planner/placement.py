"""Placement as pure math: which GPU each rank runs on and which ranks form each process group.

A layout's ranks are laid out along its parallel axes in its `axis_order`, innermost first; the
default ("tp", "dp", "pp") is Megatron-LM's: tensor-parallel ranks adjacent (inside a node's fast
domain), then data parallel, then pipeline stages outermost (Narayanan et al. 2021, Sec. 3.3).
The search tries the tp-innermost orders (tp-dp-pp, tp-pp-dp). Rank r runs on node
r // gpus_per_node, local GPU r % gpus_per_node (GPUs in the graph's rank order), which is also
what `torchrun --nnodes N --nproc-per-node G --node-rank n` gives rank n * G + local_rank.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import permutations
from typing import cast

import numpy as np

from berth.cost_models.comm import group_level
from berth.specs import terms
from berth.specs.axes import ORDERED_AXES, RANK_AXES, with_cp
from berth.specs.tree import (
    PLACEMENT_DETAIL_MAX_RANKS,
    AxisName,
    ClusterSpec,
    GroupPlacement,
    Layout,
    Placement,
)

AXES = ORDERED_AXES  # the axes of axis_order: tp, dp, pp
# RANK_AXES (specs/axes.py): with context parallelism, right outside tp
ORDERS: tuple[tuple[str, ...], ...] = tuple(permutations(AXES))


def shown_axes(layout: Layout) -> tuple[str, ...]:
    """The axes a plan lists: cp only when the layout has it (cp = 1 plans read as before)."""
    return RANK_AXES if layout.cp > 1 else AXES


def _sizes(layout: Layout) -> dict[str, int]:
    return {axis: getattr(layout, axis) for axis in RANK_AXES}


def _full(order: tuple[str, ...] | None, layout: Layout) -> tuple[str, ...]:
    """An axis order with cp: as given when it names cp, else cp right outside tp (Layout.rank_order)."""
    order = tuple(order or layout.order)
    return order if "cp" in order else with_cp(order)


def coordinates(layout: Layout, order: tuple[str, ...] | None = None) -> dict[str, np.ndarray]:
    """Each rank's index along every axis (arrays of length world size); context-parallel ranks sit
    right outside the tensor-parallel ones (torchtitan's mesh ..., cp, tp; Megatron's tp-cp-...)."""
    order = _full(order, layout)
    if sorted(order) != sorted(RANK_AXES):
        raise ValueError(f"order must be a permutation of {RANK_AXES}, got {order}")
    sizes = _sizes(layout)
    ranks = np.arange(layout.world_size)
    coords, stride = {}, 1
    for axis in order:
        coords[axis] = (ranks // stride) % sizes[axis]
        stride *= sizes[axis]
    return coords


def strides(layout: Layout, order: tuple[str, ...] | None = None) -> dict[str, int]:
    """Rank distance between neighbours of each axis."""
    sizes, out, stride = _sizes(layout), {}, 1
    for axis in _full(order, layout):
        out[axis] = stride
        stride *= sizes[axis]
    return out


def process_groups(layout: Layout, order: tuple[str, ...] | None = None) -> dict[str, list[list[int]]]:
    """For each axis, its groups: ranks that share every other coordinate, in axis order."""
    coords, sizes = coordinates(layout, order), _sizes(layout)
    groups: dict[str, list[list[int]]] = {}
    for axis in shown_axes(layout):
        key = np.zeros(layout.world_size, dtype=np.int64)
        for other in (a for a in RANK_AXES if a != axis):
            key = key * sizes[other] + coords[other]
        ranks = np.lexsort((coords[axis], key))  # by the other coordinates, then along the axis
        groups[axis] = ranks.reshape(-1, sizes[axis]).tolist()
    return groups


@dataclass(frozen=True)
class GroupSpan:
    axis: str
    size: int
    nodes: int  # nodes one group spans
    per_node: int  # members of one group on each of its nodes
    crosses_nodes: bool


def device_of(rank: int, cluster: ClusterSpec) -> tuple[int, int]:
    """(node, local GPU) of a rank."""
    return divmod(rank, cluster.gpus_per_node)


def spans(layout: Layout, cluster: ClusterSpec, order: tuple[str, ...] | None = None) -> dict[str, GroupSpan]:
    """How the (first) group of each axis sits on the nodes; all groups of an axis are alike."""
    out = {}
    for axis, groups in process_groups(layout, order).items():
        g = groups[0]
        nodes = {device_of(r, cluster)[0] for r in g}
        out[axis] = GroupSpan(axis, len(g), len(nodes), len(g) // len(nodes), len(nodes) > 1)
    return out


def rank_map(layout: Layout, cluster: ClusterSpec, order: tuple[str, ...] | None = None) -> list[dict[str, int]]:
    """Every rank with its node, local GPU and coordinates (what the plan carries)."""
    coords = coordinates(layout, order)
    return [
        {
            "rank": r,
            "node": device_of(r, cluster)[0],
            "local_rank": device_of(r, cluster)[1],
            **{a: int(coords[a][r]) for a in shown_axes(layout)},
        }
        for r in range(layout.world_size)
    ]


# the time term each axis's traffic lands in; ep (MoE expert parallelism) groups are ep consecutive dp
# ranks (the dp stride apart; with expert_tp = 1, ep consecutive ranks), listed in the placement when ep > 1
AXIS_TERMS = terms.AXIS_TERMS


def innermost_cluster(cluster: ClusterSpec) -> ClusterSpec:
    """The same cluster with every level as fast as its innermost one: what a group's traffic would
    cost if it never left the innermost fast domain (the reference for `cost_of_crossing_s`)."""
    inner = cluster.levels[0].link
    return cluster.model_copy(update={"fabric": tuple(lv.model_copy(update={"link": inner}) for lv in cluster.levels)})


def placement(
    layout: Layout,
    cluster: ClusterSpec,
    times_s: dict[str, float],
    inner_times_s: dict[str, float],
    detail: bool = True,
) -> Placement:
    """The plan's placement: for each axis where its groups sit, the slowest level they cross and
    what that costs (its time term here minus on `innermost_cluster`); with `detail`, the full
    rank map and groups up to PLACEMENT_DETAIL_MAX_RANKS ranks."""
    sizes, stride = _sizes(layout), strides(layout)
    # ep: ep data-parallel ranks the dp stride apart; with expert_tp < tp consecutive ranks, expert_tp apart
    # (Megatron's expert order tp-ep-dp-pp; cost_models/step.py moe_layer_extra_s)
    sizes["ep"], stride["ep"] = layout.ep, layout.etp if layout.etp != layout.tp else stride["dp"]
    groups = []
    for axis in (*shown_axes(layout), "ep") if layout.ep > 1 else shown_axes(layout):
        k = int(group_level(cluster, sizes[axis], stride[axis]))
        link = cluster.levels[k].link
        first = [stride[axis] * i for i in range(sizes[axis])]
        nodes = len({device_of(r, cluster)[0] for r in first})
        term = AXIS_TERMS[axis]
        groups.append(
            GroupPlacement(
                axis=cast(AxisName, axis),  # one of shown_axes' or ep: the names AxisName lists
                size=sizes[axis],
                count=layout.world_size // sizes[axis],
                stride=stride[axis],
                nodes_spanned=nodes,
                level=cluster.levels[k].name if sizes[axis] > 1 else "-",
                link_kind=link.kind if sizes[axis] > 1 else "-",
                bandwidth_bytes_per_s=link.bandwidth_bytes_per_s,
                crosses_slow_link=sizes[axis] > 1
                and k > 0
                and link.bandwidth_bytes_per_s < cluster.levels[0].link.bandwidth_bytes_per_s,
                time_s=times_s.get(term, 0.0),
                cost_of_crossing_s=max(times_s.get(term, 0.0) - inner_times_s.get(term, 0.0), 0.0),
            )
        )
    detail = detail and layout.world_size <= PLACEMENT_DETAIL_MAX_RANKS
    return Placement(
        axis_order=layout.axis_order,
        groups=tuple(groups),
        rank_map=rank_map(layout, cluster) if detail else None,
        process_groups=process_groups(layout) if detail else None,
    )
