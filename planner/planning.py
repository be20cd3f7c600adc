"""The functions the CLI and the API share: resolve inputs into specs, plan, compare, and the
JSON contract they both print."""

from __future__ import annotations

import os
import threading
from collections import OrderedDict
from typing import Any

from pydantic import ValidationError

from hardware_profiles import load_profile_file
from planner.errors import BerthError, from_validation_error
from planner.layouts import complete_layout, parse_spec
from planner.search import SearchResult, predict_layouts, search
from planner.specs import ClusterSpec, ModelSpec, Plan, SearchSpec, TrainingSpec
from planner.topology import LOCAL, cluster_from_preset, local_cluster


def load_profile(path: str | None):
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


def make_cluster(cluster: str, nodes: int = 1, devices_per_node: int | None = None,
                 profile: str | None = None) -> ClusterSpec:
    """A preset for `nodes` servers, or `local`: this machine (its GPUs, or CPU worker processes).
    A `berth profile` file replaces the device (and, for `local`, the links) by measured ones."""
    measured = load_profile(profile)
    if cluster == LOCAL:
        if nodes != 1:
            raise BerthError("cluster.nodes", nodes, "a local cluster is this one machine: nodes must be 1")
        return local_cluster(devices_per_node, measured)
    if devices_per_node is not None:
        raise BerthError("cluster.devices_per_node", devices_per_node, "applies to --cluster local only")
    spec = cluster_from_preset(cluster, nodes)
    if measured is not None:
        device = measured[0]
        if device.kind != spec.device.kind:
            raise BerthError("profile", profile, f"a {device.kind} profile cannot describe {cluster}'s "
                             f"{spec.device.kind}s")
        spec = spec.model_copy(update={"device": device.model_copy(update={"memory_bytes": spec.device.memory_bytes})})
    return spec


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


def cached_plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, spec: SearchSpec,
                max_candidates: int | None = None) -> SearchResult | None:
    """The answer of `plan` if it is in the cache (microseconds), else None."""
    return PLAN_CACHE.get(_cache_key(model, training, cluster, spec, max_candidates))


def plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, spec: SearchSpec,
         max_candidates: int | None = None, deadline: float | None = None) -> SearchResult:
    key = _cache_key(model, training, cluster, spec, max_candidates)
    cached = PLAN_CACHE.get(key)
    if cached is not None:
        return cached
    result = search(model, training, cluster, spec, max_candidates, deadline)
    PLAN_CACHE.put(key, result)
    return result


def compare(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec,
            layouts: list[str | dict[str, Any]]) -> list[Plan]:
    if not layouts:
        raise BerthError("layout", None, "give at least one layout")
    specs = []
    for i, item in enumerate(layouts):
        field = f"layout[{i}]"
        values = parse_spec(item, field) if isinstance(item, str) else dict(item)
        specs.append(complete_layout(values, training, cluster.world_size, field))
    return predict_layouts(model, training, cluster, specs)


def plans_json(result: SearchResult) -> dict[str, Any]:
    return {
        "plans": [p.model_dump(mode="json") for p in result.plans],
        "searched": result.searched,
        "feasible": result.feasible,
        "rejected": result.rejected,
    }


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
