"""Topology graphs of server presets: GPUs, switches, NICs and links as a networkx graph.

Inside a server: an NVSwitch (or, for PCIe servers, GPUs on PCIe switches, optionally
NVLink-bridged in pairs, switches on CPU sockets). Across servers, each NIC (one per GPU, or one
per `gpus_per_nic` GPUs) joins a fabric:

- "rails": NIC r of every server on rail switch r (DGX SuperPOD style, non-blocking);
- "fat-tree": every NIC of a server on its leaf switch, `nodes_per_leaf` servers a leaf, each
  leaf joined to every spine with 1/`oversubscription` of its downlink bandwidth (two tiers).

Links carry kind, bandwidth_GBps per direction, latency_us (half a hop on each side of a switch)
and efficiency (achieved ring bus bandwidth / wire, from the server profile).
"""

from __future__ import annotations

from typing import Any

import networkx as nx

from berth.specs.errors import BerthError
from berth.specs.hardware import LinkProfile, ServerProfile

FABRICS = ("rails", "fat-tree")
SHARED_NIC_PCIE_HEADROOM = 2.0  # a GPU's PCIe path to a shared NIC is not its bottleneck (x2 the NIC)


def _link(
    g: nx.Graph,
    a: str,
    b: str,
    link: LinkProfile,
    bandwidth: float | None = None,
    kind: str | None = None,
    latency_s: float | None = None,
) -> None:
    g.add_edge(
        a,
        b,
        kind=kind or link.kind,
        bandwidth_GBps=(bandwidth or link.bandwidth_bytes_per_s) / 1e9,
        latency_us=(link.hop_latency_s / 2 if latency_s is None else latency_s) * 1e6,
        efficiency=link.collective_efficiency,
    )


def _server(g: nx.Graph, server: ServerProfile, host: str) -> list[str]:
    """Add one server's GPUs and internal wiring; return where each of its NICs attaches."""
    gpus = [f"{host}.g{i}" for i in range(server.gpus_per_node)]
    for gpu in gpus:
        g.add_node(gpu, kind="gpu", device=server.device, host=host)
    intra, pcie = server.intra_node, server.pcie
    if pcie is None:
        g.add_node(f"{host}.nvswitch", kind="switch")
        for gpu in gpus:
            _link(g, gpu, f"{host}.nvswitch", intra)
        attach = gpus
    else:
        per_socket = pcie.gpus_per_switch * pcie.switches_per_socket
        sockets = -(-server.gpus_per_node // per_socket)
        for s in range(sockets):
            g.add_node(f"{host}.cpu{s}", kind="switch")
            if s:
                _link(g, f"{host}.cpu0", f"{host}.cpu{s}", intra, pcie.inter_socket_bytes_per_s)
        attach = []
        for i, gpu in enumerate(gpus):
            sw = f"{host}.pcie{i // pcie.gpus_per_switch}"
            if sw not in g:
                g.add_node(sw, kind="switch")
                _link(g, sw, f"{host}.cpu{i // per_socket}", intra, pcie.switch_uplink_bytes_per_s)
            _link(g, gpu, sw, intra)
            attach.append(sw)
            if pcie.bridge_bytes_per_s and i % 2:
                _link(g, gpus[i - 1], gpu, intra, pcie.bridge_bytes_per_s, kind="nvlink")
    inter = server.inter_node
    nic_speed = inter.bandwidth_bytes_per_s * server.gpus_per_nic
    if server.gpus_per_nic == 1 and pcie is None:
        return gpus  # one NIC per GPU: the GPU itself is the fabric port
    nics = []
    for k in range(0, server.gpus_per_node, server.gpus_per_nic):
        nic = f"{host}.nic{k // server.gpus_per_nic}"
        g.add_node(nic, kind="nic")
        if pcie is None:
            for gpu in gpus[k : k + server.gpus_per_nic]:
                _link(g, gpu, nic, intra, SHARED_NIC_PCIE_HEADROOM * nic_speed, kind="pcie")
        else:
            near = attach[k] if server.gpus_per_nic <= pcie.gpus_per_switch else f"{host}.cpu0"
            _link(g, near, nic, intra)
        nics.append(nic)
    return nics


def check_fabric(fabric: str, nodes_per_leaf: int | None, oversubscription: float, nodes: int) -> None:
    """The fabric options, each error naming its field."""
    if fabric not in FABRICS:
        raise BerthError("cluster.fabric", fabric, f"use one of {', '.join(FABRICS)}")
    if nodes_per_leaf is not None and not 1 <= nodes_per_leaf <= nodes:
        raise BerthError("cluster.nodes_per_leaf", nodes_per_leaf, f"must be in 1..{nodes} (the nodes)")
    if (
        isinstance(oversubscription, bool)
        or not isinstance(oversubscription, (int, float))
        or not 1.0 <= oversubscription <= 64.0
    ):
        raise BerthError("cluster.oversubscription", oversubscription, "must be in 1..64 (1 = non-blocking)")
    if fabric == "rails" and (nodes_per_leaf or oversubscription != 1.0):
        raise BerthError("cluster.fabric", fabric, "nodes_per_leaf and oversubscription apply to fabric fat-tree")


def cluster_graph(
    servers: list[tuple[ServerProfile, int]],
    fabric: str = "rails",
    nodes_per_leaf: int | None = None,
    oversubscription: float = 1.0,
) -> nx.Graph:
    """The graph of the given servers (profile, count), hosts named n0, n1, ... in that order."""
    total = sum(n for _, n in servers)
    check_fabric(fabric, nodes_per_leaf, oversubscription, total)
    per_leaf = nodes_per_leaf or total
    g = nx.Graph()
    node = 0
    port_speeds: list[float] = []  # fabric bandwidth of each server
    spines = 1
    for server, count in servers:
        inter = server.inter_node
        for _ in range(count):
            host = f"n{node}"
            ports = _server(g, server, host)
            spines = max(spines, len(ports))  # a spine per server port, as many as the widest server
            speed = inter.bandwidth_bytes_per_s * server.gpus_per_nic
            port_speeds.append(speed * len(ports))
            for r, port in enumerate(ports):
                switch = f"rail{r}" if fabric == "rails" else f"leaf{node // per_leaf}"
                g.add_node(switch, kind="switch")
                _link(g, port, switch, inter, speed)
            node += 1
    leaves = -(-total // per_leaf)
    if fabric == "fat-tree" and leaves > 1:
        inter = servers[0][0].inter_node
        for leaf in range(leaves):
            down = sum(port_speeds[leaf * per_leaf : (leaf + 1) * per_leaf])
            for s in range(spines):
                g.add_node(f"spine{s}", kind="switch")
                _link(g, f"leaf{leaf}", f"spine{s}", inter, down / oversubscription / spines)
    return g


def to_node_link(g: nx.Graph) -> dict[str, Any]:
    """The documented JSON form of a graph (what `--cluster FILE.json` and the API accept)."""
    nodes = []
    for n, d in g.nodes(data=True):
        item = {"id": n, "kind": d["kind"]}
        if d["kind"] == "gpu":
            item.update(device=d["device"], host=d["host"])
        nodes.append(item)
    links = [
        {
            "source": u,
            "target": v,
            "kind": d["kind"],
            "bandwidth_GBps": round(d["bandwidth_GBps"], 6),
            "latency_us": round(d["latency_us"], 6),
            **({"efficiency": d["efficiency"]} if "efficiency" in d else {}),
        }
        for u, v, d in g.edges(data=True)
    ]
    return {"nodes": nodes, "links": links}
