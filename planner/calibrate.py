"""Fit a few named efficiency parameters of the cost model to validation reports.

The parameters are the ones a profile cannot pin down in isolation, each applied to the cluster
spec the reports were planned for (so the fitted result is an ordinary profile):

    compute_scale               x the device's peak FLOP/s (all precisions)
    attention_peak_fraction     the attention core's fraction of peak
    kernel_overhead_s           dispatch cost per kernel
    tp_kernel_overhead_s        extra dispatch cost per kernel of a tensor-parallel layer
    memory_bandwidth_fraction   achieved fraction of memory bandwidth (elementwise, optimizer)
    comm_scale                  / the links' bandwidth (all collectives and p2p)
    comm_overlap_efficiency     the share of backward compute that hides data-parallel traffic
    framework_overhead_bytes    memory outside tensors the model accounts for, per rank
    allocator_fragmentation_fraction

Residuals are log(predicted / measured) of step time and of peak memory for every report whose
run succeeded: full runs (predicted as the plan) and rank-slice proxies (predicted as the proxy
is, `berth.cost_models.step.proxy_prediction`: one stage's compute and memory, no communication, no
memory outside the allocator). Full runs that measured their step terms (`breakdown`, executor/
breakdown.py) add one residual per measured term, log(predicted term / measured term), for each
term of at least TERM_FLOOR_SHARE of the step that is predicted: the compute scale is then fitted
from the measured compute, the communication parameters from the measured communication, the
memory bandwidth from the optimizer step, not all from one step total. The fit says which terms
each fitted parameter touched (`Fit.touched`: the terms whose prediction it moves, with how many
measured terms of each entered the fit). `scipy.optimize.least_squares` with bounds minimizes
them. Reports can be held out of the fit and scored after it.

Only what the reports determine is fitted (`identifiable`): each parameter needs reports of the
kind that exercises it (KINDS_NEEDED), its column of the Jacobian at the start must not be
(nearly) a combination of the columns already kept (IDENTIFIABLE_TOLERANCE), and the fit keeps at
least one residual per fitted parameter spare. The rest stay at the profile's values and the
answer says which reports would determine them. The uncertainty of each fitted value is its
standard error from the Jacobian at the solution (covariance s^2 (J^T J)^-1, s^2 the residual
variance) and a 95 % interval.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from berth.cost_models.breakdown import TERMS
from berth.cost_models.step import proxy_prediction
from berth.hardware_profiles import PROFILE_FORMAT
from berth.planner.search import predict_layouts
from berth.specs.errors import BerthError
from berth.specs.hardware import LinkProfile, ServerProfile
from berth.specs.tree import ClusterSpec, ValidationReport

MIB = 2**20
# name: (lower, upper, kind) -- "log": fitted as log(value), "lin": as value / unit
PARAMETERS: dict[str, tuple[float, float, str]] = {
    "compute_scale": (0.2, 5.0, "log"),
    "attention_peak_fraction": (0.01, 1.0, "log"),
    "kernel_overhead_s": (1e-7, 1e-3, "log"),
    "tp_kernel_overhead_s": (1e-8, 1e-2, "log"),
    "memory_bandwidth_fraction": (0.02, 1.0, "log"),
    "comm_scale": (0.1, 20.0, "log"),
    "comm_overlap_efficiency": (0.0, 1.0, "lin"),
    "framework_overhead_bytes": (0.0, 64.0 * 2**30, "mib"),
    "allocator_fragmentation_fraction": (0.0, 0.5, "lin"),
}


def current_values(cluster: ClusterSpec) -> dict[str, float]:
    d = cluster.device
    return {
        "compute_scale": 1.0,
        "attention_peak_fraction": d.attention_peak_fraction,
        "kernel_overhead_s": max(d.kernel_overhead_s, 1e-7),
        "tp_kernel_overhead_s": max(d.tp_kernel_overhead_s, 1e-8),
        "memory_bandwidth_fraction": d.memory_bandwidth_fraction,
        "comm_scale": 1.0,
        "comm_overlap_efficiency": cluster.comm_overlap_efficiency,
        "framework_overhead_bytes": d.framework_overhead_bytes,
        "allocator_fragmentation_fraction": d.allocator_fragmentation_fraction,
    }


def apply(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """The cluster spec with these parameter values."""
    d = cluster.device
    device = d.model_copy(
        update={
            "peak_flops_per_s": {k: v * values["compute_scale"] for k, v in d.peak_flops_per_s.items()},
            "attention_peak_fraction": values["attention_peak_fraction"],
            "kernel_overhead_s": values["kernel_overhead_s"],
            "tp_kernel_overhead_s": values["tp_kernel_overhead_s"],
            "memory_bandwidth_fraction": values["memory_bandwidth_fraction"],
            "framework_overhead_bytes": values["framework_overhead_bytes"],
            "allocator_fragmentation_fraction": values["allocator_fragmentation_fraction"],
        }
    )

    def link(lk) -> LinkProfile:
        return lk.model_copy(update={"bandwidth_bytes_per_s": lk.bandwidth_bytes_per_s / values["comm_scale"]})

    fabric = tuple(lv.model_copy(update={"link": link(lv.link)}) for lv in cluster.fabric)
    return cluster.model_copy(
        update={
            "device": device,
            "intra_node": link(cluster.intra_node),
            "inter_node": link(cluster.inter_node),
            "fabric": fabric,
            "comm_overlap_efficiency": values["comm_overlap_efficiency"],
        }
    )


def _encode(name: str, value: float) -> float:
    lo, hi, kind = PARAMETERS[name]
    value = min(max(value, lo), hi)
    return float(np.log(value)) if kind == "log" else value / MIB if kind == "mib" else value


def _decode(name: str, x: float) -> float:
    kind = PARAMETERS[name][2]
    return float(np.exp(x)) if kind == "log" else x * MIB if kind == "mib" else float(x)


def _bounds(names) -> tuple[np.ndarray, np.ndarray]:
    lo, hi = [], []
    for n in names:
        a, b, kind = PARAMETERS[n]
        lo.append(np.log(a) if kind == "log" else a / MIB if kind == "mib" else a)
        hi.append(np.log(b) if kind == "log" else b / MIB if kind == "mib" else b)
    return np.array(lo), np.array(hi)


def _start(initial: dict[str, float], names: tuple[str, ...], lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
    """The initial values in the fit's coordinates, INTERIOR of each range inside its bounds."""
    pad = INTERIOR * (hi - lo)
    return np.clip(np.array([_encode(n, initial[n]) for n in names]), lo + pad, hi - pad)


def usable(reports: list[ValidationReport]) -> list[ValidationReport]:
    """Successful full runs, and rank-slice proxies that say which stage and how many layers they ran."""

    def ok(r: ValidationReport) -> bool:
        if r.status != "ok" or not r.measured.step_time_s:
            return False
        return r.mode == "full" or bool(r.per_rank and {"stage", "layers"} <= set(r.per_rank[0]))

    return [r for r in reports if ok(r)]


def _cluster_of(report: ValidationReport, values: dict[str, float] | None) -> ClusterSpec:
    return report.plan.cluster if values is None else apply(report.plan.cluster, values)


def predict(reports: list[ValidationReport], values: dict[str, float] | None = None) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (step time, peak memory) of each report on its own cluster with these parameter
    `values` (None: as planned). Full runs of one model, training and cluster are scored in one
    vectorized call; a rank-slice proxy as the proxy ran (`proxy_prediction`)."""
    times, mems, _ = predict_with_terms(reports, values)
    return times, mems


def predict_with_terms(
    reports: list[ValidationReport], values: dict[str, float] | None = None
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """`predict`, and the predicted step terms (reports x TERMS; NaN for a rank-slice proxy)."""
    times, mems = np.zeros(len(reports)), np.zeros(len(reports))
    terms = np.full((len(reports), len(TERMS)), np.nan)
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        if r.mode == "rank-slice":
            rank = r.per_rank[0]
            plan = r.plan.model_copy(update={"cluster": _cluster_of(r, values)})
            pred = proxy_prediction(plan, int(rank["layers"]), rank["stage"] == 0)[0]
            times[i], mems[i] = pred.step_time_s or np.inf, pred.peak_memory_bytes or np.inf
            continue
        key = r.plan.model.model_dump_json() + r.plan.training.model_dump_json() + r.plan.cluster.model_dump_json()
        groups.setdefault(key, []).append(i)
    for idx in groups.values():
        first = reports[idx[0]]
        plans = predict_layouts(
            first.plan.model, first.plan.training, _cluster_of(first, values), [reports[i].plan.layout for i in idx]
        )
        for i, p in zip(idx, plans, strict=True):
            if p.prediction is None:  # structurally invalid now: a large, finite miss
                times[i], mems[i] = np.inf, np.inf
            else:
                times[i], mems[i] = p.prediction.step_time_s, p.prediction.peak_memory_bytes
                terms[i] = [p.prediction.time_breakdown_s.get(t, 0.0) for t in TERMS]
    return times, mems, terms


TERM_FLOOR_SHARE = 0.02  # a measured term under 2 % of its step is timing noise, not evidence for a parameter


def measured_terms(reports: list[ValidationReport], predicted: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(measured seconds per report and term, which of them enter the fit): a full run's measured
    term of at least TERM_FLOOR_SHARE of its step whose prediction is positive."""
    measured = np.full((len(reports), len(TERMS)), np.nan)
    for i, r in enumerate(reports):
        b = r.breakdown
        if r.mode != "full" or b is None:
            continue
        for j, t in enumerate(TERMS):
            row = b.terms.get(t)
            if row is not None and row.measured_s is not None and row.measured_s >= TERM_FLOOR_SHARE * b.step_time_s:
                measured[i, j] = row.measured_s
    with np.errstate(invalid="ignore"):
        use = np.isfinite(measured) & np.isfinite(predicted) & (predicted > 0)
    return measured, use


# what each parameter needs among the reports: a predicate on one report, and the words for it
KINDS_NEEDED: dict[str, tuple[str, Callable[[ValidationReport], bool]]] = {
    "compute_scale": ("reports with a step time (full or rank-slice)", lambda r: True),
    "attention_peak_fraction": (
        "reports with a step time at two or more sequence lengths or attention shares",
        lambda r: True,
    ),
    "kernel_overhead_s": ("reports with a step time at two or more micro-batch sizes or layer counts", lambda r: True),
    "tp_kernel_overhead_s": ("full runs with tp > 1", lambda r: r.mode == "full" and r.plan.layout.tp > 1),
    "memory_bandwidth_fraction": (
        "reports with a step time whose optimizer or elementwise share differs",
        lambda r: True,
    ),
    "comm_scale": (
        "full runs on 2 or more ranks (tp, dp or pp > 1)",
        lambda r: r.mode == "full" and r.plan.layout.world_size > 1,
    ),
    "comm_overlap_efficiency": ("full runs with dp > 1", lambda r: r.mode == "full" and r.plan.layout.dp > 1),
    "framework_overhead_bytes": (
        "full runs with a measured peak memory",
        lambda r: r.mode == "full" and bool(r.measured.peak_memory_bytes),
    ),
    "allocator_fragmentation_fraction": (
        "reports with a measured peak memory at two or more activation sizes",
        lambda r: bool(r.measured.peak_memory_bytes),
    ),
}
IDENTIFIABLE_TOLERANCE = 0.05  # a column less than 5 % independent of the kept ones: its standard error would be 20x
MIN_REPORTS_PER_KIND = 2  # a parameter needs two reports of its kind: one report fits anything exactly
REPORTS_PER_PARAMETER = 2  # fitted parameters of a quantity (time, memory) <= its reports / 2: a spare for each
MEMORY_PARAMETERS = ("framework_overhead_bytes", "allocator_fragmentation_fraction")
MAX_EVALUATIONS = 60  # Jacobian evaluations of the fit: a well-posed fit converges in 5-20
INTERIOR = 0.01  # the fit starts at least 1 % of each parameter's range inside its bounds
MOVED = 1e-3  # a fit whose fitted coordinates all moved less than this did not move
FIT_TOLERANCE = 1e-6  # relative change of cost or step at which the fit stops: far below report noise (~1 %)


def identifiable(
    reports: list[ValidationReport], jacobian: np.ndarray, names: tuple[str, ...], n_residuals: int
) -> tuple[list[str], dict[str, str]]:
    """(parameters the reports determine, {parameter: why not} for the others), in PARAMETERS
    order: a parameter is kept when at least MIN_REPORTS_PER_KIND reports are of the kind it needs,
    its (column-normalized) Jacobian column adds a direction the kept ones do not span (smallest
    singular value >= IDENTIFIABLE_TOLERANCE), and its quantity (step time or memory) has
    REPORTS_PER_PARAMETER reports for each parameter fitted to it."""
    keep: list[int] = []
    why: dict[str, str] = {}
    norms = np.linalg.norm(jacobian, axis=0)
    budget = {
        "time": sum(1 for r in reports if r.measured.step_time_s) // REPORTS_PER_PARAMETER,
        "memory": sum(1 for r in reports if r.measured.peak_memory_bytes) // REPORTS_PER_PARAMETER,
    }
    for j, name in enumerate(names):
        kind, pred = KINDS_NEEDED[name]
        count = sum(1 for r in reports if pred(r))
        if count < MIN_REPORTS_PER_KIND:
            why[name] = f"needs {MIN_REPORTS_PER_KIND}+ {kind} (has {count})"
            continue
        if not norms[j] > 1e-9:
            why[name] = f"the reports do not depend on it: needs {kind}"
            continue
        quantity = "memory" if name in MEMORY_PARAMETERS else "time"
        if budget[quantity] < 1 or len(keep) + 1 >= n_residuals:
            why[name] = (
                f"{REPORTS_PER_PARAMETER} more reports with a measured {quantity} needed for one more "
                f"{quantity} parameter"
            )
            continue
        cols = jacobian[:, keep + [j]] / norms[keep + [j]]
        if np.linalg.svd(cols, compute_uv=False)[-1] < IDENTIFIABLE_TOLERANCE:
            why[name] = f"not separable from {', '.join(names[k] for k in keep)} with these reports: needs {kind}"
            continue
        budget[quantity] -= 1
        keep.append(j)
    return [names[j] for j in keep], why


def jacobian(residuals, x: np.ndarray, lo: np.ndarray, hi: np.ndarray, step: float = 1e-3) -> np.ndarray:
    """Forward differences of the residuals at x (steps turned inward at a bound)."""
    r0 = residuals(x)
    jac = np.zeros((r0.size, x.size))
    for j in range(x.size):
        h = step * max(1.0, abs(x[j]))
        if x[j] + h > hi[j]:
            h = -h
        xj = x.copy()
        xj[j] += h
        jac[:, j] = (residuals(xj) - r0) / h
    return jac


def uncertainty(names: list[str], x: np.ndarray, jacobian: np.ndarray, residual: np.ndarray) -> dict[str, dict]:
    """Standard error and 95 % interval of each fitted value from the Jacobian at the solution:
    cov = s^2 (J^T J)^-1 with s^2 = |r|^2 / (residuals - parameters), in the fitted coordinates
    (log for the scale-like parameters: a multiplicative interval), mapped back to values."""
    dof = max(residual.size - len(names), 1)
    s2 = float(residual @ residual) / dof
    cov = s2 * np.linalg.pinv(jacobian.T @ jacobian)
    out = {}
    for j, name in enumerate(names):
        se = float(np.sqrt(max(cov[j, j], 0.0)))
        lo_b, hi_b = _bounds([name])
        a, b = max(x[j] - 1.96 * se, lo_b[0]), min(x[j] + 1.96 * se, hi_b[0])
        value = _decode(name, x[j])
        kind = PARAMETERS[name][2]
        value_se = value * se if kind == "log" else se * MIB if kind == "mib" else se
        out[name] = {
            "value": value,
            "standard_error": value_se,
            "ci95": [_decode(name, a), _decode(name, b)],
            "relative_standard_error": value_se / abs(value) if value else float("inf"),
        }
    return out


@dataclass
class Fit:
    values: dict[str, float]
    initial: dict[str, float]
    fit_ids: list[str]
    held_out_ids: list[str]
    cluster: ClusterSpec  # the calibrated cluster
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    fitted: list[str] = field(default_factory=list)
    not_fitted: dict[str, str] = field(default_factory=dict)  # parameter -> which reports would determine it
    uncertainty: dict[str, dict] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    # fitted parameter -> {term whose prediction it moves: measured terms of that kind in the fit}
    touched: dict[str, dict[str, int]] = field(default_factory=dict)
    term_residuals: dict[str, int] = field(default_factory=dict)  # term -> measured terms that entered the fit


def errors(reports: list[ValidationReport], values: dict[str, float] | None = None) -> dict[str, float]:
    """MAPE and worst |relative error| of step time and peak memory (fractions)."""
    if not reports:
        return {}
    t, m = predict(reports, values)
    mt = np.array([r.measured.step_time_s for r in reports])
    out = {
        "n": float(len(reports)),
        "step_time_mape": float(np.mean(np.abs(t / mt - 1))),
        "step_time_max_error": float(np.max(np.abs(t / mt - 1))),
    }
    mm = np.array([r.measured.peak_memory_bytes or np.nan for r in reports])
    ok = np.isfinite(mm)
    if ok.any():
        out["memory_mape"] = float(np.mean(np.abs(m[ok] / mm[ok] - 1)))
        out["memory_max_error"] = float(np.max(np.abs(m[ok] / mm[ok] - 1)))
    return out


def split(
    reports: list[ValidationReport], holdout: float, seed: int = 0
) -> tuple[list[ValidationReport], list[ValidationReport]]:
    """A deterministic split by report id hash: (fit, held out)."""

    def key(r) -> float:
        return int(hashlib.sha256(f"{seed}:{r.id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

    held = [r for r in reports if key(r) < holdout]
    return [r for r in reports if key(r) >= holdout], held


def report_kinds(reports: list[ValidationReport]) -> dict[str, int]:
    """How many reports of each kind: what determines which parameters."""
    full = [r for r in reports if r.mode == "full"]
    return {
        "full": len(full),
        "rank-slice": len(reports) - len(full),
        "full with tp > 1": sum(r.plan.layout.tp > 1 for r in full),
        "full with dp > 1": sum(r.plan.layout.dp > 1 for r in full),
        "full with pp > 1": sum(r.plan.layout.pp > 1 for r in full),
        "with recompute": sum(r.plan.layout.recompute != "none" for r in reports),
        "with peak memory": sum(bool(r.measured.peak_memory_bytes) for r in reports),
    }


def calibrate(
    reports: list[ValidationReport],
    holdout: float = 0.0,
    seed: int = 0,
    names: tuple[str, ...] | None = None,
    terms: bool = True,
) -> Fit:
    """Fit the parameters the reports determine. `names`: fit exactly these (refused, naming the
    reports needed, when the reports do not determine them all); None: every parameter the
    reports determine, the others kept at the profile's values. `terms`: also fit to the step
    terms full runs measured (False: to step totals and memory only)."""
    reports = usable(reports)
    if not reports:
        raise BerthError("reports", 0, "no successful validation reports (full or rank-slice) to fit")
    devices = {r.plan.cluster.device.name for r in reports}
    if len(devices) > 1:
        raise BerthError("reports", sorted(devices), "reports from several devices: calibrate one machine at a time")
    fit_set, held = split(reports, holdout, seed) if holdout > 0 else (reports, [])
    explicit = names is not None
    candidates = tuple(n for n in (names or PARAMETERS) if n in PARAMETERS)
    if names is not None and len(candidates) != len(names):
        unknown = sorted(set(names) - set(PARAMETERS))
        raise BerthError("params", ",".join(unknown), f"unknown parameter; known: {', '.join(PARAMETERS)}")
    if len(fit_set) < MIN_REPORTS_PER_KIND:
        needs = "; ".join(f"{n}: {MIN_REPORTS_PER_KIND}+ {KINDS_NEEDED[n][0]}" for n in candidates)
        raise BerthError(
            "reports",
            len(fit_set),
            f"{len(fit_set)} report(s) in the fit set cannot determine "
            f"{len(candidates)} parameters ({len(held)} held out); needs {needs}",
        )
    initial = current_values(reports[0].plan.cluster)
    mt = np.array([r.measured.step_time_s for r in fit_set])
    mm = np.array([r.measured.peak_memory_bytes or np.nan for r in fit_set])
    has_mem = np.isfinite(mm)
    planned_terms = predict_with_terms(fit_set)[2]
    term_measured, use = measured_terms(fit_set, planned_terms)
    if not terms:
        use[:] = False

    def make_residuals(chosen) -> tuple[Callable[[np.ndarray], np.ndarray], Callable[[np.ndarray], dict[str, float]]]:
        def values_of(x) -> dict[str, float]:
            v = dict(initial)
            v.update({n: _decode(n, xi) for n, xi in zip(chosen, x, strict=True)})
            return v

        def residuals(x) -> np.ndarray:
            t, m, pt = predict_with_terms(fit_set, values_of(x))
            rt = np.log(np.where(np.isfinite(t), t, 1e6) / mt)
            rm = np.log(np.where(np.isfinite(m[has_mem]), m[has_mem], 1e18) / mm[has_mem])
            p = pt[use]
            rterm = np.log(np.where(np.isfinite(p) & (p > 0), p, 1e-12) / term_measured[use])
            return np.concatenate([rt, rm, rterm])

        return residuals, values_of

    residuals, _ = make_residuals(candidates)
    lo, hi = _bounds(candidates)
    x0 = np.clip(
        np.array([_encode(n, initial[n]) for n in candidates]), lo + INTERIOR * (hi - lo), hi - INTERIOR * (hi - lo)
    )
    jac0 = jacobian(residuals, x0, lo, hi)
    chosen, not_fitted = identifiable(fit_set, jac0, candidates, jac0.shape[0])
    kinds = report_kinds(fit_set)
    if explicit and not_fitted:
        raise BerthError(
            "params",
            ",".join(not_fitted),
            "the reports do not determine: "
            + "; ".join(f"{n} {w}" for n, w in not_fitted.items())
            + f" (fit set: {kinds})",
        )
    if not chosen:
        raise BerthError(
            "reports",
            len(fit_set),
            "these reports determine none of the parameters: " + "; ".join(f"{n} {w}" for n, w in not_fitted.items()),
        )
    residuals, values_of = make_residuals(tuple(chosen))
    lo, hi = _bounds(chosen)
    # a start on a bound (an overhead of 0 bytes) stalls the trust-region solver's bound scaling at its first step:
    # the fit then "converges" where it began
    x0 = np.clip(
        np.array([_encode(n, initial[n]) for n in chosen]), lo + INTERIOR * (hi - lo), hi - INTERIOR * (hi - lo)
    )
    result = least_squares(
        residuals,
        x0,
        bounds=(lo, hi),
        diff_step=1e-3,
        x_scale="jac",
        max_nfev=MAX_EVALUATIONS,
        ftol=FIT_TOLERANCE,
        xtol=FIT_TOLERANCE,
        gtol=FIT_TOLERANCE,
    )
    if np.max(np.abs(result.x - x0)) < MOVED:
        raise BerthError(
            "reports",
            len(fit_set),
            f"the fit of {', '.join(chosen)} did not move from the profile's values (the profile is kept): these "
            "reports agree with it, or are too few to move it",
        )
    values = values_of(result.x)
    fitted = apply(reports[0].plan.cluster, values)
    used = {t: int(n) for t, n in zip(TERMS, use.sum(axis=0), strict=True) if n}
    fit = Fit(
        values=values,
        initial=initial,
        fit_ids=[r.id for r in fit_set],
        held_out_ids=[r.id for r in held],
        cluster=fitted,
        fitted=list(chosen),
        not_fitted=not_fitted,
        kinds=kinds,
        uncertainty=uncertainty(list(chosen), result.x, result.jac, result.fun),
        touched=touched_terms(fit_set, initial, list(chosen), used),
        term_residuals=used,
    )
    fit.errors = {"fit_before": errors(fit_set), "fit_after": errors(fit_set, values)}
    if held:
        fit.errors.update({"held_out_before": errors(held), "held_out_after": errors(held, values)})
    return fit


TOUCH_TOLERANCE = 1e-6  # a relative change of a predicted term below this is no touch


def touched_terms(
    reports: list[ValidationReport], initial: dict[str, float], names: list[str], used: dict[str, int]
) -> dict[str, dict[str, int]]:
    """For each parameter, the step terms whose prediction it moves on these reports (a 10 %
    change of the parameter, in its fitted coordinate, from the initial values), each with the
    number of measured terms of that kind that entered the fit (0: moved, but only the step total
    constrained it)."""
    out: dict[str, dict[str, int]] = {}
    base = np.nan_to_num(predict_with_terms(reports, initial)[2])
    for name in names:
        lo, hi = _bounds([name])
        x = _encode(name, initial[name])
        step = 0.1 * max(1.0, abs(x))
        x = x + step if x + step <= hi[0] else x - step
        moved = np.nan_to_num(predict_with_terms(reports, {**initial, name: _decode(name, x)})[2])
        change = np.abs(moved - base) / np.maximum(np.abs(base), 1e-30)
        out[name] = {
            t: used.get(t, 0)
            for j, t in enumerate(TERMS)
            if np.any((change[:, j] > TOUCH_TOLERANCE) & (np.maximum(base[:, j], moved[:, j]) > 0))
        }
    return out


def profile_document(fit: Fit, source: str) -> dict:
    """A `berth profile`-format document of the calibrated device and links."""
    c = fit.cluster
    name = f"{c.device.name}-calibrated"
    server = ServerProfile(
        name="calibrated",
        display_name=f"{c.name}, calibrated",
        device=name,
        gpus_per_node=c.gpus_per_node,
        intra_node=c.intra_node,
        inter_node=c.inter_node,
        collective_base_latency_s=c.collective_base_latency_s,
        comm_overlap_efficiency=c.comm_overlap_efficiency,
        sources={"calibration": f"{len(fit.fit_ids)} validation reports ({source}), berth calibrate"},
    )
    device = c.device.model_copy(
        update={
            "name": name,
            "sources": {
                **c.device.sources,
                "calibration": f"fitted by berth calibrate: {fit.fitted}; kept at the profile: "
                f"{sorted(fit.not_fitted)}",
            },
        }
    )
    return {
        "format": PROFILE_FORMAT,
        "device": device.model_dump(mode="json"),
        "server": server.model_dump(mode="json"),
        "calibration": {
            "values": fit.values,
            "initial": fit.initial,
            "errors": fit.errors,
            "fitted": fit.fitted,
            "not_fitted": fit.not_fitted,
            "uncertainty": fit.uncertainty,
            "report_kinds": fit.kinds,
            "fit_ids": fit.fit_ids,
            "held_out_ids": fit.held_out_ids,
            "touched_terms": fit.touched,
            "term_residuals": fit.term_residuals,
        },
    }
