"""Measured step terms beside predicted ones: the one table that maps what the executor times
(regions, `executor/timing.py`) onto the cost model's terms (`time_breakdown_s`,
`cost_models/step.py`), and the comparison a ValidationReport carries.

Torch-free: the parent side of `berth validate`, `berth report`, `berth calibrate` and the API
read it without importing torch.

How a step is measured (per rank, every step): every instant of the step, from the barrier that
starts it to the end of the optimizer step, belongs to exactly one region, the innermost one open
at that instant (exclusive time). Regions open around code the executor runs (forward, backward,
the optimizer step) and where torch.distributed work is issued and waited for (the collectives,
pipeline sends and receives). Time in no region is `other` (untimed glue: splitting the batch
into micro-batches, zeroing gradients, Python between the regions). So the measured terms plus
`other` add up to the measured step exactly; how much is `other` says how much was not explained.

Error rule: the term with the largest error is the one with the largest absolute difference
|measured - predicted| in seconds, not the largest relative one: a term predicted at 20 us and
measured at 60 us is 200 % off but explains nothing of a step-time gap, and a slowdown is
explained by the seconds it costs.
"""

from __future__ import annotations

from typing import Any

from berth.specs import terms

# term of time_breakdown_s -> (measured regions whose exclusive times add up to it, how it is measured):
# read from the registry of terms (specs/terms.py)
TERM_REGIONS: dict[str, tuple[tuple[str, ...], str]] = {t.name: (t.regions, t.measured_by) for t in terms.TIME}
OTHER = "other"  # the step's time in no region (untimed glue); also collectives on groups of no single axis
TERMS = tuple(TERM_REGIONS)
REGION_TERM = {region: term for term, (regions, _) in TERM_REGIONS.items() for region in regions}
LARGEST_ERROR_RULE = "largest |measured - predicted| in seconds"

# memory: what is measured per term (tensors held at the end of a step) beside memory_breakdown_bytes
MEMORY_MEASURED = {t.name: t.measured_by for t in terms.MEMORY if t.measured_by}
MEMORY_NOTE = (
    "total: the peak (CUDA: max_memory_reserved; CPU: the profiler's allocations replayed by address) "
    "of the rank whose step is shown; parameters, gradients and optimizer_state: tensors held at the "
    "end of a step, measured by walking them; the other terms (activations, logits, buffers, "
    "fragmentation, framework) are not measured apart: they are in the total only"
)


def term_of(region: str) -> str:
    return REGION_TERM.get(region, OTHER)


def terms_from_regions(regions_s: dict[str, float]) -> dict[str, float]:
    """Seconds per term (and `other`) from seconds per region; a term none of whose regions
    occurred is absent."""
    out: dict[str, float] = {}
    for region, seconds in regions_s.items():
        term = term_of(region)
        out[term] = out.get(term, 0.0) + seconds
    return out


def _relative(error: float | None, predicted: float | None) -> float | None:
    return error / predicted if error is not None and predicted else None


def slowest_rank(ranks: list[dict[str, Any]]) -> dict[str, Any] | None:
    """The rank that sets the step time: the largest mean step over the timed steps."""
    timed = [r for r in ranks if r.get("regions_s") is not None]
    return max(timed, key=lambda r: r["step_time_mean_s"]) if timed else None


def compare(prediction: Any, ranks: list[dict[str, Any]], method: str) -> dict[str, Any] | None:
    """The report's `breakdown`: predicted beside measured, term by term, for the rank that sets
    the step time (`prediction`: the plan's Prediction or None; `ranks`: the worker's per-rank
    records). None when no rank measured its terms."""
    rank = slowest_rank(ranks)
    if rank is None:
        return None
    measured = terms_from_regions(rank["regions_s"])
    predicted = dict(prediction.time_breakdown_s) if prediction is not None else {}
    rows: dict[str, dict[str, Any]] = {}
    for term, (_, how) in TERM_REGIONS.items():
        p, m = predicted.get(term), measured.get(term)
        # a term predicted but never seen counts as measured 0; one neither predicted nor seen has no error
        error = None if not predicted or (m is None and not p) else (m or 0.0) - (p or 0.0)
        rows[term] = {
            "predicted_s": p,
            "measured_s": m,
            "error_s": error,
            "relative_error": _relative(error, p),
            "measured_by": how,
        }
    scored = {t: abs(r["error_s"]) for t, r in rows.items() if r["error_s"] is not None}
    largest = max(scored, key=scored.__getitem__) if scored else None
    memory = memory_rows(prediction, rank)
    return {
        "rank": rank["rank"],
        "method": method,
        "step_time_s": rank["step_time_mean_s"],
        "terms": rows,
        "unattributed_s": measured.get(OTHER, 0.0),
        "largest_error_term": largest,
        "largest_error_rule": LARGEST_ERROR_RULE,
        "memory": memory,
        "memory_note": MEMORY_NOTE,
    }


def memory_rows(prediction: Any, rank: dict[str, Any]) -> dict[str, dict[str, Any]]:
    predicted = dict(prediction.memory_breakdown_bytes) if prediction is not None else {}
    state = rank.get("model_state_bytes") or {}
    rows = {}
    for term, how in MEMORY_MEASURED.items():
        p, m = predicted.get(term), state.get(term)
        rows[term] = {
            "predicted_bytes": p,
            "measured_bytes": m,
            "error_bytes": m - p if p is not None and m is not None else None,
            "measured_by": how,
        }
    total_p = sum(predicted.values()) if predicted else None
    total_m = rank.get("peak_memory_bytes")
    rows["total"] = {
        "predicted_bytes": total_p,
        "measured_bytes": total_m,
        "error_bytes": total_m - total_p if total_p is not None and total_m is not None else None,
        "measured_by": "peak of the rank (see memory_note)",
    }
    return rows
