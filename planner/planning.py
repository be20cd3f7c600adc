"""The functions the CLI and the API share: resolve inputs into specs, plan, compare, and the
JSON contract they both print."""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from berth.cost_models.validity import divisors as search_divisors
from berth.hardware_profiles import UnknownProfileError, load_profile_file, load_server, server_names
from berth.hardware_profiles.schema import DeviceProfile, ServerProfile
from berth.planner.errors import BerthError, from_validation_error
from berth.planner.graphs import cluster_graph, to_node_link
from berth.planner.layouts import check_layout, parse_spec
from berth.planner.search import SearchResult, predict_layouts, search
from berth.planner.specs import (
    DEFAULT_MEMORY_HEADROOM,
    MAX_MEMORY_HEADROOM,
    MAX_NODES,
    ClusterSpec,
    Fallback,
    ModelSpec,
    Plan,
    SearchSpec,
    TrainingSpec,
)
from berth.planner.topology import LOCAL, cluster_from_node_link, cluster_from_preset, local_cluster


def load_profile(path: str | None) -> tuple[DeviceProfile, ServerProfile] | None:
    """(device, server) of a `berth profile` file, or None."""
    if not path:
        return None
    try:
        return load_profile_file(path)
    except OSError as err:
        raise BerthError("profile", path, f"cannot read: {err.strerror}") from None
    except ValidationError as err:
        raise from_validation_error(err, "profile") from None
    except ValueError as err:
        raise BerthError("profile", path, str(err)) from None


def load_graph_file(path: str) -> ClusterSpec:
    """A cluster from a node-link graph file (docs/topology.md)."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise BerthError("cluster", path, f"cannot read: {err.strerror}") from None
    except ValueError as err:
        raise BerthError("cluster", path, f"not JSON: {err}") from None
    return cluster_from_node_link(data, Path(path).stem, field=f"cluster ({Path(path).name})")


def preset_graph(
    servers: list[str], fabric: str = "rails", nodes_per_leaf: int | None = None, oversubscription: float = 1.0
) -> tuple[dict[str, Any], ClusterSpec]:
    """The node-link graph of PRESET[:NODES] servers on one fabric (mixed presets make a
    heterogeneous cluster), and the cluster derived from it."""
    parts = []
    for item in servers:
        name, _, count = item.partition(":")
        try:
            server = load_server(name)
        except UnknownProfileError as err:
            raise BerthError("cluster.preset", name, f"unknown preset; known: {', '.join(err.known)}") from None
        if count and not (count.isdigit() and 1 <= int(count) <= MAX_NODES):
            raise BerthError("cluster.nodes", item, f"write PRESET:NODES with NODES in 1..{MAX_NODES}")
        parts.append((server, int(count or 1)))
    if len({s.gpus_per_node for s, _ in parts}) > 1:
        raise BerthError("cluster.preset", servers, "servers with different GPU counts cannot be mixed yet")
    g = cluster_graph(parts, fabric, nodes_per_leaf, oversubscription)
    data = to_node_link(g)
    return data, cluster_from_node_link(data, "+".join(servers))


def make_cluster(
    cluster: str,
    nodes: int = 1,
    devices_per_node: int | None = None,
    profile: str | None = None,
    fabric: str = "rails",
    nodes_per_leaf: int | None = None,
    oversubscription: float = 1.0,
    allow_files: bool = True,
) -> ClusterSpec:
    """A preset for `nodes` servers (on a rail or fat-tree fabric), a node-link graph file
    (`*.json`), or `local`: this machine (its GPUs, or CPU worker processes). A `berth profile`
    file replaces the device (and, for `local`, the links) by measured ones. The service passes
    allow_files=False: then only the preset catalog's names are accepted and no path is opened."""
    if not allow_files:
        if profile is not None:
            raise BerthError("profile", profile, "a request cannot name a file on the server")
        if cluster != LOCAL and cluster not in server_names():
            raise BerthError(
                "cluster.preset",
                cluster,
                f"unknown preset; known: {', '.join(server_names())}, {LOCAL}; or give the cluster as an inline graph",
            )
    measured = load_profile(profile)
    if cluster == LOCAL:
        if nodes != 1:
            raise BerthError("cluster.nodes", nodes, "a local cluster is this one machine: nodes must be 1")
        return local_cluster(devices_per_node, measured)
    if devices_per_node is not None:
        raise BerthError("cluster.devices_per_node", devices_per_node, "applies to --cluster local only")
    if cluster.endswith(".json"):
        if nodes != 1 or fabric != "rails" or nodes_per_leaf or oversubscription != 1.0:
            raise BerthError(
                "cluster",
                cluster,
                "a graph file gives its own nodes and fabric: drop --nodes, "
                "--fabric, --nodes-per-leaf and --oversubscription",
            )
        spec = load_graph_file(cluster)
    else:
        spec = cluster_from_preset(cluster, nodes, fabric, nodes_per_leaf, oversubscription)
    if measured is not None:
        device = measured[0]
        if device.kind != spec.device.kind:
            raise BerthError(
                "profile", profile, f"a {device.kind} profile cannot describe {cluster}'s {spec.device.kind}s"
            )
        spec = spec.model_copy(update={"device": device.model_copy(update={"memory_bytes": spec.device.memory_bytes})})
    return spec


def with_operations(
    cluster: ClusterSpec,
    failures_per_gpu_hour: float | None = None,
    storage_write_bytes_per_s_per_gpu: float | None = None,
    price_per_gpu_hour: float | None = None,
    restart_s: float | None = None,
) -> ClusterSpec:
    """The cluster with its failure rate, storage bandwidth, restart time and price set (None keeps)."""
    values = {
        "failures_per_gpu_hour": failures_per_gpu_hour,
        "price_per_gpu_hour": price_per_gpu_hour,
        "storage_write_bytes_per_s_per_gpu": storage_write_bytes_per_s_per_gpu,
        "restart_s": restart_s,
    }
    update = {k: v for k, v in values.items() if v is not None}
    try:
        return ClusterSpec.model_validate({**cluster.model_dump(), **update}) if update else cluster
    except ValidationError as err:
        raise from_validation_error(err, "cluster") from None


def default_precision(cluster: ClusterSpec) -> str:
    """bf16 on GPUs; fp32 on CPU workers, where bf16 matmuls are slow without AVX512-BF16."""
    return "fp32" if cluster.device.kind == "cpu" else "bf16"


def make_training(**fields: Any) -> TrainingSpec:
    try:
        return TrainingSpec(**fields)
    except ValidationError as err:
        raise from_validation_error(err, "training") from None


def make_search(top: int = 5, fix: str | dict | None = None, **fields: Any) -> SearchSpec:
    fixed = parse_spec(fix, "fix") if isinstance(fix, str) else dict(fix or {})
    try:
        return SearchSpec(top=top, fix=fixed, **fields)
    except ValidationError as err:
        raise from_validation_error(err, "search") from None


class _PlanCache:
    """Least-recently-used answers of `plan`: a search is a pure function of its four specs, so a
    repeated question (a notebook re-run, a scheduler polling) is answered from memory. Size from
    $BERTH_PLAN_CACHE_SIZE (default 256; 0 turns it off)."""

    def __init__(self, size: int):
        self.size = size
        self._items: OrderedDict[str, SearchResult] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, key: str) -> SearchResult | None:
        with self._lock:
            if key in self._items:
                self._items.move_to_end(key)
                return self._items[key]
        return None

    def put(self, key: str, value: SearchResult) -> None:
        if self.size <= 0:
            return
        with self._lock:
            self._items[key] = value
            self._items.move_to_end(key)
            while len(self._items) > self.size:
                self._items.popitem(last=False)


PLAN_CACHE = _PlanCache(int(os.environ.get("BERTH_PLAN_CACHE_SIZE", "256")))


def _cache_key(model, training, cluster, spec, max_candidates) -> str:
    return "|".join(x.model_dump_json() for x in (model, training, cluster, spec)) + f"|{max_candidates}"


def cached_plan(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, spec: SearchSpec, max_candidates: int | None = None
) -> SearchResult | None:
    """The answer of `plan` if it is in the cache (microseconds), else None."""
    return PLAN_CACHE.get(_cache_key(model, training, cluster, spec, max_candidates))


def plan(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    spec: SearchSpec,
    max_candidates: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> SearchResult:
    key = _cache_key(model, training, cluster, spec, max_candidates)
    cached = PLAN_CACHE.get(key)
    if cached is not None:
        return cached
    result = search(model, training, cluster, spec, max_candidates, deadline, cancel)
    PLAN_CACHE.put(key, result)
    return result


def compare(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    layouts: Sequence[str | dict[str, Any]],
    memory_headroom: float = DEFAULT_MEMORY_HEADROOM,
) -> list[Plan]:
    if not layouts:
        raise BerthError("layout", None, "give at least one layout")
    specs = []
    for i, item in enumerate(layouts):
        field = f"layout[{i}]"
        values = parse_spec(item, field) if isinstance(item, str) else dict(item)
        specs.append(check_layout(values, model, training, cluster, field))
    if not 0 <= memory_headroom <= MAX_MEMORY_HEADROOM:
        raise BerthError("memory_headroom", memory_headroom, f"must be in 0..{MAX_MEMORY_HEADROOM}")
    return predict_layouts(model, training, cluster, specs, memory_headroom)


def lose_nodes(cluster: ClusterSpec, lost: int) -> ClusterSpec:
    """The cluster with `lost` nodes gone: every level of its fabric capped at the GPUs left."""
    nodes = cluster.nodes - lost
    if nodes < 1:
        raise BerthError("cluster.nodes", cluster.nodes, f"losing {lost} nodes leaves none")
    world = nodes * cluster.gpus_per_node
    levels, seen = [], set()
    for level in cluster.levels:
        gpus = min(level.gpus, world)
        if gpus not in seen:
            seen.add(gpus)
            levels.append(level.model_copy(update={"gpus": gpus}))
    hosts = cluster.hosts[:nodes] if cluster.hosts else ()
    return cluster.model_copy(
        update={
            "nodes": nodes,
            "fabric": tuple(levels),
            "hosts": hosts,
            "name": f"{cluster.name} minus {lost} node{'s' if lost > 1 else ''}",
        }
    )


def fallback(
    chosen: Plan, spec: SearchSpec, lost: int = 1, deadline: float | None = None, cancel: threading.Event | None = None
) -> Fallback | None:
    """The best layout for the cluster with `lost` nodes gone (None when nothing fits there)."""
    cluster = lose_nodes(chosen.cluster, lost)
    training = chosen.training
    batches = [training.global_batch_size]
    batches += sorted(
        {max(1, round(training.global_batch_size / d)) * d for d in search_divisors(cluster.world_size)},
        key=lambda b: (abs(b - training.global_batch_size), -b),
    )
    quick = spec.model_copy(update={"top": 1})
    for batch in batches[:8]:
        t = training.model_copy(update={"global_batch_size": batch})
        try:
            result = plan(chosen.model, t, cluster, quick, deadline=deadline, cancel=cancel)
        except BerthError:
            continue
        if not result.plans:
            continue
        best = result.plans[0]
        changes = [f"{cluster.world_size} GPUs instead of {chosen.cluster.world_size}"]
        if batch != training.global_batch_size:
            changes.append(
                f"global batch {batch} instead of {training.global_batch_size}: no layout of "
                f"{cluster.world_size} GPUs splits {training.global_batch_size}"
            )
        for field in ("tp", "pp", "dp", "micro_batch_size", "num_microbatches", "zero_stage", "recompute"):
            old, new = getattr(chosen.layout, field), getattr(best.layout, field)
            if old != new:
                changes.append(f"{field} {old} -> {new}")
        ratio = best.predicted().tokens_per_s / chosen.predicted().tokens_per_s - 1.0
        changes.append(f"throughput {ratio:+.1%}")
        return Fallback(
            nodes_lost=lost,
            world_size=cluster.world_size,
            global_batch_size=batch,
            layout=best.layout,
            step_time_s=best.predicted().step_time_s,
            tokens_per_s=best.predicted().tokens_per_s,
            peak_memory_bytes=best.predicted().peak_memory_bytes,
            changes=changes,
        )
    return None


def with_fallback(
    result: SearchResult, spec: SearchSpec, deadline: float | None = None, cancel: threading.Event | None = None
) -> SearchResult:
    """The result with its best plan carrying the fallback for one node lost (unchanged when there
    is no plan or a single node); a new result, so a cached one and its serialized JSON stay as they are."""
    if not result.plans or result.plans[0].cluster.nodes < 2:
        return result
    first = result.plans[0].model_copy(
        update={"fallback": fallback(result.plans[0], spec, deadline=deadline, cancel=cancel)}
    )
    return replace(result, plans=[first, *result.plans[1:]], serialized=[])


def plans_json(result: SearchResult) -> dict[str, Any]:
    return {
        "plans": [p.model_dump(mode="json") for p in result.plans],
        "searched": result.searched,
        "feasible": result.feasible,
        "rejected": result.rejected,
    }


def plans_text(result: SearchResult) -> str:
    """`plans_json` as compact JSON text, serialized once per result: the service answers a
    repeated question from the plan cache, and the plans' dump is most of its work."""
    if not result.serialized:
        result.serialized.append(json_text(plans_json(result)))
    return result.serialized[0]


def json_text(value: Any) -> str:
    """Compact, strictly valid JSON: a non-finite float (never valid JSON) becomes null."""
    try:
        return json.dumps(value, separators=(",", ":"), allow_nan=False)
    except ValueError:
        return json.dumps(_finite(value), separators=(",", ":"), allow_nan=False)


def _finite(value: Any) -> Any:
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def compare_json(candidates: list[Plan], best: SearchResult | None) -> dict[str, Any]:
    best_plan = best.plans[0] if best and best.plans else None
    out: dict[str, Any] = {"candidates": [p.model_dump(mode="json") for p in candidates]}
    out["best_searched"] = best_plan.model_dump(mode="json") if best_plan else None
    if best_plan and best_plan.prediction:
        ref = best_plan.prediction.tokens_per_s
        out["gap_to_best"] = [
            (p.prediction.tokens_per_s / ref - 1.0) if p.prediction and not p.infeasible_reason else None
            for p in candidates
        ]
    return out
