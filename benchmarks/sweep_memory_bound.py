"""How far re-weighting the memory recipe's terms could take it on the Ultra-Scale sweep: a bound, in sample.

Every term of rank 0's predicted breakdown under the nanotron entry (cost_models/memory.py stage_memory_breakdown,
first stage: parameters, gradients, optimizer state, activations, logits, buffers, blocks) gets its own non-negative
scale, plus one fixed offset, fitted by least squares on the relative error over every run that ran, both models at
once (benchmarks/engine_sweep.py's records). What is left is the median |predicted / measured - 1| that no
weighting of these terms gets under: a bound on the memory parameters of planner/engine_fit.py, which scale groups
of these terms (docs/accuracy.md, "What is still off").

    python -m benchmarks.sweep_memory_bound
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import nnls

from benchmarks import engine_sweep
from berth.cost_models.memory import stage_memory_breakdown
from berth.specs.candidates import Candidates
from berth.specs.tree import EngineTuning


def terms_and_measured() -> tuple[list[str], np.ndarray, np.ndarray]:
    """(term names, bytes per run and term, measured reserved bytes per run) over every run that ran."""
    by_group, runs, _ = engine_sweep.loaded()
    columns: dict[str, list[np.ndarray]] = {}
    measured = []
    for key, recs in sorted(by_group.items()):
        group = runs[key]
        first = group[0]
        training = first.training.model_copy(update={"tuning": EngineTuning()})
        c = Candidates.from_layouts([r.layout for r in group])
        breakdown = stage_memory_breakdown(first.model, training, first.cluster.device, c, first=True)
        for name, value in breakdown.items():
            columns.setdefault(name, []).append(np.broadcast_to(np.asarray(value, dtype=float), (len(group),)))
        measured.append(np.array([r["peak_memory_gib"] for r in recs]) * 2**30)
    names = [n for n, v in columns.items() if np.any(np.concatenate(v))]
    return names, np.column_stack([np.concatenate(columns[n]) for n in names]), np.concatenate(measured)


def bound() -> dict:
    names, terms, measured = terms_and_measured()
    a = np.column_stack([terms, np.ones(len(measured))])
    scale, _ = nnls(a / measured[:, None], np.ones(len(measured)))
    recipe = np.abs(terms.sum(axis=1) / measured - 1.0)
    fitted = np.abs(a @ scale / measured - 1.0)
    return {
        "runs": len(measured),
        "recipe_median_abs_error": float(np.median(recipe)),
        "reweighted_median_abs_error": float(np.median(fitted)),
        "scales": dict(zip([*names, "fixed_bytes"], map(float, scale), strict=True)),
    }


def main() -> None:
    b = bound()
    print(f"{b['runs']} runs: the recipe's median |error| {b['recipe_median_abs_error']:.3f}; every term re-weighted "
          f"(in sample) {b['reweighted_median_abs_error']:.3f}")  # fmt: skip
    for name, value in b["scales"].items():
        print(f"  {name:20s} {value:.3g}")


if __name__ == "__main__":
    main()
