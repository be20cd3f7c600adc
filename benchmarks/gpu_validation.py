"""The evidence run for one GPU: profile, plan, validate, calibrate, re-predict.

    python -m benchmarks.gpu_validation                # on a machine with one (or more) NVIDIA GPU
    python -m benchmarks.gpu_validation --cpu-smoke --out-dir /tmp/smoke   # the same sequence on CPU

Steps, each a `berth` command run as a user runs it (its output kept under the results folder):
1. `berth profile` -> profile.json (GEMMs at layer shapes with CUDA events, attention, bandwidth, NCCL);
2. for each single-GPU example (EXAMPLES: Llama 3.2 1B and 3B, GPT-2 XL at seq 4096, global batch 16):
   `berth plan EXAMPLE --cluster local --profile profile.json --json` -> plans-EXAMPLE.json, then
   `berth validate plans-EXAMPLE.json --pick i` for the top `--top` plans (5) -> report-EXAMPLE-i.json;
3. two rank-slice proxies (PROXIES: a llama3-8b layout for one DGX H100 and a llama3-70b layout for
   8 DGX H100): `berth plan ... --profile profile.json` then `berth validate --proxy rank-slice --layers N`;
4. `berth calibrate --store results.sqlite --out calibrated.json` (fits what the reports determine,
   prints before/after errors on fitted and held-out reports and each value's uncertainty);
5. re-predict: `berth compare EXAMPLE --cluster local --profile calibrated.json --layout ...` for the
   validated layouts, and print each run's step-time and memory error before and after.
Everything lands in benchmarks/results/gpu-<device>/ (or --out-dir); summary.json holds the table.
Exit code 0 when every command ran and no top-ranked plan ran out of memory; 1 otherwise (the
summary says which).

`--cpu-smoke` runs the same commands and flags on CPU worker processes (tiny-gpt, `--cluster local
--devices-per-node 2`, a quick profile, fewer steps; the proxies are tiny-gpt layouts planned for 8
workers): what CI runs (tests/test_gpu_validation_script.py) so that no command or flag of the GPU
run goes unexercised.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
MODELS = ROOT / "examples" / "models"
# (name, model, seq, global batch): single-GPU examples whose states fit one 80 GB GPU
EXAMPLES = [
    ("llama-3.2-1b", str(MODELS / "llama-3.2-1b.json"), 4096, 16),
    ("gpt2-xl", str(MODELS / "gpt2-xl.json"), 4096, 16),
    ("llama-3.2-3b", str(MODELS / "llama-3.2-3b.json"), 4096, 16),
]
# (name, model, cluster args, seq, global batch, layers to run of one stage)
PROXIES = [
    ("llama3-8b-dgx-h100", "llama3-8b", ["--cluster", "dgx-h100", "--nodes", "1"], 8192, 64, 4),
    ("llama3-70b-8x-dgx-h100", "llama3-70b", ["--cluster", "dgx-h100", "--nodes", "8", "--fix", "tp=8"], 8192, 256, 2),
]  # a tp=8 slice beside the 8B's full-width layers: two kinds of compute shapes
CPU_EXAMPLES = [("tiny-gpt", "tiny-gpt", 128, 8)]
CPU_PROXIES = [
    (
        "tiny-gpt-8-workers",
        "tiny-gpt",
        ["--cluster", "local", "--devices-per-node", "8", "--fix", "tp=2,pp=2"],
        128,
        16,
        1,
    )
]
STEPS, WARMUP = 10, 3  # timed and untimed steps of each GPU validation
CPU_STEPS, CPU_WARMUP = 2, 1
HOLDOUT_MIN_REPORTS = 10  # with fewer successful runs every report is fitted (nothing held out)


def device_slug() -> str:
    from berth.hardware_profiles import UnknownProfileError, nvidia_smi_device
    from berth.topology.clusters import local_gpus

    gpus = local_gpus()
    if not gpus:
        return "cpu"
    try:
        return nvidia_smi_device(gpus[0][0])[0]
    except UnknownProfileError:
        return re.sub(r"[^a-z0-9]+", "-", gpus[0][0].lower()).strip("-")


class Runner:
    def __init__(self, out: Path, env: dict[str, str]):
        self.out, self.env, self.log = out, env, []

    def berth(self, name: str, *args: str, ok_codes=(0,)) -> subprocess.CompletedProcess:
        """Run one berth command; its stdout/stderr go to NAME.out / NAME.err."""
        cmd = [sys.executable, "-m", "berth.cli.main", *args]
        t0 = time.perf_counter()
        r = subprocess.run(cmd, capture_output=True, text=True, env=self.env, cwd=ROOT)
        took = time.perf_counter() - t0
        (self.out / f"{name}.out").write_text(r.stdout)
        (self.out / f"{name}.err").write_text(r.stderr)
        self.log.append({"step": name, "command": ["berth", *args], "exit_code": r.returncode, "seconds": took})
        print(f"[{took:6.1f} s] berth {' '.join(args)}  -> exit {r.returncode}", flush=True)
        if r.returncode not in ok_codes:
            raise SystemExit(f"gpu_validation: `berth {' '.join(args)}` exited {r.returncode}:\n{r.stderr[-2000:]}")
        return r


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cpu-smoke", action="store_true", help="the same sequence on CPU workers (tiny-gpt)")
    ap.add_argument("--out-dir", help="results folder (default benchmarks/results/gpu-<device>)")
    ap.add_argument("--top", type=int, default=5, help="plans of each example to validate")
    args = ap.parse_args(argv)
    cpu = args.cpu_smoke or os.environ.get("BERTH_GPU_VALIDATION_CPU") == "1"
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if cpu:
        env["BERTH_DEVICE"] = "cpu"  # CPU workers even where nvidia-smi answers
    slug = "cpu" if cpu else device_slug()
    if slug == "cpu" and not cpu:
        print(
            "gpu_validation: no NVIDIA GPU found (nvidia-smi); use --cpu-smoke for the CPU rehearsal", file=sys.stderr
        )
        return 2
    out = Path(args.out_dir) if args.out_dir else ROOT / "benchmarks" / "results" / f"gpu-{slug}"
    out.mkdir(parents=True, exist_ok=True)
    store = out / "results.sqlite"
    if store.exists():
        store.unlink()  # one run, one store: calibrate fits this run's reports only
    run = Runner(out, env)
    started = time.perf_counter()
    local = ["--cluster", "local"] + (["--devices-per-node", "2"] if cpu else [])
    steps, warmup = (CPU_STEPS, CPU_WARMUP) if cpu else (STEPS, WARMUP)
    examples = CPU_EXAMPLES if cpu else [(n, m, s, b) for n, m, s, b in EXAMPLES]
    proxies = CPU_PROXIES if cpu else PROXIES
    profile = out / "profile.json"

    # 1. profile
    run.berth("profile", "profile", "--out", str(profile), *(["--quick", "--max-procs", "2"] if cpu else []))

    # 2. plan and validate the top plans of each example
    rows = []
    for name, model, seq, batch in examples:
        plans_file = out / f"plans-{name}.json"
        r = run.berth(
            f"plan-{name}",
            "plan",
            model,
            *local,
            "--seq-len",
            str(seq),
            "--global-batch",
            str(batch),
            "--profile",
            str(profile),
            "--top",
            str(args.top),
            "--json",
        )
        plans_file.write_text(r.stdout)
        plans = json.loads(r.stdout)["plans"]
        for pick in range(1, min(args.top, len(plans)) + 1):
            report = out / f"report-{name}-{pick}.json"
            r = run.berth(
                f"validate-{name}-{pick}",
                "validate",
                str(plans_file),
                "--pick",
                str(pick),
                "--steps",
                str(steps),
                "--warmup",
                str(warmup),
                "--store",
                str(store),
                "--out",
                str(report),
                "--json",
                ok_codes=(0, 1),
            )  # 1: the run failed or did not fit: evidence, kept
            rows.append(_row(name, model, seq, batch, pick, json.loads(report.read_text()), local))

    # 3. rank-slice proxies of plans larger than this machine
    for name, model, cluster, seq, batch, layers in proxies:
        plans_file = out / f"plans-{name}.json"
        r = run.berth(
            f"plan-{name}",
            "plan",
            model,
            *cluster,
            "--seq-len",
            str(seq),
            "--global-batch",
            str(batch),
            "--profile",
            str(profile),
            "--top",
            "1",
            "--json",
        )
        plans_file.write_text(r.stdout)
        layout = json.loads(r.stdout)["plans"][0]["layout"]
        vpp = layout["virtual_stages"]
        n = max(vpp, layers // vpp * vpp)
        report = out / f"report-{name}-rank-slice.json"
        run.berth(
            f"validate-{name}-rank-slice",
            "validate",
            str(plans_file),
            "--proxy",
            "rank-slice",
            "--layers",
            str(n),
            "--steps",
            str(steps),
            "--warmup",
            str(warmup),
            "--store",
            str(store),
            "--out",
            str(report),
            "--json",
            ok_codes=(0, 1),
        )
        rows.append(_row(name, model, seq, batch, 1, json.loads(report.read_text()), cluster))

    # 4. calibrate on every report of this run
    calibrated = out / "calibrated.json"
    ok = sum(x["status"] == "ok" for x in rows)
    holdout = "0.3" if ok >= HOLDOUT_MIN_REPORTS else "0"  # a random 30 % of 3 reports can leave 1 to fit
    run.berth("calibrate", "calibrate", "--store", str(store), "--holdout", holdout, "--out", str(calibrated))

    # 5. re-predict the validated full runs with the calibrated profile
    for name, model, seq, batch in examples:
        mine = [x for x in rows if x["example"] == name and x["status"] == "ok"]
        if not mine:
            continue
        layouts = [a for x in mine for a in ("--layout", x["layout"])]
        r = run.berth(
            f"repredict-{name}",
            "compare",
            model,
            *local,
            "--seq-len",
            str(seq),
            "--global-batch",
            str(batch),
            "--profile",
            str(calibrated),
            *layouts,
            "--json",
        )
        for x, cand in zip(mine, json.loads(r.stdout)["candidates"], strict=True):
            p = cand.get("prediction") or {}
            x["after_step_time_s"], x["after_peak_memory_bytes"] = p.get("step_time_s"), p.get("peak_memory_bytes")

    summary = _summary(rows, run.log, time.perf_counter() - started, slug)
    (out / "summary.json").write_text(json.dumps(summary, indent=1))
    _print(summary)
    return 1 if summary["top_plans_out_of_memory"] else 0


def _row(name, model, seq, batch, pick, report, cluster) -> dict:
    err = report.get("relative_error", {})
    return {
        "example": name,
        "model": model,
        "seq_len": seq,
        "global_batch": batch,
        "pick": pick,
        "mode": report["mode"],
        "status": report["status"],
        "layout": _layout_spec(report["plan"]["layout"]),
        "cluster": cluster,
        "message": report.get("message"),
        "predicted_step_time_s": report["predicted"].get("step_time_s"),
        "measured_step_time_s": report["measured"].get("step_time_s"),
        "predicted_peak_memory_bytes": report["predicted"].get("peak_memory_bytes"),
        "measured_peak_memory_bytes": report["measured"].get("peak_memory_bytes"),
        "step_time_error": err.get("step_time_s"),
        "memory_error": err.get("peak_memory_bytes"),
    }


def _layout_spec(x: dict) -> str:
    parts = [
        f"tp={x['tp']}",
        f"pp={x['pp']}",
        f"dp={x['dp']}",
        f"zero={x['zero_stage']}",
        f"shard={x['shard']}",
        f"mbs={x['micro_batch_size']}",
        f"nmb={x['num_microbatches']}",
        f"recompute={x['recompute']}",
    ]
    if x["pp"] > 1:
        parts += [f"schedule={x['schedule']}", f"vpp={x['virtual_stages']}"]
    if x["sequence_parallel"]:
        parts.append("sp=1")
    return ",".join(parts)


def _summary(rows, log, seconds, slug) -> dict:
    def rel(pred, meas):
        return None if not pred or meas is None else (meas - pred) / pred

    for x in rows:
        x["after_step_time_error"] = rel(x.get("after_step_time_s"), x["measured_step_time_s"])
        x["after_memory_error"] = rel(x.get("after_peak_memory_bytes"), x["measured_peak_memory_bytes"])
    oom = [f"{x['example']} #1 ({x['layout']})" for x in rows if x["pick"] == 1 and x["status"] == "did_not_fit"]
    return {
        "device": slug,
        "seconds": seconds,
        "runs": rows,
        "commands": log,
        "top_plans_out_of_memory": oom,
        "statuses": {s: sum(x["status"] == s for x in rows) for s in {x["status"] for x in rows}},
    }


def _print(summary: dict) -> None:
    def pct(v):
        return "    -" if v is None else f"{v:+6.1%}"

    print(f"\n{'run':34} {'status':12} {'time err':>9} {'after':>9} {'mem err':>9} {'after':>9}")
    for x in summary["runs"]:
        label = f"{x['example']} #{x['pick']}" + (" (rank-slice)" if x["mode"] == "rank-slice" else "")
        print(
            f"{label:34} {x['status']:12} {pct(x['step_time_error']):>9} {pct(x.get('after_step_time_error')):>9} "
            f"{pct(x['memory_error']):>9} {pct(x.get('after_memory_error')):>9}"
        )
    print(
        f"errors are (measured - predicted) / predicted; 'after' uses calibrated.json. {summary['seconds']:.0f} s; "
        f"statuses {summary['statuses']}"
    )
    if summary["top_plans_out_of_memory"]:
        print("top-ranked plans that ran out of memory: " + "; ".join(summary["top_plans_out_of_memory"]))


if __name__ == "__main__":
    sys.exit(main())
