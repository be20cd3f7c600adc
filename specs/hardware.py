"""Typed schema of the hardware data files (devices and servers).

Profiles are data, not code: every number lives in a JSON file beside this module with its
unit in the key and a source (or a named assumption) for it. These models only validate them.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

Precision = Literal["bf16", "fp16", "fp32"]
# the precisions a device's tensor cores have a peak for: the training precisions and FP8 (E4M3/E5M2, Hopper and
# later; TrainingSpec.fp8 runs the linear layers' GEMMs in it)
PeakPrecision = Literal["bf16", "fp16", "fp32", "fp8"]
CollectiveOp = Literal["all_reduce", "all_gather", "reduce_scatter", "p2p"]
LinkKind = Literal["nvlink", "nvswitch", "infinity_fabric", "pcie", "infiniband", "ethernet", "loopback"]


class _Frozen(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class GemmCurve(_Frozen):
    """Achieved fraction of peak for a compute-bound GEMM as a function of its smallest dimension.

    Points are (min(m, n, k), fraction of peak); between points the fraction is interpolated
    linearly in log2(dim); beyond the ends it is held constant."""

    min_dim: list[float] = Field(min_length=1)
    peak_fraction: list[float] = Field(min_length=1)

    @field_validator("peak_fraction")
    @classmethod
    def _fractions(cls, v: list[float]) -> list[float]:
        if any(not 0.0 < f <= 1.0 for f in v):
            raise ValueError("every peak_fraction must be in (0, 1]")
        return v


class GemmShapeModel(_Frozen):
    """Fraction of peak a bf16/fp16 GEMM of (m x k) @ (k x n) reaches, by its real shape:

        1 / eff = (1 + m_knee / m + n_knee / n + k_knee / k) / max_fraction

    Each knee is the size of that dimension at which it alone halves the efficiency (per-tile
    prologue/epilogue and pipeline fill along k, partial waves of output tiles along m and n);
    max_fraction is the asymptote of large GEMMs. The same form serves the forward, dgrad and
    wgrad GEMM of a projection: each is scored with its own (m, n, k)."""

    max_fraction: float = Field(gt=0, le=1)
    m_knee: float = Field(ge=0)
    n_knee: float = Field(ge=0)
    k_knee: float = Field(ge=0)
    misaligned_slowdown: float = Field(1.0, ge=1, description="x slower: n or k x bytes a multiple of 4, not of 16")
    odd_slowdown: float = Field(1.0, ge=1, description="x slower: n or k x bytes not a multiple of 4 (odd bf16)")


class AttentionPassModel(_Frozen):
    """Fraction of peak of one pass (forward or backward) of causal flash attention, by shape:

        1 / eff = (1 + seq_knee / s + rows_knee / (b * heads * s)) / max_fraction(head_dim)

    FLOPs counted as 4 b heads s^2 d / 2 forward and 2.5x that backward (the causal half)."""

    max_fraction: float = Field(gt=0, le=1, description="head_dim >= 128")
    max_fraction_small_head: float = Field(gt=0, le=1, description="head_dim <= 64 (interpolated between)")
    seq_knee: float = Field(ge=0)
    rows_knee: float = Field(ge=0, description="b x heads per rank x s at which occupancy halves the efficiency")


class AttentionShapeModel(_Frozen):
    forward: AttentionPassModel
    backward: AttentionPassModel


# FlashAttention v1 (and its Triton port) against FlashAttention-2 on the same GPU: Dao 2023 (FlashAttention-2,
# abstract and Sec. 4.1): v1 reaches 25-40% of the A100's peak where v2 reaches 50-73%, "around 2x" faster.
FLASH1_OVER_FLASH2 = 0.5


class FrameworkCompute(_Frozen):
    """The work of one training stack's layer that is neither GEMM nor attention, per layer and
    micro-batch, and its optimizer step: what the framework's kernels (not the hardware) decide.

    A layer pass takes max(dispatch_s, device) + dispatch_exposed_fraction x min(dispatch_s, device),
    where device = its GEMMs + attention + bytes / (memory bandwidth x fraction) with bytes =
    hidden_bytes x tokens x h (/tp under sequence parallelism) + ffn_bytes x tokens x ffn/tp +
    weight_bytes x the layer's parameters on the rank: the host issues kernels while the GPU runs
    earlier ones, and waits where a run of small kernels is faster than their dispatch."""

    dispatch_fwd_s: float = Field(ge=0, description="host time per layer forward the GPU waits on (eager op dispatch)")
    dispatch_bwd_s: float = Field(ge=0, description="the same for the backward")
    hidden_bytes_fwd: float = Field(ge=0, description="bytes per token per hidden unit: norms, residual adds, casts")
    hidden_bytes_bwd: float = Field(ge=0)
    ffn_bytes_fwd: float = Field(ge=0, description="bytes per token per ffn unit of the rank: activation function")
    ffn_bytes_bwd: float = Field(ge=0)
    weight_bytes_fwd: float = Field(ge=0, description="bytes per parameter of the layer per forward (weight casts)")
    weight_bytes_bwd: float = Field(ge=0, description="bytes per parameter per backward (gradient cast, accumulation)")
    dispatch_exposed_fraction: float = Field(
        default=1.0,
        ge=0,
        le=1,
        description="share of the smaller of host dispatch and device time that does not "
        "overlap the other: pass time = max(dispatch, device) + this x min(dispatch, device); 1 = serial",
    )
    head_dispatch_s: float = Field(ge=0, description="host time of the LM head and loss, forward + backward")
    loss_bytes_per_logit: float = Field(ge=0, description="bytes per logit of the cross-entropy, forward + backward")
    optimizer_bytes_per_param: float = Field(gt=0, description="bytes the optimizer step moves per parameter")


class NvidiaSmiNames(_Frozen):
    """A GPU device file's `nvidia_smi` section: what `nvidia-smi --query-gpu=name` prints for this GPU
    and the server preset whose links stand for its machine under `--cluster local`. It lives in the
    device's JSON beside the profile but is not part of DeviceProfile (plans do not carry it)."""

    names: list[str] = Field(min_length=1, description="matched exactly, case and surrounding spaces ignored")
    server: str = Field(description="a preset in hardware_profiles/servers whose device is this one")
    source: str


class DeviceProfile(_Frozen):
    """One accelerator (or a CPU worker) as the cost model sees it."""

    name: str
    display_name: str
    kind: Literal["gpu", "cpu"] = "gpu"
    peak_flops_per_s: dict[PeakPrecision, float]
    fp8_gemm_speed: float | None = Field(
        default=None,
        gt=0,
        le=1.5,
        description="an FP8 GEMM's fraction of the fp8 peak as a multiple of a bf16 GEMM's fraction of the bf16 peak "
        "at the same shape (measured best shapes: fp8 MAMF fraction / bf16 MAMF fraction); None: no FP8 tensor cores",
    )
    fp8_transposed_copies: bool = Field(
        default=True,
        description="an FP8 GEMM needs its operands in one layout, so Transformer Engine keeps a transposed copy "
        "beside each FP8 tensor a later GEMM reads the other way (Hopper, Ada); False from Blackwell on "
        "(transformer_engine/common/transformer_engine.cpp nvte_is_non_tn_fp8_gemm_supported: SM 10.x and later)",
    )
    memory_bytes: float = Field(gt=0)
    memory_bandwidth_bytes_per_s: float = Field(gt=0)
    memory_bandwidth_fraction: float = Field(gt=0, le=1)
    gemm: GemmCurve
    attention_peak_fraction: float = Field(gt=0, le=1)
    kernel_overhead_s: float = Field(ge=0)
    kernels_per_layer_fwd: float = Field(ge=0)
    tp_kernel_overhead_s: float = Field(
        default=0.0,
        ge=0,
        description="extra dispatch time per kernel of a tensor-parallel layer (DTensor and "
        "collective launch overhead; 0 for fused GPU stacks, fitted by `berth calibrate`)",
    )
    gemm_shape: GemmShapeModel | None = Field(
        default=None, description="GEMM efficiency by (m, n, k); when absent the `gemm` curve by min dim is used"
    )
    attention_shape: AttentionShapeModel | None = Field(
        default=None, description="flash attention efficiency by shape; when absent attention_peak_fraction"
    )
    attention_kernel_speed: dict[Literal["flash2", "flash1"], float] = Field(
        default_factory=dict,
        description="speed of an older fused attention kernel (TrainingSpec.attention_kernel) "
        "as a multiple of the measured `sdpa` efficiency; absent: flash2 1.0 (the measured kernel is FlashAttention-2 "
        "class) and flash1 half of flash2",
    )
    frameworks: dict[str, FrameworkCompute] = Field(
        default_factory=dict,
        description="non-GEMM layer work per training stack (TrainingSpec.framework); when "
        "absent, memory-bound elementwise passes plus kernels_per_layer_fwd x kernel_overhead_s",
    )
    framework_overhead_bytes: float = Field(ge=0)
    allocator_fragmentation_fraction: float = Field(ge=0, lt=1)
    allocator_transient_blocks: float = Field(
        default=0.0,
        ge=0,
        le=4,
        description="blocks the size of the step's largest short-lived tensor (the fp32 "
        "logits of a micro-batch) that the caching allocator holds reserved beyond the allocated peak",
    )
    cuda_context_bytes: float = Field(
        default=0.0,
        ge=0,
        description="memory a process uses outside the caching allocator (CUDA context, kernel "
        "images, library handles); taken off the capacity, not added to the predicted (reserved) peak",
    )
    driver_reserved_bytes: float = Field(
        default=0.0,
        ge=0,
        description="memory of `memory_bytes` no process can allocate (nvidia-smi's total less "
        "the total torch reports)",
    )
    communicator_bytes: float = Field(
        default=0.0,
        ge=0,
        description="collective-library buffers outside the allocator when a rank has peers (NCCL channels)",
    )
    tdp_watts: float | None = None
    sources: dict[str, str] = Field(default_factory=dict)
    assumptions: dict[str, str] = Field(default_factory=dict)

    def peak_flops(self, precision: Precision) -> float:
        return self.peak_flops_per_s.get(precision) or self.peak_flops_per_s["fp32"]

    @property
    def has_fp8(self) -> bool:
        """FP8 tensor cores: a stated fp8 peak and a measured FP8 GEMM speed."""
        return bool(self.peak_flops_per_s.get("fp8")) and self.fp8_gemm_speed is not None

    def attention_kernel_scale(self, kernel: str) -> float:
        """Multiple of the measured attention efficiency that `kernel` (TrainingSpec.attention_kernel) reaches."""
        if kernel == "sdpa":
            return 1.0
        flash2 = self.attention_kernel_speed.get("flash2", 1.0)
        return flash2 if kernel == "flash2" else self.attention_kernel_speed.get("flash1", FLASH1_OVER_FLASH2 * flash2)


class LinkProfile(_Frozen):
    """A class of link (NVSwitch port, NIC rail…) with what collectives achieve over it."""

    kind: LinkKind
    bandwidth_bytes_per_s: float = Field(gt=0, description="per direction, per GPU")
    collective_efficiency: float = Field(gt=0, le=1, description="achieved ring bus bandwidth / wire bandwidth")
    hop_latency_s: float = Field(ge=0)
    op_time_scale: dict[CollectiveOp, float] = Field(
        default_factory=dict,
        description="measured time of each collective relative to the ring model on this link (1.0 when absent); "
        "gloo's all-gather and reduce-scatter are slower than its all-reduce, NCCL's are not",
    )

    def scale(self, op: CollectiveOp) -> float:
        return self.op_time_scale.get(op, 1.0)


class PcieWiring(_Frozen):
    """How the GPUs of a PCIe server hang together, for its topology graph: GPUs on PCIe switches
    (optionally NVLink-bridged in pairs), switches on CPU sockets, sockets on a CPU interconnect."""

    gpus_per_switch: int = Field(gt=0)
    switches_per_socket: int = Field(gt=0)
    switch_uplink_bytes_per_s: float = Field(gt=0, description="PCIe switch to CPU root port, per direction")
    inter_socket_bytes_per_s: float = Field(gt=0, description="GPU peer traffic between sockets, per direction")
    bridge_bytes_per_s: float | None = Field(default=None, gt=0, description="NVLink bridge of a GPU pair")


class ServerProfile(_Frozen):
    """A server (node) preset: which device, how many, and how they are wired."""

    name: str
    display_name: str
    device: str
    gpus_per_node: int = Field(gt=0)
    intra_node: LinkProfile
    inter_node: LinkProfile = Field(description="per GPU: a NIC shared by gpus_per_nic GPUs counts 1/gpus_per_nic")
    gpus_per_nic: int = Field(default=1, gt=0, description="GPUs that share one network port")
    pcie: PcieWiring | None = None
    collective_base_latency_s: float = Field(ge=0)
    comm_overlap_efficiency: float = Field(
        default=0.7, ge=0, le=1, description="fraction of a backward compute window that hides data-parallel traffic"
    )
    sources: dict[str, str] = Field(default_factory=dict)
    assumptions: dict[str, str] = Field(default_factory=dict)
