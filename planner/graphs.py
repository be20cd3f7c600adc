"""Topology graphs of server presets: GPUs, switches, NICs and links as a `Graph`.

Inside a server: an NVSwitch (or, for PCIe servers, GPUs on PCIe switches, optionally
NVLink-bridged in pairs, switches on CPU sockets). Across servers, each NIC (one per GPU, or one
per `gpus_per_nic` GPUs) joins a fabric:

- "rails": NIC r of every server on rail switch r (DGX SuperPOD style, non-blocking);
- "fat-tree": every NIC of a server on its leaf switch, `nodes_per_leaf` servers a leaf, each
  leaf joined to every spine with 1/`oversubscription` of its downlink bandwidth (two tiers).

Links carry kind, bandwidth_GBps per direction, latency_us (half a hop on each side of a switch)
and efficiency (achieved ring bus bandwidth / wire, from the server profile).

`Graph` is the part of networkx.Graph the planner uses, with networkx's orders (nodes as added;
edges node by node, each once, a node's neighbours as linked), so the maximum spanning tree breaks
ties as networkx's Kruskal does (tests/test_topology.py checks both against networkx). Importing
networkx took 0.1 s, a tenth of `berth plan` (tests/test_cli.py keeps it, fastapi and torch out).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

from hardware_profiles.schema import LinkProfile, ServerProfile
from planner.errors import BerthError

FABRICS = ("rails", "fat-tree")
SHARED_NIC_PCIE_HEADROOM = 2.0  # a GPU's PCIe path to a shared NIC is not its bottleneck (x2 the NIC)


class _Nodes:
    """`g.nodes[n]` (its attributes) and `g.nodes(data=True)`, as networkx's NodeView."""

    def __init__(self, node: dict[str, dict]):
        self._node = node

    def __getitem__(self, n: str) -> dict:
        return self._node[n]

    def __iter__(self) -> Iterator[str]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def __contains__(self, n: object) -> bool:
        return n in self._node

    def __call__(self, data: bool = False) -> Iterable:
        return self._node.items() if data else self._node.keys()


class _Edges:
    """`g.edges[u, v]` (its attributes) and `g.edges(data=True)`, as networkx's EdgeView."""

    def __init__(self, adj: dict[str, dict[str, dict]]):
        self._adj = adj

    def __getitem__(self, e: tuple[str, str]) -> dict:
        return self._adj[e[0]][e[1]]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return ((u, v) for u, v, _ in self(data=True))

    def __len__(self) -> int:
        return sum(1 for _ in self(data=True))

    def __call__(self, data: bool = False) -> Iterator[tuple]:
        seen: set[str] = set()
        for u, nbrs in self._adj.items():
            for v, d in nbrs.items():
                if v not in seen:
                    yield (u, v, d) if data else (u, v)
            seen.add(u)


class Graph:
    """An undirected graph with node and edge attributes (module docstring)."""

    def __init__(self) -> None:
        self._node: dict[str, dict] = {}
        self._adj: dict[str, dict[str, dict]] = {}

    def add_node(self, n: str, **attr: Any) -> None:
        if n not in self._node:
            self._adj[n] = {}
            self._node[n] = attr
        else:
            self._node[n].update(attr)

    def add_edge(self, u: str, v: str, **attr: Any) -> None:
        for x in (u, v):
            if x not in self._node:
                self._adj[x] = {}
                self._node[x] = {}
        d = self._adj[u].get(v, {})
        d.update(attr)
        self._adj[u][v] = self._adj[v][u] = d

    def has_edge(self, u: str, v: str) -> bool:
        return u in self._adj and v in self._adj[u]

    def __contains__(self, n: object) -> bool:
        return n in self._node

    def __iter__(self) -> Iterator[str]:
        return iter(self._node)

    def __len__(self) -> int:
        return len(self._node)

    def __getitem__(self, n: str) -> dict[str, dict]:
        """n's neighbours and the attributes of the link to each."""
        return self._adj[n]

    @property
    def nodes(self) -> _Nodes:
        return _Nodes(self._node)

    @property
    def edges(self) -> _Edges:
        return _Edges(self._adj)

    def number_of_nodes(self) -> int:
        return len(self._node)

    def number_of_edges(self) -> int:
        return len(self.edges)

    def subgraph(self, nodes: Iterable[str]) -> Graph:
        """The graph induced on `nodes`, in this graph's orders (attributes shared, not copied)."""
        keep = set(nodes)
        sub = Graph()
        for n, attr in self._node.items():
            if n in keep:
                sub._node[n] = attr
                sub._adj[n] = {v: d for v, d in self._adj[n].items() if v in keep}
        return sub


class UnionFind:
    """Disjoint sets: `uf[x]` names x's set, `union(a, b)` joins two."""

    def __init__(self) -> None:
        self._parent: dict[str, str] = {}

    def __getitem__(self, x: str) -> str:
        parent = self._parent
        root = parent.setdefault(x, x)
        while parent[root] != root:
            root = parent[root]
        while parent[x] != root:  # path compression
            parent[x], x = root, parent[x]
        return root

    def union(self, a: str, b: str) -> None:
        ra, rb = self[a], self[b]
        if ra != rb:
            self._parent[rb] = ra


def maximum_spanning_edges(g: Graph, weight: str) -> list[tuple[str, str, dict]]:
    """The edges of a maximum spanning forest, Kruskal's way as networkx.maximum_spanning_tree
    picks them: the heaviest first, equal weights in the graph's edge order."""
    sets = UnionFind()
    tree = []
    for u, v, d in sorted(g.edges(data=True), key=lambda e: e[2][weight], reverse=True):
        if sets[u] != sets[v]:
            tree.append((u, v, d))
            sets.union(u, v)
    return tree


def connected_component(g: Graph, source: str) -> set[str]:
    """The nodes reachable from `source`."""
    seen, frontier = {source}, [source]
    while frontier:
        nxt = []
        for u in frontier:
            for v in g[u]:
                if v not in seen:
                    seen.add(v)
                    nxt.append(v)
        frontier = nxt
    return seen


def _link(g: Graph, a: str, b: str, link: LinkProfile, bandwidth: float | None = None,
          kind: str | None = None, latency_s: float | None = None) -> None:
    g.add_edge(a, b, kind=kind or link.kind, bandwidth_GBps=(bandwidth or link.bandwidth_bytes_per_s) / 1e9,
               latency_us=(link.hop_latency_s / 2 if latency_s is None else latency_s) * 1e6,
               efficiency=link.collective_efficiency)


def _server(g: Graph, server: ServerProfile, host: str) -> list[str]:
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
            for gpu in gpus[k:k + server.gpus_per_nic]:
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
    if isinstance(oversubscription, bool) or not isinstance(oversubscription, (int, float)) or \
            not 1.0 <= oversubscription <= 64.0:
        raise BerthError("cluster.oversubscription", oversubscription, "must be in 1..64 (1 = non-blocking)")
    if fabric == "rails" and (nodes_per_leaf or oversubscription != 1.0):
        raise BerthError("cluster.fabric", fabric, "nodes_per_leaf and oversubscription apply to fabric fat-tree")


def cluster_graph(servers: list[tuple[ServerProfile, int]], fabric: str = "rails", nodes_per_leaf: int | None = None,
                  oversubscription: float = 1.0) -> Graph:
    """The graph of the given servers (profile, count), hosts named n0, n1, ... in that order."""
    total = sum(n for _, n in servers)
    check_fabric(fabric, nodes_per_leaf, oversubscription, total)
    per_leaf = nodes_per_leaf or total
    g = Graph()
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
            down = sum(port_speeds[leaf * per_leaf:(leaf + 1) * per_leaf])
            for s in range(spines):
                g.add_node(f"spine{s}", kind="switch")
                _link(g, f"leaf{leaf}", f"spine{s}", inter, down / oversubscription / spines)
    return g


def to_node_link(g: Graph) -> dict[str, Any]:
    """The documented JSON form of a graph (what `--cluster FILE.json` and the API accept)."""
    nodes = []
    for n, d in g.nodes(data=True):
        item = {"id": n, "kind": d["kind"]}
        if d["kind"] == "gpu":
            item.update(device=d["device"], host=d["host"])
        nodes.append(item)
    links = [{"source": u, "target": v, "kind": d["kind"], "bandwidth_GBps": round(d["bandwidth_GBps"], 6),
              "latency_us": round(d["latency_us"], 6), **({"efficiency": d["efficiency"]} if "efficiency" in d else {})}
             for u, v, d in g.edges(data=True)]
    return {"nodes": nodes, "links": links}
