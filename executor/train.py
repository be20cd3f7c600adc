"""Run a layout's training steps on this rank and measure them (time per step, where each step's
time went, peak memory, and with `trace_dir` a profiler trace of one more step).

Every rank takes its data-parallel slice of the same seeded global batch; the tp ranks of a dp
rank see the same rows; the first pipeline stage reads the tokens and the last the targets.

Each step is timed region by region (executor/timing.py; the regions map onto the predicted
terms in cost_models/breakdown.py). With `trace_dir`, one extra step after the timed ones (not in
the losses or step times) runs under torch.profiler with the regions as `berth:<region>` ranges
and is written as a Chrome/Perfetto trace, `<trace_dir>/rank<R>.trace.json`.

Test hook: `optimizer_delay_s` makes the rank sleep that long inside its optimizer step, every
step: a known slowdown of one term. berth.executor.worker sets it from $BERTH_TEST_SLOW_OPTIMIZER
("RANK:SECONDS" or "RANK:SECONDS:PLAN", PLAN numbered from 1 in the worker's plan file), which
only the tests set, to check that the report names the slowed term (tests/test_breakdown.py).
"""

from __future__ import annotations

import bisect
import gc
import os
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.nn.parallel import DistributedDataParallel
from torch.profiler import ProfilerActivity, profile, record_function

from berth.executor import timing
from berth.executor.context_parallel import shard_batch
from berth.executor.device import init_cuda
from berth.executor.model import synthetic_batch
from berth.executor.parallel import Coordinates, build_mesh, check_layout, prepare, run_microbatches, world_loss
from berth.planner.placement import coordinates
from berth.specs.axes import MESH_DIM_AXIS, MESH_DIMS
from berth.specs.tree import Layout, ModelSpec, TrainingSpec

TRAIN_MARK = "berth.train_start"
MEMORY_STEPS = 2  # the peak is reached once optimizer state exists: by the end of the second step


@dataclass
class StepRecord:
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)
    peak_memory_bytes: float | None = None
    memory_method: str = ""
    collective_s_per_step: float | None = None  # CPU: gloo work in the profiled steps, per step
    executed_as: list[str] = field(default_factory=list)
    step_timings: list[timing.StepTiming] = field(default_factory=list)  # per step: exclusive time per region
    timing_method: str = ""
    model_state_bytes: dict[str, float] = field(default_factory=dict)  # at the end of the last step
    trace_file: str | None = None


class PeakMemory:
    """Peak bytes held by tensors on this rank.

    CUDA: the caching allocator's peak of reserved memory (what the device must hold) since the
    tracker started. CPU: torch.profiler with profile_memory=True, started before the model is
    built; the peak of its allocation and free events replayed by address (`peak_allocated`:
    unlike the profiler's own "Total Allocated", it releases blocks freed unseen on gloo worker
    threads; benchmarks/data/reference/torch-distributed-cpu.md, "Measuring memory on CPU"; process RSS
    is useless). The profiler is stopped after the first MEMORY_STEPS steps so that
    it does not slow the timed steps.

    Both count from `mark()`, called when training starts: the model, optimizer and everything
    alive then are included, the transient copies of building and splitting the model are not
    (a real run builds on the meta device; the cost model predicts the training peak).
    """

    def __init__(self, device: torch.device):
        self.device = device
        self.peak: float | None = None
        self.collective_s: float | None = None  # time in gloo collectives after mark() (CPU only)
        self._prof: profile | None = None

    @property
    def method(self) -> str:
        if self.device.type == "cuda":
            return "torch.cuda.max_memory_reserved (caching allocator peak)"
        return f"torch.profiler profile_memory allocations replayed by address over build + {MEMORY_STEPS} steps"

    def start(self) -> None:
        if self.device.type == "cuda":
            init_cuda(self.device)  # the allocator's counters exist only once CUDA is initialised
            torch.cuda.reset_peak_memory_stats(self.device)
        else:
            gc.collect()  # a previous layout's objects in this process die now, not during the count
            self._prof = profile(activities=[ProfilerActivity.CPU], profile_memory=True)
            self._prof.__enter__()

    def mark(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)
        elif self._prof is not None:
            with record_function(TRAIN_MARK):
                pass

    def stop(self) -> None:
        if self.device.type == "cuda":
            self.peak = float(torch.cuda.max_memory_reserved(self.device))
            return
        if self._prof is None:
            return
        self._prof.__exit__(None, None, None)
        results = self._prof.profiler.kineto_results if self._prof.profiler is not None else None
        assert results is not None  # torch sets both when the profile exits
        events = list(results.events())
        marks = [e.start_ns() for e in events if e.name() == TRAIN_MARK]
        since = marks[0] if marks else 0
        self.collective_s = (
            sum(e.duration_ns() for e in events if e.name().startswith("gloo:") and e.start_ns() >= since) / 1e9
        )
        allocations, tree_marks = _allocations(self._prof)
        # no allocation recorded after the mark: the profiler lost the events (seen once for the
        # 7th layout of one worker process); report no measurement rather than 0 bytes
        self.peak = peak_allocated(allocations, tree_marks[0] if tree_marks else 0)
        self._prof = None


def _allocations(prof) -> tuple[list[tuple[int, int, int]], list[int]]:
    """(time ns, address, bytes) of every CPU allocation (+) and free (-) the profiler saw, and the
    times of the training mark, from the profiler's event tree (the [memory] events of the
    public API carry no address)."""
    from torch._C._profiler import _EventType

    allocations, marks = [], []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            allocations.append((node.start_time_ns, f.ptr, f.alloc_size))
        elif node.name == TRAIN_MARK:
            marks.append(node.start_time_ns)
    return sorted(allocations), sorted(marks)


def peak_allocated(allocations: list[tuple[int, int, int]], since: int) -> float | None:
    """Peak of the bytes held from `since` on, replaying (time, address, ±bytes) events in order.

    The profiler records a free only on a thread it profiles: a tensor whose last reference dies on
    a gloo worker thread (the outputs of functional collectives, which DTensor tensor and sequence
    parallelism use: tens of them per step; once in CI, DDP's old gradient bucket at its rebuild in the
    second step, 37.75 MiB of tests/test_validate.py's ZeRO-0 run) is freed unseen and would stay counted
    forever (+10 MB over two steps of tiny-gpt at tp=2, growing with the step count). Two live blocks
    cannot overlap, so a block that an allocation overlaps was freed before it: it is released at that point
    at the latest (an upper bound on what was held). The overlap, not the same start: the rebuilt bucket is
    mapped where the old one was, 1.75 MiB in. A free of a block allocated before the profiler started is
    ignored: the count starts at zero there, so that block was never in it (in a process that runs layout
    after layout, the previous layout's objects die late). Returns None when no allocation was recorded
    after `since`."""
    live: dict[int, int] = {}  # start -> bytes
    starts: list[int] = []  # the live blocks' starts, sorted
    running = peak = seen = 0
    for t, ptr, nbytes in allocations:
        if t >= since:
            peak = max(peak, running)  # alive when training started
            seen += 1
        if nbytes > 0:
            # the live blocks [ptr, ptr + nbytes) overlaps: the one starting before ptr if it reaches past it,
            # and every one starting inside
            lo = bisect.bisect_right(starts, ptr)
            if lo and starts[lo - 1] + live[starts[lo - 1]] > ptr:
                lo -= 1
            hi = bisect.bisect_left(starts, ptr + nbytes, lo=lo)
            for start in starts[lo:hi]:
                running -= live.pop(start)
            del starts[lo:hi]
            running += nbytes
            live[ptr] = nbytes
            bisect.insort(starts, ptr)
        elif ptr in live:
            running -= live.pop(ptr)
            del starts[bisect.bisect_left(starts, ptr)]
        if t >= since:
            peak = max(peak, running)
    return float(peak) if seen else None


def run_steps(
    spec: ModelSpec,
    training: TrainingSpec,
    layout: Layout,
    steps: int,
    seed: int = 0,
    warmup: int = 0,
    device: torch.device | None = None,
    on_step: Callable[[int, float, float], None] | None = None,
    trace_dir: str | None = None,
    optimizer_delay_s: float = 0.0,
) -> StepRecord:
    """Train warmup + steps steps. Returns the global-batch mean loss and the wall time of every
    step (warm-up included; callers drop the first `warmup`), where each step's time went, this
    rank's peak memory and model-state bytes, and with `trace_dir` the trace of one more step."""
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    device = device or torch.device("cpu")
    check_layout(spec, training, layout, world)
    coords = Coordinates.of(rank, layout)
    memory = PeakMemory(device)
    memory.start()
    mesh = build_mesh(layout, device.type) if world > 1 else None
    prepared = prepare(spec, training, layout, seed, device, mesh, coords)
    per_rank = layout.micro_batch_size * layout.num_microbatches
    autocast = training.precision != "fp32"  # bf16/fp16 autocast on CUDA and CPU alike; fp32 runs as is
    dtype = torch.bfloat16 if training.precision == "bf16" else torch.float16
    timer = timing.StepTimer(timing.CudaEventClock() if device.type == "cuda" else timing.WallClock())
    record = StepRecord(executed_as=prepared.executed_as, memory_method=memory.method, timing_method=timer.clock.name)

    def one_step(step: int) -> tuple[float, timing.StepTiming, torch.Tensor | None]:
        tokens, targets = synthetic_batch(spec, training.global_batch_size, training.seq_len, seed, step)
        mine = slice(coords.dp_rank * per_rank, (coords.dp_rank + 1) * per_rank)
        tokens, targets = tokens[mine].to(device), targets[mine].to(device)
        if layout.cp > 1 and mesh is not None:  # this cp rank's load-balanced chunks (the API's head-tail split)
            tokens, targets = shard_batch(mesh["cp"], [tokens, targets])
        if world > 1:
            dist.barrier()
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        start = time.perf_counter()
        timer.begin()
        prepared.optimizer.zero_grad(set_to_none=True)
        with torch.autocast(device.type, dtype=dtype, enabled=autocast):
            local = run_microbatches(prepared, layout, tokens, targets, coords)
        with timing.span("optimizer"):
            prepared.optimizer.step()
            if optimizer_delay_s:
                time.sleep(optimizer_delay_s)  # the test hook (module docstring)
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        elapsed = time.perf_counter() - start
        return elapsed, timer.end(), local

    ddp = isinstance(prepared.modules[0], DistributedDataParallel)
    groups: dict[str, str] = (
        {mesh.get_group(d).group_name: MESH_DIM_AXIS[d] for d in MESH_DIMS} if mesh is not None else {}
    )
    with timing.instrument(
        timer, coordinates(layout) if world > 1 else None, prepared.modules, prepared.schedule, ddp=ddp, groups=groups
    ):
        memory.mark()
        for step in range(warmup + steps):
            elapsed, spent, local = one_step(step)
            if step + 1 == MEMORY_STEPS:
                memory.stop()
            record.step_times_s.append(elapsed)
            record.step_timings.append(spent)
            record.losses.append(world_loss(local, layout, device))
            if on_step is not None:
                on_step(step, record.losses[-1], elapsed)
        memory.stop()
        record.model_state_bytes = timing.model_state_bytes(prepared.modules, prepared.optimizer)
        if trace_dir:
            record.trace_file = _trace_step(one_step, warmup + steps, timer, device, trace_dir, rank)
    record.peak_memory_bytes = memory.peak
    if memory.collective_s is not None:
        record.collective_s_per_step = memory.collective_s / min(MEMORY_STEPS, warmup + steps)
    return record


def _trace_step(
    one_step: Callable, step: int, timer: timing.StepTimer, device: torch.device, trace_dir: str, rank: int
) -> str:
    """One more step under torch.profiler, its regions as ranges; the Chrome trace's path."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    path = os.path.join(trace_dir, f"rank{rank}.trace.json")
    os.makedirs(trace_dir, exist_ok=True)
    timer.annotate = True
    try:
        with profile(activities=activities) as prof, record_function(f"berth:step {step}"):
            one_step(step)
    finally:
        timer.annotate = False
    prof.export_chrome_trace(path)
    return os.path.abspath(path)
