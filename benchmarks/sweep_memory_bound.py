"""How far re-weighting the memory recipe's terms takes it on the Ultra-Scale sweep, in sample.

Every term of rank 0's predicted breakdown under the nanotron entry (cost_models/memory.py stage_memory_breakdown,
first stage: parameters, gradients, optimizer state, activations, logits, buffers, blocks) gets its own non-negative
scale, plus one fixed offset, fitted on every run that ran, both models at once (benchmarks/engine_sweep.py's
records), two ways: least squares and least absolute deviations of the relative error (the latter aims at the
median the issue scores). What is left, the median |predicted / measured - 1|, is what these terms reach with far
more freedom than the memory parameters of planner/engine_fit.py, which scale groups of them, and with every run
in the fit (docs/accuracy.md, "What is still off"). Not a proof that no weighting does better: the median itself
is not what either fit minimizes.

    python -m benchmarks.sweep_memory_bound
"""

from __future__ import annotations

import numpy as np
from scipy.optimize import linprog, nnls

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


def least_absolute(a: np.ndarray) -> np.ndarray:
    """Non-negative x minimizing sum |a x - 1| (a linear program: x >= 0, t >= |a x - 1|)."""
    n, p = a.shape
    eye = np.eye(n)
    result = linprog(
        np.concatenate([np.zeros(p), np.ones(n)]),
        A_ub=np.block([[a, -eye], [-a, -eye]]),
        b_ub=np.concatenate([np.ones(n), -np.ones(n)]),
        bounds=(0, None),
        method="highs",
    )
    if not result.success:
        raise RuntimeError(result.message)
    return result.x[:p]


def bound() -> dict:
    names, terms, measured = terms_and_measured()
    a = np.column_stack([terms, np.ones(len(measured))]) / measured[:, None]
    squares, _ = nnls(a, np.ones(len(measured)))
    absolute = least_absolute(a)
    out = {
        "runs": len(measured),
        "recipe_median_abs_error": float(np.median(np.abs(terms.sum(axis=1) / measured - 1.0))),
        "least_squares_median_abs_error": float(np.median(np.abs(a @ squares - 1.0))),
        "least_absolute_median_abs_error": float(np.median(np.abs(a @ absolute - 1.0))),
    }
    keys = [*names, "fixed_bytes"]
    out["least_squares_scales"] = dict(zip(keys, map(float, squares), strict=True))
    out["least_absolute_scales"] = dict(zip(keys, map(float, absolute), strict=True))
    return out


def main() -> None:
    b = bound()
    print(f"{b['runs']} runs: the recipe's median |error| {b['recipe_median_abs_error']:.3f}; every term re-weighted "
          f"in sample: least squares {b['least_squares_median_abs_error']:.3f}, least absolute deviations "
          f"{b['least_absolute_median_abs_error']:.3f}")  # fmt: skip
    print(f"  {'term':20s} {'squares':>8s} {'absolute':>9s}")
    for name, value in b["least_squares_scales"].items():
        print(f"  {name:20s} {value:8.3g} {b['least_absolute_scales'][name]:9.3g}")


if __name__ == "__main__":
    main()
