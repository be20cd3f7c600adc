"""Measured runs of any engine as MeasuredRun records (planner/engine_fit.py).

Four sources:

- JSON lines (`read_runs`), one run each, the format `berth calibrate --runs FILE` reads:

      {"model": <preset | HF config object | model spec object>,
       "cluster": {"preset": "dgx-h100", "nodes": 2} or {"graph": <node-link graph>},
       "seq_len": 4096, "global_batch": 256, "layout": "tp=2,pp=2,dp=4,mbs=1,nmb=64,zero=1",
       "engine": "generic", "precision": "bf16" (or "fp8"), "fp8": "delayed" (an FP8 recipe, optional),
       "status": "ok" | "oom" | "error",
       "tokens_per_s": 123456.0 (the job's) or "tokens_per_s_per_gpu" or "step_time_s",
       "peak_memory_gib": 61.2, "memory_kind": "reserved" | "allocated",
       "memory_rank": "max" | "rank0" | "last", "id": "optional name"}

  Measurements may be missing; other fields are ignored. `memory_rank` says whose peak it is: the
  highest over all ranks ("max", the default), global rank 0's ("rank0": pipeline stage 0, the
  rank an engine's log line usually comes from; with pp > 1 another stage can hold more), or the last
  pipeline stage's ("last": the head and the loss, where nanotron logs).
- torchtitan's training log (`torchtitan_log`): the metrics line torchtitan's MetricsProcessor.log
  prints each logged step (torchtitan 0.3.0 torchtitan/components/metrics.py: "step: N  loss: ...
  grad_norm: ...  memory: X.XXGiB(P%)  tps: N  tflops: ...  mfu: ...%"); `tps` is tokens per second per
  GPU and `memory` the peak reserved memory (device_memory_monitor: max_reserved) of the rank that
  logs, rank 0 (run_train.sh LOG_RANK=0 by default: memory_rank "rank0"). The first logged step
  (warm-up, compilation) is skipped; the mesh it builds ("Building device mesh with parallelism: pp=..,
  dp_replicate=.., dp_shard=.., cp=.., tp=..", distributed/parallel_dims.py) must be the plan's.
- Megatron-LM's training log (`megatron_log`): "elapsed time per iteration (ms): X" of each
  iteration line (megatron/training/training.py training_log) and the memory report after the first
  iterations ("memory (MB) | allocated: ... | max allocated: ... | reserved: ... | max reserved: ...",
  megatron/training/utils.py report_memory). The first logged line is skipped (it carries the warm-up), and the
  arguments Megatron prints (tp, pp, batch, sequence, world size) must be the plan's.
- nanotron's training log (`nanotron_log`): the "iteration: N / M | ... | elapsed_time_per_iteration_ms: X |
  ... | cuda_max_memory_reserved: Y" line trainer.py train_step_logs prints each step (memory in the first
  five), numbers in logging.py's human_format (3 significant digits). The first logged line is skipped; the
  sizes its Config prints (ParallelismArgs dp, pp, tp) and its "[Start training]" line (mbs, grad_accum,
  global_batch_size, sequence_length) must be the plan's.

A log comes with the plan that ran (a file of that one plan: `berth plan --top 1 --json` output, a probe's
plan.json): the plan gives model, cluster, training, engine and layout; a plan made for another engine than the log's
is refused (one for `generic` or the default `executor` takes the log's).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable
from pathlib import Path
from typing import Any, get_args

from pydantic import ValidationError

from berth.planner.engine_fit import MeasuredRun, MemoryRank
from berth.planner.inputs import ClusterInput, TrainingInput, resolve
from berth.specs.engines import check_fp8
from berth.specs.errors import BerthError, from_validation_error
from berth.specs.layouts import complete_layout, parse_spec
from berth.specs.tree import ClusterSpec, Layout, ModelSpec, Plan, TrainingSpec

GIB = 2.0**30
MIB = 2.0**20
MAX_RUNS = 10_000  # runs of a runs file (the fit takes about 40 ms a run: minutes, not hours)
MAX_FIGURE = 1e12  # a measured figure above this (s, GiB, tokens/s) is a typo or an overflow, not a measurement
STATUSES = ("ok", "oom", "error")


def _number(rec: dict[str, Any], key: str, where: str) -> float | None:
    value = rec.get(key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value <= MAX_FIGURE:  # nan: False
        shown = (
            value if not isinstance(value, int) or abs(value) < 10**30 else f"an integer of {len(str(value))} digits"
        )
        raise BerthError(f"{where}.{key}", shown, f"a positive, finite number (at most {MAX_FIGURE:.0e})")
    return float(value)


def _plan_of(value: Any, where: str, base: Path | None) -> Plan:
    """A record's "plan": an inline plan object, or (from a file) a plan file's path relative to it."""
    if isinstance(value, str) and base is not None:
        path = (base / value).resolve()
        try:
            value = json.loads(path.read_text())
        except (OSError, ValueError) as err:
            raise BerthError(f"{where}.plan", str(path), f"cannot read a plan: {err}") from None
    if isinstance(value, dict) and isinstance(value.get("plans"), list):  # `berth plan --json` output: its one plan
        if len(value["plans"]) != 1:
            raise BerthError(
                f"{where}.plan", f"{len(value['plans'])} plans", "a run ran one: `berth plan ... --top 1 --json`"
            )
        value = value["plans"][0]
    try:
        return Plan.model_validate(value)
    except ValidationError as err:
        raise from_validation_error(err, f"{where}.plan") from None


def run_from_record(
    rec: Any, where: str, allow_files: bool = True, cache: dict | None = None, base: Path | None = None
) -> MeasuredRun:
    """One JSON-lines record as a MeasuredRun; a bad field is refused naming `where.<field>`. The run is given
    by "model", "cluster", "seq_len", "global_batch", "layout" and "engine", or by the "plan" that ran (an inline
    plan, or a plan file next to the runs file: what `berth probe --out` writes)."""
    if not isinstance(rec, dict):
        raise BerthError(where, str(rec)[:60], "a JSON object per line")
    cache = {} if cache is None else cache
    if "plan" in rec:
        plan = _plan_of(rec["plan"], where, base if allow_files else None)
        # said twice: they must agree, or the run is not the plan's
        if "layout" in rec and _layout_of(rec, where, plan.training, plan.cluster) != plan.layout:
            raise BerthError(f"{where}.layout", rec["layout"], f"the plan that ran is {plan.layout.short()}: give one")
        rec = {k: v for k, v in rec.items() if k != "plan"}
        return _measured(rec, where, plan.model, plan.training, plan.cluster, plan.layout)
    for key in ("model", "cluster", "seq_len", "global_batch", "layout"):
        if key not in rec:
            raise BerthError(f"{where}.{key}", None, 'required, or the "plan" that ran (a plan file beside the runs)')
    if not isinstance(rec["model"], str | dict):
        raise BerthError(f"{where}.model", rec["model"], "a preset name, a Hugging Face config object or a model spec")
    cl = rec["cluster"]
    if not isinstance(cl, dict):
        raise BerthError(f"{where}.cluster", cl, 'an object: {"preset": NAME, "nodes": N} or {"graph": {...}}')
    for key in ("seq_len", "global_batch"):
        if isinstance(rec[key], bool) or not isinstance(rec[key], int) or not 0 < rec[key] < 2**31:
            raise BerthError(f"{where}.{key}", rec[key], "a positive integer")
    nodes = cl.get("nodes", 1)
    if isinstance(nodes, bool) or not isinstance(nodes, int) or not 0 < nodes < 2**31:
        raise BerthError(f"{where}.cluster.nodes", nodes, "a positive integer")
    for key in ("precision", "fp8"):
        if rec.get(key) is not None and not isinstance(rec[key], str):
            raise BerthError(f"{where}.{key}", rec[key], "a string (precision: bf16, fp16, fp32 or fp8; fp8: a recipe)")
    given = [rec.get(k) for k in ("model", "seq_len", "global_batch", "engine", "precision", "fp8")]
    key = json.dumps([cl, *given], sort_keys=True)
    if key not in cache:
        cluster = (
            ClusterInput(graph=cl["graph"])
            if "graph" in cl
            else ClusterInput(preset=str(cl.get("preset", "dgx-h100")), nodes=nodes)
        )
        training = TrainingInput(
            rec["seq_len"],
            rec["global_batch"],
            precision=rec.get("precision"),
            engine=str(rec.get("engine", "generic")),
            fp8=rec.get("fp8"),
        )
        try:
            cache[key] = resolve(rec["model"], cluster, training, allow_files=allow_files)
        except BerthError as err:  # name the line: "runs line 3: training.engine"
            raise BerthError(f"{where}: {err.field}", err.value, err.problem) from None
    model, training, cluster = cache[key]
    return _measured(rec, where, model, training, cluster, _layout_of(rec, where, training, cluster))


def _layout_of(rec: dict[str, Any], where: str, training: TrainingSpec, cluster: ClusterSpec) -> Layout:
    """A record's "layout" string, completed for its training and cluster."""
    if not isinstance(rec["layout"], str):
        raise BerthError(f"{where}.layout", rec["layout"], 'a layout string, "tp=2,pp=2,dp=4,mbs=1,nmb=64,zero=1"')
    return complete_layout(parse_spec(rec["layout"], f"{where}.layout"), training, cluster.world_size, where)


def _measured(
    rec: dict[str, Any], where: str, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, layout: Layout
) -> MeasuredRun:
    check_fp8(training, cluster.device, f"{where}.fp8")
    status = rec.get("status", "ok")
    if status not in STATUSES:
        raise BerthError(f"{where}.status", status, f"one of {', '.join(STATUSES)}")
    kind = rec.get("memory_kind", "reserved")
    if kind not in ("reserved", "allocated"):
        raise BerthError(f"{where}.memory_kind", kind, "reserved or allocated")
    rank = rec.get("memory_rank", "max")
    if rank not in get_args(MemoryRank):
        raise BerthError(
            f"{where}.memory_rank",
            rank,
            "max (the highest over all ranks), rank0 (global rank 0's) or last (the last stage's)",
        )
    tokens = _number(rec, "tokens_per_s", where)
    per_gpu = _number(rec, "tokens_per_s_per_gpu", where)
    step = _number(rec, "step_time_s", where)
    batch_tokens = training.global_batch_size * training.seq_len
    if step is None and tokens is not None:
        step = batch_tokens / tokens
    if step is None and per_gpu is not None:
        step = batch_tokens / (per_gpu * cluster.world_size)
    mem = _number(rec, "peak_memory_gib", where)
    return MeasuredRun(
        id=str(rec.get("id", where))[:200],
        model=model,
        training=training,
        cluster=cluster,
        layout=layout,
        status=status,
        step_time_s=step if status == "ok" else None,
        peak_memory_bytes=mem * GIB if mem is not None and status == "ok" else None,
        memory_kind=kind,
        memory_rank=rank,
    )


def read_runs(text: str, source: str = "runs", allow_files: bool = True, base: Path | None = None) -> list[MeasuredRun]:
    """Every run of a JSON-lines text (blank lines and lines starting with # skipped); `base`: the folder plan
    paths are relative to."""
    runs: list[MeasuredRun] = []
    cache: dict = {}
    for n, line in enumerate(text.splitlines(), 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        if len(runs) >= MAX_RUNS:
            raise BerthError(source, f"line {n}", f"more than {MAX_RUNS} runs")
        try:
            rec = json.loads(line)
        except ValueError as err:
            raise BerthError(f"{source} line {n}", line[:60], f"not JSON: {err}") from None
        runs.append(run_from_record(rec, f"{source} line {n}", allow_files, cache, base))
    if not runs:
        raise BerthError("runs", source, "no runs in the file (one JSON object a line)")
    return runs


# ---- engines' own logs ----------------------------------------------------------------------------

# torchtitan 0.3.0 torchtitan/components/metrics.py MetricsProcessor.log (colour codes stripped first)
# (its validation line, "validate step: ...", measures the evaluation, not a training step)
_TT_LINE = re.compile(
    r"(?<!validate )step:\s*(\d+).*?memory:\s*(\d+(?:\.\d+)?)GiB.*?tps:\s*(\d{1,3}(?:,\d{3})*|\d+)(?![\d.,])"
)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
# Megatron-LM megatron/training/training.py training_log and megatron/training/utils.py report_memory
_MG_ITER = re.compile(r"iteration\s+(\d+)\s*/\s*\d+.*?elapsed time per iteration \(ms\):\s*(\d+(?:\.\d+)?)(?![\d.])")
_MG_MEM = re.compile(r"max allocated:\s*(\d+(?:\.\d+)?)(?![\d.]).*?max reserved:\s*(\d+(?:\.\d+)?)(?![\d.])")
# megatron/training/arguments.py _print_args: "  name ....... value" between its "arguments" rulers
_MG_ARG = re.compile(r"^\s*(\w+) \.{3,} (\S+)\s*$")
_MG_ARGS_TITLE = re.compile(r"-{8,} arguments -{8,}")
_MG_LAYOUT = {  # Megatron's argument -> what the plan says
    "tensor_model_parallel_size": lambda p: p.layout.tp,
    "pipeline_model_parallel_size": lambda p: p.layout.pp,
    "micro_batch_size": lambda p: p.layout.micro_batch_size,
    "global_batch_size": lambda p: p.training.global_batch_size,
    "seq_length": lambda p: p.training.seq_len,
    "world_size": lambda p: p.layout.world_size,
}
# torchtitan 0.3.0 torchtitan/distributed/parallel_dims.py ParallelDims.build_mesh, at the start of every run
_TT_MESH = re.compile(r"Building device mesh with parallelism: (.*)")
_TT_LAYOUT = {  # torchtitan's parallel dimension -> what the plan says
    "pp": lambda p: p.layout.pp,
    "dp_replicate": lambda p: p.layout.dp // p.layout.shard,  # FSDP shards over `shard` (1 without ZeRO)
    "dp_shard": lambda p: p.layout.shard,
    "cp": lambda p: p.layout.cp,
    "tp": lambda p: p.layout.tp,
}
# nanotron e24d2483 trainer.py: its "[Start training]" line and the Config it prints (pprint of ParallelismArgs)
_NT_START = re.compile(r"\[Start training\].*")
_NT_PARALLEL = re.compile(r"ParallelismArgs\(dp=(\d+),\s*pp=(\d+),\s*tp=(\d+)")
_NT_LAYOUT = {
    "dp": lambda p: p.layout.dp,
    "pp": lambda p: p.layout.pp,
    "tp": lambda p: p.layout.tp,
    "mbs": lambda p: p.layout.micro_batch_size,
    "grad_accum": lambda p: p.layout.num_microbatches,
    "global_batch_size": lambda p: p.training.global_batch_size,
    "sequence_length": lambda p: p.training.seq_len,
}
# nanotron e24d2483 trainer.py train_step_logs through logging.py LoggerWriter.add_scalars_from_list (human_format);
# from 2b141c2f (2025-03-26) on, the time is "time_per_iteration_ms" and the line carries no memory figure
_NT_ITER = re.compile(
    r"iteration:\s*(\d+)\s*/\s*\d+\s*\|.*?(?:elapsed_)?time_per_iteration_ms:\s*(\d+(?:\.\d+)?[KMGTPE]?)(?![\w.])"
)
_NT_MEM = re.compile(r"cuda_max_memory_reserved:\s*(\d+(?:\.\d+)?[KMGTPE]?)(?![\w.])")


def _median(xs: list[float]) -> float:
    xs = sorted(xs)
    mid = len(xs) // 2
    return xs[mid] if len(xs) % 2 else 0.5 * (xs[mid - 1] + xs[mid])


def _same_layout(run_id: str, printed: Any, plan: Plan, expect: dict[str, Callable[[Plan], int]]) -> None:
    """Refuse a log whose printed parallel sizes or batch (`printed`: (name, value) pairs) are not the plan's: it is
    not the plan that ran."""
    for name, value in printed:
        if name in expect and value != str(expect[name](plan)):
            raise BerthError(
                f"log {run_id}: {name}", value, f"the plan's is {expect[name](plan)}: give the plan that ran"
            )


def torchtitan_log(text: str, plan: Plan, run_id: str = "torchtitan-log") -> MeasuredRun:
    """A torchtitan training log and the plan that ran, as one measured run (median over logged steps); the mesh it
    prints is checked against the plan's layout."""
    # first: another engine's plan is the wrong plan, whatever its sizes
    training = _as_engine(plan, "torchtitan", run_id)
    for mesh in _TT_MESH.finditer(text):
        _same_layout(run_id, re.findall(r"(\w+)=(\d+)", mesh[1]), plan, _TT_LAYOUT)
    rows = [_TT_LINE.search(_ANSI.sub("", line)) for line in text.splitlines()]
    found = [(int(m[1]), float(m[2]), float(m[3].replace(",", ""))) for m in rows if m]
    steps = _after_first(found)
    if not steps:
        raise BerthError("log", run_id, "no torchtitan metrics line ('step: N ... memory: X GiB ... tps: N')")
    tps = _median([s[2] for s in steps])
    if not tps > 0:
        raise BerthError(f"log {run_id}: tps", tps, "a throughput above 0 (the logged steps measured none)")
    mem = max(s[1] for s in steps)
    batch_tokens = plan.training.global_batch_size * plan.training.seq_len
    return _log_run(plan, training, run_id, batch_tokens / (tps * plan.cluster.world_size), mem * GIB, "rank0")


def _log_run(
    plan: Plan, training: TrainingSpec, run_id: str, step_s: float, memory: float | None, rank: MemoryRank
) -> MeasuredRun:
    """What an engine's log measured of the plan that ran (`training`: the plan's as that engine's, `_as_engine`):
    its step time and the reserved peak of `rank`."""
    if not 0 < step_s <= MAX_FIGURE:
        raise BerthError(f"log {run_id}: step time (s)", step_s, "above 0: the logged iterations measured none")
    return MeasuredRun(run_id, plan.model, training, plan.cluster, plan.layout, "ok", step_s, memory, "reserved", rank)


def _as_engine(plan: Plan, engine: str, run_id: str) -> TrainingSpec:
    """The plan's training as the engine whose log it is (a plan for the generic engine, or the executor's default,
    takes the log's; one for another engine is refused: it is not the plan that ran); an FP8 recipe that engine
    cannot run is refused."""
    planned = plan.training.engine
    if planned not in (engine, "generic", "executor"):
        raise BerthError(
            f"log {run_id}", engine, f"a {engine} log, and the plan was made for {planned}: give the plan that ran"
        )
    training = plan.training.model_copy(update={"engine": engine})
    check_fp8(training, plan.cluster.device, f"{run_id}: plan.training.fp8")
    return training


def _iteration_ms(text: str, pattern: re.Pattern[str], number: Callable[[str], float]) -> list[float]:
    """The milliseconds of each iteration line (`pattern`: the iteration in group 1, its time in group 2) after
    the first logged, which carries the warm-up (at Megatron's --log-interval 100, the line at iteration 100
    averages the first hundred); all of them where there is only one."""
    return _after_first([number(m[2]) for m in (pattern.search(line) for line in text.splitlines()) if m])


def _after_first(logged: list) -> list:
    """The logged steps after the first, which carries the warm-up; all of them where there is only one."""
    return logged[1:] or logged


def _largest(text: str, pattern: re.Pattern[str], group: int, number: Callable[[str], float]) -> float | None:
    """The largest figure a memory line reports (None: no such line)."""
    found = [number(m[group]) for m in (pattern.search(line) for line in text.splitlines()) if m]
    return max(found) if found else None


def megatron_log(text: str, plan: Plan, run_id: str = "megatron-log") -> MeasuredRun:
    """A Megatron-LM training log and the plan that ran, as one measured run (median iteration time after
    the first, the largest max-reserved figure reported)."""
    training = _as_engine(plan, "megatron", run_id)
    printed = (m.groups() for m in map(_MG_ARG.match, text.splitlines()) if m)
    _same_layout(run_id, printed, plan, _MG_LAYOUT)
    times = _iteration_ms(text, _MG_ITER, float)
    if not times:
        raise BerthError(
            "log",
            run_id,
            "no Megatron iteration line ('elapsed time per iteration (ms): X'): a run shorter than its --log-interval "
            "(Megatron's default 100; berth's megatron-launch.sh sets 1) prints none",
        )
    mem = _largest(text, _MG_MEM, 2, float)
    return _log_run(plan, training, run_id, _median(times) / 1e3, None if mem is None else mem * MIB, "max")


def _human(text: str) -> float:
    """A number as nanotron's logging.py human_format writes it: 3 significant digits, a K/M/G/T/P/E suffix in
    steps of 1000 ("2.43K" is 2430)."""
    power = "KMGTPE".index(text[-1]) + 1 if text[-1] in "KMGTPE" else 0
    return float(text.rstrip("KMGTPE")) * 1000.0**power


def nanotron_log(text: str, plan: Plan, run_id: str = "nanotron-log") -> MeasuredRun:
    """A nanotron training log and the plan that ran, as one measured run: the median iteration time after the
    first (elapsed_time_per_iteration_ms), and the largest cuda_max_memory_reserved. The line comes from the
    rank with the loss (trainer.py logger_ranks: output_pp_rank, dp 0, tp 0): the last pipeline stage's
    (memory_rank "last"; at pp = 1 that is rank 0). Where nanotron's split leaves the loss a rank of its own
    (docs/accuracy.md) berth prices it with the head, so such a pipeline's figure is compared with a stage that
    holds more than the rank that logged. The parallel sizes and batch it prints at the start are checked against
    the plan's."""
    training = _as_engine(plan, "nanotron", run_id)
    # the first: Config.parallelism prints before Config.lighteval's own (lighteval_config.py, an evaluation's sizes)
    if sizes := _NT_PARALLEL.search(text):
        _same_layout(run_id, zip(("dp", "pp", "tp"), sizes.groups(), strict=True), plan, _NT_LAYOUT)
    for start in _NT_START.finditer(text):
        _same_layout(run_id, re.findall(r"(\w+): (\d+)", start[0]), plan, _NT_LAYOUT)
    times = _iteration_ms(text, _NT_ITER, _human)
    if not times:
        raise BerthError(
            "log", run_id, "no nanotron iteration line ('iteration: N / M | ... elapsed_time_per_iteration_ms: X')"
        )
    return _log_run(plan, training, run_id, _median(times) / 1e3, _largest(text, _NT_MEM, 1, _human), "last")


def read_log(path: str, plan: Plan) -> MeasuredRun:
    """A torchtitan, Megatron-LM or nanotron log file (told apart by their lines) as a measured run."""
    text = Path(path).read_text(errors="replace")[: 64 * 2**20]
    name = str(path)  # the run's id: as given (probe-01/train.log and probe-02/train.log are two runs)
    if _MG_ITER.search(text) or _MG_ARGS_TITLE.search(text):
        return megatron_log(text, plan, name)
    if _NT_ITER.search(text):
        return nanotron_log(text, plan, name)
    if _TT_LINE.search(_ANSI.sub("", text)):
        return torchtitan_log(text, plan, name)
    raise BerthError(
        "log",
        name,
        "no training line of torchtitan ('step: N ... memory: X GiB ... tps: N'), Megatron-LM ('iteration N/M ... "
        "elapsed time per iteration (ms): X') or nanotron ('iteration: N / M | ... elapsed_time_per_iteration_ms: X')",
    )
