"""Step time, throughput and memory of every candidate, with breakdowns (all vectorized).

Per micro-batch, the slowest pipeline stage runs its layers' forward, backward and
recomputation, the tensor-parallel collectives of each layer (exposed: Megatron does not
overlap them, Shoeybi 2019), and its stage-to-stage sends. The pipeline runs m micro-batches at
the pace of the slowest stage plus a fill/drain bubble of (p - 1)/v mean micro-batch times
(Narayanan 2021). Data-parallel gradient reduction (and ZeRO-3 parameter gathers) overlap with
backward compute; only the part longer than the compute it hides behind, and at least the last
layer's share, is exposed. The optimizer step follows.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from cost_models import comm, compute, flops, goodput, memory
from cost_models.candidates import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, Candidates
from cost_models.pipeline import bubble_s
from cost_models.validity import MEMORY_TIGHT, OUT_OF_MEMORY, VALID, structural_reasons
from planner.specs import DEFAULT_MEMORY_HEADROOM, ClusterSpec, ModelSpec, TrainingSpec

TP_COLLECTIVES_PER_LAYER_PASS = 2  # one after attention, one after the MLP (Shoeybi 2019, Fig. 4)
# The fraction of a compute window that hides data-parallel communication is the cluster's
# comm_overlap_efficiency: NCCL kernels take SMs and memory bandwidth from the GEMMs they overlap
# with and bucket boundaries leave gaps, so the window is never fully usable; the default 0.7 is
# an assumption (PyTorch FSDP, Zhao et al. 2023, Sec. 6 reports overlap well short of perfect at
# scale) and a parameter `berth calibrate` fits.
COMPUTE_BOUND_SHARE = 0.05  # below this share of the step no overhead is called the bottleneck
BOTTLENECK_TERMS = {
    "tp_comm": ("tp_comm",),
    "dp_comm": ("dp_comm",),
    "pipeline_bubble": ("bubble", "pp_comm"),
    "memory": ("recompute",),
    "optimizer": ("optimizer",),
}


@dataclass(frozen=True)
class Evaluation:
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    hfu: np.ndarray
    peak_memory_bytes: np.ndarray
    reason: np.ndarray  # 0 = feasible, else a code from cost_models.validity
    time_breakdown_s: dict[str, np.ndarray]
    memory_breakdown_bytes: dict[str, np.ndarray]
    bottleneck: np.ndarray  # index into BOTTLENECK_NAMES
    model_flops_per_step: float
    hardware_flops_per_step: np.ndarray
    goodput: goodput.Goodput
    cost: dict[str, np.ndarray]

    @property
    def feasible(self) -> np.ndarray:
        return self.reason == VALID


BOTTLENECK_NAMES: tuple[str, ...] = ("compute", *BOTTLENECK_TERMS)


def _tp_layer_s(cluster: ClusterSpec, activation_bytes, tp, stride):
    """Forward collectives of one layer: 2 all-reduces, or with sequence parallelism 2
    all-gathers + 2 reduce-scatters, which move the same bytes (Korthikanti 2022 Sec. 4.2.2)."""
    return TP_COLLECTIVES_PER_LAYER_PASS * comm.all_reduce_s(cluster, activation_bytes, tp, stride)


def _dp_times(training, cluster, c, stage_params, compute_mb_s, layers_per_stage, dp_stride):
    """Exposed data-parallel time per step: gradient reduction for ZeRO 0-2 once per step,
    parameter gathers and gradient reduce-scatters per micro-batch for ZeRO-3, and for hybrid
    sharding an all-reduce of the shard across replicas (the shard group is the inner part of dp)."""
    e = training.bytes_per_element
    grad_bytes = stage_params * e
    shard = c.shard.astype(float)
    replicate = c.dp / shard
    stride_shard, stride_rep = dp_stride, dp_stride * c.shard
    # all-gather and reduce-scatter of the stage's parameters over the shard group (costed apart: gloo differs)
    gather = comm.all_gather_s(cluster, grad_bytes, shard, stride_shard)
    scatter = comm.reduce_scatter_s(cluster, grad_bytes, shard, stride_shard)
    ar_replicate = comm.all_reduce_s(cluster, grad_bytes / shard, replicate, stride_rep)
    ar_dp = comm.all_reduce_s(cluster, grad_bytes, c.dp, dp_stride)
    # ZeRO 1/2: reduce-scatter grads and all-gather updated params within the shard group.
    zero12 = gather + scatter + ar_replicate
    per_step = np.where(c.zero == 0, ar_dp, np.where(c.zero <= 2, zero12, ar_replicate))
    overlap = cluster.comm_overlap_efficiency
    hide_behind = overlap * compute_mb_s * (2.0 / 3.0)  # last micro-batch's backward
    floor = per_step / layers_per_stage
    exposed_step = np.maximum(per_step - hide_behind, floor)
    # ZeRO-3: 2 all-gathers (fwd, bwd) + 1 reduce-scatter per micro-batch.
    per_mb = np.where(c.zero >= 3, 2.0 * gather + scatter, 0.0)
    exposed_mb = np.maximum(per_mb - overlap * compute_mb_s, per_mb / layers_per_stage)
    return exposed_step + c.nmb * exposed_mb


def evaluate(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates,
             memory_headroom: float = DEFAULT_MEMORY_HEADROOM) -> Evaluation:
    """`memory_headroom`: a layout whose predicted peak is above (1 - headroom) of what the
    allocator can reserve is "tight" (MEMORY_TIGHT), above all of it out of memory."""
    device = cluster.device
    e, s, h = training.bytes_per_element, training.seq_len, model.hidden_size
    b, tp, pp, vpp, nmb = c.mbs.astype(float), c.tp.astype(float), c.pp.astype(float), c.vpp, c.nmb
    layers_per_stage = model.num_layers / pp
    stride = c.strides()

    fwd, bwd, attn = compute.layer_compute_s(model, training, device, b, tp, c.sp)
    act_bytes = e * b * s * h
    tp_fwd = _tp_layer_s(cluster, act_bytes, tp, stride["tp"])
    recompute = np.where(
        c.recompute == RECOMPUTE_FULL, fwd + tp_fwd,
        np.where(c.recompute == RECOMPUTE_SELECTIVE, memory.selective_recompute_s(model, training, c, fwd, attn), 0.0)
    )
    tp_layer = 2.0 * tp_fwd  # forward + backward
    # Embedding (vocab-parallel: one all-reduce) and LM head (one in backward).
    head = compute.lm_head_compute_s(model, training, device, b, tp)
    edge_tp = comm.all_reduce_s(cluster, act_bytes, tp, stride["tp"])
    p2p = np.where(pp > 1, 2.0 * vpp * comm.p2p_s(cluster, act_bytes / tp, c.pp, stride["pp"]), 0.0)

    body_compute = layers_per_stage * (fwd + bwd)
    body_recompute = layers_per_stage * recompute
    body_tp = layers_per_stage * tp_layer
    first = body_compute + body_recompute + body_tp + edge_tp + p2p + np.where(pp == 1, head + edge_tp, 0.0)
    last = body_compute + body_recompute + body_tp + head + edge_tp + p2p + np.where(pp == 1, edge_tp, 0.0)
    middle = body_compute + body_recompute + body_tp + p2p
    slowest = np.maximum(first, last)
    mean_mb = np.where(pp == 1, slowest, (first + last + (pp - 2.0) * middle) / pp)
    last_is_slowest = last >= first

    bubble = bubble_s(pp, vpp, mean_mb)
    stage_params = np.maximum(memory.stage_params(model, pp, tp, True), memory.stage_params(model, pp, tp, False))
    dp = _dp_times(training, cluster, c, stage_params, body_compute + body_recompute, layers_per_stage,
                   stride["dp"])
    local_params = stage_params / np.where(c.zero >= 1, c.shard, 1)
    optimizer = compute.optimizer_step_s(device, training, local_params)

    edge_tp_twice = np.where(pp == 1, 2.0, 1.0) * edge_tp  # pp = 1: embedding and head together
    time = {
        "compute": nmb * (body_compute + np.where(last_is_slowest | (pp == 1), head, 0.0)),
        "recompute": nmb * body_recompute,
        "tp_comm": nmb * (body_tp + edge_tp_twice),
        "pp_comm": nmb * p2p,
        "bubble": bubble,
        "dp_comm": dp,
        "optimizer": optimizer,
    }
    step = nmb * slowest + bubble + dp + optimizer

    peak, mem = memory.peak_memory(model, training, device, c)
    reason = structural_reasons(c, model, training, cluster)
    capacity = memory.allocator_capacity_bytes(device, cluster.world_size)
    reason = np.where((reason == VALID) & (peak > capacity), OUT_OF_MEMORY, reason)
    reason = np.where((reason == VALID) & (peak > capacity * (1.0 - memory_headroom)), MEMORY_TIGHT, reason)

    model_flops = flops.model_flops_per_step(model, training)
    hw_flops = model_flops + flops.recompute_flops_per_step(model, training, c.recompute)
    peak_flops = device.peak_flops(training.precision) * cluster.world_size
    tokens_per_s = training.global_batch_size * s / step
    good = goodput.goodput(model, training, cluster, c, step, tokens_per_s)
    return Evaluation(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        mfu=model_flops / (step * peak_flops),
        hfu=hw_flops / (step * peak_flops),
        peak_memory_bytes=peak,
        reason=reason,
        time_breakdown_s=time,
        memory_breakdown_bytes=mem,
        bottleneck=_bottleneck(time, step, reason),
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        goodput=good,
        cost=goodput.cost(cluster, step, good.goodput_tokens_per_s, training.token_budget),
    )


def _bottleneck(time: dict[str, np.ndarray], step: np.ndarray, reason: np.ndarray) -> np.ndarray:
    """Index into BOTTLENECK_NAMES of the largest non-compute term; "compute" when every
    overhead is under COMPUTE_BOUND_SHARE of the step; "memory" when the layout does not fit."""
    terms = np.stack([sum(time[k] for k in keys) for keys in BOTTLENECK_TERMS.values()])
    largest = np.argmax(terms, axis=0)
    share = np.take_along_axis(terms, largest[None], axis=0)[0] / step
    index = np.where(share < COMPUTE_BOUND_SHARE, 0, largest + 1)
    return np.where((reason == OUT_OF_MEMORY) | (reason == MEMORY_TIGHT), BOTTLENECK_NAMES.index("memory"), index)


def stage_compute(model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates,
                  first: bool) -> dict[str, np.ndarray]:
    """Per-step compute of one rank of the first or the last pipeline stage, communication
    excluded: its layers' forward and backward over all micro-batches (plus the LM head where the
    stage has it), the recomputation, and the optimizer step on its shard of the stage's
    parameters. This is what a rank-slice proxy measures (executor/proxy.py)."""
    device = cluster.device
    b, tp, pp = c.mbs.astype(float), c.tp.astype(float), c.pp.astype(float)
    layers = model.num_layers / pp
    fwd, bwd, attn = compute.layer_compute_s(model, training, device, b, tp, c.sp)
    selective = memory.selective_recompute_s(model, training, c, fwd, attn)
    recompute = np.where(c.recompute == RECOMPUTE_FULL, fwd,
                         np.where(c.recompute == RECOMPUTE_SELECTIVE, selective, 0.0))
    has_head = (pp == 1) | (not first)
    head = np.where(has_head, compute.lm_head_compute_s(model, training, device, b, tp), 0.0)
    params = memory.stage_params(model, c.pp, c.tp, first)
    local = params / np.where(c.zero >= 1, c.shard, 1)
    return {
        "forward_backward": c.nmb * (layers * (fwd + bwd) + head),
        "recompute": c.nmb * layers * recompute,
        "optimizer": compute.optimizer_step_s(device, training, local),
    }
