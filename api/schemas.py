"""Request and response bodies of the REST API. Requests mirror the CLI; responses carry plans
exactly as `berth plan --json` prints them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Discriminator, Field, Tag

from berth.hardware_profiles import server_names
from berth.hardware_profiles.schema import LinkProfile, Precision
from berth.planner.launch import FORMATS
from berth.planner.specs import (
    DEFAULT_MEMORY_HEADROOM,
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_MEMORY_HEADROOM,
    MAX_NODES,
    MAX_SEQ_LEN,
    Framework,
    ImageName,
    Plan,
    SearchSpec,
    ValidationReport,
)
from berth.planner.topology import LOCAL


class Body(BaseModel):
    """Requests are strict: no bool or text for a number, no NaN or Infinity, no unknown field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# The cluster presets a request may name: the catalog shipped with the package, fixed when the
# service starts (an enum in the OpenAPI schema). A request never names a file on the server.
PRESETS: tuple[str, ...] = (*server_names(), LOCAL)
PresetName = Literal[PRESETS]  # type: ignore[valid-type]
PlanId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
SpecText = Annotated[str, Field(min_length=1, max_length=512)]  # "tp=8,pp=2": a layout in the CLI's syntax


class TrainingRequest(Body):
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN, examples=[8192])
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, examples=[256])
    precision: Precision | None = Field(default=None, description="default: bf16 on GPUs, fp32 on CPU workers")
    flash_attention: bool = True
    framework: Framework = Field(default="pytorch", description="whose memory behaviour to predict: 'pytorch' "
                                 "(DTensor, FSDP2, DDP: the bundled executor, torchtitan) or 'megatron'")
    token_budget: float | None = Field(default=None, gt=0, le=1e16, description="tokens to train on, for the cost")


class PresetCluster(Body):
    preset: PresetName = Field(examples=["dgx-h100"], description="a cluster preset, or 'local' (the server's own "
                               "machine)")
    nodes: int = Field(default=1, gt=0, le=MAX_NODES)
    devices_per_node: int | None = Field(default=None, gt=0, le=MAX_GPUS_PER_NODE,
                                         description="with preset 'local' only")
    fabric: Literal["rails", "fat-tree"] = Field(default="rails", description="how the nodes' NICs are joined")
    nodes_per_leaf: int | None = Field(default=None, gt=0, le=MAX_NODES, description="fat-tree: nodes per leaf")
    oversubscription: float = Field(default=1.0, ge=1.0, le=64.0, description="fat-tree: leaf down/up bandwidth")


class GraphCluster(Body):
    graph: dict[str, Any] = Field(description='networkx node-link: {"nodes": [...], "links": [...]}')
    name: str = Field(default="graph", min_length=1, max_length=100, pattern=r"^[^\x00-\x1f\x7f]+$")


class OperationsRequest(Body):
    """Failures, storage and price (defaults: see ClusterSpec)."""

    failures_per_gpu_hour: float | None = Field(default=None, ge=1e-12, le=1)
    storage_write_gbps_per_gpu: float | None = Field(default=None, ge=1e-6, le=1e4)
    price_per_gpu_hour: float | None = Field(default=None, ge=0, le=1e6)


class SearchRequest(Body):
    top: int = Field(default=5, gt=0, le=100)
    fix: SpecText | dict[str, int | SpecText | bool] = Field(default_factory=dict, examples=["tp=8", {"tp": 8}])
    max_micro_batch_size: int | None = Field(default=None, gt=0, le=1024)
    objective: Literal["throughput", "goodput", "cost"] = "throughput"
    fallback: bool = Field(default=False, description="also plan the best layout with one node lost")
    memory_headroom: float = Field(default=DEFAULT_MEMORY_HEADROOM, ge=0, le=MAX_MEMORY_HEADROOM,
                                   description=SearchSpec.model_fields["memory_headroom"].description)


def _cluster_kind(value: Any) -> str | None:
    if isinstance(value, GraphCluster) or isinstance(value, dict) and "graph" in value:
        return "graph"
    if isinstance(value, PresetCluster | dict):
        return "preset"
    return None  # not an object: pydantic answers 422 naming the field


ClusterRequest = Annotated[
    Annotated[PresetCluster, Tag("preset")] | Annotated[GraphCluster, Tag("graph")],
    Discriminator(_cluster_kind),
]
ModelRef = Annotated[str, Field(min_length=1, max_length=64)] | dict[str, Any]
MODEL_DESCRIPTION = "a preset name, a ModelSpec object, or a Hugging Face config.json object"


class PlanRequest(Body):
    model: ModelRef = Field(description=MODEL_DESCRIPTION, examples=["llama3-70b"])
    training: TrainingRequest
    cluster: ClusterRequest
    operations: OperationsRequest = Field(default_factory=OperationsRequest)
    search: SearchRequest = Field(default_factory=SearchRequest)


class CompareRequest(Body):
    model: ModelRef = Field(description=MODEL_DESCRIPTION, examples=["llama3-70b"])
    training: TrainingRequest
    cluster: ClusterRequest
    operations: OperationsRequest = Field(default_factory=OperationsRequest)
    layouts: list[SpecText | dict[str, int | SpecText | bool]] = Field(min_length=1, max_length=64,
                                                             examples=[["tp=8,pp=2", {"tp": 8, "zero_stage": 3}]])
    memory_headroom: float = Field(default=DEFAULT_MEMORY_HEADROOM, ge=0, le=MAX_MEMORY_HEADROOM,
                                   description=SearchSpec.model_fields["memory_headroom"].description)


class PlanResponse(BaseModel):
    id: str
    created: str
    plans: list[Plan]
    searched: int
    feasible: int
    rejected: dict[str, int]


class CompareResponse(BaseModel):
    id: str
    created: str
    candidates: list[Plan]
    best_searched: Plan | None
    gap_to_best: list[float | None] | None = None


class LaunchRequest(Body):
    plan_id: PlanId
    pick: int = Field(default=1, ge=1, le=1000, description="which plan of the stored answer (1 = first)")
    format: Literal[FORMATS]  # type: ignore[valid-type]  # the launch formats' registry (planner/launch.py)
    steps: int = Field(default=20, ge=1, le=100000)
    warmup: int = Field(default=3, ge=0, le=1000)
    image: ImageName = "berth-executor:latest"


class LaunchResponse(BaseModel):
    plan_id: str
    format: str
    files: dict[str, str]


class ValidationRequest(Body):
    plan_id: PlanId
    pick: int = Field(default=1, ge=1, le=1000, description="which plan of the stored answer (1 = first)")
    steps: int = Field(default=5, ge=1, le=200)
    warmup: int = Field(default=2, ge=0, le=50)
    proxy: Literal["rank-slice"] | None = None
    layers: int | None = Field(default=None, ge=1, le=4096)


class ValidationJob(BaseModel):
    id: str
    created: str
    plan_id: str
    status: Literal["queued", "running", "done", "failed"]
    message: str | None = None
    report: ValidationReport | None = Field(
        default=None, description="predicted vs measured; `report.breakdown` puts the measured step terms beside "
        "the predicted time_breakdown_s and memory_breakdown_bytes and names the term with the largest error "
        "(None in reports made before berth measured terms, which still load)")


class ModelInfo(BaseModel):
    name: str
    num_params: int
    num_layers: int
    hidden_size: int
    num_attention_heads: int
    num_kv_heads: int
    ffn_hidden_size: int
    vocab_size: int
    num_experts: int = Field(default=0, description="routed experts per MoE layer; 0 for a dense model")
    experts_per_token: int = 0
    active_params: int = Field(default=0, description="parameters a token goes through (num_params when dense)")


class ClusterInfo(BaseModel):
    name: str
    display_name: str
    device: str
    gpus_per_node: int
    intra_node: LinkProfile
    inter_node: LinkProfile


class ProfileInfo(BaseModel):
    name: str
    display_name: str
    kind: str
    memory_bytes: float
    peak_flops_per_s: dict[str, float]


class Health(BaseModel):
    status: Literal["ok"]
    version: str
    validation_enabled: bool
