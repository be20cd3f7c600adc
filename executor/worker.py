"""torchrun entry point: run one or more layouts of a plan file and write rank 0's records.

    python -m torch.distributed.run --standalone --nproc-per-node=N -m executor.worker \
        --plans plans.json --steps 3 --out result.json

`plans.json` holds a list of Plan objects (all with the same world size); several layouts share
one launch because starting torchrun costs seconds.
"""

from __future__ import annotations

import argparse
import json
import os
from datetime import timedelta
from pathlib import Path

import torch
import torch.distributed as dist

from executor.train import run_steps
from planner.specs import Plan

COLLECTIVE_TIMEOUT = timedelta(seconds=60)  # a dead peer turns a hang into an error


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plans", required=True)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BERTH_THREADS_PER_RANK", "1")))
    plans = [Plan.model_validate(p) for p in json.loads(Path(args.plans).read_text())]
    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    if distributed:
        dist.init_process_group("gloo", timeout=COLLECTIVE_TIMEOUT)
    results = []
    for plan in plans:
        record = run_steps(plan.model, plan.training, plan.layout, args.steps, args.seed)
        results.append({"layout": plan.layout.model_dump(), "losses": record.losses,
                        "step_times_s": record.step_times_s})
    if not distributed or dist.get_rank() == 0:
        Path(args.out).write_text(json.dumps(results))
    if distributed:
        dist.barrier()
        dist.destroy_process_group()


if __name__ == "__main__":
    main()
