"""Rich tables for plans and comparisons (display units live only here: GiB, ms, TFLOP/s)."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table

from berth.cost_models.step import COMM_TERMS
from berth.specs import terms
from berth.specs.tree import LAYOUT_FIELDS, ClusterSpec, Plan, ValidationReport, with_cp

GIB = 2**30
# the breakdown's terms, their order and labels come from the registry (specs/terms.py)


NARROW = 120  # below this many terminal columns the plan table stacks the layout into one cell


def _seconds(x: float) -> str:
    """A duration in the unit a person reads: ms, s, min, h or days."""
    if x < 1:
        return f"{x * 1e3:.1f} ms"
    if x < 120:
        return f"{x:.2f} s"
    if x < 2 * 3600:
        return f"{x / 60:.1f} min"
    if x < 2 * 86400:
        return f"{x / 3600:.1f} h"
    return f"{x / 86400:.1f} days"


def count(n: float) -> str:
    """A parameter count: 7.6M, 70.6B, 1.0T."""
    for unit, scale in (("T", 1e12), ("B", 1e9), ("M", 1e6), ("K", 1e3)):
        if n >= scale:
            return f"{n / scale:.1f}{unit}"
    return f"{n:.0f}"


def _compact_layout(p: Plan) -> str:
    x = p.layout
    parts = [f"tp{x.tp}", *([f"cp{x.cp}"] if x.cp > 1 else []), f"pp{x.pp}", f"dp{x.dp}"]
    if x.ep > 1:
        parts.append(f"ep{x.ep}")
    if x.etp != x.tp:
        parts.append(f"etp{x.etp}")
    if x.zero_stage:
        parts.append(f"z{x.zero_stage}/{x.shard}")
    parts.append(f"mbs{x.micro_batch_size}x{x.num_microbatches}")
    if x.recompute != "none":
        parts.append("rc-" + x.recompute[:3])
    if x.pp > 1:
        parts.append({"gpipe": "gpipe", "1f1b": "1f1b"}.get(x.schedule, f"il{x.virtual_stages}"))
    if x.sequence_parallel:
        parts.append("sp")
    return " ".join(parts)


def _layout_cells(p: Plan, cp: bool = False) -> list[str]:
    x = p.layout
    zero = f"{x.zero_stage}/{x.shard}" if x.zero_stage else "0"
    sched = "-" if x.pp == 1 else x.schedule.replace("interleaved_1f1b", f"interl.x{x.virtual_stages}")
    dp = str(x.dp) + (f" ep{x.ep}" if x.ep > 1 else "")
    return [
        str(x.tp),
        *([str(x.cp)] if cp else []),
        str(x.pp),
        dp,
        zero,
        x.recompute,
        str(x.micro_batch_size),
        str(x.num_microbatches),
        sched,
        "on" if x.sequence_parallel else "off",
    ]


LAYOUT_COLUMNS = ("tp", "pp", "dp", "zero/shard", "recompute", "mbs", "nmb", "schedule", "sp")


def _has_cp(plans: list[Plan]) -> bool:
    """Tables show a cp column (and time: cp_comm) only when a plan uses context parallelism."""
    return any(p.layout.cp > 1 for p in plans)


RESULT_COLUMNS = ("step", "tokens/s", "MFU", "GiB", "fits", "bottleneck")
BOTTLENECK_LEGEND = "bottleneck: " + terms.BOTTLENECK_DEFINITION


def gap_cell(p: Plan, best_tokens_per_s: float | None) -> str:
    """The "vs best" cell: the throughput gap to the best searched plan, only for a layout that fits
    (planning.gap_to_best); "-" for one that does not (its reason is in the bottleneck column)."""
    from berth.planner.planning import gap_to_best

    gap = gap_to_best(p, best_tokens_per_s)
    return "-" if gap is None else f"{gap:+.1%}"


def _result_cells(p: Plan, best_tokens_per_s: float | None, markup: bool = True) -> list[str]:
    pr = p.prediction
    if pr is None:
        cells = ["-", "-", "-", "-", "no", (p.infeasible_reason or "").split(":")[0]]
    else:
        fits = "yes" if pr.fits else ("[red]no[/red]" if markup else "no")
        note = pr.bottleneck if not p.infeasible_reason else p.infeasible_reason.split(":")[0]
        cells = [
            _seconds(pr.step_time_s),
            f"{pr.tokens_per_s:,.0f}",
            f"{pr.mfu:.1%}",
            f"{pr.peak_memory_bytes / GIB:.1f}",
            fits,
            note,
        ]
    if best_tokens_per_s:
        cells.append(gap_cell(p, best_tokens_per_s))
    return cells


def plans_table(plans: list[Plan], title: str, best_tokens_per_s: float | None = None, width: int = 200) -> Table:
    """One row per plan; under NARROW columns the layout is one compact cell (tp8 pp2 dp4 z1/4
    mbs1x16 rc-sel 1f1b sp) so the table fits 80 columns."""
    if width < NARROW:
        return _narrow_plans_table(plans, title, best_tokens_per_s)
    t = Table(title=title, header_style="bold")
    cp = _has_cp(plans)
    columns = (LAYOUT_COLUMNS[0], "cp", *LAYOUT_COLUMNS[1:]) if cp else LAYOUT_COLUMNS
    for col in ("#", *columns, *RESULT_COLUMNS):
        t.add_column(
            col, justify="right" if col not in ("recompute", "schedule", "bottleneck") else "left", no_wrap=True
        )
    if best_tokens_per_s:
        t.add_column("vs best", justify="right")
    for i, p in enumerate(plans, 1):
        t.add_row(str(i), *_layout_cells(p, cp), *_result_cells(p, best_tokens_per_s))
    return t


def _narrow_plans_table(plans: list[Plan], title: str, best_tokens_per_s: float | None) -> Table:
    """The plan table in under 80 columns: the layout in one cell, no step time (tokens/s says
    it; the breakdown below has it) and a misfit's GiB in red (a tight one's in yellow) with its reason
    as the bottleneck; its "vs best" is "-" (the reason says why)."""
    from rich import box

    t = Table(title=title, header_style="bold", box=box.SIMPLE_HEAD, pad_edge=False)
    for col in ("#", "layout", "tokens/s", "MFU", "GiB", "bottleneck", *(("vs best",) if best_tokens_per_s else ())):
        t.add_column(
            col,
            justify="left" if col in ("layout", "bottleneck") else "right",
            no_wrap=col not in ("layout", "bottleneck"),
            overflow="fold",
            min_width=16 if col == "layout" else None,
        )
    for i, p in enumerate(plans, 1):
        pr = p.prediction
        if pr is None:
            cells = ["-", "-", "-", (p.infeasible_reason or "").split(":")[0]]
        else:
            tight = (p.infeasible_reason or "").startswith("memory_tight")
            gib = f"{pr.peak_memory_bytes / GIB:.1f}"
            shown = f"[yellow]{gib}[/yellow]" if tight else gib if pr.fits else f"[red]{gib}[/red]"
            note = pr.bottleneck if not p.infeasible_reason else p.infeasible_reason.split(":")[0]
            cells = [f"{pr.tokens_per_s:,.0f}", f"{pr.mfu:.1%}", shown, note]
        if best_tokens_per_s:
            cells.append(gap_cell(p, best_tokens_per_s))
        t.add_row(str(i), _compact_layout(p), *cells)
    return t


def print_layouts(console: Console, plans: list[Plan], title: str = "layouts (paste into --layout)") -> None:
    """Each plan's layout as one unbroken `--layout` value on its own line (never wrapped by the
    terminal width, so it can be copied whole)."""
    console.print(title + ":", highlight=False)
    for i, p in enumerate(plans, 1):
        console.print(f"#{i} {p.layout.short()}", soft_wrap=True, highlight=False, markup=False)


CSV_PREDICTION = ("step_time_s", "tokens_per_s", "mfu", "hfu", "peak_memory_bytes", "memory_capacity_bytes", "fits")


def csv_header() -> list[str]:
    """The CSV's columns, the same whatever the plans: the engine, its FP8 recipe (empty for bf16), every Layout field,
    the prediction, each time term (seconds), each communication term's traffic hidden or not (seconds), each memory
    term (bytes).
    expert_tp is the degree that runs (tp where the layout leaves it out)."""
    return [
        "rank",
        "engine",
        "fp8",
        *LAYOUT_FIELDS,
        "stage_layers",
        *CSV_PREDICTION,
        "bottleneck",
        *(f"time_{t.name}_s" for t in terms.TIME),
        *(f"comm_total_{name}_s" for name in COMM_TERMS),
        *(f"memory_{m.name}_bytes" for m in terms.MEMORY),
        "vs_best",
        "infeasible_reason",
    ]


def plans_csv(plans: list[Plan], best_tokens_per_s: float | None = None) -> str:
    """The plans as CSV in SI units (seconds, bytes), one row per plan, for spreadsheets; the header
    (`csv_header`) does not depend on the plans."""
    import csv
    import io

    from berth.planner.planning import gap_to_best

    buf = io.StringIO()
    w = csv.writer(buf, lineterminator="\n")
    w.writerow(csv_header())
    for i, p in enumerate(plans, 1):
        pr = p.prediction
        x = p.layout
        lay = [x.etp if f == "expert_tp" else getattr(x, f) for f in LAYOUT_FIELDS]
        lay = [int(v) if isinstance(v, bool) else v for v in lay]
        n_pred = len(CSV_PREDICTION) + 1 + len(terms.TIME) + len(COMM_TERMS) + len(terms.MEMORY)
        if pr is None:
            vals: list = [""] * n_pred
        else:
            vals = [int(v) if isinstance(v, bool) else v for v in (getattr(pr, k) for k in CSV_PREDICTION)]
            vals += [pr.bottleneck]
            vals += [pr.time_breakdown_s.get(t.name, 0.0) for t in terms.TIME]
            vals += [pr.comm_total_s.get(n, pr.time_breakdown_s.get(n, 0.0)) for n in COMM_TERMS]
            vals += [pr.memory_breakdown_bytes.get(m.name, 0.0) for m in terms.MEMORY]
        gap = gap_to_best(p, best_tokens_per_s)
        stages = " ".join(map(str, p.stage_layers)) if p.stage_layers else ""
        row = [i, p.training.engine, p.training.fp8 or "", *lay, stages, *vals]
        w.writerow([*row, "" if gap is None else gap, p.infeasible_reason or ""])
    return buf.getvalue()


def stage_text(p: Plan) -> str:
    """Decoder layers per pipeline stage, runs folded: "7, 8 x14, 7" (specs/stages.py)."""
    if not p.stage_layers:
        return "-"
    runs: list[list[int]] = []
    for n in p.stage_layers:
        if runs and runs[-1][0] == n:
            runs[-1][1] += 1
        else:
            runs.append([n, 1])
    return ", ".join(f"{n} x{k}" if k > 1 else str(n) for n, k in runs)


def shown_time_terms(plans: list[Plan]) -> list[terms.TimeTerm]:
    """The time terms a breakdown of these plans shows (each term's `shown_when`): every term, less
    one tied to an axis no plan uses (cp_comm) or one no plan's breakdown holds (ep_comm: MoE only)."""

    def shown(term: terms.TimeTerm) -> bool:
        if term.shown_when == terms.ALWAYS:
            return True
        if term.shown_when == terms.EMITTED:
            return any(p.prediction and term.name in p.prediction.time_breakdown_s for p in plans)
        return any(getattr(p.layout, term.shown_when) > 1 for p in plans)

    return [term for term in terms.TIME if shown(term)]


def _hidden_s(p: Plan, term: str) -> float:
    """Seconds of a communication term's traffic that compute hides (0 where the prediction has no total:
    a plan from before berth reported it, or a term never hidden)."""
    pr = p.prediction
    if pr is None or term not in pr.comm_total_s:
        return 0.0
    total = pr.comm_total_s[term]
    return total - pr.time_breakdown_s.get(term, 0.0) if total > 1.001 * pr.time_breakdown_s.get(term, 0.0) else 0.0


def breakdown_table(plans: list[Plan], title: str) -> Table:
    """Time and memory by term; a communication term compute partly hides has a second row, its whole
    traffic, beside the row of what it adds to the step (time_breakdown_s: the exposed part)."""
    t = Table(title=title, header_style="bold")
    t.add_column("term")
    for i, _ in enumerate(plans, 1):
        t.add_column(f"#{i}", justify="right")
    if any(p.layout.pp > 1 for p in plans):
        t.add_row("layers per stage", *[stage_text(p) if p.layout.pp > 1 else "-" for p in plans])
    for term in shown_time_terms(plans):
        t.add_row(
            f"time: {term.label}",
            *[_seconds(p.prediction.time_breakdown_s.get(term.name, 0.0)) if p.prediction else "-" for p in plans],
        )
        if any(_hidden_s(p, term.name) > 0.0 for p in plans):
            t.add_row(
                f"  {term.label} traffic, hidden or not",
                *[
                    _seconds(p.prediction.comm_total_s[term.name]) if p.prediction and _hidden_s(p, term.name) else "-"
                    for p in plans
                ],
            )
    for mem in terms.MEMORY:
        t.add_row(
            f"memory: {mem.label}",
            *[
                f"{p.prediction.memory_breakdown_bytes.get(mem.name, 0.0) / GIB:.2f} GiB" if p.prediction else "-"
                for p in plans
            ],
        )
    t.add_row(
        "memory: usable (device less driver, CUDA context)",
        *[f"{p.prediction.memory_capacity_bytes / GIB:.2f} GiB" if p.prediction else "-" for p in plans],
    )
    return t


def print_reasons(console: Console, plans: list[Plan]) -> None:
    """Why each layout that does not fit (or is not ranked) is so; its layout is in `print_layouts`."""
    from rich.markup import escape

    for i, p in enumerate(plans, 1):
        if p.infeasible_reason:
            console.print(f"  #{i}: [yellow]{escape(p.infeasible_reason)}[/yellow]", highlight=False)


def _metric(key: str, value: float | None) -> str:
    if value is None:
        return "-"
    if key == "step_time_s":
        return _seconds(value)
    if key == "peak_memory_bytes":
        return f"{value / 2**20:,.1f} MiB" if value < GIB else f"{value / GIB:.2f} GiB"
    if key == "tokens_per_s":
        return f"{value:,.0f}"
    return f"{value:.4f}"


def validation_table(report: ValidationReport) -> Table:
    spread = report.step_time_spread_s
    title = (
        f"{report.plan.model.name} {report.plan.layout.short()}: {report.status} "
        f"({report.steps} steps after {report.warmup} warm-up, {report.mode})"
    )
    t = Table(title=title, header_style="bold")
    for col in ("metric", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col == "metric" else "right")
    names = {
        "step_time_s": "step time (median, slowest rank)",
        "tokens_per_s": "tokens/s",
        "peak_memory_bytes": "peak memory (max rank)",
        "loss": "first-step loss (pred. ln V)",
    }
    for key, name in names.items():
        p, m = getattr(report.predicted, key), getattr(report.measured, key)
        err = report.relative_error.get(key)
        t.add_row(name, _metric(key, p), _metric(key, m), f"{err:+.1%}" if err is not None else "-")
    if spread:
        t.add_row("step time min..max", "", f"{_seconds(spread['min'])}..{_seconds(spread['max'])}", "")
    if report.losses:
        t.add_row("loss first -> last", "", f"{report.losses[0]:.4f} -> {report.losses[-1]:.4f}", "")
    if report.mode == "rank-slice" and report.per_rank:
        r = report.per_rank[0]
        pred_mb = r["predicted_forward_backward_per_microbatch_s"]
        meas_mb = r["forward_per_microbatch_s"] + r["backward_per_microbatch_s"]
        t.add_row("fwd+bwd per micro-batch", _seconds(pred_mb), _seconds(meas_mb), f"{meas_mb / pred_mb - 1:+.1%}")
        t.add_row(
            "optimizer step",
            _seconds(r["predicted_optimizer_s"]),
            _seconds(r["optimizer_s"]),
            f"{r['optimizer_s'] / r['predicted_optimizer_s'] - 1:+.1%}" if r["predicted_optimizer_s"] else "-",
        )
    return t


def hierarchy_table(cluster: ClusterSpec) -> Table:
    """The cluster's hierarchy of fast domains, innermost first."""
    t = Table(
        title=f"{cluster.name}: {cluster.nodes} nodes x {cluster.gpus_per_node} GPUs, fast domains innermost first",
        header_style="bold",
    )
    for col in ("level", "GPUs a block", "link", "GB/s per GPU", "limited by", "hop latency"):
        t.add_column(col, justify="left" if col in ("level", "link", "limited by") else "right")
    for lv in cluster.levels:
        t.add_row(
            lv.name,
            str(lv.gpus),
            lv.link.kind,
            f"{lv.link.bandwidth_bytes_per_s / 1e9:,.2f}",
            lv.limited_by,
            f"{lv.link.hop_latency_s * 1e6:.1f} us",
        )
    return t


def print_placement(console: Console, plan: Plan, label: str, only_crossings: bool = False) -> None:
    """Where the plan's process groups sit; each group that leaves the innermost fast domain over
    a slower link is called out with what that costs per step."""
    for note in plan.cluster.notes:
        if not only_crossings:
            console.print(f"[yellow]note[/yellow]: {note}")
    pl = plan.placement
    if pl is None:
        return
    crossing = [g for g in pl.groups if g.crosses_slow_link]
    if not only_crossings:
        narrow = console.width < NARROW
        order = "-".join(with_cp(pl.axis_order.split("-"))) if plan.layout.cp > 1 else pl.axis_order
        t = Table(title=f"placement of {label} (axis order {order}, innermost first)", header_style="bold")
        cols = (
            "axis",
            "size",
            "groups",
            "stride",
            "nodes a group",
            "slowest level",
            "link",
            "GB/s per GPU",
            "comm / step",
            "cost of crossing",
        )
        skip = {"groups", "stride", "nodes a group"} if narrow else set()
        for col in cols:
            if col not in skip:
                t.add_column(col, justify="left" if col in ("axis", "slowest level", "link") else "right")
        for g in pl.groups:
            if g.size == 1:
                continue
            row = dict(
                zip(
                    cols,
                    (
                        g.axis,
                        str(g.size),
                        str(g.count),
                        str(g.stride),
                        str(g.nodes_spanned),
                        g.level,
                        g.link_kind,
                        f"{g.bandwidth_bytes_per_s / 1e9:,.2f}",
                        _seconds(g.time_s),
                        _seconds(g.cost_of_crossing_s) if g.crosses_slow_link else "-",
                    ),
                    strict=True,
                )
            )
            t.add_row(*[v for k, v in row.items() if k not in skip])
        console.print(t)
    inner = plan.cluster.levels[0]
    for g in crossing:
        share = g.cost_of_crossing_s / plan.prediction.step_time_s if plan.prediction else 0.0
        console.print(
            f"{label}: {g.axis} groups ({g.size} ranks) cross {g.link_kind} at "
            f"{g.bandwidth_bytes_per_s / 1e9:,.2f} GB/s per GPU ({g.level}) instead of "
            f"{inner.link.kind} at {inner.link.bandwidth_bytes_per_s / 1e9:,.0f}: "
            f"+{_seconds(g.cost_of_crossing_s)} per step ({share:.1%} of the step)"
        )


def goodput_table(plans: list[Plan], title: str) -> Table:
    """Checkpoint size and stall, failures, goodput and cost of each plan."""
    t = Table(title=title, header_style="bold")
    t.add_column("term")
    for i, _ in enumerate(plans, 1):
        t.add_column(f"#{i}", justify="right")
    goods = [p.prediction.goodput if p.prediction else None for p in plans]
    rows = [
        ("checkpoint (total)", lambda g: f"{g.checkpoint_bytes_total / GIB:,.0f} GiB"),
        ("checkpoint per rank", lambda g: f"{g.checkpoint_bytes_per_rank / GIB:,.2f} GiB x {g.checkpoint_writers}"),
        ("checkpoint write", lambda g: _seconds(g.checkpoint_write_s)),
        ("interval (Young/Daly)", lambda g: _seconds(g.checkpoint_interval_s)),
        ("stall per step", lambda g: _seconds(g.checkpoint_stall_s_per_step)),
        ("job MTBF", lambda g: f"{g.mtbf_s / 3600:,.1f} h"),
        ("lost per failure", lambda g: _seconds(g.lost_work_per_failure_s)),
        ("goodput", lambda g: f"{g.goodput_tokens_per_s:,.0f} tok/s ({g.goodput_fraction:.1%})"),
        (
            "cost / M tokens",
            lambda g: f"{g.cost_per_million_tokens:,.3f}" if g.cost_per_million_tokens is not None else "-",
        ),
        (
            "cost of the budget",
            lambda g: f"{g.cost_for_token_budget:,.0f}" if g.cost_for_token_budget is not None else "-",
        ),
        (
            "energy / M tokens (TDP)",
            lambda g: (
                f"{g.energy_kwh_per_million_tokens:,.2f} kWh" if g.energy_kwh_per_million_tokens is not None else "-"
            ),
        ),
    ]
    for name, cell in rows:
        t.add_row(name, *[cell(g) if g else "-" for g in goods])
    return t


def _ms(x: float | None) -> str:
    return "-" if x is None else f"{x * 1e3:.2f}"


def _mib(x: float | None) -> str:
    return "-" if x is None else f"{x / 2**20:,.1f}"


def measured_terms_table(report: ValidationReport) -> Table:
    """Predicted beside measured, term by term (report.breakdown), the largest error marked."""
    b = report.measured_breakdown()
    t = Table(
        title=f"step terms, rank {b.rank} (the rank that sets the step time; mean of {report.steps} timed steps)",
        header_style="bold",
    )
    for col in ("term", "predicted ms", "measured ms", "error ms", "error"):
        t.add_column(col, justify="left" if col == "term" else "right")
    for term, row in b.terms.items():
        mark = " <- largest error" if term == b.largest_error_term else ""
        rel = f"{row.relative_error:+.0%}" if row.relative_error is not None else "-"
        err = f"{row.error_s * 1e3:+.2f}" if row.error_s is not None else "-"
        style = "bold red" if mark else None
        t.add_row(term + mark, _ms(row.predicted_s), _ms(row.measured_s), err, rel, style=style)
    t.add_row("other (untimed glue)", "", _ms(b.unattributed_s), "", "")
    predicted = sum(r.predicted_s or 0.0 for r in b.terms.values())
    t.add_row(
        "step",
        _ms(predicted),
        _ms(b.step_time_s),
        f"{(b.step_time_s - predicted) * 1e3:+.2f}",
        f"{b.step_time_s / predicted - 1:+.0%}" if predicted else "-",
        style="bold",
    )
    return t


def measured_memory_table(report: ValidationReport) -> Table:
    b = report.measured_breakdown()
    t = Table(title=f"memory, rank {b.rank} (MiB)", header_style="bold")
    for col in ("term", "predicted", "measured", "error"):
        t.add_column(col, justify="left" if col == "term" else "right")
    for term, row in b.memory.items():
        err = f"{row.error_bytes / 2**20:+,.1f}" if row.error_bytes is not None else "-"
        t.add_row(
            term, _mib(row.predicted_bytes), _mib(row.measured_bytes), err, style="bold" if term == "total" else None
        )
    return t


def measured_regions_line(report: ValidationReport) -> str:
    """The shown rank's measured regions (each collective kind apart), largest first."""
    b = report.measured_breakdown()
    rank = next((r for r in report.per_rank if r.get("rank") == b.rank and r.get("regions_s")), None)
    if rank is None:
        return ""
    regions = sorted(rank["regions_s"].items(), key=lambda kv: -kv[1])
    return f"regions of rank {b.rank} (ms per step): " + ", ".join(f"{k} {v * 1e3:.2f}" for k, v in regions)
