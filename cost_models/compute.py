"""Time of the compute each rank performs for one layer and one micro-batch.

GEMMs follow a roofline (Williams et al. 2009): time = max(FLOPs / (peak x eff(shape)),
bytes / achieved memory bandwidth), where eff(shape) is the device's measured efficiency curve
as a function of the smallest GEMM dimension. Tensor parallelism shrinks the n or k dimension of
every projection to h/tp or ffn/tp, so thin slices pay both terms. Elementwise work (norms,
residual adds, activation functions, dropout, softmax) is memory-bound.
"""

from __future__ import annotations

import numpy as np

from cost_models.flops import BACKWARD_TO_FORWARD
from hardware_profiles.schema import DeviceProfile
from planner.specs import ModelSpec, TrainingSpec

# Named constants (each an assumption stated with its reason).
CAUSAL_WORK_FRACTION = 0.5  # FlashAttention skips fully-masked blocks: ~half of s^2 (Dao 2023)
HIDDEN_ELEMENTWISE_PASSES = 10  # 2 norms (read+write) + 2 residual adds (2 reads+write) per layer
FFN_ELEMENTWISE_PASSES_GELU = 2  # GELU reads and writes the b x s x ffn tensor
FFN_ELEMENTWISE_PASSES_SWIGLU = 3  # SiLU(gate) * up: reads 2, writes 1 b x s x ffn tensors
SOFTMAX_PASSES = 4  # unfused-attention path: write scores, softmax read+write, read in AV
DROPOUT_PASSES = 3  # read, write output, write 1-byte mask (counted as one pass)


def gemm_efficiency(device: DeviceProfile, min_dim):
    """Fraction of peak a compute-bound GEMM reaches, interpolated in log2 of its smallest dim."""
    xs = np.log2(np.asarray(device.gemm.min_dim, dtype=float))
    x = np.log2(np.maximum(np.asarray(min_dim, dtype=float), 1.0))
    return np.interp(x, xs, np.asarray(device.gemm.peak_fraction, dtype=float))


def gemm_time_s(device: DeviceProfile, training: TrainingSpec, m, n, k, batch=1.0):
    """Roofline time of `batch` GEMMs of (m x k) @ (k x n) in the training precision."""
    flops = 2.0 * batch * m * n * k
    e = training.bytes_per_element
    compute = flops / (device.peak_flops(training.precision) * gemm_efficiency(
        device, np.minimum(np.minimum(m, n), k)
    ))
    traffic = batch * e * (m * k + k * n + m * n)
    memory = traffic / (device.memory_bandwidth_bytes_per_s * device.memory_bandwidth_fraction)
    return np.maximum(compute, memory)


def memory_bound_time_s(device: DeviceProfile, nbytes):
    return nbytes / (device.memory_bandwidth_bytes_per_s * device.memory_bandwidth_fraction)


def layer_gemm_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp):
    """QKV, output projection and MLP GEMMs of one layer on one tp rank (Shoeybi 2019 split:
    QKV and MLP-in column-parallel, output and MLP-out row-parallel)."""
    h, f, s = model.hidden_size, model.ffn_hidden_size, training.seq_len
    rows = b * s
    qkv_out = (h + 2 * model.kv_heads * model.head_dim) / tp
    t = gemm_time_s(device, training, rows, qkv_out, h)
    t = t + gemm_time_s(device, training, rows, h, h / tp)
    t = t + (model.mlp_matrices - 1) * gemm_time_s(device, training, rows, f / tp, h)
    return t + gemm_time_s(device, training, rows, h, f / tp)


def attention_core_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp):
    """Scores, softmax and context for the a/tp heads of one rank, forward.

    Flash path: 4bs^2h/tp FLOPs x causal fraction at the device's attention efficiency
    (Dao 2022/2023). Unfused path (Megatron 2021-22): two batched GEMMs with k = head_dim over
    the full s x s matrix, plus the softmax and dropout passes over b(a/tp)s^2 scores.
    """
    s, a, d = training.seq_len, model.num_attention_heads, model.head_dim
    heads = b * a / tp
    if training.flash_attention:
        flops = 4.0 * heads * s * s * d * CAUSAL_WORK_FRACTION
        return flops / (device.peak_flops(training.precision) * device.attention_peak_fraction)
    gemms = gemm_time_s(device, training, s, s, d, batch=heads) + gemm_time_s(
        device, training, s, d, s, batch=heads
    )
    passes = SOFTMAX_PASSES + (DROPOUT_PASSES if model.dropout else 0)
    return gemms + memory_bound_time_s(device, passes * training.bytes_per_element * heads * s * s)


def elementwise_forward_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp):
    """Norms, residual adds, activation function, dropout: memory-bound passes over activations.

    Without sequence parallelism the b x s x h work is replicated on every tp rank; with it the
    sequence is split over tp (Korthikanti 2022, Sec. 4.2.2).
    """
    e, s, h, f = training.bytes_per_element, training.seq_len, model.hidden_size, model.ffn_hidden_size
    hidden_split = np.where(sp > 0, tp, 1)
    hidden_passes = HIDDEN_ELEMENTWISE_PASSES + (2 * DROPOUT_PASSES if model.dropout else 0)
    ffn_passes = FFN_ELEMENTWISE_PASSES_SWIGLU if model.mlp == "swiglu" else FFN_ELEMENTWISE_PASSES_GELU
    nbytes = e * b * s * (hidden_passes * h / hidden_split + ffn_passes * f / tp)
    return memory_bound_time_s(device, nbytes)


def kernel_overhead_forward_s(device: DeviceProfile, tp=1):
    """Dispatch cost of one layer's kernels; tensor-parallel layers pay the device's extra
    per-kernel overhead (DTensor dispatch and collective launches; calibrated, 0 by default)."""
    extra = np.where(np.asarray(tp) > 1, device.tp_kernel_overhead_s, 0.0)
    return device.kernels_per_layer_fwd * (device.kernel_overhead_s + extra)


def layer_compute_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp, sp):
    """(forward, backward, attention-core forward) seconds of one layer and micro-batch."""
    gemm = layer_gemm_forward_s(model, training, device, b, tp)
    attn = attention_core_forward_s(model, training, device, b, tp)
    rest = elementwise_forward_s(model, training, device, b, tp, sp) + kernel_overhead_forward_s(device, tp)
    fwd = gemm + attn + rest
    return fwd, BACKWARD_TO_FORWARD * fwd, attn


def lm_head_compute_s(model: ModelSpec, training: TrainingSpec, device: DeviceProfile, b, tp):
    """Vocabulary-parallel output GEMM and cross-entropy (fp32 logits), forward + backward."""
    s, v, h = training.seq_len, model.vocab_size, model.hidden_size
    gemm = gemm_time_s(device, training, b * s, v / tp, h)
    loss_bytes = 4.0 * 4 * b * s * v / tp  # fp32 logits: upcast, softmax, grad write and read
    return (1.0 + BACKWARD_TO_FORWARD) * gemm + memory_bound_time_s(device, loss_bytes)


def optimizer_step_s(device: DeviceProfile, training: TrainingSpec, local_params):
    """AdamW update of the parameters this rank owns: memory-bound streaming of model states."""
    per_param = 2 * training.optimizer_bytes_per_param + 2 * training.bytes_per_element
    return memory_bound_time_s(device, per_param * local_params)
