"""Cluster topology: presets become a networkx graph of GPUs, switches and links, and the graph
is summarized into the ClusterSpec the cost model reads (fast domain inside a node, one NIC per
GPU across nodes).

Graph format (networkx node-link): GPU nodes {"id": "n0.g0", "kind": "gpu", "device": ..., "host":
"n0"}, switch nodes {"id": "n0.nvswitch", "kind": "switch"}, links {"source", "target", "kind",
"bandwidth_GBps" (per direction), "latency_us"}.
"""

from __future__ import annotations

import networkx as nx

from hardware_profiles import UnknownProfileError, load_device, load_server
from hardware_profiles.schema import ServerProfile
from planner.errors import BerthError
from planner.specs import MAX_NODES, ClusterSpec


def cluster_from_preset(preset: str, nodes: int) -> ClusterSpec:
    if not isinstance(nodes, int) or nodes < 1 or nodes > MAX_NODES:
        raise BerthError("cluster.nodes", nodes, f"must be an integer in 1..{MAX_NODES}")
    try:
        server = load_server(preset)
        device = load_device(server.device)
    except UnknownProfileError as err:
        raise BerthError("cluster.preset", preset, f"unknown preset; known: {', '.join(err.known)}") from None
    return ClusterSpec(
        name=preset,
        nodes=nodes,
        gpus_per_node=server.gpus_per_node,
        device=device,
        intra_node=server.intra_node,
        inter_node=server.inter_node,
        collective_base_latency_s=server.collective_base_latency_s,
    )


def preset_graph(server: ServerProfile, nodes: int) -> nx.Graph:
    """The graph of `nodes` servers: each GPU on the node's NVSwitch and on its own NIC rail
    (rail r of every node on leaf switch r)."""
    g = nx.Graph()
    intra, inter = server.intra_node, server.inter_node
    for r in range(server.gpus_per_node):
        g.add_node(f"rail{r}", kind="switch")
    for n in range(nodes):
        sw = f"n{n}.nvswitch"
        g.add_node(sw, kind="switch")
        for r in range(server.gpus_per_node):
            gpu = f"n{n}.g{r}"
            g.add_node(gpu, kind="gpu", device=server.device, host=f"n{n}")
            g.add_edge(gpu, sw, kind=intra.kind, bandwidth_GBps=intra.bandwidth_bytes_per_s / 1e9,
                       latency_us=intra.hop_latency_s * 1e6)
            g.add_edge(gpu, f"rail{r}", kind=inter.kind, bandwidth_GBps=inter.bandwidth_bytes_per_s / 1e9,
                       latency_us=inter.hop_latency_s * 1e6)
    return g


def graph_summary(g: nx.Graph) -> dict[str, int]:
    """Hosts and GPUs per host of a graph (the seam the general graph input will widen)."""
    hosts: dict[str, int] = {}
    for _, data in g.nodes(data=True):
        if data.get("kind") == "gpu":
            hosts[data["host"]] = hosts.get(data["host"], 0) + 1
    sizes = set(hosts.values())
    return {"nodes": len(hosts), "gpus_per_node": max(sizes) if sizes else 0}
