"""The cluster as berth sees it: a graph of GPUs and links (graphs.py), its fabric levels and GPU order
(hierarchy.py), and a ClusterSpec built from a preset, a node-link graph or this machine (clusters.py)."""
