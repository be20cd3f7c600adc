"""Cluster topology: presets become a networkx graph of GPUs, switches and links, and the graph
is summarized into the ClusterSpec the cost model reads (fast domain inside a node, one NIC per
GPU across nodes).

Graph format (networkx node-link): GPU nodes {"id": "n0.g0", "kind": "gpu", "device": ..., "host":
"n0"}, switch nodes {"id": "n0.nvswitch", "kind": "switch"}, links {"source", "target", "kind",
"bandwidth_GBps" (per direction), "latency_us"}.
"""

from __future__ import annotations

import heapq
import math
import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import networkx as nx

from hardware_profiles import UnknownProfileError, device_names, load_device, load_server, server_names
from hardware_profiles.schema import DeviceProfile, LinkProfile, ServerProfile
from planner.errors import BerthError
from planner.specs import MAX_GPUS_PER_NODE, MAX_NODES, ClusterSpec


def cluster_from_preset(preset: str, nodes: int) -> ClusterSpec:
    """Build the preset's graph for `nodes` servers and summarize it into a ClusterSpec."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or nodes > MAX_NODES:
        raise BerthError("cluster.nodes", nodes, f"must be an integer in 1..{MAX_NODES}")
    try:
        load_server(preset)
    except UnknownProfileError as err:
        raise BerthError("cluster.preset", preset, f"unknown preset; known: {', '.join(err.known)}") from None
    return _preset_cluster(preset, nodes)


@lru_cache(maxsize=64)
def _preset_cluster(preset: str, nodes: int) -> ClusterSpec:
    """Presets are data: the same (preset, nodes) always gives the same (frozen) spec."""
    server = load_server(preset)
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
        comm_overlap_efficiency=server.comm_overlap_efficiency,
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
GPU_NAMES = (("H200", "h200"), ("H100 PCIe", "h100-pcie"), ("H100", "h100-sxm"), ("A100-SXM4-80GB", "a100-80g"),
             ("A100 80GB", "a100-80g"), ("A100-SXM4-40GB", "a100-40g"), ("B200", "b200"), ("L40S", "l40s"),
             ("L4", "l4"), ("MI300X", "mi300x"))


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


def local_cluster(devices_per_node: int | None = None,
                  profile: tuple[DeviceProfile, ServerProfile] | None = None) -> ClusterSpec:
    """This machine as a one-node cluster: its GPUs, or with none, `devices_per_node` CPU worker
    processes (default: one per core) sharing the host's RAM, on the host CPU profile, or on the
    measured `profile` (from `berth profile`) when one is given."""
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
    if profile is not None:
        device = profile[0].model_copy(update={"memory_bytes": device.memory_bytes})
        server = profile[1]
    return ClusterSpec(name=LOCAL if profile is None else f"{LOCAL} (profiled)", nodes=1, gpus_per_node=count,
                       device=device, intra_node=server.intra_node,
                       inter_node=server.inter_node, collective_base_latency_s=server.collective_base_latency_s,
                       comm_overlap_efficiency=server.comm_overlap_efficiency)


# Achieved ring bus bandwidth / wire bandwidth per link kind, for graphs (presets carry their own).
GRAPH_LINK_EFFICIENCY = {
    "nvlink": 0.78,  # DGX A100 nccl-tests all-reduce busbw 234.9 of 300 GB/s (hardware_facts.json)
    "nvswitch": 0.78,
    "infiniband": 0.96,  # one HDR NIC: 24 of 25 GB/s (hardware_facts.json)
    "ethernet": 0.8,  # assumption: RoCE/TCP reach less of the wire than InfiniBand
    "pcie": 0.8,  # assumption: PCIe Gen4/5 peer transfers reach about 80% of the wire
    "loopback": 1.0,
}
LINK_KINDS = tuple(GRAPH_LINK_EFFICIENCY)
GRAPH_BASE_LATENCY_S = 8.4e-6  # NCCL tuner base latency (hardware_facts.json), as in the presets
MAX_GRAPH_ELEMENTS = 200_000


def graph_from_node_link(data: Any, field: str = "cluster.graph") -> nx.Graph:
    """Parse and check a node-link graph: {"nodes": [{"id", "kind": "gpu"|"switch"|"nic", "device",
    "host"}], "links": [{"source", "target", "kind", "bandwidth_GBps", "latency_us"}]}. Every
    problem is a BerthError naming the element."""
    if not isinstance(data, dict) or not isinstance(data.get("nodes"), list) or not isinstance(data.get("links"), list):
        raise BerthError(field, _brief(data), 'expected {"nodes": [...], "links": [...]}')
    nodes, links = data["nodes"], data["links"]
    if len(nodes) + len(links) > MAX_GRAPH_ELEMENTS:
        raise BerthError(field, len(nodes) + len(links), f"graph too large: at most {MAX_GRAPH_ELEMENTS} nodes + links")
    g = nx.Graph()
    known = set(device_names())
    for i, n in enumerate(nodes):
        where = f"{field}.nodes[{i}]"
        if not isinstance(n, dict) or not isinstance(n.get("id"), str) or not n["id"]:
            raise BerthError(where, _brief(n), "each node needs a non-empty string id")
        if n["id"] in g:
            raise BerthError(f"{where}.id", n["id"], "duplicate node id")
        kind = n.get("kind")
        if kind not in ("gpu", "switch", "nic"):
            raise BerthError(f"{where}.kind", kind, "must be gpu, switch or nic")
        if kind == "gpu":
            if n.get("device") not in known:
                raise BerthError(f"{where}.device", n.get("device"),
                                 f"unknown device; known: {', '.join(sorted(known))}")
            if not isinstance(n.get("host"), str) or not n["host"]:
                raise BerthError(f"{where}.host", n.get("host"), "a GPU needs the host (server) it sits in")
        g.add_node(n["id"], **{k: v for k, v in n.items() if k != "id"})
    for i, e in enumerate(links):
        where = f"{field}.links[{i}]"
        if not isinstance(e, dict):
            raise BerthError(where, _brief(e), "each link must be an object")
        for end in ("source", "target"):
            if e.get(end) not in g:
                raise BerthError(f"{where}.{end}", e.get(end), "not a node id of the graph")
        if e["source"] == e["target"]:
            raise BerthError(where, e["source"], "self-loop: a link must join two different nodes")
        if e.get("kind") not in LINK_KINDS:
            raise BerthError(f"{where}.kind", e.get("kind"), f"must be one of {', '.join(LINK_KINDS)}")
        bw, lat = e.get("bandwidth_GBps"), e.get("latency_us", 1.0)
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < 1e6:
            raise BerthError(f"{where}.bandwidth_GBps", bw, "must be a positive number of GB/s (per direction)")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < 1e6:
            raise BerthError(f"{where}.latency_us", lat, "must be a non-negative number of microseconds")
        if g.has_edge(e["source"], e["target"]):
            raise BerthError(where, f"{e['source']}-{e['target']}", "duplicate link")
        g.add_edge(e["source"], e["target"], kind=e["kind"], bandwidth_GBps=float(bw), latency_us=float(lat))
    gpus = [n for n, d in g.nodes(data=True) if d["kind"] == "gpu"]
    if not gpus:
        raise BerthError(f"{field}.nodes", len(nodes), "the graph has no GPU node")
    component = nx.node_connected_component(g, gpus[0])
    stray = next((n for n in gpus if n not in component), None)
    if stray is not None:
        raise BerthError(f"{field}", stray, f"disconnected: GPU {stray!r} has no path to GPU {gpus[0]!r}")
    return g


def _brief(value: Any) -> Any:
    text = repr(value)
    return text if len(text) <= 60 else text[:57] + "..."


def _widest_path_GBps(g: nx.Graph, source: str, targets: set[str],
                      allowed: set[str] | None = None) -> tuple[float, float]:
    """(bottleneck bandwidth, latency along it) of the widest path from source to any target,
    optionally through `allowed` nodes only (modified Dijkstra, max-min)."""
    best = {source: math.inf}
    latency = {source: 0.0}
    heap = [(-math.inf, source)]
    while heap:
        neg, u = heapq.heappop(heap)
        width = -neg
        if u in targets and u != source:
            return width, latency[u]
        if width < best.get(u, 0):
            continue
        for v, d in g[u].items():
            if allowed is not None and v not in allowed:
                continue
            w = min(width, d["bandwidth_GBps"])
            if w > best.get(v, 0):
                best[v], latency[v] = w, latency[u] + d["latency_us"]
                heapq.heappush(heap, (-w, v))
    return 0.0, 0.0


def _link_profile(kind: str, bandwidth_GBps: float, latency_us: float) -> LinkProfile:
    return LinkProfile(kind=kind, bandwidth_bytes_per_s=bandwidth_GBps * 1e9,
                       collective_efficiency=GRAPH_LINK_EFFICIENCY[kind], hop_latency_s=latency_us * 1e-6)


def cluster_from_node_link(data: Any, name: str = "graph", field: str = "cluster.graph") -> ClusterSpec:
    """A ClusterSpec from a node-link graph: hosts and GPUs per host; the intra-node link is the
    worst widest path between two GPUs of a host through that host's own switches, the
    inter-node link the worst widest path from a GPU to another host. (Issue 6 widens this to
    per-group collectives, link sharing and heterogeneous clusters.)"""
    g = graph_from_node_link(data, field)
    hosts: dict[str, list[str]] = {}
    for n, d in g.nodes(data=True):
        if d["kind"] == "gpu":
            hosts.setdefault(d["host"], []).append(n)
    sizes = {len(v) for v in hosts.values()}
    if len(sizes) != 1:
        raise BerthError(f"{field}.nodes", sorted(sizes), "hosts hold different GPU counts; not supported yet")
    devices = {g.nodes[n]["device"] for gs in hosts.values() for n in gs}
    if len(devices) != 1:
        raise BerthError(f"{field}.nodes", sorted(devices), "mixed GPU types are not supported yet")
    device = load_device(devices.pop())
    gpus_of = {n: h for h, gs in hosts.items() for n in gs}
    intra = (math.inf, 0.0, "loopback")
    inter = (math.inf, 0.0, "loopback")
    for host, gs in hosts.items():
        # switches that serve only this host's GPUs belong to its fast domain
        local = set(gs) | {n for n, d in g.nodes(data=True) if d["kind"] != "gpu"
                           and {gpus_of.get(m) for m in g[n] if m in gpus_of} == {host}}
        for gpu in gs[:2] if len(gs) > 1 else []:
            bw, lat = _widest_path_GBps(g, gpu, set(gs) - {gpu}, local)
            if bw == 0:
                bw, lat = _widest_path_GBps(g, gpu, set(gs) - {gpu})
            kind = max(g[gpu].items(), key=lambda kv: kv[1]["bandwidth_GBps"])[1]["kind"]
            intra = min(intra, (bw, lat, kind))
        if len(hosts) > 1:
            others = set(gpus_of) - set(gs)
            bw, lat = _widest_path_GBps(g, gs[0], others)
            kinds = [d["kind"] for m, d in g[gs[0]].items() if m not in local] or ["ethernet"]
            inter = min(inter, (bw, lat, kinds[0]))
    if intra[0] == math.inf:
        intra = inter if inter[0] != math.inf else (1.0, 0.0, "loopback")
    if inter[0] == math.inf:
        inter = intra
    return ClusterSpec(name=name, nodes=len(hosts), gpus_per_node=sizes.pop(), device=device,
                       intra_node=_link_profile(intra[2], intra[0], intra[1] / 2),
                       inter_node=_link_profile(inter[2], inter[0], inter[1] / 2),
                       collective_base_latency_s=GRAPH_BASE_LATENCY_S)
