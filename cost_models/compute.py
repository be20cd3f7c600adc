"""Time of the compute each rank performs for one layer and one micro-batch.

Three kinds of work, each timed from measurements of the device (hardware_profiles/devices/*.json,
sources there; the H100 fits come from benchmarks/data/reference/h100-microbench via
`python -m benchmarks.layer_fidelity --fit`):

- GEMMs: a roofline (Williams et al. 2009), time = max(FLOPs / (peak x eff), bytes / achieved
  bandwidth), where eff is the device's GEMM efficiency by the real shape (m, n, k) of each GEMM
  (`gemm_shape`, fitted to gemm.json). The backward runs each projection's dgrad GEMM
  (tokens x in, reducing over out) and wgrad GEMM (in x out, reducing over tokens) with their own
  shapes, so it is no longer a flat 2x the forward. Tensor parallelism shrinks the n or k
  dimension of every projection to h/tp or ffn/tp (Shoeybi 2019 split). A projection whose n or k breaks
  16-byte row alignment (an odd vocabulary's LM head) runs several times slower (`alignment_slowdown`, measured).
- Flash attention: FLOPs of the causal half of the score and context products at the device's
  attention efficiency by shape (`attention_shape`, fitted to attention.json), forward and
  backward apart. Unfused attention (Megatron 2021-22) is two batched GEMMs plus softmax passes.
- The rest of the layer (norms, rotary, activation function, residual adds, dtype casts of the
  weights under autocast, kernel dispatch): what the training stack's kernels decide, so it is
  kept per compute stack (`DeviceProfile.frameworks`, the engine's entry, see FrameworkCompute):
  a host dispatch time per layer pass plus bytes moved at the device's streaming bandwidth.

Profiles without the measured models (a `berth profile` of a CPU, older files) fall back to the
earlier terms: the GEMM curve by min dim, one attention fraction, fixed elementwise passes and
kernels_per_layer_fwd x kernel_overhead_s, with the backward at BACKWARD_TO_FORWARD x forward.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from berth.cost_models import memory
from berth.cost_models.arrays import ArrayOrFloat
from berth.cost_models.flops import BACKWARD_TO_FORWARD
from berth.specs.engines import engine_of
from berth.specs.hardware import AttentionPassModel, DeviceProfile, FrameworkCompute, GemmShapeModel
from berth.specs.tree import ModelSpec, TrainingSpec

# Named constants (each an assumption stated with its reason).
CAUSAL_WORK_FRACTION = 0.5  # FlashAttention skips fully-masked blocks: ~half of s^2 (Dao 2023)
ATTENTION_BACKWARD_FLOPS = 2.5  # flash backward recomputes S and P: 5 s^2 d products vs 2 (Dao 2023, Sec. 3)
HIDDEN_ELEMENTWISE_PASSES = 10  # legacy: 2 norms (read+write) + 2 residual adds (2 reads+write) per layer
FFN_ELEMENTWISE_PASSES_GELU = 2  # legacy: GELU reads and writes the b x s x ffn tensor
FFN_ELEMENTWISE_PASSES_SWIGLU = 3  # legacy: SiLU(gate) * up: reads 2, writes 1 b x s x ffn tensors
SOFTMAX_PASSES = 4  # unfused-attention path: write scores, softmax read+write, read in AV
DROPOUT_PASSES = 3  # read, write output, write 1-byte mask (counted as one pass)
HEAD_DIM_SMALL, HEAD_DIM_LARGE = 64.0, 128.0  # attention.json measures these two head dims
GELU_FFN_SHARE = 0.5  # GELU touches one b x s x ffn tensor where SiLU(gate) * up touches two


def _framework(device: DeviceProfile, training: TrainingSpec) -> FrameworkCompute | None:
    """The engine's compute stack: the first of its `compute_stacks` (specs/engines.py) the device has."""
    for stack in engine_of(training).compute_stacks:
        if stack in device.frameworks:
            return device.frameworks[stack]
    return None


def _stream_s(device: DeviceProfile, nbytes) -> ArrayOrFloat:
    return nbytes / (device.memory_bandwidth_bytes_per_s * device.memory_bandwidth_fraction)


memory_bound_time_s = _stream_s


def gemm_efficiency(device: DeviceProfile, m, n=None, k=None) -> ArrayOrFloat:
    """Fraction of peak a compute-bound GEMM of (m x k) @ (k x n) reaches.

    With the device's shape model: 1/eff = (1 + m_knee/m + n_knee/n + k_knee/k) / max_fraction
    (fitted to gemm.json for the H100). Without it (or called with one argument, the smallest
    dimension): the older curve by min(m, n, k), linear in log2(dim), held at the ends."""
    shape = device.gemm_shape
    if shape is None or n is None:
        min_dim = m if n is None else np.minimum(np.minimum(m, n), k)
        xs = np.log2(np.asarray(device.gemm.min_dim, dtype=float))
        x = np.log2(np.maximum(np.asarray(min_dim, dtype=float), 1.0))
        return np.interp(x, xs, np.asarray(device.gemm.peak_fraction, dtype=float))
    m, n, k = (np.maximum(np.asarray(v, dtype=float), 1.0) for v in (m, n, k))
    return shape.max_fraction / (1.0 + shape.m_knee / m + shape.n_knee / n + shape.k_knee / k)


def gemm_time_s(device: DeviceProfile, training: TrainingSpec, m, n, k, batch=1.0) -> ArrayOrFloat:
    """Roofline time of `batch` GEMMs of (m x k) @ (k x n) in the training precision."""
    flops = 2.0 * batch * m * n * k
    e = training.bytes_per_element
    compute = flops / (device.peak_flops(training.precision) * gemm_efficiency(device, m, n, k))
    traffic = batch * e * (m * k + k * n + m * n)
    return np.maximum(compute, _stream_s(device, traffic))


def fp8_gemms(training: TrainingSpec, device: DeviceProfile) -> bool:
    """The linear layers' GEMMs run in FP8 (TrainingSpec.fp8 on a device with FP8 tensor cores; the engine and
    device checks refuse the rest before a prediction, planner/inputs.py)."""
    return training.fp8 is not None and device.has_fp8


def fp8_speedup(device: DeviceProfile, training: TrainingSpec) -> float:
    """How much faster an FP8 GEMM runs than the same GEMM in the training precision, at every shape: the fp8
    peak x DeviceProfile.fp8_gemm_speed over the training precision's peak (H100 SXM: 1979 x 0.883 / 989 = 1.77,
    the measured best shapes' ratio 1402.6 / 794.5 TFLOPS). The knees of the shape model are kept: no FP8 GEMM
    was measured by shape (an assumption; FP8's larger tiles would lower small shapes' gain)."""
    return device.peak_flops_per_s["fp8"] * (device.fp8_gemm_speed or 0.0) / device.peak_flops(training.precision)


def alignment_slowdown(shape: GemmShapeModel, operand_bytes: float, *dims) -> ArrayOrFloat:
    """How many times slower a GEMM runs whose row lengths are not a multiple of 16 bytes. cuBLAS's tensor-core
    kernels read each operand's rows in 16-byte vectors; where a leading dimension breaks that alignment it picks
    kernels with narrower loads. For y = x W^T and its dgrad and wgrad the leading dimensions are n and k (the
    tokens, m, only count rows). Measured on an H200 (benchmarks/results/gpu-h200/head-gemms-alignment.json, bf16,
    16,384 x 1,600 by vocabularies 50,257-50,264 and 32,000-32,001): rows of 4-12 bytes ran the three GEMMs 3.0x
    slower than at 16 bytes, odd element counts (2-byte rows) 6.2x (shape.misaligned_slowdown, odd_slowdown)."""
    worst = np.ones_like(np.asarray(dims[0], dtype=float))
    for d in dims:
        # an uneven split's largest rank has the rounded-up size; an empty GEMM takes no time either way
        n = np.ceil(np.asarray(d, dtype=float)).astype(np.int64)
        row_bytes = np.where(n > 0, (n & -n) * operand_bytes, 16.0)  # the largest power of two dividing the row
        slow = np.where(row_bytes >= 16, 1.0, np.where(row_bytes >= 4, shape.misaligned_slowdown, shape.odd_slowdown))
        worst = np.maximum(worst, slow)
    return worst


def _projection_s(
    device, training, rows, out, inp, count=1.0, linear: bool = True
) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(forward, backward) of `count` projections y = x W^T, x: rows x inp, y: rows x out (slowed where out or inp
    breaks 16-byte row alignment, `alignment_slowdown`).

    Backward = dgrad (m, n, k) = (rows, inp, out) + wgrad (inp, out, rows). The three GEMMs share
    their FLOPs and the bytes of the three matrices, so the roofline is evaluated once for them
    (the same as three gemm_time_s calls, at a third of the array operations).
    `linear`: a decoder layer's linear, which TrainingSpec.fp8 runs in FP8 (`fp8_speedup`; operands of 1 byte,
    the output in bf16); 'rowwise_with_gw_hp' keeps the wgrad in bf16. The LM head (linear=False) stays bf16:
    Megatron's output layer is its own ColumnParallelLinear, outside Transformer Engine, and berth's torchtitan
    file filters it out of the Float8 converter (filter_fqns=['lm_head'])."""
    shape = device.gemm_shape
    fp8 = linear and fp8_gemms(training, device)
    fwd_speed = fp8_speedup(device, training) if fp8 else 1.0
    wgrad_speed = 1.0 if training.fp8 == "rowwise_with_gw_hp" else fwd_speed
    if shape is None:
        fwd = gemm_time_s(device, training, rows, out, inp)
        return count * fwd / fwd_speed, count * (fwd / fwd_speed + (BACKWARD_TO_FORWARD - 1.0) * fwd / wgrad_speed)
    e = training.bytes_per_element
    operand = 1.0 if fp8 else e
    memory = _stream_s(device, operand * (rows * inp + inp * out) + e * rows * out)
    base = 2.0 * rows * out * inp / (device.peak_flops(training.precision) * shape.max_fraction)
    base = base * alignment_slowdown(shape, operand, out, inp)
    r, o, i = shape.m_knee / rows, shape.n_knee / out, shape.k_knee / inp  # forward: m = rows, n = out, k = inp
    fwd = np.maximum(base / fwd_speed * (1.0 + r + o + i), memory)
    dgrad = np.maximum(base / fwd_speed * (1.0 + r + shape.n_knee / inp + shape.k_knee / out), memory)
    wgrad = np.maximum(base / wgrad_speed * (1.0 + shape.m_knee / inp + o + shape.k_knee / rows), memory)
    return count * fwd, count * (dgrad + wgrad)


def layer_gemm_s(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp
) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(forward, backward) seconds of the QKV, output and MLP GEMMs of one layer on one tp rank
    (Shoeybi 2019 split: QKV and MLP-in column-parallel, output and MLP-out row-parallel)."""
    h, f, s = model.hidden_size, model.ffn_hidden_size, training.seq_len
    rows = b * s
    qkv_out = (h + 2 * model.kv_heads * model.head_dim) / tp
    parts = (
        _projection_s(device, training, rows, qkv_out, h),
        _projection_s(device, training, rows, h, h / tp),
        _projection_s(device, training, rows, f / tp, h, model.mlp_matrices - 1),
        _projection_s(device, training, rows, h, f / tp),
    )
    return sum(p[0] for p in parts), sum(p[1] for p in parts)


def layer_gemm_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp) -> ArrayOrFloat:
    return layer_gemm_s(model, training, device, b, tp)[0]


def attention_efficiency(p: AttentionPassModel, head_dim: float, s, rows) -> ArrayOrFloat:
    """1/eff = (1 + seq_knee/s + rows_knee/(b heads s)) / max_fraction(head_dim); the asymptote is
    interpolated in log2(head_dim) between the measured 64 and 128 and held beyond them."""
    d = np.asarray(head_dim, dtype=float)
    w = np.clip(np.log2(d / HEAD_DIM_SMALL) / np.log2(HEAD_DIM_LARGE / HEAD_DIM_SMALL), 0.0, 1.0)
    top = p.max_fraction_small_head + w * (p.max_fraction - p.max_fraction_small_head)
    return top / (1.0 + p.seq_knee / s + p.rows_knee / np.maximum(rows, 1.0))


def attention_core_s(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, cp=1
) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(forward, backward) seconds of scores, softmax and context for the a/tp heads of one rank.

    Flash path: 4 b (a/tp) s^2 d x causal fraction FLOPs forward, 2.5x that backward, each at the
    device's measured efficiency for the shape (attention.json, `enable_gqa` and MHA rows), or at
    the single attention_peak_fraction where the profile has no shape model. Unfused path
    (Megatron 2021-22): two batched GEMMs with k = head_dim over the full s x s matrix, plus the
    softmax and dropout passes over b(a/tp)s^2 scores; backward 2x. TrainingSpec.attention_kernel
    names an older kernel than the measured one: its efficiency is scaled by
    DeviceProfile.attention_kernel_scale.
    Context parallelism (`cp`, with `b` already b / cp): the FLOPs are the rank's total / cp, run as cp
    kernel calls of s/cp queries against s/cp keys (one ring step each, torchtitan / Megatron), so the
    efficiency's sequence term is taken at s/cp.
    """
    s, a, d = training.seq_len, model.num_attention_heads, model.head_dim
    s_kernel = s / np.asarray(cp, dtype=float)
    heads = b * a / tp
    peak = device.peak_flops(training.precision)
    if training.flash_attention:
        flops = 4.0 * heads * s * s * d * CAUSAL_WORK_FRACTION
        shape = device.attention_shape
        if shape is None:
            fwd = flops / (peak * device.attention_peak_fraction)
            return fwd, BACKWARD_TO_FORWARD * fwd
        rows = heads * s
        kernel = device.attention_kernel_scale(training.attention_kernel)
        fwd = flops / (peak * kernel * attention_efficiency(shape.forward, d, s_kernel, rows))
        bwd = (
            ATTENTION_BACKWARD_FLOPS * flops / (peak * kernel * attention_efficiency(shape.backward, d, s_kernel, rows))
        )
        return fwd, bwd
    gemms = gemm_time_s(device, training, s, s, d, batch=heads) + gemm_time_s(device, training, s, d, s, batch=heads)
    passes = SOFTMAX_PASSES + (DROPOUT_PASSES if model.dropout else 0)
    fwd = gemms + _stream_s(device, passes * training.bytes_per_element * heads * s * s)
    return fwd, BACKWARD_TO_FORWARD * fwd


def attention_core_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp) -> ArrayOrFloat:
    return attention_core_s(model, training, device, b, tp)[0]


def elementwise_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp) -> ArrayOrFloat:
    """Legacy (profiles without `frameworks`): norms, residual adds, activation function, dropout
    as memory-bound passes over activations. Without sequence parallelism the b x s x h work is
    replicated on every tp rank; with it the sequence is split over tp (Korthikanti 2022, 4.2.2)."""
    e, s, h, f = training.bytes_per_element, training.seq_len, model.hidden_size, model.ffn_hidden_size
    hidden_split = np.where(sp > 0, tp, 1)
    hidden_passes = HIDDEN_ELEMENTWISE_PASSES + (2 * DROPOUT_PASSES if model.dropout else 0)
    ffn_passes = FFN_ELEMENTWISE_PASSES_SWIGLU if model.mlp == "swiglu" else FFN_ELEMENTWISE_PASSES_GELU
    nbytes = e * b * s * (hidden_passes * h / hidden_split + ffn_passes * f / tp)
    return _stream_s(device, nbytes)


def kernel_overhead_forward_s(device: DeviceProfile, tp=1) -> ArrayOrFloat:
    """Dispatch cost of one layer's kernels; tensor-parallel layers pay the device's extra
    per-kernel overhead (DTensor dispatch and collective launches; calibrated, 0 by default)."""
    extra = np.where(np.asarray(tp) > 1, device.tp_kernel_overhead_s, 0.0)
    return device.kernels_per_layer_fwd * (device.kernel_overhead_s + extra)


# FP8 casts (TrainingSpec.fp8), bytes moved per element cast, from the engines' kernels:
# - Transformer Engine (Megatron): delayed scaling casts with the scale of the previous steps, so a cast is one fused
#   cast-transpose (read 2, write the FP8 copy and its transpose: 4); the inputs of qkv and fc1 are cast inside the
#   LayerNorm kernel (LayerNormLinear: it writes 1 + 1 bytes instead of 2, nothing extra). Current scaling
#   (tensorwise) needs the amax first: one more read (6), the norm-fused inputs included. Weights are cast once per
#   step (the FP8 workspace), not per micro-batch: left out.
# - torchao's Float8Linear (torchtitan, generic): each cast is an amax pass and a scaled cast (read 2, read 2,
#   write 1: 5), of the input and the weight on every call; the backward casts the output gradient twice (for dgrad
#   and wgrad, along different axes in rowwise) and recasts the input and the weight (torchao/float8/float8_linear.py);
#   rowwise_with_gw_hp keeps the wgrad in bf16 (the gradient cast once, no input recast). torch.compile fuses
#   some of these into their neighbours; that is not counted.
TE_CAST_BYTES = {"delayed": 4.0, "tensorwise": 6.0}
TE_NORM_FUSED_CAST_BYTES = {"delayed": 0.0, "tensorwise": 6.0}
TORCHAO_CAST_BYTES = 5.0


def fp8_cast_bytes(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp) -> tuple:
    """(forward, backward) bytes one layer's FP8 casts move per micro-batch on one tp rank (TE_CAST_BYTES and
    TORCHAO_CAST_BYTES above; 0 without FP8). Elements cast: the inputs of the four linears (qkv and fc1 on the
    sequence shard under Megatron's sequence parallelism, whole under DTensor's), their output gradients, and for
    torchao the layer's weights."""
    if not fp8_gemms(training, device):
        return 0.0, 0.0
    s, h, f = training.seq_len, model.hidden_size, model.ffn_hidden_size
    tokens = b * s
    qkv_out = h + 2 * model.kv_heads * model.head_dim
    grads = tokens * (qkv_out / tp + h + (model.mlp_matrices - 1) * f / tp + h)
    unfused_inputs = tokens * (h + f) / tp  # the attention output into proj, the activation into fc2
    engine, recipe = engine_of(training), str(training.fp8)
    if engine.fp8_kernels == "te":
        normed = 2 * tokens * h / np.where(sp > 0, tp, 1)  # qkv's and fc1's normed inputs
        fwd = TE_NORM_FUSED_CAST_BYTES[recipe] * normed + TE_CAST_BYTES[recipe] * unfused_inputs
        return fwd, TE_CAST_BYTES[recipe] * grads
    inputs = unfused_inputs + 2 * tokens * h
    weights = model.params_per_layer / tp
    fwd = TORCHAO_CAST_BYTES * (inputs + weights)
    if training.fp8 == "rowwise_with_gw_hp":
        return fwd, TORCHAO_CAST_BYTES * (grads + weights)
    return fwd, TORCHAO_CAST_BYTES * (2 * grads + inputs + weights)


def layer_rest_s(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp
) -> tuple[tuple[ArrayOrFloat, ArrayOrFloat], tuple[ArrayOrFloat, ArrayOrFloat]]:
    """(forward, backward) device seconds of the layer's work that is neither GEMM nor attention,
    and (forward, backward) host dispatch seconds.

    With the framework's entry (FrameworkCompute, fitted for the bundled executor "pytorch" to
    layer.json): bytes at streaming bandwidth, where bytes =
      hidden_bytes x tokens x h / (tp under sequence parallelism)   norms, residual adds and the
          autocast casts of the normed input (the b x s x h tensors each rank handles),
      ffn_bytes x tokens x ffn/tp (x 1/2 for GELU)                  SiLU(gate) * up (or GELU),
      weight_bytes x layer parameters / tp                          fp32 -> bf16 weight casts
          forward, the bf16 weight gradient's cast and accumulation into fp32 .grad backward,
    plus dropout passes where the model has dropout. The dispatch is the entry's dispatch_s per
    pass plus, for a tensor-parallel layer, the device's tp_kernel_overhead_s per kernel (DTensor;
    0 unless calibrated).
    Without an entry: the legacy elementwise passes, and kernel overhead as dispatch; backward 2x.
    FP8 training adds its casts (`fp8_cast_bytes`) to the device bytes."""
    fw = _framework(device, training)
    tp_extra = kernel_overhead_forward_s(device, tp) - device.kernels_per_layer_fwd * device.kernel_overhead_s
    cast_fwd, cast_bwd = fp8_cast_bytes(model, training, device, b, tp, sp)
    if fw is None:
        fwd = elementwise_forward_s(model, training, device, b, tp, sp)
        launch = kernel_overhead_forward_s(device, tp)
        device_s = (fwd + _stream_s(device, cast_fwd), BACKWARD_TO_FORWARD * fwd + _stream_s(device, cast_bwd))
        return device_s, (launch, BACKWARD_TO_FORWARD * launch)
    s, h, f = training.seq_len, model.hidden_size, model.ffn_hidden_size
    tokens = b * s
    hidden = tokens * h / np.where(sp > 0, tp, 1)
    ffn = tokens * f / tp * (1.0 if model.mlp == "swiglu" else GELU_FFN_SHARE)
    weights = model.params_per_layer / tp
    dropout = (DROPOUT_PASSES * training.bytes_per_element * 2 * hidden) if model.dropout else 0.0
    fwd_bytes = fw.hidden_bytes_fwd * hidden + fw.ffn_bytes_fwd * ffn + fw.weight_bytes_fwd * weights + dropout
    bwd_bytes = fw.hidden_bytes_bwd * hidden + fw.ffn_bytes_bwd * ffn + fw.weight_bytes_bwd * weights + dropout
    fwd_bytes, bwd_bytes = fwd_bytes + cast_fwd, bwd_bytes + cast_bwd
    device_s = (_stream_s(device, fwd_bytes), _stream_s(device, bwd_bytes))
    return device_s, (fw.dispatch_fwd_s + tp_extra, fw.dispatch_bwd_s + BACKWARD_TO_FORWARD * tp_extra)


def host_and_device_s(device: DeviceProfile, training: TrainingSpec, dispatch_s, device_s) -> ArrayOrFloat:
    """Time of a pass that the host dispatches in dispatch_s and the GPU runs in device_s:
    max + exposed fraction x min (FrameworkCompute.dispatch_exposed_fraction; serial without an
    entry)."""
    fw = _framework(device, training)
    exposed = 1.0 if fw is None else fw.dispatch_exposed_fraction
    return np.maximum(dispatch_s, device_s) + exposed * np.minimum(dispatch_s, device_s)


class LayerTimes(NamedTuple):
    """Seconds of one layer and micro-batch: the passes and the parts the step model reuses."""

    forward: ArrayOrFloat
    backward: ArrayOrFloat
    attention_forward: ArrayOrFloat
    attention_backward: ArrayOrFloat
    gemm_forward: ArrayOrFloat


def layer_times(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp, cp=1) -> LayerTimes:
    """The layer's forward and backward (`b` per rank: b / cp under context parallelism), with its
    attention core and forward GEMMs, each computed once."""
    gemm_f, gemm_b = layer_gemm_s(model, training, device, b, tp)
    attn_f, attn_b = attention_core_s(model, training, device, b, tp, cp)
    (rest_f, rest_b), (host_f, host_b) = layer_rest_s(model, training, device, b, tp, sp)
    fwd = host_and_device_s(device, training, host_f, gemm_f + attn_f + rest_f)
    bwd = host_and_device_s(device, training, host_b, gemm_b + attn_b + rest_b)
    return LayerTimes(fwd, bwd, attn_f, attn_b, gemm_f)


def layer_compute_s(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp, cp=1
) -> tuple[ArrayOrFloat, ArrayOrFloat, ArrayOrFloat]:
    """(forward, backward, attention-core forward) seconds of one layer and micro-batch (`layer_times`)."""
    t = layer_times(model, training, device, b, tp, sp, cp)
    return t.forward, t.backward, t.attention_forward


def lm_head_compute_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp) -> ArrayOrFloat:
    """Vocabulary-parallel output GEMM and cross-entropy (fp32 logits), forward + backward.

    With the framework's entry (fitted to head.json): the output GEMM's forward, dgrad and wgrad
    at their shapes, loss_bytes_per_logit per logit of the rank (upcast, log-softmax, its
    gradient, downcast), the weight casts of the head (weight_bytes) and the embedding's dense
    gradient accumulation (weight_bytes_bwd again), and head_dispatch_s. Without it: the legacy
    3x GEMM + 16 bytes per logit."""
    s, h = training.seq_len, model.hidden_size
    v = memory.padded_vocab(model, tp)  # the vocabulary padded to a multiple of tp (vocab_size where tp divides it)
    rows = b * s
    fw = _framework(device, training)
    if fw is None:
        gemm = gemm_time_s(device, training, rows, v / tp, h)
        loss_bytes = 4.0 * 4 * rows * v / tp  # fp32 logits: upcast, softmax, grad write and read
        return (1.0 + BACKWARD_TO_FORWARD) * gemm + _stream_s(device, loss_bytes)
    fwd, bwd = _projection_s(device, training, rows, v / tp, h, linear=False)
    weights = v * h / tp
    nbytes = fw.loss_bytes_per_logit * rows * v / tp + (fw.weight_bytes_fwd + 2 * fw.weight_bytes_bwd) * weights
    return fwd + bwd + fw.head_dispatch_s + _stream_s(device, nbytes)


def optimizer_step_s(device: DeviceProfile, training: TrainingSpec, local_params) -> ArrayOrFloat:
    """AdamW update of the parameters this rank owns: memory-bound streaming of model states.

    With the framework's entry: optimizer_bytes_per_param (the bundled executor's AdamW with
    foreach=False runs ~10 elementwise passes of 8 bytes; optimizer.json). Without it: read and
    write of the optimizer states, the fp32 weights and the gradient."""
    fw = _framework(device, training)
    if fw is not None:
        return _stream_s(device, fw.optimizer_bytes_per_param * local_params)
    per_param = 2 * training.optimizer_bytes_per_param + 2 * training.bytes_per_element
    return _stream_s(device, per_param * local_params)
