"""Step time, throughput and memory of every candidate, with breakdowns (all vectorized).

Per micro-batch, the slowest pipeline stage runs its layers' forward, backward and
recomputation, the tensor-parallel collectives of each layer (exposed: Megatron does not
overlap them, Shoeybi 2019; nor is the backward's second gather of sequence-parallel inputs credited
with the input-gradient GEMM that Megatron's and nanotron's code overlap it with: docs/accuracy.md), and
its stage-to-stage sends. The pipeline runs m micro-batches at
the pace of the slowest stage plus a fill/drain bubble of (p - 1)/v mean micro-batch times
(Narayanan 2021). Stage depths follow specs/stages.py: with an uneven split the first and last
stages hold fewer layers and a middle stage (more layers, no embedding or head) can be the slowest.
Data-parallel traffic (gradient reduction, ZeRO-3 parameter gathers) is issued layer by layer
behind the forward or backward compute it overlaps (`_dp_times`); what a layer's traffic takes
beyond its usable compute, and the first or last layer's share, is exposed. The optimizer step
follows.

Context parallelism (cp, `cp_exchange_s`): each rank holds s/cp tokens of every sequence, in the
load-balanced causal split of torchtitan and Megatron (2 cp chunks, rank i holds chunks i and
2cp-1-i; Megatron-LM's context_parallel docs, Liu et al. 2023 "Ring Attention"), so every GEMM,
norm, activation and tp collective sees b s / cp tokens and the attention core total / cp FLOPs.
Data parallelism reduces gradients over dp x cp ranks (the cp ranks hold the same parameters;
Megatron's data-parallel group with cp, torchtitan's dp_shard_cp FSDP mesh), and ZeRO shards over
shard x cp ranks.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

import numpy as np

from berth.cost_models import comm, compute, flops, goodput, memory
from berth.cost_models.arrays import ArrayOrFloat
from berth.cost_models.pipeline import bubble_s, microbatches_in_flight
from berth.specs import stages
from berth.specs.candidates import RECOMPUTE_FULL, RECOMPUTE_SELECTIVE, Candidates
from berth.specs.engines import (
    engine_of,
    grad_reduce_exposed,
    param_gather_exposed,
    reduction_buckets,
    split_rule,
)
from berth.specs.hardware import LinkProfile
from berth.specs.tree import ClusterSpec, EngineTuning, Metrics, ModelSpec, Plan, TrainingSpec
from berth.specs.validity import MEMORY_TIGHT, OUT_OF_MEMORY, VALID, structural_reasons

TP_COLLECTIVES_PER_LAYER_PASS = 2  # one after attention, one after the MLP (Shoeybi 2019, Fig. 4)
# The fraction of a compute window that hides data-parallel communication is the cluster's
# comm_overlap_efficiency: NCCL kernels take SMs and memory bandwidth from the GEMMs they overlap
# with and bucket boundaries leave gaps, so the window is never fully usable; the default 0.7 is
# an assumption (PyTorch FSDP, Zhao et al. 2023, Sec. 6 reports overlap well short of perfect at
# scale) and a parameter `berth calibrate` fits.
# Communication that overlaps compute still slows it: NCCL's kernels occupy SMs (one thread block per
# channel) and HBM bandwidth the GEMMs they run beside would use. Measured with GPT and LLaMA models
# on 4 A100s, H100s, MI250s and MI210s: overlapped with communication, compute ran 18.9% slower on
# average (40% at worst) than alone ("Characterizing Compute-Communication Overlap in GPU-Accelerated Distributed Deep
# Learning: Performance and Power Implications", arXiv:2507.03114, 2025, abstract). `overlapped_s`
# charges that share of every second of communication a window hides.
OVERLAP_COMPUTE_SLOWDOWN = 0.189
CP_MERGE_PASSES = 3  # read the accumulator, read the step's partial, write the accumulator (fp32)
FP32 = 4.0
# Mixture of experts: the router never splits tokens evenly, and the step waits for the busiest
# expert-parallel rank (its expert GEMMs and the all-to-all it receives). Named assumption: the
# busiest rank gets 1.15x the mean load. Reasoning: with auxiliary-loss load balancing, capacity
# factors of 1.0-1.25 are what drop-free training needs (Fedus et al. 2022, Switch Transformer,
# Sec. 2.2 and Table 1: capacity factor 1.0-1.25; Lepikhin et al. 2021, GShard: 1.25 with
# 2 experts per token); 1.15 sits inside that range. It multiplies the routed experts' GEMM time
# and the token all-to-all. The expert GEMMs' shape (rows per expert) is costed as it runs.
MOE_IMBALANCE = 1.15
A2A_PER_MOE_LAYER = 4  # dispatch and combine, forward and backward (Megatron-LM's MoEAlltoAllTokenDispatcher)
# The bottleneck is the largest of these groups of the step's time terms, compute included: the term
# that takes most of the step ("memory" instead when the layout does not fit). Bubble and pipeline
# sends are one group (the pipeline's cost).
BOTTLENECK_TERMS = {
    "compute": ("compute",),
    "tp_comm": ("tp_comm",),
    "cp_comm": ("cp_comm",),
    "dp_comm": ("dp_comm",),
    "pipeline_bubble": ("bubble", "pp_comm"),
    "recompute": ("recompute",),
    "optimizer": ("optimizer",),
    "ep_comm": ("ep_comm",),  # MoE models only
}
# The communication terms whose collectives can run behind compute: comm_total_s holds what their
# traffic takes, hidden or not; time_breakdown_s what they add to the step.
COMM_TERMS = ("tp_comm", "cp_comm", "pp_comm", "dp_comm", "ep_comm")


@dataclass(frozen=True)
class Evaluation:
    step_time_s: np.ndarray
    tokens_per_s: np.ndarray
    mfu: np.ndarray
    hfu: np.ndarray
    peak_memory_bytes: np.ndarray
    required_memory_bytes: np.ndarray  # what must fit (memory.peak_memory)
    held_memory_bytes: np.ndarray  # what the allocator holds without waiting on a collective: the headroom's
    first_stage_memory_bytes: np.ndarray  # global rank 0's (pipeline stage 0): what engines' logs report
    last_stage_memory_bytes: np.ndarray  # the last pipeline stage's (the head and loss): nanotron's log line
    reason: np.ndarray  # 0 = feasible, else a code from berth.specs.validity
    time_breakdown_s: dict[str, np.ndarray]
    memory_breakdown_bytes: dict[str, np.ndarray]
    bottleneck: np.ndarray  # index into BOTTLENECK_NAMES
    comm_total_s: dict[str, np.ndarray]  # COMM_TERMS: seconds of traffic per step, hidden behind compute or not
    model_flops_per_step: float
    hardware_flops_per_step: np.ndarray
    goodput: goodput.Goodput
    cost: dict[str, np.ndarray]

    @property
    def feasible(self) -> np.ndarray:
        return self.reason == VALID


BOTTLENECK_NAMES: tuple[str, ...] = (*BOTTLENECK_TERMS, "memory")  # "memory": does not fit


def _tp_layer_s(cluster: ClusterSpec, activation_bytes, tp, stride) -> np.ndarray:
    """Forward collectives of one layer: 2 all-reduces, or with sequence parallelism 2
    all-gathers + 2 reduce-scatters, which move the same bytes (Korthikanti 2022 Sec. 4.2.2)."""
    return TP_COLLECTIVES_PER_LAYER_PASS * comm.all_reduce_s(cluster, activation_bytes, tp, stride)


def moe_tp_collective_share(model: ModelSpec, c: Candidates) -> ArrayOrFloat:
    """The share of a layer's tensor-parallel collectives a layout runs: 1, less the MLP's collective
    (one of TP_COLLECTIVES_PER_LAYER_PASS) in each MoE layer whose experts run unsplit by tp
    (expert_tp < tp: no tp collective inside the expert MLP, the tokens reach the experts by the ep
    all-to-all; Liu et al. 2025 Sec. 3; Megatron's MoEAlltoAllTokenDispatcher gathers over the expert-tp
    group only); a shared expert is a tp-split MLP and keeps it."""
    if not model.is_moe or model.num_shared_experts:
        return 1.0
    dropped = model.num_moe_layers / model.num_layers / TP_COLLECTIVES_PER_LAYER_PASS
    return np.where(memory.expert_tp_of(c) != c.tp, 1.0 - dropped, 1.0)


def second_gathers(model: ModelSpec) -> float:
    """All-gathers per layer that a backward repeats where the layer saved its column-parallel linears' input split
    over the sequence (`memory.linear_inputs_saved_split`): QKV's, and the MLP's in a dense layer or a shared expert;
    routed experts take their tokens from the dispatcher, whose backward is a reduce-scatter, and save them as they
    came (Megatron-Core's TEGroupedLinear runs no tp collective: explicit_expert_comm)."""
    if not model.is_moe or model.num_shared_experts:
        return 2.0
    return 2.0 - model.num_moe_layers / model.num_layers


def cp_exchange_s(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, b_local, tp, cp, cp_stride, attn_fwd_s, attn_bwd_s
) -> tuple[np.ndarray, np.ndarray]:
    """(forward, backward) exposed seconds of one layer's ring-attention KV exchange for one micro-batch.

    Ring attention (Liu et al. 2023; torchtitan `context_parallel`, Megatron-LM's p2p CP): cp - 1
    steps, in each of which every rank sends its current K and V block, 2 x b x s/cp x kv_heads/tp x
    head_dim elements (`b_local` = b / cp), to its ring neighbour while computing attention against
    the block it holds; one step's compute is the rank's attention / cp (the load-balanced split
    gives every step the same causal work). Exposed per step: max(0, transfer - compute), plus the
    attention the hidden transfer slows (`overlapped_s`). The
    backward ring moves K, V and the partial dK, dV: twice the bytes, behind the backward attention
    of the step. The transfer runs over the slowest link the cp group spans (`comm.p2p_s`).
    Each step also merges its partial result into the rank's fp32 accumulators (torchtitan's
    _merge_sdpa / Megatron's per-step correction: output rescaled by the log-sum-exp forward; dQ, and
    the travelling dK, dV, accumulated backward), CP_MERGE_PASSES memory-bound passes per tensor."""
    cp = np.asarray(cp, dtype=float)
    tokens = b_local * training.seq_len
    kv = 2.0 * tokens * model.kv_heads / tp * model.head_dim * training.bytes_per_element
    send = comm.p2p_s(cluster, kv, cp, cp_stride)
    steps = np.maximum(cp - 1.0, 0.0)
    window_f, window_b = attn_fwd_s / np.maximum(cp, 1.0), attn_bwd_s / np.maximum(cp, 1.0)
    q_elems = tokens * model.num_attention_heads / tp * model.head_dim
    kv_elems = 2.0 * tokens * model.kv_heads / tp * model.head_dim
    merge_f = compute.memory_bound_time_s(cluster.device, CP_MERGE_PASSES * FP32 * q_elems)
    merge_b = compute.memory_bound_time_s(cluster.device, CP_MERGE_PASSES * FP32 * (q_elems + kv_elems))
    fwd = np.where(cp > 1, steps * (overlapped_s(send, np.maximum(send - window_f, 0.0)) + merge_f), 0.0)
    bwd = np.where(cp > 1, steps * (overlapped_s(2.0 * send, np.maximum(2.0 * send - window_b, 0.0)) + merge_b), 0.0)
    return fwd, bwd


def overlapped_s(traffic_s, exposed_s) -> ArrayOrFloat:
    """Step time that `traffic_s` of communication costs when `exposed_s` of it is not hidden: the
    exposed part, plus the compute it overlaps slowed by OVERLAP_COMPUTE_SLOWDOWN of the hidden part
    (module constant)."""
    return exposed_s + OVERLAP_COMPUTE_SLOWDOWN * np.maximum(traffic_s - exposed_s, 0.0)


def pipelined_exposed_s(traffic_s, window_s, chunks, overlap) -> ArrayOrFloat:
    """Exposed time of `traffic_s` of communication issued in `chunks` equal pieces (one per layer),
    each hidden behind the compute of the neighbouring layer, of which a share `overlap` is usable.

    A two-stage pipeline (transfer chunk i+1 while computing chunk i): the first (or last) chunk
    has nothing to hide behind, each of the other chunks - 1 exposes what its transfer takes beyond
    its layer's usable compute. Never less than traffic - overlap x window (the whole window cannot
    hide more than it lasts), never less than one chunk, and 0 with no traffic."""
    n = np.maximum(np.asarray(chunks, dtype=float), 1.0)
    per_chunk = traffic_s / n
    return per_chunk + (n - 1.0) * np.maximum(per_chunk - overlap * window_s / n, 0.0)


def _dp_times(
    training, cluster, c, stage_params, fwd_window_s, bwd_window_s, layers_per_stage, dp_stride, cp_stride=None
) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, total) data-parallel time per step, layer by layer against the compute it overlaps:
    what the traffic adds to the step, and what it takes on the links, hidden or not.

    - ZeRO 0 (DDP, Li et al. 2020): the gradient all-reduce runs in buckets during the last
      micro-batch's backward; the last bucket is exposed.
    - ZeRO 1/2: the gradient reduce-scatter (and, for hybrid sharding, the all-reduce of the
      shard across replicas) in the last micro-batch's backward; the all-gather of the updated
      parameters during the next step's first forward (FSDP2 reshard_after_forward=False,
      Megatron's overlapped parameter gather), its first layer exposed. The engine's
      `param_gather_exposed` share of the gather runs after the step instead (DeepSpeed), and its
      `grad_reduce_exposed` share of the reduction is an all-reduce of the whole gradients after the
      backward, each rank keeping its shard (nanotron's ZeRO-1 with fp32 accumulation: trainer.py
      all-reduces the fp32 gradient buffers once the pipeline is done).
    - ZeRO 3 / FSDP (Rajbhandari et al. 2020 Sec. 5; Zhao et al. 2023, "PyTorch FSDP", Sec. 3.3-3.4):
      per micro-batch, each layer's parameters are all-gathered in forward (prefetched behind
      the previous layer's forward) and again in backward, where each layer's gradients are
      reduce-scattered; backward gathers and reduce-scatters are issued on the same links, one
      after the other, so they share the backward window. The first gather of each pass and the
      last reduce-scatter have no compute to hide behind. Hybrid sharding adds the all-reduce
      of the shard across replicas to the last micro-batch's backward.
    Only `comm_overlap_efficiency` of each window hides traffic (NCCL kernels take SMs and
    memory bandwidth from the GEMMs; Zhao et al. 2023 Sec. 6), and the hidden traffic slows the
    compute it runs beside (`overlapped_s`). Parameters travel in the dtype the
    recipe gathers and gradients in the one it reduces (memory.dp_collective_bytes: fp32 gradients
    but for Megatron's fp16).
    With context parallelism the gradient group is dp x cp and the shard group shard x cp (module
    docstring); the group is costed as one ring starting at the cp stride (exact for the default
    tp-dp-pp order, where cp and dp are adjacent)."""
    gathered, reduced = memory.dp_collective_bytes(training, c)
    param_bytes, grad_bytes = stage_params * gathered, stage_params * reduced
    cp = c.cp.astype(float)
    shard = c.shard.astype(float) * cp
    replicate = c.dp / c.shard.astype(float)
    inner_stride = dp_stride if cp_stride is None else np.where(cp > 1, cp_stride, dp_stride)
    stride_shard, stride_rep = np.where(c.shard * c.cp > c.shard, inner_stride, dp_stride), dp_stride * c.shard
    # all-gather and reduce-scatter of the stage's parameters over the shard group (costed apart: gloo differs)
    gather = comm.all_gather_s(cluster, param_bytes, shard, stride_shard)
    # the engine reduces gradients in buckets, one collective each: every bucket after the first adds its latency
    buckets = reduction_buckets(training, c, stage_params, reduced, c.dp * cp) - 1.0
    scatter_whole = comm.reduce_scatter_s(cluster, grad_bytes, shard, stride_shard)  # one collective (ZeRO-3's)
    scatter = scatter_whole + buckets * comm.reduce_scatter_s(cluster, 0.0, shard, stride_shard)
    ar_replicate = comm.all_reduce_s(cluster, grad_bytes / shard, replicate, stride_rep)
    ar_whole = comm.all_reduce_s(cluster, grad_bytes, c.dp * cp, inner_stride)  # one collective
    ar_dp = ar_whole + buckets * comm.all_reduce_s(cluster, 0.0, c.dp * cp, inner_stride)
    overlap = cluster.comm_overlap_efficiency
    n = layers_per_stage

    def hidden(traffic, window) -> ArrayOrFloat:
        return overlapped_s(traffic, pipelined_exposed_s(traffic, window, n, overlap))

    ddp = hidden(ar_dp, bwd_window_s)
    gather_fwd = hidden(gather, fwd_window_s)  # behind a forward: ZeRO-1/2's next step, ZeRO-3's micro-batch
    exposed = param_gather_exposed(training)  # ZeRO-1/2's gather after the step (DeepSpeed) or behind the forward
    after = grad_reduce_exposed(training)  # ZeRO-1/2's reduction behind the backward, or after it as an all-reduce
    reduce12 = hidden(scatter + ar_replicate, bwd_window_s)
    zero12 = (reduce12 if after == 0.0 else (1.0 - after) * reduce12 + after * ar_whole) + (
        gather_fwd if exposed == 0.0 else (1.0 - exposed) * gather_fwd + exposed * gather
    )
    zero12 = zero12 + gather_copies_s(training, cluster, shard, layers_per_stage)
    zero3_mb = gather_fwd + hidden(gather + scatter_whole, bwd_window_s)
    zero3_last = gather_fwd + hidden(gather + scatter_whole + ar_replicate, bwd_window_s)
    zero3 = (c.num_microbatches - 1.0) * zero3_mb + zero3_last
    charged = np.where(c.zero_stage == 0, ddp, np.where(c.zero_stage <= 2, zero12, zero3))
    total = np.where(
        c.zero_stage == 0,
        ar_dp,
        np.where(
            c.zero_stage <= 2,
            (1.0 - after) * (scatter + ar_replicate) + after * ar_whole + gather,
            c.num_microbatches * (2.0 * gather + scatter_whole) + ar_replicate,
        ),
    )
    return charged, total


# the parameter tensors outside the decoder layers (embedding, final norm, LM head), counted on the stage costed
NON_LAYER_TENSORS = 3
# host work of nanotron's copy-back per (rank, tensor) pair in eager ops: its loop (two views, a list entry and a
# copy_) over one torch.mul of 8 elements, measured on CPU with nanotron's code (tests/test_engine_sweep.py: 1.5-1.6)
COPY_BACK_OPS_PER_PAIR = 1.5


def gather_copies_s(training, cluster, shard, layers) -> ArrayOrFloat:
    """Host time of ZeRO-1's copy-back where the engine copies each rank's slice of each parameter tensor out of the
    gathered buffer one eager op at a time (EngineInfo.zero1_gather_tensors_per_layer; 0 where it gathers in place).
    nanotron e24d2483 `optim/zero.py _all_gather_params` hands every parameter of the stage, split over all dp
    ranks (`_partition_parameters`), to `distributed.py all_gather_coalesced`, whose `update_output` then runs
    `copy_` for each (rank, tensor) pair after the collective: shard x tensors x COPY_BACK_OPS_PER_PAIR eager ops at
    the device's kernel_overhead_s (its host's time for one). Nothing overlaps them: the next step's forward waits
    for the host; it is charged in dp_comm, as part of the gather. Uncalibrated, on the Ultra-Scale sweep's ZeRO-1
    runs without a pipeline (tp <= 8, 16-256 GPUs), the step time measured beyond the prediction grew by 8 us per
    (rank, tensor) pair without this term and by 1 us with it; the ZeRO-0 runs', which gather nothing, by -1 us
    (docs/accuracy.md). nanotron runs no MoE model (its rules refuse one), so no expert part is counted twice."""
    per_layer = engine_of(training).zero1_gather_tensors_per_layer
    if per_layer == 0:
        return 0.0
    tensors = per_layer * np.asarray(layers, dtype=float) + NON_LAYER_TENSORS
    op_s = COPY_BACK_OPS_PER_PAIR * cluster.device.kernel_overhead_s
    return np.where(np.asarray(shard) > 1, shard * tensors * op_s, 0.0)


def _stage_dp_times(
    model, training, cluster, c, layers, fwd, bwd_and_recompute, dp_stride, cp_stride=None
) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, total) data-parallel time of the stage that takes longest (`_stage_dp_times_part`). MoE: the
    routed experts' gradients are reduced over their expert-data-parallel group (dp / ep ranks, ep x
    the dp stride apart; with expert_tp < tp, tp x dp / (ep x expert_tp) ranks, expert_tp x ep apart;
    memory.expert_candidates), the rest over dp; the two share the compute window in proportion to
    their bytes on the rank."""
    if not model.is_moe:
        return _stage_dp_times_part(model, training, cluster, c, layers, fwd, bwd_and_recompute, dp_stride, cp_stride)
    _, share = memory.expert_share(model, c, split_rule(training))
    etp = memory.expert_tp_of(c)
    # the expert-data-parallel group's stride: ep x the dp stride with expert_tp = tp; with expert_tp < tp the
    # expert ranks are ordered expert_tp-ep-edp inside tp x dp (Megatron's expert RankGenerator, order
    # tp-ep-dp-pp), so the group's members are expert_tp x ep ranks apart
    edp_stride = np.where(etp != c.tp, etp * c.ep, dp_stride * c.ep)
    dense = _stage_dp_times_part(
        model,
        training,
        cluster,
        c,
        layers,
        fwd * (1 - share),
        bwd_and_recompute * (1 - share),
        dp_stride,
        cp_stride,
        part="dense",
    )
    moe = _stage_dp_times_part(
        model,
        training,
        cluster,
        memory.expert_candidates(c, split_dp=True),
        layers,
        fwd * share,
        bwd_and_recompute * share,
        edp_stride,
        cp_stride,
        part="expert",
        ep=c.ep,
    )
    return dense[0] + moe[0], dense[1] + moe[1]


def _stage_dp_times_part(
    model, training, cluster, c, layers, fwd, bwd_and_recompute, dp_stride, cp_stride=None, part="all", ep=1
) -> tuple[np.ndarray, np.ndarray]:
    """(exposed, total) data-parallel time of the stage whose exposed time is longest: each rank reduces
    (and gathers) its own stage's parameters behind its own layers' compute. With an even split the first or the last
    stage (an embedding or head more, the same layers) is that stage; with an uneven one
    (specs/stages.py) each of the first, a middle and the last stage is costed."""
    n_first, n_middle, n_last = layers
    etp = memory.expert_tp_of(c)
    rule = split_rule(training)
    pf = memory.stage_params(model, c.pp, c.tp, True, c.virtual_stages, ep=ep, part=part, etp=etp, rule=rule)
    pl = memory.stage_params(model, c.pp, c.tp, False, c.virtual_stages, ep=ep, part=part, etp=etp, rule=rule)
    even = (n_first == n_middle) & (n_last == n_middle)
    if np.all(even):
        return _dp_times(
            training,
            cluster,
            c,
            np.maximum(pf, pl),
            n_first * fwd,
            n_first * bwd_and_recompute,
            n_first,
            dp_stride,
            cp_stride,
        )

    def at(params, n) -> tuple[np.ndarray, np.ndarray]:
        return _dp_times(training, cluster, c, params, n * fwd, n * bwd_and_recompute, n, dp_stride, cp_stride)

    def longer(a, b) -> tuple[np.ndarray, np.ndarray]:
        return np.maximum(a[0], b[0]), np.where(b[0] > a[0], b[1], a[1])

    pm = memory.stage_params(
        model, c.pp, c.tp, False, c.virtual_stages, middle=True, ep=ep, part=part, etp=etp, rule=rule
    )
    middle = at(pm, n_middle)
    ends = longer(at(pf, n_first), at(pl, n_last))
    return longer(ends, (np.where(c.pp > 2, middle[0], 0.0), middle[1]))


def moe_layer_extra_s(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates, b, tp, stride
) -> tuple[ArrayOrFloat, ArrayOrFloat, ArrayOrFloat]:
    """(forward, backward, all-to-all per layer pass) seconds an MoE model adds to the mean layer of
    its compute view (ModelSpec.compute_view, whose MLP is one GEMM of the active experts' width):

    - the routed experts' GEMMs as they run: each rank holds E / ep experts and each gets the
      tokens routed to it from the ep group, b x s x k x ep / E rows on average (grouped GEMMs of
      that many rows, expert ffn / tp wide: expert-tensor parallelism = tp), at the device's GEMM
      efficiency for that shape, times MOE_IMBALANCE (the busiest rank); less the compute view's
      one wide GEMM. Few rows per expert (small ep, many experts) run at a low efficiency: this is
      what makes expert parallelism pay beyond memory.
    - one all-to-all of the token dispatch: each rank sends the top-k copies of its micro-batch's
      hidden states, micro-batch x seq x k x h x bytes, over the ep group (ep ranks of dp, the dp
      stride apart). Every tp rank of an ep group dispatches the micro-batch's tokens (Megatron-LM
      without sequence parallelism; with it Megatron gathers over tp first: the same bytes).
    Expert-tensor parallelism below tp (expert_tp < tp; expert_tp = 1 is MoE parallel folding: Liu et al.
    2025, arXiv 2504.14960, Sec. 3 and Fig. 3; Megatron-LM --expert-tensor-parallel-size, parallel_state.py
    initialize_model_parallel's expert RankGenerator of order tp-ep-dp-pp): sequence parallelism holds
    each tp rank's own seq / tp tokens, which the all-to-all moves over an ep group of ranks expert_tp
    apart (consecutive with expert_tp = 1: inside a node when ep fits in it, `comm.all_to_all_s` at the
    level the group spans); with expert_tp > 1 the expert-tp group of consecutive ranks then all-gathers
    what it received (and reduce-scatters the experts' outputs in the combine: the same bytes;
    Megatron's MoEAlltoAllTokenDispatcher gathers over the expert-tp group), so each rank runs the
    expert_tp / tp share of the tokens (`memory.dispatch_share`) through experts expert ffn / expert_tp
    wide (rows per expert b x s x expert_tp / tp x k x ep / E). The all-to-all returned is one
    dispatch (or combine) with that gather (or reduce-scatter).
    Averaged over the layers (first_k_dense layers have none)."""
    if not model.is_moe:
        zero = np.zeros(len(c))
        return zero, zero, zero
    device = cluster.device
    h, k, fe, m = model.hidden_size, model.experts_per_token, model.expert_ffn, model.mlp_matrices
    ep = np.asarray(c.ep, dtype=float)
    rows = b * training.seq_len
    etp = memory.expert_tp_of(c)
    folded = etp != c.tp
    routed = memory.dispatch_share(c)  # the share of the micro-batch's tokens this rank dispatches

    def mlp_s(r, width, count, split, linear=True) -> tuple[ArrayOrFloat, ArrayOrFloat]:
        up = compute._projection_s(device, training, r, width / split, h, count * (m - 1), linear=linear)
        down = compute._projection_s(device, training, r, h, width / split, count, linear=linear)
        return up[0] + down[0], up[1] + down[1]

    # the experts in FP8 only where the engine runs them so (EngineInfo.fp8_experts); the dense view the layer's time
    # counted (compute_view, a linear like the others) is taken off as it was counted
    fp8_experts = engine_of(training).fp8_experts
    real_f, real_b = mlp_s(rows * routed * k * ep / model.num_experts, fe, model.num_experts / ep, etp, fp8_experts)
    view_f, view_b = mlp_s(rows, k * fe, 1.0, tp)
    share = model.num_moe_layers / model.num_layers
    own = np.where(folded, 1.0 / np.asarray(c.tp, dtype=float), 1.0)  # the tokens a rank sends: its own seq / tp
    dispatched = own * training.bytes_per_element * b * training.seq_len * k * h
    ep_stride = np.where(folded, etp, stride)  # the expert order tp-ep-dp-pp: ep right outside expert tp
    # expert_tp < tp: the expert-tp group (consecutive ranks) gathers what its members received (0 at expert_tp 1)
    gather = np.where(folded, comm.all_gather_s(cluster, dispatched * etp, etp, 1), 0.0)
    a2a = share * MOE_IMBALANCE * (comm.all_to_all_s(cluster, dispatched, c.ep, ep_stride) + gather)
    return share * (MOE_IMBALANCE * real_f - view_f), share * (MOE_IMBALANCE * real_b - view_b), a2a


def evaluate(
    model: ModelSpec,
    training: TrainingSpec,
    cluster: ClusterSpec,
    c: Candidates,
    memory_headroom: float | None = None,
) -> Evaluation:
    """`memory_headroom`: a layout whose predicted memory (what the allocator holds, memory.peak_memory) is above
    (1 - headroom) of what it can reserve is "tight" (MEMORY_TIGHT); one that needs more than all of it is out of
    memory; None: the engine's (EngineInfo.memory_headroom)."""
    tuning = training.tuning
    cluster = tuned_cluster(cluster, tuning)
    device = cluster.device
    e, s, h = training.bytes_per_element, training.seq_len, model.hidden_size
    tp, pp, vpp, nmb = c.tp.astype(float), c.pp.astype(float), c.virtual_stages, c.num_microbatches
    # tokens per rank: b s / cp (the compute and memory terms take b / cp as the micro-batch)
    b = c.micro_batch_size.astype(float) / c.cp
    # decoder layers of the first, a middle and the last stage (the engine's split, specs/stages.py)
    rule = split_rule(training)
    n_first, n_middle, n_last, _ = (
        np.asarray(a, dtype=float) for a in stages.rule_stage_split(model, c.pp, c.virtual_stages, rule)
    )
    stride = c.strides()

    cm = model.compute_view()  # MoE: the dense model with the same per-token work
    lt = tuned_layer_times(compute.layer_times(cm, training, device, b, tp, c.sequence_parallel, c.cp), tuning)
    fwd, bwd, attn, gemm_fwd = lt.forward, lt.backward, lt.attention_forward, lt.gemm_forward
    moe_fwd, moe_bwd, a2a = moe_layer_extra_s(model, training, cluster, c, b, tp, stride["dp"])
    fwd, bwd = fwd + moe_fwd, bwd + moe_bwd
    act_bytes = e * b * s * h
    # under sequence parallelism half of the forward's collectives are all-gathers of a linear's input: in FP8 where
    # the engine gathers it so (EngineInfo.fp8_gather_bytes); the reduce-scatters and the backward's collectives (of
    # gradients) stay in the compute precision
    gather = engine_of(training).fp8_gather_bytes if compute.fp8_gemms(training, device) else 0.0
    fwd_element = np.where((c.sequence_parallel > 0) & (gather > 0), (e + gather) / 2.0, e)
    share = moe_tp_collective_share(model, c)

    # where a layer saved its column-parallel linears' input split by tp, the backward all-gathers it again for the
    # weight gradient (`memory.linear_inputs_saved_split`): QKV's, and the MLP's where a tp-split linear takes it
    # (`second_gathers`), in the FP8 gather's element size where the engine gathers in FP8 (Transformer Engine)
    regather = memory.linear_inputs_saved_split(training, c.sequence_parallel)
    gathers = np.where(regather, second_gathers(model), 0.0)

    def tp_collectives(cl: ClusterSpec) -> tuple[np.ndarray, np.ndarray]:
        """(forward, backward) tensor-parallel collectives of one layer on `cl`."""
        fwd_s = _tp_layer_s(cl, fwd_element * b * s * h, tp, stride["tp"]) * share
        again = gathers * comm.all_gather_s(cl, (gather or e) * b * s * h, tp, stride["tp"])
        return fwd_s, _tp_layer_s(cl, act_bytes, tp, stride["tp"]) * share + again

    tp_fwd, tp_bwd = tp_collectives(cluster)
    # a pipeline whose sends cross nodes: where an engine's host-synchronized sends cost time (EngineTuning
    # pipeline_latency_scale and pipeline_microbatch_overhead_s); inside a node the sweep's pipelines show neither
    # (benchmarks/engine_sweep.py: nanotron, 1B and 8B, tp 2-4 within a node, -15 to 11 ms per micro-batch)
    crosses = (pp > 1) & (comm.members_per_block(c.pp, stride["pp"], cluster.gpus_per_node) < pp)
    # the host-synchronized pipeline's tp collectives (EngineTuning.pipeline_latency_scale) are a floor under each
    # micro-batch's layers, not a cost beside their work: across nodes the sweep's pipelines with tp 2-32 take as
    # long per micro-batch at 1 as at 8-16 sequences (1B, tp 8, pp 2 on 32 GPUs: 216-222 ms at 1-16, 400 at 32;
    # 8B, tp 16, pp 2 on 64 GPUs: 832-980 ms at 1-16), and only past that grow with the work
    floor_layer: ArrayOrFloat | None = None  # None: no floor (the engine's prior), nothing to compare per stage
    if tuning.pipeline_latency_scale != 1.0:
        sync_fwd, sync_bwd = tp_collectives(
            tuned_cluster(cluster, EngineTuning(latency_scale=tuning.pipeline_latency_scale))
        )
        full = np.where(c.recompute == RECOMPUTE_FULL, 2.0, 1.0)  # full recompute runs the forward's again
        floor_layer = np.where(crosses, full * sync_fwd + sync_bwd, 0.0)
    cp_fwd, cp_bwd = cp_exchange_s(
        model, training, cluster, b, tp, c.cp, stride["cp"], lt.attention_forward, lt.attention_backward
    )
    selective = memory.selective_recompute_s(cm, training, c, fwd, attn, gemm_fwd)
    # full recompute runs the forward again, its KV exchange and its two all-to-alls included
    recompute = np.where(
        c.recompute == RECOMPUTE_FULL,
        fwd + tp_fwd + cp_fwd + 2.0 * a2a,
        np.where(
            c.recompute == RECOMPUTE_SELECTIVE,
            selective + np.where(memory.precision_recipe(training, c) == memory.RECIPE_FSDP2, 0.0, cp_fwd),
            0.0,
        ),
    )
    tp_layer = tp_fwd + tp_bwd  # forward + backward
    cp_layer = cp_fwd + cp_bwd
    ep_layer = A2A_PER_MOE_LAYER * a2a
    # Embedding (vocab-parallel: one all-reduce) and LM head (one in backward).
    head = compute.lm_head_compute_s(model, training, device, b, tp) / tuning.compute_efficiency
    edge_tp = comm.all_reduce_s(cluster, act_bytes, tp, stride["tp"])
    p2p = np.where(
        pp > 1,
        2.0 * vpp * comm.p2p_s(cluster, act_bytes / tp, c.pp, stride["pp"])
        # the engine's send handshake, where the pipeline's sends cross nodes (EngineTuning)
        + tuning.pipeline_microbatch_overhead_s * crosses,
        0.0,
    )

    def body(layers) -> tuple[ArrayOrFloat, ArrayOrFloat, ArrayOrFloat, ArrayOrFloat, ArrayOrFloat]:
        """(compute, recompute, tp collectives, cp KV exchange, ep all-to-alls) of `layers` decoder layers
        for one micro-batch. Where the pipeline's host-synchronized collectives set a floor (`floor_layer`), what
        of it the layers' work does not cover is the tp collectives' (the host issues them while the GPU runs:
        a floor under the micro-batch, not a cost beside its work)."""
        work = layers * (fwd + bwd), layers * recompute, layers * tp_layer, layers * cp_layer, layers * ep_layer
        if floor_layer is None:
            return work
        gap = np.maximum(layers * floor_layer - sum(work), 0.0)
        return work[0], work[1], work[2] + gap, work[3], work[4]

    first_body, last_body, middle_body = body(n_first), body(n_last), body(n_middle)
    first = sum(first_body) + edge_tp + p2p + np.where(pp == 1, head + edge_tp, 0.0)
    last = sum(last_body) + head + edge_tp + p2p + np.where(pp == 1, edge_tp, 0.0)
    middle = sum(middle_body) + p2p
    # every stage runs each micro-batch at the pace of the slowest; with an even split a middle
    # stage (no embedding, no head) never is; with an uneven one it can be (more layers)
    last_is_slowest = last >= first
    middle_is_slowest = (pp > 2) & (middle > np.maximum(first, last))
    slowest = np.where(middle_is_slowest, middle, np.maximum(first, last))
    mean_mb = np.where(pp == 1, slowest, (first + last + (pp - 2.0) * middle) / pp)

    bubble = bubble_s(pp, vpp, mean_mb)
    dp, dp_total = _stage_dp_times(
        model, training, cluster, c, (n_first, n_middle, n_last), fwd, bwd + recompute, stride["dp"], stride["cp"]
    )
    etp = memory.expert_tp_of(c)
    local_params = memory.largest_stage_params(model, c.pp, c.tp, c.virtual_stages, c.ep, etp, rule) / np.where(
        c.zero_stage >= 1, c.shard * c.cp, 1
    )
    if model.is_moe:  # the routed experts' optimizer states shard over max(shard x tp / (ep x etp), 1) ranks only
        experts = memory.stage_params(
            model, c.pp, c.tp, True, c.virtual_stages, ep=c.ep, part="expert", etp=etp, rule=rule
        )
        expert_shard = memory.expert_candidates(c).shard * c.cp
        local_params = local_params + np.where(
            c.zero_stage >= 1, experts / expert_shard - experts / (c.shard * c.cp), 0.0
        )
    optimizer = compute.optimizer_step_s(device, training, local_params)

    edge_tp_twice = np.where(pp == 1, 2.0, 1.0) * edge_tp  # pp = 1: embedding and head together
    # the breakdown is the slowest stage's
    slow = [
        np.where(middle_is_slowest, m, np.where(last_is_slowest, la, f))
        for f, m, la in zip(first_body, middle_body, last_body, strict=True)
    ]
    time = {
        "compute": nmb * (slow[0] + np.where(~middle_is_slowest & (last_is_slowest | (pp == 1)), head, 0.0)),
        "recompute": nmb * slow[1],
        "tp_comm": nmb * (slow[2] + np.where(middle_is_slowest, 0.0, edge_tp_twice)),
        "cp_comm": nmb * slow[3],
        "pp_comm": nmb * p2p,
        "bubble": bubble,
        "dp_comm": dp,
        "optimizer": optimizer,
    }
    if model.is_moe:
        time["ep_comm"] = nmb * slow[4]
    step = nmb * slowest + bubble + dp + optimizer
    # what each communication term's traffic takes, hidden or not: the ring exchange with no attention to
    # hide behind, the data-parallel traffic before overlap; tp, pp and ep collectives are never hidden
    n_slow = np.where(middle_is_slowest, n_middle, np.where(last_is_slowest, n_last, n_first))
    cp_all = sum(cp_exchange_s(model, training, cluster, b, tp, c.cp, stride["cp"], 0.0, 0.0))
    comm_total = {k: time[k] for k in COMM_TERMS if k in time} | {
        "cp_comm": np.maximum(nmb * n_slow * cp_all, time["cp_comm"]),
        "dp_comm": np.maximum(dp_total, dp),
    }

    capacity = memory.allocator_capacity_bytes(device, cluster.world_size)
    peak, mem, first_stage_bytes, last_stage_bytes, required, held = memory.peak_memory(
        model, training, device, c, capacity
    )
    reason = structural_reasons(c, model, training, cluster)
    reason = np.where((reason == VALID) & (required > capacity), OUT_OF_MEMORY, reason)
    headroom = engine_of(training).headroom(memory_headroom)
    reason = np.where((reason == VALID) & (held > capacity * (1.0 - headroom)), MEMORY_TIGHT, reason)

    model_flops = flops.model_flops_per_step(model, training)
    hw_flops = model_flops + flops.recompute_flops_per_step(cm, training, c.recompute)
    peak_flops = device.peak_flops(training.precision) * cluster.world_size
    tokens_per_s = training.global_batch_size * s / step
    good = goodput.goodput(model, training, cluster, c, step, tokens_per_s)
    return Evaluation(
        step_time_s=step,
        tokens_per_s=tokens_per_s,
        mfu=model_flops / (step * peak_flops),
        hfu=hw_flops / (step * peak_flops),
        peak_memory_bytes=peak,
        required_memory_bytes=required,
        held_memory_bytes=held,
        first_stage_memory_bytes=first_stage_bytes,
        last_stage_memory_bytes=last_stage_bytes,
        reason=reason,
        time_breakdown_s=time,
        memory_breakdown_bytes=mem,
        bottleneck=_bottleneck(time, step, reason),
        comm_total_s=comm_total,
        model_flops_per_step=model_flops,
        hardware_flops_per_step=hw_flops,
        goodput=good,
        cost=goodput.cost(cluster, step, good.goodput_tokens_per_s, training.token_budget),
    )


def tuned_cluster(cluster: ClusterSpec, tuning: EngineTuning) -> ClusterSpec:
    """The cluster as the engine achieves it (EngineTuning; planner/engine_fit.py): the innermost fabric
    level's bandwidth x intra_node_bandwidth_scale, every outer level's x inter_node_bandwidth_scale, every
    latency x latency_scale, and the engine's data-parallel overlap. Neutral values return `cluster`."""
    if tuning.neutral:
        return cluster

    def link(lk: LinkProfile, scale: float) -> LinkProfile:
        return lk.model_copy(
            update={
                "bandwidth_bytes_per_s": lk.bandwidth_bytes_per_s * scale,
                "hop_latency_s": lk.hop_latency_s * tuning.latency_scale,
            }
        )

    intra, inter = tuning.intra_node_bandwidth_scale, tuning.inter_node_bandwidth_scale
    fabric = tuple(
        lv.model_copy(update={"link": link(lv.link, intra if i == 0 else inter)}) for i, lv in enumerate(cluster.fabric)
    )
    return cluster.model_copy(
        update={
            "intra_node": link(cluster.intra_node, intra),
            "inter_node": link(cluster.inter_node, inter),
            "fabric": fabric,
            "collective_base_latency_s": cluster.collective_base_latency_s * tuning.latency_scale,
            "comm_overlap_efficiency": cluster.comm_overlap_efficiency if tuning.overlap is None else tuning.overlap,
        }
    )


def tuned_layer_times(lt: compute.LayerTimes, tuning: EngineTuning) -> compute.LayerTimes:
    """A layer's compute at the engine's fitted speed (x 1 / compute_efficiency), and the engine's host time
    per micro-batch (layer_overhead_s, a third in the forward, two thirds in the backward, as the work splits):
    the host issues a layer's kernels while the GPU runs the ones before, so a pass takes the longer of the two
    (host-bound where the layer's compute is short: small micro-batches split by wide tensor parallelism)."""
    if tuning.neutral:
        return lt
    k, oh = 1.0 / tuning.compute_efficiency, tuning.layer_overhead_s
    return lt._replace(
        forward=np.maximum(lt.forward * k, oh / 3.0),
        backward=np.maximum(lt.backward * k, 2.0 * oh / 3.0),
        attention_forward=lt.attention_forward * k,
        attention_backward=lt.attention_backward * k,
        gemm_forward=lt.gemm_forward * k,
    )


def _bottleneck(time: dict[str, np.ndarray], step: np.ndarray, reason: np.ndarray) -> np.ndarray:
    """Index into BOTTLENECK_NAMES of the largest group of BOTTLENECK_TERMS (terms.py BOTTLENECK_DEFINITION):
    the term that takes most of the step, compute included; "memory" only when the layout does not fit."""
    terms = np.stack([sum(time.get(k, np.zeros_like(step)) for k in keys) for keys in BOTTLENECK_TERMS.values()])
    index = np.argmax(terms, axis=0)
    return np.where((reason == OUT_OF_MEMORY) | (reason == MEMORY_TIGHT), BOTTLENECK_NAMES.index("memory"), index)


def stage_compute(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates, first: bool
) -> dict[str, np.ndarray]:
    """Per-step compute of one rank of the first or the last pipeline stage, communication
    excluded: its layers' forward and backward over all micro-batches (plus the LM head where the
    stage has it), the recomputation, and the optimizer step on its shard of the stage's
    parameters. This is what a rank-slice proxy measures (executor/proxy.py)."""
    device = cluster.device
    b, tp, pp = c.micro_batch_size.astype(float) / c.cp, c.tp.astype(float), c.pp.astype(float)
    rule = split_rule(training)
    split = stages.rule_stage_split(model, c.pp, c.virtual_stages, rule)
    layers = np.asarray(split[0] if first else split[2], dtype=float)
    cm = model.compute_view()
    lt = compute.layer_times(cm, training, device, b, tp, c.sequence_parallel, c.cp)
    fwd, bwd = lt.forward, lt.backward
    selective = memory.selective_recompute_s(cm, training, c, fwd, lt.attention_forward, lt.gemm_forward)
    recompute = np.where(
        c.recompute == RECOMPUTE_FULL, fwd, np.where(c.recompute == RECOMPUTE_SELECTIVE, selective, 0.0)
    )
    has_head = (pp == 1) | (not first)
    head = np.where(has_head, compute.lm_head_compute_s(model, training, device, b, tp), 0.0)
    params = memory.stage_params(
        model, c.pp, c.tp, first, c.virtual_stages, ep=c.ep, etp=memory.expert_tp_of(c), rule=rule
    )
    local = params / np.where(c.zero_stage >= 1, c.shard * c.cp, 1)
    return {
        "forward_backward": c.num_microbatches * (layers * (fwd + bwd) + head),
        "recompute": c.num_microbatches * layers * recompute,
        "optimizer": compute.optimizer_step_s(device, training, local),
    }


def proxy_prediction(plan: Plan, layers: int, first: bool) -> tuple[Metrics, dict[str, float], int]:
    """The per-rank figures a rank-slice proxy measures, from the same cost model: the stage's
    compute (communication excluded) and memory, for a model `layers` deep per stage, with ZeRO
    capped at stage 1 (what the proxy holds). Returns metrics, breakdown, micro-batches in flight."""
    x = plan.layout
    model = plan.model.model_copy(update={"num_layers": layers * x.pp})
    c = Candidates.from_layouts([x.model_copy(update={"zero_stage": min(x.zero_stage, 1)})])
    # one process without FSDP2: fp32 weights under autocast, the executor's own precision recipe
    c = replace(c, dp=np.ones_like(c.dp))
    with np.errstate(divide="ignore", invalid="ignore"):
        comp = {k: float(v[0]) for k, v in stage_compute(model, plan.training, plan.cluster, c, first).items()}
        mem = {
            k: float(v[0])
            for k, v in memory.stage_memory_breakdown(
                model, plan.training, plan.cluster.device, c, first, buckets=False, whole_tensors=True
            ).items()
        }
        stage = 0 if first else x.pp - 1
        in_flight = float(microbatches_in_flight(c.pp, c.virtual_stages, c.num_microbatches, c.schedule, stage)[0])
    mem["framework"] = 0.0
    metrics = Metrics(step_time_s=sum(comp.values()), peak_memory_bytes=sum(mem.values()))
    breakdown = {**{f"time.{k}": v for k, v in comp.items()}, **{f"memory.{k}": v for k, v in mem.items()}}
    return metrics, breakdown, max(1, math.ceil(in_flight - 1e-9))
