"""Where a rank's step time goes: exclusive time per region, per step (the measuring side of
`cost_models/breakdown.py`, whose TERM_REGIONS maps these regions onto the predicted terms).

A `StepTimer` records spans (name, start point, end point) between `begin()` and `end()`; `end()`
gives every instant of the step to the innermost span open at that instant (`attribute`), so the
regions' exclusive times and the untimed rest (`other`) add up to the step. The spans come from:

- the executor's own code (executor/train.py, executor/parallel.py): `span("forward")`,
  `span("backward")`, `span("optimizer")`, and `span("recompute")` around a checkpointed block
  or attention core when it runs inside backward (autograd's current graph task is set);
- `instrument(...)`, which while a layout runs wraps where torch.distributed work is issued and
  waited for, naming each span by the axis of its process group (tp, cp, dp, pp: the device mesh
  dimension the group belongs to, else the layout coordinate that varies among its ranks) and
  its kind:
  functional collectives (DTensor tensor/sequence parallelism) and their `wait_tensor`;
  `torch.distributed` collectives (FSDP2's all-gather and reduce-scatter, HSDP's all-reduce,
  ZeRO-1's broadcasts); FSDP2's `unshard` / `wait_for_unshard` / `post_backward` (the collective
  with its copy-in and copy-out); the pipeline schedule's `_batch_p2p` (issue) and
  `_wait_batch_p2p` (wait), its stages' `forward_one_chunk` / `backward_one_chunk` and loss;
  and, for DDP, whose bucket all-reduces are issued and awaited inside its C++ reducer, a
  post-accumulate-grad hook on every parameter: from the last gradient accumulated to the end of
  backward the rank waits for the buckets (`dp_all_reduce`).

Clocks: on CPU a point is `time.perf_counter()` taken on the host where the span opens or closes.
On CUDA a point is a `torch.cuda.Event` recorded on the current stream there, resolved after the
step's synchronize with `elapsed_time` from the step's first event: the spans are then GPU time
(a collective's wait is the compute stream stalled on the communication stream). Both go through
the same attribution; tests drive the CUDA path with recording stand-ins for the event class.

`annotate=True` (the `--trace` step) also opens a torch.profiler range `berth:<region>` for each
span, so the Chrome/Perfetto trace shows the regions above the operators.
"""

from __future__ import annotations

import contextlib
import functools
import inspect
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from berth.cost_models.breakdown import OTHER
from berth.specs.axes import RANK_AXES

# spans of these prefixes opened inside the key are not opened: their time stays the key's
# (the cost model counts a full recomputation's tensor-parallel collectives as recomputation)
ABSORBED = {"recompute": ("tp_",)}


class WallClock:
    name = "host wall clock (time.perf_counter) around each region"

    def point(self) -> float:
        return time.perf_counter()

    def seconds(self, points: list[Any]) -> list[float]:
        origin = points[0]
        return [p - origin for p in points]


class CudaEventClock:
    """Points are CUDA events on the current stream; `seconds` synchronizes and reads them."""

    name = "CUDA events on the current stream at each region's edges (GPU time)"

    def __init__(self, event: Callable[..., Any] | None = None, synchronize: Callable[[], None] | None = None):
        self.event = event or torch.cuda.Event
        self.synchronize = synchronize or torch.cuda.synchronize

    def point(self) -> Any:
        e = self.event(enable_timing=True)
        e.record()
        return e

    def seconds(self, points: list[Any]) -> list[float]:
        self.synchronize()
        origin = points[0]
        return [0.0 if p is origin else origin.elapsed_time(p) / 1e3 for p in points]


@dataclass
class StepTiming:
    step_s: float
    regions_s: dict[str, float]  # exclusive seconds per region; OTHER = in no region
    segments: list[tuple[float, float, str]]  # the step's timeline: (start, end, region), adjacent ones merged


@dataclass
class _Node:
    name: str
    start: float
    end: float
    children: list[_Node] = field(default_factory=list)


def attribute(spans: list[tuple[str, float, float]], step_s: float) -> StepTiming:
    """Exclusive time per region of spans (name, start, end) in seconds from the step's start.
    A span is nested in the latest-starting span still open when it starts and clipped to it and
    to its previous sibling (the executor's spans nest; clipping keeps a partition if some do
    not); each instant goes to the innermost span, the rest of the step to `other`."""
    root = _Node(OTHER, 0.0, step_s)
    stack = [root]
    for name, s, e in sorted(spans, key=lambda x: (x[1], -x[2])):
        s, e = max(s, 0.0), min(e, step_s)
        while len(stack) > 1 and stack[-1].end <= s:
            stack.pop()
        parent = stack[-1]
        s = max(s, parent.children[-1].end if parent.children else parent.start)
        e = min(e, parent.end)
        if e <= s:
            continue
        node = _Node(name, s, e)
        parent.children.append(node)
        stack.append(node)
    segments: list[tuple[float, float, str]] = []

    def emit(s: float, e: float, name: str) -> None:
        if e <= s:
            return
        if segments and segments[-1][2] == name and abs(segments[-1][1] - s) < 1e-12:
            segments[-1] = (segments[-1][0], e, name)
        else:
            segments.append((s, e, name))

    def visit(node: _Node) -> None:
        cursor = node.start
        for child in node.children:
            emit(cursor, child.start, node.name)
            visit(child)
            cursor = child.end
        emit(cursor, node.end, node.name)

    visit(root)
    regions: dict[str, float] = {}
    for s, e, name in segments:
        regions[name] = regions.get(name, 0.0) + (e - s)
    return StepTiming(step_s, regions, segments)


class StepTimer:
    def __init__(self, clock: WallClock | CudaEventClock | None = None):
        self.clock = clock or WallClock()
        self.annotate = False
        self._start: Any = None
        self._open: list[str] = []
        self._spans: list[tuple[str, Any, Any]] = []
        self.last_grad: Any = None

    @property
    def active(self) -> bool:
        return self._start is not None

    def begin(self) -> None:
        self._spans, self._open, self.last_grad = [], [], None
        self._start = self.clock.point()

    def end(self) -> StepTiming:
        stop = self.clock.point()
        points = [self._start, stop] + [p for _, a, b in self._spans for p in (a, b)]
        secs = self.clock.seconds(points)
        spans = [(name, secs[2 + 2 * i], secs[3 + 2 * i]) for i, (name, _, _) in enumerate(self._spans)]
        self._start = None
        self._spans, self._open = [], []
        return attribute(spans, secs[1])

    def span(self, name: str) -> _Span:
        return _Span(self, name)

    def grad_ready(self) -> None:
        if self._start is not None:
            self.last_grad = self.clock.point()

    def tail(self, name: str) -> None:
        """A span from the last gradient accumulated (`grad_ready`) to now (the DDP wait)."""
        if self._start is not None and self.last_grad is not None:
            self._spans.append((name, self.last_grad, self.clock.point()))
            self.last_grad = None


class _Span:
    __slots__ = ("timer", "name", "point", "ranges")

    def __init__(self, timer: StepTimer, name: str):
        self.timer, self.name = timer, name
        self.point: float | None = None
        self.ranges: torch.autograd.profiler.record_function | None = None

    def __enter__(self) -> _Span:
        t = self.timer
        if t._start is None or any(
            outer in t._open and self.name.startswith(prefixes) for outer, prefixes in ABSORBED.items()
        ):
            return self
        if t.annotate:
            self.ranges = torch.autograd.profiler.record_function("berth:" + self.name)
            self.ranges.__enter__()
        t._open.append(self.name)
        self.point = t.clock.point()
        return self

    def __exit__(self, *exc: object) -> None:
        if self.point is None:
            return
        t = self.timer
        t._spans.append((self.name, self.point, t.clock.point()))
        t._open.pop()
        if self.ranges is not None:
            self.ranges.__exit__(None, None, None)


_ACTIVE: StepTimer | None = None
_NULL = contextlib.nullcontext()


def span(name: str) -> _Span | contextlib.nullcontext:
    """A span of the active timer (a no-op outside `instrument`)."""
    t = _ACTIVE
    return t.span(name) if t is not None and t.active else _NULL


def tail(name: str) -> None:
    if _ACTIVE is not None:
        _ACTIVE.tail(name)


def in_backward() -> bool:
    return torch._C._current_graph_task_id() != -1


def recomputed(fn: Callable[..., Any]) -> Callable[..., Any]:
    """`fn` timed as `recompute` when it runs inside backward (a checkpoint re-running it)."""

    def run(*args: Any, **kwargs: Any) -> Any:
        if _ACTIVE is None or not in_backward():
            return fn(*args, **kwargs)
        with span("recompute"):
            return fn(*args, **kwargs)

    return run


# ---------------------------------------------------------------------------------------------
# instrumenting torch.distributed while a layout runs

FUNCOL_KINDS = {
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_tensor": "all_gather",
    "all_gather_tensor_autograd": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_autograd": "reduce_scatter",
    "all_to_all_single": "all_to_all",
    "all_to_all_single_autograd": "all_to_all",
}
DIST_KINDS = {
    "all_reduce": "all_reduce",
    "all_gather_single": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather": "all_gather",
    "reduce_scatter_single": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter": "reduce_scatter",
    "broadcast": "broadcast",
    "all_to_all_single": "all_to_all",
}


class _Patches:
    """Wrappers set on torch's functions for one run, restored afterwards. A name this torch does
    not have is left alone: the tables name functions of several torch versions (the
    `*_single` collectives of torch.distributed are 2.13's; a CUDA build of 2.11 has none), and the
    private pipelining hooks move between versions. Work issued through a missing name is then
    timed as the region around it (`other` at worst), never a failed run."""

    def __init__(self) -> None:
        self._saved: list[tuple[Any, str, bool, Any]] = []

    def set(self, owner: Any, name: str, make: Callable[[Any], Any]) -> None:
        if not hasattr(owner, name):
            return
        original = getattr(owner, name)
        own = name in vars(owner) if isinstance(owner, type) else True
        self._saved.append((owner, name, own, vars(owner).get(name, original) if isinstance(owner, type) else original))
        setattr(owner, name, make(original))

    def restore(self) -> None:
        for owner, name, own, original in reversed(self._saved):
            if own:
                setattr(owner, name, original)
            else:
                delattr(owner, name)
        self._saved.clear()


class _Axes:
    """The layout axis (tp, cp, dp, pp) of a process group: the mesh dimension it belongs to (`known`:
    group name -> axis; a size-1 group such as HSDP's replicate group of one is only known this
    way), else the one coordinate that varies among its ranks; `other` for a group spanning
    several axes (the world group of a 2-D layout)."""

    def __init__(self, coordinates: dict[str, Any] | None, known: dict[str, str] | None = None):
        self.coordinates = coordinates
        self._cache: dict[str, str] = dict(known or {})

    def of_group(self, group: Any) -> str:
        import torch.distributed as dist

        pg = group if group is not None else dist.group.WORLD
        key = getattr(pg, "group_name", None) or str(id(pg))
        if key not in self._cache:
            self._cache[key] = self._axis(dist.get_process_group_ranks(pg))
        return self._cache[key]

    def of_funcol(self, group: Any) -> str:
        from torch.distributed import _functional_collectives as funcol
        from torch.distributed import distributed_c10d as c10d

        name = funcol._resolve_group_name(group)
        if name not in self._cache:
            self._cache[name] = self._axis(c10d.get_process_group_ranks(c10d._resolve_process_group(name)))
        return self._cache[name]

    def _axis(self, ranks: list[int]) -> str:
        if self.coordinates is None:
            return OTHER
        varying = {
            axis
            for axis in RANK_AXES
            if axis in self.coordinates and len({int(self.coordinates[axis][r]) for r in ranks}) > 1
        }
        if varying == {"dp", "cp"}:
            return "dp"  # FSDP/ZeRO and gradient reduction span dp x cp (the cost model's dp_comm)
        return varying.pop() if len(varying) == 1 else OTHER


def _region(axis: str, kind: str) -> str:
    return f"{axis}_{kind}" if axis != OTHER else OTHER + "_comm"


def _group_of(fn: Callable[..., Any]) -> Callable[[tuple, dict], Any]:
    sig = inspect.signature(fn)

    def get(args: tuple, kwargs: dict) -> Any:
        try:
            return sig.bind_partial(*args, **kwargs).arguments.get("group")
        except TypeError:
            return None

    return get


@contextlib.contextmanager
def instrument(
    timer: StepTimer,
    coordinates: dict[str, Any] | None,
    modules: Sequence[torch.nn.Module],
    schedule: Any = None,
    ddp: bool = False,
    groups: dict[str, str] | None = None,
) -> Iterator[StepTimer]:
    """Make `timer` the active one and wrap torch.distributed's issue and wait points (see the
    module docstring) until the block ends; everything is restored afterwards. `coordinates`:
    the layout's (berth.planner.placement.coordinates), `groups`: process group name -> axis."""
    global _ACTIVE
    import torch.distributed as dist
    from torch.distributed import _functional_collectives as funcol

    axes = _Axes(coordinates, groups)
    patches = _Patches()
    hooks = []
    issued: dict[int, str] = {}  # data pointer of a functional collective's output -> its region
    last = [OTHER + "_comm"]  # the latest issued region: a wait on an output seen under another pointer

    def wrap_funcol(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        group_of = _group_of(fn)

        def run(*args: Any, **kwargs: Any) -> Any:
            if not timer.active:
                return fn(*args, **kwargs)
            region = _region(axes.of_funcol(group_of(args, kwargs)), kind)
            with timer.span(region):
                out = fn(*args, **kwargs)
            for t in out if isinstance(out, list) else [out]:
                elem = getattr(t, "elem", t)
                if isinstance(elem, torch.Tensor):
                    issued[elem.data_ptr()] = region
            last[0] = region
            return out

        return run

    def wrap_wait(fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(tensor: Any) -> Any:
            if not timer.active:
                return fn(tensor)
            with timer.span(issued.pop(tensor.data_ptr(), last[0])):
                return fn(tensor)

        return run

    def wrap_dist(kind: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        group_of = _group_of(fn)

        def run(*args: Any, **kwargs: Any) -> Any:
            if not timer.active:
                return fn(*args, **kwargs)
            with timer.span(_region(axes.of_group(group_of(args, kwargs)), kind)):
                return fn(*args, **kwargs)

        return run

    def wrap_as(region: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def run(*args: Any, **kwargs: Any) -> Any:
            with span(region):
                return fn(*args, **kwargs)

        return run

    for name, kind in FUNCOL_KINDS.items():
        patches.set(funcol, name, functools.partial(wrap_funcol, kind))
    patches.set(funcol, "wait_tensor", wrap_wait)
    for name, kind in DIST_KINDS.items():
        patches.set(dist, name, functools.partial(wrap_dist, kind))
    try:
        from torch.distributed.fsdp._fully_shard._fsdp_param_group import FSDPParamGroup

        for method, region in (
            ("unshard", "dp_all_gather"),
            ("wait_for_unshard", "dp_all_gather"),
            ("post_backward", "dp_reduce_scatter"),
        ):
            patches.set(FSDPParamGroup, method, functools.partial(wrap_as, region))
    except ImportError:  # pragma: no cover - torch without FSDP2
        pass
    if schedule is not None:
        from torch.distributed.pipelining import schedules
        from torch.distributed.pipelining.stage import PipelineStage

        # gloo completes a send only once the peer has posted its receive: a wait for sends is
        # waiting for the neighbouring stage as much as one for receives, so every wait is pp_wait
        patches.set(schedules, "_batch_p2p", lambda fn: wrap_as("pp_transfer", fn))
        patches.set(schedules, "_wait_batch_p2p", lambda fn: wrap_as("pp_wait", fn))
        patches.set(PipelineStage, "forward_one_chunk", lambda fn: wrap_as("forward", fn))
        patches.set(PipelineStage, "backward_one_chunk", lambda fn: wrap_as("backward", fn))
        patches.set(schedules._PipelineSchedule, "_maybe_compute_loss", lambda fn: wrap_as("forward", fn))
    if ddp:
        for module in modules:
            for p in module.parameters():
                if p.requires_grad:
                    hooks.append(p.register_post_accumulate_grad_hook(lambda _: timer.grad_ready()))
    _ACTIVE = timer
    try:
        yield timer
    finally:
        _ACTIVE = None
        patches.restore()
        for h in hooks:
            h.remove()


def model_state_bytes(modules: Sequence[torch.nn.Module], optimizer: torch.optim.Optimizer) -> dict[str, float]:
    """Bytes this rank holds in parameters, gradients and optimizer state (local shards)."""

    def local(t: torch.Tensor) -> torch.Tensor:
        return t.to_local() if hasattr(t, "to_local") else t

    def nbytes(t: torch.Tensor) -> int:
        t = local(t)
        return t.numel() * t.element_size()

    params = {id(p): p for m in modules for p in m.parameters()}
    state = 0
    inner = getattr(optimizer, "optim", optimizer)  # ZeroRedundancyOptimizer keeps its shard's optimizer here
    for s in inner.state.values():
        state += sum(nbytes(v) for v in s.values() if isinstance(v, torch.Tensor) and v.dim() > 0)
    return {
        "parameters": float(sum(nbytes(p) for p in params.values())),
        "gradients": float(sum(nbytes(p.grad) for p in params.values() if p.grad is not None)),
        "optimizer_state": float(state),
    }
