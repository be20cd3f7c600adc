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
run succeeded (full runs, not rank-slice proxies); `scipy.optimize.least_squares` with bounds
minimizes them. Reports can be held out of the fit and scored after it.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import numpy as np
from scipy.optimize import least_squares

from hardware_profiles.schema import ServerProfile
from planner.errors import BerthError
from planner.search import predict_layouts
from planner.specs import ClusterSpec, ValidationReport

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
    return {"compute_scale": 1.0, "attention_peak_fraction": d.attention_peak_fraction,
            "kernel_overhead_s": max(d.kernel_overhead_s, 1e-7),
            "tp_kernel_overhead_s": max(d.tp_kernel_overhead_s, 1e-8),
            "memory_bandwidth_fraction": d.memory_bandwidth_fraction,
            "comm_scale": 1.0, "comm_overlap_efficiency": cluster.comm_overlap_efficiency,
            "framework_overhead_bytes": d.framework_overhead_bytes,
            "allocator_fragmentation_fraction": d.allocator_fragmentation_fraction}


def apply(cluster: ClusterSpec, values: dict[str, float]) -> ClusterSpec:
    """The cluster spec with these parameter values."""
    d = cluster.device
    device = d.model_copy(update={
        "peak_flops_per_s": {k: v * values["compute_scale"] for k, v in d.peak_flops_per_s.items()},
        "attention_peak_fraction": values["attention_peak_fraction"],
        "kernel_overhead_s": values["kernel_overhead_s"],
        "tp_kernel_overhead_s": values["tp_kernel_overhead_s"],
        "memory_bandwidth_fraction": values["memory_bandwidth_fraction"],
        "framework_overhead_bytes": values["framework_overhead_bytes"],
        "allocator_fragmentation_fraction": values["allocator_fragmentation_fraction"],
    })

    def link(lk):
        return lk.model_copy(update={"bandwidth_bytes_per_s": lk.bandwidth_bytes_per_s / values["comm_scale"]})

    fabric = tuple(lv.model_copy(update={"link": link(lv.link)}) for lv in cluster.fabric)
    return cluster.model_copy(update={"device": device, "intra_node": link(cluster.intra_node),
                                      "inter_node": link(cluster.inter_node), "fabric": fabric,
                                      "comm_overlap_efficiency": values["comm_overlap_efficiency"]})


def _encode(name: str, value: float) -> float:
    lo, hi, kind = PARAMETERS[name]
    value = min(max(value, lo), hi)
    return float(np.log(value)) if kind == "log" else value / MIB if kind == "mib" else value


def _decode(name: str, x: float) -> float:
    kind = PARAMETERS[name][2]
    return float(np.exp(x)) if kind == "log" else x * MIB if kind == "mib" else float(x)


def _bounds(names):
    lo, hi = [], []
    for n in names:
        a, b, kind = PARAMETERS[n]
        lo.append(np.log(a) if kind == "log" else a / MIB if kind == "mib" else a)
        hi.append(np.log(b) if kind == "log" else b / MIB if kind == "mib" else b)
    return np.array(lo), np.array(hi)


def usable(reports: list[ValidationReport]) -> list[ValidationReport]:
    return [r for r in reports if r.status == "ok" and r.mode == "full" and r.measured.step_time_s]


def predict(reports: list[ValidationReport], cluster: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
    """Predicted (step time, peak memory) of each report's layout on `cluster`; the reports of
    one model and training are scored in one vectorized call."""
    times, mems = np.zeros(len(reports)), np.zeros(len(reports))
    groups: dict[str, list[int]] = {}
    for i, r in enumerate(reports):
        groups.setdefault(r.plan.model.model_dump_json() + r.plan.training.model_dump_json(), []).append(i)
    for idx in groups.values():
        first = reports[idx[0]].plan
        plans = predict_layouts(first.model, first.training, cluster, [reports[i].plan.layout for i in idx])
        for i, p in zip(idx, plans, strict=True):
            if p.prediction is None:  # structurally invalid now: a large, finite miss
                times[i], mems[i] = np.inf, np.inf
            else:
                times[i], mems[i] = p.prediction.step_time_s, p.prediction.peak_memory_bytes
    return times, mems


@dataclass
class Fit:
    values: dict[str, float]
    initial: dict[str, float]
    fit_ids: list[str]
    held_out_ids: list[str]
    errors: dict[str, dict[str, float]] = field(default_factory=dict)
    cluster: ClusterSpec | None = None


def errors(reports: list[ValidationReport], cluster: ClusterSpec) -> dict[str, float]:
    """MAPE and worst |relative error| of step time and peak memory (fractions)."""
    if not reports:
        return {}
    t, m = predict(reports, cluster)
    mt = np.array([r.measured.step_time_s for r in reports])
    out = {"n": float(len(reports)), "step_time_mape": float(np.mean(np.abs(t / mt - 1))),
           "step_time_max_error": float(np.max(np.abs(t / mt - 1)))}
    mm = np.array([r.measured.peak_memory_bytes or np.nan for r in reports])
    ok = np.isfinite(mm)
    if ok.any():
        out["memory_mape"] = float(np.mean(np.abs(m[ok] / mm[ok] - 1)))
        out["memory_max_error"] = float(np.max(np.abs(m[ok] / mm[ok] - 1)))
    return out


def split(reports: list[ValidationReport], holdout: float, seed: int = 0):
    """A deterministic split by report id hash: (fit, held out)."""
    def key(r):
        return int(hashlib.sha256(f"{seed}:{r.id}".encode()).hexdigest()[:8], 16) / 0xFFFFFFFF

    held = [r for r in reports if key(r) < holdout]
    return [r for r in reports if key(r) >= holdout], held


def calibrate(reports: list[ValidationReport], holdout: float = 0.0, seed: int = 0,
              names: tuple[str, ...] = tuple(PARAMETERS)) -> Fit:
    reports = usable(reports)
    if not reports:
        raise BerthError("reports", 0, "no successful full validation reports to fit")
    devices = {r.plan.cluster.device.name for r in reports}
    if len(devices) > 1:
        raise BerthError("reports", sorted(devices), "reports from several devices: calibrate one machine at a time")
    fit_set, held = split(reports, holdout, seed) if holdout > 0 else (reports, [])
    if len(fit_set) < 2:
        raise BerthError("reports", len(fit_set), "need at least 2 reports in the fit set")
    base = reports[0].plan.cluster
    initial = current_values(base)
    names = tuple(n for n in names if n in PARAMETERS)
    mt = np.array([r.measured.step_time_s for r in fit_set])
    mm = np.array([r.measured.peak_memory_bytes or np.nan for r in fit_set])
    has_mem = np.isfinite(mm)

    def values_of(x):
        v = dict(initial)
        v.update({n: _decode(n, xi) for n, xi in zip(names, x, strict=True)})
        return v

    def residuals(x):
        t, m = predict(fit_set, apply(base, values_of(x)))
        rt = np.log(np.where(np.isfinite(t), t, 1e6) / mt)
        rm = np.log(np.where(np.isfinite(m[has_mem]), m[has_mem], 1e18) / mm[has_mem])
        return np.concatenate([rt, rm])

    x0 = np.array([_encode(n, initial[n]) for n in names])
    lo, hi = _bounds(names)
    x0 = np.clip(x0, lo + 1e-9, hi - 1e-9)
    result = least_squares(residuals, x0, bounds=(lo, hi), diff_step=1e-3, max_nfev=200)
    values = values_of(result.x)
    fitted = apply(base, values)
    fit = Fit(values=values, initial=initial, fit_ids=[r.id for r in fit_set], held_out_ids=[r.id for r in held],
              cluster=fitted)
    fit.errors = {"fit_before": errors(fit_set, base), "fit_after": errors(fit_set, fitted)}
    if held:
        fit.errors.update({"held_out_before": errors(held, base), "held_out_after": errors(held, fitted)})
    return fit


def profile_document(fit: Fit, source: str) -> dict:
    """A `berth profile`-format document of the calibrated device and links."""
    c = fit.cluster
    name = f"{c.device.name}-calibrated"
    server = ServerProfile(
        name="calibrated", display_name=f"{c.name}, calibrated", device=name, gpus_per_node=c.gpus_per_node,
        intra_node=c.intra_node, inter_node=c.inter_node, collective_base_latency_s=c.collective_base_latency_s,
        comm_overlap_efficiency=c.comm_overlap_efficiency,
        sources={"calibration": f"{len(fit.fit_ids)} validation reports ({source}), berth calibrate"})
    device = c.device.model_copy(update={"name": name, "sources": {
        **c.device.sources, "calibration": f"parameters fitted by berth calibrate: {sorted(fit.values)}"}})
    return {"format": "berth-profile/1", "device": device.model_dump(mode="json"),
            "server": server.model_dump(mode="json"),
            "calibration": {"values": fit.values, "initial": fit.initial, "errors": fit.errors,
                            "fit_ids": fit.fit_ids, "held_out_ids": fit.held_out_ids}}
