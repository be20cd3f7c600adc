"""Search speed: candidates evaluated, candidates per second and wall time of the exhaustive
search on three large problems. Prints a table and saves benchmarks/results/search_speed.json.

Targets (2-core CI machine): gpt3-175b on 128 DGX A100 nodes under 1 s; every case under 5 s.
Each case runs REPEATS times; the median is reported next to the min and max.

Beside the in-process search, each case is timed as a user feels it: the whole `berth plan`
process (interpreter start, imports, the cluster, the search, the tables), WHOLE_REPEATS runs,
min and median, with berth's modules byte-compiled first (`compile_packages`: as an installed berth
runs). Targets: the gpt3-175b case under 1.0 s, the 405B on 2,048 nodes under 1.5 s.
On a shared machine these wall times are noisy: compare minima.
"""

from __future__ import annotations

import json
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

from berth.planner.search import search
from berth.specs.models import load_model
from berth.specs.tree import SearchSpec, TrainingSpec
from berth.topology.clusters import cluster_from_preset

CASES = [
    # name, model, cluster preset, nodes, seq, global batch (sequences)
    ("gpt3-175b / 128 x DGX A100", "gpt3-175b", "dgx-a100-80g", 128, 2048, 1536),
    ("gpt-1t / 384 x DGX A100", "gpt-1t", "dgx-a100-80g", 384, 2048, 3072),
    ("llama3.1-405b / 2048 x DGX H100", "llama3.1-405b", "dgx-h100", 2048, 8192, 2048),
]
REPEATS = 3
WHOLE_REPEATS = 5
WHOLE_TARGETS_S = {"gpt3-175b / 128 x DGX A100": 1.0, "llama3.1-405b / 2048 x DGX H100": 1.5}
OUT = Path(__file__).parent / "results" / "search_speed.json"


def run_case(model_name, preset, nodes, seq, batch):
    model = load_model(model_name)
    cluster = cluster_from_preset(preset, nodes)
    training = TrainingSpec(seq_len=seq, global_batch_size=batch)
    walls, result = [], None
    for _ in range(REPEATS):
        t0 = time.perf_counter()
        result = search(model, training, cluster, SearchSpec(top=5))
        walls.append(time.perf_counter() - t0)
    best = result.plans[0]
    return {
        "candidates": result.searched,
        "feasible": result.feasible,
        "wall_s_median": statistics.median(walls),
        "wall_s_min": min(walls),
        "wall_s_max": max(walls),
        "candidates_per_s": result.searched / statistics.median(walls),
        "best_layout": best.layout.short(),
        "best_step_time_s": best.prediction.step_time_s,
        "best_mfu": best.prediction.mfu,
    }


PACKAGES = ("berth.planner", "berth.api", "berth.cost_models", "berth.hardware_profiles", "berth.executor")


def compile_packages() -> None:
    """Byte-compile berth's modules, as installing a wheel does (and any run does where Python may write
    its cache): a process started under PYTHONDONTWRITEBYTECODE from a fresh checkout would otherwise
    compile every module from source on each start (about 0.2 s more here), which no installed berth does."""
    import compileall
    import importlib.util

    for name in PACKAGES:
        for folder in importlib.util.find_spec(name).submodule_search_locations:
            compileall.compile_dir(folder, quiet=1)


def whole_process(model_name, preset, nodes, seq, batch) -> dict:
    """Wall time of `berth plan ...` as a fresh process (tables printed to /dev/null); main() byte-compiles
    berth first."""
    cmd = [
        sys.executable,
        "-m",
        "berth.cli.main",
        "plan",
        model_name,
        "--cluster",
        preset,
        "--nodes",
        str(nodes),
        "--seq-len",
        str(seq),
        "--global-batch",
        str(batch),
    ]
    walls = []
    for _ in range(WHOLE_REPEATS):
        t0 = time.perf_counter()
        subprocess.run(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, check=True)
        walls.append(time.perf_counter() - t0)
    return {
        "command": "berth " + " ".join(cmd[3:]),
        "wall_s_min": min(walls),
        "wall_s_median": statistics.median(walls),
        "walls_s": walls,
    }


def main() -> None:
    results = {}
    print(f"{'case':36s} {'candidates':>11s} {'wall s':>8s} {'cand/s':>12s}  best layout")
    for name, *args in CASES:
        r = run_case(*args)
        results[name] = r
        print(
            f"{name:36s} {r['candidates']:11,d} {r['wall_s_median']:8.3f} {r['candidates_per_s']:12,.0f}  "
            f"{r['best_layout']} (MFU {r['best_mfu']:.1%})"
        )
    print(f"\nwhole process (`berth plan ...`, {WHOLE_REPEATS} runs)")
    compile_packages()
    for name, *args in CASES:
        w = whole_process(*args)
        results[name]["whole_process"] = w
        target = WHOLE_TARGETS_S.get(name)
        note = f"  target {target:g} s: {'met' if w['wall_s_min'] < target else 'missed'} (min)" if target else ""
        print(f"{name:36s} min {w['wall_s_min']:.3f} s, median {w['wall_s_median']:.3f} s{note}")
    first = results[CASES[0][0]]["wall_s_median"]
    worst = max(r["wall_s_median"] for r in results.values())
    summary = {
        "first_case_under_1s": first < 1.0,
        "every_case_under_5s": worst < 5.0,
        "whole_process_targets_met_by_min": {
            n: results[n]["whole_process"]["wall_s_min"] < t for n, t in WHOLE_TARGETS_S.items()
        },
    }
    print(
        f"targets: first case {first:.3f} s (< 1 s: {summary['first_case_under_1s']}), "
        f"worst {worst:.3f} s (< 5 s: {summary['every_case_under_5s']})"
    )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(
        json.dumps(
            {
                "machine": platform.node(),
                "processor": platform.processor(),
                "python": platform.python_version(),
                "cases": results,
                "summary": summary,
            },
            indent=2,
        )
    )
    print(f"saved {OUT}")


if __name__ == "__main__":
    main()
