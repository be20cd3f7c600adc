"""The one typed spec tree: model, training, cluster, search, layout, prediction, plan.

Every spec is a frozen pydantic model with extra="forbid"; it flows unchanged from the CLI and
the API through the planner into the plan JSON and on to the executor. Names follow DESIGN.md.
Units are SI base units and carried in field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    StringConstraints,
    TypeAdapter,
    ValidationError,
    ValidationInfo,
    field_validator,
    model_validator,
)

from berth.specs import terms
from berth.specs.axes import with_cp  # noqa: F401 (re-exported: the axis table's placement of cp)
from berth.specs.errors import BerthError, from_validation_error
from berth.specs.hardware import DeviceProfile, LinkProfile, Precision

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
# The training engines berth plans for; each described once in specs/engines.py (what it runs, recipe, stack, launch)
Engine = Literal["executor", "torchtitan", "megatron", "deepspeed", "llmfoundry", "nanotron", "generic"]
ENGINE_CHOICES: tuple[Engine, ...] = (
    "executor",
    "torchtitan",
    "megatron",
    "deepspeed",
    "llmfoundry",
    "nanotron",
    "generic",
)
# FP8 recipes for the linear layers' GEMMs (TrainingSpec.fp8); which engine runs which: EngineInfo.fp8_recipes
Fp8Recipe = Literal["delayed", "tensorwise", "rowwise", "rowwise_with_gw_hp"]
# a plan request's precision (planner/inputs.py): a training precision, or fp8 (bf16, FP8 linears: the engine's first)
PrecisionChoice = Literal["bf16", "fp16", "fp32", "fp8"]
FP8_DEFAULT_RECIPE: Fp8Recipe = "tensorwise"  # `precision: fp8` for an engine without FP8 (then refused by name)
# other names a user may give: the old --framework values and the stacks built on an engine
ENGINE_ALIASES: dict[str, Engine] = {
    "pytorch": "executor",
    "megatron-lm": "megatron",
    "nemo": "megatron",
    "megatron-bridge": "megatron",
    "mosaicml": "llmfoundry",
    "llm-foundry": "llmfoundry",
}
Framework = Engine  # the old name of the field's type
AxisOrder = Literal["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp"]
AxisName = Literal["tp", "cp", "dp", "pp", "ep"]  # the values of berth.specs.axes.Axis
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full")
SCHEDULE_CHOICES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
# innermost axis first; tp-dp-pp (Megatron's default) first so that ties keep it
AXIS_ORDER_CHOICES: tuple[AxisOrder, ...] = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp")


# Sanity bounds on user input: far beyond any real model or cluster, small enough never to make the planner loop
MAX_LAYERS = 4096
MAX_HIDDEN = 1 << 20
MAX_HEADS = 1 << 14
MAX_VOCAB = 1 << 24
MAX_SEQ_LEN = 1 << 22
MAX_GLOBAL_BATCH = 1 << 24
MAX_NODES = 1 << 16
MAX_GPUS_PER_NODE = 1024


# Names that reach generated scripts and manifests (sbatch job names, torchrun's --master-addr,
# container images, Kubernetes object names) are checked here, once: letters, digits and . _ - /
# : + @ only (no whitespace, quotes, $, backticks, ; or newlines), bounded length. Launch files
# still shell-quote every value (launch/writers.py): the two defences do not rely on each other.
MAX_NAME_LEN = 128  # Hugging Face repo ids ("org/name") are at most 96 characters
MAX_IMAGE_LEN = 255  # OCI image references: registry host, path, tag (Docker caps a tag at 128)
ModelName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9_./][A-Za-z0-9_./:+@-]*$", min_length=1, max_length=MAX_NAME_LEN)
]
HostName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$", min_length=1, max_length=253)
]  # RFC 1123 host names, IPv4/IPv6 addresses
ImageName = Annotated[
    str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./:@-]*$", min_length=1, max_length=MAX_IMAGE_LEN)
]
LabelText = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]*$", max_length=256)]  # one printable line
_HOST = TypeAdapter(HostName)


def check_host(value: Any) -> str | None:
    """None when `value` is a valid host name, else what is wrong (graph parsers name the field)."""
    try:
        _HOST.validate_python(value)
    except ValidationError as err:
        return "a host name: letters, digits and . _ - : only, at most 253 characters" + (
            "" if isinstance(value, str) else f" ({err.errors()[0]['msg']})"
        )
    return None


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class RopeScaling(Spec):
    """Llama 3.1's rotary frequency scaling (Hugging Face rope_scaling with rope_type 'llama3'): frequencies
    with wavelengths beyond original_max_position_embeddings / low_freq_factor are divided by factor, those
    below original / high_freq_factor kept, the band between interpolated. Launch files only (no cost term)."""

    rope_type: Literal["llama3"] = Field(default="llama3", description="the scaling kind (only 'llama3')")
    factor: float = Field(default=8.0, gt=0, le=1e6, description="the divisor of the low frequencies")
    low_freq_factor: float = Field(default=1.0, gt=0, le=1e6, description="the low-frequency band's edge")
    high_freq_factor: float = Field(default=4.0, gt=0, le=1e6, description="the high-frequency band's edge")
    original_max_position_embeddings: int = Field(
        default=8192, gt=0, le=MAX_SEQ_LEN, description="the context length the model was pre-trained at"
    )


class ModelSpec(Spec):
    """A decoder-only transformer's shape (Megatron/Llama family)."""

    name: ModelName = Field(
        default="custom",
        description="the model's name in tables, plans and launch files (a preset name or Hugging Face repo id; "
        "'custom' when given by its shape)",
    )
    num_layers: int = Field(gt=0, le=MAX_LAYERS, description="number of decoder layers (transformer blocks)")
    hidden_size: int = Field(
        gt=0, le=MAX_HIDDEN, description="model width h: the size of each token's hidden state (elements)"
    )
    num_attention_heads: int = Field(
        gt=0, le=MAX_HEADS, description="query heads per attention layer; hidden_size must be divisible by it"
    )
    num_kv_heads: int | None = Field(
        default=None,
        gt=0,
        le=MAX_HEADS,
        description="key/value heads per attention layer (grouped-query attention); null: one per query head "
        "(multi-head attention)",
    )
    ffn_hidden_size: int = Field(gt=0, le=MAX_HIDDEN * 8, description="inner width of a dense layer's MLP (elements)")
    vocab_size: int = Field(
        gt=0, le=MAX_VOCAB, description="tokens in the vocabulary: the rows of the input embedding and of the LM head"
    )
    mlp: Literal["gelu", "swiglu"] = Field(
        default="gelu", description="MLP kind: 'gelu' (two h x ffn weight matrices) or 'swiglu' (three: gate, up, down)"
    )
    norm: Literal["layernorm", "rmsnorm"] = Field(
        default="layernorm",
        description="normalization layers: 'layernorm' (weight and bias) or 'rmsnorm' (weight only)",
    )
    tied_embeddings: bool = Field(
        default=False, description="the LM head shares the input embedding's weights (no separate head parameters)"
    )
    dropout: bool = Field(
        default=False, description="dropout is applied (adds elementwise passes and mask memory to the cost model)"
    )
    # The model's own details that launch files carry (launch/writers.py) and the cost model does not read.
    rope_theta: float = Field(
        default=10000.0,
        gt=0,
        le=1e12,
        description="rotary position embedding base (Llama 2: 10000, Llama 3: 500000, Qwen2.5: 1000000); "
        "launch files only",
    )
    rope_scaling: RopeScaling | None = Field(
        default=None, description="rotary frequency scaling (Llama 3.1: 'llama3'); null: none. Launch files only"
    )
    norm_eps: float = Field(
        default=1e-5, gt=0, lt=1, description="the normalization layers' epsilon (Qwen2.5: 1e-6); launch files only"
    )
    qkv_bias: bool = Field(
        default=False,
        description="the query/key/value projections have biases (Qwen2.5); launch files only (the cost "
        "model leaves biases out)",
    )
    # Mixture of experts (Shazeer et al. 2017; Fedus et al. 2022; Mixtral, DeepSeek-V3): each MoE
    # layer replaces its MLP by `num_experts` routed experts of `moe_ffn_hidden_size` (same mlp kind),
    # of which a router (one h x E linear, top-k softmax) picks `experts_per_token` per token, plus
    # `num_shared_experts` experts every token goes through (DeepSeek). The first `first_k_dense`
    # layers keep the dense MLP of `ffn_hidden_size` (DeepSeek-V3: 3); num_experts = 0 is dense.
    num_experts: int = Field(
        default=0, ge=0, le=1 << 14, description="routed experts per MoE layer; 0 for a dense model"
    )
    experts_per_token: int = Field(default=0, ge=0, le=1 << 10, description="top-k of the router")
    moe_ffn_hidden_size: int | None = Field(
        default=None, gt=0, le=MAX_HIDDEN * 8, description="one expert's ffn size (default: ffn_hidden_size)"
    )
    num_shared_experts: int = Field(
        default=0,
        ge=0,
        le=64,
        description="experts every token goes through in each MoE layer, besides the routed ones (DeepSeek)",
    )
    shared_expert_ffn_hidden_size: int | None = Field(
        default=None, gt=0, le=MAX_HIDDEN * 8, description="one shared expert's ffn size (default: the expert ffn size)"
    )
    first_k_dense: int = Field(default=0, ge=0, le=MAX_LAYERS, description="leading layers with a dense MLP")

    @model_validator(mode="after")
    def _moe(self) -> ModelSpec:
        if self.num_experts == 0:
            extra = [k for k in ("experts_per_token", "num_shared_experts", "first_k_dense") if getattr(self, k)]
            extra += [k for k in ("moe_ffn_hidden_size", "shared_expert_ffn_hidden_size") if getattr(self, k)]
            if extra:
                raise ValueError(f"{extra[0]} needs num_experts > 0 (a mixture-of-experts model)")
            return self
        if not 1 <= self.experts_per_token <= self.num_experts:
            raise ValueError(f"experts_per_token {self.experts_per_token} must be in 1..num_experts {self.num_experts}")
        if self.first_k_dense >= self.num_layers:
            raise ValueError(f"first_k_dense {self.first_k_dense} leaves no MoE layer of {self.num_layers}")
        return self

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by num_kv_heads {self.kv_heads}"
            )
        return self

    @property
    def kv_heads(self) -> int:
        return self.num_kv_heads or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def kv_ratio(self) -> float:
        """g = kv heads / query heads: the size of K and V relative to Q."""
        return self.kv_heads / self.num_attention_heads

    @property
    def mlp_matrices(self) -> int:
        """Weight matrices of size h x ffn in the MLP: 2 for GELU, 3 for SwiGLU (gate, up, down)."""
        return 3 if self.mlp == "swiglu" else 2

    @property
    def is_moe(self) -> bool:
        return self.num_experts > 0

    @property
    def num_moe_layers(self) -> int:
        return self.num_layers - self.first_k_dense if self.is_moe else 0

    @property
    def expert_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn_hidden_size

    @property
    def shared_ffn(self) -> int:
        return self.shared_expert_ffn_hidden_size or self.expert_ffn

    @property
    def active_ffn_hidden_size(self) -> int:
        """The ffn size a token's MLP work has in an MoE layer: top-k routed experts plus the shared ones."""
        return self.experts_per_token * self.expert_ffn + self.num_shared_experts * self.shared_ffn

    @property
    def mean_ffn_hidden_size(self) -> int:
        """Per-token MLP width averaged over the layers (dense layers: ffn_hidden_size; MoE layers: the
        active experts'): what the compute and activation formulas of a layer use. Exact for Mixtral
        (every layer MoE) and DeepSeek-V3 (8 x 2048 + 2048 = 18432 = its dense ffn)."""
        if not self.is_moe:
            return self.ffn_hidden_size
        moe, dense = self.num_moe_layers, self.first_k_dense
        return round((moe * self.active_ffn_hidden_size + dense * self.ffn_hidden_size) / self.num_layers)

    def compute_view(self) -> ModelSpec:
        """The dense model with the same per-token work: every layer's MLP of mean_ffn_hidden_size
        (FLOPs, GEMM times and activations per token; the router's h x E GEMM is under 1% and left
        out). Dense models are returned as they are."""
        if not self.is_moe:
            return self
        return ModelSpec(
            name=self.name,
            num_layers=self.num_layers,
            hidden_size=self.hidden_size,
            num_attention_heads=self.num_attention_heads,
            num_kv_heads=self.num_kv_heads,
            ffn_hidden_size=self.mean_ffn_hidden_size,
            vocab_size=self.vocab_size,
            mlp=self.mlp,
            norm=self.norm,
            tied_embeddings=self.tied_embeddings,
            dropout=self.dropout,
        )

    @property
    def attention_norm_params_per_layer(self) -> int:
        h = self.hidden_size
        qkv = h * (h + 2 * self.kv_heads * self.head_dim)
        norms = (2 if self.norm == "layernorm" else 1) * 2 * h
        return qkv + h * h + norms

    @property
    def expert_params_per_moe_layer(self) -> int:
        """The routed experts of one MoE layer (what expert parallelism splits)."""
        return self.num_experts * self.mlp_matrices * self.hidden_size * self.expert_ffn

    @property
    def moe_layer_other_params(self) -> int:
        """An MoE layer less its routed experts: attention, norms, router (h x E), shared experts."""
        h = self.hidden_size
        return (
            self.attention_norm_params_per_layer
            + h * self.num_experts
            + self.num_shared_experts * self.mlp_matrices * h * self.shared_ffn
        )

    @property
    def layer_params_total(self) -> int:
        """Parameters of all decoder layers."""
        dense = self.attention_norm_params_per_layer + self.mlp_matrices * self.hidden_size * self.ffn_hidden_size
        if not self.is_moe:
            return self.num_layers * dense
        return self.first_k_dense * dense + self.num_moe_layers * (
            self.moe_layer_other_params + self.expert_params_per_moe_layer
        )

    @property
    def params_per_layer(self) -> float:
        """Parameters of a decoder layer (MoE: the mean over the layers, all experts counted)."""
        if not self.is_moe:
            return self.layer_params_total // self.num_layers
        return self.layer_params_total / self.num_layers

    @property
    def expert_params_per_layer(self) -> float:
        """Routed-expert parameters per decoder layer, averaged over the layers (0 for dense)."""
        return self.num_moe_layers * self.expert_params_per_moe_layer / self.num_layers

    @property
    def active_params(self) -> int:
        """Parameters a token goes through (MoE: top-k of the routed experts); num_params for dense."""
        if not self.is_moe:
            return self.num_params
        idle = (
            self.num_moe_layers
            * (self.num_experts - self.experts_per_token)
            * self.mlp_matrices
            * self.hidden_size
            * self.expert_ffn
        )
        return self.num_params - idle

    @property
    def embedding_params(self) -> int:
        return self.vocab_size * self.hidden_size

    @property
    def final_norm_params(self) -> int:
        return (2 if self.norm == "layernorm" else 1) * self.hidden_size

    @property
    def num_params(self) -> int:
        head = 0 if self.tied_embeddings else self.embedding_params
        return self.layer_params_total + self.embedding_params + head + self.final_norm_params


class EngineTuning(Spec):
    """What `berth calibrate --runs` learns of an engine from its measured runs: a handful of named, bounded parameters
    on top of the engine's recipe (specs/engines.py). The defaults change nothing. Time: cost_models/step.py; memory:
    cost_models/memory.py `tuned_breakdown`; fitting: planner/engine_fit.py, within these bounds (why each: there)."""

    model_config = ConfigDict(frozen=True, extra="forbid", strict=True)  # no bool or text for a number (a profile)
    profile: LabelText | None = Field(default=None, description="the name of the engine profile these came from")
    compute_efficiency: float = Field(
        default=1.0, ge=0.2, le=1.15, description="x the speed of every layer's compute, the head and recomputation"
    )
    layer_overhead_s: float = Field(
        default=0.0,
        ge=0,
        le=0.05,
        description="host time the engine takes to issue a decoder layer's forward and backward, per micro-batch: "
        "where it is longer than the layer's compute, the layer takes it instead (host-bound)",
    )
    intra_node_bandwidth_scale: float = Field(
        default=1.0, ge=0.25, le=1.2, description="x the achieved bandwidth of the innermost fabric level (in a node)"
    )
    inter_node_bandwidth_scale: float = Field(
        default=1.0, ge=0.005, le=1.2, description="x the achieved bandwidth of every level outside a node"
    )
    latency_scale: float = Field(
        default=1.0, ge=0.1, le=1000, description="x the latency of every collective and send (base and per hop)"
    )
    pipeline_microbatch_overhead_s: float = Field(
        default=0.0,
        ge=0,
        le=2.0,
        description="fixed time per micro-batch of a pipeline stage whose sends cross nodes (pp > 1 over the "
        "network): the engine's host-synchronized send/receive handshake (inside a node it is negligible)",
    )
    overlap: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the share of backward compute that hides data-parallel traffic (null: the cluster's)",
    )
    param_gather_exposed: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the share of ZeRO-1/2's all-gather of the updated parameters that runs after the optimizer "
        "step, exposed (0: behind the next forward, as Megatron's overlapped gather and FSDP2; 1: after the step, "
        "as DeepSpeed ZeRO-1/2; null: the engine's, specs/engines.py)",
    )
    grad_reduce_exposed: float | None = Field(
        default=None,
        ge=0,
        le=1,
        description="the share of ZeRO-1/2's gradient reduction that runs after the backward as an all-reduce of the "
        "whole gradients, exposed (0: reduce-scattered behind the last micro-batch's backward, as Megatron's "
        "overlapped reduce and FSDP2; 1: after the backward, as nanotron's ZeRO-1 with fp32 accumulation; "
        "null: the engine's, specs/engines.py)",
    )
    pipeline_latency_scale: float = Field(
        default=1.0,
        ge=1,
        le=1000,
        description="x the latency of tensor-parallel collectives where the pipeline's sends cross nodes, a floor "
        "under each micro-batch's layers: an engine that syncs host and device at each pipeline send (metadata on the "
        "host) hides their launch cost only behind longer GPU work (inside a node it is negligible)",
    )
    fixed_bytes: float = Field(
        default=0.0, ge=0, le=2.0**35, description="bytes per GPU the engine holds beyond its recipe"
    )
    state_bytes_scale: float = Field(
        default=1.0, ge=0.3, le=4, description="x the bytes of parameters, gradients and their buffers"
    )
    optimizer_bytes_scale: float = Field(default=1.0, ge=0.3, le=4, description="x the optimizer-state bytes")
    activation_scale: float = Field(
        default=1.0, ge=0.2, le=5, description="x the bytes of saved activations and pipeline buffers"
    )
    activation_tp_unsharded: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="the share of a layer's saved activations that tensor parallelism leaves whole on each rank "
        "(0: the recipe's split; about 0.3 for tensor parallelism without sequence parallelism, whose layer norms "
        "and dropouts keep 10 of 34 s b h bytes unsplit: Korthikanti et al. 2022, Sec. 4.2)",
    )
    logits_scale: float = Field(
        default=1.0, ge=0.2, le=5, description="x the bytes the loss holds for the logits (copies, gradients)"
    )
    reserve_fraction: float = Field(
        default=0.0,
        ge=0,
        le=1,
        description="what the allocator reserves beyond the allocated peak, as a share of it (measured "
        "max_memory_reserved over max_memory_allocated - 1)",
    )

    @property
    def neutral(self) -> bool:
        """True when the values change no prediction."""
        return self.model_dump(exclude={"profile"}) == EngineTuning().model_dump(exclude={"profile"})


class TrainingSpec(Spec):
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN, description="tokens per sequence")
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, description="sequences per step")
    precision: Precision = Field(
        default="bf16",
        description="compute precision of parameters, activations and gradients (fp32: 4 bytes per element, else 2); "
        "mixed precision keeps fp32 master weights in the optimizer state",
    )
    optimizer: Literal["adamw"] = Field(
        default="adamw",
        description="the optimizer whose state the memory and checkpoint model count (AdamW: 12 bytes per parameter in "
        "mixed precision, 8 in fp32)",
    )
    flash_attention: bool = Field(
        default=True,
        description="attention runs as a fused kernel that never stores the seq_len x seq_len scores; false: unfused "
        "matmul-softmax-matmul",
    )
    attention_kernel: Literal["sdpa", "flash2", "flash1"] = Field(
        default="sdpa",
        description=(
            "which fused attention kernel runs when flash_attention is on: 'sdpa' (today's PyTorch "
            "scaled_dot_product_attention, what the device profile measured), 'flash2' (FlashAttention-2, e.g. PyTorch "
            "of 2024 on Hopper) or 'flash1' (FlashAttention v1 and its Triton port, e.g. MosaicML llm-foundry's "
            "attn_impl 'triton' of 2023); speeds in DeviceProfile.attention_kernel_speed"
        ),
    )
    engine: Engine = Field(
        default="executor",
        validation_alias=AliasChoices("engine", "framework"),
        description=(
            "the training engine the plan is for (specs/engines.py): 'executor' (berth's bundled "
            "torch.distributed executor), 'torchtitan', 'megatron' (Megatron-LM, NeMo, Megatron-Bridge), 'deepspeed', "
            "'llmfoundry' (MosaicML) or 'generic' (a PyTorch stack to calibrate with `berth calibrate --runs`); it "
            "decides which layouts run, the memory recipe and the compute stack. Old name: framework ('pytorch' is "
            "'executor')"
        ),
    )
    tuning: EngineTuning = Field(
        default_factory=lambda: EngineTuning(),
        description="the engine's fitted parameters (`berth calibrate --runs`, applied with --profile); the defaults "
        "leave the engine's recipe as it is",
    )
    token_budget: float | None = Field(default=None, gt=0, le=1e16, description="tokens to train on (for the cost)")
    cross_entropy: Literal["fp32", "fused"] = Field(
        default="fp32",
        description=(
            "how the loss holds the logits: 'fp32' (F.cross_entropy on an fp32 copy: the bundled executor, torchtitan, "
            "Megatron-LM) or 'fused' (a fused kernel on the 16-bit logits that writes their gradient in place, as "
            "MosaicML llm-foundry's fused_crossentropy)"
        ),
    )

    fp8: Fp8Recipe | None = Field(
        default=None,
        description=(
            "run the decoder layers' linear GEMMs (QKV, attention output, MLP; forward, dgrad and wgrad) in FP8 with "
            "this scaling recipe, as the engine does it (specs/engines.py fp8_recipes): 'delayed' (Transformer "
            "Engine's DelayedScaling, amax history), 'tensorwise' (one scale per tensor from the current amax: TE's "
            "Float8CurrentScaling, torchao's tensorwise), 'rowwise' (torchao, a scale per row) or "
            "'rowwise_with_gw_hp' (torchao rowwise, the weight gradient in bf16). Attention, norms, the LM head, the "
            "master weights, gradients and optimizer states stay bf16/fp32. None: bf16 GEMMs. A plan request's "
            "`precision: fp8` is bf16 with the engine's first recipe"
        ),
    )

    @field_validator("fp8")
    @classmethod
    def _fp8_needs_bf16(cls, value: Any, info: ValidationInfo) -> Any:
        precision = info.data.get("precision")  # absent when it was refused itself: that error is the one to show
        if value is not None and precision is not None and precision != "bf16":
            raise ValueError(f"FP8 recipes train the rest of the model in bf16, not precision {precision}")
        return value

    @property
    def bytes_per_element(self) -> int:
        """Bytes of a parameter, activation or gradient element in the compute precision."""
        return 4 if self.precision == "fp32" else 2

    @property
    def optimizer_bytes_per_param(self) -> int:
        """Optimizer-state bytes per parameter, K in Rajbhandari et al. 2020 (ZeRO), Sec. 3.1.

        Mixed-precision AdamW keeps an fp32 master copy, momentum and variance: K = 12.
        Pure fp32 AdamW keeps momentum and variance only (the weights are the master): K = 8.
        """
        return 8 if self.precision == "fp32" else 12

    @field_validator("engine", mode="before")
    @classmethod
    def _engine_alias(cls, value: Any) -> Any:
        return ENGINE_ALIASES.get(value, value) if isinstance(value, str) else value

    @property
    def framework(self) -> Engine:
        """The engine under its old name (read-only)."""
        return self.engine


class FabricLevel(Spec):
    """One level of the cluster's hierarchy of fast domains: blocks of `gpus` consecutive GPUs (in
    rank order) and the link a GPU's traffic takes to the other sub-blocks of its block, with
    `bandwidth_bytes_per_s` the share each GPU gets when every GPU of the block sends at once
    (the bottleneck of the best path, a NIC shared by several GPUs, or an oversubscribed uplink)."""

    name: str = Field(description="the level's label in tables (e.g. 'node', 'cluster', a switch or leaf name)")
    gpus: int = Field(gt=0, description="GPUs in one block of this level (consecutive ranks)")
    link: LinkProfile = Field(
        description="the link a GPU's traffic to the other sub-blocks of its block takes, with the bandwidth share "
        "each GPU gets"
    )
    limited_by: str = Field(
        default="path",
        description="path (slowest hop), nic (one GPU's own port) or shared (a link several GPUs cross at once)",
    )


class ClusterSpec(Spec):
    """The cluster as the cost model sees it: nodes of gpus_per_node GPUs, a fast domain inside each
    node and a fabric between them. Presets and graphs (`topology.py`, `hierarchy.py`) also give
    `fabric`, the full hierarchy of fast domains; without it the hierarchy is node, then cluster."""

    name: LabelText = Field(description="the cluster's label in tables and plans")
    nodes: int = Field(gt=0, le=MAX_NODES, description="number of nodes (machines)")
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE, description="GPUs (devices) in each node")
    device: DeviceProfile = Field(
        description="the GPU model's profile (memory, peak FLOP/s, measured kernel speeds); with mixed devices, the "
        "slowest speed and smallest memory"
    )
    intra_node: LinkProfile = Field(description="the link between GPUs inside a node (NVLink/NVSwitch, PCIe)")
    inter_node: LinkProfile = Field(description="the link between nodes (a NIC rail: InfiniBand, Ethernet)")
    collective_base_latency_s: float = Field(
        ge=0,
        description="fixed start-up time of one collective call, seconds (added once per collective on top of the "
        "per-hop latency)",
    )
    comm_overlap_efficiency: float = Field(
        default=0.7,
        ge=0,
        le=1,
        description="fraction of a backward compute window that hides data-parallel traffic (cost_models/step.py)",
    )
    fabric: tuple[FabricLevel, ...] = Field(
        default=(),
        description="the hierarchy of fast domains, innermost first, the last spanning the cluster; empty: node, then "
        "cluster",
    )
    devices: dict[str, int] = Field(
        default_factory=dict, description="GPUs per device profile, when the cluster mixes several"
    )
    notes: tuple[str, ...] = Field(
        default=(),
        description="remarks on how the cluster was built (e.g. a heterogeneous mix run at its slowest device's pace)",
    )
    hosts: tuple[HostName, ...] = Field(
        default=(), description="host name of each node (graph clusters), in node order"
    )
    # Failures and checkpoints (cost_models/goodput.py). Defaults from Meta's Llama 3 pre-training (Dubey et al.
    # 2024, "The Llama 3 Herd of Models", Sec. 3.3): 419 unexpected interruptions in 54 days on 16,384 H100 GPUs =
    # 1.97e-5 per GPU-hour; the Tectonic filesystem sustained 2 TB/s for them = 122 MB/s of write bandwidth per GPU.
    failures_per_gpu_hour: float = Field(
        default=1.97e-5,
        ge=1e-12,
        le=1,
        description="unexpected job interruptions per GPU-hour (default: Llama 3 pre-training, Dubey et al. 2024)",
    )
    storage_write_bytes_per_s_per_gpu: float = Field(
        default=1.22e8, ge=1e3, description="the filesystem's aggregate write bandwidth / GPUs"
    )
    storage_client_write_bytes_per_s: float = Field(
        default=2e9,
        ge=1e3,
        description="one writing rank's bandwidth to storage (assumption: about one 25 GB/s "
        "storage NIC shared by a node's 8 GPUs, at 2/3 efficiency)",
    )
    restart_s: float = Field(
        default=600.0, ge=0, description="detect a failure, reschedule, reload (assumption: 10 minutes)"
    )
    price_per_gpu_hour: float | None = Field(default=None, ge=0, description="currency units per GPU-hour")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def levels(self) -> tuple[FabricLevel, ...]:
        """The hierarchy, innermost first; its last level spans the whole cluster."""
        if self.fabric:
            return self.fabric
        return (
            FabricLevel(name="node", gpus=self.gpus_per_node, link=self.intra_node),
            FabricLevel(name="cluster", gpus=self.world_size, link=self.inter_node),
        )


class Layout(Spec):
    """One parallel layout in DESIGN.md's vocabulary."""

    tp: int = Field(
        default=1, gt=0, description="tensor-parallel degree: ranks that split each layer's weight matrices (Megatron)"
    )
    cp: int = Field(
        default=1,
        gt=0,
        description="context-parallel degree: each rank holds seq/cp tokens of every "
        "sequence (load-balanced causal split into 2 cp chunks; ring attention, cost_models/step.py)",
    )
    pp: int = Field(
        default=1, gt=0, description="pipeline-parallel degree: ranks that each hold a contiguous stage of the layers"
    )
    dp: int = Field(
        default=1, gt=0, description="data-parallel degree: model replicas, each on its own share of the global batch"
    )
    ep: int = Field(
        default=1,
        gt=0,
        description="expert-parallel degree (MoE models): ranks carved out of dp, each "
        "holding num_experts / ep experts; 1 for dense models",
    )
    expert_tp: int | None = Field(
        default=None,
        gt=0,
        description="expert-tensor-parallel degree (MoE models; Megatron-LM's --expert-tensor-parallel-size): "
        "ranks that split each routed expert's weights, a divisor of tp; left out (null): tp, the experts split as "
        "the dense layers. 1: MoE parallel folding (Liu et al. 2025, arXiv 2504.14960): each rank holds num_experts "
        "/ ep whole experts and the ep group is consecutive ranks of tp x dp; between 1 and tp, the expert-tp group "
        "of consecutive ranks gathers the tokens its ep all-to-all brought (ep x expert_tp must divide tp x dp)",
    )
    shard: int = Field(
        default=1,
        gt=0,
        description="ranks of dp that ZeRO shards the model state over, times cp (shard = dp: fully sharded; 1 "
        "without ZeRO)",
    )
    zero_stage: int = Field(
        default=0,
        ge=0,
        le=3,
        description="ZeRO stage (Rajbhandari et al. 2020): 0 none, 1 optimizer state, 2 plus gradients, 3 plus "
        "parameters sharded over `shard` x cp ranks",
    )
    recompute: Recompute = Field(
        default="none",
        description="activation recomputation: 'none', 'selective' (attention core only, Korthikanti et al. 2022) or "
        "'full' (each layer's forward rerun in the backward)",
    )
    micro_batch_size: int = Field(default=1, gt=0, description="sequences per micro-batch on one data-parallel replica")
    num_microbatches: int = Field(
        default=1,
        gt=0,
        description="micro-batches per step on one data-parallel replica; dp x micro_batch_size x num_microbatches = "
        "global_batch_size",
    )
    virtual_stages: int = Field(
        default=1, gt=0, description="model chunks per pipeline rank (interleaved 1F1B); 1 otherwise"
    )
    schedule: Schedule = Field(
        default="1f1b",
        description="pipeline schedule: 'gpipe', '1f1b' or 'interleaved_1f1b' (needs virtual_stages > 1)",
    )
    sequence_parallel: bool = Field(
        default=False,
        description="tensor-parallel ranks also split the norms' and dropouts' activations along the sequence "
        "(Korthikanti et al. 2022)",
    )
    axis_order: AxisOrder = Field(default="tp-dp-pp", description="parallel axes over ranks, innermost first")

    @property
    def world_size(self) -> int:
        return self.tp * self.cp * self.pp * self.dp

    @property
    def order(self) -> tuple[str, ...]:
        return tuple(self.axis_order.split("-"))

    @property
    def rank_order(self) -> tuple[str, ...]:
        """The axes over ranks, innermost first, cp included: cp sits right outside tp in every
        axis_order (torchtitan's mesh pp, dp_replicate, dp_shard, cp, tp; Megatron's tp-cp-ep-dp-pp)."""
        return with_cp(self.order)

    @property
    def etp(self) -> int:
        """The expert-tensor-parallel degree in effect: expert_tp, or tp where it is not given."""
        return self.tp if self.expert_tp is None else self.expert_tp

    def short(self) -> str:
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
        if self.etp != self.tp:
            parts.append(f"etp={self.etp}")
        if self.zero_stage:
            parts += [f"zero={self.zero_stage}", f"shard={self.shard}"]
        parts += [f"mbs={self.micro_batch_size}", f"nmb={self.num_microbatches}"]
        if self.recompute != "none":
            parts.append(f"recompute={self.recompute}")
        if self.pp > 1:
            parts.append(f"schedule={self.schedule}")
        if self.virtual_stages > 1:
            parts.append(f"vpp={self.virtual_stages}")
        if self.sequence_parallel:
            parts.append("sp=1")
        if self.axis_order != "tp-dp-pp":
            parts.append(f"axis_order={self.axis_order}")
        return ",".join(parts)


LAYOUT_FIELDS: tuple[str, ...] = tuple(Layout.model_fields)


Objective = Literal["throughput", "goodput", "cost"]


# Share of the allocator's capacity a plan must leave free to be ranked as fitting, unless the engine's entry says
# more (EngineInfo.memory_headroom). The memory model's error on the single-H100 steps (benchmarks/memory_fidelity.py)
# spans about -2 % to +3 % of the measured reserved peak, the allocator's slack between runs of one layout up to ~5 %
# of the peak: 5 % covers both, so a plan ranked as fitting runs out of memory only past any miss seen.
DEFAULT_MEMORY_HEADROOM = 0.05
MAX_MEMORY_HEADROOM = 0.5


class SearchSpec(Spec):
    top: int = Field(default=5, gt=0, le=1000, description="how many plans to return, best first")
    memory_headroom: float | None = Field(
        default=None,
        ge=0,
        le=MAX_MEMORY_HEADROOM,
        description="share of the device memory (what the caching allocator can reserve) a plan must leave free "
        "to be ranked as fitting; a plan whose predicted memory is above capacity x (1 - headroom) is 'tight' "
        "(reason memory_tight) and is not ranked. Default (null): the engine's, 0.05 (nanotron and generic: 0.10)",
    )
    objective: Objective = Field(
        default="throughput",
        description="rank by tokens/s, by useful tokens/s after checkpoints and failures, or by cost per useful token",
    )
    fix: dict[str, int | str | bool] = Field(
        default_factory=dict,
        description="layout fields held at these values during the search (keys: Layout's field names)",
    )
    max_micro_batch_size: int | None = Field(
        default=None,
        gt=0,
        description="largest micro-batch size (sequences) the search tries; null: no limit beyond the batch",
    )

    @model_validator(mode="after")
    def _fix_keys(self) -> SearchSpec:
        for key in self.fix:
            if key not in LAYOUT_FIELDS:
                raise ValueError(f"unknown layout field {key!r} in fix; known: {LAYOUT_FIELDS}")
        return self


class GoodputPrediction(Spec):
    """Checkpoints, failures and what they leave of the throughput (cost_models/goodput.py)."""

    checkpoint_bytes_total: float = Field(description="bytes of one full checkpoint (weights and optimizer state)")
    checkpoint_bytes_per_rank: float = Field(description="bytes the busiest writing rank writes per checkpoint")
    checkpoint_writers: int = Field(description="ranks that write distinct state to a checkpoint")
    checkpoint_write_s: float = Field(
        description="seconds to write one checkpoint (aggregate storage or one rank's client bandwidth, whichever "
        "binds)"
    )
    mtbf_s: float = Field(description="mean time between failures of the whole job")
    checkpoint_interval_s: float = Field(description="Young/Daly optimum")
    lost_work_per_failure_s: float = Field(
        description="seconds lost per failure: the restart plus half a checkpoint interval and write"
    )
    checkpoint_stall_s_per_step: float = Field(
        description="seconds of checkpoint writing per step, averaged over the interval"
    )
    goodput_fraction: float = Field(
        description="fraction 0-1 of wall-clock time that is useful training after checkpoints and failures"
    )
    goodput_tokens_per_s: float = Field(description="useful tokens per second: tokens_per_s x goodput_fraction")
    cost_per_step: float | None = Field(
        default=None, description="price of one step in currency units (null without a price per GPU-hour)"
    )
    cost_per_million_tokens: float | None = Field(
        default=None, description="price per million useful tokens in currency units (null without a price)"
    )
    cost_for_token_budget: float | None = Field(
        default=None,
        description="price of training on training.token_budget useful tokens (null without a price or budget)",
    )
    energy_kwh_per_million_tokens: float | None = Field(
        default=None, description="kWh per million useful tokens at the devices' TDP (null without a TDP)"
    )


class Prediction(Spec):
    step_time_s: float = Field(
        description="seconds per training step (the slowest pipeline stage, bubble, exposed communication, optimizer)"
    )
    tokens_per_s: float = Field(
        description="training throughput, tokens per second (global_batch_size x seq_len / step_time_s)"
    )
    mfu: float = Field(
        description="model FLOPs utilization, fraction 0-1: model FLOPs per step / (step time x peak FLOP/s of all "
        "GPUs)"
    )
    hfu: float = Field(
        description="hardware FLOPs utilization, fraction 0-1: as mfu with recomputation's FLOPs counted"
    )
    peak_memory_bytes: float = Field(
        description="predicted peak bytes the caching allocator reserves on the busiest GPU"
    )
    memory_capacity_bytes: float = Field(
        description="bytes the caching allocator can reserve on one GPU (device memory less driver, CUDA context and "
        "communicator buffers)"
    )
    fits: bool = Field(description="the predicted peak is at most memory_capacity_bytes (the headroom not applied)")
    bottleneck: str = Field(description="the bottleneck: " + terms.BOTTLENECK_DEFINITION)
    time_breakdown_s: dict[str, float] = Field(
        description="seconds per step by term (specs/terms.py): " + terms.describe(terms.TIME)
    )
    comm_total_s: dict[str, float] = Field(
        default_factory=dict,
        description="seconds per step each communication term's traffic takes on the links, hidden behind compute "
        "or not (tp_comm, cp_comm, pp_comm, dp_comm, ep_comm); time_breakdown_s holds the exposed part, what it "
        "adds to the step (with the slowdown the hidden part causes to the compute it overlaps). Total minus "
        "exposed is the traffic compute hides: near the total, a slower link or less compute exposes it",
    )
    memory_breakdown_bytes: dict[str, float] = Field(
        description="bytes per GPU at the peak by term (specs/terms.py): " + terms.describe(terms.MEMORY)
    )
    model_flops_per_step: float = Field(
        description="FLOPs of one step's forward and backward, recomputation not counted"
    )
    hardware_flops_per_step: float = Field(description="FLOPs executed per step, recomputation included")
    goodput: GoodputPrediction | None = Field(
        default=None, description="checkpoints, failures and cost (null where not predicted)"
    )


class GroupPlacement(Spec):
    """Where the process groups of one parallel axis sit, and what their slowest link costs."""

    # ep (MoE): consecutive dp ranks, the dp stride apart
    axis: AxisName = Field(description="the parallel axis: tp, cp, dp, pp or ep (MoE)")
    size: int = Field(description="ranks in one group of this axis (its degree)")
    count: int = Field(description="how many groups of this axis")
    stride: int = Field(description="rank distance between neighbours in a group")
    nodes_spanned: int = Field(description="nodes one group touches")
    level: str = Field(description="the smallest fast domain that holds a whole group")
    link_kind: str = Field(description="kind of the group's slowest link (nvlink, infiniband, ...)")
    bandwidth_bytes_per_s: float = Field(description="per GPU on the group's slowest level, shared as in the fabric")
    crosses_slow_link: bool = Field(description="the group leaves the innermost fast domain")
    time_s: float = Field(description="this axis's communication per step (exposed part)")
    cost_of_crossing_s: float = Field(description="how much less time it would take inside the innermost domain")


class Placement(Spec):
    """Rank -> GPU mapping and process groups of a plan: rank r runs on node r // gpus_per_node,
    local GPU r % gpus_per_node (what torchrun's --node-rank and local rank give); its coordinate
    along each axis follows `axis_order`. `rank_map` and `process_groups` are listed in full for
    the best plan of a search and for compared layouts, up to PLACEMENT_DETAIL_MAX_RANKS ranks;
    the others carry the per-axis summary (the rule above is exact, `planner/placement.py`)."""

    axis_order: AxisOrder = Field(description="parallel axes over ranks, innermost first")
    groups: tuple[GroupPlacement, ...] = Field(description="one entry per parallel axis of the layout")
    rank_map: list[dict[str, int]] | None = Field(default=None, description="rank, node, local_rank, tp, cp, dp, pp")
    process_groups: dict[str, list[list[int]]] | None = Field(
        default=None, description="for each axis, the rank lists of its process groups"
    )


PLACEMENT_DETAIL_MAX_RANKS = 4096


class Fallback(Spec):
    """What to run when a node is lost: the best layout on the remaining nodes, keeping the global
    batch where some layout splits it, else the nearest batch that one does."""

    nodes_lost: int = Field(description="nodes assumed lost")
    world_size: int = Field(description="GPUs left")
    global_batch_size: int = Field(description="sequences per step on the remaining nodes")
    layout: Layout = Field(description="the best layout on the remaining nodes")
    step_time_s: float = Field(description="predicted seconds per step of the fallback layout")
    tokens_per_s: float = Field(description="predicted tokens per second of the fallback layout")
    peak_memory_bytes: float = Field(description="predicted peak allocator bytes per GPU of the fallback layout")
    changes: list[str] = Field(
        description="what differs from the planned layout, one line each, with the throughput change"
    )


class Plan(Spec):
    """A layout with its prediction, self-contained: it carries the specs it was planned for."""

    berth_version: str = Field(description="the berth version that made the plan")
    model: ModelSpec = Field(description="the model planned for")
    training: TrainingSpec = Field(description="the training setup planned for")
    cluster: ClusterSpec = Field(description="the cluster planned for")
    layout: Layout = Field(description="the parallel layout")
    prediction: Prediction | None = Field(
        description="the cost model's prediction (null when the layout is infeasible)"
    )
    infeasible_reason: str | None = Field(default=None, description="why the layout cannot run (null when it can)")
    stage_layers: list[int] | None = Field(
        default=None,
        description="decoder layers on each pipeline stage (pp rank, its virtual stages summed), "
        "first stage first: the engine's split rule (specs/stages.py: berth's, uneven when pp x virtual_stages "
        "does not divide the layers; nanotron's compute-balanced one); null when the layout has no valid split",
    )
    placement: Placement | None = Field(default=None, description="rank -> GPU mapping and process groups")
    fallback: Fallback | None = Field(default=None, description="the best layout with one node lost (when asked for)")

    def predicted(self) -> Prediction:
        """The prediction of a plan that has one (every plan the search returns); ValueError otherwise."""
        if self.prediction is None:
            raise ValueError(f"plan {self.layout.short()} has no prediction: {self.infeasible_reason}")
        return self.prediction


def plan_listing(data: Any) -> list[Any] | None:
    """The plans of a listing as its JSON holds them: `berth plan --json` / `berth compare --json` output and stored
    API answers ({"plans": [...]} or {"candidates": [...]}), `berth probe --json`'s picks, each with its plan, a list
    of plans, or one plan object; None when `data` is none of these."""
    if isinstance(data, dict) and isinstance(data.get("picks"), list):
        return [p.get("plan") if isinstance(p, dict) else p for p in data["picks"]]
    if isinstance(data, dict):
        listed = data.get("plans", data.get("candidates"))
        return [data] if listed is None else listed if isinstance(listed, list) else None
    return data if isinstance(data, list) else None


def pick_plan(plans: list[Any], pick: int, holder: str) -> Plan:
    """Plan number `pick` (from 1, as the tables number them) of `plans`, checked again as a Plan (its
    names must pass today's rules): what `berth validate/launch --pick` and the API's `pick` choose.
    `holder` names the listing in the error ("the file", "plan <id>")."""
    if not 1 <= pick <= len(plans):
        raise BerthError(
            "pick", pick, f"{holder} holds {len(plans)} plans" + (f" (numbered 1..{len(plans)})" if plans else "")
        )
    try:
        return Plan.model_validate(plans[pick - 1])
    except ValidationError as err:
        raise from_validation_error(err, "plan") from None


class Metrics(Spec):
    """The figures a validation compares; None where not measured or not predicted."""

    step_time_s: float | None = Field(default=None, description="seconds per step")
    tokens_per_s: float | None = Field(default=None, description="tokens per second")
    peak_memory_bytes: float | None = Field(
        default=None, description="peak bytes reserved by the allocator on the busiest rank"
    )
    loss: float | None = Field(default=None, description="training loss (nats per token) of the first step")


ValidationStatus = Literal["ok", "failed", "did_not_fit"]


class TermComparison(Spec):
    """One predicted step term beside what was measured for it (cost_models/breakdown.py says how)."""

    predicted_s: float | None = Field(default=None, description="predicted seconds per step of this term")
    measured_s: float | None = Field(default=None, description="None: the run never entered this term's regions")
    error_s: float | None = Field(default=None, description="measured - predicted (a term not seen counts as 0)")
    relative_error: float | None = Field(
        default=None, description="error_s / predicted_s (null when nothing was predicted)"
    )
    measured_by: str = Field(default="", description="how the executor measured the term (its timed regions)")


class MemoryComparison(Spec):
    predicted_bytes: float | None = Field(default=None, description="predicted bytes of this memory term")
    measured_bytes: float | None = Field(default=None, description="measured bytes of this memory term")
    error_bytes: float | None = Field(
        default=None, description="measured - predicted, bytes (null when either side is missing)"
    )
    measured_by: str = Field(default="", description="how the executor measured the term")


class MeasuredBreakdown(Spec):
    """Predicted `time_breakdown_s` and `memory_breakdown_bytes` beside what the executor measured, term by term, for
    the rank that sets the step time (the largest mean step over the timed steps). Measured seconds are means over the
    timed steps of that rank (means add up: the terms plus `unattributed_s` are `step_time_s`)."""

    rank: int = Field(description="the rank compared (the one with the largest mean step)")
    method: str = Field(description="the clock: host wall clock (CPU) or CUDA events")
    step_time_s: float = Field(description="that rank's mean step over the timed steps")
    terms: dict[str, TermComparison] = Field(description="per time term: predicted and measured seconds per step")
    unattributed_s: float = Field(description="time of the step in no measured region (untimed glue)")
    largest_error_term: str | None = Field(
        default=None, description="the term with the largest absolute error (null when none was scored)"
    )
    largest_error_rule: str = Field(default="", description="how largest_error_term is chosen")
    memory: dict[str, MemoryComparison] = Field(
        default_factory=dict, description="per memory term, and the total: predicted and measured bytes"
    )
    memory_note: str = Field(
        default="", description="what the measured memory figures are and where they differ from the predicted terms"
    )


class ValidationReport(Spec):
    """What `berth validate` measured for a plan, next to what the plan predicted.

    predicted.loss is the first-step loss of a randomly initialized model, ln(vocab_size) (uniform
    next-token distribution); measured.loss is the loss of the first step. relative_error is
    (measured - predicted) / predicted for each metric both sides have.
    """

    model_config = ConfigDict(defer_build=True)  # its schema is built at first use: `berth plan` never needs it

    id: str = Field(description="the report's id in the results store")
    created: str = Field(description="when the report was made (ISO 8601, UTC)")
    berth_version: str = Field(description="the berth version that ran the validation")
    status: ValidationStatus = Field(
        description="'ok' (measured), 'failed' (the run failed) or 'did_not_fit' (out of memory)"
    )
    message: str | None = Field(default=None, description="why the run failed (null when ok)")
    mode: Literal["full", "rank-slice"] = Field(
        default="full",
        description="'full' (every rank of the plan run) or 'rank-slice' (one rank's share of one stage, in one "
        "process)",
    )
    plan: Plan = Field(description="the plan validated")
    machine: dict[str, Any] = Field(
        default_factory=dict,
        description="where it ran: host name, CPUs, torch version, GPU, world size, backend, wall time (s)",
    )
    steps: int = Field(description="timed steps")
    warmup: int = Field(description="untimed steps before the timed ones")
    predicted: Metrics = Field(description="what the plan predicted")
    measured: Metrics = Field(
        description="what the run measured (step time: median over timed steps of the slowest rank)"
    )
    relative_error: dict[str, float] = Field(
        default_factory=dict, description="(measured - predicted) / predicted per metric both sides have"
    )
    step_time_spread_s: dict[str, float] = Field(
        default_factory=dict, description="min, median, max (and stdev) of the timed steps, seconds"
    )
    step_times_s: list[float] = Field(
        default_factory=list, description="seconds of each timed step (the slowest rank's)"
    )
    losses: list[float] = Field(default_factory=list, description="loss of each step, warm-up steps included")
    per_rank: list[dict[str, Any]] = Field(
        default_factory=list, description="per-rank records: step time, peak memory, collective time and measured terms"
    )
    memory_method: str | None = Field(
        default=None,
        description="how peak memory was measured (GPU: torch.cuda.max_memory_reserved; CPU: the "
        "profiler's allocations replayed)",
    )
    executed_as: list[str] = Field(
        default_factory=list, description="where the executor ran the layout differently from the plan, one line each"
    )
    checks: dict[str, list[str]] = Field(
        default_factory=dict,
        description="what a rank-slice validation checks and does not check ('checked', 'not_checked')",
    )
    breakdown: MeasuredBreakdown | None = Field(
        default=None,
        description="predicted and measured step terms (reports from before berth measured them have none)",
    )
    traces: list[str] = Field(
        default_factory=list,
        description="Chrome/Perfetto trace files of one step, one per rank (`berth validate --trace DIR`)",
    )

    def measured_breakdown(self) -> MeasuredBreakdown:
        """The measured step terms of a report that has them; ValueError otherwise (callers check first)."""
        if self.breakdown is None:
            raise ValueError(f"validation report {self.id} has no measured breakdown")
        return self.breakdown
