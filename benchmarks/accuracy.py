"""Prediction accuracy on this machine: the number that says whether berth can be trusted.

    python -m benchmarks.accuracy [--runs 2] [--world 2] [--passes 2] [--quick]
    python -m benchmarks.accuracy --rescore benchmarks/results/accuracy-vm-measurements.json

Each run:
1. profiles this machine afresh (`berth profile`);
2. enumerates every feasible layout of a small model (tiny-gpt: 4 layers, hidden 256, sequence
   256, global batch 8) for the world size (2 by default; 4 on a 2-core machine is
   oversubscribed and said so in the results);
3. predicts each with the profile, runs each with the executor (gloo, one thread per rank) in
   `passes` launches with the layouts in a different order each time, and compares;
4. saves the measurements (accuracy-<machine>-measurements.json), then scores the raw
   profile-based predictions, and predictions calibrated on held-out data: 2-fold cross-validation
   (fit `berth.planner.calibrate` on one half of the layouts, score the other), so no layout is scored
   by a model fitted on it. `--rescore` repeats this step alone on saved measurements, for a
   changed cost model; the results then name the file they were scored from.

Prints a table and saves benchmarks/results/accuracy-<machine>.json (a rescore only prints,
unless --out names a file; the plot needs matplotlib, the `bench` extra) (fractions, not percents:
step_time_mape, step_time_max_error, memory_mape, memory_max_error, spearman, top1_regret, the
noise floor between passes, every case) and accuracy-<machine>.png (predicted vs measured).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from berth.executor.profile import run_profile
from berth.executor.validate import report_from_result
from berth.planner.calibrate import calibrate, predict
from berth.planner.search import predict_layouts, search
from berth.specs.hardware import DeviceProfile, ServerProfile
from berth.specs.models import load_model
from berth.specs.tree import Layout, Plan, SearchSpec, TrainingSpec, ValidationReport
from berth.topology.clusters import local_cluster

RESULTS = Path(__file__).parent / "results"
MODEL = "tiny-gpt"
SEQ_LEN, GLOBAL_BATCH = 256, 8
STEPS, WARMUP = 4, 2
PER_LAUNCH = 12  # layouts per torchrun launch (a launch costs seconds)


def enumerate_plans(world: int, profile: dict) -> list[Plan]:
    device = DeviceProfile.model_validate(profile["device"])
    server = ServerProfile.model_validate(profile["server"])
    cluster = local_cluster(world, (device, server))
    training = TrainingSpec(seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, precision="fp32")
    result = search(load_model(MODEL), training, cluster, SearchSpec(top=1000))
    return result.plans


def run_layouts(plans: list[Plan], say) -> list[dict]:
    """Run the plans (same world size) in launches of PER_LAUNCH; returns worker result entries
    in the plans' order, None where a launch failed."""
    world = plans[0].layout.world_size
    out: list[dict | None] = [None] * len(plans)
    for start in range(0, len(plans), PER_LAUNCH):
        chunk = plans[start : start + PER_LAUNCH]
        with tempfile.TemporaryDirectory() as tmp:
            (Path(tmp) / "plans.json").write_text(json.dumps([p.model_dump(mode="json") for p in chunk]))
            result = Path(tmp) / "out.json"
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={world}",
                "-m",
                "berth.executor.worker",
                "--plans",
                str(Path(tmp) / "plans.json"),
                "--steps",
                str(STEPS),
                "--warmup",
                str(WARMUP),
                "--out",
                str(result),
            ]
            env = {**os.environ, "BERTH_DEVICE": "cpu", "BERTH_THREADS_PER_RANK": "1"}
            r = subprocess.run(cmd, capture_output=True, text=True, timeout=1800, env=env)
            if result.is_file():
                data = json.loads(result.read_text())
                for i, entry in enumerate(data["results"]):
                    out[start + i] = {"entry": entry, "data": data}
            else:
                say(f"  launch of layouts {start}..{start + len(chunk) - 1} failed: {r.stderr[-300:]}")
        say(f"  ran {min(start + PER_LAUNCH, len(plans))}/{len(plans)} layouts")
    return out


def metrics(pred_t, meas_t, pred_m, meas_m) -> dict[str, float]:
    pred_t, meas_t, pred_m, meas_m = map(np.asarray, (pred_t, meas_t, pred_m, meas_m))
    et, em = np.abs(pred_t / meas_t - 1), np.abs(pred_m / meas_m - 1)
    best_pred = int(np.argmin(pred_t))
    return {
        "n": int(len(meas_t)),
        "step_time_mape": float(et.mean()),
        "step_time_max_error": float(et.max()),
        "memory_mape": float(em.mean()),
        "memory_max_error": float(em.max()),
        "spearman": float(spearmanr(pred_t, meas_t).statistic),
        "top1_regret": float(meas_t[best_pred] / meas_t.min() - 1),
    }


def local_plans(profile: dict, world: int, layouts: list[Layout]) -> list[Plan]:
    """The layouts predicted with the profile's device on `world` local processes."""
    device = DeviceProfile.model_validate(profile["device"])
    server = ServerProfile.model_validate(profile["server"])
    cluster = local_cluster(world, (device, server))
    training = TrainingSpec(seq_len=SEQ_LEN, global_batch_size=GLOBAL_BATCH, precision="fp32")
    return predict_layouts(load_model(MODEL), training, cluster, layouts)


def measure(world: int, passes: int, quick: bool, seed: int, say) -> dict:
    """Profile, enumerate and run: the measurements of one run (what is expensive), kept apart so
    that a changed cost model can be scored again on them (`--rescore`)."""
    say("profiling this machine")
    profile = run_profile(quick=quick)
    plans = enumerate_plans(world, profile)
    if quick:
        plans = random.Random(seed).sample(plans, min(len(plans), 12))
    say(f"{len(plans)} feasible layouts for {world} processes")
    per_pass = []
    for k in range(passes):
        order = list(range(len(plans)))
        random.Random(seed * 100 + k).shuffle(order)
        say(f"pass {k + 1}/{passes}")
        ran = run_layouts([plans[i] for i in order], say)
        results = [None] * len(plans)
        for pos, i in enumerate(order):
            if ran[pos] is not None:  # keep what report_from_result reads
                data = ran[pos]["data"]
                results[i] = {
                    "entry": ran[pos]["entry"],
                    "data": {"machine": data["machine"], "world_size": data["world_size"]},
                }
        per_pass.append(results)
    return {
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%S"),
        "profile": {"device": profile["device"], "server": profile["server"]},
        "world_size": world,
        "passes": passes,
        "layouts": [p.layout.model_dump(mode="json") for p in plans],
        "results": per_pass,
    }


def score(measured: dict) -> dict:
    """Predict every measured layout with the run's profile and the current cost model, and score
    it raw and calibrated (2-fold cross-validation)."""
    profile, world, passes = measured["profile"], measured["world_size"], measured["passes"]
    plans = local_plans(profile, world, [Layout.model_validate(x) for x in measured["layouts"]])
    per_pass = measured["results"]
    reports: list[ValidationReport] = []
    cases = []
    for i, plan in enumerate(plans):
        runs = [p[i] for p in per_pass if p[i] is not None]
        if not runs or plan.prediction is None:
            continue
        reps = [report_from_result(plan, r["entry"], r["data"], STEPS, WARMUP, 0.0) for r in runs]
        times = [r.measured.step_time_s for r in reps]
        mems = [r.measured.peak_memory_bytes for r in reps]
        rep = reps[0].model_copy(
            update={
                "measured": reps[0].measured.model_copy(
                    update={"step_time_s": float(np.mean(times)), "peak_memory_bytes": float(np.mean(mems))}
                )
            }
        )
        reports.append(rep)
        cases.append(
            {
                "layout": plan.layout.short(),
                "predicted_step_time_s": plan.prediction.step_time_s,
                "predicted_peak_memory_bytes": plan.prediction.peak_memory_bytes,
                "measured_step_time_s": float(np.mean(times)),
                "measured_step_time_per_pass_s": times,
                "measured_peak_memory_bytes": float(np.mean(mems)),
                "measured_peak_memory_per_pass": mems,
                "report_id": rep.id,
            }
        )
    pt = [c["predicted_step_time_s"] for c in cases]
    mt = [c["measured_step_time_s"] for c in cases]
    pm = [c["predicted_peak_memory_bytes"] for c in cases]
    mm = [c["measured_peak_memory_bytes"] for c in cases]
    raw = metrics(pt, mt, pm, mm)
    noise = {}
    if passes > 1:
        spreads = [
            abs(c["measured_step_time_per_pass_s"][0] / c["measured_step_time_per_pass_s"][1] - 1)
            for c in cases
            if len(c["measured_step_time_per_pass_s"]) > 1
        ]
        mspreads = [
            abs(c["measured_peak_memory_per_pass"][0] / c["measured_peak_memory_per_pass"][1] - 1)
            for c in cases
            if len(c["measured_peak_memory_per_pass"]) > 1
        ]
        noise = {
            "step_time_pass_to_pass_mean": float(np.mean(spreads)),
            "step_time_pass_to_pass_max": float(np.max(spreads)),
            "memory_pass_to_pass_mean": float(np.mean(mspreads)),
        }
    # 2-fold cross-validated calibration: every case scored by a fit that never saw it
    cal_t, cal_m = np.zeros(len(reports)), np.zeros(len(reports))
    folds = [[r for j, r in enumerate(reports) if j % 2 == f] for f in (0, 1)]
    fits = []
    for f in (0, 1):
        fit = calibrate(folds[f])
        fits.append({"fold": f, "values": fit.values, "errors": fit.errors})
        held = folds[1 - f]
        t, m = predict(held, fit.values)
        for r, ti, mi in zip(held, t, m, strict=True):
            j = reports.index(r)
            cal_t[j], cal_m[j] = ti, mi
    for c, ti, mi in zip(cases, cal_t, cal_m, strict=True):
        c["calibrated_step_time_s"], c["calibrated_peak_memory_bytes"] = float(ti), float(mi)
    calibrated = metrics(cal_t, mt, cal_m, mm)
    return {
        "measured_at": measured["measured_at"],
        "profile": profile,
        "world_size": world,
        "oversubscribed": world > (os.cpu_count() or 1),
        "layouts": len(plans),
        "measured_layouts": len(cases),
        "passes": passes,
        "uncalibrated": raw,
        "calibrated_cross_validated": calibrated,
        "noise_floor": noise,
        "calibration_folds": fits,
        "cases": cases,
    }


def scatter(runs: list[dict], path: Path) -> None:
    try:
        import matplotlib
    except ImportError:
        print(f"matplotlib is not installed (pip install -e '.[bench]'): no plot written to {path}")
        return

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 2, figsize=(11, 5))
    for k, run in enumerate(runs):
        cs = run["cases"]
        mt = [c["measured_step_time_s"] * 1e3 for c in cs]
        axes[0].scatter(mt, [c["predicted_step_time_s"] * 1e3 for c in cs], s=12, label=f"run {k + 1}: profile only")
        axes[0].scatter(
            mt,
            [c["calibrated_step_time_s"] * 1e3 for c in cs],
            s=12,
            marker="x",
            label=f"run {k + 1}: calibrated (held out)",
        )
        mm = [c["measured_peak_memory_bytes"] / 2**20 for c in cs]
        axes[1].scatter(mm, [c["predicted_peak_memory_bytes"] / 2**20 for c in cs], s=12, label=f"run {k + 1}")
    for ax, unit, title in ((axes[0], "ms", "step time"), (axes[1], "MiB", "peak memory per rank")):
        lo, hi = ax.get_xlim()
        ax.plot([lo, hi], [lo, hi], "k--", lw=0.8)
        ax.set_xlabel(f"measured ({unit})")
        ax.set_ylabel(f"predicted ({unit})")
        ax.set_title(title)
        ax.legend(fontsize=7)
    fig.suptitle(f"berth prediction accuracy: {MODEL}, seq {SEQ_LEN}, batch {GLOBAL_BATCH}, {platform.node()}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--runs", type=int, default=2, help="independent runs, each with a fresh profile")
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--passes", type=int, default=2, help="launches per layout per run (noise floor)")
    ap.add_argument("--quick", action="store_true", help="quick profile and 12 sampled layouts")
    ap.add_argument("--machine", default=platform.node().split(".")[0] or "local")
    ap.add_argument(
        "--rescore",
        metavar="MEASUREMENTS.json",
        help="score the current cost model on saved measurements instead of running again "
        "(prints the scores; writes them only with --out)",
    )
    ap.add_argument(
        "--out",
        metavar="RESULT.json",
        help="where to write the scores (and the .png beside); "
        f"default: {RESULTS}/accuracy-MACHINE.json, nothing with --rescore",
    )
    args = ap.parse_args()
    out = Path(args.out) if args.out else None
    if out is not None and not out.parent.is_dir():
        ap.error(f"--out {args.out}: directory {out.parent} does not exist")
    if args.rescore and not Path(args.rescore).is_file():
        ap.error(f"--rescore {args.rescore}: no such file")

    def say(msg: str) -> None:
        print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)

    RESULTS.mkdir(parents=True, exist_ok=True)
    stem = f"accuracy-{args.machine}" + ("-quick" if args.quick else "")
    if args.rescore:
        try:
            measured = json.loads(Path(args.rescore).read_text())["runs"]
        except (ValueError, KeyError, TypeError):
            ap.error(f'--rescore {args.rescore}: not a measurements file (JSON with "runs")')
        say(f"scoring the current cost model on {len(measured)} saved runs from {args.rescore}")
    else:
        measured = [measure(args.world, args.passes, args.quick, seed, say) for seed in range(args.runs)]
        (RESULTS / f"{stem}-measurements.json").write_text(json.dumps({"model": MODEL, "runs": measured}))
    runs = [score(m) for m in measured]
    keys = ("step_time_mape", "step_time_max_error", "memory_mape", "memory_max_error", "spearman", "top1_regret")
    summary = {
        f"run{k + 1}": {
            "uncalibrated": {x: r["uncalibrated"][x] for x in keys},
            "calibrated_cross_validated": {x: r["calibrated_cross_validated"][x] for x in keys},
            "noise_floor": r["noise_floor"],
        }
        for k, r in enumerate(runs)
    }
    doc = {
        **{k: runs[0]["calibrated_cross_validated"][k] for k in keys},
        "headline": "run 1, calibrated, held out",
        "summary": summary,
        "targets": {"step_time_mape": 0.10, "memory_mape": 0.05, "spearman": 0.9, "top1_regret": 0.05},
        "rescored_from": args.rescore,
        "model": MODEL,
        "seq_len": SEQ_LEN,
        "global_batch_size": GLOBAL_BATCH,
        "steps": STEPS,
        "warmup": WARMUP,
        "machine": {"hostname": platform.node(), "cpu_count": os.cpu_count(), "platform": platform.platform()},
        "runs": runs,
    }
    if out is None and not args.rescore:  # a fresh measurement is saved; a rescore only printed
        out = RESULTS / f"{stem}.json"
    if out is not None:
        out.write_text(json.dumps(doc, indent=1))
        scatter(runs, out.with_suffix(".png"))
    print(f"\n{'':36s}" + "".join(f"{k:>20s}" for k in keys))
    for name, s in summary.items():
        for kind in ("uncalibrated", "calibrated_cross_validated"):
            print(f"{name + ' ' + kind:36s}" + "".join(f"{s[kind][k]:>20.3f}" for k in keys))
        if s["noise_floor"]:
            print(
                f"{name + ' noise (pass to pass)':36s}{s['noise_floor']['step_time_pass_to_pass_mean']:>20.3f}"
                f"{'':>20s}{s['noise_floor']['memory_pass_to_pass_mean']:>20.3f}"
            )
    print(f"saved {out}" if out is not None else "not saved (give --out RESULT.json to keep the scores)")


if __name__ == "__main__":
    main()
