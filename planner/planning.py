"""The functions the CLI and the API share: plan, compare, and the JSON contract they both print.
Turning user input into specs is `berth.planner.inputs`."""

from __future__ import annotations

import json
import math
import os
import threading
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import replace
from typing import Any

from berth.cost_models.compute import alignment_slowdown
from berth.cost_models.memory import allocator_capacity_bytes, vocab_rows

# The input conversion lives in berth.planner.inputs; these names stay importable from here for
# the callers that planned with them (tests, notebooks).
from berth.planner.inputs import (  # noqa: F401
    default_precision,
    load_graph_file,
    load_profile,
    make_cluster,
    make_search,
    make_training,
    preset_graph,
    with_operations,
)
from berth.planner.search import SearchResult, predict_layouts, search
from berth.specs.engines import MEGATRON_VOCAB_DIVISOR, engine_of
from berth.specs.errors import BerthError
from berth.specs.layouts import complete_layout, parse_spec
from berth.specs.tree import (
    MAX_MEMORY_HEADROOM,
    ClusterSpec,
    EngineTuning,
    Fallback,
    Layout,
    ModelSpec,
    Plan,
    SearchSpec,
    TrainingSpec,
)
from berth.specs.validity import divisors as search_divisors

# plans x GPUs the cache keeps in all (a plan lists every rank's placement, ~200 bytes of JSON each,
# so about 200 MB of answers): bounded in size at every insert, not only in count
PLAN_CACHE_MAX_RANKS = 1 << 20


class _PlanCache:
    """Least-recently-used answers of `plan`: a search is a pure function of its four specs, so a
    repeated question (a notebook re-run, a scheduler polling) is answered from memory. Size from
    $BERTH_PLAN_CACHE_SIZE (default 256; 0 turns it off), and at most `max_ranks` plans x GPUs."""

    def __init__(self, size: int, max_ranks: int = PLAN_CACHE_MAX_RANKS):
        self.size, self.max_ranks = size, max_ranks
        self._items: OrderedDict[str, SearchResult] = OrderedDict()
        self._ranks: dict[str, int] = {}
        self._total = 0
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
        ranks = 1 + sum(p.cluster.world_size for p in value.plans)  # bytes scale with the ranks listed
        if ranks > self.max_ranks:
            return
        with self._lock:
            self._total += ranks - self._ranks.get(key, 0)
            self._items[key], self._ranks[key] = value, ranks
            self._items.move_to_end(key)
            while len(self._items) > self.size or self._total > self.max_ranks:
                old, _ = self._items.popitem(last=False)
                self._total -= self._ranks.pop(old)


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
    note = vocabulary_note(model, training, cluster, result.plans[0]) if result.plans else None
    if note:
        result = replace(result, notes=(note,))
    PLAN_CACHE.put(key, result)
    return result


def parse_layouts(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, layouts: Sequence[str | dict[str, Any]]
) -> list[Layout]:
    """Layouts given as text ("tp=8,pp=4,dp=2,...") or objects, completed for the inputs (dp from the GPUs, the
    micro-batch count from the global batch); a value that is no layout value (an unknown field, not a positive
    integer, not a choice) is an error naming the layout's index (`layout[i]`). A layout that breaks a rule, the
    engine's included, is kept: its plan says which (`infeasible_reason`), as a layout that does not fit does, so one
    such layout among many (a sweep's, a team's list) leaves the others' comparison standing."""
    if not layouts:
        raise BerthError("layout", None, "give at least one layout")
    specs = []
    for i, item in enumerate(layouts):
        field = f"layout[{i}]"
        values = parse_spec(item, field) if isinstance(item, str) else dict(item)
        specs.append(complete_layout(values, training, cluster.world_size, field))
    return specs


def compare(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    layouts: Sequence[str | dict[str, Any]],
    memory_headroom: float | None = None,
) -> list[Plan]:
    specs = parse_layouts(model, training, cluster, layouts)
    if memory_headroom is not None and not 0 <= memory_headroom <= MAX_MEMORY_HEADROOM:
        raise BerthError("memory_headroom", memory_headroom, f"must be in 0..{MAX_MEMORY_HEADROOM}")
    return predict_layouts(model, training, cluster, specs, memory_headroom)


def compare_with_best(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    layouts: Sequence[str | dict[str, Any]],
    memory_headroom: float | None = None,
    max_candidates: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> tuple[list[Plan], SearchResult | None]:
    """`berth compare` and POST /v1/compare: the given layouts predicted side by side (`compare`) and the
    best layout the search finds for the same inputs, the reference of their gap (None where the search
    finds none: the comparison stands without it)."""
    candidates = compare(model, training, cluster, layouts, memory_headroom)
    try:
        best = plan(
            model,
            training,
            cluster,
            make_search(top=1, memory_headroom=memory_headroom),
            max_candidates,
            deadline,
            cancel,
        )
    except BerthError:
        best = None
    return candidates, best


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


def why_none(result: SearchResult, cluster: ClusterSpec) -> str:
    """Why no layout fits, in one line (`berth plan` prints it, the service answers it as `why_none`): the
    smallest predicted peak against what the allocator can use when some layout breaks no rule but memory, else
    every rule broken with its count."""
    rejected = ", ".join(f"{k} {v:,}" for k, v in result.rejected.items()) or "none"
    unit = "CPU worker" if cluster.device.kind == "cpu" else "GPU"
    if result.closest is not None:
        layout, peak = result.closest
        have = allocator_capacity_bytes(cluster.device, cluster.world_size) / 2**30
        return (
            f"the smallest predicted peak is {peak / 2**30:,.1f} GiB per {unit} ({layout}), where the allocator can "
            f"use {have:,.1f} GiB and a plan keeps {result.memory_headroom:.0%} of it spare; "
            f"more GPUs, a shorter sequence or a smaller global batch (rejected: {rejected})"
        )
    return f"every layout of {result.searched:,} searched breaks a rule: {rejected}"


def vocabulary_note(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, best: Plan) -> str | None:
    """Where the plan's LM head runs GEMMs whose rows break 16-byte alignment (its vocabulary rows per tensor-parallel
    rank; cost_models/compute.py alignment_slowdown, measured on the device's profile), what padding the vocabulary to
    a multiple of 128 x tp, as Megatron-LM does by default (--make-vocab-size-divisible-by), would take off the step:
    the same layout predicted again for the padded model, whose extra rows no token uses. None where it is aligned."""
    shape, tp = cluster.device.gemm_shape, best.layout.tp
    if shape is None or best.prediction is None:
        return None
    rows = int(vocab_rows(model, tp))
    slow = float(alignment_slowdown(shape, training.bytes_per_element, float(rows)))
    if slow <= 1.0:
        return None
    padded = math.ceil(model.vocab_size / (MEGATRON_VOCAB_DIVISOR * tp)) * MEGATRON_VOCAB_DIVISOR * tp
    again = predict_layouts(model.model_copy(update={"vocab_size": padded}), training, cluster, [best.layout])[0]
    if again.prediction is None:
        return None
    now, then = best.prediction.step_time_s, again.prediction.step_time_s
    return (
        f"the LM head's {rows:,} vocabulary rows per tensor-parallel rank break 16-byte alignment: its GEMMs run "
        f"{slow:.1f}x slower (the {cluster.device.name} profile's gemm_shape); a model whose vocab_size is padded to "
        f"{padded:,} (a multiple of {MEGATRON_VOCAB_DIVISOR} x tp, as Megatron-LM pads by default; berth's launch "
        f"files keep the model's own) would take #1's step from {now:#.3g} s to {then:#.3g} s ({now / then - 1:+.0%} "
        "tokens/s)"
    )


def plans_json(result: SearchResult, cluster: ClusterSpec | None = None) -> dict[str, Any]:
    """The plan JSON contract (CLI --json, POST /v1/plans); `why_none` says why when no plan fits."""
    return {
        "plans": [p.model_dump(mode="json") for p in result.plans],
        "searched": result.searched,
        "feasible": result.feasible,
        "rejected": result.rejected,
        "memory_headroom": result.memory_headroom,
        "why_none": why_none(result, cluster) if not result.plans and cluster is not None else None,
        "notes": list(result.notes),
    }


def plans_text(result: SearchResult, cluster: ClusterSpec | None = None) -> str:
    """`plans_json` as compact JSON text, serialized once per result: the service answers a
    repeated question from the plan cache, and the plans' dump is most of its work."""
    if not result.serialized:
        result.serialized.append(json_text(plans_json(result, cluster)))
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


def gap_to_best(p: Plan, best_tokens_per_s: float | None) -> float | None:
    """A compared layout's tokens/s over the best searched plan's, minus 1; None for a layout that does
    not fit or is not ranked (its infeasible_reason says why): a throughput it cannot run at is no gap."""
    if not best_tokens_per_s or p.prediction is None or p.infeasible_reason:
        return None
    return p.prediction.tokens_per_s / best_tokens_per_s - 1.0


def first_choice(candidates: list[Plan]) -> int | None:
    """The index of the candidate berth would pick among these, as the search ranks: the fastest of those
    predicted to fit with the memory headroom (a 'memory_tight' plan, bottleneck 'memory', is not ranked);
    None where none does."""
    ranked = [
        (p.prediction.tokens_per_s, i)
        for i, p in enumerate(candidates)
        if p.prediction is not None and p.prediction.fits and p.prediction.bottleneck != "memory"
    ]
    return max(ranked)[1] if ranked else None


def compare_json(candidates: list[Plan], best: SearchResult | None, memory_headroom: float | None) -> dict[str, Any]:
    """The compare JSON contract (CLI --json, POST /v1/compare), with the memory headroom the choice used: the one
    asked for (`memory_headroom`), else the candidates' engine's."""
    best_plan = best.plans[0] if best and best.plans else None
    out: dict[str, Any] = {"candidates": [p.model_dump(mode="json") for p in candidates]}
    out["choice"] = first_choice(candidates)
    out["memory_headroom"] = engine_of(candidates[0].training).headroom(memory_headroom) if candidates else None
    out["best_searched"] = best_plan.model_dump(mode="json") if best_plan else None
    if best_plan and best_plan.prediction:
        out["gap_to_best"] = [gap_to_best(p, best_plan.prediction.tokens_per_s) for p in candidates]
    return out


def plan_for_format(plan: Plan, fmt: str | None) -> tuple[Plan, str, str | None]:
    """(the plan to launch, the format, a note): the plan's engine's own format when `fmt` is None; a format of
    another engine re-predicts the layout for that engine (the note says so and gives both predictions), and is
    refused, naming both engines and the reason, when that engine cannot run the layout."""
    from berth.specs.engines import ENGINES, check_fp8, engine_of_format, fp8_refusal

    engine = ENGINES[plan.training.engine]
    check_fp8(plan.training, plan.cluster.device, "plan.training.fp8")  # a plan file may name any recipe
    if fmt is None:
        if not engine.launch_formats:
            raise BerthError(
                "format",
                None,
                f"engine {engine.label} has no launch files in berth; give --format (torchrun, megatron, deepspeed, "
                "torchtitan, ...) to re-predict the plan for that format's engine",
            )
        return plan, engine.launch_formats[0], None
    target = engine_of_format(fmt)
    if target is None or target.name == engine.name:
        return plan, fmt, None
    training = plan.training.model_copy(update={"engine": target.name, "tuning": EngineTuning()})
    refusal = fp8_refusal(training, plan.cluster.device)
    if refusal is not None:  # the FP8 recipe is the plan's, the target engine may not run it
        raise BerthError(
            "format", fmt, f"the plan was made for engine {engine.name}; format {fmt} starts {target.name}: {refusal}"
        )
    again = predict_layouts(plan.model, training, plan.cluster, [plan.layout])[0]
    if again.prediction is None or again.infeasible_reason:
        raise BerthError(
            "format",
            fmt,
            f"the plan was made for engine {engine.label}; format {fmt} starts {target.label}, which cannot run "
            f"{plan.layout.short()}: {again.infeasible_reason}",
        )
    before, after = plan.predicted(), again.predicted()
    note = (
        f"the plan was made for engine {engine.name}; format {fmt} starts {target.name}: re-predicted for it, "
        f"{after.tokens_per_s:,.0f} tokens/s and {after.peak_memory_bytes / 2**30:.1f} GiB per GPU "
        f"(was {before.tokens_per_s:,.0f} tokens/s, {before.peak_memory_bytes / 2**30:.1f} GiB)"
        + (
            f"; its profile {plan.training.tuning.profile}, fitted for {engine.name}, is left out"
            if plan.training.tuning.profile or not plan.training.tuning.neutral
            else ""
        )
    )
    return again, fmt, note
