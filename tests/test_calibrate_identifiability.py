"""`berth calibrate` fits only what its reports determine, says what else it needs, reports the
uncertainty of what it fits, takes rank-slice proxy reports (compute only), and reads a real
SQLite results store (refusing a missing or foreign file without creating anything)."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from berth.executor.validate import proxy_prediction
from berth.planner.calibrate import PARAMETERS, apply, calibrate, current_values
from berth.planner.planning import make_cluster
from berth.planner.search import predict_layouts
from berth.planner.store import Store
from berth.specs.errors import BerthError
from berth.specs.models import presets
from berth.specs.tree import Layout, Metrics, TrainingSpec, ValidationReport

BERTH = [sys.executable, "-m", "berth.cli.main"]


def _report(i, plan, t, m, mode="full", per_rank=None):
    return ValidationReport(
        id=f"r{i:03d}",
        created=f"2026-01-01T00:00:{i:02d}",
        berth_version="test",
        status="ok",
        plan=plan,
        steps=3,
        warmup=1,
        predicted=Metrics(),
        mode=mode,
        per_rank=per_rank or [],
        measured=Metrics(step_time_s=t, peak_memory_bytes=m),
    )


def full_reports(truth, layouts, noise=0.0, seed=0):
    model = presets()["tiny-gpt"]
    training = TrainingSpec(seq_len=256, global_batch_size=8, precision="fp32")
    base = make_cluster("local", 1, 2)
    planned = predict_layouts(model, training, base, layouts)
    true = predict_layouts(model, training, apply(base, truth), layouts)
    rng = np.random.default_rng(seed)
    out = []
    for i, (p, t) in enumerate(zip(planned, true, strict=True)):
        e = 1 + noise * rng.standard_normal(2)
        out.append(_report(i, p, t.prediction.step_time_s * e[0], t.prediction.peak_memory_bytes * e[1]))
    return out, base


DP_LAYOUTS = [
    Layout(dp=2, zero_stage=z, shard=2 if z else 1, micro_batch_size=m, num_microbatches=4 // m, recompute=r)
    for z in (0, 1, 3)
    for m in (1, 2, 4)
    for r in ("none", "full")
]


def test_one_report_cannot_determine_nine_parameters():
    base = make_cluster("local", 1, 2)
    reports, _ = full_reports(current_values(base), DP_LAYOUTS[:1])
    with pytest.raises(BerthError) as err:
        calibrate(reports)
    text = str(err.value)
    assert "1 report" in text and "9 parameters" in text and "tp > 1" in text and "dp > 1" in text
    with pytest.raises(BerthError, match="unknown parameter"):
        calibrate(reports * 2, names=("compute_scale", "warp_speed"))
    # three reports: one step-time parameter and one memory parameter, each with a spare report
    three, _ = full_reports({**current_values(base), "compute_scale": 0.7}, DP_LAYOUTS[::6][:3], noise=0.01)
    fit = calibrate(three)
    assert fit.fitted[0] == "compute_scale" and len(fit.fitted) <= 2
    assert sum(n in ("framework_overhead_bytes", "allocator_fragmentation_fraction") for n in fit.fitted) <= 1
    assert "more reports with a measured time" in fit.not_fitted["kernel_overhead_s"]


def test_fits_only_what_data_parallel_reports_determine_with_uncertainty():
    base = make_cluster("local", 1, 2)
    truth = {**current_values(base), "compute_scale": 0.6, "comm_scale": 3.0, "framework_overhead_bytes": 20 * 2**20}
    reports, _ = full_reports(truth, DP_LAYOUTS, noise=0.01, seed=2)
    fit = calibrate(reports)
    assert "tp_kernel_overhead_s" not in fit.fitted and "tp > 1" in fit.not_fitted["tp_kernel_overhead_s"]
    assert fit.values["tp_kernel_overhead_s"] == fit.initial["tp_kernel_overhead_s"]  # kept, not invented
    assert {"compute_scale", "comm_scale", "framework_overhead_bytes"} <= set(fit.fitted)
    for name in fit.fitted:
        u = fit.uncertainty[name]
        assert u["standard_error"] > 0 and u["ci95"][0] <= u["value"] <= u["ci95"][1], name
    for name in ("compute_scale", "comm_scale"):
        lo, hi = fit.uncertainty[name]["ci95"]
        assert lo <= truth[name] <= hi, (name, lo, hi)
    assert fit.values["compute_scale"] == pytest.approx(0.6, rel=0.05)
    assert fit.errors["fit_after"]["step_time_mape"] < 0.03
    # asking for a parameter these reports cannot determine is refused, naming what is needed
    with pytest.raises(BerthError, match="tp_kernel_overhead_s.*tp > 1"):
        calibrate(reports, names=("compute_scale", "tp_kernel_overhead_s"))


def test_uncertainty_shrinks_with_more_reports():
    base = make_cluster("local", 1, 2)
    truth = {**current_values(base), "compute_scale": 0.7}
    few, _ = full_reports(truth, DP_LAYOUTS[:4], noise=0.03, seed=3)
    many, _ = full_reports(truth, DP_LAYOUTS, noise=0.03, seed=3)
    se_few = calibrate(few, names=("compute_scale",)).uncertainty["compute_scale"]["standard_error"]
    se_many = calibrate(many, names=("compute_scale",)).uncertainty["compute_scale"]["standard_error"]
    assert se_many < se_few


def rank_slice_reports(truth, noise=0.0, seed=0):
    """Proxies of llama3-8b layouts planned for DGX H100, 'measured' as the proxy model predicts
    them with `truth` (compute only: communication parameters do not enter)."""
    model = presets()["llama3-8b"]
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    cluster = make_cluster("dgx-h100", 2)
    layouts = [
        Layout(
            tp=tp,
            pp=pp,
            dp=16 // (tp * pp),
            micro_batch_size=m,
            num_microbatches=64 // (16 // (tp * pp)) // m,
            recompute=r,
        )
        for tp in (2, 4, 8)
        for pp in (1, 2)
        for m in (1, 2)
        for r in ("none", "full")
    ]
    plans = predict_layouts(model, training, cluster, layouts)
    rng = np.random.default_rng(seed)
    out = []
    for i, p in enumerate(plans):
        if p.prediction is None:
            continue
        layers = 2
        true = proxy_prediction(p.model_copy(update={"cluster": apply(cluster, truth)}), layers, True)[0]
        e = 1 + noise * rng.standard_normal(2)
        out.append(
            _report(
                i,
                p,
                true.step_time_s * e[0],
                true.peak_memory_bytes * e[1],
                mode="rank-slice",
                per_rank=[{"rank": 0, "stage": 0, "layers": layers}],
            )
        )
    return out, cluster


def test_rank_slice_reports_constrain_compute_not_communication():
    cluster = make_cluster("dgx-h100", 2)
    truth = {**current_values(cluster), "compute_scale": 0.55, "allocator_fragmentation_fraction": 0.12}
    reports, _ = rank_slice_reports(truth, noise=0.005, seed=4)
    assert len(reports) >= 12
    fit = calibrate(reports)
    assert fit.kinds["rank-slice"] == len(reports) and fit.kinds["full"] == 0
    assert "compute_scale" in fit.fitted and fit.values["compute_scale"] == pytest.approx(0.55, rel=0.05)
    for name in ("comm_scale", "comm_overlap_efficiency", "tp_kernel_overhead_s", "framework_overhead_bytes"):
        assert name not in fit.fitted and name in fit.not_fitted, name
    # compute_scale scales the GEMM and attention work, not the framework's dispatch: 0.55 moves the step by ~25 %
    assert fit.errors["fit_before"]["step_time_mape"] > 0.15 and fit.errors["fit_after"]["step_time_mape"] < 0.02


def test_cli_reads_a_real_store_and_refuses_bad_stores(tmp_path):
    base = make_cluster("local", 1, 2)
    reports, _ = full_reports({**current_values(base), "compute_scale": 0.8}, DP_LAYOUTS, noise=0.01, seed=5)
    store_path = tmp_path / "results.sqlite"
    store = Store(store_path)
    for r in reports:
        store.add_validation(r)
    store.close()
    out = tmp_path / "calibrated.json"
    r = subprocess.run(
        [*BERTH, "calibrate", "--store", str(store_path), "--holdout", "0", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "COLUMNS": "80"},
    )
    assert r.returncode == 0, r.stderr
    assert "± s.e." in r.stdout and "not fitted:" in r.stdout
    assert "…" not in r.stdout  # every name and number whole at 80 columns (the GPU run's table cut them)
    doc = json.loads(out.read_text())["calibration"]
    assert set(doc["fitted"]) | set(doc["not_fitted"]) == set(PARAMETERS)
    assert doc["uncertainty"]["compute_scale"]["standard_error"] > 0 and doc["report_kinds"]["full"] > 0

    one = tmp_path / "one.json"
    one.write_text(reports[0].model_dump_json())
    r = subprocess.run([*BERTH, "calibrate", str(one)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1 and "9 parameters" in r.stderr, r.stderr

    text_file = tmp_path / "notes.txt"
    text_file.write_text("not a database")
    missing = tmp_path / "missing.sqlite"
    for bad in (text_file, missing):
        r = subprocess.run([*BERTH, "calibrate", "--store", str(bad)], capture_output=True, text=True, timeout=120)
        assert r.returncode == 2 and "Traceback" not in r.stderr, r.stderr
        assert len(r.stderr.strip().splitlines()) == 1 and "store" in r.stderr
    assert not missing.exists()


def _with_terms(reports_and_truth, noise=0.01, seed=0):
    """Full-run reports whose breakdown measured every step term at its true value (with noise)."""
    from berth.specs.tree import MeasuredBreakdown

    rng = np.random.default_rng(seed)
    out = []
    for i, (p, t) in enumerate(reports_and_truth):
        terms = {k: v * (1 + noise * rng.standard_normal()) for k, v in t.prediction.time_breakdown_s.items()}
        step = sum(terms.values())
        bd = MeasuredBreakdown(
            rank=0,
            method="synthetic",
            step_time_s=step,
            unattributed_s=0.0,
            terms={
                k: {"predicted_s": p.prediction.time_breakdown_s[k], "measured_s": v if v > 0 else None}
                for k, v in terms.items()
            },
        )
        out.append(_report(i, p, step, t.prediction.peak_memory_bytes).model_copy(update={"breakdown": bd}))
    return out


def test_measured_terms_separate_compute_from_communication():
    """Four runs of one ZeRO-3 layout: their step totals cannot tell a slower compute from slower
    links (the two columns of the Jacobian are parallel), their measured compute and dp_comm
    terms can; the fit says which terms each parameter touched."""
    model = presets()["tiny-gpt"]
    training = TrainingSpec(seq_len=256, global_batch_size=8, precision="fp32")
    base = make_cluster("local", 1, 2)
    truth = {**current_values(base), "compute_scale": 0.6, "comm_scale": 3.0}
    layouts = [Layout(dp=2, zero_stage=3, shard=2, micro_batch_size=2, num_microbatches=2)] * 4
    planned = predict_layouts(model, training, base, layouts)
    reports = _with_terms(zip(planned, predict_layouts(model, training, apply(base, truth), layouts), strict=True))
    names = ("compute_scale", "comm_scale")
    with pytest.raises(BerthError, match="comm_scale not separable from compute_scale"):
        calibrate(reports, names=names, terms=False)
    fit = calibrate(reports, names=names)
    assert fit.values["compute_scale"] == pytest.approx(0.6, rel=0.03)
    assert fit.values["comm_scale"] == pytest.approx(3.0, rel=0.03)
    assert fit.term_residuals["compute"] == 4 and fit.term_residuals["dp_comm"] == 4
    assert fit.touched["compute_scale"]["compute"] == 4
    assert fit.touched["comm_scale"] == {"dp_comm": 4}
    # the refusal rules are the same with terms: two reports determine one time parameter
    with pytest.raises(BerthError, match="more reports with a measured time"):
        calibrate(reports[:2], names=names)
