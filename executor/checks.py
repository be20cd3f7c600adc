"""What the executor can run, checked without torch (so `berth validate` refuses a bad plan
before anything is launched, and the planner never imports torch)."""

from __future__ import annotations

from berth.specs.tree import Layout, ModelSpec, TrainingSpec
from berth.specs.validity import EXECUTOR, Facts, violations

PROGRESS_PREFIX = "BERTH_PROGRESS "  # rank 0's per-step line, read by `berth validate` for its progress display
REQUIRE_GPU_ENV = "BERTH_REQUIRE_GPU"  # `berth validate` sets it to 1 for a GPU plan: no CPU stand-in


class UnsupportedLayout(ValueError):
    """The layout cannot run on this model with this executor (raised before any collective)."""


def check_layout(spec: ModelSpec, training: TrainingSpec, layout: Layout, world: int) -> None:
    """Everything that would make the run fail or train wrongly, said before it starts: the rules
    of berth.specs.validity.RULES that bind the bundled executor (the planner's own, less those only
    the engines have, plus those only this executor has), with `world` the processes launched."""
    facts = Facts(spec, training, world, ranks="processes of the launch")
    problems = [why for _, why in violations(layout, facts, who=EXECUTOR)]
    if problems:
        raise UnsupportedLayout(f"layout {layout.short()}: " + "; ".join(dict.fromkeys(problems)))
