"""PNG figures of a validation report's measured breakdown (`berth report --png`): the timeline
of one step per rank (the pipeline "comb") and predicted against measured per term.

matplotlib is an optional extra (`pip install 'berth[plot]'`); it is imported only here and only
when a figure is drawn.
"""

from __future__ import annotations

from pathlib import Path
from types import ModuleType

from berth.cost_models.breakdown import OTHER, TERMS, term_of
from berth.specs.terms import TIME as TIME_TERMS
from berth.specs.tree import ValidationReport

COLORS = {**{t.name: t.colour for t in TIME_TERMS}, OTHER: "#f0e442"}  # the terms' own from the registry
# compute is drawn in two shades in the timeline, so that a schedule's forwards and backwards show
SHADES = {"forward": ("compute: forward", "#8fb0e0"), "backward": ("compute: backward", "#2f5597")}
EXTRA = "plot"  # the pyproject extra that installs matplotlib


def have_matplotlib() -> bool:
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return False
    return True


def _pyplot() -> ModuleType:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def timeline_png(report: ValidationReport, path: str | Path) -> Path:
    """One row per rank: the regions of that rank's step of median length, coloured by the term
    they count for (compute in two shades: forward, backward), from the barrier that starts the
    step (each rank's own clock)."""
    plt = _pyplot()
    ranks = [r for r in report.per_rank if r.get("timeline")]
    fig, ax = plt.subplots(figsize=(9, 0.45 * len(ranks) + 1.5), dpi=100)
    seen: set[str] = set()
    for row, r in enumerate(ranks):
        for start, end, region in r["timeline"]:
            label, color = SHADES.get(region) or (term_of(region), COLORS[term_of(region)])
            ax.broken_barh(
                [(start * 1e3, (end - start) * 1e3)],
                (row - 0.4, 0.8),
                facecolors=color,
                label=None if label in seen else label,
            )
            seen.add(label)
    ax.set_yticks(range(len(ranks)), [f"rank {r['rank']}" for r in ranks])
    ax.invert_yaxis()
    ax.set_xlabel("ms from the start of the step")
    ax.set_title(f"{report.plan.model.name} {report.plan.layout.short()}: one step per rank", fontsize=9)
    handles, labels = ax.get_legend_handles_labels()
    names = [n for t in (*TERMS, OTHER) for n in ([s[0] for s in SHADES.values()] if t == "compute" else [t])]
    order = [labels.index(n) for n in names if n in labels]
    ax.legend(
        [handles[i] for i in order],
        [labels[i] for i in order],
        loc="upper left",
        bbox_to_anchor=(1.0, 1.0),
        fontsize=8,
        frameon=False,
    )
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)


def terms_png(report: ValidationReport, path: str | Path) -> Path:
    """Predicted and measured seconds per term (the rank that sets the step time), the term
    with the largest error marked."""
    plt = _pyplot()
    b = report.measured_breakdown()
    terms = [t for t, r in b.terms.items() if (r.predicted_s or 0) > 0 or r.measured_s is not None]
    x = range(len(terms))
    fig, ax = plt.subplots(figsize=(8, 3.6), dpi=100)
    pred = [(b.terms[t].predicted_s or 0.0) * 1e3 for t in terms]
    meas = [(b.terms[t].measured_s or 0.0) * 1e3 for t in terms]
    ax.bar([i - 0.2 for i in x], pred, 0.4, label="predicted", facecolor="none", edgecolor="#333333", hatch="//")
    ax.bar([i + 0.2 for i in x], meas, 0.4, label="measured", color=[COLORS[t] for t in terms], edgecolor="#333333")
    ax.set_xticks(list(x), [t + (" *" if t == b.largest_error_term else "") for t in terms])
    ax.set_ylabel("ms per step")
    ax.set_title(
        f"{report.plan.model.name} {report.plan.layout.short()}\npredicted vs measured per step, rank "
        f"{b.rank} (* largest error: {b.largest_error_term})",
        fontsize=9,
    )
    ax.legend(fontsize=8, frameon=False)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return Path(path)
