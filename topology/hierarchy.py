"""From a topology graph to the hierarchy of fast domains the collective model reads.

GPUs are numbered in rank order: hosts in natural order ("n2" before "n10"), a host's GPUs in
natural order of their ids. A level is a block size D (a run of D consecutive GPUs); the chain of
levels comes from the graph itself: the fast domains of its maximum spanning tree (components
above each bandwidth, e.g. NVLink pairs, NVSwitch nodes), the hosts, and the GPUs under each
switch rounded to whole hosts (a PCIe switch, a CPU socket, a leaf switch). Each level gets the
bandwidth a GPU has towards the other sub-blocks of its block, the smallest of:

- path: the bottleneck of the widest path between ring neighbours (the maximum spanning tree
  holds a widest path between every pair; Hu 1961);
- nic: the GPU's own links out of its sub-block (a slower NIC paces every ring through it);
- shared: the capacity leaving a sub-block towards the rest of its block divided by the GPUs in
  the sub-block, because all groups of an axis communicate at once (every dp group reduces at the
  same moment), so a NIC serving two GPUs or an oversubscribed leaf uplink is shared.

This is exact for tree-shaped fabrics (fat trees, rails, PCIe trees), the shapes of every preset.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import networkx as nx

from berth.specs.hardware import LinkKind, LinkProfile
from berth.specs.tree import FabricLevel

# Achieved ring bus bandwidth / wire bandwidth per link kind when a link does not give its own
# `efficiency` (presets do).
GRAPH_LINK_EFFICIENCY = {
    "nvlink": 0.78,  # DGX A100 nccl-tests all-reduce busbw 234.9 of 300 GB/s (hardware_facts.json)
    "nvswitch": 0.78,
    "infinity_fabric": 0.698,  # 8 MI300X, RCCL all-reduce busbw 312.9 of 448 GB/s (hardware_facts.json)
    "infiniband": 0.96,  # one HDR NIC: 24 of 25 GB/s (hardware_facts.json)
    "ethernet": 0.8,  # assumption: RoCE/TCP reach less of the wire than InfiniBand
    "pcie": 0.8,  # assumption: PCIe Gen4/5 peer transfers reach about 80% of the wire
    "loopback": 1.0,
}


def natural_key(text: str) -> tuple:
    return tuple(int(t) if t.isdigit() else t for t in re.split(r"(\d+)", text))


def gpu_order(g: nx.Graph) -> list[str]:
    """GPU ids in rank order: by host, then by id (natural order)."""
    gpus = [n for n, d in g.nodes(data=True) if d.get("kind") == "gpu"]
    return sorted(gpus, key=lambda n: (natural_key(g.nodes[n]["host"]), natural_key(n)))


@dataclass(frozen=True)
class _Hop:
    bandwidth_GBps: float
    latency_us: float
    kind: LinkKind
    efficiency: float


def _efficiency(d: dict) -> float:
    return float(d.get("efficiency") or GRAPH_LINK_EFFICIENCY[d["kind"]])


class _Tree:
    """The maximum spanning tree, rooted, for bottleneck queries along its paths."""

    def __init__(self, g: nx.Graph, root: str):
        tree = nx.maximum_spanning_tree(g, weight="bandwidth_GBps")
        self.parent: dict[str, str] = {}  # every node but the root (which `path` never steps up from)
        self.depth = {root: 0}
        self.up: dict[str, dict] = {}
        for u, v in nx.bfs_edges(tree, root):
            self.parent[v], self.depth[v], self.up[v] = u, self.depth[u] + 1, tree.edges[u, v]

    def path(self, a: str, b: str) -> _Hop:
        """Bottleneck hop and total latency between a and b."""
        worst: dict | None = None
        latency = 0.0

        def step(x: str) -> str:
            nonlocal worst, latency
            d = self.up[x]
            latency += d["latency_us"]
            if worst is None or d["bandwidth_GBps"] < worst["bandwidth_GBps"]:
                worst = d
            return self.parent[x]

        while self.depth[a] > self.depth[b]:
            a = step(a)
        while self.depth[b] > self.depth[a]:
            b = step(b)
        while a != b:
            a, b = step(a), step(b)
        if worst is None:
            return _Hop(float("inf"), 0.0, "loopback", 1.0)
        return _Hop(worst["bandwidth_GBps"], latency, worst["kind"], _efficiency(worst))


def _spans(g: nx.Graph, index: dict[str, int]) -> dict[str, tuple[int, int]]:
    """(lowest, highest) GPU index under every node: a GPU is its own; a switch or NIC covers the
    GPUs of its neighbours one hop closer to the GPUs (multi-source BFS layers)."""
    dist = dict.fromkeys(index, 0)
    span = {n: (i, i) for n, i in index.items()}
    frontier = list(index)
    while frontier:
        nxt = []
        for u in frontier:
            for v in g[u]:
                if v not in dist:
                    dist[v] = dist[u] + 1
                    nxt.append(v)
        for v in nxt:
            below = [span[w] for w in g[v] if dist.get(w) == dist[v] - 1]
            span[v] = (min(lo for lo, _ in below), max(hi for _, hi in below))
        frontier = nxt
    return span


def _block_sizes(g: nx.Graph, order: list[str], span: dict[str, tuple[int, int]], per_host: int) -> list[int]:
    """The chain of block sizes (each divides the next, the last is all GPUs)."""
    n = len(order)
    index = {x: i for i, x in enumerate(order)}
    sizes = {per_host, n}
    # fast domains: components of the spanning forest above each bandwidth (Kruskal order)
    uf = nx.utils.UnionFind()
    edges = sorted(g.edges(data=True), key=lambda e: -e[2]["bandwidth_GBps"])
    for k, (u, v, d) in enumerate(edges):
        uf.union(u, v)
        if k + 1 < len(edges) and edges[k + 1][2]["bandwidth_GBps"] == d["bandwidth_GBps"]:
            continue
        comps: dict[str, list[int]] = {}
        for x in order:
            comps.setdefault(uf[x], []).append(index[x])
        lens = {len(c) for c in comps.values()}
        if len(lens) == 1 and all(max(c) - min(c) + 1 == len(c) and min(c) % len(c) == 0 for c in comps.values()):
            sizes.add(lens.pop())
    # GPUs under each switch (not NIC: a NIC shared by two GPUs is no fast domain): inside a host
    # as they are, across hosts rounded to whole hosts
    for node, (lo, hi) in span.items():
        if g.nodes[node].get("kind") != "switch":
            continue
        if lo // per_host != hi // per_host:
            lo, hi = lo // per_host * per_host, (hi // per_host + 1) * per_host - 1
        size = hi - lo + 1
        if lo % size == 0:
            sizes.add(size)
    chain = [1]
    for s in sorted(sizes):
        if s > 1 and n % s == 0 and s % chain[-1] == 0:
            chain.append(s)
    return chain[1:] or [n]


def _level_name(size: int, per_host: int, n: int) -> str:
    if size == n:
        return "cluster"
    if size == per_host:
        return "host"
    if size < per_host:
        return f"{size} GPUs in a host"
    return f"{size // per_host} hosts"


def derive_levels(g: nx.Graph, order: list[str]) -> tuple[FabricLevel, ...]:
    """The hierarchy of fast domains of a checked graph (all hosts hold the same GPU count)."""
    n = len(order)
    if n == 1:
        return (
            FabricLevel(
                name="cluster",
                gpus=1,
                link=LinkProfile(
                    kind="loopback", bandwidth_bytes_per_s=1e12, collective_efficiency=1.0, hop_latency_s=0.0
                ),
            ),
        )
    per_host = sum(1 for x in order if g.nodes[x]["host"] == g.nodes[order[0]]["host"])
    index = {x: i for i, x in enumerate(order)}
    span = _spans(g, index)
    g = g.subgraph(span)  # drop anything not connected to the GPUs
    tree = _Tree(g, order[0])
    levels = []
    prev = 1
    for size in _block_sizes(g, order, span, per_host):
        levels.append(_level(g, order, span, tree, prev, size, _level_name(size, per_host, n)))
        prev = size
    return tuple(levels)


def _level(g: nx.Graph, order: list[str], span, tree: _Tree, prev: int, size: int, name: str) -> FabricLevel:
    """Per-GPU bandwidth from a sub-block of `prev` GPUs to the rest of its block of `size`."""

    def block(node: str, d: int) -> int | None:
        lo, hi = span[node]
        return lo // d if lo // d == hi // d else None

    # path: widest path from the first GPU of each sub-block to the first of the next (ring order)
    path = min(
        (tree.path(order[j], order[(j // size) * size + (j + prev) % size]) for j in range(0, len(order), prev)),
        key=lambda h: h.bandwidth_GBps,
    )
    latency_us = path.latency_us
    best = (path.bandwidth_GBps, path.kind, path.efficiency, "path")
    # shared and nic: capacity out of each sub-block (and out of each GPU) towards its own block
    cut: dict[int, float] = {}
    cut_kind: dict[int, dict] = {}
    own: dict[str, float] = {}
    own_kind: dict[str, dict] = {}
    for u, v, d in g.edges(data=True):
        pu, pv = block(u, size), block(v, size)
        su, sv = block(u, prev), block(v, prev)
        if pu is None or pu != pv or su == sv:
            continue
        for x, sx in ((u, su), (v, sv)):
            if sx is None:
                continue
            cut[sx] = cut.get(sx, 0.0) + d["bandwidth_GBps"]
            if sx not in cut_kind or d["bandwidth_GBps"] < cut_kind[sx]["bandwidth_GBps"]:
                cut_kind[sx] = d
            if x in span and g.nodes[x].get("kind") == "gpu":
                own[x] = own.get(x, 0.0) + d["bandwidth_GBps"]
                if x not in own_kind or d["bandwidth_GBps"] < own_kind[x]["bandwidth_GBps"]:
                    own_kind[x] = d
    if cut:
        j = min(cut, key=cut.__getitem__)
        per_gpu = cut[j] / prev
        if per_gpu < best[0]:
            d = cut_kind[j]
            best = (per_gpu, d["kind"], _efficiency(d), "shared" if prev > 1 else "nic")
    if own:
        x = min(own, key=own.__getitem__)
        if own[x] < best[0]:
            d = own_kind[x]
            best = (own[x], d["kind"], _efficiency(d), "nic")
    bandwidth, kind, efficiency, limited_by = best
    link = LinkProfile(
        kind=kind,
        bandwidth_bytes_per_s=bandwidth * 1e9,
        collective_efficiency=efficiency,
        hop_latency_s=latency_us * 1e-6,
    )
    return FabricLevel(name=name, gpus=size, link=link, limited_by=limited_by)
