"""Exhaustive layout search: enumerate every layout that divides correctly as numpy arrays, score
them all with the vectorized cost model, mask the infeasible with a reason, keep the top k."""

from __future__ import annotations

import math
import threading
import time
from collections import Counter
from collections.abc import Iterator
from dataclasses import dataclass, field
from itertools import product

import numpy as np

from berth.cost_models.memory import allocator_capacity_bytes
from berth.cost_models.step import BOTTLENECK_NAMES, Evaluation, evaluate
from berth.planner.placement import innermost_cluster, placement
from berth.specs import __version__, engines, stages
from berth.specs.candidates import (
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
    Candidates,
)
from berth.specs.errors import BerthError
from berth.specs.layouts import check_values, layout_problems, refuse_fix
from berth.specs.tree import (
    AXIS_ORDER_CHOICES,
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    ClusterSpec,
    GoodputPrediction,
    Layout,
    ModelSpec,
    Plan,
    Prediction,
    SearchSpec,
    TrainingSpec,
)
from berth.specs.validity import (
    MEMORY_TIGHT,
    OUT_OF_MEMORY,
    REASONS,
    VALID,
    Facts,
    divisors,
    prune,
    structural_reasons,
)

# Memory of one search is bounded: candidates are generated and scored in chunks, and only each
# chunk's best rows are kept. evaluate() peaks at about 700 bytes per candidate (tracemalloc, gpt-1t
# on 384 DGX A100 nodes, a 262,144-row chunk) plus 96 bytes of candidate columns (12 int64).
BYTES_PER_CANDIDATE = 800
SEARCH_CHUNK_BYTES = 128 << 20  # the cap on one chunk's working memory
CHUNK = SEARCH_CHUNK_BYTES // BYTES_PER_CANDIDATE  # candidates scored per vectorized batch


@dataclass(frozen=True)
class SearchResult:
    plans: list[Plan]
    searched: int
    feasible: int
    rejected: dict[str, int]
    serialized: list[str] = field(default_factory=list, compare=False, repr=False)  # memo of its JSON text
    closest: tuple[str, float] | None = field(default=None, compare=False)  # misfit with the smallest peak
    memory_headroom: float | None = None  # the headroom the search ranked with (EngineInfo.headroom)
    notes: tuple[str, ...] = ()  # advice on the first plan (planning.plan: the LM head's vocabulary alignment)


def axis_orders(tp: int, pp: int, dp: int) -> list[int]:
    """Codes of the axis orders searched: tp innermost (tensor-parallel traffic is the heaviest and
    every engine berth launches on keeps it there), then dp or pp in either order, counting only
    orders that place ranks differently (axes of size 1 do not count). Other orders can still be
    predicted and compared (`--layout ...,axis_order=dp-tp-pp`)."""
    sizes = {"tp": tp, "pp": pp, "dp": dp}
    seen: dict[tuple[str, ...], int] = {}
    for code, name in enumerate(AXIS_ORDER_CHOICES):
        if name.startswith("tp-"):
            seen.setdefault(tuple(a for a in name.split("-") if sizes[a] > 1), code)
    return sorted(seen.values())


# Context parallelism searched: cp a power of 2 dividing the GPUs left by tp, with at least this many
# tokens of each sequence per rank (cp <= seq_len / 4096), seq_len divisible by 2 cp (the load-balanced
# split) and flash attention. Context parallelism is for sequences whose activations do not fit
# otherwise (Llama 3 used it only for its 131k stage, 8,192 tokens per rank); shorter chunks only add
# KV traffic, and the rule keeps the search small (seq 8192: cp <= 2; 4096 and below: never). `--fix
# cp=N` / `--layout cp=N` reach any cp the validity rules accept (specs/validity.py).
CP_SEARCH_MIN_TOKENS_PER_RANK = 4096


def cp_options(training: TrainingSpec, world: int) -> list[int]:
    """The cp values the search tries for `world` GPUs (those left by tp)."""
    s = training.seq_len
    out = [1]
    cp = 2
    while (
        training.flash_attention and world % cp == 0 and s % (2 * cp) == 0 and cp * CP_SEARCH_MIN_TOKENS_PER_RANK <= s
    ):
        out.append(cp)
        cp *= 2
    return out


def _structural_rows(model: ModelSpec, training: TrainingSpec, world: int, max_mbs: int | None) -> np.ndarray:
    """(tp, pp, dp, mbs, nmb, schedule, vpp, axis order, cp) rows that divide correctly: the
    rule table's rules that read only tp, cp, pp and virtual_stages (specs/validity.py
    `prune`: the heads, the cp chunks, the stage split) judge (tp, cp, pp) and the virtual stages
    before any row is built; the search's own choices (cp_options, axis_orders, the vpp that divide a
    middle rank's layers) narrow what is tried; the mask checks every rule on the full rows."""
    L, B = model.num_layers, training.global_batch_size
    facts = Facts(model, training, world)
    triples = np.asarray(
        [
            (t, c, p)
            for t in divisors(world)
            for c in cp_options(training, world // t)
            for p in divisors(world // (t * c))
        ],
        dtype=np.int64,
    ).reshape(-1, 3)
    keep = prune(
        facts, tp=triples[:, 0], cp=triples[:, 1], pp=triples[:, 2], virtual_stages=np.ones(len(triples), np.int64)
    )
    # virtual stages: the divisors v > 1 of a middle rank's layers, ceil(L / pp) (L / pp when pp divides L)
    pairs = np.asarray(
        [(p, v) for p in sorted(set(triples[keep, 2].tolist())) if p > 1 for v in divisors(-(-L // p)) if v > 1],
        dtype=np.int64,
    ).reshape(-1, 2)
    vpps: dict[int, list[int]] = {}
    if len(pairs):
        for p, v in pairs[prune(facts, pp=pairs[:, 0], virtual_stages=pairs[:, 1])].tolist():
            vpps.setdefault(p, []).append(v)
    rows = []
    for tp, cp, pp in triples[keep].tolist():
        dp = world // (tp * cp * pp)
        if B % dp:  # batch_not_divisible for every micro-batch size
            continue
        if pp == 1:
            schedules = [(SCHEDULE_1F1B, 1)]
        else:
            schedules = [(SCHEDULE_GPIPE, 1), (SCHEDULE_1F1B, 1)]
            schedules += [(SCHEDULE_INTERLEAVED, v) for v in vpps.get(pp, [])]
        orders = axis_orders(tp, pp, dp)
        for mbs in divisors(B // dp):
            if max_mbs and mbs > max_mbs:
                continue
            rows += [(tp, pp, dp, mbs, B // (dp * mbs), s, v, o, cp) for s, v in schedules for o in orders]
    return np.asarray(rows, dtype=np.int64).reshape(-1, 9)


def _inner_options(dp: int, tp: int, experts: int = 0, cp: bool = False, fixed_etp: int | None = None) -> np.ndarray:
    """(zero, shard, recompute, sp, ep, expert_tp) options for a given dp and tp; ep (MoE models only,
    `experts` > 0) ranges over the common divisors of dp and the number of experts. ZeRO shards over
    shard x cp ranks (cost_models/memory.py), so with context parallelism (`cp`) shard = 1 under ZeRO
    still shards, over the cp ranks (torchtitan's FSDP over dp_shard x cp with dp_shard 1, Megatron's
    distributed optimizer over dp x cp).
    expert_tp: MoE models (whose groups know their tp) try the experts split as the dense layers (tp)
    and, with tp > 1, whole experts per rank (1, MoE parallel folding: sequence parallelism on, ep over
    the common divisors of tp x dp and the experts); dense models hold 0, "= tp" (`_block` resolves it;
    1 where tp is 1). An expert_tp between 1 and tp is searched only where search.fix names it
    (`fixed_etp`): ep then over the common divisors of tp x dp / expert_tp and the experts."""
    shards = [d for d in divisors(dp) if d > 1] + ([1] if cp else [])
    zero_shard = [(0, 1)] + [(z, s) for z in (1, 2, 3) for s in shards]
    sps = (0, 1) if tp > 1 else (0,)
    eps = divisors(math.gcd(dp, experts)) if experts else [1]
    same = tp if experts or tp == 1 else 0
    recomputes = range(len(RECOMPUTE_CHOICES))
    opts = [(z, s, r, sp, ep, same) for (z, s), r, sp, ep in product(zero_shard, recomputes, sps, eps)]
    if experts and tp > 1:
        below = [1] + ([fixed_etp] if fixed_etp and 1 < fixed_etp < tp and tp % fixed_etp == 0 else [])
        for etp in below:
            folded = divisors(math.gcd(tp * dp // etp, experts))
            opts += [(z, s, r, 1, ep, etp) for (z, s), r, ep in product(zero_shard, recomputes, folded)]
    return np.asarray(opts, dtype=np.int64)


# _structural_rows' and _inner_options' columns (Candidates fields)
_STRUCT_COLUMNS = (
    "tp",
    "pp",
    "dp",
    "micro_batch_size",
    "num_microbatches",
    "schedule",
    "virtual_stages",
    "axis_order",
    "cp",
)
_INNER_COLUMNS = ("zero_stage", "shard", "recompute", "sequence_parallel", "ep", "expert_tp")


def _groups(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, search: SearchSpec
) -> list[tuple[np.ndarray, np.ndarray]]:
    """(structural rows, inner options) per group, search.fix applied to each side: the candidates
    are every row of a group times every option of it, so they are counted before any is built."""
    rows = _structural_rows(model, training, cluster.world_size, search.max_micro_batch_size)
    if rows.shape[0] == 0:
        raise BerthError(
            "training.global_batch_size",
            training.global_batch_size,
            f"no layout of {cluster.world_size} GPUs splits it (dp must divide the global batch; "
            f"tp must divide {model.num_attention_heads} heads and {model.kv_heads} kv heads; "
            f"pp must leave each pipeline stage of the {model.num_layers} layers at least one; cp is searched "
            f"up to seq_len / {CP_SEARCH_MIN_TOKENS_PER_RANK})",
        )
    if search.fix:
        check_values(search.fix, "fix")
    out = _group_tables(rows, _fix_codes(search.fix), model.num_experts)
    if not out and search.fix:
        _refuse_empty_fix(rows, search.fix, model, training, cluster)
    return out


def _group_tables(rows: np.ndarray, codes: dict[str, int], experts: int = 0) -> list[tuple[np.ndarray, np.ndarray]]:
    """(structural rows, inner options) of each (dp, tp > 1, cp > 1) group with the fixed codes applied;
    MoE models group by tp itself (their expert_tp and ep options depend on it)."""
    groups: dict[tuple[int, int, bool], list[int]] = {}
    cp_column = _STRUCT_COLUMNS.index("cp")
    for i, (tp, dp, cp) in enumerate(rows[:, [0, 2, cp_column]].tolist()):  # lists: iterating numpy rows is slow
        groups.setdefault((dp, tp if experts else min(tp, 2), cp > 1), []).append(i)
    out = []
    for (dp, tp, has_cp), idx in groups.items():
        struct = rows[np.asarray(idx)]
        inner = _inner_options(dp, tp, experts, has_cp, codes.get("expert_tp"))
        struct = struct[_matches(struct, _STRUCT_COLUMNS, codes)]
        inner = inner[_matches(inner, _INNER_COLUMNS, codes)]
        if len(struct) and len(inner):
            out.append((struct, inner))
    return out


_CODES = {"recompute": RECOMPUTE_CHOICES, "schedule": SCHEDULE_CHOICES, "axis_order": AXIS_ORDER_CHOICES}


def _refuse_empty_fix(
    rows: np.ndarray, fix: dict, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec
) -> None:
    """Raise the refusal of the first fixed key that leaves no candidate (keys applied in the order
    given), with the values the candidates left by the keys before it have: never an empty search."""
    keys = list(fix)
    for n, key in enumerate(keys):
        column = key  # Candidates columns are named as the Layout fields
        present: set[int] = set()
        for struct, inner in _group_tables(rows, _fix_codes({k: fix[k] for k in keys[:n]}), model.num_experts):
            table, columns = (struct, _STRUCT_COLUMNS) if column in _STRUCT_COLUMNS else (inner, _INNER_COLUMNS)
            present.update(np.unique(table[:, columns.index(column)]).tolist())
        if _fix_codes({key: fix[key]})[column] not in present:
            values = sorted(present - {0} if key == "expert_tp" else present)  # 0: a dense model's "= tp"
            valid = [_CODES[key][v] for v in values] if key in _CODES else values
            raise refuse_fix(fix, key, valid, model, training, cluster)


def _matches(table: np.ndarray, columns: tuple[str, ...], codes: dict[str, int]) -> np.ndarray:
    keep = np.ones(len(table), dtype=bool)
    for j, name in enumerate(columns):
        if name in codes:
            keep &= table[:, j] == codes[name]
    return keep


def count_candidates(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, search: SearchSpec) -> int:
    """How many layouts `search` would score, computed without enumerating them."""
    return sum(len(struct) * len(inner) for struct, inner in _groups(model, training, cluster, search))


def _block(struct: np.ndarray, inner: np.ndarray) -> Candidates:
    s = np.repeat(struct, len(inner), axis=0)
    o = np.tile(inner, (len(struct), 1))
    columns = {name: s[:, j] for j, name in enumerate(_STRUCT_COLUMNS)}
    columns |= {name: o[:, j] for j, name in enumerate(_INNER_COLUMNS)}
    etp = columns["expert_tp"]
    columns["expert_tp"] = np.where(etp == 0, columns["tp"], etp)  # 0: "= tp" (_inner_options)
    return Candidates(**columns)


def iter_candidates(groups: list[tuple[np.ndarray, np.ndarray]], chunk: int | None = None) -> Iterator[Candidates]:
    """The candidates of `groups` in order, `chunk` (default CHUNK) at a time, the last one shorter:
    at most about two chunks are ever built at once."""
    chunk = chunk or CHUNK
    pending: list[Candidates] = []
    size = 0
    for struct, inner in groups:
        step = max(1, chunk // len(inner))
        for start in range(0, len(struct), step):
            block = _block(struct[start : start + step], inner)
            pending.append(block)
            size += len(block)
            while size >= chunk:
                joined = Candidates.concat(pending) if len(pending) > 1 else pending[0]
                yield joined.take(slice(0, chunk))  # views, not copies
                rest = joined.take(slice(chunk, None))
                pending, size = ([rest], len(rest)) if len(rest) else ([], 0)
    if size:
        yield Candidates.concat(pending) if len(pending) > 1 else pending[0]


def enumerate_candidates(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, search: SearchSpec
) -> Candidates:
    """Every candidate of the search at once (tests and small searches; `search` streams them)."""
    return Candidates.concat(
        [_block(struct, inner) for struct, inner in _groups(model, training, cluster, search)]
        or [_block(np.zeros((0, len(_STRUCT_COLUMNS)), np.int64), np.zeros((1, len(_INNER_COLUMNS)), np.int64))]
    )


def _fix_codes(fix: dict) -> dict[str, int]:
    """search.fix (its values checked by `berth.specs.layouts.check_values`) as column -> code."""
    return {key: _CODES[key].index(value) if key in _CODES else int(value) for key, value in fix.items()}


def objective_value(ev: Evaluation, objective: str = "throughput") -> np.ndarray:
    """Higher is better: tokens/s, or useful tokens/s after checkpoints and failures (goodput;
    the cost per useful token of a fixed cluster is its inverse, so "cost" ranks the same way)."""
    return ev.tokens_per_s if objective == "throughput" else ev.goodput.goodput_tokens_per_s


def rank_order(ev: Evaluation, c: Candidates, objective: str = "throughput") -> np.ndarray:
    """Feasible candidates, best first: the objective, then less memory, then fewer model-parallel
    ranks and less recomputation (the simpler layout wins a tie)."""
    idx = np.flatnonzero(ev.feasible)
    value = objective_value(ev, objective)
    keys = (c.recompute[idx], c.tp[idx] * c.cp[idx] * c.pp[idx], ev.peak_memory_bytes[idx], -value[idx])
    return idx[np.lexsort(keys)]


class SearchTimeout(RuntimeError):
    """The search ran past its deadline or was cancelled (checked between chunks, so it stops
    within one chunk)."""


def search(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    spec: SearchSpec,
    max_candidates: int | None = None,
    deadline: float | None = None,
    cancel: threading.Event | None = None,
) -> SearchResult:
    """Score every candidate layout and keep the `spec.top` best. `max_candidates` refuses a
    search larger than that (BerthError, counted before any candidate is built); `deadline`
    (time.monotonic) and `cancel` stop one that runs late or whose caller gave up."""
    groups = _groups(model, training, cluster, spec)
    total = sum(len(struct) * len(inner) for struct, inner in groups)
    if max_candidates is not None and total > max_candidates:
        raise BerthError(
            "search",
            total,
            f"{total:,} layouts to score, more than this server's limit "
            f"{max_candidates:,}; narrow the search with search.fix (e.g. tp=8)",
        )
    best: list[tuple[Candidates, Evaluation, np.ndarray]] = []
    reasons: Counter[int] = Counter()
    feasible = done = 0
    closest: tuple[str, float] | None = None
    for part in iter_candidates(groups):
        if cancel is not None and cancel.is_set():
            raise SearchTimeout(f"search cancelled after {done:,} of {total:,} layouts")
        if deadline is not None and time.monotonic() > deadline:
            raise SearchTimeout(f"search stopped after {done:,} of {total:,} layouts: over its time budget")
        done += len(part)
        # a layout that breaks a structural rule keeps that reason whatever the cost model says:
        # count it and score only the rest (evaluate is row-wise, so their numbers are unchanged)
        structural = structural_reasons(part, model, training, cluster)
        broken = structural != VALID
        if broken.any():
            codes, counts = np.unique(structural[broken], return_counts=True)
            reasons.update(dict(zip(codes.tolist(), counts.tolist(), strict=True)))
            part = part.take(np.flatnonzero(~broken))
            if not len(part):
                continue
        ev = evaluate(model, training, cluster, part, spec.memory_headroom)
        codes, counts = np.unique(ev.reason, return_counts=True)
        reasons.update(dict(zip(codes.tolist(), counts.tolist(), strict=True)))
        misfit = np.flatnonzero((ev.reason == OUT_OF_MEMORY) | (ev.reason == MEMORY_TIGHT))
        if len(misfit):
            j = int(misfit[np.argmin(ev.peak_memory_bytes[misfit])])
            if closest is None or ev.peak_memory_bytes[j] < closest[1]:
                closest = (part.layout(j).short(), float(ev.peak_memory_bytes[j]))
        order = rank_order(ev, part, spec.objective)
        feasible += len(order)
        # keep only this chunk's best rows (scored again on their own: evaluate is row-wise), so
        # memory stays one chunk whatever the search's size
        top = part.take(order[: spec.top * len(AXIS_ORDER_CHOICES)])
        del ev, part
        best.append((top, evaluate(model, training, cluster, top, spec.memory_headroom), np.arange(len(top))))
    merged = [
        (float(objective_value(ev, spec.objective)[i]), k, int(i)) for k, (_, ev, top) in enumerate(best) for i in top
    ]
    merged.sort(key=lambda t: -t[0])
    plans: list[Plan] = []
    seen: set[Layout] = set()
    inner: dict[int, Evaluation] = {}
    for _, k, i in merged:  # one plan per layout: its best axis order (an equal one keeps tp-dp-pp)
        key = best[k][0].layout(i).model_copy(update={"axis_order": "tp-dp-pp"})
        if key not in seen and len(plans) < spec.top:
            seen.add(key)
            if k not in inner:  # one evaluation per chunk's kept rows, not one per plan
                inner[k] = innermost_evaluation(model, training, cluster, best[k][0])
            plans.append(make_plan(model, training, cluster, best[k][0], best[k][1], i, not plans, inner[k]))
    rejected = {REASONS[code][0]: n for code, n in sorted(reasons.items()) if code != VALID}
    return SearchResult(
        plans=plans,
        searched=total,
        feasible=feasible,
        rejected=rejected,
        closest=closest if not plans else None,
        memory_headroom=engines.engine_of(training).headroom(spec.memory_headroom),
    )


def prediction_at(ev: Evaluation, cluster: ClusterSpec, i: int) -> Prediction:
    capacity = allocator_capacity_bytes(cluster.device, cluster.world_size)
    return Prediction(
        step_time_s=float(ev.step_time_s[i]),
        tokens_per_s=float(ev.tokens_per_s[i]),
        mfu=float(ev.mfu[i]),
        hfu=float(ev.hfu[i]),
        peak_memory_bytes=float(ev.peak_memory_bytes[i]),
        memory_capacity_bytes=capacity,
        fits=bool(ev.required_memory_bytes[i] <= capacity),
        bottleneck=BOTTLENECK_NAMES[int(ev.bottleneck[i])],
        time_breakdown_s={k: float(v[i]) for k, v in ev.time_breakdown_s.items()},
        comm_total_s={k: float(v[i]) for k, v in ev.comm_total_s.items()},
        memory_breakdown_bytes={k: float(v[i]) for k, v in ev.memory_breakdown_bytes.items()},
        model_flops_per_step=float(ev.model_flops_per_step),
        hardware_flops_per_step=float(ev.hardware_flops_per_step[i]),
        goodput=GoodputPrediction.model_validate(
            {**ev.goodput.at(i), **{k: _finite(float(v[i])) for k, v in ev.cost.items()}}
        ),
    )


def _finite(x: float) -> float | None:
    """A cost or energy per useful token is undefined (None, JSON null) when nothing useful is left."""
    return x if math.isfinite(x) else None


def make_plan(
    model,
    training,
    cluster,
    c: Candidates,
    ev: Evaluation,
    i: int,
    detail: bool = True,
    inner: Evaluation | None = None,
) -> Plan:
    """The plan of candidate i; `detail` lists its rank map and process groups (the best plan of a
    search and every compared layout carry them; the runners-up carry the per-axis summary).
    `inner`: `innermost_evaluation` of the same candidates, when the caller has it (one vectorized
    evaluation for many plans instead of one per plan)."""
    code = int(ev.reason[i])
    structurally_valid = code == VALID or REASONS[code][0] in ("out_of_memory", "memory_tight")
    layout = c.layout(i)
    prediction = prediction_at(ev, cluster, i) if structurally_valid else None
    placed = None
    if prediction:
        row = i
        if inner is None:
            inner, row = innermost_evaluation(model, training, cluster, Candidates.from_layouts([layout])), 0
        innermost_s = {k: float(v[row]) for k, v in inner.time_breakdown_s.items()}
        placed = placement(layout, cluster, prediction.time_breakdown_s, innermost_s, detail)
    return Plan(
        berth_version=__version__,
        model=model,
        training=training,
        cluster=cluster,
        layout=layout,
        prediction=prediction,
        infeasible_reason=_reason_text(code, ev, cluster, i, None if structurally_valid else (layout, model, training)),
        stage_layers=_stage_layers(model, training, layout),
        placement=placed,
    )


def _stage_layers(model: ModelSpec, training: TrainingSpec, layout: Layout) -> list[int] | None:
    try:
        return stages.rule_stage_layers(model, layout.pp, layout.virtual_stages, engines.split_rule(training))
    except ValueError:
        return None


def innermost_evaluation(model, training, cluster, c: Candidates) -> Evaluation:
    """The candidates on a cluster as fast as its innermost domain everywhere: what a plan's
    placement prices each axis's traffic against (where its groups sit, planner/placement.py)."""
    with np.errstate(divide="ignore", invalid="ignore"):
        return evaluate(model, training, innermost_cluster(cluster), c)


def _reason_text(
    code: int, ev: Evaluation, cluster: ClusterSpec, i: int, one: tuple[Layout, ModelSpec, TrainingSpec] | None = None
) -> str | None:
    """Why candidate i is not ranked (None: it is). With `one` (its layout, model and training), a layout that breaks
    the rules says so in its own numbers: the first rule's name, then what each of the first three broken says
    (specs/layouts.py layout_problems, the table the evaluation applied; an engine's rule names the engine)."""
    if code == VALID:
        return None
    name, text = REASONS[code]
    problems = layout_problems(*one, cluster) if one is not None else []
    if problems:
        return f"{problems[0][0]}: " + "; ".join(dict.fromkeys(why for _, why in problems[:3]))
    if name in ("out_of_memory", "memory_tight"):
        need = ev.required_memory_bytes[i] / 2**30  # what must fit (memory.peak_memory)
        have = allocator_capacity_bytes(cluster.device, cluster.world_size) / 2**30
        if name == "memory_tight":  # the headroom reads what the allocator holds: the blocks it keeps cached too
            held = ev.held_memory_bytes[i] / 2**30
            cached = f", {held:.1f} with the blocks it keeps cached," if held > need + 0.05 else ""
            return (
                f"{name}: needs {need:.1f} GiB per GPU{cached} of the {have:.1f} GiB the allocator can use, inside "
                f"the memory headroom ({max(1 - held / have, 0.0):.1%} left); it may run out of memory or stall"
            )
        peak = ev.peak_memory_bytes[i] / 2**30  # the GiB column: with the cached blocks it hands back as it fills
        freed = f" (its {peak:.1f} GiB peak less cached blocks it hands back)" if peak > need + 0.05 else ""
        return f"{name}: needs {need:.1f} GiB per GPU{freed}, the allocator can use {have:.1f} GiB"
    return f"{name}: {text}"


def predict_layouts(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    layouts: list[Layout],
    memory_headroom: float | None = None,
) -> list[Plan]:
    """Score given layouts (invalid ones keep their reason and no prediction)."""
    c = Candidates.from_layouts(layouts)
    with np.errstate(divide="ignore", invalid="ignore"):
        ev = evaluate(model, training, cluster, c, memory_headroom)
    inner = innermost_evaluation(model, training, cluster, c)
    return [make_plan(model, training, cluster, c, ev, i, inner=inner) for i in range(len(layouts))]


__all__ = [
    "SearchResult",
    "SearchTimeout",
    "count_candidates",
    "divisors",
    "enumerate_candidates",
    "iter_candidates",
    "predict_layouts",
    "search",
]
