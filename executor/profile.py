"""`berth profile`: measure the machine berth runs on and write a profile the planner accepts.

Compute (in this process, one thread on CPU as each executor rank uses, or the GPU):
- GEMM throughput over the shapes a transformer layer produces (rows = micro-batch x sequence,
  the other dimensions from 16 to 2048), giving the device's peak and its efficiency curve by
  smallest dimension; on a GPU also an LM head's GEMMs at an aligned, a 4-byte-only and an odd width (the GEMM
  model's alignment slowdowns, `measure_gemm_alignment`);
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
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F

from berth.executor.device import rank_device
from berth.hardware_profiles import PROFILE_FORMAT, load_device, load_server
from berth.specs.hardware import (
    AttentionPassModel,
    CollectiveOp,
    DeviceProfile,
    GemmCurve,
    LinkProfile,
    Precision,
    ServerProfile,
)

GEMM_DIMS = (16, 32, 64, 128, 256, 512, 1024, 2048)
QUICK_GEMM_DIMS = (16, 64, 256, 1024)
COMM_SIZES = (1 << 14, 1 << 16, 1 << 18, 1 << 20, 1 << 22, 1 << 24)
QUICK_COMM_SIZES = (1 << 16, 1 << 19, 1 << 21, 1 << 23)
RING_FACTOR: dict[CollectiveOp, Callable[[int], float]] = {  # bytes each rank moves per byte of the full buffer, ring
    "all_reduce": lambda n: 2.0 * (n - 1) / n,
    "all_gather": lambda n: (n - 1) / n,
    "reduce_scatter": lambda n: (n - 1) / n,
    "p2p": lambda n: 1.0,
}

Progress = Callable[[str], None]


TIMED_BUDGET_S = 0.2  # timed seconds per CUDA shape: enough repetitions that the median is stable
QUICK_TIMED_BUDGET_S = 0.05
MIN_REPS, MAX_REPS = 10, 200  # CUDA-event repetitions per shape (after warm-up)
CUDA_WARMUP = 3  # untimed runs first: cuBLAS heuristics, clocks, caches
SQUARE_REFERENCE = 8192  # the square bf16 matmul that stands for "peak achievable" on a GPU
# the layers `berth plan` predicts: hidden 2k-16k (Llama 3.2 1B .. Llama 3.1 405B), tp 1-8,
# tokens per micro-batch 2k-32k (h100-microbench/gemm.json covers the same grid)
GPU_HIDDEN = (2048, 4096, 8192, 16384)
GPU_TP = (1, 2, 4, 8)
GPU_TOKENS = (2048, 4096, 8192, 16384, 32768)
QUICK_GPU_HIDDEN, QUICK_GPU_TP, QUICK_GPU_TOKENS = (4096, 16384), (1, 8), (4096,)
# an LM head's GEMMs at rows of 16 bytes (32,000 bf16), of 4 bytes only and odd (measure_gemm_alignment)
ALIGNMENT_WIDTHS = {"aligned": 32000, "misaligned": 32002, "odd": 32001}
ALIGNMENT_TOKENS, ALIGNMENT_HIDDEN = 16384, 2048
FFN_RATIO = 3.25  # SwiGLU ffn / hidden of Llama 3.1 405B (53248 / 16384); 8B and 70B use 3.5
MAX_GEMM = (16384, 16384, 53248)  # the largest GEMM timed: the 405B down projection at tp 1, 16k tokens
ATTENTION_SEQ = (2048, 4096, 8192)
ATTENTION_HEADS = (4, 8, 16, 32)  # heads per tp rank: 32-128 heads over tp 1-8
QUICK_ATTENTION_SEQ, QUICK_ATTENTION_HEADS = (4096,), (8, 32)
ATTENTION_HEAD_DIM = 128
# head dim 64 (GPT-2, GPT-3 up to 6.7B, Llama-style models below 1B): its own asymptote in the attention model
# (cost_models/compute.py attention_efficiency), timed at these heads per rank (QUICK: the first)
SMALL_HEAD_DIM, SMALL_HEAD_HEADS = 64, (8, 32)
ATTENTION_TOKENS = 16384  # batch x seq of each attention shape (batch = tokens / seq)


def repetitions(estimate_s: float, budget_s: float, lo: int = MIN_REPS, hi: int = MAX_REPS) -> int:
    """Timed repetitions of an operation that takes about `estimate_s`: fill `budget_s`, within [lo, hi]."""
    if not estimate_s > 0:
        return hi
    return int(min(hi, max(lo, budget_s / estimate_s)))


def cuda_event_median(fn: Callable[[], None], reps: int, warmup: int = CUDA_WARMUP) -> float:
    """Median seconds of `fn` timed by CUDA events around each repetition (GPU time, no host
    clock or launch gap in it), after `warmup` untimed runs."""
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(reps)]
    for start, end in zip(starts, ends, strict=True):
        start.record()
        fn()
        end.record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) / 1e3 for s, e in zip(starts, ends, strict=True))


def timer(device: torch.device, quick: bool = False) -> Callable[..., float]:
    """measure(fn, reps) -> median seconds. CUDA: events, with the repetitions sized from a first
    estimate to fill the timing budget; CPU: the host clock (ops are milliseconds long there)."""
    if device.type == "cuda":
        budget = QUICK_TIMED_BUDGET_S if quick else TIMED_BUDGET_S

        def measure_cuda(fn, reps: int = MIN_REPS, warmup: int = CUDA_WARMUP) -> float:
            estimate = cuda_event_median(fn, 3, warmup)
            return cuda_event_median(fn, max(reps, repetitions(estimate, budget)), 0)

        return measure_cuda

    def measure(fn, reps: int, warmup: int = 2) -> float:
        for _ in range(warmup):
            fn()
        times = []
        for _ in range(reps):
            t0 = time.perf_counter()
            fn()
            times.append(time.perf_counter() - t0)
        return statistics.median(times)

    return measure


def _dtype(device: torch.device) -> tuple[torch.dtype, Precision]:
    return (torch.bfloat16, "bf16") if device.type == "cuda" else (torch.float32, "fp32")


def layer_gemm_shapes(
    hidden: tuple[int, ...] = GPU_HIDDEN,
    tps: tuple[int, ...] = GPU_TP,
    tokens: tuple[int, ...] = GPU_TOKENS,
    ffn_ratio: float = FFN_RATIO,
    limit: tuple[int, int, int] = MAX_GEMM,
) -> list[tuple[int, int, int]]:
    """(m, n, k) of the projections of a decoder layer (Llama-style, GQA with 8 kv heads of 128,
    SwiGLU) for each hidden size, tp degree and micro-batch token count: QKV (m x h)@(h x (h + 2 kv)/tp),
    output (m x h/tp)@(h/tp x h), gate+up (m x h)@(h x 2 ffn/tp), down (m x ffn/tp)@(ffn/tp x h).
    Shapes of more work than `limit` (m x n x k) are left out; plus the square SQUARE_REFERENCE matmul."""
    shapes = {(SQUARE_REFERENCE,) * 3}
    for h in hidden:
        ffn = int(round(h * ffn_ratio / 256)) * 256
        kv = 8 * 128
        for tp in tps:
            for m in tokens:
                for n, k in (((h + 2 * kv) // tp, h), (h, h // tp), (2 * ffn // tp, h), (h, ffn // tp)):
                    if m * n * k <= limit[0] * limit[1] * limit[2]:
                        shapes.add((m, n, k))
    return sorted(shapes)


def cpu_gemm_shapes(quick: bool) -> list[tuple[int, int, int]]:
    """CPU worker sweep: rows x max(d, 256) @ max(d, 256) x d, d = 16..2048 (one thread: larger
    shapes take seconds and the curve is flat beyond 128)."""
    rows = 2048 if quick else 4096
    return [(rows, d, max(d, 256)) for d in (QUICK_GEMM_DIMS if quick else GEMM_DIMS)]


def measure_gemm(device: torch.device, quick: bool, shapes: list[tuple[int, int, int]] | None = None) -> list[dict]:
    """Seconds and achieved FLOP/s of (m x k) @ (k x n) for each shape."""
    dtype, _ = _dtype(device)
    if shapes is None:
        if device.type == "cuda":
            shapes = layer_gemm_shapes(*((QUICK_GPU_HIDDEN, QUICK_GPU_TP, QUICK_GPU_TOKENS) if quick else ()))
        else:
            shapes = cpu_gemm_shapes(quick)
    measure = timer(device, quick)
    out = []
    for m, n, k in shapes:
        a = torch.randn(m, k, device=device, dtype=dtype)
        b = torch.randn(k, n, device=device, dtype=dtype)
        flops = 2.0 * m * n * k
        reps = MIN_REPS if device.type == "cuda" else max(3, min(50, int(2e9 / flops)))
        t = measure(lambda a=a, b=b: a @ b, reps)
        out.append({"m": m, "n": n, "k": k, "rows": m, "min_dim": min(m, n, k), "seconds": t, "flops_per_s": flops / t})
        del a, b
    return out


def measure_gemm_alignment(
    device: torch.device, quick: bool, tokens: int = ALIGNMENT_TOKENS, hidden: int = ALIGNMENT_HIDDEN
) -> list[dict]:
    """An LM head's three GEMMs (forward x W^T, dgrad dy W, wgrad dy^T x) at ALIGNMENT_WIDTHS output rows: a multiple
    of 16 bytes, one of 4 bytes only, an odd count (cost_models/compute.py alignment_slowdown; `alignment_slowdowns`
    turns them into the GEMM shape model's two factors). Seconds of the three together per width."""
    measure = timer(device, quick)
    tokens = tokens // 4 if quick else tokens
    reps = MIN_REPS if device.type == "cuda" else 3
    out = []
    for kind, width in ALIGNMENT_WIDTHS.items():
        seconds = sum(measure(fn, reps) for fn in head_gemm_passes(device, tokens, hidden, width).values())
        out.append({"kind": kind, "m": tokens, "n": width, "k": hidden, "seconds": seconds})
    return out


def head_gemm_passes(device: torch.device, tokens: int, hidden: int, width: int) -> dict[str, Callable[[], Any]]:
    """An LM head's three GEMMs in the device's precision, on random operands: forward (logits = x W^T), dgrad
    (dx = dlogits W) and wgrad (dW = dlogits^T x); the operands live as long as the callables."""
    dtype, _ = _dtype(device)
    w = torch.randn(width, hidden, device=device, dtype=dtype)
    x = torch.randn(tokens, hidden, device=device, dtype=dtype)
    dy = torch.randn(tokens, width, device=device, dtype=dtype)
    return {"fwd": lambda: x @ w.t(), "dgrad": lambda: dy @ w, "wgrad": lambda: dy.t() @ x}


def alignment_slowdowns(rows: list[dict]) -> dict[str, float]:
    """The GEMM shape model's misaligned_slowdown / odd_slowdown from `measure_gemm_alignment`'s rows: each width's
    time over the aligned one's (per FLOP; at least 1)."""
    by = {r["kind"]: r["seconds"] / (r["m"] * r["n"] * r["k"]) for r in rows}
    return {f"{kind}_slowdown": max(1.0, by[kind] / by["aligned"]) for kind in ("misaligned", "odd") if kind in by}


def measure_memory_bandwidth(device: torch.device, quick: bool) -> float:
    n = (1 << 23) if quick else (1 << 24)
    if device.type == "cuda":
        n *= 16
    x = torch.randn(n, device=device)
    y = torch.empty_like(x)
    t = timer(device, quick)(lambda: torch.mul(x, 2.0, out=y), 5 if quick else 10)
    return 2 * x.numel() * x.element_size() / t


def attention_flops(batch: int, heads: int, seq: int, head_dim: int) -> tuple[float, float]:
    """(forward, backward) FLOPs of causal attention as FlashAttention counts them: 4 b h s^2 d / 2
    forward, 2.5x that backward (h100-microbench/attention.json counts the same)."""
    from berth.cost_models.compute import ATTENTION_BACKWARD_FLOPS, CAUSAL_WORK_FRACTION

    fwd = 4.0 * batch * heads * seq * seq * head_dim * CAUSAL_WORK_FRACTION
    return fwd, ATTENTION_BACKWARD_FLOPS * fwd


def attention_shapes(device_type: str, quick: bool) -> list[tuple[int, int, int, int]]:
    """(batch, heads per rank, seq, head dim) to time: CUDA, the layers berth plans (seq 2k-8k,
    32-128 heads over tp 1-8, head dim 128, ATTENTION_TOKENS per shape) and, at the same sequences,
    head dim 64 (SMALL_HEAD_HEADS), whose asymptote the model keeps apart; CPU, one small shape."""
    if device_type != "cuda":
        return [(4, 4, 256, 64)]
    seqs, heads = (QUICK_ATTENTION_SEQ, QUICK_ATTENTION_HEADS) if quick else (ATTENTION_SEQ, ATTENTION_HEADS)
    small = SMALL_HEAD_HEADS[:1] if quick else SMALL_HEAD_HEADS
    return [
        (max(1, ATTENTION_TOKENS // s), h, s, d)
        for d, per_rank in ((ATTENTION_HEAD_DIM, heads), (SMALL_HEAD_DIM, small))
        for s in seqs
        for h in per_rank
    ]


def measure_attention(device: torch.device, quick: bool) -> list[dict]:
    """Causal scaled_dot_product_attention forward and backward, timed separately, at each shape
    (the kernel torch selects for the executor's layer, `_time_attention`)."""
    measure = timer(device, quick)
    rows = []
    for b, heads, s, d in attention_shapes(device.type, quick):
        fwd_s, bwd_s, backend = _time_attention(device, measure, b, heads, s, d, 3 if quick else 8)
        f_fwd, f_bwd = attention_flops(b, heads, s, d)
        rows.append(
            {
                "batch": b,
                "heads": heads,
                "seq": s,
                "head_dim": d,
                "forward_s": fwd_s,
                "backward_s": bwd_s,
                "forward_flops": f_fwd,
                "backward_flops": f_bwd,
                "flops_per_s": (f_fwd + f_bwd) / (fwd_s + bwd_s),
                "backend": backend,
            }
        )
    return rows


def _time_attention(
    device: torch.device, measure, b: int, heads: int, s: int, d: int, reps: int
) -> tuple[float, float, str]:
    """(forward s, backward s, backend) of one shape, called as the executor's layer calls it for a
    grouped-query model (executor/model.py `Attention.forward` and `CausalAttention`: q as `rotary`
    returns it and k, v as `repeat_interleave` returns them, all contiguous (b, heads, s, d); a
    multi-head layer passes v as a transposed view instead, the same last-dimension stride), causal
    F.scaled_dot_product_attention with no backend forced: the kernel timed is the one torch picks
    (`backend`, its name). Forcing the flash backend, as this did before, timed another kernel than
    the layers run: on an H200 with torch 2.11 the profile's attention came out at 0.27 of the bf16
    peak (median) and predicted the executor's whole steps 10 % slow. Timed as here on the same kind of
    machine, torch picked cuDNN's attention, the asymptotes came out at 0.68 / 0.64 (forward / backward,
    0.36 before), and the same steps were predicted within 5.6 % at the mean, as with the bundled
    profile's attention terms (benchmarks/results/gpu-h200/README.md)."""
    dtype, _ = _dtype(device)
    q, k, v = (torch.randn(b, heads, s, d, device=device, dtype=dtype, requires_grad=True) for _ in range(3))

    def forward() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    fwd_s = measure(forward, reps)
    out = forward()
    grad = torch.ones_like(out)
    bwd_s = measure(lambda: torch.autograd.grad(out, (q, k, v), grad, retain_graph=True), reps)
    return fwd_s, bwd_s, sdpa_backend(q, k, v)


def sdpa_backend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> str:
    """The fused SDPA kernel torch selects for causal attention of these inputs, by name (flash_attention,
    efficient_attention, cudnn_attention, math, ...), as the profile records it."""
    try:
        from torch.nn.attention import SDPBackend

        return SDPBackend(int(torch._fused_sdp_choice(q, k, v, is_causal=True))).name.lower()
    except (ImportError, RuntimeError, ValueError, TypeError, AttributeError) as err:  # a torch without it
        return f"unknown ({type(err).__name__})"


def attention_backends(rows: list[dict]) -> list[str]:
    """The SDPA kernels the attention rows of a profile recorded (`sdpa_backend`), sorted; [] for older profiles."""
    return sorted({str(a["backend"]) for a in rows if a.get("backend")})


def measure_op_overhead(device: torch.device) -> float:
    x = torch.randn(8, device=device)
    reps = 2000
    sync = torch.cuda.synchronize if device.type == "cuda" else (lambda: None)

    def many() -> None:
        for _ in range(reps):
            torch.mul(x, 2.0)

    times = []
    for trial in range(4):  # host clock around many launches: the dispatch floor per op
        sync()
        t0 = time.perf_counter()
        many()
        sync()
        if trial:
            times.append(time.perf_counter() - t0)
    return statistics.median(times) / reps


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
    mine: dict[str, Any] = {
        "gemm": measure_gemm(torch.device("cpu"), quick),
        "memory_bandwidth": measure_memory_bandwidth(torch.device("cpu"), quick),
        "attention": measure_attention(torch.device("cpu"), quick),
        "op_overhead": measure_op_overhead(torch.device("cpu")),
    }
    everyone: list[Any] = [None] * world
    dist.all_gather_object(everyone, mine)

    def mean_rows(key: str, fields: tuple[str, ...]) -> list[dict]:
        return [
            dict(row, **{f: float(np.mean([e[key][i][f] for e in everyone])) for f in fields})
            for i, row in enumerate(mine[key])
        ]

    return {
        "gemm": mean_rows("gemm", ("seconds", "flops_per_s")),
        "processes": world,
        "attention": mean_rows("attention", ("forward_s", "backward_s", "flops_per_s")),
        **{k: float(np.mean([e[k] for e in everyone])) for k in ("memory_bandwidth", "op_overhead")},
    }


def _comm_worker(out: str, sizes: list[int], reps: int, compute: bool = False, quick: bool = False) -> None:
    """Runs under torchrun: time each collective at each size; rank 0 writes the medians (and,
    with `compute`, the concurrent compute figures)."""
    import torch.distributed as dist

    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    device = rank_device()
    cuda = device.type == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
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
        Path(out).write_text(
            json.dumps({"world": world, "backend": dist.get_backend(), "results": results, "compute": concurrent})
        )
    dist.barrier()
    dist.destroy_process_group()


def measure_collectives(nprocs: int, quick: bool, compute: bool = False, timeout_s: float = 300.0) -> dict:
    with tempfile.TemporaryDirectory() as tmp:
        out = Path(tmp) / "comm.json"
        sizes = QUICK_COMM_SIZES if quick else COMM_SIZES
        cmd = (
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                f"--nproc-per-node={nprocs}",
                "-m",
                "berth.executor.profile",
                "--comm-worker",
                str(out),
                "--sizes",
                ",".join(map(str, sizes)),
                "--reps",
                "3" if quick else "5",
            ]
            + (["--compute"] if compute else [])
            + (["--quick"] if quick else [])
        )
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, env=env)
        if not out.is_file():
            raise RuntimeError(f"collective benchmark on {nprocs} processes failed: {r.stderr[-1500:]}")
        return json.loads(out.read_text())


def fit_collective(points: list[list[float]], op: CollectiveOp, n: int) -> dict[str, float]:
    """Least squares on relative error of t = latency + bytes x factor / bus_bandwidth."""
    from scipy.optimize import nnls

    x = np.array([p[0] for p in points], dtype=float) * RING_FACTOR[op](n)
    t = np.array([p[1] for p in points], dtype=float)
    w = 1.0 / t
    design = np.stack([np.ones_like(x), x], axis=1) * w[:, None]
    (latency, inv_bw), _ = nnls(design, t * w)  # both terms non-negative
    inv_bw = max(inv_bw, 1e-13)
    return {"latency_s": float(latency), "bus_bandwidth_bytes_per_s": float(1.0 / inv_bw)}


def isotonic(values: list[float], weights: list[float] | None = None) -> list[float]:
    """The non-decreasing sequence closest to `values` in weighted least squares (pool adjacent
    violators): GEMM efficiency does not fall as the smallest dimension grows, timing noise does."""
    blocks: list[tuple[float, float, int]] = []  # (mean, weight, count)
    for v, w in zip(values, weights or [1.0] * len(values), strict=True):
        blocks.append((float(v), float(w), 1))
        while len(blocks) > 1 and blocks[-2][0] > blocks[-1][0]:
            m2, w2, c2 = blocks.pop()
            m1, w1, c1 = blocks.pop()
            blocks.append(((m1 * w1 + m2 * w2) / (w1 + w2), w1 + w2, c1 + c2))
    return [b[0] for b in blocks for _ in range(b[2])]


def gemm_curve(gemm: list[dict], reference_flops: float, monotone: bool = True) -> tuple[list[float], list[float]]:
    """(min dims, fractions of `reference_flops`): the median efficiency of the shapes in each
    power-of-two bin of their smallest dimension, fitted non-decreasing (`isotonic`, weighted by
    the shapes in the bin) when `monotone`. Fractions are measured / reference, never capped at
    another measurement (the schema bounds them to (0, 1])."""
    bins: dict[int, list[float]] = {}
    for g in gemm:
        d = int(2 ** round(np.log2(g["min_dim"])))
        bins.setdefault(d, []).append(g["flops_per_s"] / reference_flops)
    dims = sorted(bins)
    medians = [float(np.median(bins[d])) for d in dims]
    fitted = isotonic(medians, [len(bins[d]) for d in dims]) if monotone else medians
    return [float(d) for d in dims], [min(1.0, max(1e-4, f)) for f in fitted]


def square_matmul(gemm: list[dict]) -> dict | None:
    """The square SQUARE_REFERENCE matmul of a GPU sweep: the "peak achievable" reference."""
    return next((g for g in gemm if g["m"] == g["n"] == g["k"] == SQUARE_REFERENCE), None)


PEAK_AGREEMENT = 0.05  # the curve's top must be within 5 % of the square matmul, else the sweep is suspect


def _median_ratio(measured: list[float], predicted) -> float:
    return float(np.median(np.asarray(measured, dtype=float) / np.asarray(predicted, dtype=float)))


def shape_models_rescaled(measurements: dict, base: DeviceProfile, reference: float) -> dict:
    """The base profile's measured shape models (GEMM efficiency by (m, n, k), fused attention by
    shape; cost_models/compute.py) moved to this GPU's level: each asymptote is multiplied by the
    median ratio of what the sweep measured to what the model predicts at the same shapes (the
    knees, which need thousands of timings to fit, stay the base fit's). Without the models (older
    profiles) nothing changes: the legacy curve above is used."""
    from berth.cost_models.compute import gemm_efficiency

    out: dict = {}
    gemm = measurements["gemm"]
    if base.gemm_shape is not None and gemm:
        predicted = gemm_efficiency(base, *(np.asarray([g[x] for g in gemm], dtype=float) for x in "mnk"))
        ratio = _median_ratio([g["flops_per_s"] / reference for g in gemm], predicted)
        shape = base.gemm_shape
        slowdowns = alignment_slowdowns(measurements.get("gemm_alignment") or [])
        out["gemm_shape"] = shape.model_copy(
            update={"max_fraction": float(min(1.0, shape.max_fraction * ratio)), **slowdowns}
        )
    attention = measurements["attention"]
    if base.attention_shape is not None and attention:
        # each asymptote by the rows at its head dim; a head dim not timed (older profiles) moves with the other,
        # and rows at neither (a head dim between) move both
        large, small = attention_by_head_dim(attention)
        if not large and not small:
            large = attention
        passes = {}
        for index, name in enumerate(("forward", "backward")):
            model = getattr(base.attention_shape, name)
            ratio_large = _attention_ratio(large or small, model, index, reference)
            ratio_small = _attention_ratio(small, model, index, reference) if small else ratio_large
            passes[name] = model.model_copy(
                update={
                    "max_fraction": float(min(1.0, model.max_fraction * ratio_large)),
                    "max_fraction_small_head": float(min(1.0, model.max_fraction_small_head * ratio_small)),
                }
            )
        out["attention_shape"] = base.attention_shape.model_copy(update=passes)
    return out


def _attention_ratio(rows: list[dict], model: AttentionPassModel, index: int, reference: float) -> float:
    """Median measured / modelled efficiency of one attention pass (index 0 forward, 1 backward) over rows."""
    from berth.cost_models.compute import attention_efficiency

    name = ("forward", "backward")[index]
    flops = [attention_flops(a["batch"], a["heads"], a["seq"], a["head_dim"])[index] for a in rows]
    measured = [f / a[f"{name}_s"] / reference for f, a in zip(flops, rows, strict=True)]
    modelled = [attention_efficiency(model, a["head_dim"], a["seq"], a["batch"] * a["heads"] * a["seq"]) for a in rows]
    return _median_ratio(measured, modelled)


def attention_by_head_dim(rows: list[dict]) -> tuple[list[dict], list[dict]]:
    """The attention rows at head dim >= 128 and <= 64: the two asymptotes of the attention model
    (cost_models/compute.py HEAD_DIM_LARGE, HEAD_DIM_SMALL)."""
    from berth.cost_models.compute import HEAD_DIM_LARGE, HEAD_DIM_SMALL

    return [a for a in rows if a["head_dim"] >= HEAD_DIM_LARGE], [a for a in rows if a["head_dim"] <= HEAD_DIM_SMALL]


def profile_fields(measurements: dict, base: DeviceProfile, precision: Precision) -> tuple[dict, dict, dict]:
    """The one place measured timings become DeviceProfile fields: (fields, sources, checks).

    GPU: `peak_flops_per_s` stays the datasheet peak of the base profile (what MFU is computed
    against); every efficiency is measured / datasheet: the GEMM curve, attention (median over the
    shapes of forward + backward FLOP/s), memory bandwidth. The square 8192 matmul is the peak
    achievable; the curve's top must agree with it within PEAK_AGREEMENT (`checks`). CPU (no
    datasheet for a worker process): the peak is the best GEMM measured and fractions are relative
    to it, as the cpu-host profile does."""
    gemm = measurements["gemm"]
    gpu = base.kind == "gpu"
    best = max(g["flops_per_s"] for g in gemm)
    reference = base.peak_flops(precision) if gpu else best
    # GPU: tile and wave quantization scatter the shapes of a bin, the trend is monotone; CPU:
    # cache effects make the efficiency of one thread genuinely non-monotone, kept as measured
    dims, fractions = gemm_curve(gemm, reference, monotone=gpu)
    large, small = attention_by_head_dim(measurements["attention"])
    # the legacy single fraction: at head dim 128 where timed (what it meant before head dim 64 was timed too)
    attention = [a["flops_per_s"] / reference for a in (large or measurements["attention"])]
    backends = attention_backends(measurements["attention"])
    bandwidth = measurements["memory_bandwidth_bytes_per_s"]
    fields: dict[str, Any] = {
        "peak_flops_per_s": {**base.peak_flops_per_s, precision: reference},
        "gemm": GemmCurve(min_dim=dims, peak_fraction=fractions),
        "attention_peak_fraction": min(1.0, float(np.median(attention))),
        "kernel_overhead_s": measurements["op_overhead_s"],
    }
    if gpu:
        fields.update(
            memory_bandwidth_bytes_per_s=base.memory_bandwidth_bytes_per_s,
            memory_bandwidth_fraction=min(1.0, bandwidth / base.memory_bandwidth_bytes_per_s),
        )
        fields.update(shape_models_rescaled(measurements, base, reference))
    else:
        fields.update(memory_bandwidth_bytes_per_s=bandwidth, memory_bandwidth_fraction=1.0)
    checks: dict = {"best_gemm_flops_per_s": best, "reference_flops_per_s": reference}
    square = square_matmul(gemm) if gpu else None
    if square is not None:
        top = fractions[-1] * reference
        checks.update(
            square_matmul_flops_per_s=square["flops_per_s"],
            curve_top_flops_per_s=top,
            curve_top_vs_square=top / square["flops_per_s"] - 1,
            peak_agrees=abs(top / square["flops_per_s"] - 1) <= PEAK_AGREEMENT,
        )
    what = "datasheet peak (base profile)" if gpu else "best GEMM of the sweep"
    sources = {
        f"peak_flops_per_s.{precision}": what,
        "gemm": f"{len(gemm)} GEMMs binned by min dim {[int(d) for d in dims]}, median measured / {what}, "
        + ("fitted non-decreasing" if gpu else "as measured"),
        "attention_peak_fraction": f"median over {len(attention)} causal SDPA shapes"
        + (" at head dim 128" if large else "")
        + " of forward+backward "
        f"FLOP/s / {what}; the kernel torch picked: {', '.join(backends) or 'not recorded'}",
        "memory_bandwidth_bytes_per_s": "datasheet, with memory_bandwidth_fraction = streaming multiply / datasheet"
        if gpu
        else "streaming multiply (achieved: fraction 1.0)",
        "kernel_overhead_s": "dispatch of a tiny op (host clock over 2000 launches)",
    }
    if gpu:
        sources["memory_bandwidth_fraction"] = "streaming multiply / datasheet bandwidth"
    by_dim = ", ".join(
        f"{len(rows)} at head dim {d}" if rows else f"none at {d} (moved with the other)"
        for d, rows in ((128, large), (64, small))
    )
    rescaled = {"gemm_shape": f"{len(gemm)} GEMMs", "attention_shape": f"causal SDPA shapes ({by_dim})"}
    for name, over in rescaled.items():
        if name in fields:  # the base's fit moved to the measured level (shape_models_rescaled)
            sources[name] = (
                f"the base profile's fit, its asymptotes x the median measured / modelled efficiency over {over} "
                "(the knees the base fit's)"
            )
    if "gemm_shape" in fields:
        aligned = measurements.get("gemm_alignment")
        sources["gemm_shape"] += (
            "; misaligned_slowdown / odd_slowdown: an LM head's three GEMMs at "
            + ", ".join(f"{r['n']:,}" for r in aligned)
            + " rows over the aligned width's time"
            if aligned
            else "; misaligned_slowdown / odd_slowdown: the base profile's (not timed)"
        )
    return fields, sources, checks


def build_profile(device_type: str, measurements: dict, comm: dict[int, dict], machine: dict) -> dict:
    """DeviceProfile and ServerProfile from the measurements (`profile_fields`); the base profile
    (cpu-host, or the GPU's own device profile) supplies what is not measured (TDP, kernels per
    layer, memory outside tensors); a GPU's memory is what torch reports for it."""
    _, precision = _dtype(torch.device(device_type))
    base = load_device("cpu-host") if device_type == "cpu" else load_device(machine["profile_base"])
    fields, measured_sources, checks = profile_fields(measurements, base, precision)
    when = datetime.now(UTC).date().isoformat()
    src = f"measured by `berth profile` on {machine['hostname']} ({when})"
    measured = {k: f"{v}, {src}" for k, v in measured_sources.items()}
    if device_type == "cuda":
        # everything not measured (the frameworks' layer work, the allocator and driver memory, the
        # shape models' knees, TDP) stays the base GPU profile's, with its sources
        device = DeviceProfile.model_validate(
            {
                **base.model_dump(),
                **{k: v for k, v in fields.items()},
                "name": f"{base.name}-profiled",
                "display_name": f"{base.display_name}, profiled on {machine['hostname']}",
                # torch's total is nvidia-smi's less what the driver keeps, which the capacity takes off again
                "memory_bytes": (
                    machine["gpu_memory_bytes"] + base.driver_reserved_bytes
                    if machine.get("gpu_memory_bytes")
                    else base.memory_bytes
                ),
                "sources": {**base.sources, **measured},
                # what was measured here is no longer the base profile's assumption
                "assumptions": {k: v for k, v in base.assumptions.items() if k.split(".")[0] not in measured},
            }
        )
    else:
        device = DeviceProfile(
            name=f"{base.name}-profiled",
            display_name=f"{base.display_name}, profiled on {machine['hostname']}",
            kind=base.kind,
            memory_bytes=machine.get("gpu_memory_bytes") or base.memory_bytes,
            kernels_per_layer_fwd=base.kernels_per_layer_fwd,
            framework_overhead_bytes=base.framework_overhead_bytes,
            allocator_fragmentation_fraction=base.allocator_fragmentation_fraction,
            tdp_watts=base.tdp_watts,
            tp_kernel_overhead_s=base.tp_kernel_overhead_s,
            **fields,
            sources=measured,
            assumptions={
                k: v
                for k, v in base.assumptions.items()
                if k
                in (
                    "memory_bytes",
                    "framework_overhead_bytes",
                    "allocator_fragmentation_fraction",
                    "kernels_per_layer_fwd",
                )
            },
        )
    server_base = load_server("local-cpu" if device_type == "cpu" else machine.get("server_base", "dgx-h100"))
    link = server_base.intra_node
    base_latency = server_base.collective_base_latency_s
    sources = {}
    fits = {}
    if comm:
        n = min(comm)
        fits = {op: fit_collective(comm[n]["results"][op], op, n) for op in RING_FACTOR}
        ar = fits["all_reduce"]
        bw = ar["bus_bandwidth_bytes_per_s"]
        scale: dict[CollectiveOp, float] = {
            op: bw / f["bus_bandwidth_bytes_per_s"] for op, f in fits.items() if op != "all_reduce"
        }
        # all-reduce latency over n ranks = base + 2 (n - 1) hops; split half and half
        hop = ar["latency_s"] / (2 * (n - 1)) / 2
        base_latency = ar["latency_s"] / 2
        link = LinkProfile(
            kind=link.kind, bandwidth_bytes_per_s=bw, collective_efficiency=1.0, hop_latency_s=hop, op_time_scale=scale
        )
        sources = {
            "intra_node": f"{comm[n]['backend']} collectives on {n} processes fitted to latency + bytes / "
            f"bus bandwidth, {src}",
            "op_time_scale": "each op's fitted bus bandwidth relative to all-reduce's",
        }
    server = ServerProfile(
        name="local-profiled",
        display_name=f"{machine['hostname']} (profiled)",
        device=device.name,
        gpus_per_node=max(comm) if comm else machine.get("gpus", 1),
        intra_node=link,
        inter_node=link,
        collective_base_latency_s=base_latency,
        comm_overlap_efficiency=server_base.comm_overlap_efficiency,
        sources=sources,
        assumptions={"one_node": "the profile describes one machine; inter_node = intra_node"},
    )
    return {
        "format": PROFILE_FORMAT,
        "created": datetime.now(UTC).isoformat(),
        "machine": machine,
        "device": device.model_dump(mode="json"),
        "server": server.model_dump(mode="json"),
        "checks": checks,
        "measurements": {**measurements, "collectives": {str(k): v for k, v in comm.items()}, "collective_fits": fits},
    }


def gpu_base(name: str) -> tuple[str, str]:
    """(device profile, server preset) of this GPU by its name (the nvidia_smi section of its device file);
    an unknown GPU is an error naming the known ones."""
    from berth.hardware_profiles import UnknownProfileError, nvidia_smi_device
    from berth.specs.errors import BerthError

    try:
        return nvidia_smi_device(name)
    except UnknownProfileError as err:
        raise BerthError(
            "device", name, f"no device profile for this GPU; known GPUs: {', '.join(err.known)}"
        ) from None


def run_profile(quick: bool = False, max_procs: int | None = None, progress: Progress | None = None) -> dict:
    say = progress or (lambda _msg: None)
    device = rank_device(0)
    cuda = device.type == "cuda"
    if not cuda:
        torch.set_num_threads(int(os.environ.get("BERTH_THREADS_PER_RANK", "1")))
    machine: dict[str, Any] = {
        "hostname": platform.node(),
        "cpu_count": os.cpu_count(),
        "torch": torch.__version__,
        "device": device.type,
        "threads": torch.get_num_threads(),
        "quick": quick,
    }
    if cuda:
        machine["gpu"] = torch.cuda.get_device_name(device)
        machine["gpu_memory_bytes"] = float(torch.cuda.get_device_properties(device).total_memory)
        machine["gpus"] = torch.cuda.device_count()
        machine["profile_base"], machine["server_base"] = gpu_base(machine["gpu"])
        machine["timing"] = (
            f"CUDA events, median of >= {MIN_REPS} repetitions filling "
            f"{QUICK_TIMED_BUDGET_S if quick else TIMED_BUDGET_S} s after {CUDA_WARMUP} warm-ups"
        )
    say("GEMM sweep" + (" (layer shapes, CUDA events)" if cuda else ""))
    gemm = measure_gemm(device, quick)
    alignment = measure_gemm_alignment(device, quick) if cuda else []
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
    measurements = {
        "gemm": gemm,
        "gemm_alignment": alignment,
        "memory_bandwidth_bytes_per_s": bandwidth,
        "attention": attention,
        "op_overhead_s": overhead,
    }
    return build_profile(device.type, measurements, comm, machine)


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
