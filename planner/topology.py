"""Cluster topology: presets become a networkx graph of GPUs, switches and links, and the graph
is summarized into the ClusterSpec the cost model reads (fast domain inside a node, one NIC per
GPU across nodes).

Graph format (networkx node-link): GPU nodes {"id": "n0.g0", "kind": "gpu", "device": ..., "host":
"n0"}, switch nodes {"id": "n0.nvswitch", "kind": "switch"}, links {"source", "target", "kind",
"bandwidth_GBps" (per direction), "latency_us"}.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from pathlib import Path

import networkx as nx

from hardware_profiles import UnknownProfileError, device_names, load_device, load_server, server_names
from hardware_profiles.schema import ServerProfile
from planner.errors import BerthError
from planner.specs import MAX_GPUS_PER_NODE, MAX_NODES, ClusterSpec


def cluster_from_preset(preset: str, nodes: int) -> ClusterSpec:
    """Build the preset's graph for `nodes` servers and summarize it into a ClusterSpec."""
    if not isinstance(nodes, int) or nodes < 1 or nodes > MAX_NODES:
        raise BerthError("cluster.nodes", nodes, f"must be an integer in 1..{MAX_NODES}")
    try:
        server = load_server(preset)
    except UnknownProfileError as err:
        raise BerthError("cluster.preset", preset, f"unknown preset; known: {', '.join(err.known)}") from None
    return cluster_from_graph(preset_graph(server, nodes), preset, server)


def cluster_from_graph(g: nx.Graph, name: str, server: ServerProfile) -> ClusterSpec:
    """Summarize a graph: hosts and GPUs per host from the GPU nodes; the intra-node link is the
    slowest GPU link inside a host's fast domain, the inter-node link the slowest NIC link.
    Collective efficiencies and latencies per link kind come from the server profile."""
    summary = graph_summary(g)
    devices = {d["device"] for _, d in g.nodes(data=True) if d.get("kind") == "gpu"}
    if len(devices) != 1:
        raise BerthError("cluster.graph", sorted(devices), "mixed GPU types are not supported yet")
    try:
        device = load_device(devices.pop())
    except UnknownProfileError as err:
        raise BerthError("cluster.device", err.name, f"unknown device; known: {', '.join(err.known)}") from None
    intra_bw = _slowest(g, server.intra_node.kind)
    inter_bw = _slowest(g, server.inter_node.kind)
    return ClusterSpec(
        name=name,
        nodes=summary["nodes"],
        gpus_per_node=summary["gpus_per_node"],
        device=device,
        intra_node=server.intra_node.model_copy(update={"bandwidth_bytes_per_s": intra_bw}),
        inter_node=server.inter_node.model_copy(update={"bandwidth_bytes_per_s": inter_bw}),
        collective_base_latency_s=server.collective_base_latency_s,
    )


def _slowest(g: nx.Graph, kind: str) -> float:
    """Bandwidth (bytes/s per direction) of the slowest link of this kind in the graph."""
    return min(d["bandwidth_GBps"] for _, _, d in g.edges(data=True) if d["kind"] == kind) * 1e9


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


LOCAL = "local"
# nvidia-smi name fragment -> device profile (most specific first)
GPU_NAMES = (("H200", "h200"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80g"), ("A100 80GB", "a100-80g"))


def local_gpus() -> list[tuple[str, float]]:
    """(name, memory bytes) of each GPU on this machine from nvidia-smi; [] without one. The
    planner does not import torch, so it asks the driver's tool."""
    if os.environ.get("BERTH_DEVICE") == "cpu" or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=20, check=True).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, mib = (x.strip() for x in line.rsplit(",", 1))
        gpus.append((name, float(mib) * 2**20))
    return gpus


def host_memory_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_cluster(devices_per_node: int | None = None) -> ClusterSpec:
    """This machine as a one-node cluster: its GPUs, or with none, `devices_per_node` CPU worker
    processes (default: one per core) sharing the host's RAM, on the host CPU profile."""
    if devices_per_node is not None and not 1 <= devices_per_node <= MAX_GPUS_PER_NODE:
        raise BerthError("cluster.devices_per_node", devices_per_node, f"must be in 1..{MAX_GPUS_PER_NODE}")
    gpus = local_gpus()
    if gpus:
        name, memory = gpus[0]
        profile = next((p for frag, p in GPU_NAMES if frag in name), None)
        if profile is None:
            raise BerthError("cluster", LOCAL, f"this machine's GPU {name!r} has no profile; known devices: "
                             f"{', '.join(device_names())}")
        if devices_per_node is not None and devices_per_node > len(gpus):
            raise BerthError("cluster.devices_per_node", devices_per_node, f"this machine has {len(gpus)} GPUs")
        count = devices_per_node or len(gpus)
        server = next(load_server(s) for s in server_names() if load_server(s).device == profile)
        device = load_device(profile).model_copy(update={"memory_bytes": memory})
    else:
        count = devices_per_node or os.cpu_count() or 1
        server = load_server("local-cpu")
        device = load_device(server.device).model_copy(update={"memory_bytes": host_memory_bytes() / count})
    return ClusterSpec(name=LOCAL, nodes=1, gpus_per_node=count, device=device, intra_node=server.intra_node,
                       inter_node=server.inter_node, collective_base_latency_s=server.collective_base_latency_s)
