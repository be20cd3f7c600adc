"""The engine loop of benchmarks/engine_sweep.py from ten probe sets: 12 probes of each model on 16, 32, 64, 128 and
256 GPUs, each calibrated and scored on the other 13 groups, from berth's nanotron entry and from the generic engine.
Per loop the summary after calibration (its medians over the groups); over the ten, their mean and median: how much
the figures of one loop hang on which GPU count was probed. About 8 minutes on two cores.

    python -m benchmarks.engine_sweep_sets      # prints, writes benchmarks/results/engine_sweep_sets.json
"""

from __future__ import annotations

import json
import time

import numpy as np

from benchmarks.engine_sweep import ENGINE, GENERIC, HEADLINE, HERE, PROBES, _run_loops

OUT = HERE / "results" / "engine_sweep_sets.json"
GPUS = (16, 32, 64, 128, 256)
KEYS = (*HEADLINE, "ran_predicted_not_to_fit")


def main() -> dict:
    t0 = time.time()
    jobs = [(e, s, g) for e in (ENGINE, GENERIC) for s in ("1B", "8B") for g in GPUS]
    loops = _run_loops(jobs, PROBES, {})
    result: dict = {"probes": PROBES, "gpus": list(GPUS), "engines": {}}
    for engine in (ENGINE, GENERIC):
        rows = [
            {"model": s, "probe_gpus": r["probe_gpus"], **{k: r["after"][k] for k in KEYS}}
            for (e, s, _), r in zip(jobs, loops, strict=True)
            if e == engine
        ]
        over = {
            k: {"mean": float(np.mean([r[k] for r in rows])), "median": float(np.median([r[k] for r in rows]))}
            for k in KEYS
        }
        result["engines"][engine] = {"loops": rows, "over_the_loops": over}
        print(engine, " ".join(f"{k} {v['mean']:.3f} (median {v['median']:.3f})" for k, v in over.items()))
    result["seconds"] = round(time.time() - t0, 1)
    OUT.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


if __name__ == "__main__":
    main()
