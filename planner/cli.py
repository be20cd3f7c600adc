"""`berth` command line: a thin edge over planner.planning. Bad input exits 2 with one line."""

from __future__ import annotations

import json
import shutil
import sys
from typing import Annotated

import typer
from rich.console import Console

from planner.errors import BerthError
from planner.models import load_model
from planner.planning import compare, compare_json, make_search, make_training, plan, plans_json
from planner.render import breakdown_table, plans_table, print_reasons
from planner.topology import cluster_from_preset

app = typer.Typer(add_completion=False, no_args_is_help=True, help="berth: plan parallel layouts for training.")
MIN_WIDTH = 150  # the plan table needs about this many columns; narrower output would wrap cells
console = Console(width=max(MIN_WIDTH, shutil.get_terminal_size().columns))

Model = Annotated[str, typer.Argument(help="preset name, a model YAML/JSON file, or an HF config.json")]
Cluster = Annotated[str, typer.Option("--cluster", help="cluster preset: dgx-a100-80g, dgx-h100, dgx-h200")]
Nodes = Annotated[int, typer.Option("--nodes", help="number of nodes")]
SeqLen = Annotated[int, typer.Option("--seq-len", help="sequence length (tokens)")]
Batch = Annotated[int, typer.Option("--global-batch", help="global batch (sequences per step)")]
Precision = Annotated[str, typer.Option("--precision", help="bf16, fp16 or fp32")]
Flash = Annotated[bool, typer.Option("--flash-attention/--no-flash-attention", help="FlashAttention kernels")]
Json = Annotated[bool, typer.Option("--json", help="print one JSON object instead of tables")]


def _inputs(model: str, cluster: str, nodes: int, seq_len: int, global_batch: int, precision: str,
            flash: bool):
    spec = load_model(model)
    training = make_training(seq_len=seq_len, global_batch_size=global_batch, precision=precision,
                             flash_attention=flash)
    return spec, training, cluster_from_preset(cluster, nodes)


@app.command("plan")
def plan_cmd(
    model: Model,
    cluster: Cluster = "dgx-h100",
    nodes: Nodes = 1,
    seq_len: SeqLen = 4096,
    global_batch: Batch = 256,
    precision: Precision = "bf16",
    flash: Flash = True,
    top: Annotated[int, typer.Option("--top", help="how many plans to show")] = 5,
    fix: Annotated[str, typer.Option("--fix", help="restrict the search, e.g. tp=8,pp=2")] = "",
    max_mbs: Annotated[int | None, typer.Option("--max-mbs", help="largest micro-batch to try")] = None,
    as_json: Json = False,
) -> None:
    """Search every valid layout and show the fastest that fit."""
    spec, training, cl = _inputs(model, cluster, nodes, seq_len, global_batch, precision, flash)
    result = plan(spec, training, cl, make_search(top=top, fix=fix, max_micro_batch_size=max_mbs))
    if as_json:
        print(json.dumps(plans_json(result)))
        return
    head = (f"{spec.name} ({spec.num_params / 1e9:.1f}B params) on {cl.nodes} x {cl.name} "
            f"({cl.world_size} GPUs), seq {seq_len}, global batch {global_batch}, {precision}")
    console.print(plans_table(result.plans, head))
    rejected = ", ".join(f"{k} {v:,}" for k, v in result.rejected.items()) or "none"
    console.print(f"searched {result.searched:,} layouts: {result.feasible:,} feasible; rejected: {rejected}")
    if result.plans:
        console.print(breakdown_table(result.plans, "where the time and memory go"))
    else:
        console.print("[red]no layout fits[/red]: see the rejected counts above")


@app.command("compare")
def compare_cmd(
    model: Model,
    layout: Annotated[list[str], typer.Option("--layout", help="tp=8,pp=4,dp=2,zero=1,recompute=selective,...")],
    cluster: Cluster = "dgx-h100",
    nodes: Nodes = 1,
    seq_len: SeqLen = 4096,
    global_batch: Batch = 256,
    precision: Precision = "bf16",
    flash: Flash = True,
    as_json: Json = False,
) -> None:
    """Predict given layouts side by side, with the gap to the best layout the search finds."""
    spec, training, cl = _inputs(model, cluster, nodes, seq_len, global_batch, precision, flash)
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
    console.print(plans_table(candidates, f"{spec.name} on {cl.world_size} GPUs: candidates", ref))
    print_reasons(console, candidates)
    if best and best.plans:
        b = best.plans[0]
        console.print(f"best searched layout: {b.layout.short()} at {b.prediction.tokens_per_s:,.0f} tokens/s")
    console.print(breakdown_table(candidates, "breakdowns"))


def main() -> None:
    try:
        app(standalone_mode=True)
    except BerthError as err:
        Console(stderr=True).print(f"[red]error:[/red] {err}", highlight=False, soft_wrap=True)
        sys.exit(2)


if __name__ == "__main__":
    main()
