"""Collective model: flat ring against hand computation; hierarchy across nodes."""

import numpy as np
import pytest

from berth.cost_models import comm
from berth.topology.clusters import cluster_from_preset


def test_flat_ring_all_reduce_inside_a_node():
    c = cluster_from_preset("dgx-h100", 1)
    n, size = 8, 1e9
    bw = c.intra_node.bandwidth_bytes_per_s * c.intra_node.collective_efficiency
    expected = 2 * (n - 1) / n * size / bw + 2 * (n - 1) * c.intra_node.hop_latency_s + c.collective_base_latency_s
    assert float(comm.all_reduce_s(c, size, n, 1)) == pytest.approx(expected)


def test_single_rank_group_costs_nothing():
    c = cluster_from_preset("dgx-h100", 1)
    assert float(comm.all_reduce_s(c, 1e9, 1, 1)) == 0.0


def test_group_spanning_nodes_pays_the_nic_hop():
    """Hierarchical all-reduce: the intra-node phases plus a ring over 8 NIC rails. With 8 rails of
    NDR (8 x 47 GB/s per node) that is ~1.5x the in-node time, and with one GPU per node (a dp group
    of tp=8 replicas) the whole buffer crosses one NIC."""
    c = cluster_from_preset("dgx-h100", 2)
    inside = float(comm.all_reduce_s(c, 1e8, 8, 1))
    across = float(comm.all_reduce_s(c, 1e8, 16, 1))
    one_rail = float(comm.all_reduce_s(c, 1e8, 2, 8))
    assert 1.3 * inside < across < one_rail
    nic = c.inter_node.bandwidth_bytes_per_s * c.inter_node.collective_efficiency
    assert one_rail == pytest.approx(1e8 / nic + 2 * c.inter_node.hop_latency_s + c.collective_base_latency_s)


def test_members_per_block_follow_rank_order():
    assert comm.members_per_block(np.array(16), np.array(1), 8) == 8
    assert comm.members_per_block(np.array(16), np.array(8), 8) == 1
    assert comm.members_per_block(np.array(4), np.array(2), 8) == 4


def test_busbw_matches_nccl_tests_inside_a_dgx():
    """Large all-reduce inside one DGX reproduces the published nccl-tests bus bandwidth."""
    for preset, busbw in (("dgx-a100-80g", 234.89e9), ("dgx-h100", 367.6e9)):
        c = cluster_from_preset(preset, 1)
        size, n = 16 * 2**30, 8
        t = float(comm.all_reduce_s(c, size, n, 1))
        predicted_busbw = size / t * 2 * (n - 1) / n
        assert predicted_busbw == pytest.approx(busbw, rel=0.03)


def test_preset_cluster_is_derived_from_its_graph():
    from berth.hardware_profiles import load_server
    from berth.topology.graphs import cluster_graph

    g = cluster_graph([(load_server("dgx-a100-80g"), 3)])
    assert g.number_of_nodes() == 3 * 8 + 3 + 8  # GPUs, one NVSwitch per node, 8 rail switches
    c = cluster_from_preset("dgx-a100-80g", 3)
    assert (c.world_size, c.intra_node.bandwidth_bytes_per_s, c.inter_node.bandwidth_bytes_per_s) == (24, 300e9, 25e9)
    assert [(lv.gpus, lv.link.kind) for lv in c.levels] == [(8, "nvswitch"), (24, "infiniband")]
    assert c.hosts == ("n0", "n1", "n2")


def test_all_reduce_across_many_nodes_runs_nccls_tree_where_it_is_faster():
    """NCCL's tuning model (src/graph/tuning.cc): a ring all-reduce takes 2 (n - 1) latency steps, the tree 2 log2
    of the nodes between them, at 0.92 of the bus bandwidth and without the ring's (n - 1) / n. A small buffer over
    64 nodes runs the tree; a large one over 2 nodes the ring; reduce-scatter is ring only."""
    c = cluster_from_preset("aws-p5", 64)
    hop, base = c.inter_node.hop_latency_s, c.collective_base_latency_s
    # one GPU per node (stride 8): only the inter-node level
    small = float(comm.all_reduce_s(c, 0.0, 64, 8))
    assert small == pytest.approx(2 * 6 * hop + base)  # tree: log2(64) = 6 steps each way, against 63 for the ring
    assert float(comm.reduce_scatter_s(c, 0.0, 64, 8)) == pytest.approx(63 * hop + base)
    two = cluster_from_preset("aws-p5", 2)
    nic = two.inter_node.bandwidth_bytes_per_s * two.inter_node.collective_efficiency
    big = float(comm.all_reduce_s(two, 1e9, 2, 8))
    assert big == pytest.approx(2 * (0.5 * 1e9 / nic + hop) + base)  # the ring: half the buffer each way
    # a whole-node group over 64 nodes: the node's ring, then the tree over the nodes with 1/8 of the buffer each
    bw8 = c.intra_node.bandwidth_bytes_per_s * c.intra_node.collective_efficiency
    whole = float(comm.all_reduce_s(c, 8e9, 512, 1))
    tree = 2 * (7 / 8 * 8e9 / bw8 + 7 * c.intra_node.hop_latency_s + 1e9 / (0.92 * nic) + 6 * hop) + base
    ring = 2 * (7 / 8 * 8e9 / bw8 + 7 * c.intra_node.hop_latency_s + 63 / 64 * 1e9 / nic + 63 * hop) + base
    assert whole == pytest.approx(min(tree, ring))
