"""Trial runs that pin an engine's parameters down: an experimental design over the fit's sensitivities.

`berth probe` answers "which K short runs should we measure so that `berth calibrate --runs` learns
this engine?". For every candidate layout that is predicted to fit with a margin (MARGIN of the
allocator's capacity left; short of K such layouts, those predicted to fit, and among the layouts a
team gave, the rest: it knows which run), the sensitivities of its log step time and log peak memory to each
parameter a layout informs (DESIGNED: planner/engine_fit.py PARAMETERS less the allocator's reserve,
which measuring both peaks of any run pins; in the fit's coordinates) are its rows of the fit's
Jacobian. The picks greedily maximize the determinant of the information matrix
lambda I + sum J_i^T J_i (D-optimal design, Atkinson & Donev 1992; lambda is the fit's prior weight
squared), i.e. each next run is the one that shrinks the joint uncertainty of the
parameters most given the runs already picked. Each pick says which parameters it pins most
(the largest relative gains of the information matrix's diagonal) and what dominates its step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from berth.cost_models.memory import allocator_capacity_bytes
from berth.cost_models.step import evaluate
from berth.planner.engine_fit import PARAMETERS, PRIOR_WEIGHT, decode, encode, prior_value, with_values
from berth.planner.search import enumerate_candidates, make_plan
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.tree import ClusterSpec, Layout, ModelSpec, Plan, Prediction, SearchSpec, TrainingSpec
from berth.specs.validity import RUNS_MEMORY_ASIDE

MARGIN = 0.15  # a probe must fit with 15 % of the capacity to spare: it is measured, not risked
# a probe is a layout a team might use: among the fitting layouts, those predicted at least this share of the best
# predicted throughput (calibrating where the choice is made, not on layouts nobody would run)
RELEVANT = 0.5
MAX_CANDIDATES = 20_000  # candidates scored for the design (an even sample of the feasible ones beyond)
STEP = 0.05  # the finite-difference step in the fit's coordinates
# the parameters a choice of layouts informs: the allocator's reserve is pinned by measuring both peaks of a run
# (reserved and allocated), whichever layout it is
DESIGNED = [n for n in PARAMETERS if n != "reserve_fraction"]


@dataclass(frozen=True)
class Pick:
    plan: Plan
    pins: tuple[str, ...]  # the parameters this run informs most
    why: str


def sensitivities(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(J: candidates x 2 x parameters, d log step time and d log peak memory per fitted coordinate;
    predicted step time; predicted peak) at the training's tuning, the slopes with its threshold parameters at their
    start at least."""
    names = DESIGNED
    base = evaluate(model, training, cluster, c)
    # a threshold parameter below its start changes nothing and has no slope there: its slope is taken where the
    # fit starts it (planner/engine_fit.py start), so the design can pick the runs that say whether it binds
    prior = {n: prior_value(training.tuning, n, cluster, training.engine) for n in names}
    raised = {n: p.start for n in names if (p := PARAMETERS[n]).start is not None and prior[n] < p.start}
    ref = training.model_copy(update={"tuning": with_values(training.tuning, raised)}) if raised else training
    at = evaluate(model, ref, cluster, c) if raised else base
    t0, m0 = np.log(at.step_time_s), np.log(at.peak_memory_bytes)
    jac = np.zeros((len(c), 2, len(names)))
    for j, n in enumerate(names):
        x = encode(n, prior_value(ref.tuning, n, cluster, training.engine))
        lo, hi = PARAMETERS[n].lo, PARAMETERS[n].hi
        h = STEP if decode(n, x + STEP) <= hi else -STEP
        if decode(n, x + h) < lo:
            continue
        moved = ref.model_copy(update={"tuning": with_values(ref.tuning, {n: decode(n, x + h)})})
        ev = evaluate(model, moved, cluster, c)
        jac[:, 0, j] = (np.log(ev.step_time_s) - t0) / h
        jac[:, 1, j] = (np.log(ev.peak_memory_bytes) - m0) / h
    return np.nan_to_num(jac), base.step_time_s, base.peak_memory_bytes


def design(jac: np.ndarray, k: int) -> tuple[list[int], list[np.ndarray]]:
    """Greedy D-optimal picks (indices into jac's rows) and each pick's relative diagonal gains."""
    p = jac.shape[2]
    info = PRIOR_WEIGHT**2 * np.eye(p)
    picks: list[int] = []
    gains: list[np.ndarray] = []
    for _ in range(min(k, len(jac))):
        inv = np.linalg.inv(info)
        # det(info + J_i^T J_i) / det(info) = det(I_2 + J_i inv J_i^T) (matrix determinant lemma)
        m = np.einsum("nap,pq,nbq->nab", jac, inv, jac)
        score = (1 + m[:, 0, 0]) * (1 + m[:, 1, 1]) - m[:, 0, 1] * m[:, 1, 0]
        score[picks] = -np.inf
        i = int(np.argmax(score))
        new = info + jac[i].T @ jac[i]
        gains.append(np.diag(new) / np.diag(info) - 1.0)
        info = new
        picks.append(i)
    return picks, gains


def probe(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    k: int,
    layouts: list[Layout] | None = None,
    search: SearchSpec | None = None,
) -> list[Pick]:
    """K layouts to measure (among `layouts`, or every layout the search enumerates) that fit with MARGIN
    to spare (short of K such, those predicted to fit; among given layouts, then any) and are predicted at
    RELEVANT of the best throughput or more, chosen to pin the engine's parameters down (module docstring)."""
    if not 1 <= k <= 64:
        raise BerthError("runs", k, "probe 1 to 64 runs")
    c = (
        Candidates.from_layouts(layouts)
        if layouts is not None
        else enumerate_candidates(model, training, cluster, search or SearchSpec())
    )
    with np.errstate(divide="ignore", invalid="ignore"):
        ev = evaluate(model, training, cluster, c)
        capacity = allocator_capacity_bytes(cluster.device, cluster.world_size)
        runnable = np.isin(ev.reason, RUNS_MEMORY_ASIDE) & np.isfinite(ev.step_time_s)
        # with MARGIN to spare; short of k such layouts, those predicted to fit at all; and among layouts the team
        # gave (it knows what runs), the rest too: a run the prior thinks too big corrects the memory model
        tiers = [
            runnable & (ev.peak_memory_bytes <= (1.0 - MARGIN) * capacity),
            runnable & (ev.required_memory_bytes <= capacity),
        ]
        if layouts is not None:
            tiers.append(runnable)
        ok = tiers[-1]  # the widest: fewer than k candidates in all of them
        for tier in tiers:
            if tier.sum() >= k:
                ok = tier
                break
        if ok.any():
            ok &= ev.tokens_per_s >= RELEVANT * ev.tokens_per_s[ok].max()
    idx = np.flatnonzero(ok)
    if idx.size == 0:
        raise BerthError("probe", len(c), "no layout is predicted to fit: give the layouts that run (--layouts)")
    if idx.size > MAX_CANDIDATES:
        idx = idx[np.linspace(0, idx.size - 1, MAX_CANDIDATES).astype(int)]
    sub = c.take(idx)
    with np.errstate(divide="ignore", invalid="ignore"):
        jac, _, _ = sensitivities(model, training, cluster, sub)
    chosen, gains = design(jac, k)
    names = DESIGNED
    out: list[Pick] = []
    with np.errstate(divide="ignore", invalid="ignore"):
        ev_sub = evaluate(model, training, cluster, sub)
    for i, gain in zip(chosen, gains, strict=True):
        plan = make_plan(model, training, cluster, sub, ev_sub, i)
        order = np.argsort(-gain)
        pins = tuple(names[j] for j in order[:3] if gain[j] > 0.05)
        pred = plan.predicted()
        terms = sorted(pred.time_breakdown_s.items(), key=lambda kv: -kv[1])
        share = ", ".join(f"{t} {v / pred.step_time_s:.0%}" for t, v in terms[:2] if v > 0)
        why = (
            f"pins {', '.join(pins) if pins else 'nothing new (the design ran out of information)'}; "
            f"its step is {share}; {pred.peak_memory_bytes / 2**30:.1f} GiB{_room(pred)}"
        )
        out.append(Pick(plan, pins, why))
    return out


def _room(pred: Prediction) -> str:
    """What a pick's predicted memory says of measuring it (nothing when it fits with MARGIN to spare)."""
    room = pred.peak_memory_bytes / pred.memory_capacity_bytes
    if room <= 1.0 - MARGIN:
        return ""
    if room <= 1.0:
        return f" (predicted to leave less than {MARGIN:.0%} of the memory: it may not fit)"
    return " (predicted not to fit: whether it runs corrects the memory model)"
