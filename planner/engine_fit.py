"""Learn an engine from its measured runs: EngineTuning fitted to runs of any engine.

A run is what a team measured with its own engine: the model, the cluster, the sequence length and
global batch, the layout, whether it ran ("ok"), ran out of memory ("oom") or failed otherwise
("error"), and what it measured (step time or tokens/s, peak memory, reserved or allocated). Runs
come as JSON lines (`read_runs`; `berth calibrate --runs FILE`), from torchtitan's, Megatron-LM's or nanotron's
own training logs (planner/run_logs.py), or from berth's executor reports.

The fit (`fit_engine`) moves a handful of named, bounded parameters (PARAMETERS, EngineTuning in
specs/tree.py) on top of the engine's recipe (specs/engines.py):

    time:   compute_efficiency, layer_overhead_s, intra_node_bandwidth_scale,
            inter_node_bandwidth_scale, latency_scale, pipeline_microbatch_overhead_s, overlap,
            param_gather_exposed, grad_reduce_exposed, pipeline_latency_scale
    memory: fixed_bytes, state_bytes_scale, optimizer_bytes_scale, activation_scale,
            activation_tp_unsharded, logits_scale, reserve_fraction

Residuals: log(predicted / measured) of each run's step time and peak memory; a run that ran out of
memory is a one-sided constraint (its prediction must not fit: log(capacity / predicted) while it
does); a run that ran without a memory figure is the other side (log(predicted / capacity) while it
does not fit); a run whose reserved peak reached the allocator's ceiling (CEILING of its capacity) is
censored: PyTorch's caching allocator frees its cache and retries a failed allocation before it raises
(c10/cuda/CUDACachingAllocator.cpp: release_cached_blocks, then the malloc again), so the reserved
figure is where the cap stopped it, a lower bound on what the run asked for (a one-sided constraint:
its prediction must not be lower), and its step time paid for the retries (left out of the fit: on
the Ultra-Scale Playbook's sweep such runs ran 2.5-5x slower than predicted, docs/accuracy.md); a weak
prior (PRIOR_WEIGHT) holds what the runs say nothing about at the engine's values.
`scipy.optimize.least_squares` with the parameters' bounds minimizes them, under a robust loss; a step time the
fit still misses by 2x or more (a slow node, a run the engine's noise slowed: the Ultra-Scale sweep repeats layouts
measured up to 5x apart) is then set aside and the fit solved again without it, its memory figure kept, where such
runs are at most a quarter of those timed (`fit_engine`, OUTLIER; the answer names them).

Only what the runs determine is fitted: a parameter whose Jacobian column is (nearly) zero or a
combination of those already kept (IDENTIFIABLE_TOLERANCE), or for which its quantity has no spare
layout measured (RUNS_PER_PARAMETER; repeats of a layout count once), stays at its prior value, and the answer
says why. The parameters are considered in the order that explains most of the runs' disagreement with the prior
first (`explaining_order`), so a short budget goes where the runs say the engine differs. One the solution leaves
undetermined (`undetermined`: no dependence there, or a standard error wider than its range) goes back to the prior
and the rest is solved again; its budget goes to the next parameter the selection would take, kept where that fit
holds out no worse (`_reoffer_worse`). A run whose layout the engine's rules refuse is set aside (`refused_by_rules`).
Each fitted value gets its standard error (`covariance`: each quantity weighted by its own residual scale over the
rows that inform it), and the fit is scored on runs it did not see (k-fold by layout, `held_out`); fitted memory
parameters that predict the runs they did not see worse than the
prior, or predict more runs that ran not to fit than it does (unless RECIPE_NO_REFERENCE times as close), go back
to it (`_memory_back_to_prior`), and the time parameters are solved again without them. A fit that determines
nothing, or does not move, or whose only fitted parameters went back, is refused (BerthError): the caller keeps
the prior and exits non-zero.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any, Literal, NamedTuple

import numpy as np
from pydantic import ValidationError
from scipy.optimize import least_squares

from berth.cost_models.memory import allocator_capacity_bytes
from berth.cost_models.step import evaluate
from berth.planner.calibrate import jacobian
from berth.specs.candidates import Candidates
from berth.specs.engines import ENGINES
from berth.specs.errors import BerthError, from_validation_error
from berth.specs.layouts import layout_problems
from berth.specs.tree import ClusterSpec, EngineTuning, Layout, ModelSpec, TrainingSpec
from berth.specs.validity import RUNS_MEMORY_ASIDE, VALID

ENGINE_PROFILE_FORMAT = "berth-engine-profile/1"
GIB = 2.0**30
Status = Literal["ok", "oom", "error"]


@dataclass(frozen=True)
class Parameter:
    kind: str  # "log": fitted as log(value); "lin": as value / unit
    unit: float
    quantity: str  # "time" or "memory"
    needs: str  # the runs that determine it
    # a threshold (the host time a layer takes the longer of): below every run's layer time it changes nothing and
    # its derivative is 0, so the fit starts it no lower than this, where the runs can say whether it binds
    start: float | None = None
    lo: float = math.nan  # its EngineTuning field's bounds (`_bounded`)
    hi: float = math.nan


def _bounded(params: dict[str, Parameter]) -> dict[str, Parameter]:
    """The parameters with their bounds: the ge and le of their EngineTuning field (specs/tree.py), one place for
    what a fit may reach and what a profile or a request may hold."""
    out = {}
    for name, p in params.items():
        meta = EngineTuning.model_fields[name].metadata
        lo, hi = (next(getattr(m, key) for m in meta if hasattr(m, key)) for key in ("ge", "le"))
        out[name] = dataclasses.replace(p, lo=float(lo), hi=float(hi))
    return out


# layer_overhead_s's start: 3 ms a layer and micro-batch, about twice the host dispatch the H100 profiles measured per
# decoder layer for torch stacks (1.3-1.7 ms forward and backward, hardware_profiles/devices/h100-sxm.json frameworks)
HOST_START_S = 0.003
# pipeline_latency_scale's start: the geometric middle of its range. Nothing before the runs says where a pipeline's
# host-synchronized collectives start to bind (cost_models/step.py: a floor under each micro-batch's layers)
PIPELINE_LATENCY_START = math.sqrt(1000.0)
PARAMETERS: dict[str, Parameter] = _bounded(
    {
        # at most 15 % faster than the device profile's measured kernels, at most 20 % above its links' bandwidth: an
        # engine cannot beat the hardware, and a fit that wants to is absorbing something else
        "compute_efficiency": Parameter("log", 1.0, "time", "runs with a step time"),
        "layer_overhead_s": Parameter(
            "lin",
            1e-3,
            "time",
            "runs whose layers are short enough to wait on the host (small micro-batches, wide tp)",
            start=HOST_START_S,
        ),
        # inside a node an engine's collectives are the same library's as the profile's measured bus bandwidth: at
        # most 4x slower (small messages are latency_scale's); a fit that wants NVLink slower is absorbing its host or
        # compute
        "intra_node_bandwidth_scale": Parameter("log", 1.0, "time", "runs with tp or dp inside a node"),
        "inter_node_bandwidth_scale": Parameter("log", 1.0, "time", "runs with a group across nodes"),
        "latency_scale": Parameter("log", 1.0, "time", "runs with many small collectives (tp, small mbs)"),
        "pipeline_microbatch_overhead_s": Parameter("lin", 1e-2, "time", "runs with pp > 1 across nodes"),
        "overlap": Parameter("lin", 1.0, "time", "runs with dp > 1 whose gradient traffic is not hidden"),
        "param_gather_exposed": Parameter("lin", 1.0, "time", "runs with ZeRO-1 or 2 and dp > 1"),
        "grad_reduce_exposed": Parameter("lin", 1.0, "time", "runs with ZeRO-1 or 2 and dp > 1"),
        "pipeline_latency_scale": Parameter(
            "log", 1.0, "time", "runs with tp > 1 and pp > 1 across nodes", start=PIPELINE_LATENCY_START
        ),
        "fixed_bytes": Parameter("lin", GIB, "memory", "runs with a measured peak memory"),
        "state_bytes_scale": Parameter("log", 1.0, "memory", "runs whose parameter share differs"),
        "optimizer_bytes_scale": Parameter("log", 1.0, "memory", "runs with and without ZeRO sharding"),
        "activation_scale": Parameter("log", 1.0, "memory", "runs at two or more micro-batch sizes"),
        "activation_tp_unsharded": Parameter("lin", 1.0, "memory", "runs at two or more tp degrees"),
        "logits_scale": Parameter("log", 1.0, "memory", "runs whose last stage holds the logits"),
        "reserve_fraction": Parameter("lin", 1.0, "memory", "runs with reserved and allocated peaks"),
    }
)
TIME_PARAMETERS = tuple(n for n, p in PARAMETERS.items() if p.quantity == "time")
MEMORY_PARAMETERS = tuple(n for n, p in PARAMETERS.items() if p.quantity == "memory")
# a memory fit that predicts the held-out peaks this much closer than the recipe is kept even where it refuses a run
# that ran: the recipe is then no reference (the generic engine's misses the Ultra-Scale sweep by 37 %)
RECIPE_NO_REFERENCE = 0.5
CEILING = 0.97  # a reserved peak within 3 % of the allocator's capacity is capped, not measured (module docstring)
IDENTIFIABLE_TOLERANCE = 0.05  # a column < 5 % independent of the kept ones would have a 20x standard error
RUNS_PER_PARAMETER = 2  # parameters of a quantity <= its runs / 2: a spare run for each
NOISE_FLOOR = 0.01  # no measured step time or peak is known closer than 1 % (log): the floor of a residual scale
PRIOR_WEIGHT = 0.05  # the prior's pull, per fitted coordinate (log: a factor e costs as much as a 5 % miss)
MISS = 3.0  # the residual of a run whose layout the model refuses now (log: a 20x miss)
MOVED = 1e-3  # a fit whose fitted coordinates all moved less than this did not move
MAX_EVALUATIONS = 80
FOLDS = 4
INTERIOR = 0.01  # a start at least 1 % of its range inside a bound
# robust loss: a run missed by more than LOSS_SCALE (log) weighs ever less (a noisy run, a pathology no parameter
# describes), so the fit follows the bulk of the runs, not its worst outliers
LOSS, LOSS_SCALE = "soft_l1", 0.2
# a step time the fit still misses by 2x or more is set aside and the fit solved again without it (its memory kept),
# where such runs are at most a quarter of those with a step time (more: the model, not the runs, is off)
OUTLIER, OUTLIER_SHARE = math.log(2.0), 0.25
# whose memory figure a run reports (MeasuredRun.memory_rank)
MemoryRank = Literal["max", "rank0", "last"]


@dataclass(frozen=True)
class MeasuredRun:
    """One measured run of an engine (planned specs plus what was measured)."""

    id: str
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    layout: Layout
    status: Status = "ok"
    step_time_s: float | None = None
    peak_memory_bytes: float | None = None
    memory_kind: Literal["reserved", "allocated"] = "reserved"
    # whose peak it is: the highest over all ranks ("max"), global rank 0's ("rank0": pipeline stage 0, the rank
    # most engines' logs report; the cost model's first stage, Evaluation.first_stage_memory_bytes) or the last
    # pipeline stage's ("last": the loss's, where nanotron logs; Evaluation.last_stage_memory_bytes)
    memory_rank: MemoryRank = "max"

    @cached_property
    def group(self) -> str:
        """The model, training (less its tuning) and cluster: runs of one group are predicted in one call."""
        t = self.training.model_copy(update={"tuning": EngineTuning()})
        return self.model.model_dump_json() + t.model_dump_json() + self.cluster.model_dump_json()


# ---- the parameters' coordinates ------------------------------------------------------------------


def prior_value(tuning: EngineTuning, name: str, cluster: ClusterSpec | None = None, engine: str = "generic") -> float:
    v = getattr(tuning, name)
    if v is None and name == "overlap":  # the cluster's
        return cluster.comm_overlap_efficiency if cluster is not None else 0.7
    if v is None:  # the engine's (specs/engines.py)
        return float(getattr(ENGINES[engine], name))
    return float(v)


def encode(name: str, value: float) -> float:
    p = PARAMETERS[name]
    value = min(max(value, p.lo), p.hi)
    return math.log(value) if p.kind == "log" else value / p.unit


def decode(name: str, x: float) -> float:
    p = PARAMETERS[name]
    return float(math.exp(x)) if p.kind == "log" else float(x * p.unit)


def bounds(names: Iterable[str]) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = [], []
    for n in names:
        p = PARAMETERS[n]
        lo.append(encode(n, p.lo) if p.kind == "lin" else math.log(p.lo))
        hi.append(encode(n, p.hi) if p.kind == "lin" else math.log(p.hi))
    return np.array(lo), np.array(hi)


def with_values(tuning: EngineTuning, values: dict[str, float]) -> EngineTuning:
    return tuning.model_copy(update=values)


# ---- predicting runs ------------------------------------------------------------------------------


class RunPredictions(NamedTuple):
    """`predict_runs`'s answer, one entry per run (inf where the rules refuse the layout)."""

    time: np.ndarray  # step time (s)
    required: np.ndarray  # the memory that must fit (bytes)
    capacity: np.ndarray  # the allocator's capacity (bytes)
    seen: np.ndarray  # the memory of the rank the run reports: the peak, rank 0's or the last stage's (memory_rank)
    ranked: np.ndarray  # the search would rank it: it fits with the memory headroom (not memory_tight)

    @property
    def fits(self) -> np.ndarray:
        """Predicted to fit: what must fit is within the allocator's capacity (not out_of_memory, nor refused)."""
        return np.isfinite(self.required) & (self.required <= self.capacity)


def predict_runs(runs: list[MeasuredRun], tuning: EngineTuning) -> RunPredictions:
    """Each run under `tuning` (RunPredictions): one vectorized evaluation (cost_models/step.py) per model, training
    and cluster; a layout the rules refuse now gets inf (what a plan would carry, without building the plans: the
    fit evaluates its runs hundreds of times). Whether a run fits is the required memory's to say, whether the
    search ranks it the evaluation's (cost_models/memory.py peak_memory); how its measured figure compares is the
    reported rank's."""
    times, mems, caps, seen = (np.full(len(runs), np.inf) for _ in range(4))
    ranked = np.zeros(len(runs), dtype=bool)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(runs):
        groups.setdefault(r.group, []).append(i)
    for idx in groups.values():
        first = runs[idx[0]]
        training = first.training.model_copy(update={"tuning": tuning})
        with np.errstate(divide="ignore", invalid="ignore"):
            ev = evaluate(first.model, training, first.cluster, Candidates.from_layouts([runs[i].layout for i in idx]))
        runs_ok = np.isin(ev.reason, RUNS_MEMORY_ASIDE)
        cap = allocator_capacity_bytes(first.cluster.device, first.cluster.world_size)
        caps[idx] = float(cap)
        times[idx] = np.where(runs_ok, ev.step_time_s, np.inf)
        mems[idx] = np.where(runs_ok, ev.required_memory_bytes, np.inf)
        rank = np.array([runs[i].memory_rank for i in idx])
        reported = np.select(
            [rank == "rank0", rank == "last"],
            [ev.first_stage_memory_bytes, ev.last_stage_memory_bytes],
            ev.peak_memory_bytes,
        )
        seen[idx] = np.where(runs_ok, reported, np.inf)
        ranked[idx] = ev.reason == VALID
    return RunPredictions(times, mems, caps, seen, ranked)


def _allocated(mem: np.ndarray, tuning: EngineTuning) -> np.ndarray:
    """The allocated peak within a predicted reserved one (the reserve is reserve_fraction x the rest)."""
    return mem / (1.0 + tuning.reserve_fraction)


@dataclass
class Data:
    """The runs as arrays, for the residuals."""

    runs: list[MeasuredRun]
    time: np.ndarray  # measured step time (nan: none)
    mem: np.ndarray  # measured peak memory (nan: none)
    allocated: np.ndarray  # the memory figure is allocated, not reserved
    ok: np.ndarray
    oom: np.ndarray
    ceiling: np.ndarray  # the reserved peak reached the allocator's ceiling: a lower bound, the time left out
    # the memory figure is one rank's (rank 0's, the last stage's): the others' are bounded only by having run
    one_rank: np.ndarray

    @classmethod
    def of(cls, runs: list[MeasuredRun]) -> Data:
        mem = np.array(
            [r.peak_memory_bytes if r.status == "ok" and r.peak_memory_bytes else np.nan for r in runs], dtype=float
        )
        allocated = np.array([r.memory_kind == "allocated" for r in runs])
        cap = np.array([allocator_capacity_bytes(r.cluster.device, r.cluster.world_size) for r in runs], dtype=float)
        with np.errstate(invalid="ignore"):
            ceiling = ~allocated & (mem >= CEILING * cap)
        time = [r.step_time_s if r.status == "ok" and r.step_time_s else np.nan for r in runs]
        return cls(
            runs,
            np.where(ceiling, np.nan, np.array(time, dtype=float)),
            mem,
            allocated,
            np.array([r.status == "ok" for r in runs]),
            np.array([r.status == "oom" for r in runs]),
            ceiling,
            np.array([r.memory_rank != "max" for r in runs]),
        )

    def residuals(self, tuning: EngineTuning) -> np.ndarray:
        t, m, cap, seen, _ = predict_runs(self.runs, tuning)
        has_t, has_m = np.isfinite(self.time), np.isfinite(self.mem)
        with np.errstate(divide="ignore", invalid="ignore"):
            rt = np.where(np.isfinite(t[has_t]), np.log(t[has_t] / self.time[has_t]), MISS)
            pm = self.as_measured(seen, tuning)
            rm = np.where(np.isfinite(pm[has_m]), np.log(pm[has_m] / self.mem[has_m]), MISS)
            rm = np.where(self.ceiling[has_m], np.minimum(rm, 0.0), rm)  # capped: only a prediction below counts
            # one-sided: an out-of-memory run must not fit; a run that ran must fit where its figure does not say
            # so already (none, or one rank's only)
            r_oom = np.maximum(np.log(cap[self.oom] / np.where(np.isfinite(m[self.oom]), m[self.oom], 1e30)), 0.0)
            free = self.ok & (~has_m | self.one_rank)
            r_fit = np.maximum(np.log(np.where(np.isfinite(m[free]), m[free], 1e30) / cap[free]), 0.0)
        return np.concatenate([rt, rm, r_oom, r_fit])

    def as_measured(self, seen: np.ndarray, tuning: EngineTuning) -> np.ndarray:
        """The predicted memory of the reported rank (`predict_runs`' last array) in each run's figure: the
        allocated peak within the reserved one where the run measured allocated memory."""
        return np.where(self.allocated, _allocated(seen, tuning), seen)

    def layouts(self) -> dict[str, int]:
        """Distinct layouts (group and layout) with a measured step time and with a measured peak: repeats of one
        layout measure it again, they do not tell parameters apart (`identifiable`'s budget)."""
        keys = [layout_key(r) for r in self.runs]
        return {
            q: len({k for k, has in zip(keys, np.isfinite(v), strict=True) if has})
            for q, v in (("time", self.time), ("memory", self.mem))
        }

    def counts(self) -> dict[str, int]:
        return {
            "time": int(np.isfinite(self.time).sum()),
            "memory": int(np.isfinite(self.mem).sum()),
            "oom": int(self.oom.sum()),
            "allocated": int((np.isfinite(self.mem) & self.allocated).sum()),
            "at_ceiling": int(self.ceiling.sum()),
        }


def layout_key(run: MeasuredRun) -> str:
    """One key per layout of one group: the runs of a layout measured several times share it."""
    return f"{run.group}|{run.layout.short()}"


def memory_errors(ratio: np.ndarray, ceiling: np.ndarray) -> np.ndarray:
    """|predicted / measured - 1| of peak memory; for a peak capped at the allocator's ceiling only a shortfall
    (the prediction below the cap it reached) is an error."""
    return np.where(ceiling, np.maximum(1.0 - ratio, 0.0), np.abs(ratio - 1.0))


def errors(runs: list[MeasuredRun], tuning: EngineTuning) -> dict[str, float]:
    """Median and worst |relative error| of step time and peak memory over the runs that measured them (a
    step at the allocator's ceiling is left out, a peak there counts only below it: `memory_errors`), with how
    many ran and were predicted not to fit, and how many ran out of memory but were predicted to fit."""
    if not runs:
        return {}
    d = Data.of(runs)
    p = predict_runs(runs, tuning)
    t, seen = p.time, p.seen
    out: dict[str, float] = {"runs": float(len(runs))}
    has_t, has_m = np.isfinite(d.time), np.isfinite(d.mem)
    if has_t.any():
        e = np.abs(t[has_t] / d.time[has_t] - 1.0)
        out.update(step_time_median_error=float(np.median(e)), step_time_max_error=float(np.max(e)))
    if has_m.any():
        pm = d.as_measured(seen, tuning)
        e = memory_errors(pm[has_m] / d.mem[has_m], d.ceiling[has_m])
        out.update(memory_median_error=float(np.median(e)), memory_max_error=float(np.max(e)))
    out["ran_predicted_not_to_fit"] = float(np.sum(d.ok & ~p.fits))
    out["oom_predicted_to_fit"] = float(np.sum(d.oom & p.fits))
    return out


# ---- the fit --------------------------------------------------------------------------------------


@dataclass
class EngineFit:
    engine: str
    prior: EngineTuning
    tuning: EngineTuning
    fitted: list[str]
    not_fitted: dict[str, str]
    uncertainty: dict[str, dict[str, Any]] = field(default_factory=dict)
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    counts: dict[str, int] = field(default_factory=dict)
    run_ids: list[str] = field(default_factory=list)
    set_aside: dict[str, str] = field(default_factory=dict)  # run id -> why its step time was left out (OUTLIER)

    def document(self, name: str) -> dict[str, Any]:
        """The engine profile `berth plan/compare --profile` and the API's training.tuning take."""
        return {
            "format": ENGINE_PROFILE_FORMAT,
            "engine": self.engine,
            "tuning": self.tuning.model_copy(update={"profile": name}).model_dump(mode="json"),
            "fit": {
                "fitted": self.fitted,
                "not_fitted": self.not_fitted,
                "uncertainty": self.uncertainty,
                "errors": self.errors,
                "runs": self.counts,
                "run_ids": self.run_ids,
                "set_aside": self.set_aside,
                "prior": self.prior.model_dump(mode="json"),
            },
        }


def explaining_order(jacobian: np.ndarray, residual: np.ndarray) -> list[int]:
    """The columns in the order forward stepwise selection takes them (orthogonal matching pursuit, Pati et al.
    1993): each next one is the column that, made orthogonal to those taken, explains most of what is left of the
    runs' residual at the prior. A short budget of parameters goes to what the runs disagree with the prior
    about, not to what they are merely sensitive to."""
    q = np.array(jacobian, dtype=float)
    r = np.array(residual, dtype=float)
    order: list[int] = []
    left = list(range(q.shape[1]))
    while left:
        if float(np.linalg.norm(r)) < 1e-9:  # nothing left to explain: the rest in PARAMETERS order
            return order + left
        norms = np.linalg.norm(q[:, left], axis=0)
        gain = np.where(norms > 1e-12, np.abs(q[:, left].T @ r) / np.maximum(norms, 1e-12), -1.0)
        j = left[int(np.argmax(gain))]
        order.append(j)
        left.remove(j)
        u = q[:, j] / max(float(np.linalg.norm(q[:, j])), 1e-12)
        r = r - u * (u @ r)
        q[:, left] -= np.outer(u, u @ q[:, left])
    return order


class NotSeparable(str):
    """`identifiable`'s reason for a parameter the runs cannot tell apart from kept ones (`tied`), which keeps those
    names, so that `_ties_as_fitted` can say which of them the fit then did not keep (`dropped`) without reading its
    words back."""

    tied: tuple[str, ...]
    needs: str
    dropped: tuple[str, ...]

    def __new__(cls, tied: Iterable[str], needs: str, dropped: Iterable[str] = ()) -> NotSeparable:
        names, gone = tuple(tied), tuple(dropped)
        note = f" ({', '.join(gone)} then not kept either)" if gone else ""
        text = f"not separable from {', '.join(names)} with these runs{note}: needs {needs} that tell them apart"
        self = super().__new__(cls, text)
        self.tied, self.needs, self.dropped = names, needs, gone
        return self

    def __reduce__(self) -> tuple:  # pickled with its parts (benchmarks/engine_sweep.py returns fits from workers)
        return NotSeparable, (self.tied, self.needs, self.dropped)


def identifiable(
    jacobian: np.ndarray,
    names: tuple[str, ...],
    counts: dict[str, int],
    residual: np.ndarray | None = None,
    first: tuple[str, ...] = (),
) -> tuple[list[str], dict[str, str]]:
    """(the parameters the runs determine, {parameter: why not} for the others), in PARAMETERS order; `counts`' time
    and memory are distinct layouts measured (`Data.layouts`), RUNS_PER_PARAMETER of them per parameter. With the
    runs' `residual` at the prior, the budget goes first to the parameters that explain it (`explaining_order`);
    without, in PARAMETERS order. `first`: parameters whose mechanism the engine's code has (EngineInfo.fit_first),
    offered the budget before the others where the runs depend on them: a threshold's effect is not linear, and
    the selection's linear view at one point gives it to the parameters that mimic it there."""
    keep: list[int] = []
    why: dict[str, str] = {}
    norms = np.linalg.norm(jacobian, axis=0)
    budget = {q: max(counts[q] // RUNS_PER_PARAMETER, 1 if counts[q] >= 2 else 0) for q in ("time", "memory")}
    budget["memory"] += 1 if counts["oom"] >= 2 and counts["memory"] else 0
    order = explaining_order(jacobian, residual) if residual is not None else list(range(len(names)))
    ahead = [names.index(n) for n in first]
    order = ahead + [j for j in order if j not in ahead]
    for j in order:
        name = names[j]
        p = PARAMETERS[name]
        if not counts[p.quantity]:
            why[name] = f"needs runs with a measured {p.quantity}"
            continue
        if not norms[j] > 1e-9:
            why[name] = f"the runs do not depend on it: needs {p.needs}"
            continue
        if name == "reserve_fraction" and not 0 < counts["allocated"] < counts["memory"]:
            # with one kind of memory figure it is one more scale of every term, not the allocator's reserve
            why[name] = f"needs {p.needs}"
            continue
        if budget[p.quantity] < 1:
            kept = sum(PARAMETERS[names[k]].quantity == p.quantity for k in keep)
            more = RUNS_PER_PARAMETER * (kept + 1) - counts[p.quantity]
            why[name] = f"needs {more} more layout{'s' if more > 1 else ''} run with a measured {p.quantity}"
            continue
        cols = jacobian[:, keep + [j]] / norms[keep + [j]]
        if np.linalg.svd(cols, compute_uv=False)[-1] < IDENTIFIABLE_TOLERANCE:
            # the kept parameters of its own quantity: a time and a memory parameter move different residuals (all
            # kept ones where none is of its quantity: then it is not the time/memory split that ties them)
            alike = [names[k] for k in keep if PARAMETERS[names[k]].quantity == p.quantity] or [names[k] for k in keep]
            why[name] = NotSeparable(alike, p.needs)
            continue
        budget[p.quantity] -= 1
        keep.append(j)
    return [names[j] for j in sorted(keep)], {n: why[n] for n in names if n in why}


def start(prior: EngineTuning, names: Iterable[str], cluster: ClusterSpec, engine: str) -> np.ndarray:
    """The prior in the fit's coordinates, moved INTERIOR of the way inside its bounds (a start on a bound,
    e.g. an overhead of 0, stalls the trust-region solver's bound scaling at its first step), a threshold
    parameter no lower than its Parameter.start."""
    names = list(names)
    lo, hi = bounds(names)
    x = np.array(
        [encode(n, max(prior_value(prior, n, cluster, engine), PARAMETERS[n].start or -math.inf)) for n in names]
    )
    pad = INTERIOR * (hi - lo)
    return np.clip(x, lo + pad, hi - pad)


def _solve(
    data: Data, prior: EngineTuning, names: list[str], cluster: ClusterSpec, curvature: bool = False
) -> tuple[EngineTuning, Any, np.ndarray]:
    """(the fitted tuning, the solver's result, the prior in the fit's coordinates): the solver starts INTERIOR
    inside the bounds (`start`), the prior's pull is towards the prior itself."""
    lo, hi = bounds(names)
    engine = data.runs[0].training.engine
    x0 = start(prior, names, cluster, engine)
    at = np.clip([encode(n, prior_value(prior, n, cluster, engine)) for n in names], lo, hi)

    def tuning_of(x: np.ndarray) -> EngineTuning:  # within the fields' bounds: exp(log(hi)) can round past hi
        values = {n: decode(n, xi) for n, xi in zip(names, x, strict=True)}
        return with_values(prior, {n: min(max(v, PARAMETERS[n].lo), PARAMETERS[n].hi) for n, v in values.items()})

    def fun(x: np.ndarray) -> np.ndarray:
        return np.concatenate([data.residuals(tuning_of(x)), PRIOR_WEIGHT * (x - at)])

    result = least_squares(
        fun, x0, bounds=(lo, hi), diff_step=1e-3, x_scale="jac", max_nfev=MAX_EVALUATIONS, loss=LOSS, f_scale=LOSS_SCALE
    )
    if curvature:  # the runs' residuals and their Jacobian at the solution (`covariance`): the solver's own `jac`
        # has the columns of parameters held at an active bound zeroed, and the robust loss's weights applied
        result.runs_fun = data.residuals(tuning_of(result.x))
        result.runs_jac = jacobian(lambda x: data.residuals(tuning_of(x)), result.x, lo, hi)
    return tuning_of(result.x), result, at


def fit_engine(runs: list[MeasuredRun], prior: EngineTuning | None = None, folds: int = FOLDS) -> EngineFit:
    """Fit the engine's parameters the runs determine (see the module docstring); a step time the fit still misses
    by 2x or more (OUTLIER: a noisy run, a slow node, a pathology no parameter describes) is set aside and the fit
    solved again without it, where such runs are at most OUTLIER_SHARE of those with a step time (`set_aside` says
    which and why; its memory figure stays in). A run whose layout the engine's rules refuse is set aside whole
    (`refused_by_rules`): no parameter moves a refusal, so its constant miss would only widen every interval."""
    refused = refused_by_rules(runs, prior or runs[0].training.tuning) if runs else {}
    if refused and len(refused) == len(runs):
        raise BerthError(
            "runs", len(runs), "every run's layout breaks the engine's rules: " + next(iter(refused.values()))
        )
    times = Counter(r.id for r in runs)  # a run's name: its id, with its place where ids repeat
    named = ((runs[i].id, i, w) for i, w in refused.items())
    refused_named = {name if times[name] == 1 else f"{name} (run {i + 1})": w for name, i, w in named}
    runs = [r for i, r in enumerate(runs) if i not in refused]
    fit = _fit_engine(runs, prior, folds)
    fit.set_aside = refused_named | fit.set_aside
    measured = Data.of(runs).time

    def miss(tuning: EngineTuning) -> np.ndarray:  # log(predicted / measured) step time (nan: none measured)
        with np.errstate(divide="ignore", invalid="ignore"):
            return np.log(predict_runs(runs, tuning).time / measured)

    first = miss(fit.tuning)
    out = np.isfinite(first) & (np.abs(first) >= OUTLIER)
    if not out.any() or out.sum() > OUTLIER_SHARE * np.isfinite(measured).sum():
        return fit
    kept = [dataclasses.replace(r, step_time_s=None) if o else r for r, o in zip(runs, out, strict=True)]
    try:
        refit = _fit_engine(kept, prior, folds)
    except BerthError:  # without them the runs determine nothing, or the fit does not move: the first fit stands
        return fit
    refit.set_aside = refused_named | {
        r.id: f"its step time, {r.step_time_s:.3g} s, is {math.exp(-m):.2g}x what the fit of the others predicts: "
        "left out as noise (its memory kept)"
        for r, m, o in zip(runs, miss(refit.tuning), out, strict=True)
        if o
    }
    return refit


def refused_by_rules(runs: list[MeasuredRun], tuning: EngineTuning) -> dict[int, str]:
    """{index: why} of the runs whose layout the engine's rules refuse (`predict_runs` gives them inf): berth would
    not plan such a layout for this engine, so a run of it says the engine or the layout is not what the run names."""
    out: dict[int, str] = {}
    for i in np.flatnonzero(~np.isfinite(predict_runs(runs, tuning).time)):
        r = runs[int(i)]
        rule = "; ".join(why for _, why in layout_problems(r.layout, r.model, r.training, r.cluster))
        out[int(i)] = f"{r.training.engine}'s rules refuse {r.layout.short()} ({rule or 'a rule'}): left out of the fit"
    return out


def _solve_determined(
    data: Data, prior: EngineTuning, chosen: list[str], not_fitted: dict[str, str], cluster: ClusterSpec
) -> tuple[EngineTuning, Any, np.ndarray, list[str], dict[str, str]]:
    """`_solve`, then again without the parameters it left `undetermined` (they keep the prior's values) until none
    is; (tuning, result, the prior's coordinates, the parameters fitted, {parameter: why not}). Refused (BerthError)
    where none is left."""
    tuning, result, at = _solve(data, prior, chosen, cluster, curvature=True)
    while loose := undetermined(chosen, result, data):
        chosen = [n for n in chosen if n not in loose]
        not_fitted = {n: (loose | not_fitted)[n] for n in PARAMETERS if n in loose or n in not_fitted}
        if not chosen:
            raise BerthError(
                "runs",
                len(data.runs),
                "the fit leaves every parameter it tried undetermined (the prior is kept): "
                + "; ".join(f"{n}: {w}" for n, w in loose.items()),
            )
        tuning, result, at = _solve(data, prior, chosen, cluster, curvature=True)
    return tuning, result, at, chosen, not_fitted


def _fit_engine(runs: list[MeasuredRun], prior: EngineTuning | None, folds: int) -> EngineFit:
    """One fit of the runs as they are (the module docstring); `fit_engine` sets outliers aside around it."""
    if not runs:
        raise BerthError("runs", 0, "no runs to fit")
    engines = sorted({r.training.engine for r in runs})
    if len(engines) > 1:
        raise BerthError("runs", engines, "runs of several engines: calibrate one engine at a time")
    devices = sorted({r.cluster.device.name for r in runs})
    if len(devices) > 1:
        raise BerthError("runs", devices, "runs on several device kinds: calibrate one device at a time")
    prior = prior or runs[0].training.tuning
    cluster = runs[0].cluster
    data = Data.of(runs)
    counts = data.counts()
    if counts["time"] + counts["memory"] + counts["oom"] < 2:
        raise BerthError(
            "runs", len(runs), "fewer than two measured values (step time, peak memory, oom): nothing to fit"
        )
    names = tuple(PARAMETERS)
    lo, hi = bounds(names)
    x0 = start(prior, names, cluster, engines[0])

    def fun_all(x: np.ndarray) -> np.ndarray:
        return data.residuals(with_values(prior, {n: decode(n, xi) for n, xi in zip(names, x, strict=True)}))

    first = ENGINES[engines[0]].fit_first
    distinct = counts | data.layouts()  # repeats of a layout do not tell parameters apart
    jac, residual = jacobian(fun_all, x0, lo, hi), data.residuals(prior)
    chosen, not_fitted = identifiable(jac, names, distinct, residual, first)
    if not chosen:
        raise BerthError(
            "runs",
            len(runs),
            "these runs determine none of the engine's parameters (the prior is kept): "
            + "; ".join(f"{n}: {w}" for n, w in not_fitted.items()),
        )
    tried = set(chosen)
    tuning, result, x_prior, fitted, not_fitted = once = _solve_determined(data, prior, chosen, not_fitted, cluster)
    # the budget of the parameters the solve left undetermined goes to the next ones the selection would take, until
    # a selection offers none it has not tried (each round drops at least one: at most as many rounds as parameters);
    # kept where it predicts the runs it does not see no worse than the first solve (`_reoffer_worse`)
    dropped = {n: not_fitted[n] for n in tried if n not in fitted}
    while dropped:
        jac[:, [names.index(n) for n in dropped]] = 0.0  # out of the selection: they keep their reason
        again, why = identifiable(jac, names, distinct, residual, first)
        if set(again) <= tried:
            break
        tried |= set(again)
        try:
            solved = _solve_determined(data, prior, again, why | dropped, cluster)
        except BerthError:  # the new ones leave every parameter undetermined: the last solve stands
            break
        tuning, result, x_prior, fitted, not_fitted = solved
        dropped |= {n: not_fitted[n] for n in again if n not in fitted}
    held_for: dict[tuple[str, ...], dict] = {}  # the k-fold figures of a set of parameters, solved once

    def held(names_: list[str]) -> dict:
        if tuple(names_) not in held_for:
            held_for[tuple(names_)] = held_out(runs, prior, names_, cluster, folds)
        return held_for[tuple(names_)]

    if fitted != once[3] and (worse := _reoffer_worse(held(once[3]), held(fitted))):
        added = [n for n in fitted if n not in once[3]]
        tuning, result, x_prior, fitted, not_fitted = once
        not_fitted = not_fitted | {n: worse for n in added}
    chosen = fitted
    not_fitted = {n: not_fitted[n] for n in PARAMETERS if n in not_fitted}
    _refuse_unmoved(
        result.x, x_prior, runs, f"the fit of {', '.join(chosen)} did not move from the prior: these runs agree with it"
    )
    fit = EngineFit(
        engine=engines[0],
        prior=prior,
        tuning=tuning,
        fitted=chosen,
        not_fitted=not_fitted,
        uncertainty=uncertainty(chosen, result, data),
        counts=counts,
        run_ids=[r.id for r in runs],
    )
    fit.errors = {"fit_before": errors(runs, prior), "fit_after": errors(runs, tuning)}
    if k_fold := held(chosen):
        fit.errors.update(k_fold)
        _memory_back_to_prior(fit, runs, folds)
    _ties_as_fitted(fit)
    return fit


def _reoffer_worse(first: dict, then: dict) -> str:
    """Why the parameters a re-offered budget added are not kept ('' where they are): the fit with them (`then`, its
    `held_out` figures) predicts the runs it does not see worse in step time than the first solve's (`first`). A
    parameter taken after the solve is a second choice made on the same runs; it has to earn its place on runs it
    did not see."""
    a = first.get("held_out_after", {}).get("step_time_median_error")
    b = then.get("held_out_after", {}).get("step_time_median_error")
    if a is None or b is None or b <= a:
        return ""
    return (
        f"offered the budget of a parameter the runs left undetermined, the fit with it predicted the runs it did not "
        f"see to {b:.1%} (median |step time error|), without it to {a:.1%}: not kept"
    )


def _ties_as_fitted(fit: EngineFit) -> None:
    """A "not separable from A, B" reason (NotSeparable) names the parameters the selection (`identifiable`, at the
    prior) had kept; one of them the fit then did not keep (undetermined at the solution, or a memory fit set back) is
    said so, so the reason does not send a reader to a parameter the answer lists as not fitted without a word."""
    for name, why in fit.not_fitted.items():
        if not isinstance(why, NotSeparable) or why.dropped:  # another reason, or said already
            continue
        if dropped := [n for n in why.tied if n not in fit.fitted]:
            fit.not_fitted[name] = NotSeparable(why.tied, why.needs, dropped)


def recipe_no_reference(errors: dict[str, dict[str, float]]) -> bool:
    """The memory fit predicts the held-out peaks over 1 / RECIPE_NO_REFERENCE times as closely as the prior: the
    prior is then no reference, and the fit is kept even where it refuses a run that ran (`_memory_back_to_prior`)."""
    after = errors.get("held_out_after", {}).get("memory_median_error")
    before = errors.get("held_out_before", {}).get("memory_median_error")
    return after is not None and before is not None and after < RECIPE_NO_REFERENCE * before


def _refuse_unmoved(x: np.ndarray, at: np.ndarray, runs: list[MeasuredRun], why: str) -> None:
    """A fit whose fitted coordinates all moved less than MOVED from the prior's did not move: refused, the prior
    kept (the caller exits non-zero)."""
    if np.max(np.abs(x - at)) < MOVED:
        raise BerthError("runs", len(runs), f"{why} (the prior is kept)")


def _memory_back_to_prior(fit: EngineFit, runs: list[MeasuredRun], folds: int = FOLDS) -> None:
    """Where the k-fold held-out memory error is above the prior's, or the fit predicts more of the runs that ran
    not to fit than the prior does (on the runs it did not see, or on all of them) without predicting the held-out
    peaks RECIPE_NO_REFERENCE as closely, the fitted memory parameters go back to the prior: a memory fit that
    predicts the runs it did not see worse than the engine's recipe does, or would refuse layouts that ran where the
    recipe is a fair reference, is not kept. On the Ultra-Scale Playbook's sweep, 12 probes of the 8B model on 64
    GPUs fitted the pipeline stages' extra memory at tp 8 as a share of the activations that tensor parallelism
    leaves whole (held-out median 8.0 % against the prior's 9.6 %) and predicted one held-out probe that ran not to
    fit: kept, that fit put 14 runs that ran at tp 16-32 and 16-64 sequences a micro-batch over the capacity, the
    prior 3, and missed the other groups' memory by 10.5 % against 8.7 % (benchmarks/engine_sweep.py). The time
    fit stands, solved again without the memory parameters; a time fit that holds out worse is only warned about
    (`berth calibrate`): the sweep's held-out time error over 9 runs is noisier than what the time fit gains on the
    runs of other GPU counts."""
    held_after, held_before = fit.errors["held_out_after"], fit.errors["held_out_before"]
    after, before = held_after.get("memory_median_error"), held_before.get("memory_median_error")
    back = [n for n in fit.fitted if n in MEMORY_PARAMETERS]
    if after is None or before is None or not back:
        return
    refused = (held_after.get("ran_predicted_not_to_fit", 0.0), fit.errors["fit_after"]["ran_predicted_not_to_fit"])
    refused_before = held_before["ran_predicted_not_to_fit"]
    if max(refused) > refused_before and not recipe_no_reference(fit.errors):
        held = (
            f"predicted that {refused[0]:.0f} of the runs it did not see, and {refused[1]:.0f} of all, would not fit, "
            f"though they ran (the prior: {refused_before:.0f})"
        )
    elif after > before:
        held = f"predicted the runs it did not see to {after:.1%} (median |error|), the prior to {before:.1%}"
    else:
        return
    if len(back) == len(fit.fitted):
        raise BerthError("runs", len(runs), f"the fit of {', '.join(back)} {held}: the prior is kept")
    fit.fitted = [n for n in fit.fitted if n not in back]
    why = fit.not_fitted | {n: f"the memory fit {held}: the prior is kept" for n in back}
    fit.not_fitted = {n: why[n] for n in PARAMETERS if n in why}
    # the time parameters solved again by themselves: the joint solve's evaluation budget (MAX_EVALUATIONS) went to
    # the memory parameters too, and may have stopped before the time ones settled
    data = Data.of(runs)
    fit.tuning, result, at, fit.fitted, fit.not_fitted = _solve_determined(
        data, fit.prior, fit.fitted, fit.not_fitted, runs[0].cluster
    )
    moved = f"the memory fit {held}, and the fit of {', '.join(fit.fitted)} did not move from the prior without it"
    _refuse_unmoved(result.x, at, runs, moved)
    fit.uncertainty = uncertainty(fit.fitted, result, data)
    fit.errors["fit_after"] = errors(runs, fit.tuning)
    # held out again with the parameters kept (the time ones' folds solved without the memory ones, as the answer is;
    # its memory is the prior's); the memory fit not kept keeps its own figures under held_out_memory_fit
    memory = ("memory_median_error", "memory_max_error", "ran_predicted_not_to_fit")
    fit.errors["held_out_memory_fit"] = {k: held_after[k] for k in memory if k in held_after}
    again = held_out(runs, fit.prior, fit.fitted, runs[0].cluster, folds).get("held_out_after", {})
    fit.errors["held_out_after"] = again | {k: held_before[k] for k in memory if k in held_before}


def undetermined(names: list[str], result: Any, data: Data) -> dict[str, str]:
    """{parameter: why} for the fitted parameters the runs leave undetermined at the solution: the runs do not
    depend on it there (a threshold it did not reach, a bound that switches its mechanism off), or its standard error
    (`uncertainty`'s covariance) is wider than its whole range: the runs say nothing of it. Selection
    (`identifiable`) looks at the prior; this looks where the solver ended."""
    norms = np.linalg.norm(result.runs_jac, axis=0)
    cov = covariance(names, result, data)
    lo, hi = bounds(names)
    out: dict[str, str] = {}
    for j, name in enumerate(names):
        value, needs = decode(name, result.x[j]), PARAMETERS[name].needs
        if not norms[j] > 1e-9:
            out[name] = f"at {value:.3g} the runs do not depend on it: needs {needs}"
        elif math.sqrt(max(cov[j, j], 0.0)) > hi[j] - lo[j]:
            interval = f"{decode(name, lo[j]):.3g} .. {decode(name, hi[j]):.3g}"
            out[name] = f"its standard error is wider than its whole range ({interval}): needs {needs}"
    return out


def covariance(names: list[str], result: Any, data: Data) -> np.ndarray:
    """The fitted coordinates' covariance at the solution (`_solve` with curvature), (J^T W J)^+ over the runs' rows
    (not the prior's): each row weighted by 1 / s^2 of its quantity (step time; peak memory with the out-of-memory and
    must-fit rows), s^2 its informative rows' residual sum of squares / (those rows - the quantity's parameters), at
    least NOISE_FLOOR^2. Step times miss by more than peaks do: one pooled s^2 would give the memory parameters the
    time residuals' noise. A row is informative where it moves with a fitted parameter or misses: an out-of-memory or
    must-fit row that holds (0, flat) is no measurement, and counting it would narrow every interval."""
    jac, res = result.runs_jac, result.runs_fun
    time_rows = np.arange(res.size) < int(np.isfinite(data.time).sum())  # Data.residuals: step times first
    informative = np.any(jac != 0.0, axis=1) | (res != 0.0)
    weight = np.empty(res.size)
    for rows, quantity in ((time_rows, "time"), (~time_rows, "memory")):
        k = sum(PARAMETERS[m].quantity == quantity for m in names)
        used = rows & informative
        weight[rows] = 1.0 / max(float(res[used] @ res[used]) / max(int(used.sum()) - k, 1), NOISE_FLOOR**2)
    return np.linalg.pinv(jac.T @ (weight[:, None] * jac))


def uncertainty(names: list[str], result: Any, data: Data) -> dict[str, dict[str, Any]]:
    """Standard error and 95 % interval of each fitted value (`covariance`), in the fitted coordinates (log: a
    multiplicative interval), mapped back to values."""
    cov = covariance(names, result, data)
    lo, hi = bounds(names)
    out: dict[str, dict[str, Any]] = {}
    for j, name in enumerate(names):
        se = float(np.sqrt(max(cov[j, j], 0.0)))
        x = result.x[j]
        value = decode(name, x)
        p = PARAMETERS[name]
        value_se = abs(value) * se if p.kind == "log" else se * p.unit
        out[name] = {
            "value": value,
            "standard_error": value_se,
            "ci95": [decode(name, max(x - 1.96 * se, lo[j])), decode(name, min(x + 1.96 * se, hi[j]))],
            "at_bound": bool(np.isclose(x, lo[j]) or np.isclose(x, hi[j])),
        }
    return out


def held_out(
    runs: list[MeasuredRun], prior: EngineTuning, names: list[str], cluster: ClusterSpec, folds: int
) -> dict[str, dict[str, float]]:
    """k-fold: fit on the rest, score each fold's runs; the errors of all folds pooled (before: the prior)."""
    # a stable shuffle (str hashes change between processes): the folds, and so the figures, are reproducible; the
    # runs of one layout fall in one fold, so no run is predicted by a fit that saw the same layout measured again
    first: dict[str, str] = {}  # a layout's first run id
    for r in runs:
        first.setdefault(layout_key(r), r.id)
    keys = sorted(first, key=lambda key: hashlib.sha256(first[key].encode()).hexdigest())
    k = min(folds, len(keys))
    if k < 2:
        return {}
    fold_of = {key: i % k for i, key in enumerate(keys)}
    preds_t, preds_m = np.full(len(runs), np.nan), np.full(len(runs), np.nan)
    ceiling = np.zeros(len(runs), dtype=bool)
    not_fit = np.zeros(len(runs), dtype=bool)
    for f in range(k):
        test = {i for i, r in enumerate(runs) if fold_of[layout_key(r)] == f}
        train = [r for i, r in enumerate(runs) if i not in test]
        if not train:
            continue
        tuning, _, _ = _solve(Data.of(train), prior, names, cluster)
        idx = sorted(test)
        p = predict_runs([runs[i] for i in idx], tuning)
        d = Data.of([runs[i] for i in idx])
        not_fit[idx] = d.ok & ~p.fits
        preds_t[idx] = p.time / d.time
        preds_m[idx] = d.as_measured(p.seen, tuning) / d.mem
        ceiling[idx] = d.ceiling
    out: dict[str, float] = {}
    for key, ratio in (("step_time", preds_t), ("memory", preds_m)):
        ok = np.isfinite(ratio)
        if ok.any():
            e = memory_errors(ratio[ok], ceiling[ok]) if key == "memory" else np.abs(ratio[ok] - 1.0)
            out[f"{key}_median_error"] = float(np.median(e))
            out[f"{key}_max_error"] = float(np.max(e))
    if out:
        out["ran_predicted_not_to_fit"] = float(not_fit.sum())
    return {"held_out_before": errors(runs, prior), "held_out_after": out} if out else {}


# ---- engine profiles ------------------------------------------------------------------------------


def read_engine_profile(data: Any, field: str = "profile") -> tuple[str, EngineTuning]:
    """(engine, tuning) of an engine profile document (`berth calibrate --runs --out`)."""
    if not isinstance(data, dict) or data.get("format") != ENGINE_PROFILE_FORMAT:
        raise BerthError(field, str(data)[:80], f"not an engine profile (format {ENGINE_PROFILE_FORMAT})")
    if "tuning" not in data:
        raise BerthError(
            f"{field}.tuning", None, "missing: the fitted parameters (`berth calibrate --runs --out` writes them)"
        )
    try:
        tuning = EngineTuning.model_validate(data["tuning"])
    except ValidationError as err:
        raise from_validation_error(err, f"{field}.tuning") from None
    engine = data.get("engine")
    if not isinstance(engine, str):
        raise BerthError(f"{field}.engine", engine, "an engine name")
    return engine, tuning


def is_engine_profile(path: str) -> bool:
    """True when the file at `path` is an engine profile (not a `berth profile` device profile)."""
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, ValueError):
        return False
    return isinstance(data, dict) and data.get("format") == ENGINE_PROFILE_FORMAT
