"""`berth validate`: run a plan for real on this machine and compare measured with predicted.

The parent process never imports torch: it checks the plan, launches
`torchrun --standalone --nproc-per-node=<world size> -m berth.executor.worker`, follows rank 0's progress
lines, enforces a wall-clock watchdog, and turns the result (or the failure) into a
ValidationReport, written to a file and appended to the SQLite results store.

Failure handling: the workers' process-group timeout (BERTH_COLLECTIVE_TIMEOUT_S) turns a dead or
hung peer into an error on the others; torchrun tears the group down when a rank exits; the
watchdog kills the whole process group if the launch outlives its deadline. Success is judged
from the result file (reference "Traps": a few launches abort at exit after writing results).
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import math
import os
import re
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

from berth.cost_models.breakdown import compare, terms_from_regions
from berth.cost_models.step import proxy_prediction
from berth.executor.checks import PROGRESS_PREFIX, REQUIRE_GPU_ENV, UnsupportedLayout, check_layout
from berth.planner.store import Store
from berth.specs import __version__, stages
from berth.specs.errors import BerthError
from berth.specs.tree import (
    MeasuredBreakdown,
    Metrics,
    Plan,
    ValidationReport,
    ValidationStatus,
    pick_plan,
    plan_listing,
)
from berth.topology.clusters import local_gpus

STARTUP_BUDGET_S = 120.0  # torchrun start, imports and model build, generously
STEP_BUDGET_FACTOR = 20.0  # a step may run this many times slower than predicted before the watchdog fires
TERMINATE_GRACE_S = 5.0
# After a rank has written its error file, how long the others get to write theirs before the launch
# is ended. torchrun itself stops the other ranks with SIGTERM and then waits 30 s before SIGKILL (its
# agent's _stop_workers ignores TORCH_ELASTIC_SHUTDOWN_TIMEOUT in torch 2.13), and a rank stuck in a
# collective or stopped ignores the SIGTERM: every failed run took half a minute more to report.
WORKER_SHUTDOWN_GRACE_S = 5.0
POLL_S = 0.5  # how often the launch is checked for its end or a rank's error file

Progress = Callable[[dict[str, Any]], None]


def load_plan(path: str | Path, pick: int = 1) -> Plan:
    """One Plan from a file holding a plan object, a list of them, or `berth plan --json` output
    (plans numbered from 1 as in the table; the first unless `pick`)."""
    return pick_plan(read_plans(path), pick, "the file")


def read_plans(path: str | Path) -> list[Any]:
    """The plans a file lists (`plan_listing`), as JSON: at least one, else refused naming the file."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise BerthError("plan", str(path), f"cannot read the file: {err.strerror}") from None
    except json.JSONDecodeError as err:
        raise BerthError("plan", str(path), f"not JSON: {err.msg} at line {err.lineno}") from None
    plans = plan_listing(data)
    if not plans:
        raise BerthError("plan", str(path), "holds no plan (expected a plan, a list, or `berth plan --json` output)")
    return plans


def local_devices() -> tuple[str, int]:
    gpus = local_gpus()
    return ("gpu", len(gpus)) if gpus else ("cpu", os.cpu_count() or 1)


def require_torch(what: str = "a validation") -> None:
    """The executor runs on torch (the `executor` extra): without it, refused in one line naming the
    extra before anything starts, not a traceback or a failed run."""
    if importlib.util.find_spec("torch") is None:
        raise BerthError(
            "executor", "torch", f"{what} needs torch: pip install 'berth[executor]' (torch 2.13.0, the CPU wheel)"
        )


def _runnable(plan: Plan) -> None:
    """Refuse a plan the bundled executor cannot run at all: an infeasible one, or one with FP8 linears."""
    if plan.infeasible_reason:
        raise BerthError("plan.infeasible_reason", plan.infeasible_reason, "the plan is not feasible; pick another")
    if plan.training.fp8 is not None:
        raise BerthError(
            "plan.training.fp8",
            plan.training.fp8,
            "the bundled executor trains in bf16, fp16 or fp32 (no FP8 linears): validate a bf16 plan, or measure the "
            "FP8 run on its engine and give it to `berth calibrate --runs`",
        )


def preflight(plan: Plan, oversubscribe: bool = False) -> None:
    """Refuse, before launching anything, a plan this machine cannot run or that cannot run."""
    _runnable(plan)
    try:
        check_layout(plan.model, plan.training, plan.layout, plan.layout.world_size)
    except UnsupportedLayout as err:
        raise BerthError("plan.layout", plan.layout.short(), str(err)) from None
    kind, count = local_devices()
    want = plan.cluster.device.kind
    if want == "gpu" and kind != "gpu":
        raise BerthError(
            "plan.cluster.device",
            plan.cluster.device.name,
            "the plan is for GPUs and this machine has none; plan with --cluster local",
        )
    if want == "cpu" and kind == "gpu" and os.environ.get("BERTH_DEVICE") != "cpu":
        raise BerthError(
            "plan.cluster.device",
            plan.cluster.device.name,
            "the plan is for CPU workers and this machine has GPUs; set BERTH_DEVICE=cpu to run it on CPU",
        )
    world = plan.layout.world_size
    if world > count and not (kind == "cpu" and oversubscribe):
        hint = " (--oversubscribe runs more CPU workers than cores)" if kind == "cpu" else ""
        raise BerthError(
            "plan.layout",
            plan.layout.short(),
            f"needs {world} {'GPUs' if kind == 'gpu' else 'CPU workers'}, this machine has {count}; "
            f"use --proxy rank-slice to run one rank's share{hint}",
        )
    require_torch()


def predicted_metrics(plan: Plan) -> Metrics:
    p = plan.prediction
    initial_loss = math.log(plan.model.vocab_size)
    if p is None:
        return Metrics(loss=initial_loss)
    return Metrics(
        step_time_s=p.step_time_s, tokens_per_s=p.tokens_per_s, peak_memory_bytes=p.peak_memory_bytes, loss=initial_loss
    )


def relative_errors(predicted: Metrics, measured: Metrics) -> dict[str, float]:
    out = {}
    for key in Metrics.model_fields:
        p, m = getattr(predicted, key), getattr(measured, key)
        if p and m is not None:
            out[key] = (m - p) / p
    return out


def _watchdog_s(plan: Plan, steps: int) -> float:
    predicted = plan.prediction.step_time_s if plan.prediction else 10.0
    return STARTUP_BUDGET_S + STEP_BUDGET_FACTOR * predicted * steps


def _launch(
    cmd: list[str],
    env: dict[str, str],
    deadline_s: float,
    on_progress: Progress | None,
    stderr_path: Path,
    failed: Callable[[], bool] | None = None,
) -> tuple[int | None, bool]:
    """Run torchrun in its own process group; returns (exit code, timed out). The group is killed
    when it outlives `deadline_s`, or WORKER_SHUTDOWN_GRACE_S after `failed()` (a rank's error file)
    first holds while torchrun is still waiting on the other ranks."""
    with stderr_path.open("w") as err, contextlib.ExitStack() as stack:
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True, env=env, start_new_session=True)
        stack.callback(_guard(proc.pid))

        stdout = proc.stdout
        assert stdout is not None  # stdout=PIPE

        def follow() -> None:
            for line in stdout:
                at = line.find(PROGRESS_PREFIX)
                if at >= 0 and on_progress is not None:
                    with contextlib.suppress(json.JSONDecodeError, TypeError):
                        on_progress(json.loads(line[at + len(PROGRESS_PREFIX) :]))

        reader = threading.Thread(target=follow, daemon=True)
        reader.start()
        end, failed_at = time.monotonic() + deadline_s, None
        while True:
            try:
                rc, timed_out = proc.wait(timeout=POLL_S), False
                break
            except subprocess.TimeoutExpired:
                now = time.monotonic()
                if failed_at is None and failed is not None and failed():
                    failed_at = now
                if now >= end or (failed_at is not None and now - failed_at >= WORKER_SHUTDOWN_GRACE_S):
                    timed_out = now >= end and failed_at is None
                    # a failed run's ranks have had their grace: no second one for torchrun's SIGTERM
                    _kill_group(proc, (signal.SIGKILL,) if failed_at is not None else KILL_SIGNALS)
                    rc = proc.returncode
                    break
        reader.join(timeout=TERMINATE_GRACE_S)
    return rc, timed_out


KILL_SIGNALS = (signal.SIGTERM, signal.SIGKILL)  # each sent to the group, TERMINATE_GRACE_S apart
# The guard of a launch: reads its stdin until this process writes "done" or dies (kill -9
# included: the pipe closes, the read ends empty); in the second case it ends the launch's process
# group (torchrun and its workers), SIGTERM then SIGKILL.
GUARD = """
import os, signal, sys, time
group = int(sys.argv[1])
if sys.stdin.buffer.read(4) != b"done":
    for sig in (signal.SIGTERM, signal.SIGKILL):
        try:
            os.killpg(group, sig)
        except (ProcessLookupError, PermissionError):
            break
        time.sleep(float(sys.argv[2]))
"""


def _guard(group: int) -> Callable[[], None]:
    """Start the guard of process group `group` (see GUARD); the returned function stands it down
    once the group has ended normally."""
    guard = subprocess.Popen(
        [sys.executable, "-c", GUARD, str(group), str(TERMINATE_GRACE_S)],
        stdin=subprocess.PIPE,
        start_new_session=True,
    )

    def stand_down() -> None:
        with contextlib.suppress(OSError):
            assert guard.stdin is not None
            guard.stdin.write(b"done")
            guard.stdin.close()
        with contextlib.suppress(subprocess.TimeoutExpired):
            guard.wait(timeout=TERMINATE_GRACE_S)

    return stand_down


def _kill_group(proc: subprocess.Popen, signals: tuple[signal.Signals, ...] = KILL_SIGNALS) -> None:
    for sig in signals:
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=TERMINATE_GRACE_S)
            return
        except subprocess.TimeoutExpired:
            continue


def _measured(breakdown: dict[str, Any] | None) -> MeasuredBreakdown | None:
    """The report's breakdown (breakdown.compare's dict) as the spec it is validated into."""
    return None if breakdown is None else MeasuredBreakdown.model_validate(breakdown)


def _failure(
    out: Path, stderr_path: Path, rc: int | None, timed_out: bool, deadline_s: float, plan: Plan
) -> tuple[ValidationStatus, str]:
    """(status, message) of a launch that left no result file."""
    errors = []
    for f in sorted(out.parent.glob(out.name + ".rank*.error.json")):
        try:
            errors.append((f.name.split(".rank")[1].split(".")[0], json.loads(f.read_text())))
        except (OSError, json.JSONDecodeError):
            continue
    oom = [(r, e) for r, e in errors if e.get("out_of_memory")]
    if oom:
        rank, e = oom[0]
        available = e.get("available_memory_bytes") or plan.cluster.device.memory_bytes
        predicted = plan.prediction.peak_memory_bytes if plan.prediction else float("nan")
        return "did_not_fit", (
            f"did not fit: rank {rank} ran out of memory (predicted peak "
            f"{predicted / 2**30:.2f} GiB, available {available / 2**30:.2f} GiB): "
            f"{e['message'][:300]}"
        )
    if timed_out:
        return "failed", f"timed out: the run outlived its {deadline_s:.0f} s watchdog and was killed"
    tail = stderr_path.read_text(errors="replace") if stderr_path.is_file() else ""
    parts = []
    first = re.search(r"failed \(exitcode: (-?\d+)\) local_rank: (\d+)", tail)
    if first:
        code, rank = int(first.group(1)), first.group(2)
        killed = code < 0 and -code in _SIGNALS
        how = f"was killed by {signal.Signals(-code).name}" if killed else f"exited with code {code}"
        parts.append(f"rank {rank} {how} first")
    if errors:
        rank, e = errors[0]
        parts.append(f"rank {rank} raised {e['type']}: {e['message'].splitlines()[0][:240]}")
    detail = "; ".join(parts) or " | ".join(tail.strip().splitlines()[-3:])
    return "failed", f"the run failed (torchrun exit code {rc}): {detail}"


_SIGNALS = {int(s) for s in signal.Signals}


def _failed_report(
    common: dict[str, Any],
    result_path: Path,
    stderr_path: Path,
    rc: int | None,
    timed_out: bool,
    deadline: float,
    plan: Plan,
    started: float,
) -> ValidationReport:
    status, message = _failure(result_path, stderr_path, rc, timed_out, deadline, plan)
    return ValidationReport(
        **common,
        status=status,
        message=message,
        measured=Metrics(),
        machine={"wall_time_s": time.perf_counter() - started},
    )


def _save(report: ValidationReport, out: str | Path | None, store: Store | None) -> ValidationReport:
    """Write the report file (if asked) and append it to the results store, failed ones too."""
    if out:
        Path(out).write_text(report.model_dump_json(indent=2))
    (store or Store()).add_validation(report)
    return report


def measured_metrics(plan: Plan, result: dict[str, Any]) -> tuple[Metrics, dict[str, Any]]:
    """Step time = median over timed steps of the slowest rank's step; memory = the largest rank."""
    warm = result["warmup"]
    ranks = result["ranks"]
    per_step = [max(r["step_times_s"][i] for r in ranks) for i in range(warm, len(ranks[0]["step_times_s"]))]
    median = statistics.median(per_step)
    tokens = plan.training.global_batch_size * plan.training.seq_len
    peaks = [r["peak_memory_bytes"] for r in ranks if r["peak_memory_bytes"] is not None]
    metrics = Metrics(
        step_time_s=median,
        tokens_per_s=tokens / median,
        peak_memory_bytes=max(peaks) if peaks else None,
        loss=result["losses"][0],
    )
    extra = {
        "step_times_s": per_step,
        "spread": {
            "min": min(per_step),
            "median": median,
            "max": max(per_step),
            "stdev": statistics.stdev(per_step) if len(per_step) > 1 else 0.0,
        },
        "per_rank": [_rank_entry(r, warm) for r in ranks],
    }
    return metrics, extra


def _rank_entry(r: dict[str, Any], warm: int) -> dict[str, Any]:
    entry = {
        "rank": r["rank"],
        "step_time_median_s": statistics.median(r["step_times_s"][warm:]),
        "peak_memory_bytes": r["peak_memory_bytes"],
        "collective_s_per_step": r.get("collective_s_per_step"),
    }
    if r.get("regions_s") is not None:  # what this rank's steps went to (cost_models/breakdown.py)
        entry.update(
            {
                "step_time_mean_s": r["step_time_mean_s"],
                "terms_s": terms_from_regions(r["regions_s"]),
                "regions_s": r["regions_s"],
                "model_state_bytes": r.get("model_state_bytes"),
                "timeline": r.get("timeline"),
                "trace_file": r.get("trace_file"),
            }
        )
    return entry


PROXY_CHECKS = {
    "checked": [
        "compute time of one rank per step: forward and backward of its stage's layers at their tp widths "
        "(with the embedding and/or LM head the stage holds) over the planned micro-batches, recomputation, "
        "and the optimizer step on its shard",
        "peak memory of that rank: parameters and gradients of its slice, optimizer state of its shard, "
        "activations of the micro-batches the schedule keeps in flight on that stage, logits",
    ],
    "not_checked": [
        "tensor- and sequence-parallel collectives, pipeline sends and the pipeline bubble",
        "data-parallel and ZeRO traffic, inside the node and across nodes",
        "ZeRO-2/3 (FSDP) parameter and gradient sharding: the proxy holds what zero <= 1 holds and is compared "
        "with the prediction for that",
        "the loss and the end-to-end step time and throughput",
        "framework memory outside the allocator (CUDA context, NCCL buffers): left out of the predicted figure",
    ],
}


def validate_proxy(
    plan: Plan,
    layers: int | None = None,
    stage: str | None = None,
    steps: int = 5,
    warmup: int = 2,
    seed: int = 0,
    store: Store | None = None,
    out: str | Path | None = None,
    on_progress: Progress | None = None,
    timeout_s: float | None = None,
    run_dir: str | Path | None = None,
) -> ValidationReport:
    """Run one rank's share of the plan in one process (executor/proxy.py) and compare it with
    the cost model's per-rank figures for that stage."""
    x = plan.layout
    # the deepest stage's layers (specs/stages.py; every stage's when the split is even)
    per_stage = max(int(n) for n in stages.stage_split(plan.model.num_layers, x.pp, x.virtual_stages)[:3])
    layers = per_stage if layers is None else layers
    if not 1 <= layers <= per_stage:
        raise BerthError("layers", layers, f"must be in 1..{per_stage} (the layers of one stage)")
    if layers % x.virtual_stages:
        raise BerthError("layers", layers, f"must be a multiple of virtual_stages={x.virtual_stages}")
    if steps < 1 or warmup < 0:
        raise BerthError("steps" if steps < 1 else "warmup", steps if steps < 1 else warmup, "out of range")
    _runnable(plan)
    if x.cp > 1:
        raise BerthError(
            "plan.layout.cp",
            x.cp,
            "the rank-slice proxy does not emulate context parallelism (the "
            "chunked sequence and its KV exchange); validate the whole layout instead",
        )
    if plan.model.is_moe:
        raise BerthError(
            "plan.model",
            plan.model.name,
            "the rank-slice proxy does not emulate mixture-of-experts "
            "layers (its slice would hold every expert); validate the whole layout instead",
        )
    try:
        check_layout(plan.model, plan.training, x, x.world_size)
    except UnsupportedLayout as err:
        raise BerthError("plan.layout", x.short(), str(err)) from None
    kind, _ = local_devices()
    if plan.cluster.device.kind == "gpu" and kind != "gpu":
        raise BerthError(
            "plan.cluster.device",
            plan.cluster.device.name,
            "the plan is for GPUs and this machine has none: a CPU proxy would not measure that device",
        )
    require_torch()
    predicted_full = predicted_metrics(plan)
    first_mem = proxy_prediction(plan, layers, True)[0].peak_memory_bytes or 0.0  # always set by proxy_prediction
    last_mem = proxy_prediction(plan, layers, False)[0].peak_memory_bytes or 0.0
    stage = stage or ("first" if first_mem >= last_mem or x.pp == 1 else "last")
    if stage not in ("first", "last"):
        raise BerthError("stage", stage, "must be first or last")
    predicted, breakdown, in_flight = proxy_prediction(plan, layers, stage == "first")
    if run_dir is None:  # a directory of our own, removed afterwards (the report keeps the stderr tail)
        with tempfile.TemporaryDirectory(prefix="berth-proxy-") as tmp:
            return validate_proxy(plan, layers, stage, steps, warmup, seed, store, out, on_progress, timeout_s, tmp)
    work = Path(run_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "plan.json").write_text(plan.model_dump_json())
    result_path = work / "result.json"
    cmd = [
        sys.executable,
        "-m",
        "berth.executor.proxy",
        "--plan",
        str(work / "plan.json"),
        "--stage",
        stage,
        "--layers",
        str(layers),
        "--in-flight",
        str(in_flight),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--seed",
        str(seed),
        "--out",
        str(result_path),
    ]
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    if plan.cluster.device.kind == "cpu":
        env["BERTH_DEVICE"] = "cpu"
    else:
        env[REQUIRE_GPU_ENV] = "1"  # a GPU plan is measured on a GPU or not at all
    deadline = timeout_s or STARTUP_BUDGET_S + STEP_BUDGET_FACTOR * (predicted.step_time_s or 10.0) * (steps + warmup)
    started = time.perf_counter()
    rc, timed_out = _launch(cmd, env, deadline, on_progress, work / "proxy.stderr")
    common: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "created": datetime.now(UTC).isoformat(),
        "berth_version": __version__,
        "plan": plan,
        "steps": steps,
        "warmup": warmup,
        "predicted": predicted,
        "mode": "rank-slice",
        "checks": PROXY_CHECKS,
    }
    if result_path.is_file():
        r = json.loads(result_path.read_text())
        timed = r["step_compute_s"][warmup:]
        med = statistics.median
        measured = Metrics(step_time_s=med(timed), peak_memory_bytes=r["peak_memory_bytes"])
        nmb = x.num_microbatches
        rank = {
            "rank": 0,
            "stage": r["stage"],
            "layers": layers,
            "micro_batches_in_flight": in_flight,
            "forward_per_microbatch_s": med(r["forward_s"][warmup:]) / nmb,
            "backward_per_microbatch_s": med(r["backward_s"][warmup:]) / nmb,
            "optimizer_s": med(r["optimizer_s"][warmup:]),
            "predicted_forward_backward_per_microbatch_s": (
                breakdown["time.forward_backward"] + breakdown["time.recompute"]
            )
            / nmb,
            "predicted_optimizer_s": breakdown["time.optimizer"],
            "parameters": r["params"],
            "optimizer_parameters": r["optimizer_params"],
            "predicted_breakdown": breakdown,
            "plan_prediction": predicted_full.model_dump(),
        }
        report = ValidationReport(
            **common,
            status="ok",
            machine={**r["machine"], "device": r["device"], "wall_time_s": time.perf_counter() - started},
            measured=measured,
            relative_error=relative_errors(predicted, measured),
            step_time_spread_s={"min": min(timed), "median": med(timed), "max": max(timed)},
            step_times_s=timed,
            per_rank=[rank],
            memory_method=r["memory_method"],
        )
    else:
        report = _failed_report(common, result_path, work / "proxy.stderr", rc, timed_out, deadline, plan, started)
    return _save(report, out, store)


def report_from_result(
    plan: Plan,
    result: dict[str, Any],
    data: dict[str, Any],
    steps: int,
    warmup: int,
    wall_s: float,
    predicted: Metrics | None = None,
) -> ValidationReport:
    """A ValidationReport from one layout's entry of a berth.executor.worker result file."""
    predicted = predicted or predicted_metrics(plan)
    measured, extra = measured_metrics(plan, result)
    return ValidationReport(
        id=uuid.uuid4().hex,
        created=datetime.now(UTC).isoformat(),
        berth_version=__version__,
        plan=plan,
        steps=steps,
        warmup=warmup,
        predicted=predicted,
        status="ok",
        machine={
            **data["machine"],
            "world_size": data["world_size"],
            "device": result["device"],
            "backend": result["backend"],
            "wall_time_s": wall_s,
        },
        measured=measured,
        relative_error=relative_errors(predicted, measured),
        step_time_spread_s=extra["spread"],
        step_times_s=extra["step_times_s"],
        losses=result["losses"],
        per_rank=extra["per_rank"],
        memory_method=result["memory_method"],
        executed_as=result["executed_as"],
        breakdown=_measured(compare(plan.prediction, result["ranks"], result.get("timing_method", ""))),
        traces=[r["trace_file"] for r in result["ranks"] if r.get("trace_file")],
    )


def validate(
    plan: Plan,
    steps: int = 5,
    warmup: int = 2,
    seed: int = 0,
    store: Store | None = None,
    out: str | Path | None = None,
    on_progress: Progress | None = None,
    oversubscribe: bool = False,
    timeout_s: float | None = None,
    collective_timeout_s: float = 60.0,
    run_dir: str | Path | None = None,
    trace_dir: str | Path | None = None,
) -> ValidationReport:
    """Check, launch, measure and report. Failures come back as a report with status failed or
    did_not_fit (and are stored); bad input raises BerthError before anything starts.
    `trace_dir`: one more step per rank runs under torch.profiler and is written there as a
    Chrome/Perfetto trace (rank<R>.trace.json), listed in the report's `traces`."""
    if steps < 1:
        raise BerthError("steps", steps, "must be at least 1")
    if warmup < 0:
        raise BerthError("warmup", warmup, "must be 0 or more")
    preflight(plan, oversubscribe)
    if run_dir is None:  # a directory of our own, removed afterwards (the report keeps the stderr tail)
        with tempfile.TemporaryDirectory(prefix="berth-validate-") as tmp:
            return validate(
                plan,
                steps,
                warmup,
                seed,
                store,
                out,
                on_progress,
                oversubscribe,
                timeout_s,
                collective_timeout_s,
                run_dir=tmp,
                trace_dir=trace_dir,
            )
    work = Path(run_dir)
    work.mkdir(parents=True, exist_ok=True)
    (work / "plans.json").write_text(json.dumps([plan.model_dump(mode="json")]))
    result_path = work / "result.json"
    world = plan.layout.world_size
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--standalone",
        f"--nproc-per-node={world}",
        "-m",
        "berth.executor.worker",
        "--plans",
        str(work / "plans.json"),
        "--steps",
        str(steps),
        "--warmup",
        str(warmup),
        "--seed",
        str(seed),
        "--out",
        str(result_path),
    ]
    if trace_dir is not None:
        trace = Path(trace_dir).resolve()
        try:
            trace.mkdir(parents=True, exist_ok=True)
        except OSError as err:
            raise BerthError("trace", str(trace_dir), f"cannot create the directory: {err.strerror}") from None
        cmd += ["--trace", str(trace)]
    env = {
        **os.environ,
        "PYTHONUNBUFFERED": "1",
        "BERTH_COLLECTIVE_TIMEOUT_S": str(collective_timeout_s),
        "BERTH_RUN_DIR": str(work),
        "TMPDIR": str(work),  # torchrun's own log directory (torchelastic_*) lands here and goes with it
    }
    if plan.cluster.device.kind == "cpu":
        env["BERTH_DEVICE"] = "cpu"
    else:
        env[REQUIRE_GPU_ENV] = "1"  # a GPU plan is measured on a GPU or not at all
    deadline = timeout_s or _watchdog_s(plan, steps + warmup + (trace_dir is not None))
    started = time.perf_counter()

    def failed() -> bool:
        return any(work.glob(f"{result_path.name}.rank*.error.json"))

    rc, timed_out = _launch(cmd, env, deadline, on_progress, work / "torchrun.stderr", failed)
    predicted = predicted_metrics(plan)
    common: dict[str, Any] = {
        "id": uuid.uuid4().hex,
        "created": datetime.now(UTC).isoformat(),
        "berth_version": __version__,
        "plan": plan,
        "steps": steps,
        "warmup": warmup,
        "predicted": predicted,
    }
    if result_path.is_file():
        data = json.loads(result_path.read_text())
        report = report_from_result(
            plan, data["results"][0], data, steps, warmup, time.perf_counter() - started, predicted
        )
    else:
        report = _failed_report(common, result_path, work / "torchrun.stderr", rc, timed_out, deadline, plan, started)
    return _save(report, out, store)
