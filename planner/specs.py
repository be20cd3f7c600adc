"""The one typed spec tree: model, training, cluster, search, layout, prediction, plan.

Every spec is a frozen pydantic model with extra="forbid"; it flows unchanged from the CLI and
the API through the planner into the plan JSON and on to the executor. Names follow DESIGN.md.
Units are SI base units and carried in field names.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field, StringConstraints, TypeAdapter, ValidationError, model_validator

from berth.cost_models import terms
from berth.hardware_profiles.schema import DeviceProfile, LinkProfile, Precision
from berth.planner.axes import with_cp  # noqa: F401 (re-exported: the axis table's placement of cp)
from berth.planner.errors import BerthError, from_validation_error

Recompute = Literal["none", "selective", "full"]
Schedule = Literal["gpipe", "1f1b", "interleaved_1f1b"]
Framework = Literal["pytorch", "megatron"]
AxisOrder = Literal["tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp"]
RECOMPUTE_CHOICES: tuple[Recompute, ...] = ("none", "selective", "full")
SCHEDULE_CHOICES: tuple[Schedule, ...] = ("gpipe", "1f1b", "interleaved_1f1b")
# innermost axis first; tp-dp-pp (Megatron's default) first so that ties keep it
AXIS_ORDER_CHOICES: tuple[AxisOrder, ...] = ("tp-dp-pp", "tp-pp-dp", "dp-tp-pp", "dp-pp-tp", "pp-tp-dp", "pp-dp-tp")


# Sanity bounds on user input: far beyond any real model or cluster, small enough that a
# request can never make the planner allocate or loop without bound.
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
# still shell-quote every value (planner/launch.py): the two defences do not rely on each other.
MAX_NAME_LEN = 128  # Hugging Face repo ids ("org/name") are at most 96 characters
MAX_IMAGE_LEN = 255  # OCI image references: registry host, path, tag (Docker caps a tag at 128)
ModelName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_./][A-Za-z0-9_./:+@-]*$", min_length=1,
                                             max_length=MAX_NAME_LEN)]
HostName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9_][A-Za-z0-9_.:-]*$", min_length=1,
                                            max_length=253)]  # RFC 1123 host names, IPv4/IPv6 addresses
ImageName = Annotated[str, StringConstraints(pattern=r"^[A-Za-z0-9][A-Za-z0-9_./:@-]*$", min_length=1,
                                             max_length=MAX_IMAGE_LEN)]
LabelText = Annotated[str, StringConstraints(pattern=r"^[^\x00-\x1f\x7f]*$", max_length=256)]  # one printable line
_HOST = TypeAdapter(HostName)


def check_host(value: Any) -> str | None:
    """None when `value` is a valid host name, else what is wrong (graph parsers name the field)."""
    try:
        _HOST.validate_python(value)
    except ValidationError as err:
        return "a host name: letters, digits and . _ - : only, at most 253 characters" + (
            "" if isinstance(value, str) else f" ({err.errors()[0]['msg']})")
    return None


class Spec(BaseModel):
    model_config = ConfigDict(frozen=True, extra="forbid")


class ModelSpec(Spec):
    """A decoder-only transformer's shape (Megatron/Llama family)."""

    name: ModelName = "custom"
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden_size: int = Field(gt=0, le=MAX_HIDDEN)
    num_attention_heads: int = Field(gt=0, le=MAX_HEADS)
    num_kv_heads: int | None = Field(default=None, gt=0, le=MAX_HEADS)
    ffn_hidden_size: int = Field(gt=0, le=MAX_HIDDEN * 8)
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    mlp: Literal["gelu", "swiglu"] = "gelu"
    norm: Literal["layernorm", "rmsnorm"] = "layernorm"
    tied_embeddings: bool = False
    dropout: bool = False
    # Mixture of experts (Shazeer et al. 2017; Fedus et al. 2022; Mixtral, DeepSeek-V3): each MoE
    # layer replaces its MLP by `num_experts` routed experts of `moe_ffn_hidden_size` (same mlp kind),
    # of which a router (one h x E linear, top-k softmax) picks `experts_per_token` per token, plus
    # `num_shared_experts` experts every token goes through (DeepSeek). The first `first_k_dense`
    # layers keep the dense MLP of `ffn_hidden_size` (DeepSeek-V3: 3); num_experts = 0 is dense.
    num_experts: int = Field(default=0, ge=0, le=1 << 14)
    experts_per_token: int = Field(default=0, ge=0, le=1 << 10, description="top-k of the router")
    moe_ffn_hidden_size: int | None = Field(default=None, gt=0, le=MAX_HIDDEN * 8,
                                            description="one expert's ffn size (default: ffn_hidden_size)")
    num_shared_experts: int = Field(default=0, ge=0, le=64)
    shared_expert_ffn_hidden_size: int | None = Field(default=None, gt=0, le=MAX_HIDDEN * 8,
                                                      description="one shared expert's ffn size (default: the "
                                                      "expert ffn size)")
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
            raise ValueError(f"experts_per_token {self.experts_per_token} must be in 1..num_experts "
                             f"{self.num_experts}")
        if self.first_k_dense >= self.num_layers:
            raise ValueError(f"first_k_dense {self.first_k_dense} leaves no MoE layer of {self.num_layers}")
        return self

    @model_validator(mode="after")
    def _shape(self) -> ModelSpec:
        if self.hidden_size % self.num_attention_heads:
            raise ValueError(
                f"hidden_size {self.hidden_size} is not divisible by "
                f"num_attention_heads {self.num_attention_heads}"
            )
        if self.num_attention_heads % self.kv_heads:
            raise ValueError(
                f"num_attention_heads {self.num_attention_heads} is not divisible by "
                f"num_kv_heads {self.kv_heads}"
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
        return ModelSpec(name=self.name, num_layers=self.num_layers, hidden_size=self.hidden_size,
                         num_attention_heads=self.num_attention_heads, num_kv_heads=self.num_kv_heads,
                         ffn_hidden_size=self.mean_ffn_hidden_size, vocab_size=self.vocab_size, mlp=self.mlp,
                         norm=self.norm, tied_embeddings=self.tied_embeddings, dropout=self.dropout)

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
        return (self.attention_norm_params_per_layer + h * self.num_experts
                + self.num_shared_experts * self.mlp_matrices * h * self.shared_ffn)

    @property
    def layer_params_total(self) -> int:
        """Parameters of all decoder layers."""
        dense = self.attention_norm_params_per_layer + self.mlp_matrices * self.hidden_size * self.ffn_hidden_size
        if not self.is_moe:
            return self.num_layers * dense
        return self.first_k_dense * dense + self.num_moe_layers * (self.moe_layer_other_params
                                                                   + self.expert_params_per_moe_layer)

    @property
    def params_per_layer(self):
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
        idle = self.num_moe_layers * (self.num_experts - self.experts_per_token) * self.mlp_matrices \
            * self.hidden_size * self.expert_ffn
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


class TrainingSpec(Spec):
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN)
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, description="sequences per step")
    precision: Precision = "bf16"
    optimizer: Literal["adamw"] = "adamw"
    flash_attention: bool = True
    attention_kernel: Literal["sdpa", "flash2", "flash1"] = Field(default="sdpa", description=(
        "which fused attention kernel runs when flash_attention is on: 'sdpa' (today's PyTorch "
        "scaled_dot_product_attention, what the device profile measured), 'flash2' (FlashAttention-2, e.g. PyTorch "
        "of 2024 on Hopper) or 'flash1' (FlashAttention v1 and its Triton port, e.g. MosaicML llm-foundry's "
        "attn_impl 'triton' of 2023); speeds in DeviceProfile.attention_kernel_speed"))
    framework: Framework = Field(default="pytorch", description=(
        "the training stack whose memory behaviour the prediction follows: 'pytorch' (DTensor tensor and "
        "sequence parallelism, FSDP2, DDP: the bundled executor, torchtitan) or 'megatron' (Megatron-LM)"))
    token_budget: float | None = Field(default=None, gt=0, description="tokens to train on (for the cost)")
    cross_entropy: Literal["fp32", "fused"] = Field(default="fp32", description=(
        "how the loss holds the logits: 'fp32' (F.cross_entropy on an fp32 copy: the bundled executor, torchtitan, "
        "Megatron-LM) or 'fused' (a fused kernel on the 16-bit logits that writes their gradient in place, as "
        "MosaicML llm-foundry's fused_crossentropy)"))

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


class FabricLevel(Spec):
    """One level of the cluster's hierarchy of fast domains: blocks of `gpus` consecutive GPUs (in
    rank order) and the link a GPU's traffic takes to the other sub-blocks of its block, with
    `bandwidth_bytes_per_s` the share each GPU gets when every GPU of the block sends at once
    (the bottleneck of the best path, a NIC shared by several GPUs, or an oversubscribed uplink)."""

    name: str
    gpus: int = Field(gt=0)
    link: LinkProfile
    limited_by: str = Field(default="path", description="path (slowest hop), nic (one GPU's own port) or "
                            "shared (a link several GPUs cross at once)")


class ClusterSpec(Spec):
    """The cluster as the cost model sees it: nodes of gpus_per_node GPUs, a fast domain inside each
    node and a fabric between them. Presets and graphs (`topology.py`, `hierarchy.py`) also give
    `fabric`, the full hierarchy of fast domains; without it the hierarchy is node, then cluster."""

    name: LabelText
    nodes: int = Field(gt=0, le=MAX_NODES)
    gpus_per_node: int = Field(gt=0, le=MAX_GPUS_PER_NODE)
    device: DeviceProfile
    intra_node: LinkProfile
    inter_node: LinkProfile
    collective_base_latency_s: float = Field(ge=0)
    comm_overlap_efficiency: float = Field(
        default=0.7, ge=0, le=1,
        description="fraction of a backward compute window that hides data-parallel traffic (cost_models/step.py)")
    fabric: tuple[FabricLevel, ...] = ()
    devices: dict[str, int] = Field(default_factory=dict,
                                    description="GPUs per device profile, when the cluster mixes several")
    notes: tuple[str, ...] = ()
    hosts: tuple[HostName, ...] = Field(default=(), description="host name of each node (graph clusters), in node "
                                        "order")
    # Failures and checkpoints (cost_models/goodput.py). Defaults from Meta's Llama 3 pre-training
    # (Dubey et al. 2024, "The Llama 3 Herd of Models", Sec. 3.3): 419 unexpected interruptions in
    # 54 days on 16,384 H100 GPUs = 1.97e-5 per GPU-hour; the Tectonic filesystem sustained 2 TB/s
    # for those 16,384 GPUs = 122 MB/s of write bandwidth per GPU.
    failures_per_gpu_hour: float = Field(default=1.97e-5, ge=1e-12, le=1)
    storage_write_bytes_per_s_per_gpu: float = Field(default=1.22e8, ge=1e3,
                                                    description="the filesystem's aggregate write bandwidth / GPUs")
    storage_client_write_bytes_per_s: float = Field(
        default=2e9, ge=1e3, description="one writing rank's bandwidth to storage (assumption: about one 25 GB/s "
        "storage NIC shared by a node's 8 GPUs, at 2/3 efficiency)")
    restart_s: float = Field(default=600.0, ge=0, description="detect a failure, reschedule, reload (assumption: "
                             "10 minutes)")
    price_per_gpu_hour: float | None = Field(default=None, ge=0, description="currency units per GPU-hour")

    @property
    def world_size(self) -> int:
        return self.nodes * self.gpus_per_node

    @property
    def levels(self) -> tuple[FabricLevel, ...]:
        """The hierarchy, innermost first; its last level spans the whole cluster."""
        if self.fabric:
            return self.fabric
        return (FabricLevel(name="node", gpus=self.gpus_per_node, link=self.intra_node),
                FabricLevel(name="cluster", gpus=self.world_size, link=self.inter_node))


class Layout(Spec):
    """One parallel layout in DESIGN.md's vocabulary."""

    tp: int = Field(default=1, gt=0)
    cp: int = Field(default=1, gt=0, description="context-parallel degree: each rank holds seq/cp tokens of every "
                    "sequence (load-balanced causal split into 2 cp chunks; ring attention, cost_models/step.py)")
    pp: int = Field(default=1, gt=0)
    dp: int = Field(default=1, gt=0)
    ep: int = Field(default=1, gt=0, description="expert-parallel degree (MoE models): ranks carved out of dp, each "
                    "holding num_experts / ep experts; 1 for dense models")
    shard: int = Field(default=1, gt=0)
    zero_stage: int = Field(default=0, ge=0, le=3)
    recompute: Recompute = "none"
    micro_batch_size: int = Field(default=1, gt=0)
    num_microbatches: int = Field(default=1, gt=0)
    virtual_stages: int = Field(default=1, gt=0)
    schedule: Schedule = "1f1b"
    sequence_parallel: bool = False
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

    def short(self) -> str:
        parts = [f"tp={self.tp}"] + ([f"cp={self.cp}"] if self.cp > 1 else []) + [f"pp={self.pp}", f"dp={self.dp}"]
        if self.ep > 1:
            parts.append(f"ep={self.ep}")
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


# Share of the allocator's capacity a plan must leave free to be ranked as fitting. The memory
# model's error on the single-H100 steps it is scored on (benchmarks/memory_fidelity.py:
# full-step-runs.json and mem_detail.json) spans about -2 % to +3 % of the measured reserved peak,
# and the allocator's own slack varies by about as much between runs of one layout (reserved less
# allocated: 0.5-1.4x a logits tensor, i.e. up to ~5 % of the peak); 5 % covers both, so a plan
# ranked as fitting runs out of memory only if the prediction is off by more than any run seen.
DEFAULT_MEMORY_HEADROOM = 0.05
MAX_MEMORY_HEADROOM = 0.5


class SearchSpec(Spec):
    top: int = Field(default=5, gt=0, le=1000)
    memory_headroom: float = Field(
        default=DEFAULT_MEMORY_HEADROOM, ge=0, le=MAX_MEMORY_HEADROOM,
        description="share of the device memory (what the caching allocator can reserve) a plan must leave free "
        "to be ranked as fitting; a plan whose predicted peak is above capacity x (1 - headroom) is 'tight' "
        "(reason memory_tight) and is not ranked")
    objective: Objective = Field(default="throughput", description="rank by tokens/s, by useful tokens/s after "
                                 "checkpoints and failures, or by cost per useful token")
    fix: dict[str, int | str | bool] = Field(default_factory=dict)
    max_micro_batch_size: int | None = Field(default=None, gt=0)

    @model_validator(mode="after")
    def _fix_keys(self) -> SearchSpec:
        for key in self.fix:
            if key not in LAYOUT_FIELDS:
                raise ValueError(f"unknown layout field {key!r} in fix; known: {LAYOUT_FIELDS}")
        return self


class GoodputPrediction(Spec):
    """Checkpoints, failures and what they leave of the throughput (cost_models/goodput.py)."""

    checkpoint_bytes_total: float
    checkpoint_bytes_per_rank: float
    checkpoint_writers: int
    checkpoint_write_s: float
    mtbf_s: float = Field(description="mean time between failures of the whole job")
    checkpoint_interval_s: float = Field(description="Young/Daly optimum")
    lost_work_per_failure_s: float
    checkpoint_stall_s_per_step: float
    goodput_fraction: float
    goodput_tokens_per_s: float
    cost_per_step: float | None = None
    cost_per_million_tokens: float | None = None
    cost_for_token_budget: float | None = None
    energy_kwh_per_million_tokens: float | None = None


class Prediction(Spec):
    step_time_s: float
    tokens_per_s: float
    mfu: float
    hfu: float
    peak_memory_bytes: float
    memory_capacity_bytes: float
    fits: bool
    bottleneck: str
    time_breakdown_s: dict[str, float] = Field(description="seconds per step by term (cost_models/terms.py): "
                                               + terms.describe(terms.TIME))
    memory_breakdown_bytes: dict[str, float] = Field(description="bytes per GPU at the peak by term "
                                                     "(cost_models/terms.py): " + terms.describe(terms.MEMORY))
    model_flops_per_step: float
    hardware_flops_per_step: float
    goodput: GoodputPrediction | None = None


class GroupPlacement(Spec):
    """Where the process groups of one parallel axis sit, and what their slowest link costs."""

    axis: Literal["tp", "cp", "dp", "pp", "ep"]  # ep (MoE): consecutive dp ranks, the dp stride apart
    size: int
    count: int = Field(description="how many groups of this axis")
    stride: int = Field(description="rank distance between neighbours in a group")
    nodes_spanned: int = Field(description="nodes one group touches")
    level: str = Field(description="the smallest fast domain that holds a whole group")
    link_kind: str
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

    axis_order: AxisOrder
    groups: tuple[GroupPlacement, ...]
    rank_map: list[dict[str, int]] | None = Field(default=None, description="rank, node, local_rank, tp, cp, dp, pp")
    process_groups: dict[str, list[list[int]]] | None = None


PLACEMENT_DETAIL_MAX_RANKS = 4096


class Fallback(Spec):
    """What to run when a node is lost: the best layout on the remaining nodes, keeping the global
    batch where some layout splits it, else the nearest batch that one does."""

    nodes_lost: int
    world_size: int
    global_batch_size: int
    layout: Layout
    step_time_s: float
    tokens_per_s: float
    peak_memory_bytes: float
    changes: list[str]


class Plan(Spec):
    """A layout with its prediction, self-contained: it carries the specs it was planned for."""

    berth_version: str
    model: ModelSpec
    training: TrainingSpec
    cluster: ClusterSpec
    layout: Layout
    prediction: Prediction | None
    infeasible_reason: str | None = None
    stage_layers: list[int] | None = Field(
        default=None, description="decoder layers on each pipeline stage (pp rank, its virtual stages summed), "
        "first stage first: the split rule of planner/stages.py, uneven when pp x virtual_stages does not divide "
        "the layers; null when the layout has no valid split")
    placement: Placement | None = None
    fallback: Fallback | None = None


def plan_listing(data: Any) -> list[Any] | None:
    """The plans of a listing as its JSON holds them: `berth plan --json` / `berth compare --json`
    output and stored API answers ({"plans": [...]} or {"candidates": [...]}), a list of plans, or
    one plan object; None when `data` is none of these."""
    if isinstance(data, dict):
        listed = data.get("plans", data.get("candidates"))
        return [data] if listed is None else listed if isinstance(listed, list) else None
    return data if isinstance(data, list) else None


def pick_plan(plans: list[Any], pick: int, holder: str) -> Plan:
    """Plan number `pick` (from 1, as the tables number them) of `plans`, checked again as a Plan (its
    names must pass today's rules): what `berth validate/launch --pick` and the API's `pick` choose.
    `holder` names the listing in the error ("the file", "plan <id>")."""
    if not 1 <= pick <= len(plans):
        raise BerthError("pick", pick, f"{holder} holds {len(plans)} plans" + (f" (numbered 1..{len(plans)})"
                                                                            if plans else ""))
    try:
        return Plan.model_validate(plans[pick - 1])
    except ValidationError as err:
        raise from_validation_error(err, "plan") from None


class Metrics(Spec):
    """The figures a validation compares; None where not measured or not predicted."""

    step_time_s: float | None = None
    tokens_per_s: float | None = None
    peak_memory_bytes: float | None = None
    loss: float | None = None


ValidationStatus = Literal["ok", "failed", "did_not_fit"]


class TermComparison(Spec):
    """One predicted step term beside what was measured for it (executor/breakdown.py says how)."""

    predicted_s: float | None = None
    measured_s: float | None = Field(default=None, description="None: the run never entered this term's regions")
    error_s: float | None = Field(default=None, description="measured - predicted (a term not seen counts as 0)")
    relative_error: float | None = None
    measured_by: str = ""


class MemoryComparison(Spec):
    predicted_bytes: float | None = None
    measured_bytes: float | None = None
    error_bytes: float | None = None
    measured_by: str = ""


class MeasuredBreakdown(Spec):
    """Predicted `time_breakdown_s` and `memory_breakdown_bytes` beside what the executor measured,
    term by term, for the rank that sets the step time (the largest mean step over the timed
    steps). Measured seconds are means over the timed steps of that rank (means add up: the
    terms plus `unattributed_s` are `step_time_s`)."""

    rank: int
    method: str = Field(description="the clock: host wall clock (CPU) or CUDA events")
    step_time_s: float = Field(description="that rank's mean step over the timed steps")
    terms: dict[str, TermComparison]
    unattributed_s: float = Field(description="time of the step in no measured region (untimed glue)")
    largest_error_term: str | None = None
    largest_error_rule: str = ""
    memory: dict[str, MemoryComparison] = Field(default_factory=dict)
    memory_note: str = ""


class ValidationReport(Spec):
    """What `berth validate` measured for a plan, next to what the plan predicted.

    predicted.loss is the first-step loss of a randomly initialized model, ln(vocab_size) (uniform
    next-token distribution); measured.loss is the loss of the first step. relative_error is
    (measured - predicted) / predicted for each metric both sides have.
    """

    model_config = ConfigDict(defer_build=True)  # its schema is built at first use: `berth plan` never needs it

    id: str
    created: str
    berth_version: str
    status: ValidationStatus
    message: str | None = None
    mode: Literal["full", "rank-slice"] = "full"
    plan: Plan
    machine: dict[str, Any] = Field(default_factory=dict)
    steps: int
    warmup: int
    predicted: Metrics
    measured: Metrics
    relative_error: dict[str, float] = Field(default_factory=dict)
    step_time_spread_s: dict[str, float] = Field(default_factory=dict)
    step_times_s: list[float] = Field(default_factory=list)
    losses: list[float] = Field(default_factory=list)
    per_rank: list[dict[str, Any]] = Field(default_factory=list)
    memory_method: str | None = None
    executed_as: list[str] = Field(default_factory=list)
    checks: dict[str, list[str]] = Field(default_factory=dict)
    breakdown: MeasuredBreakdown | None = Field(default=None, description="predicted and measured step terms "
                                                "(reports from before berth measured them have none)")
    traces: list[str] = Field(default_factory=list, description="Chrome/Perfetto trace files of one step, one "
                              "per rank (`berth validate --trace DIR`)")
