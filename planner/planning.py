"""The functions the CLI and the API share: resolve inputs into specs, plan, compare, and the
JSON contract they both print."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

from planner.errors import BerthError, from_validation_error
from planner.layouts import complete_layout, parse_spec
from planner.search import SearchResult, predict_layouts, search
from planner.specs import ClusterSpec, ModelSpec, Plan, SearchSpec, TrainingSpec
from planner.topology import LOCAL, cluster_from_preset, local_cluster


def make_cluster(cluster: str, nodes: int = 1, devices_per_node: int | None = None) -> ClusterSpec:
    """A preset for `nodes` servers, or `local`: this machine (its GPUs, or CPU worker processes)."""
    if cluster == LOCAL:
        if nodes != 1:
            raise BerthError("cluster.nodes", nodes, "a local cluster is this one machine: nodes must be 1")
        return local_cluster(devices_per_node)
    if devices_per_node is not None:
        raise BerthError("cluster.devices_per_node", devices_per_node, "applies to --cluster local only")
    return cluster_from_preset(cluster, nodes)


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


def plan(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, spec: SearchSpec) -> SearchResult:
    return search(model, training, cluster, spec)


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
