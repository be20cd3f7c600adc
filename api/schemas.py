"""Request and response bodies of the REST API. Requests mirror the CLI; responses carry plans
exactly as `berth plan --json` prints them."""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import AliasChoices, BaseModel, ConfigDict, Discriminator, Field, Tag

from berth.hardware_profiles import server_names
from berth.launch.writers import FORMATS
from berth.planner.inputs import ClusterInput, OperationsInput, TrainingInput, with_engine_profile
from berth.specs.errors import BerthError
from berth.specs.hardware import LinkProfile
from berth.specs.tree import (
    ENGINE_ALIASES,
    ENGINE_CHOICES,
    MAX_GLOBAL_BATCH,
    MAX_GPUS_PER_NODE,
    MAX_MEMORY_HEADROOM,
    MAX_NODES,
    MAX_SEQ_LEN,
    EngineTuning,
    Fp8Recipe,
    ImageName,
    Plan,
    PrecisionChoice,
    SearchSpec,
    ValidationReport,
)
from berth.topology.clusters import LOCAL


class Body(BaseModel):
    """Requests are strict: no bool or text for a number, no NaN or Infinity, no unknown field."""

    model_config = ConfigDict(extra="forbid", strict=True, allow_inf_nan=False)


# The cluster presets a request may name: the catalog shipped with the package, fixed when the
# service starts (an enum in the OpenAPI schema). A request never names a file on the server.
PRESETS: tuple[str, ...] = (*server_names(), LOCAL)
PresetName = Literal[PRESETS]  # type: ignore[valid-type]
EngineName = Literal[(*ENGINE_CHOICES, *ENGINE_ALIASES)]  # type: ignore[valid-type]
PlanId = Annotated[str, Field(min_length=1, max_length=64, pattern=r"^[A-Za-z0-9_-]+$")]
SpecText = Annotated[str, Field(min_length=1, max_length=512)]  # "tp=8,pp=2": a layout in the CLI's syntax


class TrainingRequest(Body):
    seq_len: int = Field(gt=0, le=MAX_SEQ_LEN, examples=[8192], description="tokens per sequence")
    global_batch_size: int = Field(gt=0, le=MAX_GLOBAL_BATCH, examples=[256], description="sequences per step")
    precision: PrecisionChoice | None = Field(
        default=None,
        description="default: bf16 on GPUs, fp32 on CPU workers; fp8: bf16 with the engine's first FP8 recipe",
    )
    attention_kernel: Literal["sdpa", "flash2", "flash1"] | None = Field(
        default=None,
        description="the fused attention kernel the stack runs: sdpa (today's PyTorch, the default), flash2 "
        "(FlashAttention-2 class: PyTorch and Transformer Engine of 2024) or flash1",
    )
    fp8: Fp8Recipe | None = Field(
        default=None,
        description="run the linear layers' GEMMs in FP8 with this recipe (GET /v1/engines lists each engine's "
        "fp8_recipes); refused by name where the engine or the device has none",
    )
    flash_attention: bool = Field(
        default=True, description="attention runs as a fused kernel that never stores the seq_len x seq_len scores"
    )
    engine: EngineName = Field(
        default="executor",
        validation_alias=AliasChoices("engine", "framework"),
        description="the training engine (GET /v1/engines lists them): executor (berth's), torchtitan, megatron "
        "(NeMo, Megatron-Bridge), deepspeed, llmfoundry, nanotron or generic; the old field name framework and "
        "its value pytorch (= executor) are accepted",
    )
    token_budget: float | None = Field(default=None, gt=0, le=1e16, description="tokens to train on, for the cost")
    tuning: EngineTuning | None = Field(
        default=None,
        description="an engine profile's fitted parameters: the `tuning` object of the file `berth calibrate --runs "
        "--out` writes (its `profile` names it in the plans), with the engine they were fitted for as training.engine",
    )

    profile: dict[str, Any] | None = Field(
        default=None,
        description="an engine profile as `berth calibrate --runs --out` writes it (its format, engine and tuning "
        "are read; its fit report is not): the plans take its engine and fitted parameters, as --profile does; "
        "training.engine, where given, must be the profile's; not with training.tuning",
    )

    def to_input(self) -> TrainingInput:
        """The values berth.planner.inputs turns into a TrainingSpec (the CLI's options become the same); an
        engine profile gives its engine and tuning, checked as the CLI checks its file (`with_engine_profile`)."""
        values = self.model_dump(exclude={"tuning", "profile"})
        if self.profile is None:
            if self.tuning is not None and "engine" not in self.model_fields_set:  # fitted parameters are one engine's
                why = "give the engine training.tuning was fitted for (training.profile carries it)"
                raise BerthError("training.engine", None, why)
            return TrainingInput(**values, tuning=self.tuning)
        if self.tuning is not None:
            raise BerthError("training.tuning", None, "give training.profile or training.tuning, not both")
        given = self.engine if "engine" in self.model_fields_set else None  # the default is not a choice
        return with_engine_profile(self.profile, TrainingInput(**{**values, "engine": given}))


class EngineRefusal(BaseModel):
    rule: str = Field(description="the rule's name (a plan's infeasible_reason starts with it)")
    text: str = Field(description="what the engine cannot run")


class EngineDoc(BaseModel):
    name: str = Field(description="the value of training.engine")
    title: str = Field(description="what the engine is")
    version: str = Field(description="the version whose code the entry was read from, and launch files target")
    memory_recipe: str = Field(description="pytorch (autocast / FSDP2) or megatron (16-bit weights, fp32 master)")
    compute_stacks: list[str] = Field(description="the device profile's compute-stack entries, first present wins")
    launch_formats: list[str] = Field(description="POST /v1/launch formats that start it, the default first")
    refuses: list[EngineRefusal] = Field(
        description="what the engine cannot run: its rules, as the planner applies them"
    )
    param_gather_exposed: float = Field(description="share of ZeRO-1/2's parameter gather exposed after the step")
    grad_reduce_exposed: float = Field(description="share of ZeRO-1/2's gradient reduction exposed after the backward")
    bucket_params: float = Field(description="gradient parameters per data-parallel bucket (0: by bytes or one bucket)")
    bucket_params_per_dp: float = Field(description="bucket parameters per data-parallel rank (Megatron's max(..))")
    bucket_bytes: float = Field(description="gradient bytes per data-parallel bucket (0: by parameters or one bucket)")
    buckets_ddp_only: bool = Field(description="the buckets apply only where the engine wraps DDP (tp = pp = 1)")
    pipeline_split: str = Field(description="how the engine splits the decoder layers over pipeline ranks")
    memory_extras: list[str] = Field(
        description="what the engine holds beyond its memory recipe, by EngineInfo field (specs/engines.py)"
    )
    fp8_recipes: list[str] = Field(description="the FP8 recipes the engine runs (training.fp8); empty: it refuses FP8")
    source: str = Field(description="where the entry was read")


class PresetCluster(Body):
    preset: PresetName = Field(
        examples=["dgx-h100"], description="a cluster preset, or 'local' (the server's own machine)"
    )
    nodes: int = Field(default=1, gt=0, le=MAX_NODES, description="number of nodes")
    devices_per_node: int | None = Field(
        default=None, gt=0, le=MAX_GPUS_PER_NODE, description="with preset 'local' only"
    )
    fabric: Literal["rails", "fat-tree"] = Field(default="rails", description="how the nodes' NICs are joined")
    nodes_per_leaf: int | None = Field(default=None, gt=0, le=MAX_NODES, description="fat-tree: nodes per leaf")
    oversubscription: float = Field(default=1.0, ge=1.0, le=64.0, description="fat-tree: leaf down/up bandwidth")

    def to_input(self) -> ClusterInput:
        """The cluster as berth.planner.inputs takes it: a catalog name, never a file."""
        return ClusterInput(
            self.preset, self.nodes, self.devices_per_node, self.fabric, self.nodes_per_leaf, self.oversubscription
        )


class GraphCluster(Body):
    graph: dict[str, Any] = Field(description='networkx node-link: {"nodes": [...], "links": [...]}')
    name: str = Field(
        default="graph",
        min_length=1,
        max_length=100,
        pattern=r"^[^\x00-\x1f\x7f]+$",
        description="the cluster's label in tables and plans",
    )

    def to_input(self) -> ClusterInput:
        return ClusterInput(graph=self.graph, graph_name=self.name)


class OperationsRequest(Body):
    """Failures, storage and price (defaults: see ClusterSpec)."""

    failures_per_gpu_hour: float | None = Field(
        default=None, ge=1e-12, le=1, description="unexpected interruptions per GPU-hour (default: ClusterSpec's)"
    )
    storage_write_gbps_per_gpu: float | None = Field(
        default=None,
        ge=1e-6,
        le=1e4,
        description="the filesystem's aggregate write bandwidth per GPU, GB/s (1e9 bytes/s)",
    )
    price_per_gpu_hour: float | None = Field(
        default=None, ge=0, le=1e6, description="currency units per GPU-hour (no cost without it)"
    )

    def to_input(self) -> OperationsInput:
        return OperationsInput(**self.model_dump())


class SearchRequest(Body):
    top: int = Field(default=5, gt=0, le=100, description="how many plans to return, best first")
    fix: SpecText | dict[str, int | SpecText | bool] = Field(
        default_factory=dict,
        examples=["tp=8", {"tp": 8}],
        description="layout fields held fixed: 'tp=8,pp=2' (the CLI's syntax) or an object of Layout field names",
    )
    max_micro_batch_size: int | None = Field(
        default=None, gt=0, le=1024, description="largest micro-batch size (sequences) the search tries"
    )
    objective: Literal["throughput", "goodput", "cost"] = Field(
        default="throughput",
        description="rank by tokens/s, by useful tokens/s after checkpoints and failures, or by cost per useful token",
    )
    fallback: bool = Field(default=False, description="also plan the best layout with one node lost")
    memory_headroom: float | None = Field(
        default=None,
        ge=0,
        le=MAX_MEMORY_HEADROOM,
        description=SearchSpec.model_fields["memory_headroom"].description,
    )


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
    training: TrainingRequest = Field(description="sequence length, batch and precision")
    cluster: ClusterRequest = Field(description="a preset cluster or a topology graph")
    operations: OperationsRequest = Field(default_factory=OperationsRequest, description="failures, storage and price")
    search: SearchRequest = Field(
        default_factory=SearchRequest, description="what to search for and how many plans to return"
    )


class CompareRequest(Body):
    model: ModelRef = Field(description=MODEL_DESCRIPTION, examples=["llama3-70b"])
    training: TrainingRequest = Field(description="sequence length, batch and precision")
    cluster: ClusterRequest = Field(description="a preset cluster or a topology graph")
    operations: OperationsRequest = Field(default_factory=OperationsRequest, description="failures, storage and price")
    layouts: list[SpecText | dict[str, int | SpecText | bool]] = Field(
        min_length=1,
        max_length=64,
        examples=[["tp=8,pp=2", {"tp": 8, "zero_stage": 3}]],
        description="the layouts to predict, each 'tp=8,pp=2' (the CLI's syntax) or an object of Layout field names",
    )
    memory_headroom: float | None = Field(
        default=None,
        ge=0,
        le=MAX_MEMORY_HEADROOM,
        description=SearchSpec.model_fields["memory_headroom"].description,
    )


class PlanResponse(BaseModel):
    id: str = Field(description="the stored answer's id (plan_id for launch and validation requests)")
    created: str = Field(description="when the answer was made (ISO 8601, UTC)")
    plans: list[Plan] = Field(description="the best plans, best first")
    searched: int = Field(description="layouts evaluated")
    feasible: int = Field(description="layouts that can run and fit")
    rejected: dict[str, int] = Field(description="layouts rejected, counted by reason code")
    memory_headroom: float | None = Field(
        default=None, description="the memory headroom the search ranked with: the one asked for, else the engine's"
    )
    why_none: str | None = Field(
        default=None,
        description="when no layout fits (plans empty): why, the text `berth plan` prints (the smallest predicted "
        "peak against the device memory with the layout that has it, or every rule broken with its count); null "
        "when some plan fits",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="advice on the first plan, the notes `berth plan` prints under it (a vocabulary whose rows per "
        "tensor-parallel rank break the GEMMs' alignment, with what padding it would gain)",
    )


class CompareResponse(BaseModel):
    id: str = Field(description="the stored answer's id (plan_id for launch and validation requests)")
    created: str = Field(description="when the answer was made (ISO 8601, UTC)")
    candidates: list[Plan] = Field(description="one plan per requested layout, in request order")
    choice: int | None = Field(
        default=None,
        description="index into candidates of the one berth picks: the fastest predicted to fit with the memory "
        "headroom (null: none does)",
    )
    memory_headroom: float | None = Field(
        default=None, description="the memory headroom the choice used: the one asked for, else the engine's"
    )
    best_searched: Plan | None = Field(
        description="the best plan a search finds for the same inputs (null when none fits)"
    )
    gap_to_best: list[float | None] | None = Field(
        default=None,
        description="per candidate: its tokens/s over the best searched plan's, minus 1 (fraction; negative: slower); "
        "null for an infeasible candidate",
    )


class LaunchRequest(Body):
    plan_id: PlanId = Field(description="id of a stored plan or compare answer")
    pick: int = Field(default=1, ge=1, le=1000, description="which plan of the stored answer (1 = first)")
    # the launch formats' registry (launch/writers.py)
    format: Literal[FORMATS] | None = Field(  # type: ignore[valid-type]
        default=None,
        description="the launch file format to write (null: the plan's engine's own); another engine's format "
        "re-predicts the layout for that engine (`note` says so) or is refused naming both engines",
    )
    steps: int = Field(default=20, ge=1, le=100000, description="training steps the launched job runs")
    warmup: int = Field(default=3, ge=0, le=1000, description="untimed steps before the timed ones")
    image: ImageName = Field(
        default="berth-executor:latest", description="container image of the executor (container formats)"
    )
    train: dict[str, Annotated[str, Field(max_length=255)] | float | list[float]] | None = Field(
        default=None,
        max_length=32,
        description="engine formats: the training run (train_steps, lr, min_lr, warmup_steps, decay, weight_decay, "
        "betas, adam_eps, grad_clip, checkpoint_interval, checkpoint_dir, data_split; defaults in docs/engines.md)",
    )


class LaunchResponse(BaseModel):
    plan_id: str = Field(description="the stored answer's id")
    format: str = Field(description="the launch file format written")
    files: dict[str, str] = Field(description="file name -> file contents")
    note: str | None = Field(default=None, description="how the plan was re-predicted for the format's engine")


class ValidationRequest(Body):
    plan_id: PlanId = Field(description="id of a stored plan or compare answer")
    pick: int = Field(default=1, ge=1, le=1000, description="which plan of the stored answer (1 = first)")
    steps: int = Field(default=5, ge=1, le=200, description="timed steps")
    warmup: int = Field(default=2, ge=0, le=50, description="untimed steps before the timed ones")
    proxy: Literal["rank-slice"] | None = Field(
        default=None,
        description="'rank-slice': run one rank's share of one stage in one process instead of the whole plan",
    )
    layers: int | None = Field(
        default=None, ge=1, le=4096, description="rank-slice only: decoder layers to run (default: one stage's)"
    )


class ValidationJob(BaseModel):
    id: str = Field(description="the job's id")
    created: str = Field(description="when the job was queued (ISO 8601, UTC)")
    plan_id: str = Field(description="the stored answer validated")
    status: Literal["queued", "running", "done", "failed"] = Field(description="queued, running, done or failed")
    message: str | None = Field(default=None, description="why the job failed (null otherwise)")
    report: ValidationReport | None = Field(
        default=None,
        description="predicted vs measured; `report.breakdown` puts the measured step terms beside "
        "the predicted time_breakdown_s and memory_breakdown_bytes and names the term with the largest error "
        "(None in reports made before berth measured terms, which still load)",
    )


class ModelInfo(BaseModel):
    name: str = Field(description="the preset's name")
    num_params: int = Field(description="parameters in total (all experts counted)")
    num_layers: int = Field(description="decoder layers")
    hidden_size: int = Field(description="model width h")
    num_attention_heads: int = Field(description="query heads per attention layer")
    num_kv_heads: int = Field(description="key/value heads per attention layer")
    ffn_hidden_size: int = Field(description="inner width of a dense layer's MLP")
    vocab_size: int = Field(description="tokens in the vocabulary")
    num_experts: int = Field(default=0, description="routed experts per MoE layer; 0 for a dense model")
    experts_per_token: int = Field(
        default=0, description="routed experts a token goes through (top-k); 0 for a dense model"
    )
    active_params: int = Field(default=0, description="parameters a token goes through (num_params when dense)")


class ClusterInfo(BaseModel):
    name: str = Field(description="the preset's name (what a request's cluster.preset names)")
    display_name: str = Field(description="human-readable name")
    device: str = Field(description="the device profile's name")
    gpus_per_node: int = Field(description="GPUs in each node")
    intra_node: LinkProfile = Field(description="the link between GPUs inside a node")
    inter_node: LinkProfile = Field(description="the link between nodes")


class ProfileInfo(BaseModel):
    name: str = Field(description="the profile's name")
    display_name: str = Field(description="human-readable name")
    kind: str = Field(description="'gpu' or 'cpu'")
    memory_bytes: float = Field(description="device memory, bytes")
    peak_flops_per_s: dict[str, float] = Field(description="dense peak FLOP/s per precision")


class Health(BaseModel):
    status: Literal["ok"] = Field(description="'ok' when the service answers")
    version: str = Field(description="the berth version serving")
    validation_enabled: bool = Field(
        description="the server accepts POST /v1/validations (BERTH_VALIDATION_ENABLED, with an API key)"
    )
