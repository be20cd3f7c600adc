"""Per-GPU memory of a pipeline stage, as a breakdown.

Model states follow Rajbhandari et al. 2020 (ZeRO), Sec. 3.1 and 5: (2 + 2 + K) bytes per
parameter in mixed precision, with stage 1 sharding the K optimizer bytes, stage 2 also the
gradients, stage 3 also the parameters, over the `shard` group.

Activations follow Korthikanti et al. 2022, Sec. 4: per layer and micro-batch
sbh(34 + 5as/h) bytes with 16-bit activations, split as sbh(10 + 24/t + 5as/(ht)) under tensor
parallelism and sbh(34 + 5as/h)/t with sequence parallelism (Megatron-LM, which keeps the
attention and MLP inputs sharded and re-gathers them in backward; DTensor sequence parallelism,
framework "pytorch", keeps the gathered inputs: 2sbh of the 34 stay unsplit); selective recompute drops the
5as^2b score terms; full recompute keeps only the 2sbh layer input. Generalized here:
K and V are g = kv/heads the size of Q (GQA); the MLP keeps 2 (GELU) or 3 (SwiGLU: gate, up,
product) b x s x ffn tensors; dropout masks exist only when the model uses dropout;
FlashAttention replaces the score terms by its fp32 log-sum-exp (Dao 2022).

What is alive at the peak is taken phase by phase, as the bundled executor's profiles show
(CPU profiler, peak op of each layout; shared/reference/torch-distributed-cpu.md): the sum of every
term at once over-counted layouts without gradient accumulation by up to 20% and under-counted
accumulation by up to 30%. The peak is the largest of
- the start of the loss backward (peak op: log-softmax backward) of the micro-batch with the most
  activations in flight: parameters, optimizer state, the stored activations, the logits and
  their gradients, and the gradients held then;
- a layer's backward (peak op: a matmul backward; with full recompute after the layer is
  re-materialized): the same without the logits, plus the re-materialized layer (full recompute),
  the layer's gradients and one MLP-sized gradient temporary;
- the optimizer step: parameters, optimizer state and every gradient.
torch.distributed.pipelining's receive buffers (framework "pytorch", pp > 1) are held in every
phase (`pipeline_buffers`).
Gradients held during the backward: zero_grad(set_to_none) frees them each step, so they exist
only once an earlier micro-batch's backward has finished on this stage (gradient accumulation;
never before the first backward of GPipe), and then unsharded for ZeRO 0-2 (accumulation runs
before the once-per-step reduce: DDP no_sync, FSDP2 without gradient sync) and sharded for ZeRO-3
(reduce-scattered every micro-batch, as the step-time model has it). PyTorch DDP's gradient
buckets (the executor's wrapper for zero <= 1 when dp is the only axis) hold one unsharded
gradient copy for the whole run on top of that. Megatron-LM's persistent gradient buffer, which
exists for every layout, is not modelled for framework "megatron" (a known gap).
"""

from __future__ import annotations

import numpy as np

from cost_models.candidates import RECOMPUTE_FULL, RECOMPUTE_NONE, SCHEDULE_GPIPE
from cost_models.pipeline import layers_in_flight, microbatches_in_flight
from hardware_profiles.schema import DeviceProfile
from planner.specs import ModelSpec, TrainingSpec

FP32_BYTES = 4
MASK_BYTES = 1  # dropout masks are stored as bytes
# Per logit: the stage output (e bytes) and the fp32 log-softmax output the loss saves, for every
# micro-batch whose loss backward has not run yet; during one loss backward the log-softmax's
# incoming gradient and the logits' gradient (fp32). Measured e + 12 bytes with one micro-batch
# in flight on CPU fp32; GPipe's last stage holds the first part for all its micro-batches.
LOGITS_SAVED_BYTES = 4
LOGITS_BACKWARD_BYTES = 8
# vocabulary-parallel cross-entropy (tp > 1; DTensor loss_parallel, as Megatron's) holds two more
# fp32 copies of the local logits in its backward (measured: +1.2 MB per sequence of 256 tokens
# at vocabulary 1024 / tp 2 on CPU fp32, i.e. about 2.3 copies)
LOSS_PARALLEL_EXTRA_BYTES = 8
FSDP_PARAM_BUFFERS = 2  # the gathered layer and the prefetched next one (FSDP, Zhao 2023 Sec. 3.3)
FSDP_GRAD_BUFFERS = 1  # the unsharded gradient of the layer being reduce-scattered


def stage_params(model: ModelSpec, pp, tp, first: bool):
    """Parameters on one rank of the first (or last) pipeline stage after the tp split.

    The first stage holds the input embedding, the last the LM head and final norm; with
    pp = 1 one stage holds both (a single matrix if the embeddings are tied). Megatron keeps a
    copy of a tied embedding on the last stage when pp > 1.
    """
    pp = np.asarray(pp, dtype=float)
    layers = model.num_layers / pp * model.params_per_layer / tp
    emb = model.embedding_params / tp
    head = np.where((pp == 1) & model.tied_embeddings, 0.0, emb) + model.final_norm_params
    if first:
        return layers + emb + np.where(pp == 1, head, 0.0)
    return layers + head + np.where(pp == 1, emb, 0.0)


def model_state_bytes(training: TrainingSpec, params, zero, shard):
    """(parameters, gradients, optimizer state) bytes for ZeRO stage `zero` over `shard` ranks."""
    e = training.bytes_per_element
    shard = np.asarray(shard, dtype=float)
    p = params * e / np.where(zero >= 3, shard, 1.0)
    g = params * e / np.where(zero >= 2, shard, 1.0)
    o = params * training.optimizer_bytes_per_param / np.where(zero >= 1, shard, 1.0)
    return p, g, o


def layer_activation_bytes(model: ModelSpec, training: TrainingSpec, b, tp, sp, recompute):
    """Activation bytes one layer keeps per micro-batch on one tp rank (Korthikanti 2022 Sec. 4)."""
    e, s, h, f = training.bytes_per_element, training.seq_len, model.hidden_size, model.ffn_hidden_size
    a, g = model.num_attention_heads, model.kv_ratio
    sbh = b * s * h
    hidden_split = np.where(sp > 0, tp, 1)
    masks = 2 * MASK_BYTES if model.dropout else 0
    # norm inputs (2), QKV input, MLP input, dropout masks: replicated across tp unless sp; the
    # QKV and MLP inputs stay gathered under DTensor sp (framework "pytorch")
    linear_split = 1 if training.framework == "pytorch" else hidden_split
    unsplit = (2 * e + masks) * sbh / hidden_split + 2 * e * sbh / linear_split
    # Q, K, V, attention output, and the MLP intermediates: split by tp.
    mlp_tensors = 3 if model.mlp == "swiglu" else 2
    split = e * (2 + 2 * g) * sbh + mlp_tensors * e * b * s * f
    if training.flash_attention:
        scores = FP32_BYTES * b * a * s  # log-sum-exp per row
    else:
        scores = (e + (MASK_BYTES + e if model.dropout else 0)) * b * a * s * s
    full_layer = unsplit + split / tp + scores / tp
    selective = full_layer - np.where(training.flash_attention, 0.0, scores / tp)
    checkpoint = e * sbh / hidden_split
    return np.where(
        recompute == RECOMPUTE_FULL,
        checkpoint,
        np.where(recompute == RECOMPUTE_NONE, full_layer, selective),
    ), full_layer


def activation_bytes(model: ModelSpec, training: TrainingSpec, c, stage: float, first: bool):
    """(stored, working) activations of the stage: stored layers x in-flight micro-batches plus
    the embedding output on the first stage or the final norm input on the last; and (full
    recompute) the one layer re-materialized during its backward."""
    per_layer, full_layer = layer_activation_bytes(model, training, c.mbs, c.tp, c.sp, c.recompute)
    held = layers_in_flight(model.num_layers, c.pp, c.vpp, c.nmb, c.schedule, stage) * per_layer
    working = np.where(c.recompute == RECOMPUTE_FULL, full_layer, 0.0)
    inflight = microbatches_in_flight(c.pp, c.vpp, c.nmb, c.schedule, stage)
    edge = boundary_bytes(model, training, c) * (inflight if first else 1.0)
    return held + edge, working


def boundary_bytes(model: ModelSpec, training: TrainingSpec, c):
    """One micro-batch's hidden states between layers (split over tp under sequence parallelism)."""
    return training.bytes_per_element * c.mbs * training.seq_len * model.hidden_size / np.where(c.sp > 0, c.tp, 1)


def pipeline_buffer_bytes(model: ModelSpec, training: TrainingSpec, c):
    """Receive buffers torch.distributed.pipelining (framework "pytorch", pp > 1) allocates up front
    for every micro-batch of each local stage and keeps for the whole step: activations into all
    but the model's first stage, gradients into all but its last, i.e. 2v - 1 boundary tensors per
    micro-batch on the first and the last rank (PipelineStage._prepare_forward_infra and
    _prepare_backward_infra, torch 2.x; measured by benchmarks/accuracy.py). Megatron-LM receives
    into transient tensors: none."""
    torch_pipeline = (np.asarray(c.pp) > 1) & (training.framework == "pytorch")
    receivers = np.where(torch_pipeline, 2.0 * np.asarray(c.vpp, dtype=float) - 1.0, 0.0)
    return boundary_bytes(model, training, c) * c.nmb * receivers


def logits_bytes(model: ModelSpec, training: TrainingSpec, b, tp, in_flight=1.0):
    """Logits on the last stage at its loss backward: the output and the saved fp32 log-softmax of
    each of `in_flight` micro-batches, plus the gradients of the one in backward (vocabulary split
    over tp)."""
    parallel_loss = np.where(np.asarray(tp) > 1, LOSS_PARALLEL_EXTRA_BYTES, 0)
    per_logit = (training.bytes_per_element + LOGITS_SAVED_BYTES) * in_flight + LOGITS_BACKWARD_BYTES + parallel_loss
    return per_logit * b * training.seq_len * model.vocab_size / tp


def sharding_buffer_bytes(model: ModelSpec, training: TrainingSpec, tp, zero):
    """Unsharded buffers of FSDP / ZeRO-3 (gathered layers) and ZeRO-2/3 (gradient reduce-scatter)."""
    layer = model.params_per_layer / tp * training.bytes_per_element
    params = np.where(zero >= 3, FSDP_PARAM_BUFFERS * layer, 0.0)
    grads = np.where(zero >= 2, FSDP_GRAD_BUFFERS * layer, 0.0)
    return params + grads


def gradient_buckets(c):
    """1 where the data-parallel wrapper keeps a persistent unsharded gradient copy: PyTorch DDP
    with gradient_as_bucket_view, which the executor uses for zero <= 1 when dp is the only axis."""
    return ((np.asarray(c.zero) < 2) & (np.asarray(c.dp) > 1) & (np.asarray(c.tp) == 1)
            & (np.asarray(c.pp) == 1)).astype(float)


def stage_memory_breakdown(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, c, first: bool,
                           buckets: bool = True):
    """Breakdown (dict of arrays, bytes) of the first or the last pipeline stage at its peak
    phase (module docstring). `buckets=False` leaves out the data-parallel gradient buckets (a
    single-process proxy of one rank has none)."""
    stage = 0.0 if first else np.asarray(c.pp, dtype=float) - 1.0
    params = stage_params(model, c.pp, c.tp, first)
    p, g, o = model_state_bytes(training, params, c.zero, c.shard)
    e = training.bytes_per_element
    unsharded = params * e
    stored, working = activation_bytes(model, training, c, stage, first)
    holds_head = (np.asarray(c.pp) == 1) | (not first)
    # micro-batches past the head but not yet through their loss backward: all of them under GPipe
    loss_in_flight = np.where((c.schedule == SCHEDULE_GPIPE) & (np.asarray(c.pp) > 1), c.nmb, 1)
    logits = np.where(holds_head, logits_bytes(model, training, c.mbs, c.tp, loss_in_flight), 0.0)
    buffers = sharding_buffer_bytes(model, training, c.tp, c.zero)
    receive = pipeline_buffer_bytes(model, training, c)
    inflight = microbatches_in_flight(c.pp, c.vpp, c.nmb, c.schedule, stage)
    accumulating = np.asarray(c.nmb, dtype=float) > inflight + 1e-9
    accumulated = np.where(accumulating, np.where(np.asarray(c.zero) >= 3, g, unsharded), 0.0)
    persistent = gradient_buckets(c) * unsharded if buckets else np.zeros_like(p)
    held_grads = persistent + accumulated
    # one layer's gradients and its largest backward temporary (an MLP activation gradient)
    layer_grads = np.where(accumulated > 0, 0.0, model.params_per_layer / c.tp * e)
    mlp_temp = e * c.mbs * training.seq_len * model.ffn_hidden_size / c.tp
    # FSDP2 ZeRO-2 (framework "pytorch"; reshard_after_forward=False) keeps the whole gathered
    # model from forward to backward and its sharded parameters beside it; in mixed precision
    # the sharded copy is the fp32 master (in the optimizer state), in fp32 it is one more copy.
    # After the backward it reshards: the optimizer step sees only the sharded parameters.
    fsdp2_zero2 = (np.asarray(c.zero) == 2) & (training.framework == "pytorch")
    sharded_copy = np.where(fsdp2_zero2 & (training.precision == "fp32"), unsharded / c.shard, 0.0)
    step_params = np.where(fsdp2_zero2, sharded_copy, p)
    phases = [
        {"parameters": p + sharded_copy, "gradients": held_grads, "activations": stored, "logits": logits,
         "sharding_buffers": buffers, "pipeline_buffers": receive},
        {"parameters": p + sharded_copy, "gradients": held_grads + layer_grads,
         "activations": stored + working + mlp_temp, "logits": np.zeros_like(p), "sharding_buffers": buffers,
         "pipeline_buffers": receive},
        {"parameters": step_params, "gradients": np.maximum(g, persistent), "activations": np.zeros_like(p),
         "logits": np.zeros_like(p), "sharding_buffers": np.zeros_like(p), "pipeline_buffers": receive},
    ]
    totals = np.stack([sum(ph.values()) for ph in phases])
    which = np.argmax(totals, axis=0)
    chosen = {k: np.choose(which, [ph[k] for ph in phases]) for k in phases[0]}
    dynamic = (chosen["activations"] + chosen["logits"] + chosen["sharding_buffers"]
               + chosen["pipeline_buffers"])
    return {
        "parameters": chosen["parameters"],
        "gradients": chosen["gradients"],
        "optimizer_state": o,
        "activations": chosen["activations"],
        "logits": chosen["logits"],
        "sharding_buffers": chosen["sharding_buffers"],
        "pipeline_buffers": chosen["pipeline_buffers"],
        "fragmentation": device.allocator_fragmentation_fraction * dynamic,
        "framework": np.full_like(p, device.framework_overhead_bytes),
    }


def peak_memory(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, c):
    """Peak bytes per GPU (the worse of the first and last stage) and that stage's breakdown.

    Middle stages hold fewer in-flight micro-batches than the first and no embedding or head,
    so they are never the peak."""
    first = stage_memory_breakdown(model, training, device, c, first=True)
    last = stage_memory_breakdown(model, training, device, c, first=False)
    total_first = sum(first.values())
    total_last = sum(last.values())
    use_first = total_first >= total_last
    breakdown = {k: np.where(use_first, first[k], last[k]) for k in first}
    return np.maximum(total_first, total_last), breakdown
