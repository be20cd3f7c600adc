"""Cluster topology: presets and user graphs become a networkx graph of GPUs, switches and links
(`graphs.py`), checked here, and derived into the ClusterSpec the cost model reads: hosts, the
hierarchy of fast domains (`hierarchy.py`) and the device. `local` is this machine.

Graph format (networkx node-link): GPU nodes {"id": "n0.g0", "kind": "gpu", "device": ..., "host":
"n0"}, switch or NIC nodes {"id": "n0.nvswitch", "kind": "switch"}, links {"source", "target",
"kind", "bandwidth_GBps" (per direction), "latency_us", optional "efficiency"}. docs/topology.md.
"""

from __future__ import annotations

import os
import shutil
import subprocess
from functools import lru_cache
from pathlib import Path
from typing import Any

import networkx as nx

from berth.hardware_profiles import UnknownProfileError, device_names, load_device, load_server, nvidia_smi_device
from berth.specs.errors import BerthError
from berth.specs.hardware import DeviceProfile, ServerProfile
from berth.specs.tree import MAX_GPUS_PER_NODE, MAX_NODES, ClusterSpec, check_host
from berth.topology.graphs import check_fabric, cluster_graph
from berth.topology.hierarchy import GRAPH_LINK_EFFICIENCY, derive_levels, gpu_order


def cluster_from_preset(
    preset: str, nodes: int, fabric: str = "rails", nodes_per_leaf: int | None = None, oversubscription: float = 1.0
) -> ClusterSpec:
    """Build the preset's graph for `nodes` servers and derive the ClusterSpec from it."""
    if not isinstance(nodes, int) or isinstance(nodes, bool) or nodes < 1 or nodes > MAX_NODES:
        raise BerthError("cluster.nodes", nodes, f"must be an integer in 1..{MAX_NODES}")
    try:
        load_server(preset)
    except UnknownProfileError as err:
        raise BerthError("cluster.preset", preset, f"unknown preset; known: {', '.join(err.known)}") from None
    return _preset_cluster(preset, nodes, fabric, nodes_per_leaf, oversubscription)


# On a rail fabric every node beyond the second adds GPUs to the top level and nothing else: the
# same NICs, rail switches, widest paths and per-GPU cut (tests/test_preset_scaling.py compares
# the shortcut with the full graph of every preset). A 2,048-node cluster is then derived from
# the graph of RAILS_SAMPLE_NODES nodes instead of one of 16,384 GPUs (2.2 s of a 2.5 s plan).
RAILS_SAMPLE_NODES = 2


@lru_cache(maxsize=64)
def _preset_cluster(
    preset: str, nodes: int, fabric: str, nodes_per_leaf: int | None, oversubscription: float
) -> ClusterSpec:
    """Presets are data: the same arguments always give the same (frozen) spec."""
    if fabric == "rails" and nodes > RAILS_SAMPLE_NODES:
        check_fabric(fabric, nodes_per_leaf, oversubscription, nodes)
        return _rails_scaled(_preset_cluster(preset, RAILS_SAMPLE_NODES, fabric, None, 1.0), nodes)
    server = load_server(preset)
    g = cluster_graph([(server, nodes)], fabric, nodes_per_leaf, oversubscription)
    name = (
        preset
        if fabric == "rails"
        else f"{preset} ({fabric}, {nodes_per_leaf or nodes} nodes a leaf, {oversubscription:g}:1)"
    )
    return cluster_from_graph(g, name, server)


def _rails_scaled(sample: ClusterSpec, nodes: int) -> ClusterSpec:
    """The rail-fabric cluster of `nodes` nodes from the one derived for fewer: the top level
    ("cluster") grows to every GPU, every level inside a node stays as it is."""
    top = sample.fabric[-1].model_copy(update={"gpus": nodes * sample.gpus_per_node})
    return sample.model_copy(
        update={"nodes": nodes, "fabric": (*sample.fabric[:-1], top), "hosts": tuple(f"n{i}" for i in range(nodes))}
    )


def cluster_from_graph(
    g: nx.Graph, name: str, server: ServerProfile | None = None, field: str = "cluster.graph"
) -> ClusterSpec:
    """Derive the ClusterSpec of a checked graph: hosts, the hierarchy of fast domains
    (`hierarchy.derive_levels`), and the device. A graph that mixes devices is planned on the
    slowest device's speed and the smallest memory, and says so in `notes`."""
    order = gpu_order(g)
    hosts: dict[str, int] = {}
    for x in order:
        hosts[g.nodes[x]["host"]] = hosts.get(g.nodes[x]["host"], 0) + 1
    sizes = set(hosts.values())
    if len(sizes) != 1:
        listed = ", ".join(f"{h}: {n}" for h, n in list(hosts.items())[:6])
        raise BerthError(f"{field}.nodes", listed, "hosts hold different GPU counts; not supported yet")
    counts: dict[str, int] = {}
    for x in order:
        counts[g.nodes[x]["device"]] = counts.get(g.nodes[x]["device"], 0) + 1
    device, notes = _device(counts, field)
    levels = derive_levels(g, order)
    per_host = sizes.pop()
    intra = max((lv for lv in levels if lv.gpus <= per_host), key=lambda lv: lv.gpus, default=levels[0])
    return ClusterSpec(
        name=name,
        nodes=len(hosts),
        gpus_per_node=per_host,
        device=device,
        intra_node=intra.link,
        inter_node=levels[-1].link,
        collective_base_latency_s=server.collective_base_latency_s if server else GRAPH_BASE_LATENCY_S,
        comm_overlap_efficiency=server.comm_overlap_efficiency
        if server
        else ClusterSpec.model_fields["comm_overlap_efficiency"].default,
        fabric=levels,
        devices=counts if len(counts) > 1 else {},
        notes=notes,
        hosts=tuple(hosts),
    )


def _device(counts: dict[str, int], field: str) -> tuple[DeviceProfile, tuple[str, ...]]:
    try:
        profiles = [load_device(name) for name in counts]
    except UnknownProfileError as err:
        raise BerthError(f"{field}.device", err.name, f"unknown device; known: {', '.join(err.known)}") from None
    if len(profiles) == 1:
        return profiles[0], ()
    kinds = {p.kind for p in profiles}
    if len(kinds) > 1:
        raise BerthError(f"{field}.nodes", sorted(counts), "a cluster cannot mix CPU workers and GPUs")
    slowest = min(profiles, key=lambda p: (p.peak_flops("bf16"), p.memory_bandwidth_bytes_per_s))
    smallest = min(profiles, key=lambda p: p.memory_bytes)
    mix = ", ".join(f"{n}x {name}" for name, n in counts.items())
    device = slowest.model_copy(
        update={
            "memory_bytes": smallest.memory_bytes,
            "display_name": f"{slowest.display_name} pace, {smallest.memory_bytes / 2**30:.0f} GiB bound ({mix})",
        }
    )
    notes = (
        f"heterogeneous cluster ({mix}): every synchronous step runs at the pace of the slowest device, "
        f"{slowest.name}, so the plan is predicted on its speed",
        f"every rank is planned against the smallest memory, {smallest.name}'s "
        f"{smallest.memory_bytes / 2**30:.0f} GiB, so each device's own memory bounds what is placed on it",
        "pipeline stages are not yet sized to device speed: faster devices idle at each step's barriers",
    )
    return device, notes


LOCAL = "local"


def local_gpus() -> list[tuple[str, float]]:
    """(name, memory bytes) of each GPU on this machine from nvidia-smi; [] without one. The
    planner does not import torch, so it asks the driver's tool."""
    if os.environ.get("BERTH_DEVICE") == "cpu" or shutil.which("nvidia-smi") is None:
        return []
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader,nounits"],
            capture_output=True,
            text=True,
            timeout=20,
            check=True,
        ).stdout
    except (OSError, subprocess.SubprocessError):
        return []
    gpus = []
    for line in out.strip().splitlines():
        name, _, mib = (x.strip() for x in line.rpartition(","))
        try:
            gpus.append((name, float(mib) * 2**20))
        except ValueError:  # a line that is not "name, MiB" (a driver message): not a GPU
            continue
    return gpus


def host_memory_bytes() -> float:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return float(line.split()[1]) * 1024
    except OSError:
        pass
    return float(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"))


def local_cluster(
    devices_per_node: int | None = None, profile: tuple[DeviceProfile, ServerProfile] | None = None
) -> ClusterSpec:
    """This machine as a one-node cluster: its GPUs, or with none, `devices_per_node` CPU worker
    processes (default: one per core) sharing the host's RAM, on the host CPU profile, or on the
    measured `profile` (from `berth profile`) when one is given. A profile of another kind of device
    (a GPU's, read on a machine without one, to re-predict its runs) describes the machine it was
    measured on: its device memory too, not this host's RAM; such a plan cannot run here (validate
    says so)."""
    if devices_per_node is not None and not 1 <= devices_per_node <= MAX_GPUS_PER_NODE:
        raise BerthError("cluster.devices_per_node", devices_per_node, f"must be in 1..{MAX_GPUS_PER_NODE}")
    gpus = local_gpus()
    if gpus:
        names = sorted({name for name, _ in gpus})
        if len(names) > 1:
            raise BerthError("cluster", LOCAL, f"this machine mixes GPUs ({', '.join(names)}); not supported")
        try:
            device_name, server_name = nvidia_smi_device(names[0])
        except UnknownProfileError as err:
            raise BerthError(
                "cluster",
                LOCAL,
                f"this machine's GPU {names[0]!r} has no device profile; known GPUs: "
                f"{', '.join(err.known)} (nvidia_smi in hardware_profiles/devices/*.json)",
            ) from None
        if devices_per_node is not None and devices_per_node > len(gpus):
            raise BerthError("cluster.devices_per_node", devices_per_node, f"this machine has {len(gpus)} GPUs")
        count = devices_per_node or len(gpus)
        server = load_server(server_name)
        memory = min(m for _, m in gpus)  # what nvidia-smi reports: the capacity each rank plans against
        device = load_device(device_name).model_copy(update={"memory_bytes": memory})
    else:
        count = devices_per_node or os.cpu_count() or 1
        server = load_server("local-cpu")
        device = load_device(server.device).model_copy(update={"memory_bytes": host_memory_bytes() / count})
    if profile is not None:
        same_kind = profile[0].kind == device.kind
        device = profile[0].model_copy(update={"memory_bytes": device.memory_bytes}) if same_kind else profile[0]
        server = profile[1]
    return ClusterSpec(
        name=LOCAL if profile is None else f"{LOCAL} (profiled)",
        nodes=1,
        gpus_per_node=count,
        device=device,
        intra_node=server.intra_node,
        inter_node=server.inter_node,
        collective_base_latency_s=server.collective_base_latency_s,
        comm_overlap_efficiency=server.comm_overlap_efficiency,
    )


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
                raise BerthError(
                    f"{where}.device", n.get("device"), f"unknown device; known: {', '.join(sorted(known))}"
                )
            if not isinstance(n.get("host"), str) or not n["host"]:
                raise BerthError(f"{where}.host", n.get("host"), "a GPU needs the host (server) it sits in")
            if (problem := check_host(n["host"])) is not None:
                raise BerthError(f"{where}.host", n["host"], f"must be {problem}")
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
        bw, lat, eff = e.get("bandwidth_GBps"), e.get("latency_us", 1.0), e.get("efficiency", None)
        if isinstance(bw, bool) or not isinstance(bw, (int, float)) or not 0 < bw < 1e6:
            raise BerthError(f"{where}.bandwidth_GBps", bw, "must be a positive number of GB/s (per direction)")
        if isinstance(lat, bool) or not isinstance(lat, (int, float)) or not 0 <= lat < 1e6:
            raise BerthError(f"{where}.latency_us", lat, "must be a non-negative number of microseconds")
        if eff is not None and (isinstance(eff, bool) or not isinstance(eff, (int, float)) or not 0 < eff <= 1):
            raise BerthError(f"{where}.efficiency", eff, "must be a number in (0, 1]: achieved / wire bandwidth")
        if g.has_edge(e["source"], e["target"]):
            raise BerthError(where, f"{e['source']}-{e['target']}", "duplicate link")
        g.add_edge(
            e["source"],
            e["target"],
            kind=e["kind"],
            bandwidth_GBps=float(bw),
            latency_us=float(lat),
            **({"efficiency": float(eff)} if eff is not None else {}),
        )
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


def cluster_from_node_link(data: Any, name: str = "graph", field: str = "cluster.graph") -> ClusterSpec:
    """A ClusterSpec from a node-link graph (JSON from a file or a request)."""
    return cluster_from_graph(graph_from_node_link(data, field), name, field=field)
