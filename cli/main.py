"""`berth` command line: a thin edge over berth.planner.planning. Bad input exits 2 with one line."""

# No `from __future__ import annotations` here: typer would eval every option's annotation string
# of every command at each start (30 ms of `berth plan`).
import json
import os
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich import box
from rich.console import Console
from rich.padding import Padding

from berth.launch.writers import formats_text
from berth.specs import __version__
from berth.specs.errors import BerthError
from berth.specs.tree import ClusterSpec, ModelSpec, Plan, TrainingSpec, pick_plan

# Imports of the commands live inside them: `berth plan` loads neither torch, the service stack
# (fastapi, uvicorn), scipy nor the executor (`python -X importtime -m berth.cli.main plan ...`;
# tests/test_cli.py checks it).

# Exit codes: 0 done (also when the reader of the output goes away: `berth plan ... | head -1`), 1 no layout
# fits (plan) or a validation failed (validate), 2 bad input, 130 interrupted.
EXIT_NO_FIT = 1
# plain click help (rich_markup_mode=None): wrapped at the terminal's width, option names never truncated
app = typer.Typer(no_args_is_help=True, help="berth: plan parallel layouts for training.", rich_markup_mode=None)


class _Console(Console):
    """rich's Console, but a closed pipe (the reader gone: `| head`) ends the command quietly with 0."""

    def on_broken_pipe(self) -> None:
        _quiet_exit()


def _quiet_exit() -> None:
    """The reader of stdout is gone: point stdout at /dev/null (so the interpreter's last flush cannot
    fail) and exit 0."""
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())
    raise SystemExit(0)


console = _Console()  # the terminal's width (80 when piped): tables adapt, see berth.cli.render.NARROW


def _version(value: bool) -> None:
    if value:
        print(f"berth {__version__}")
        raise typer.Exit()


@app.callback()
def _main(
    version: Annotated[
        bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version and exit")
    ] = False,
) -> None:
    """berth: plan parallel layouts for training."""


def _out_file(path: str | None, field: str = "out") -> None:
    """Refuse, before any work, an output file that cannot be written."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise BerthError(field, path, "is a directory; give a file path")
    parent = p.parent
    if not parent.is_dir():
        raise BerthError(field, path, f"directory {str(parent)!r} does not exist")
    if not os.access(parent, os.W_OK) or (p.exists() and not os.access(p, os.W_OK)):
        raise BerthError(field, path, "not writable")


def _write(path: str, text: str, field: str = "out") -> None:
    try:
        Path(path).write_text(text)
    except OSError as err:
        raise BerthError(field, path, f"cannot write: {err.strerror}") from None


def _at_least(field: str, value: float | None, low: float) -> None:
    if value is not None and value < low:
        raise BerthError(field, value, f"must be at least {low:g}")


Model = Annotated[str, typer.Argument(help="preset name, a model YAML/JSON file, or an HF config.json")]
Cluster = Annotated[
    str,
    typer.Option(
        "--cluster",
        help="cluster preset (dgx-h100, dgx-a100-80g, dgx-b200, aws-p5, ...: see `berth presets`), "
        "a topology graph FILE.json (see `berth topology`), or 'local': this machine",
    ),
]
Fabric = Annotated[str, typer.Option("--fabric", help="with a preset: rails (one rail switch per NIC) or fat-tree")]
PerLeaf = Annotated[int | None, typer.Option("--nodes-per-leaf", help="fat-tree: nodes per leaf switch")]
Oversub = Annotated[float, typer.Option("--oversubscription", help="fat-tree: leaf downlink / uplink bandwidth")]
Objective = Annotated[
    str, typer.Option("--objective", help="rank by throughput, goodput (after checkpoints and failures) or cost")
]
Failures = Annotated[
    float | None, typer.Option("--failures-per-gpu-hour", help="default 1.97e-5 (Llama 3 pre-training)")
]
Storage = Annotated[
    float | None,
    typer.Option("--storage-gbps-per-gpu", help="filesystem write GB/s per GPU (default 0.122, Llama 3's Tectonic)"),
]
Price = Annotated[float | None, typer.Option("--price-per-gpu-hour", help="for cost per step and per token")]
Budget = Annotated[float | None, typer.Option("--token-budget", help="tokens to train on, for the total cost")]
Nodes = Annotated[int, typer.Option("--nodes", help="number of nodes")]
Devices = Annotated[
    int | None,
    typer.Option(
        "--devices-per-node", help="with --cluster local: GPUs to use, or CPU worker processes (default: all)"
    ),
]
SeqLen = Annotated[int, typer.Option("--seq-len", help="sequence length (tokens)")]
Batch = Annotated[int, typer.Option("--global-batch", help="global batch (sequences per step)")]
Precision = Annotated[
    str | None,
    typer.Option(
        "--precision",
        help="bf16, fp16 or fp32 (default: bf16 on GPUs, fp32 on CPU); fp8: bf16 with the engine's first FP8 recipe",
    ),
]
AttentionKernel = Annotated[
    str | None,
    typer.Option(
        "--attention-kernel",
        help="the fused attention kernel the stack runs: sdpa (today's PyTorch, the default), flash2 "
        "(FlashAttention-2 class: PyTorch and Transformer Engine of 2024) or flash1",
    ),
]
Fp8 = Annotated[
    str | None,
    typer.Option(
        "--fp8",
        help="run the linear layers' GEMMs in FP8 with this recipe: delayed or tensorwise (Megatron, Transformer "
        "Engine), rowwise or rowwise_with_gw_hp (torchtitan, torchao); `berth engines` lists each engine's",
    ),
]
Flash = Annotated[bool, typer.Option("--flash-attention/--no-flash-attention", help="FlashAttention kernels")]
EngineOpt = Annotated[
    str | None,
    typer.Option(
        "--engine",
        "--framework",
        help="the training engine: executor (berth's, the default), torchtitan, megatron (NeMo, Megatron-Bridge), "
        "deepspeed, llmfoundry, nanotron or generic (to calibrate); `berth engines` lists what each runs. "
        "--framework is the old name (pytorch = executor)",
    ),
]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]
Headroom = Annotated[
    float | None,
    typer.Option(
        "--memory-headroom",
        help="share of the device memory a plan must leave free to be ranked as fitting (default: the engine's, "
        "0.05; nanotron and generic 0.10); closer to the capacity it is 'memory_tight' and not ranked",
        show_default=False,
    ),
]
Csv = Annotated[bool, typer.Option("--csv", help="print the plans as CSV (SI units) instead of tables")]


Profile = Annotated[
    str | None,
    typer.Option(
        "--profile",
        help="a `berth profile` output (measured device, and with --cluster local links) or an engine profile "
        "(`berth calibrate --runs ... --out`: the engine and its fitted parameters)",
    ),
]


def _inputs(
    model: str,
    cluster: str,
    nodes: int,
    devices: int | None,
    seq_len: int,
    global_batch: int,
    precision: str | None,
    flash: bool,
    profile: str | None = None,
    fabric: tuple = ("rails", None, 1.0),
    operations: tuple = (None, None, None),
    token_budget: float | None = None,
    engine: str | None = None,
    fp8: str | None = None,
    attention_kernel: str | None = None,
) -> tuple[ModelSpec, TrainingSpec, ClusterSpec]:
    """The options of `plan` and `compare` as berth.planner.inputs takes them (the service's
    bodies become the same values); the CLI may read files."""
    from berth.planner.inputs import ClusterInput, OperationsInput, TrainingInput, resolve

    kind, per_leaf, oversubscription = fabric
    return resolve(
        model,
        ClusterInput(cluster, nodes, devices, kind, per_leaf, oversubscription, profile=profile),
        TrainingInput(
            seq_len, global_batch, precision, flash, engine, token_budget, fp8=fp8, attention_kernel=attention_kernel
        ),
        OperationsInput(*operations),
        allow_files=True,
    )


def _unit(cluster) -> str:
    return "CPU workers" if cluster.device.kind == "cpu" else "GPUs"


def _read_text(path: str, field: str, expected: str) -> str:
    """A local file's text; an unreadable or binary one is refused naming the option and the path."""
    try:
        return Path(path).read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors write one) is no text
    except OSError as err:
        raise BerthError(field, path, f"cannot read: {err.strerror}") from None
    except UnicodeDecodeError:
        raise BerthError(field, path, f"not a text file (expected {expected})") from None


@app.command("plan")
def plan_cmd(
    model: Model,
    cluster: Cluster = "dgx-h100",
    nodes: Nodes = 1,
    devices: Devices = None,
    profile: Profile = None,
    fabric: Fabric = "rails",
    nodes_per_leaf: PerLeaf = None,
    oversubscription: Oversub = 1.0,
    seq_len: SeqLen = 4096,
    global_batch: Batch = 256,
    precision: Precision = None,
    flash: Flash = True,
    engine: EngineOpt = None,
    fp8: Fp8 = None,
    attention_kernel: AttentionKernel = None,
    top: Annotated[int, typer.Option("--top", help="how many plans to show")] = 5,
    fix: Annotated[str, typer.Option("--fix", help="restrict the search, e.g. tp=8,pp=2 or tp=8,cp=16,pp=16")] = "",
    max_mbs: Annotated[int | None, typer.Option("--max-mbs", help="largest micro-batch to try")] = None,
    memory_headroom: Headroom = None,
    objective: Objective = "throughput",
    failures: Failures = None,
    storage_gbps: Storage = None,
    price: Price = None,
    token_budget: Budget = None,
    show_fallback: Annotated[
        bool, typer.Option("--fallback", help="also plan the best layout for the cluster with one node lost")
    ] = False,
    spare_nodes: Annotated[
        int, typer.Option("--spare-nodes", help="keep this many nodes as hot spares: plan on the rest")
    ] = 0,
    as_json: Json = False,
    as_csv: Csv = False,
) -> None:
    """Search every valid layout and show the fastest that fit (exit 1 when none fits, with the reason)."""
    from berth.cli.render import (
        BOTTLENECK_LEGEND,
        breakdown_table,
        count,
        goodput_table,
        plans_csv,
        plans_table,
        print_layouts,
        print_placement,
    )
    from berth.planner.inputs import make_search
    from berth.planner.planning import lose_nodes, plan, plans_json, with_fallback

    if as_json and as_csv:
        raise BerthError("csv", True, "give --json or --csv, not both")
    spec, training, cl = _inputs(
        model,
        cluster,
        nodes,
        devices,
        seq_len,
        global_batch,
        precision,
        flash,
        profile,
        (fabric, nodes_per_leaf, oversubscription),
        (failures, storage_gbps, price),
        token_budget,
        engine,
        fp8,
        attention_kernel,
    )
    if spare_nodes:
        if not 0 < spare_nodes < cl.nodes:
            why = f"must be in 1..{cl.nodes - 1} (of {cl.nodes} nodes" if cl.nodes > 1 else "needs 2+ nodes (of 1"
            raise BerthError("spare_nodes", spare_nodes, f"{why}: one must stay to train)")
        cl = lose_nodes(cl, spare_nodes)
    search_spec = make_search(
        top=top, fix=fix, max_micro_batch_size=max_mbs, objective=objective, memory_headroom=memory_headroom
    )
    result = plan(spec, training, cl, search_spec)
    if show_fallback:
        result = with_fallback(result, search_spec)
    if as_json:
        print(json.dumps(plans_json(result, cl)))
    elif as_csv:
        sys.stdout.write(plans_csv(result.plans))
    if not result.plans:
        _no_fit(result, cl, as_json or as_csv)
    if as_json or as_csv:
        return
    moe = (
        f", MoE {spec.num_experts} experts top-{spec.experts_per_token}, {count(spec.active_params)} active"
        if spec.is_moe
        else ""
    )
    head = (
        f"{spec.name} ({count(spec.num_params)} params{moe}) on {cl.nodes} x {cl.name} "
        f"({cl.world_size} {_unit(cl)}), seq {seq_len}, global batch {global_batch}, {training.precision}, "
        f"engine {training.engine}"
        + (f" ({training.tuning.profile})" if training.tuning.profile else "")
        + (f", FP8 {training.fp8}" if training.fp8 else "")
    )
    console.print(plans_table(result.plans, head, width=console.width))
    print_layouts(console, result.plans)
    console.print(BOTTLENECK_LEGEND, highlight=False)
    rejected = ", ".join(f"{k} {v:,}" for k, v in result.rejected.items()) or "none"
    console.print(f"searched {result.searched:,} layouts: {result.feasible:,} feasible; rejected: {rejected}")
    if result.plans:
        console.print(breakdown_table(result.plans, "where the time and memory go"))
        console.print(goodput_table(result.plans, f"checkpoints, failures and cost (ranked by {objective})"))
        print_placement(console, result.plans[0], "#1")
        for note in result.notes:
            console.print(f"[yellow]note[/yellow]: {note}", highlight=False)
        fb = result.plans[0].fallback
        if show_fallback and fb is None:
            console.print("[red]fallback[/red]: no layout fits the cluster with one node lost")
        if fb is not None:
            console.print(
                f"fallback with {fb.nodes_lost} node lost: {fb.layout.short()}, "
                f"{fb.tokens_per_s:,.0f} tokens/s; " + "; ".join(fb.changes)
            )


def _no_fit(result, cluster, quiet: bool) -> None:
    """Exit EXIT_NO_FIT with the reason (planning.why_none: the text the service gives)."""
    from berth.planner.planning import why_none

    if not quiet:
        rejected = ", ".join(f"{k} {v:,}" for k, v in result.rejected.items()) or "none"
        console.print(f"searched {result.searched:,} layouts: {result.feasible:,} feasible; rejected: {rejected}")
    Console(stderr=True).print(
        f"[red]no layout fits[/red]: {why_none(result, cluster)}", highlight=False, soft_wrap=True
    )
    raise typer.Exit(EXIT_NO_FIT)


LayoutsFile = Annotated[
    str | None, typer.Option("--layouts", help="a file of layouts, one per line ('#' starts a comment)")
]


def _given_layouts(layout: list[str] | None, layouts_file: str | None) -> list[str]:
    """The --layout options, then the lines of the --layouts file."""
    given = list(layout or [])
    if layouts_file is not None:
        text = _read_text(layouts_file, "layouts", "one layout a line")
        given += [x for x in (line.split("#", 1)[0].strip() for line in text.splitlines()) if x]
        if not given:
            raise BerthError("layouts", layouts_file, "no layout in it")
    return given


@app.command("compare")
def compare_cmd(
    model: Model,
    layout: Annotated[
        list[str] | None,
        typer.Option("--layout", help="tp=8,pp=4,dp=2,zero=1,recompute=selective,... (repeat it)"),
    ] = None,
    layouts_file: LayoutsFile = None,
    cluster: Cluster = "dgx-h100",
    nodes: Nodes = 1,
    devices: Devices = None,
    profile: Profile = None,
    fabric: Fabric = "rails",
    nodes_per_leaf: PerLeaf = None,
    oversubscription: Oversub = 1.0,
    seq_len: SeqLen = 4096,
    global_batch: Batch = 256,
    precision: Precision = None,
    flash: Flash = True,
    engine: EngineOpt = None,
    fp8: Fp8 = None,
    attention_kernel: AttentionKernel = None,
    memory_headroom: Headroom = None,
    failures: Failures = None,
    storage_gbps: Storage = None,
    price: Price = None,
    token_budget: Budget = None,
    as_json: Json = False,
    as_csv: Csv = False,
) -> None:
    """Predict given layouts side by side, with the gap to the best layout the search finds."""
    from berth.cli.render import (
        BOTTLENECK_LEGEND,
        breakdown_table,
        plans_csv,
        plans_table,
        print_layouts,
        print_placement,
        print_reasons,
    )
    from berth.planner.planning import compare_json, compare_with_best

    if as_json and as_csv:
        raise BerthError("csv", True, "give --json or --csv, not both")
    spec, training, cl = _inputs(
        model,
        cluster,
        nodes,
        devices,
        seq_len,
        global_batch,
        precision,
        flash,
        profile,
        (fabric, nodes_per_leaf, oversubscription),
        (failures, storage_gbps, price),
        token_budget,
        engine,
        fp8,
        attention_kernel,
    )
    given = _given_layouts(layout, layouts_file)
    if not given:
        raise BerthError("layout", None, "the layouts to compare: --layout tp=..,pp=.. (repeat it), --layouts FILE")
    candidates, best = compare_with_best(spec, training, cl, given, memory_headroom)
    out = compare_json(candidates, best, memory_headroom)
    headroom = out["memory_headroom"]
    if as_json:
        print(json.dumps(out))
        return
    ref = best.plans[0].predicted().tokens_per_s if best and best.plans else None
    if as_csv:
        sys.stdout.write(plans_csv(candidates, ref))
        return
    console.print(
        plans_table(
            candidates,
            f"{spec.name} on {cl.world_size} {_unit(cl)}, engine {training.engine}"
            + (f" ({training.tuning.profile})" if training.tuning.profile else "")
            + (f", FP8 {training.fp8}" if training.fp8 else "")
            + ": candidates",
            ref,
            width=console.width,
        )
    )
    print_layouts(console, candidates)
    print_reasons(console, candidates)
    console.print(BOTTLENECK_LEGEND, highlight=False)
    pick = out["choice"]
    console.print(
        f"berth's pick among these: #{pick + 1}, the fastest predicted to fit with the memory headroom ({headroom:.0%})"
        if pick is not None
        else f"berth's pick among these: none is predicted to fit with the memory headroom ({headroom:.0%})",
        highlight=False,
    )
    if best and best.plans:
        b = best.plans[0]
        console.print(f"best searched layout, at {b.predicted().tokens_per_s:,.0f} tokens/s:", highlight=False)
        console.print(f"  {b.layout.short()}", soft_wrap=True, highlight=False, markup=False)
    console.print(breakdown_table(candidates, "breakdowns"))
    for i, p in enumerate(candidates, 1):
        print_placement(console, p, f"#{i}", only_crossings=True)


@app.command("topology")
def topology_cmd(
    servers: Annotated[
        list[str],
        typer.Argument(
            help="PRESET[:NODES]..., e.g. dgx-h100:4, or a graph FILE.json "
            "to inspect; several presets make a mixed cluster"
        ),
    ],
    fabric: Fabric = "rails",
    nodes_per_leaf: PerLeaf = None,
    oversubscription: Oversub = 1.0,
    out: Annotated[str | None, typer.Option("--out", help="write the node-link graph JSON here")] = None,
    as_json: Json = False,
) -> None:
    """Build a cluster's topology graph from presets (or read one) and show its fast domains."""
    from berth.planner.inputs import load_graph_file, preset_graph

    _out_file(out)
    if len(servers) == 1 and servers[0].endswith(".json"):
        data, cl = None, load_graph_file(servers[0])
    else:
        data, cl = preset_graph(servers, fabric, nodes_per_leaf, oversubscription)
    if out and data is not None:
        _write(out, json.dumps(data, indent=1) + "\n")
    if as_json:
        print(json.dumps(data if data is not None else cl.model_dump(mode="json")))
        return
    from berth.cli.render import hierarchy_table

    console.print(hierarchy_table(cl))
    for note in cl.notes:
        console.print(f"[yellow]note[/yellow]: {note}")
    if out and data is not None:
        console.print(
            f"graph ({len(data['nodes'])} nodes, {len(data['links'])} links) written to {out}; "
            f"plan on it with --cluster {out}"
        )


@app.command("presets")
def presets_cmd(as_json: Json = False) -> None:
    """List the model, cluster and device presets."""
    from rich.table import Table

    from berth.cli.render import count
    from berth.hardware_profiles import device_names, load_device, load_server, server_names
    from berth.specs.models import presets

    servers = [load_server(n) for n in server_names()]
    devices = [load_device(n) for n in device_names()]
    if as_json:
        print(
            json.dumps(
                {
                    "models": sorted(presets()),
                    "clusters": [s.name for s in servers],
                    "devices": [d.name for d in devices],
                }
            )
        )
        return
    t = Table(title="cluster presets (per node)", header_style="bold")
    for col in ("name", "device", "GPUs", "intra-node GB/s", "inter-node GB/s per GPU", "description"):
        t.add_column(col, no_wrap=col in ("name", "device"), overflow="fold")  # a name is printed whole
    for s in servers:
        t.add_row(
            s.name,
            s.device,
            str(s.gpus_per_node),
            f"{s.intra_node.bandwidth_bytes_per_s / 1e9:g} {s.intra_node.kind}",
            f"{s.inter_node.bandwidth_bytes_per_s / 1e9:g} {s.inter_node.kind}",
            s.display_name,
        )
    console.print(t)
    d = Table(title="devices", header_style="bold")
    for col in ("name", "bf16 TFLOP/s", "memory GiB", "memory TB/s", "description"):
        d.add_column(col, no_wrap=col == "name", overflow="fold")
    for x in devices:
        d.add_row(
            x.name,
            f"{x.peak_flops('bf16') / 1e12:g}",
            f"{x.memory_bytes / 2**30:.0f}",
            f"{x.memory_bandwidth_bytes_per_s / 1e12:.3g}",
            x.display_name,
        )
    console.print(d)
    console.print(
        "models: " + ", ".join(f"{n} ({count(m.num_params)})" for n, m in sorted(presets().items())), highlight=False
    )


@app.command("validate")
def validate_cmd(
    plan_file: Annotated[str, typer.Argument(help="a plan JSON, or the output of `berth plan --json`")],
    pick: Annotated[int, typer.Option("--pick", help="which plan of the file (1 = first)")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="timed steps")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed steps first")] = 2,
    out: Annotated[str | None, typer.Option("--out", help="write the ValidationReport JSON here")] = None,
    store: Annotated[
        str | None,
        typer.Option(
            "--store", help="SQLite results store (default $BERTH_STORE_PATH or ~/.local/share/berth/berth.sqlite)"
        ),
    ] = None,
    timeout: Annotated[
        float | None, typer.Option("--timeout", help="watchdog in seconds (default: from the predicted step time)")
    ] = None,
    oversubscribe: Annotated[bool, typer.Option("--oversubscribe", help="allow more CPU workers than cores")] = False,
    proxy: Annotated[
        str | None,
        typer.Option(
            "--proxy", help="rank-slice: run one rank's share of a plan larger than this machine in one process"
        ),
    ] = None,
    layers: Annotated[
        int | None,
        typer.Option("--layers", help="with --proxy: layers of the stage to run (default: all of one stage)"),
    ] = None,
    stage: Annotated[
        str | None,
        typer.Option(
            "--stage",
            help="with --proxy: first or last pipeline stage (default: the one predicted to hold more memory)",
        ),
    ] = None,
    trace: Annotated[
        str | None,
        typer.Option(
            "--trace",
            help="write a Chrome/Perfetto trace of one more step per rank into this directory (torch.profiler)",
        ),
    ] = None,
    as_json: Json = False,
) -> None:
    """Run a plan on this machine with torch.distributed and compare measured with predicted, term
    by term (`berth report` renders a saved report)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from berth.cli.render import measured_terms_table, validation_table
    from berth.executor.validate import validate, validate_proxy
    from berth.planner.store import Store

    _at_least("steps", steps, 1)
    _at_least("warmup", warmup, 0)
    _at_least("layers", layers, 1)
    if timeout is not None and not timeout > 0:
        raise BerthError("timeout", timeout, "must be a positive number of seconds")
    _out_file(out)
    _store_file(store)
    chosen = _load_plan(plan_file, pick)
    if proxy not in (None, "rank-slice"):
        raise BerthError("proxy", proxy, "the only proxy is rank-slice")
    if proxy is None and (layers is not None or stage is not None):
        raise BerthError("layers" if layers is not None else "stage", layers or stage, "applies to --proxy rank-slice")
    if proxy and trace:
        raise BerthError("trace", trace, "traces are written by full runs, not by --proxy rank-slice")
    if trace and Path(trace).exists() and not Path(trace).is_dir():
        raise BerthError("trace", trace, "exists and is not a directory")
    db = Store(store)
    err = Console(stderr=True)
    total = steps + warmup
    with Progress(
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=err,
        transient=True,
    ) as bar:
        what = "one rank's slice in 1 process" if proxy else f"{chosen.layout.world_size} processes"
        task = bar.add_task(f"validating {chosen.layout.short()} on {what} (starting)", total=total)

        def progress(p: dict) -> None:
            loss = f"  loss {p['loss']:.4f}" if p.get("loss") is not None else ""
            bar.update(
                task,
                completed=p["step"],
                description=f"step {p['step']}/{p['of']}{loss}  {p['step_time_s'] * 1e3:.0f} ms",
            )

        if proxy:
            report = validate_proxy(
                chosen,
                layers=layers,
                stage=stage,
                steps=steps,
                warmup=warmup,
                store=db,
                out=out,
                on_progress=progress,
                timeout_s=timeout,
            )
        else:
            report = validate(
                chosen,
                steps=steps,
                warmup=warmup,
                store=db,
                out=out,
                on_progress=progress,
                oversubscribe=oversubscribe,
                timeout_s=timeout,
                trace_dir=trace,
            )
    if as_json:
        print(report.model_dump_json())
    else:
        console.print(validation_table(report))
        if report.breakdown is not None:
            console.print(measured_terms_table(report))
        if report.traces:
            console.print("traces (chrome://tracing or https://ui.perfetto.dev):\n  " + "\n  ".join(report.traces))
        if report.mode == "rank-slice":
            console.print(
                "rank-slice proxy: the step time above is one rank's compute (no communication, no "
                "bubble). Not checked:\n  - " + "\n  - ".join(report.checks["not_checked"])
            )
        where = f"report {report.id} stored in {db.path}" + (f" and written to {out}" if out else "")
        console.print(where)
    if report.status != "ok":
        Console(stderr=True).print(f"[red]{report.status}:[/red] {report.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


def _is_plan_file(path: Path) -> bool:
    """`berth plan --json`'s answer, a plan or a list of them (`berth launch --out`'s plan.json), not a report."""
    try:
        data = json.loads(path.read_text())
    except ValueError:
        return False
    one = data[0] if isinstance(data, list) and data else data
    answer = isinstance(data, dict) and "plans" in data
    return answer or isinstance(one, dict) and {"layout", "prediction"} <= one.keys()


@app.command("report")
def report_cmd(
    report_file: Annotated[str, typer.Argument(help="a ValidationReport JSON (`berth validate --out`)")],
    png: Annotated[
        str | None,
        typer.Option(
            "--png",
            help="also save the per-rank timeline of one step and the "
            "predicted-vs-measured chart as PNG files in this directory "
            "(needs matplotlib: the `plot` extra)",
        ),
    ] = None,
) -> None:
    """Show a validation report: predicted beside measured, term by term, with the largest error
    named; the traces it lists; with --png the timeline ("comb") and the bar chart."""
    from pydantic import ValidationError

    from berth.cli.render import (
        measured_memory_table,
        measured_regions_line,
        measured_terms_table,
        validation_table,
    )
    from berth.specs.errors import from_validation_error
    from berth.specs.tree import ValidationReport

    path = Path(report_file)
    if not path.is_file():
        raise BerthError("report", report_file, "no such file" if not path.exists() else "not a file")
    try:
        report = ValidationReport.model_validate_json(path.read_text())
    except UnicodeDecodeError:
        raise BerthError("report", report_file, "not a text file (expected a ValidationReport JSON)") from None
    except ValidationError as err:
        if _is_plan_file(path):
            raise BerthError("report", report_file, "a plan, not a report: `berth validate` it first") from None
        raise from_validation_error(err, "report") from None
    if png is not None:
        from berth.cli.plots import EXTRA, have_matplotlib

        if not have_matplotlib():
            raise BerthError("png", png, f"needs matplotlib: pip install 'berth[{EXTRA}]'")
        if report.breakdown is None:
            raise BerthError("png", png, "the report has no measured breakdown to draw")
        if Path(png).exists() and not Path(png).is_dir():
            raise BerthError("png", png, "exists and is not a directory")
    console.print(validation_table(report))
    if report.breakdown is None:
        console.print(
            "no measured breakdown in this report (a failed run, a rank-slice proxy, or a report from "
            "before berth measured step terms)"
        )
    else:
        b = report.breakdown
        console.print(measured_terms_table(report))
        console.print(measured_regions_line(report), highlight=False)
        console.print(f"largest error: {b.largest_error_term} ({b.largest_error_rule}); clock: {b.method}")
        console.print(measured_memory_table(report))
        console.print(b.memory_note, style="dim")
    if report.traces:
        console.print("traces (chrome://tracing or https://ui.perfetto.dev):\n  " + "\n  ".join(report.traces))
    if png is not None:
        from berth.cli.plots import terms_png, timeline_png

        out = Path(png)
        out.mkdir(parents=True, exist_ok=True)
        stem = report.id[:8]
        written = [timeline_png(report, out / f"{stem}-timeline.png"), terms_png(report, out / f"{stem}-terms.png")]
        console.print("written: " + ", ".join(str(p) for p in written))


@app.command("launch")
def launch_cmd(
    plan_file: Annotated[str, typer.Argument(help="a plan JSON, or the output of `berth plan --json`")],
    fmt: Annotated[
        str | None,
        typer.Option(
            "--format",
            help=f"{formats_text()} (default: the plan's engine's own; another engine's format "
            "re-predicts the layout for that engine)",
        ),
    ] = None,
    pick: Annotated[int, typer.Option("--pick", help="which plan of the file (1 = first)")] = 1,
    out: Annotated[str, typer.Option("--out", help="directory for the files")] = "berth-launch",
    steps: Annotated[int, typer.Option("--steps", help="executor formats: timed steps")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="executor formats: untimed steps first")] = 3,
    image: Annotated[
        str, typer.Option("--image", help="kubernetes: container image with berth and torch")
    ] = "berth-executor:latest",
    train: Annotated[
        str,
        typer.Option(
            "--train",
            help="engine formats: the training run, e.g. train_steps=20000,lr=1e-4,warmup_steps=2000,decay=cosine,"
            "checkpoint_interval=500 (defaults and ranges: docs/engines.md)",
        ),
    ] = "",
) -> None:
    """Write the files that launch a plan: per-node torchrun scripts, an sbatch script or a PyTorchJob
    running the bundled executor, or Megatron-LM / DeepSpeed / torchtitan / nanotron configs for the layout."""
    from berth.launch.writers import artifacts, engine_training

    _at_least("steps", steps, 1)
    _at_least("warmup", warmup, 0)
    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise BerthError("out", out, "exists and is not a directory; give a directory for the files")
    from berth.planner.planning import plan_for_format

    plan, fmt, note = plan_for_format(_load_plan(plan_file, pick), fmt)
    if note:
        console.print(f"[yellow]note[/yellow]: {note}", highlight=False)
    files = artifacts(plan, fmt, steps=steps, warmup=warmup, image=image, training=engine_training(train))
    try:
        directory.mkdir(parents=True, exist_ok=True)
        for name, text in files.items():
            path = directory / name
            path.write_text(text)
            if name.endswith((".sh", ".sbatch")):
                path.chmod(0o755)
            console.print(f"wrote {path}")
    except OSError as err:
        raise BerthError("out", out, f"cannot write: {err.strerror}") from None
    console.print(f"{fmt} launch of {plan.layout.short()} ({plan.layout.world_size} ranks)")


@app.command("profile")
def profile_cmd(
    out: Annotated[str, typer.Option("--out", help="where to write the profile")] = "berth-profile.json",
    quick: Annotated[bool, typer.Option("--quick", help="fewer shapes, sizes and repeats (under a minute)")] = False,
    max_procs: Annotated[
        int | None,
        typer.Option("--max-procs", help="largest process count for collectives (default: cores or GPUs, at most 8)"),
    ] = None,
) -> None:
    """Measure this machine (GEMMs, memory bandwidth, attention, collectives) into a profile that
    plan, compare and --cluster local accept with --profile."""
    _out_file(out)
    _at_least("max_procs", max_procs, 1)
    from berth.executor.validate import require_torch

    require_torch("`berth profile`")
    from berth.executor.profile import attention_backends, run_profile

    err = Console(stderr=True)
    with err.status("profiling") as status:
        result = run_profile(quick=quick, max_procs=max_procs, progress=lambda msg: status.update(f"profiling: {msg}"))
    _write(out, json.dumps(result, indent=2))
    dev, link, checks = result["device"], result["server"]["intra_node"], result.get("checks", {})
    peak = max(v for k, v in dev["peak_flops_per_s"].items() if k != "fp8")  # the precisions the profile measured
    kernels = attention_backends(result["measurements"]["attention"])
    console.print(
        f"{dev['display_name']}: peak {peak / 1e9:,.1f} GFLOP/s, best GEMM "
        f"{checks.get('best_gemm_flops_per_s', peak) / 1e9:,.1f} GFLOP/s, memory "
        f"{dev['memory_bandwidth_bytes_per_s'] * dev['memory_bandwidth_fraction'] / 1e9:.1f} GB/s, "
        f"attention {dev['attention_peak_fraction']:.0%} of peak ({', '.join(kernels) or 'kernel not recorded'}), "
        f"op overhead {dev['kernel_overhead_s'] * 1e6:.1f} us"
    )
    if "square_matmul_flops_per_s" in checks:
        console.print(
            f"square 8192 matmul {checks['square_matmul_flops_per_s'] / 1e12:.0f} TFLOP/s, GEMM curve top "
            f"{checks['curve_top_flops_per_s'] / 1e12:.0f} TFLOP/s ({checks['curve_top_vs_square']:+.1%}"
            f"{'' if checks['peak_agrees'] else ': more than 5% apart, rerun on an idle GPU'})"
        )
    console.print(
        f"collectives: all-reduce bus bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, time vs "
        "all-reduce: " + ", ".join(f"{k} x{v:.2f}" for k, v in link["op_time_scale"].items())
    )
    console.print(f"written to {out}")


@app.command("calibrate")
def calibrate_cmd(
    reports: Annotated[
        list[str] | None, typer.Argument(help="ValidationReport JSON files (default: the store)")
    ] = None,
    out: Annotated[str | None, typer.Option("--out", help="write the calibrated profile here")] = None,
    store: Annotated[str | None, typer.Option("--store", help="SQLite results store to read reports from")] = None,
    device: Annotated[str | None, typer.Option("--device", help="only reports planned for this device")] = None,
    holdout: Annotated[float, typer.Option("--holdout", help="fraction of reports held out of the fit")] = 0.3,
    seed: Annotated[int, typer.Option("--seed", help="seed of the held-out split")] = 0,
    params: Annotated[
        str | None,
        typer.Option("--params", help="comma-separated parameters to fit (default: every one the reports determine)"),
    ] = None,
    terms: Annotated[
        bool,
        typer.Option(
            "--terms/--step-only",
            help="fit to the step terms full runs measured "
            "(compute, communication, optimizer...) as well as to step totals",
        ),
    ] = True,
    runs: Annotated[
        str | None,
        typer.Option("--runs", help="measured runs of any engine, JSON lines (see README: teach berth your engine)"),
    ] = None,
    log: Annotated[
        list[str] | None, typer.Option("--log", help="a torchtitan, Megatron-LM or nanotron training log (with --plan)")
    ] = None,
    plan_file: Annotated[
        list[str] | None,
        typer.Option("--plan", help="the plan the --log runs ran: one for every log, or one per --log, in order"),
    ] = None,
    prior: Annotated[str | None, typer.Option("--prior", help="an engine profile to start the fit from")] = None,
) -> None:
    """Fit the cost model's named efficiency parameters to validation reports (scipy least_squares)
    and print the error on the fitted reports and on those held out, with each fitted value's
    uncertainty; parameters the reports cannot determine keep the profile's values. With --runs (or --log and
    --plan): fit an engine's parameters to its measured runs, and write an engine profile that plan, compare and
    probe take with --profile."""
    from pydantic import ValidationError
    from rich.table import Table

    from berth.planner.calibrate import PARAMETERS, calibrate, profile_document
    from berth.planner.store import read_validations
    from berth.specs.errors import from_validation_error
    from berth.specs.tree import ValidationReport

    if runs or log:
        _calibrate_runs(runs or "", log or [], plan_file or [], out, prior)
        return
    if not 0.0 <= holdout < 1.0:
        raise BerthError("holdout", holdout, "must be in [0, 1)")
    _out_file(out)
    loaded = []
    if reports:
        for path in reports:
            text = _read_text(path, "reports", "a ValidationReport JSON")
            try:
                loaded.append(ValidationReport.model_validate_json(text))
            except ValidationError as err:
                raise from_validation_error(err, f"reports[{path}]") from None
    else:
        loaded = read_validations(store, status="ok")
    if device:
        loaded = [r for r in loaded if r.plan.cluster.device.name == device]
    names = tuple(n.strip() for n in params.split(",") if n.strip()) if params else None
    fit = calibrate(loaded, holdout=holdout, seed=seed, names=names, terms=terms)
    kinds = ", ".join(f"{v} {k}" for k, v in fit.kinds.items() if v)
    t = Table(  # names and numbers whole in 80 columns; why a parameter is not fitted goes under the table
        title=f"calibration on {len(fit.fit_ids)} reports ({len(fit.held_out_ids)} held out; {kinds})",
        box=box.SIMPLE_HEAD,
        show_edge=False,
        collapse_padding=True,
    )
    for col in ("parameter", "before", "after", "± s.e.", "95% interval"):
        t.add_column(col, justify="left" if col == "parameter" else "right", no_wrap=col != "95% interval")
    why_not = []  # under the table: in a column of it a reason wrapped a word a line at 80 columns
    for name in PARAMETERS:
        u = fit.uncertainty.get(name)
        if u:
            t.add_row(
                name,
                f"{fit.initial[name]:.4g}",
                f"{fit.values[name]:.4g}",
                f"{u['standard_error']:.2g}",
                f"{u['ci95'][0]:.3g} .. {u['ci95'][1]:.3g}",
            )
        else:
            t.add_row(name, f"{fit.initial[name]:.4g}", "-", "", "")
            if fit.not_fitted.get(name):
                why_not.append(f"  {name} not fitted: {fit.not_fitted[name]}")
    console.print(t)
    for line in why_not:
        console.print(line)
    if fit.term_residuals:
        console.print(
            "measured step terms in the fit: "
            + ", ".join(f"{k} {v}" for k, v in fit.term_residuals.items())
            + " (besides every report's step total and peak memory)"
        )
    else:
        console.print(
            "no measured step terms in the fit: "
            + ("--step-only" if not terms else "the reports carry no breakdown (validated before berth measured terms)")
            + "; the time parameters are fitted to step totals"
        )
    for name in fit.fitted:
        touched = fit.touched.get(name, {})
        if not touched:
            continue
        console.print(
            f"  {name} touched: "
            + ", ".join(f"{term} ({n} measured)" if n else f"{term} (step total only)" for term, n in touched.items())
        )
    e = Table(title="errors (fractions)")
    for col in ("reports", "step-time MAPE", "worst", "memory MAPE", "worst"):
        e.add_column(col, justify="left" if col == "reports" else "right")
    for key, errs in fit.errors.items():
        if errs:
            nan = float("nan")
            e.add_row(
                key.replace("_", " "),
                f"{errs['step_time_mape']:.3f}",
                f"{errs['step_time_max_error']:.3f}",
                f"{errs.get('memory_mape', nan):.3f}",
                f"{errs.get('memory_max_error', nan):.3f}",
            )
    console.print(e)
    if out:
        Path(out).write_text(
            json.dumps(profile_document(fit, "reports given" if reports else "results store"), indent=2)
        )
        console.print(f"calibrated profile written to {out} (use it with --profile)")


@app.command("engines")
def engines_cmd(as_json: Json = False) -> None:
    """The engines berth plans for: version, memory recipe, compute stack, launch formats and what each cannot run
    (specs/engines.py)."""
    from rich.table import Table

    from berth.specs.engines import ENGINES, engine_table, memory_extras

    if as_json:
        print(json.dumps(engine_table()))
        return
    rows = {
        name: {
            "version": [e.version],
            "memory": [e.recipe, *(f"+ {x}" for x in memory_extras(e))],
            "launch": list(e.launch_formats) or ["-"],
            "fp8": list(e.fp8_recipes) or ["-"],
            "refuses": [r.name.removeprefix(f"{name}_") for r in e.rules] or ["-"],
        }
        for name, e in ENGINES.items()
    }
    t = Table(title="engines (--engine)")
    for col in ("engine", *next(iter(rows.values()))):
        t.add_column(col, no_wrap=True)
    for name, cells in rows.items():
        t.add_row(name, *("\n".join(v) for v in cells.values()))
    if console.measure(t, options=console.options.update_width(1000)).maximum > console.width:  # narrower: blocks
        t = Table.grid(padding=(0, 1))
        t.title = "engines (--engine)"
        t.add_column(no_wrap=True)
        t.add_column()
        for name, cells in rows.items():
            t.add_row(f"[bold]{name}[/bold]", "")
            for key, v in cells.items():
                t.add_row(f"  {key}", " ".join(v) if key == "memory" else ", ".join(v))
    console.print(t)


@app.command("probe")
def probe_cmd(
    model: Model,
    cluster: Cluster = "dgx-h100",
    nodes: Nodes = 1,
    devices: Devices = None,
    profile: Profile = None,
    seq_len: SeqLen = 4096,
    global_batch: Batch = 256,
    precision: Precision = None,
    flash: Flash = True,
    engine: EngineOpt = None,
    fp8: Fp8 = None,
    attention_kernel: AttentionKernel = None,
    runs: Annotated[int, typer.Option("--runs", help="how many trial runs to pick (1-64)")] = 8,
    max_mbs: Annotated[int | None, typer.Option("--max-mbs", help="largest micro-batch to try")] = None,
    layout: Annotated[
        list[str] | None,
        typer.Option(
            "--layout",
            help="pick only among these layouts (repeat it; those your engine and cluster can run); default: every "
            "layout the search enumerates",
        ),
    ] = None,
    layouts_file: LayoutsFile = None,
    out: Annotated[
        str | None, typer.Option("--out", help="write each pick's plan (and its engine's launch files) here")
    ] = None,
    as_json: Json = False,
) -> None:
    """Pick the short trial runs whose measurements pin this engine's parameters down best (a D-optimal
    design over the fit's sensitivities, among layouts predicted to fit with 15 % memory to spare), say why
    each was picked, and write their plans and launch files. Measure them, then `berth calibrate --runs`."""
    from berth.planner.inputs import make_search
    from berth.planner.planning import parse_layouts
    from berth.planner.probe import probe

    _at_least("runs", runs, 1)
    spec, training, cl = _inputs(
        model,
        cluster,
        nodes,
        devices,
        seq_len,
        global_batch,
        precision,
        flash,
        profile,
        engine=engine,
        fp8=fp8,
        attention_kernel=attention_kernel,
    )
    given = _given_layouts(layout, layouts_file)
    candidates = parse_layouts(spec, training, cl, given) if given else None
    note = Console(stderr=True) if as_json else console  # with --json, notes go to stderr
    _say_refused(candidates or [], spec, training, cl, note)
    picks = probe(spec, training, cl, runs, layouts=candidates, search=make_search(max_micro_batch_size=max_mbs))
    if len(picks) < runs:
        note.print(
            f"note: {len(picks)} of the {runs} runs asked: no more distinct layouts "
            + ("among those given " if candidates else "")
            + "fit with the margin a probe needs",
            highlight=False,
        )
    if out:  # first: a folder it may not write is refused before anything is printed
        _write_probe_files(out, picks, note)
    if as_json:
        print(
            json.dumps(
                {
                    "engine": training.engine,
                    "picks": [
                        {
                            "layout": p.plan.layout.short(),
                            "pins": list(p.pins),
                            "why": p.why,
                            "plan": p.plan.model_dump(mode="json"),
                        }
                        for p in picks
                    ],
                }
            )
        )
    else:
        for i, p in enumerate(picks, 1):
            console.print(f"{i:2d}. {p.plan.layout.short()}", highlight=False, soft_wrap=True)
            console.print(Padding(p.why, (0, 0, 0, 4)), highlight=False)
    if not as_json:
        console.print(
            "measure each (step time or tokens/s, peak memory, or that it ran out of memory), write one JSON line per "
            "run, then: berth calibrate --runs RUNS.jsonl --out ENGINE-PROFILE.json",
            highlight=False,
        )


def _say_refused(layouts: list, spec, training, cl, note: Console) -> None:
    """Given layouts that break a rule (the engine's included) are not picked: say which and why (the first few); when
    all do, refuse naming the first (exit 2)."""
    from berth.specs.layouts import layout_problems

    refused = [(i, x, p[0]) for i, x in enumerate(layouts) if (p := layout_problems(x, spec, training, cl))]
    if refused and len(refused) == len(layouts):
        i, x, (name, why) = refused[0]
        raise BerthError(f"layout[{i}]", x.short(), f"{name}: {why} (every given layout breaks a rule: none to pick)")
    if refused:
        shown = "; ".join(f"layout[{i}] {x.short()}: {name}: {why}" for i, x, (name, why) in refused[:3])
        note.print(
            f"note: {len(refused)} of the {len(layouts)} given layouts break a rule and were not picked ({shown}"
            + ("; ..." if len(refused) > 3 else "")
            + ")",
            highlight=False,
            soft_wrap=True,
        )


def _write_probe_files(out: str, picks: list, note: Console) -> None:
    from berth.launch.writers import artifacts
    from berth.specs.engines import ENGINES

    directory = Path(out)
    if directory.exists() and not directory.is_dir():
        raise BerthError("out", out, "exists and is not a directory")
    earlier = sorted(p.name for p in directory.glob("probe-*")) if directory.is_dir() else []
    if earlier or (directory / "runs.jsonl").exists():  # a team's measurements are never overwritten
        raise BerthError("out", out, f"holds earlier probes ({', '.join(earlier) or 'runs.jsonl'}): give a new folder")
    try:
        for i, p in enumerate(picks, 1):
            sub = directory / f"probe-{i:02d}"
            sub.mkdir(parents=True, exist_ok=True)
            (sub / "plan.json").write_text(p.plan.model_dump_json(indent=1))
            formats = ENGINES[p.plan.training.engine].launch_formats
            if formats:
                for name, text in artifacts(p.plan, formats[0]).items():
                    (sub / name).write_text(text)
                    if name.endswith((".sh", ".sbatch")):
                        (sub / name).chmod(0o755)
        template = [
            {
                "plan": f"probe-{i:02d}/plan.json",
                "status": "ok",
                "tokens_per_s": None,
                "peak_memory_gib": None,
                "memory_kind": "reserved",
                "memory_rank": "max",  # "rank0" or "last" where the figure is one rank's (a log line's)
            }
            for i in range(1, len(picks) + 1)
        ]
        (directory / "runs.jsonl").write_text("".join(json.dumps(t) + "\n" for t in template))
        engine = ENGINES[picks[0].plan.training.engine] if picks else None
        files = (
            "and their engine's launch files"
            if engine is None or engine.launch_formats
            else f"no launch files: berth writes none for {engine.label}; set each layout in your config"
        )
        note.print(
            f"wrote {len(picks)} plans ({files}) under {directory}/, and "
            f"{directory}/runs.jsonl to fill in with what each run measured (or status oom/error)"
        )
    except OSError as err:
        raise BerthError("out", out, f"cannot write: {err.strerror}") from None


def _calibrate_runs(runs_file: str, logs: list[str], plans: list[str], out: str | None, prior: str | None) -> None:
    """`berth calibrate --runs/--log`: fit an engine to measured runs (planner/engine_fit.py)."""
    from rich.table import Table

    from berth.planner.engine_fit import (
        CEILING,
        MEMORY_PARAMETERS,
        PARAMETERS,
        fit_engine,
        prior_value,
        read_engine_profile,
        recipe_no_reference,
    )
    from berth.planner.run_logs import read_log, read_runs

    _out_file(out)
    runs = []
    if runs_file:
        text = _read_text(runs_file, "runs", "JSON lines")
        runs.extend(read_runs(text, runs_file, base=Path(runs_file).resolve().parent))
    if logs:
        if not plans:
            raise BerthError(
                "plan",
                None,
                "--log needs --plan: the plan that ran (`berth plan --top 1 --json` output, a probe's plan.json)",
            )
        if len(plans) not in (1, len(logs)):
            raise BerthError("plan", plans, f"one --plan for every log, or one per --log ({len(logs)}), in order")
        loaded = {path: _the_plan_that_ran(path) for path in plans}
        for path, plan_path in zip(logs, plans * len(logs) if len(plans) == 1 else plans, strict=True):
            try:
                run = read_log(path, loaded[plan_path])
            except OSError as err:
                raise BerthError("log", path, f"cannot read: {err.strerror}") from None
            runs.append(run)
            peak = f", peak {run.peak_memory_bytes / 2**30:.1f} GiB" if run.peak_memory_bytes else ", no peak memory"
            console.print(  # what the fit is given, before it answers (or refuses)
                f"{path}: {run.training.engine} log of {run.layout.short()}: step {run.step_time_s:.3g} s{peak}"
                + (f" {run.memory_kind} ({run.memory_rank})" if run.peak_memory_bytes else ""),
                highlight=False,
                soft_wrap=True,
            )
    tuning = None
    if prior:
        try:
            engine, tuning = read_engine_profile(json.loads(Path(prior).read_text()), "prior")
        except (OSError, ValueError) as err:
            if isinstance(err, BerthError):
                raise
            raise BerthError("prior", prior, f"cannot read an engine profile: {err}") from None
        given = sorted({r.training.engine for r in runs} - {engine})
        if given:
            raise BerthError("prior", prior, f"an engine profile of {engine}; the runs are of {', '.join(given)}")
    fit = fit_engine(runs, tuning)
    cl = runs[0].cluster
    measured = ", ".join(f"{v} {k.replace('_', ' ')}" for k, v in fit.counts.items() if v)
    t = Table(title=f"engine {fit.engine}: fitted on {len(fit.run_ids)} runs (measured: {measured})")
    for col in ("parameter", "prior", "fitted", "± s.e.", "95% interval / why not"):
        t.add_column(
            col,
            justify="left" if col in ("parameter", "95% interval / why not") else "right",
            no_wrap=col == "parameter",
        )
    last = None  # the row above's reason: the same again reads "as above" (a memory fit set back names six)
    for name in PARAMETERS:
        before = prior_value(fit.prior, name, cl, fit.engine)
        u = fit.uncertainty.get(name)
        if u:
            t.add_row(
                name,
                f"{before:.4g}",
                f"{u['value']:.4g}" + (" (bound)" if u["at_bound"] else ""),
                f"{u['standard_error']:.2g}",
                f"{u['ci95'][0]:.3g} .. {u['ci95'][1]:.3g}",
            )
            last = None
        else:
            why = fit.not_fitted.get(name, "")
            t.add_row(name, f"{before:.4g}", "not fitted", "", "as above" if why and why == last else why)
            last = why
    console.print(t)
    for run_id, why in fit.set_aside.items():
        console.print(f"[yellow]set aside[/yellow]: run {run_id}: {why}", highlight=False)
    if fit.counts.get("at_ceiling"):
        console.print(
            f"{fit.counts['at_ceiling']} run(s) reached the allocator's ceiling (reserved >= {CEILING:.0%} of the "
            "capacity): their peak is read as a lower bound, their step time (slowed by the allocator's retries) "
            "is left out",
            highlight=False,
        )
    e = fit.errors
    warned = False  # the memory fit's held-out warning already printed
    # a memory fit not kept: its held-out figures (held_out_after then holds the kept prior's)
    memory_fit = e.get("held_out_memory_fit") or e.get("held_out_after", {})
    for q, label in (("step_time", "step time"), ("memory", "peak memory")):
        key = f"{q}_median_error"
        if key in e["fit_after"]:
            held = (
                f"; held out (k-fold): {e['held_out_before'][key]:.1%} -> {e['held_out_after'][key]:.1%}"
                if key in e.get("held_out_after", {})
                else ""
            )
            console.print(
                f"{label}: median |error| on the runs {e['fit_before'][key]:.1%} -> {e['fit_after'][key]:.1%}{held}",
                highlight=False,
            )
            if e["fit_after"][key] > 0.5:  # no parameter within its bounds reaches these runs
                console.print(
                    f"[yellow]warning[/yellow]: the fit still misses the runs' {label} by {e['fit_after'][key]:.0%} "
                    "at the median: check that each run's plan is the one that ran (layout, batch, sequence, cluster)",
                    highlight=False,
                )
            tried = memory_fit if q == "memory" else e.get("held_out_after", {})
            worse = tried.get(key, 0.0) > e.get("held_out_before", {}).get(key, float("inf"))
            warned |= worse and q == "memory"
            if worse:
                console.print(
                    f"[yellow]warning[/yellow]: on runs it did not see, the fit predicts {label} worse than the "
                    + (
                        f"prior ({tried[key]:.1%}): the prior's memory parameters are kept"
                        if q == "memory"
                        else "prior: these runs do not pin its parameters down (measure more, or more varied, runs)"
                    ),
                    highlight=False,
                )
    refused = memory_fit.get("ran_predicted_not_to_fit", 0.0)
    if refused > e.get("held_out_before", {}).get("ran_predicted_not_to_fit", 0.0) and not warned:
        kept = any(n in MEMORY_PARAMETERS for n in fit.fitted)
        closer = recipe_no_reference(e)
        console.print(
            f"[yellow]warning[/yellow]: on runs it did not see, the memory fit predicts {refused:.0f} that ran not to "
            + (
                "fit: the prior's memory parameters are kept"
                if not kept
                else "fit; kept, as it predicts their peaks over twice as closely as the prior"
                if closer
                else "fit"
            ),
            highlight=False,
        )
    if out:
        name = Path(out).stem
        Path(out).write_text(json.dumps(fit.document(name), indent=1) + "\n")
        console.print(f"wrote {out}: use it with --profile {out} (berth plan, compare, probe)")


@app.command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option("--host", help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8000,
    workers: Annotated[int, typer.Option("--workers", help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the REST API (settings from BERTH_* environment variables; docs at /docs)."""
    from berth.api.server import serve

    if not 1 <= port <= 65535:
        raise BerthError("port", port, "must be in 1..65535")
    if not 1 <= workers <= 64:  # each worker process imports the planner (~200 MB)
        raise BerthError("workers", workers, "must be in 1..64 (worker processes of one server)")
    serve(host, port, workers)


def _the_plan_that_ran(path: str) -> Plan:
    """The one plan of a --plan file beside a log: a listing of several (`berth plan --json`, `berth probe --json`)
    does not say which ran, so it is refused rather than read as its first."""
    plans = _read_plans(path)
    if len(plans) > 1:
        raise BerthError(
            "plan",
            path,
            f"lists {len(plans)} plans, and a log ran one: give that one (`berth plan ... --top 1 --json`, or the "
            "probe-NN/plan.json `berth probe --out` writes)",
        )
    return pick_plan(plans, 1, "the file")


def _load_plan(path: str, pick: int) -> Plan:
    """One plan of a plan file, numbered from 1."""
    return pick_plan(_read_plans(path), pick, "the file")


def _read_plans(path: str) -> list:
    """The plans a plan file lists; a file that is no text or no JSON is refused naming it."""
    from berth.executor.validate import read_plans

    if not Path(path).is_file():
        raise BerthError("plan", path, "no such file" if not Path(path).exists() else "not a file")
    try:
        return read_plans(path)
    except UnicodeDecodeError:
        raise BerthError("plan", path, "not a text file (expected `berth plan --json` output)") from None


def _store_file(path: str | None) -> None:
    """A results store that exists must be SQLite; a new one needs an existing directory."""
    if path is None:
        return
    p = Path(path)
    if p.is_dir():
        raise BerthError("store", path, "is a directory; give a SQLite file path")
    if p.exists():
        from berth.planner.store import SQLITE_HEADER, file_header

        try:
            head = file_header(p)
        except OSError as err:
            raise BerthError("store", path, f"cannot read: {err.strerror}") from None
        if head and head != SQLITE_HEADER:
            raise BerthError("store", path, "not a SQLite database")
    elif not p.parent.is_dir():
        raise BerthError("store", path, f"directory {str(p.parent)!r} does not exist")


def main(argv: list[str] | None = None) -> None:
    """Run the CLI: bad input (ours or the argument parser's) is one line on stderr and exit 2."""
    try:  # typer >= 0.24 vendors click
        from typer._click.exceptions import ClickException, NoArgsIsHelpError
    except ImportError:  # pragma: no cover - older typer on click
        # click's own classes under the names typer vendors (to mypy, two distinct types)
        from click.exceptions import ClickException, NoArgsIsHelpError  # type: ignore[assignment]

    err_console = Console(stderr=True, highlight=False, soft_wrap=True)
    try:
        code = app(args=argv, prog_name="berth", standalone_mode=False)
    except SystemExit as done:
        # typer turns a write to a closed pipe (print of --json / --csv into `| head`) into exit 1 after
        # wrapping stdout in click's PacifyFlushWrapper: that is the reader gone, not a failure
        if type(sys.stdout).__name__ == "PacifyFlushWrapper":
            _quiet_exit()
        raise done
    except BerthError as err:
        from rich.markup import escape

        err_console.print(f"[red]error:[/red] {escape(str(err))}")  # a message may hold brackets: berth[plot]
        sys.exit(2)
    except NoArgsIsHelpError as err:
        print(err.ctx.get_help() if err.ctx else "berth --help")
        sys.exit(2)
    except ClickException as err:  # the parser's own: a missing argument, "abc" for an integer, ...
        ctx = getattr(err, "ctx", None)
        where = f" (berth {ctx.command_path.split(' ', 1)[1]} --help)" if ctx and " " in ctx.command_path else ""
        err_console.print(f"[red]error:[/red] {err.format_message()}{where}", markup=True)
        sys.exit(2)
    except typer.Abort:
        sys.exit(130)
    except BrokenPipeError:  # print() to a closed pipe (`berth plan --json | head -c 10`)
        _quiet_exit()
    try:
        sys.stdout.flush()
    except BrokenPipeError:
        _quiet_exit()
    sys.exit(code if isinstance(code, int) else 0)


if __name__ == "__main__":
    main()
