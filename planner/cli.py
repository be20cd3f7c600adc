"""`berth` command line: a thin edge over planner.planning. Bad input exits 2 with one line."""

from __future__ import annotations

import json
import shutil
import sys
from pathlib import Path
from typing import Annotated

import typer
from rich.console import Console

from planner.errors import BerthError
from planner.models import load_model
from planner.planning import (
    compare,
    compare_json,
    default_precision,
    lose_nodes,
    make_cluster,
    make_search,
    make_training,
    plan,
    plans_json,
    with_fallback,
    with_operations,
)
from planner.render import breakdown_table, goodput_table, plans_table, print_placement, print_reasons, validation_table

app = typer.Typer(add_completion=False, no_args_is_help=True, help="berth: plan parallel layouts for training.")
MIN_WIDTH = 150  # the plan table needs about this many columns; narrower output would wrap cells
console = Console(width=max(MIN_WIDTH, shutil.get_terminal_size().columns))

Model = Annotated[str, typer.Argument(help="preset name, a model YAML/JSON file, or an HF config.json")]
Cluster = Annotated[str, typer.Option(
    "--cluster", help="cluster preset (dgx-h100, dgx-a100-80g, dgx-b200, aws-p5, ...: see `berth presets`), "
    "a topology graph FILE.json (see `berth topology`), or 'local': this machine")]
Fabric = Annotated[str, typer.Option("--fabric", help="with a preset: rails (one rail switch per NIC) or fat-tree")]
PerLeaf = Annotated[int | None, typer.Option("--nodes-per-leaf", help="fat-tree: nodes per leaf switch")]
Oversub = Annotated[float, typer.Option("--oversubscription", help="fat-tree: leaf downlink / uplink bandwidth")]
Objective = Annotated[str, typer.Option("--objective", help="rank by throughput, goodput (after checkpoints and "
                                        "failures) or cost")]
Failures = Annotated[float | None, typer.Option("--failures-per-gpu-hour", help="default 1.97e-5 (Llama 3 "
                                                "pre-training)")]
Storage = Annotated[float | None, typer.Option("--storage-gbps-per-gpu", help="filesystem write GB/s per GPU "
                                               "(default 0.122, Llama 3's Tectonic)")]
Price = Annotated[float | None, typer.Option("--price-per-gpu-hour", help="for cost per step and per token")]
Budget = Annotated[float | None, typer.Option("--token-budget", help="tokens to train on, for the total cost")]
Nodes = Annotated[int, typer.Option("--nodes", help="number of nodes")]
Devices = Annotated[int | None, typer.Option(
    "--devices-per-node", help="with --cluster local: GPUs to use, or CPU worker processes (default: all)")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="sequence length (tokens)")]
Batch = Annotated[int, typer.Option("--global-batch", help="global batch (sequences per step)")]
Precision = Annotated[str | None, typer.Option(
    "--precision", help="bf16, fp16 or fp32 (default: bf16 on GPUs, fp32 on CPU)")]
Flash = Annotated[bool, typer.Option("--flash-attention/--no-flash-attention", help="FlashAttention kernels")]
FrameworkOpt = Annotated[str, typer.Option("--framework", help="whose memory behaviour to predict: pytorch (DTensor, "
                                           "FSDP2, DDP: the bundled executor, torchtitan) or megatron")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]


Profile = Annotated[str | None, typer.Option("--profile", help="a `berth profile` output: measured device "
                                             "(and, with --cluster local, links)")]


def _inputs(model: str, cluster: str, nodes: int, devices: int | None, seq_len: int, global_batch: int,
            precision: str | None, flash: bool, profile: str | None = None, fabric: tuple = ("rails", None, 1.0),
            operations: tuple = (None, None, None), token_budget: float | None = None, framework: str = "pytorch"):
    spec = load_model(model)
    failures, storage_gbps, price = operations
    cl = with_operations(make_cluster(cluster, nodes, devices, profile, *fabric), failures,
                         storage_gbps * 1e9 if storage_gbps is not None else None, price)
    training = make_training(seq_len=seq_len, global_batch_size=global_batch,
                             precision=precision or default_precision(cl), flash_attention=flash,
                             framework=framework, token_budget=token_budget)
    return spec, training, cl


def _unit(cluster) -> str:
    return "CPU workers" if cluster.device.kind == "cpu" else "GPUs"


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
    framework: FrameworkOpt = "pytorch",
    top: Annotated[int, typer.Option("--top", help="how many plans to show")] = 5,
    fix: Annotated[str, typer.Option("--fix", help="restrict the search, e.g. tp=8,pp=2")] = "",
    max_mbs: Annotated[int | None, typer.Option("--max-mbs", help="largest micro-batch to try")] = None,
    objective: Objective = "throughput",
    failures: Failures = None,
    storage_gbps: Storage = None,
    price: Price = None,
    token_budget: Budget = None,
    show_fallback: Annotated[bool, typer.Option("--fallback", help="also plan the best layout for the cluster "
                                                "with one node lost")] = False,
    spare_nodes: Annotated[int, typer.Option("--spare-nodes", help="keep this many nodes as hot spares: plan on "
                                             "the rest")] = 0,
    as_json: Json = False,
) -> None:
    """Search every valid layout and show the fastest that fit."""
    spec, training, cl = _inputs(model, cluster, nodes, devices, seq_len, global_batch, precision, flash, profile,
                                 (fabric, nodes_per_leaf, oversubscription), (failures, storage_gbps, price),
                                 token_budget, framework)
    if spare_nodes:
        if not 0 < spare_nodes < cl.nodes:
            raise BerthError("spare_nodes", spare_nodes, f"must be in 1..{cl.nodes - 1} (of {cl.nodes} nodes)")
        cl = lose_nodes(cl, spare_nodes)
    search_spec = make_search(top=top, fix=fix, max_micro_batch_size=max_mbs, objective=objective)
    result = plan(spec, training, cl, search_spec)
    if show_fallback:
        result = with_fallback(result, search_spec)
    if as_json:
        print(json.dumps(plans_json(result)))
        return
    head = (f"{spec.name} ({spec.num_params / 1e9:.1f}B params) on {cl.nodes} x {cl.name} "
            f"({cl.world_size} {_unit(cl)}), seq {seq_len}, global batch {global_batch}, {training.precision}")
    console.print(plans_table(result.plans, head))
    rejected = ", ".join(f"{k} {v:,}" for k, v in result.rejected.items()) or "none"
    console.print(f"searched {result.searched:,} layouts: {result.feasible:,} feasible; rejected: {rejected}")
    if result.plans:
        console.print(breakdown_table(result.plans, "where the time and memory go"))
        console.print(goodput_table(result.plans, f"checkpoints, failures and cost (ranked by {objective})"))
        print_placement(console, result.plans[0], "#1")
        fb = result.plans[0].fallback
        if show_fallback and fb is None:
            console.print("[red]fallback[/red]: no layout fits the cluster with one node lost")
        if fb is not None:
            console.print(f"fallback with {fb.nodes_lost} node lost: {fb.layout.short()}, "
                          f"{fb.tokens_per_s:,.0f} tokens/s; " + "; ".join(fb.changes))
    else:
        console.print("[red]no layout fits[/red]: see the rejected counts above")


@app.command("compare")
def compare_cmd(
    model: Model,
    layout: Annotated[list[str], typer.Option("--layout", help="tp=8,pp=4,dp=2,zero=1,recompute=selective,...")],
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
    framework: FrameworkOpt = "pytorch",
    as_json: Json = False,
) -> None:
    """Predict given layouts side by side, with the gap to the best layout the search finds."""
    spec, training, cl = _inputs(model, cluster, nodes, devices, seq_len, global_batch, precision, flash, profile,
                                 (fabric, nodes_per_leaf, oversubscription), framework=framework)
    candidates = compare(spec, training, cl, layout)
    try:
        best = plan(spec, training, cl, make_search(top=1))
    except BerthError:
        best = None
    out = compare_json(candidates, best)
    if as_json:
        print(json.dumps(out))
        return
    ref = best.plans[0].prediction.tokens_per_s if best and best.plans else None
    console.print(plans_table(candidates, f"{spec.name} on {cl.world_size} {_unit(cl)}: candidates", ref))
    print_reasons(console, candidates)
    if best and best.plans:
        b = best.plans[0]
        console.print(f"best searched layout: {b.layout.short()} at {b.prediction.tokens_per_s:,.0f} tokens/s")
    console.print(breakdown_table(candidates, "breakdowns"))
    for i, p in enumerate(candidates, 1):
        print_placement(console, p, f"#{i}", only_crossings=True)


@app.command("topology")
def topology_cmd(
    servers: Annotated[list[str], typer.Argument(help="PRESET[:NODES]..., e.g. dgx-h100:4, or a graph FILE.json "
                                                 "to inspect; several presets make a mixed cluster")],
    fabric: Fabric = "rails",
    nodes_per_leaf: PerLeaf = None,
    oversubscription: Oversub = 1.0,
    out: Annotated[str | None, typer.Option("--out", help="write the node-link graph JSON here")] = None,
    as_json: Json = False,
) -> None:
    """Build a cluster's topology graph from presets (or read one) and show its fast domains."""
    from planner.planning import load_graph_file, preset_graph

    if len(servers) == 1 and servers[0].endswith(".json"):
        data, cl = None, load_graph_file(servers[0])
    else:
        data, cl = preset_graph(servers, fabric, nodes_per_leaf, oversubscription)
    if out and data is not None:
        Path(out).write_text(json.dumps(data, indent=1) + "\n")
    if as_json:
        print(json.dumps(data if data is not None else cl.model_dump(mode="json")))
        return
    from planner.render import hierarchy_table

    console.print(hierarchy_table(cl))
    for note in cl.notes:
        console.print(f"[yellow]note[/yellow]: {note}")
    if out and data is not None:
        console.print(f"graph ({len(data['nodes'])} nodes, {len(data['links'])} links) written to {out}; "
                      f"plan on it with --cluster {out}")


@app.command("presets")
def presets_cmd(as_json: Json = False) -> None:
    """List the model, cluster and device presets."""
    from rich.table import Table

    from hardware_profiles import device_names, load_device, load_server, server_names
    from planner.models import presets

    servers = [load_server(n) for n in server_names()]
    devices = [load_device(n) for n in device_names()]
    if as_json:
        print(json.dumps({"models": sorted(presets()), "clusters": [s.name for s in servers],
                          "devices": [d.name for d in devices]}))
        return
    t = Table(title="cluster presets (per node)", header_style="bold")
    for col in ("name", "device", "GPUs", "intra-node GB/s", "inter-node GB/s per GPU", "description"):
        t.add_column(col)
    for s in servers:
        t.add_row(s.name, s.device, str(s.gpus_per_node), f"{s.intra_node.bandwidth_bytes_per_s / 1e9:g} "
                  f"{s.intra_node.kind}", f"{s.inter_node.bandwidth_bytes_per_s / 1e9:g} {s.inter_node.kind}",
                  s.display_name)
    console.print(t)
    d = Table(title="devices", header_style="bold")
    for col in ("name", "bf16 TFLOP/s", "memory GiB", "memory TB/s", "description"):
        d.add_column(col)
    for x in devices:
        d.add_row(x.name, f"{x.peak_flops('bf16') / 1e12:g}", f"{x.memory_bytes / 2**30:.0f}",
                  f"{x.memory_bandwidth_bytes_per_s / 1e12:.3g}", x.display_name)
    console.print(d)
    console.print("models: " + ", ".join(sorted(presets())))


@app.command("validate")
def validate_cmd(
    plan_file: Annotated[str, typer.Argument(help="a plan JSON, or the output of `berth plan --json`")],
    pick: Annotated[int, typer.Option("--pick", help="which plan of the file (1 = first)")] = 1,
    steps: Annotated[int, typer.Option("--steps", help="timed steps")] = 5,
    warmup: Annotated[int, typer.Option("--warmup", help="untimed steps first")] = 2,
    out: Annotated[str | None, typer.Option("--out", help="write the ValidationReport JSON here")] = None,
    store: Annotated[str | None, typer.Option("--store", help="SQLite results store (default $BERTH_STORE_PATH "
                                              "or ~/.local/share/berth/berth.sqlite)")] = None,
    timeout: Annotated[float | None, typer.Option("--timeout", help="watchdog in seconds (default: from the "
                                                  "predicted step time)")] = None,
    oversubscribe: Annotated[bool, typer.Option("--oversubscribe", help="allow more CPU workers than cores")] = False,
    proxy: Annotated[str | None, typer.Option("--proxy", help="rank-slice: run one rank's share of a plan "
                                              "larger than this machine in one process")] = None,
    layers: Annotated[int | None, typer.Option("--layers", help="with --proxy: layers of the stage to run "
                                               "(default: all of one stage)")] = None,
    stage: Annotated[str | None, typer.Option("--stage", help="with --proxy: first or last pipeline stage "
                                              "(default: the one predicted to hold more memory)")] = None,
    as_json: Json = False,
) -> None:
    """Run a plan on this machine with torch.distributed and compare measured with predicted."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from executor.validate import load_plan, validate, validate_proxy
    from planner.store import Store

    chosen = load_plan(plan_file, pick)
    if proxy not in (None, "rank-slice"):
        raise BerthError("proxy", proxy, "the only proxy is rank-slice")
    if proxy is None and (layers is not None or stage is not None):
        raise BerthError("layers" if layers is not None else "stage", layers or stage, "applies to --proxy rank-slice")
    db = Store(store)
    err = Console(stderr=True)
    total = steps + warmup
    with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                  console=err, transient=True) as bar:
        what = "one rank's slice in 1 process" if proxy else f"{chosen.layout.world_size} processes"
        task = bar.add_task(f"validating {chosen.layout.short()} on {what} (starting)", total=total)

        def progress(p: dict) -> None:
            loss = f"  loss {p['loss']:.4f}" if p.get("loss") is not None else ""
            bar.update(task, completed=p["step"],
                       description=f"step {p['step']}/{p['of']}{loss}  {p['step_time_s'] * 1e3:.0f} ms")

        if proxy:
            report = validate_proxy(chosen, layers=layers, stage=stage, steps=steps, warmup=warmup, store=db,
                                    out=out, on_progress=progress, timeout_s=timeout)
        else:
            report = validate(chosen, steps=steps, warmup=warmup, store=db, out=out, on_progress=progress,
                              oversubscribe=oversubscribe, timeout_s=timeout)
    if as_json:
        print(report.model_dump_json())
    else:
        console.print(validation_table(report))
        if report.mode == "rank-slice":
            console.print("rank-slice proxy: the step time above is one rank's compute (no communication, no "
                          "bubble). Not checked:\n  - " + "\n  - ".join(report.checks["not_checked"]))
        where = f"report {report.id} stored in {db.path}" + (f" and written to {out}" if out else "")
        console.print(where)
    if report.status != "ok":
        Console(stderr=True).print(f"[red]{report.status}:[/red] {report.message}", highlight=False, soft_wrap=True)
        raise typer.Exit(1)


@app.command("launch")
def launch_cmd(
    plan_file: Annotated[str, typer.Argument(help="a plan JSON, or the output of `berth plan --json`")],
    fmt: Annotated[str, typer.Option("--format", help="torchrun, slurm, kubernetes, megatron, deepspeed or "
                                     "torchtitan")] = "torchrun",
    pick: Annotated[int, typer.Option("--pick", help="which plan of the file (1 = first)")] = 1,
    out: Annotated[str, typer.Option("--out", help="directory for the files")] = "berth-launch",
    steps: Annotated[int, typer.Option("--steps", help="executor formats: timed steps")] = 20,
    warmup: Annotated[int, typer.Option("--warmup", help="executor formats: untimed steps first")] = 3,
    image: Annotated[str, typer.Option("--image", help="kubernetes: container image with berth and torch")] =
    "berth-executor:latest",
) -> None:
    """Write the files that launch a plan: per-node torchrun scripts, an sbatch script or a PyTorchJob
    running the bundled executor, or Megatron-LM / DeepSpeed / torchtitan configs for the layout."""
    from executor.validate import load_plan
    from planner.launch import artifacts

    plan = load_plan(plan_file, pick)
    files = artifacts(plan, fmt, steps=steps, warmup=warmup, image=image)
    directory = Path(out)
    directory.mkdir(parents=True, exist_ok=True)
    for name, text in files.items():
        path = directory / name
        path.write_text(text)
        if name.endswith((".sh", ".sbatch")):
            path.chmod(0o755)
        console.print(f"wrote {path}")
    console.print(f"{fmt} launch of {plan.layout.short()} ({plan.layout.world_size} ranks)")


@app.command("profile")
def profile_cmd(
    out: Annotated[str, typer.Option("--out", help="where to write the profile")] = "berth-profile.json",
    quick: Annotated[bool, typer.Option("--quick", help="fewer shapes, sizes and repeats (under a minute)")] = False,
    max_procs: Annotated[int | None, typer.Option("--max-procs", help="largest process count for collectives "
                                                  "(default: cores or GPUs, at most 8)")] = None,
) -> None:
    """Measure this machine (GEMMs, memory bandwidth, attention, collectives) into a profile that
    plan, compare and --cluster local accept with --profile."""
    from executor.profile import run_profile

    err = Console(stderr=True)
    with err.status("profiling") as status:
        result = run_profile(quick=quick, max_procs=max_procs, progress=lambda msg: status.update(f"profiling: {msg}"))
    Path(out).write_text(json.dumps(result, indent=2))
    dev, link = result["device"], result["server"]["intra_node"]
    peak = max(dev["peak_flops_per_s"].values())
    console.print(f"{dev['display_name']}: GEMM peak {peak / 1e9:,.1f} GFLOP/s, memory "
                  f"{dev['memory_bandwidth_bytes_per_s'] / 1e9:.1f} GB/s, "
                  f"attention {dev['attention_peak_fraction']:.0%} "
                  f"of peak, op overhead {dev['kernel_overhead_s'] * 1e6:.1f} us")
    console.print(f"collectives: all-reduce bus bandwidth {link['bandwidth_bytes_per_s'] / 1e9:.2f} GB/s, time vs "
                  "all-reduce: " + ", ".join(f"{k} x{v:.2f}" for k, v in link["op_time_scale"].items()))
    console.print(f"written to {out}")


@app.command("calibrate")
def calibrate_cmd(
    reports: Annotated[list[str] | None, typer.Argument(
        help="ValidationReport JSON files (default: the store)")] = None,
    out: Annotated[str | None, typer.Option("--out", help="write the calibrated profile here")] = None,
    store: Annotated[str | None, typer.Option("--store", help="SQLite results store to read reports from")] = None,
    device: Annotated[str | None, typer.Option("--device", help="only reports planned for this device")] = None,
    holdout: Annotated[float, typer.Option("--holdout", help="fraction of reports held out of the fit")] = 0.3,
    seed: Annotated[int, typer.Option("--seed", help="seed of the held-out split")] = 0,
) -> None:
    """Fit the cost model's named efficiency parameters to validation reports (scipy least_squares)
    and print the error on the fitted reports and on those held out."""
    from pydantic import ValidationError
    from rich.table import Table

    from planner.calibrate import PARAMETERS, calibrate, profile_document
    from planner.errors import from_validation_error
    from planner.specs import ValidationReport
    from planner.store import Store

    if not 0.0 <= holdout < 1.0:
        raise BerthError("holdout", holdout, "must be in [0, 1)")
    loaded = []
    if reports:
        for path in reports:
            try:
                loaded.append(ValidationReport.model_validate_json(Path(path).read_text()))
            except OSError as err:
                raise BerthError("reports", path, f"cannot read: {err.strerror}") from None
            except ValidationError as err:
                raise from_validation_error(err, f"reports[{path}]") from None
    else:
        loaded = Store(store).validations(status="ok")
    if device:
        loaded = [r for r in loaded if r.plan.cluster.device.name == device]
    fit = calibrate(loaded, holdout=holdout, seed=seed)
    t = Table(title=f"calibration on {len(fit.fit_ids)} reports ({len(fit.held_out_ids)} held out)")
    for col in ("parameter", "before", "after"):
        t.add_column(col, justify="left" if col == "parameter" else "right")
    for name in PARAMETERS:
        t.add_row(name, f"{fit.initial[name]:.4g}", f"{fit.values[name]:.4g}")
    console.print(t)
    e = Table(title="errors (fractions)")
    for col in ("reports", "step-time MAPE", "worst", "memory MAPE", "worst"):
        e.add_column(col, justify="left" if col == "reports" else "right")
    for key, errs in fit.errors.items():
        if errs:
            nan = float("nan")
            e.add_row(key.replace("_", " "), f"{errs['step_time_mape']:.3f}", f"{errs['step_time_max_error']:.3f}",
                      f"{errs.get('memory_mape', nan):.3f}", f"{errs.get('memory_max_error', nan):.3f}")
    console.print(e)
    if out:
        Path(out).write_text(json.dumps(profile_document(fit, "reports given" if reports else "results store"),
                                        indent=2))
        console.print(f"calibrated profile written to {out} (use it with --profile)")


@app.command("serve")
def serve_cmd(
    host: Annotated[str, typer.Option("--host", help="interface to bind")] = "127.0.0.1",
    port: Annotated[int, typer.Option("--port", help="TCP port")] = 8000,
    workers: Annotated[int, typer.Option("--workers", help="uvicorn worker processes")] = 1,
) -> None:
    """Serve the REST API (settings from BERTH_* environment variables; docs at /docs)."""
    from api.server import serve

    if not 1 <= port <= 65535:
        raise BerthError("port", port, "must be in 1..65535")
    if workers < 1:
        raise BerthError("workers", workers, "must be at least 1")
    serve(host, port, workers)


def main() -> None:
    try:
        app(standalone_mode=True)
    except BerthError as err:
        Console(stderr=True).print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
