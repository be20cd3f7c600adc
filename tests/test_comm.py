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
