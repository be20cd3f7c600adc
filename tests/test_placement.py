"""Placement as pure math: groups have the right sizes, partition the ranks, and sit on nodes as
the axis order says."""

import pytest

from berth.planner.placement import AXES, ORDERS, coordinates, process_groups, rank_map, spans
from berth.specs.tree import Layout
from berth.topology.clusters import cluster_from_preset

LAYOUTS = [Layout(tp=8, pp=4, dp=4), Layout(tp=2, pp=2, dp=8), Layout(tp=4, dp=16), Layout(pp=8, dp=8)]


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: x.short())
@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(o))
def test_groups_partition_the_ranks(layout, order):
    groups = process_groups(layout, order)
    sizes = {"tp": layout.tp, "dp": layout.dp, "pp": layout.pp}
    for axis in AXES:
        assert all(len(g) == sizes[axis] for g in groups[axis])
        members = sorted(r for g in groups[axis] for r in g)
        assert members == list(range(layout.world_size))  # every rank in exactly one group
    coords = coordinates(layout, order)
    seen = {tuple(int(coords[a][r]) for a in AXES) for r in range(layout.world_size)}
    assert len(seen) == layout.world_size  # coordinates are a bijection


def test_default_order_keeps_tp_inside_a_node_and_matches_the_executor():
    pytest.importorskip("torch", reason="compares with the executor's rank arithmetic (torch: the executor extra)")
    from berth.executor.parallel import Coordinates  # the executor's own rank arithmetic

    cluster = cluster_from_preset("dgx-h100", 16)
    layout = Layout(tp=8, pp=4, dp=4)
    s = spans(layout, cluster)
    assert not s["tp"].crosses_nodes and s["tp"].per_node == 8
    assert s["dp"].crosses_nodes and s["dp"].nodes == 4 and s["dp"].per_node == 1
    for entry in rank_map(layout, cluster):
        c = Coordinates.of(entry["rank"], layout)
        assert (c.tp_rank, c.dp_rank, c.pp_rank) == (entry["tp"], entry["dp"], entry["pp"])
        assert entry["node"] * 8 + entry["local_rank"] == entry["rank"]


def test_dp_innermost_puts_tp_across_nodes():
    cluster = cluster_from_preset("dgx-h100", 4)
    s = spans(Layout(tp=8, dp=4), cluster, order=("dp", "tp", "pp"))
    assert s["tp"].crosses_nodes and s["tp"].per_node == 2 and s["dp"].per_node == 4


@pytest.mark.parametrize("order", ORDERS, ids=lambda o: "-".join(o))
def test_context_parallel_ranks_sit_right_outside_tp(order):
    """cp sits right outside tp in every axis order (torchtitan's mesh ..., cp, tp; Megatron's tp-cp-...)."""
    from berth.planner.placement import RANK_AXES, strides

    layout = Layout(tp=4, cp=2, pp=2, dp=2, axis_order="-".join(order))
    groups = process_groups(layout)
    sizes = {"tp": 4, "cp": 2, "dp": 2, "pp": 2}
    for axis in RANK_AXES:
        assert all(len(g) == sizes[axis] for g in groups[axis])
        assert sorted(r for g in groups[axis] for r in g) == list(range(layout.world_size))
    st = strides(layout)
    assert st["cp"] == st["tp"] * 4
    if order[0] == "tp":
        assert groups["tp"][0] == [0, 1, 2, 3] and groups["cp"][0] == [0, 4]
    entry = rank_map(layout, cluster_from_preset("dgx-h100", 2))[5]
    assert {"tp", "cp", "dp", "pp"} <= set(entry)
