"""User input -> specs: the one conversion both edges call.

The CLI (`cli/main.py`: `plan`, `compare`, `topology`) and the REST service (`api/service.py`
for /v1/plans and /v1/compare) only parse their own syntax (typer options, pydantic bodies) into
the plain values below (`ClusterInput`, `TrainingInput`, `OperationsInput`, the search's fields)
and render a BerthError (CLI: exit 2 and one line; API: a 422 whose `loc` names the field). The
defaults, the checks and the field names of the errors live here, once.

Files: `resolve` and `make_cluster_input` take `allow_files` as a required keyword (`make_cluster`
defaults to False). The CLI passes True (a model YAML/JSON or HF config.json, a topology graph
FILE.json, a `berth profile` file: the user's own disk); the service passes False, and then only the
package's catalog names and inline objects are accepted: a name that is no preset is refused before
any path is looked at. `load_profile` and `load_graph_file` open files: the CLI's own, reached from
here only with allow_files.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

from pydantic import ValidationError

from berth.hardware_profiles import UnknownProfileError, load_profile_file, load_server, server_names
from berth.specs.engines import ENGINES, fp8_refusal
from berth.specs.errors import BerthError, from_validation_error
from berth.specs.hardware import DeviceProfile, ServerProfile
from berth.specs.layouts import parse_spec
from berth.specs.models import load_model
from berth.specs.tree import (
    ENGINE_ALIASES,
    ENGINE_CHOICES,
    FP8_DEFAULT_RECIPE,
    MAX_NODES,
    ClusterSpec,
    EngineTuning,
    ModelSpec,
    SearchSpec,
    TrainingSpec,
)
from berth.topology.clusters import LOCAL, cluster_from_node_link, cluster_from_preset, local_cluster
from berth.topology.graphs import cluster_graph, to_node_link


@dataclass(frozen=True)
class ClusterInput:
    """A cluster as a user gives it: a preset (or `local`) for `nodes` servers on a fabric, or an
    inline node-link `graph`. With allow_files, `preset` may also name a graph FILE.json and
    `profile` a `berth profile` file."""

    preset: str = "dgx-h100"
    nodes: int = 1
    devices_per_node: int | None = None
    fabric: str = "rails"
    nodes_per_leaf: int | None = None
    oversubscription: float = 1.0
    graph: Any = None  # an inline node-link graph (the service's `cluster.graph`): preset is then unused
    graph_name: str = "graph"
    profile: str | None = None


@dataclass(frozen=True)
class TrainingInput:
    """The training run; precision None: bf16 on GPUs, fp32 on CPU workers (`default_precision`)."""

    seq_len: int
    global_batch_size: int
    precision: str | None = None  # also "fp8": bf16 with the engine's first FP8 recipe
    flash_attention: bool = True
    engine: str | None = None  # None: the profile's engine, else "executor"
    token_budget: float | None = None
    tuning: EngineTuning | dict[str, Any] | None = None  # an engine profile's fitted parameters
    fp8: str | None = None  # an FP8 recipe (TrainingSpec.fp8)
    attention_kernel: str | None = None  # None: "sdpa" (TrainingSpec.attention_kernel)


@dataclass(frozen=True)
class OperationsInput:
    """Failures, storage and price; None keeps ClusterSpec's default. Storage in GB/s (1e9 bytes/s)."""

    failures_per_gpu_hour: float | None = None
    storage_write_gbps_per_gpu: float | None = None
    price_per_gpu_hour: float | None = None


def resolve(
    model: str | dict[str, Any],
    cluster: ClusterInput | ClusterSpec,
    training: TrainingInput,
    operations: OperationsInput | None = None,
    *,
    allow_files: bool,
) -> tuple[ModelSpec, TrainingSpec, ClusterSpec]:
    """Model, training and cluster specs of one plan or compare question. `cluster` may be a
    ClusterSpec built already (the service builds a large one in a child process)."""
    seq = training.seq_len if isinstance(training.seq_len, int) and training.seq_len > 0 else None
    spec = load_model(model, allow_files=allow_files, seq_len=seq)
    if isinstance(cluster, ClusterInput) and cluster.profile is not None and allow_files:
        cluster, training = engine_profile_input(cluster, training)
    built = cluster if isinstance(cluster, ClusterSpec) else make_cluster_input(cluster, allow_files=allow_files)
    built = apply_operations(built, operations or OperationsInput())
    return spec, training_spec(training, built), built


def engine_profile_input(cluster: ClusterInput, training: TrainingInput) -> tuple[ClusterInput, TrainingInput]:
    """--profile names either a `berth profile` device profile (kept on the cluster) or an engine profile
    (`berth calibrate --runs --out`): then the training takes its engine and fitted parameters. An engine
    given beside it must be the profile's (the fitted parameters describe that engine only)."""
    from berth.planner.engine_fit import is_engine_profile

    path = cluster.profile
    assert path is not None
    if not is_engine_profile(path):
        return cluster, training
    return replace(cluster, profile=None), with_engine_profile(json.loads(Path(path).read_text()), training, path)


def with_engine_profile(data: Any, training: TrainingInput, where: str | None = None) -> TrainingInput:
    """`training` with an engine profile's engine and fitted parameters (`data`: the document `berth calibrate --runs
    --out` writes, from the file `where` (the CLI) or inline (the API's training.profile)). An engine given beside
    it must be the profile's: the fitted parameters describe that engine only."""
    from berth.planner.engine_fit import read_engine_profile

    field = "profile" if where else "training.profile"
    engine, tuning = read_engine_profile(data, field)
    engine = ENGINE_ALIASES.get(engine, engine)
    if engine not in ENGINE_CHOICES:
        raise BerthError(f"{field}.engine", engine, f"one of {', '.join(ENGINE_CHOICES)}")
    given = ENGINE_ALIASES.get(training.engine, training.engine) if training.engine else None
    if given is not None and given != engine:
        fix = f"give --engine {engine}" if where else f"give {engine} or leave the engine out"
        raise BerthError(
            "engine" if where else "training.engine",
            training.engine,
            f"the profile {where + ' ' if where else ''}was fitted for engine {engine}: {fix}",
        )
    return replace(training, engine=engine, tuning=tuning)


def make_cluster_input(cluster: ClusterInput, *, allow_files: bool) -> ClusterSpec:
    """The ClusterSpec of a ClusterInput: its inline graph, or `make_cluster` of its preset."""
    if cluster.graph is not None:
        return cluster_from_node_link(cluster.graph, cluster.graph_name)
    return make_cluster(
        cluster.preset,
        cluster.nodes,
        cluster.devices_per_node,
        cluster.profile,
        cluster.fabric,
        cluster.nodes_per_leaf,
        cluster.oversubscription,
        allow_files=allow_files,
    )


def make_cluster(
    cluster: str,
    nodes: int = 1,
    devices_per_node: int | None = None,
    profile: str | None = None,
    fabric: str = "rails",
    nodes_per_leaf: int | None = None,
    oversubscription: float = 1.0,
    allow_files: bool = False,
) -> ClusterSpec:
    """A preset for `nodes` servers (on a rail or fat-tree fabric), or `local`: this machine (its
    GPUs, or CPU worker processes). With allow_files (the CLI) also a node-link graph file
    (`*.json`), and a `berth profile` file replaces the device (and, for `local`, the links) by
    measured ones. Without (the default, and the service): only the preset catalog's names are
    accepted and no path is opened."""
    if not allow_files:
        if profile is not None:
            raise BerthError("profile", profile, "a request cannot name a file on the server")
        if cluster != LOCAL and cluster not in server_names():
            raise BerthError(
                "cluster.preset",
                cluster,
                f"unknown preset; known: {', '.join(server_names())}, {LOCAL}; or give the cluster as an inline graph",
            )
    measured = load_profile(profile)
    if cluster == LOCAL:
        if nodes != 1:
            raise BerthError("cluster.nodes", nodes, "a local cluster is this one machine: nodes must be 1")
        return local_cluster(devices_per_node, measured)
    if devices_per_node is not None:
        raise BerthError("cluster.devices_per_node", devices_per_node, f"applies to cluster {LOCAL!r} only")
    if cluster.endswith(".json"):
        if nodes != 1 or fabric != "rails" or nodes_per_leaf or oversubscription != 1.0:
            raise BerthError(
                "cluster",
                cluster,
                "a graph file gives its own nodes and fabric: drop --nodes, "
                "--fabric, --nodes-per-leaf and --oversubscription",
            )
        spec = load_graph_file(cluster)
    else:
        spec = cluster_from_preset(cluster, nodes, fabric, nodes_per_leaf, oversubscription)
    if measured is not None:
        device = measured[0]
        if device.kind != spec.device.kind:
            raise BerthError(
                "profile", profile, f"a {device.kind} profile cannot describe {cluster}'s {spec.device.kind}s"
            )
        spec = spec.model_copy(update={"device": device.model_copy(update={"memory_bytes": spec.device.memory_bytes})})
    return spec


def load_profile(path: str | None) -> tuple[DeviceProfile, ServerProfile] | None:
    """(device, server) of a `berth profile` file, or None. The CLI's only: `make_cluster` refuses
    a profile before this without allow_files."""
    if not path:
        return None
    try:
        return load_profile_file(path)
    except OSError as err:
        raise BerthError("profile", path, f"cannot read: {err.strerror}") from None
    except ValidationError as err:
        raise from_validation_error(err, "profile") from None
    except ValueError as err:
        raise BerthError("profile", path, str(err)) from None


def load_graph_file(path: str) -> ClusterSpec:
    """A cluster from a node-link graph file (docs/topology.md). The CLI's only."""
    try:
        data = json.loads(Path(path).read_text())
    except OSError as err:
        raise BerthError("cluster", path, f"cannot read: {err.strerror}") from None
    except ValueError as err:
        raise BerthError("cluster", path, f"not JSON: {err}") from None
    return cluster_from_node_link(data, Path(path).stem, field=f"cluster ({Path(path).name})")


def preset_graph(
    servers: list[str], fabric: str = "rails", nodes_per_leaf: int | None = None, oversubscription: float = 1.0
) -> tuple[dict[str, Any], ClusterSpec]:
    """The node-link graph of PRESET[:NODES] servers on one fabric (mixed presets make a
    heterogeneous cluster), and the cluster derived from it."""
    parts = []
    for item in servers:
        name, _, count = item.partition(":")
        try:
            server = load_server(name)
        except UnknownProfileError as err:
            raise BerthError("cluster.preset", name, f"unknown preset; known: {', '.join(err.known)}") from None
        if count and not (count.isdigit() and 1 <= int(count) <= MAX_NODES):
            raise BerthError("cluster.nodes", item, f"write PRESET:NODES with NODES in 1..{MAX_NODES}")
        parts.append((server, int(count or 1)))
    if len({s.gpus_per_node for s, _ in parts}) > 1:
        raise BerthError("cluster.preset", servers, "servers with different GPU counts cannot be mixed yet")
    g = cluster_graph(parts, fabric, nodes_per_leaf, oversubscription)
    data = to_node_link(g)
    return data, cluster_from_node_link(data, "+".join(servers))


# OperationsInput's fields -> ClusterSpec's, with the factor from the input's unit to the spec's.
OPERATIONS_FIELDS = {
    "failures_per_gpu_hour": ("failures_per_gpu_hour", 1.0),
    "storage_write_gbps_per_gpu": ("storage_write_bytes_per_s_per_gpu", 1e9),
    "price_per_gpu_hour": ("price_per_gpu_hour", 1.0),
}


def apply_operations(cluster: ClusterSpec, operations: OperationsInput) -> ClusterSpec:
    """The cluster with the given failure rate, storage bandwidth and price (None keeps the
    spec's); a bad value is refused naming `operations.<field>` and the value as given."""
    for name, (spec_field, scale) in OPERATIONS_FIELDS.items():
        value = getattr(operations, name)
        if value is None:
            continue
        try:
            cluster = with_operations(cluster, **{spec_field: value * scale})
        except BerthError as err:
            unit = f" bytes/s ({spec_field}: {value:g} GB/s = {value * scale:g} bytes/s)" if scale != 1.0 else ""
            raise BerthError(f"operations.{name}", value, err.problem + unit) from None
    return cluster


def with_operations(
    cluster: ClusterSpec,
    failures_per_gpu_hour: float | None = None,
    storage_write_bytes_per_s_per_gpu: float | None = None,
    price_per_gpu_hour: float | None = None,
    restart_s: float | None = None,
) -> ClusterSpec:
    """The cluster with its failure rate, storage bandwidth, restart time and price set (None keeps)."""
    values = {
        "failures_per_gpu_hour": failures_per_gpu_hour,
        "price_per_gpu_hour": price_per_gpu_hour,
        "storage_write_bytes_per_s_per_gpu": storage_write_bytes_per_s_per_gpu,
        "restart_s": restart_s,
    }
    update = {k: v for k, v in values.items() if v is not None}
    try:
        return ClusterSpec.model_validate({**cluster.model_dump(), **update}) if update else cluster
    except ValidationError as err:
        raise from_validation_error(err, "cluster") from None


def default_precision(cluster: ClusterSpec) -> str:
    """bf16 on GPUs; fp32 on CPU workers, where bf16 matmuls are slow without AVX512-BF16."""
    return "fp32" if cluster.device.kind == "cpu" else "bf16"


def training_spec(training: TrainingInput, cluster: ClusterSpec) -> TrainingSpec:
    """The TrainingSpec of a TrainingInput on this cluster (its default precision filled in). Precision 'fp8' is
    bf16 with FP8 linear GEMMs, the engine's first FP8 recipe unless `fp8` names one; an FP8 recipe the engine or
    the device cannot run is refused here, naming both (specs/engines.py fp8_refusal)."""
    precision, fp8 = training.precision or default_precision(cluster), training.fp8
    engine = training.engine or "executor"
    if precision == "fp8":
        name = ENGINE_ALIASES.get(engine, engine)
        recipes = ENGINES[name].fp8_recipes if name in ENGINES else ()  # an unknown engine is refused below
        precision, fp8 = "bf16", fp8 or (recipes[0] if recipes else FP8_DEFAULT_RECIPE)
    spec = make_training(
        seq_len=training.seq_len,
        global_batch_size=training.global_batch_size,
        precision=precision,
        flash_attention=training.flash_attention,
        engine=engine,
        token_budget=training.token_budget,
        fp8=fp8,
        **({} if training.attention_kernel is None else {"attention_kernel": training.attention_kernel}),
        **({} if training.tuning is None else {"tuning": training.tuning}),
    )
    refusal = fp8_refusal(spec, cluster.device)
    if refusal is not None:  # named on what the user gave: the precision 'fp8', or the recipe
        field, value = ("training.precision", "fp8") if training.fp8 is None else ("training.fp8", spec.fp8)
        raise BerthError(field, value, refusal)
    return spec


def make_training(**fields: Any) -> TrainingSpec:
    """A TrainingSpec; a bad value is refused naming `training.<field>`."""
    try:
        return TrainingSpec(**fields)
    except ValidationError as err:
        raise from_validation_error(err, "training") from None


def make_search(top: int = 5, fix: str | dict[str, Any] | None = None, **fields: Any) -> SearchSpec:
    """A SearchSpec; `fix` in the CLI's syntax ("tp=8,pp=2") or as Layout field values. A bad
    value is refused naming `search.<field>` (`fix.<key>` for a key of the fix text)."""
    fixed = parse_spec(fix, "fix") if isinstance(fix, str) else dict(fix or {})
    try:
        return SearchSpec(top=top, fix=fixed, **fields)
    except ValidationError as err:
        raise from_validation_error(err, "search") from None
