"""`berth profile`: measure the machine berth runs on and write a profile the planner accepts.

Compute (in this process, one thread on CPU as each executor rank uses, or the GPU):
- GEMM throughput over the shapes a transformer layer produces (rows = micro-batch x sequence,
  the other dimensions from 16 to 2048), giving the device's peak and its efficiency curve by
  smallest dimension;
- memory bandwidth (a streaming multiply over a buffer far larger than the caches);
- causal scaled_dot_product_attention forward + backward, as a fraction of the GEMM peak;
- the dispatch cost of a tiny operation (the per-kernel overhead).
Communication (torchrun, gloo on CPU or NCCL on GPUs, 2..N local processes): all-reduce,
all-gather, reduce-scatter and send/recv over a range of sizes, each fitted to
time = latency + bytes x ring factor / bus bandwidth (least squares, relative error).

The profile holds a DeviceProfile and a ServerProfile built from those figures (with every
measured number named in `sources`), plus the raw measurements.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from hardware_profiles import load_device, load_server
from hardware_profiles.schema import DeviceProfile, GemmCurve, LinkProfile, ServerProfile

GEMM_DIMS = (16, 32, 64, 128, 256, 512, 1024, 2048)
QUICK_GEMM_DIMS = (16, 64, 256, 1024)
COMM_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
QUICK_COMM_SIZES = (1 << 16, 1 << 19, 1 << 21, 1 << 23)
RING_FACTOR = {  # bytes each rank moves per byte of the full buffer, ring algorithms
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}
PROFILE_FORMAT = "berth-profile/1"

Progress = Callable[[str], None]


def _timer(device: torch.device):
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def measure(fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def _dtype(device: torch.device) -> tuple[torch.dtype, str]:
    return (torch.bfloat16, "bf16") if device.type == "cuda" else (torch.float32, "fp32")


def measure_gemm(device: torch.device, quick: bool) -> list[dict]:
    """Achieved FLOP/s of (rows x k) @ (k x n) with min(n, k) = d: the projection shapes of a
    layer (rows = tokens of a micro-batch; n or k = a hidden or ffn slice)."""
    dtype, _ = _dtype(device)
    measure = _timer(device)
    rows = 2048 if quick else 4096
    if device.type == "cuda":
        rows *= 4
    out = []
    for d in QUICK_GEMM_DIMS if quick else GEMM_DIMS:
        k = max(d, 256)
        a = torch.randn(rows, k, device=device, dtype=dtype)
        b = torch.randn(k, d, device=device, dtype=dtype)
        flops = 2.0 * rows * k * d
        reps = max(3, min(50, int(2e9 / flops)))
        t = measure(lambda a=a, b=b: a @ b, reps)
        out.append({"rows": rows, "k": k, "n": d, "min_dim": d, "seconds": t, "flops_per_s": flops / t})
    return out


def measure_memory_bandwidth(device: torch.device, quick: bool) -> float:
    n = (1 << 23) if quick else (1 << 24)
    if device.type == "cuda":
        n *= 16
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    t = _timer(device)(lambda: torch.mul(x, 2.0, out=y), 5 if quick else 10)
    return 2 * x.numel() * x.element_size() / t


def measure_attention(device: torch.device, quick: bool) -> float:
    """Achieved FLOP/s of causal SDPA forward + backward (4bs^2hd/2 forward, 2.5x with backward
    as FlashAttention counts it)."""
    dtype, _ = _dtype(device)
    b, heads, s, d = (4, 4, 256, 64) if device.type == "cpu" else (8, 32, 2048, 128)
    # laid out as a layer produces them: (b, s, heads, d) projections viewed as (b, heads, s, d)
    q, k, v = (torch.randn(b, s, heads, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def step():
        out = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        out.sum().backward()

    t = _timer(device)(step, 3 if quick else 8)
    flops = 4.0 * b * heads * s * s * d * 0.5 * 3.5  # forward + backward (2.5x forward)
    return flops / t


def measure_op_overhead(device: torch.device) -> float:
    x = torch.randn(8, device=device)
    reps = 2000
    measure = _timer(device)

    def many():
        for _ in range(reps):
            torch.mul(x, 2.0)

    return measure(many, 3) / reps


def _collective_ops(x, gathered, shard, rank: int, world: int) -> dict[str, Callable[[], None]]:
    import torch.distributed as dist

    peer = rank ^ 1  # pairs (0, 1), (2, 3), ...

    def p2p() -> None:
        if peer >= world:
            return
        if rank % 2 == 0:
            dist.send(x, peer)
        else:
            dist.recv(x, peer)

    return {
        "all_reduce": lambda: dist.all_reduce(x),
        "all_gather": lambda: dist.all_gather_into_tensor(gathered, x),
        "reduce_scatter": lambda: dist.reduce_scatter_tensor(shard, x[: shard.numel() * world]),
        "p2p": p2p,
    }


def _concurrent_compute(quick: bool, world: int) -> dict:
    """Every rank measures compute at the same time, as ranks of a CPU run share the machine's
    cores, caches and memory bandwidth; the figures are averaged over ranks."""
    import torch.distributed as dist

    dist.barrier()
    mine = {"gemm": measure_gemm(torch.device("cpu"), quick),
            "memory_bandwidth": measure_memory_bandwidth(torch.device("cpu"), quick),
            "attention": measure_attention(torch.device("cpu"), quick),
            "op_overhead": measure_op_overhead(torch.device("cpu"))}
    everyone = [None] * world
    dist.all_gather_object(everyone, mine)
    gemm = [dict(g, flops_per_s=float(np.mean([e["gemm"][i]["flops_per_s"] for e in everyone])))
            for i, g in enumerate(mine["gemm"])]
    return {"gemm": gemm, "processes": world,
            **{k: float(np.mean([e[k] for e in everyone])) for k in ("memory_bandwidth", "attention", "op_overhead")}}


def _comm_worker(out: str, sizes: list[int], reps: int, compute: bool = False, quick: bool = False) -> None:
    """Runs under torchrun: time each collective at each size; rank 0 writes the medians (and,
    with `compute`, the concurrent compute figures)."""
    import torch.distributed as dist

    cuda = torch.cuda.is_available() and os.environ.get("BERTH_DEVICE") != "cpu"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0))) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    results: dict[str, list] = {op: [] for op in RING_FACTOR}
    for size in sizes:
        numel = size // 4
        x = torch.randn(numel, device=device)
        gathered = torch.empty(numel * world, device=device)
        shard = torch.empty(numel // world, device=device)
        ops = _collective_ops(x, gathered, shard, rank, world)
        for op, fn in ops.items():
            for _ in range(2):
                fn()
            times = []
            for _ in range(5):  # trials of `reps` back-to-back calls: rank skew at the barrier amortized
                dist.barrier()
                sync()
                t0 = time.perf_counter()
                for _ in range(reps):
                    fn()
                sync()
                times.append((time.perf_counter() - t0) / reps)
            t = torch.tensor([min(times)], dtype=torch.float64)  # best trial: least disturbed by neighbours
            dist.all_reduce(t, op=dist.ReduceOp.MAX)  # the slowest rank's median
            full = size * world if op == "all_gather" else size  # the cost model's "full buffer"
            results[op].append([full, float(t.item())])
    concurrent = _concurrent_compute(quick, world) if compute else None
    if rank == 0:
        Path(out).write_text(json.dumps({"world": world, "backend": dist.get_backend(), "results": results,
                                         "compute": concurrent}))
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(nprocs: int, quick: bool, compute: bool = False, timeout_s: float = 300.0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        sizes = QUICK_COMM_SIZES if quick else COMM_SIZES
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nprocs}",
               "-m", "executor.profile", "--comm-worker", str(out), "--sizes", ",".join(map(str, sizes)),
               "--reps", "3" if quick else "5"] + (["--compute"] if compute else []) + (["--quick"] if quick else [])
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if not out.is_file():
            raise RuntimeError(f"collective benchmark on {nprocs} processes failed: {r.stderr[-1500:]}")
        return json.loads(out.read_text())


def fit_collective(points: list[list[float]], op: str, n: int) -> dict[str, float]:
    """Least squares on relative error of t = latency + bytes x factor / bus_bandwidth."""
    from scipy.optimize import nnls

    x = np.array([p[0] for p in points], dtype=float) * RING_FACTOR[op](n)
    t = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (latency, inv_bw), _ = nnls(design, t * w)  # both terms non-negative
    inv_bw = max(inv_bw, 1e-13)
    return {"latency_s": float(latency), "bus_bandwidth_bytes_per_s": float(1.0 / inv_bw)}


def build_profile(device_type: str, gemm: list[dict], bandwidth: float, attention_flops: float, overhead: float,
                  comm: dict[int, dict], machine: dict) -> dict:
    """DeviceProfile and ServerProfile from the measurements; the base profile supplies what is
    not measured (memory capacity, TDP, kernels per layer)."""
    _, precision = _dtype(torch.device(device_type))
    peak = max(g["flops_per_s"] for g in gemm)
    dims = [g["min_dim"] for g in gemm]
    fractions = [min(1.0, max(1e-3, g["flops_per_s"] / peak)) for g in gemm]
    base = load_device("cpu-host") if device_type == "cpu" else load_device(machine.get("profile_base", "h100-sxm"))
    peaks = {**base.peak_flops_per_s, precision: peak}  # the measured precision; the others from the base
    when = datetime.now(UTC).date().isoformat()
    src = f"measured by `berth profile` on {machine['hostname']} ({when})"
    device = DeviceProfile(
        name=f"{base.name}-profiled", display_name=f"{base.display_name}, profiled on {machine['hostname']}",
        kind=base.kind, peak_flops_per_s=peaks, memory_bytes=base.memory_bytes,
        memory_bandwidth_bytes_per_s=bandwidth, memory_bandwidth_fraction=1.0,
        gemm=GemmCurve(min_dim=dims, peak_fraction=fractions),
        attention_peak_fraction=min(1.0, attention_flops / peak), kernel_overhead_s=overhead,
        kernels_per_layer_fwd=base.kernels_per_layer_fwd, framework_overhead_bytes=base.framework_overhead_bytes,
        allocator_fragmentation_fraction=base.allocator_fragmentation_fraction, tdp_watts=base.tdp_watts,
        sources={f"peak_flops_per_s.{precision}": f"best GEMM of the sweep, {src}",
                 "gemm": f"GEMM sweep over min dim {dims}, {src}",
                 "memory_bandwidth_bytes_per_s": f"streaming multiply (achieved, so fraction 1.0), {src}",
                 "attention_peak_fraction": f"causal SDPA forward+backward / GEMM peak, {src}",
                 "kernel_overhead_s": f"dispatch of a tiny op, {src}"},
        assumptions={k: v for k, v in base.assumptions.items()
                     if k in ("memory_bytes", "framework_overhead_bytes", "allocator_fragmentation_fraction",
                              "kernels_per_layer_fwd")},
    )
    server_base = load_server("local-cpu" if device_type == "cpu" else "dgx-h100")
    link = server_base.intra_node
    base_latency = server_base.collective_base_latency_s
    sources = {}
    fits = {}
    if comm:
        n = min(comm)
        fits = {op: fit_collective(comm[n]["results"][op], op, n) for op in RING_FACTOR}
        ar = fits["all_reduce"]
        bw = ar["bus_bandwidth_bytes_per_s"]
        scale = {op: bw / f["bus_bandwidth_bytes_per_s"] for op, f in fits.items() if op != "all_reduce"}
        # all-reduce latency over n ranks = base + 2 (n - 1) hops; split half and half
        hop = ar["latency_s"] / (2 * (n - 1)) / 2
        base_latency = ar["latency_s"] / 2
        link = LinkProfile(kind=link.kind, bandwidth_bytes_per_s=bw, collective_efficiency=1.0,
                           hop_latency_s=hop, op_time_scale=scale)
        sources = {"intra_node": f"{comm[n]['backend']} collectives on {n} processes fitted to latency + bytes / "
                                 f"bus bandwidth, {src}",
                   "op_time_scale": "each op's fitted bus bandwidth relative to all-reduce's"}
    server = ServerProfile(
        name="local-profiled", display_name=f"{machine['hostname']} (profiled)", device=device.name,
        gpus_per_node=max(comm) if comm else server_base.gpus_per_node, intra_node=link, inter_node=link,
        collective_base_latency_s=base_latency, comm_overlap_efficiency=server_base.comm_overlap_efficiency,
        sources=sources, assumptions={"one_node": "the profile describes one machine; inter_node = intra_node"})
    return {"format": PROFILE_FORMAT, "created": datetime.now(UTC).isoformat(), "machine": machine,
            "device": device.model_dump(mode="json"), "server": server.model_dump(mode="json"),
            "measurements": {"gemm": gemm, "memory_bandwidth_bytes_per_s": bandwidth,
                             "attention_flops_per_s": attention_flops, "op_overhead_s": overhead,
                             "collectives": {str(k): v for k, v in comm.items()},
                             "collective_fits": fits}}


def run_profile(quick: bool = False, max_procs: int | None = None, progress: Progress | None = None) -> dict:
    say = progress or (lambda _msg: None)
    cuda = torch.cuda.is_available() and os.environ.get("BERTH_DEVICE") != "cpu"
    device = torch.device("cuda", 0) if cuda else torch.device("cpu")
    if not cuda:
        torch.set_num_threads(int(os.environ.get("BERTH_THREADS_PER_RANK", "1")))
    machine = {"hostname": platform.node(), "cpu_count": os.cpu_count(), "torch": torch.__version__,
               "device": device.type, "threads": torch.get_num_threads(), "quick": quick}
    if cuda:
        machine["gpu"] = torch.cuda.get_device_name(0)
        name = machine["gpu"]
        machine["profile_base"] = "h200" if "H200" in name else "a100-80g" if "A100" in name else "h100-sxm"
    say("GEMM sweep")
    gemm = measure_gemm(device, quick)
    say("memory bandwidth")
    bandwidth = measure_memory_bandwidth(device, quick)
    say("attention")
    attention = measure_attention(device, quick)
    say("op overhead")
    overhead = measure_op_overhead(device)
    available = torch.cuda.device_count() if cuda else (os.cpu_count() or 1)
    top = max(2, min(max_procs or available, available, 2 if quick else 8))
    comm = {}
    for n in range(2, top + 1):
        if cuda and n > available:
            break
        concurrent = not cuda and n == top
        say(f"collectives on {n} processes" + (" (and compute, all ranks at once)" if concurrent else ""))
        comm[n] = measure_collectives(n, quick, compute=concurrent)
        if concurrent:
            c = comm[n]["compute"]
            gemm, bandwidth, attention, overhead = c["gemm"], c["memory_bandwidth"], c["attention"], c["op_overhead"]
            machine["compute_measured_with_processes"] = n
    return build_profile(device.type, gemm, bandwidth, attention, overhead, comm, machine)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--comm-worker")
    ap.add_argument("--sizes")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--compute", action="store_true")
    ap.add_argument("--quick", action="store_true")
    args = ap.parse_args()
    if args.comm_worker:
        torch.set_num_threads(1)
        _comm_worker(args.comm_worker, [int(s) for s in args.sizes.split(",")], args.reps, args.compute, args.quick)


if __name__ == "__main__":
    main()
