"""Rail-fabric presets are derived from a 2-node sample graph and scaled (topology/clusters.py):
the result must equal the cluster derived from the full graph of every preset."""

import pytest

from berth.hardware_profiles import load_server, server_names
from berth.topology.clusters import RAILS_SAMPLE_NODES, _preset_cluster, cluster_from_graph
from berth.topology.graphs import cluster_graph


@pytest.mark.parametrize("preset", [p for p in server_names() if p != "local-cpu"])
def test_scaled_rails_cluster_equals_the_full_graph(preset):
    server = load_server(preset)
    for nodes in (RAILS_SAMPLE_NODES + 1, 4, 8):
        full = cluster_from_graph(cluster_graph([(server, nodes)], "rails", None, 1.0), preset, server)
        assert _preset_cluster(preset, nodes, "rails", None, 1.0) == full, (preset, nodes)
