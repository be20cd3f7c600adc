"""torchrun entry point: run the layouts of a plan file and write what every rank measured.

    python -m torch.distributed.run --standalone --nproc-per-node=N -m berth.executor.worker \
        --plans plans.json --steps 3 --warmup 2 --out result.json [--trace DIR]

`plans.json` holds a list of Plan objects (all with the same world size); several layouts share
one launch because starting torchrun costs seconds. Rank 0 prints one `BERTH_PROGRESS {json}`
line per step (what `berth validate` reads for its progress display) and writes the result file
at the end. A rank that fails writes `<out>.rank<R>.error.json` (the exception, and for an
out-of-memory the device's memory) and re-raises, so torchrun tears the group down; success is
judged from the result file, not the exit code (reference "Traps").

Each rank's entry also holds where its timed steps went: the mean exclusive seconds per measured
region (`regions_s`, executor/timing.py; cost_models/breakdown.py maps them onto the predicted terms),
the timeline of its median step, the model-state bytes it holds, and with --trace the path of its
Chrome trace of one more step.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
import warnings
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from berth.executor.checks import PROGRESS_PREFIX
from berth.executor.device import rank_device
from berth.executor.train import run_steps
from berth.specs.tree import Plan

DEFAULT_COLLECTIVE_TIMEOUT_S = 60.0  # a dead or hung peer turns a hang into an error
SLOW_OPTIMIZER_ENV = "BERTH_TEST_SLOW_OPTIMIZER"  # test hook: "RANK:SECONDS[:PLAN]" (executor/train.py)


def optimizer_delay_s(rank: int, plan_number: int) -> float:
    """Seconds this rank sleeps in its optimizer step for this plan ($BERTH_TEST_SLOW_OPTIMIZER,
    set only by tests: a known slowdown the report must name)."""
    value = os.environ.get(SLOW_OPTIMIZER_ENV, "")
    if not value:
        return 0.0
    who, seconds, *plan = value.split(":")
    return float(seconds) if int(who) == rank and (not plan or int(plan[0]) == plan_number) else 0.0


def machine() -> dict:
    info = {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "threads_per_rank": torch.get_num_threads(),
    }
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_memory_bytes"] = torch.cuda.get_device_properties(0).total_memory
    return info


def _error_record(err: BaseException, device: torch.device) -> dict:
    oom = isinstance(err, torch.OutOfMemoryError) or "out of memory" in str(err).lower()
    record = {
        "type": type(err).__name__,
        "message": str(err)[:2000],
        "out_of_memory": oom,
        "traceback": traceback.format_exc()[-4000:],
    }
    if oom and device.type == "cuda":
        free, total = torch.cuda.mem_get_info(device)
        record["available_memory_bytes"] = total
        record["peak_memory_bytes"] = torch.cuda.max_memory_reserved(device)
    return record


def step_terms(timings: list) -> dict:
    """A rank's regions over the timed steps: the mean exclusive seconds of each region that
    occurred (means add up: regions_s sums to step_time_mean_s), and the timeline of the step of
    median length (for the per-rank comb of `berth report --png`)."""
    n = len(timings)
    regions: dict[str, float] = {}
    for t in timings:
        for name, seconds in t.regions_s.items():
            regions[name] = regions.get(name, 0.0) + seconds / n
    median = sorted(timings, key=lambda t: t.step_s)[n // 2]
    return {
        "regions_s": regions,
        "step_time_mean_s": sum(t.step_s for t in timings) / n,
        "timeline": [[round(a, 7), round(b, 7), name] for a, b, name in median.segments],
    }


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--warmup", type=int, default=0)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    ap.add_argument(
        "--trace",
        help="write a Chrome/Perfetto trace of one more step per rank into this directory "
        "(one subdirectory per plan when several)",
    )
    ap.add_argument(
        "--report",
        help="also write the ValidationReport of the first plan here (rank 0): what "
        "`berth launch` scripts use, so a launch on any cluster ends in predicted vs measured",
    )
    args = ap.parse_args()
    started = time.perf_counter()
    # Pipeline stages hand FSDP2 outputs on as views; nothing modifies them in place.
    warnings.filterwarnings("ignore", message="FSDP2-wrapped module .* returned a view tensor")
    torch.set_num_threads(int(os.environ.get("BERTH_THREADS_PER_RANK", "1")))
    plans = [Plan.model_validate(p) for p in json.loads(Path(args.plans).read_text())]
    world = int(os.environ.get("WORLD_SIZE", "1"))
    rank = int(os.environ.get("RANK", "0"))
    try:
        device = rank_device()
    except RuntimeError as err:
        Path(f"{args.out}.rank{rank}.error.json").write_text(json.dumps(_error_record(err, torch.device("cpu"))))
        raise
    if os.environ.get("BERTH_RUN_DIR"):  # lets a supervisor (or a fault test) find each rank
        Path(os.environ["BERTH_RUN_DIR"], f"rank{rank}.pid").write_text(str(os.getpid()))
    timeout = timedelta(seconds=float(os.environ.get("BERTH_COLLECTIVE_TIMEOUT_S", DEFAULT_COLLECTIVE_TIMEOUT_S)))
    if world > 1:
        dist.init_process_group(
            "nccl" if device.type == "cuda" else "gloo",
            timeout=timeout,
            device_id=device if device.type == "cuda" else None,
        )
    results = []
    try:
        for index, plan in enumerate(plans):

            def progress(step: int, loss: float, seconds: float, index: int = index) -> None:
                if rank == 0:
                    line = {
                        "plan": index,
                        "step": step + 1,
                        "of": args.warmup + args.steps,
                        "loss": loss,
                        "step_time_s": seconds,
                    }
                    print(PROGRESS_PREFIX + json.dumps(line), flush=True)

            trace = None
            if args.trace:
                trace = args.trace if len(plans) == 1 else str(Path(args.trace, f"plan{index + 1}"))
            rec = run_steps(
                plan.model,
                plan.training,
                plan.layout,
                args.steps,
                args.seed,
                warmup=args.warmup,
                device=device,
                on_step=progress,
                trace_dir=trace,
                optimizer_delay_s=optimizer_delay_s(rank, index + 1),
            )
            mine = {
                "rank": rank,
                "step_times_s": rec.step_times_s,
                "peak_memory_bytes": rec.peak_memory_bytes,
                "collective_s_per_step": rec.collective_s_per_step,
                **step_terms(rec.step_timings[args.warmup :] or rec.step_timings),
                "model_state_bytes": rec.model_state_bytes,
                "trace_file": rec.trace_file,
            }
            ranks = [None] * world if world > 1 else [mine]
            if world > 1:
                dist.all_gather_object(ranks, mine)
            results.append(
                {
                    "layout": plan.layout.model_dump(),
                    "losses": rec.losses,
                    "step_times_s": rec.step_times_s,
                    "warmup": args.warmup,
                    "ranks": ranks,
                    "memory_method": rec.memory_method,
                    "executed_as": rec.executed_as,
                    "timing_method": rec.timing_method,
                    "device": str(device.type),
                    "backend": dist.get_backend() if world > 1 else None,
                }
            )
    except BaseException as err:
        Path(f"{args.out}.rank{rank}.error.json").write_text(json.dumps(_error_record(err, device)))
        raise
    if rank == 0:
        tmp = Path(args.out + ".tmp")
        data = {"machine": machine(), "world_size": world, "results": results}
        tmp.write_text(json.dumps(data))
        tmp.replace(args.out)
        if args.report:
            from berth.executor.validate import report_from_result

            report = report_from_result(
                plans[0], results[0], data, args.steps, args.warmup, time.perf_counter() - started
            )
            Path(args.report).write_text(report.model_dump_json(indent=1))
            print(
                f"berth: report written to {args.report}: step time {report.measured.step_time_s:.3f} s "
                f"measured vs {report.predicted.step_time_s:.3f} s predicted",
                flush=True,
            )
    if world > 1:
        dist.barrier()
        dist.destroy_process_group()
    sys.stdout.flush()


if __name__ == "__main__":
    main()
