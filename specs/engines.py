"""The engine table: each training engine berth plans for, described once.

An engine decides three things a layout's prediction depends on, and the files that start it:

- what it can run: its rules (`EngineInfo.rules`), vectorized predicates over Candidates evaluated with the layout
  rules of specs/validity.py (the search keeps only what the engine runs, a fixed layout it cannot run is refused
  naming the engine: an error for `--fix`, a compared layout's infeasible_reason; `berth launch` says the same);
- its memory recipe (`recipe`, read by cost_models/memory.py): "pytorch" (fp32 parameters under
  autocast, or FSDP2 bf16 mixed precision where the layout shards; DTensor sequence parallelism
  keeps the gathered inputs; torch.distributed.pipelining receive buffers) or "megatron" (16-bit
  parameters, a persistent fp32 gradient buffer, fp32 main parameters and Adam state sharded by the
  distributed optimizer; sequence parallelism keeps the inputs sharded);
- its compute stack (`compute_stacks`: the DeviceProfile.frameworks entry pricing a layer's non-GEMM work);
- its launch formats (`launch_formats`: launch/writers.py), and the version all of this was read from.

What no table can know (this team's kernels, its network's achieved bandwidth, its allocator) an
engine learns from measured runs: `berth calibrate --runs` fits EngineTuning (planner/engine_fit.py).
The 'generic' engine is the starting point for a stack berth has no entry for: the textbook
mixed-precision recipe (Rajbhandari et al. 2020, Sec. 3.1: 16-bit weights, fp32 master weights and
Adam states, ZeRO sharding), eager PyTorch kernels, and every layout berth can model allowed.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from berth.specs import stages, tree
from berth.specs.candidates import (
    RECOMPUTE_SELECTIVE,
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
    Candidates,
)
from berth.specs.errors import BerthError
from berth.specs.hardware import DeviceProfile
from berth.specs.tree import AXIS_ORDER_CHOICES, ENGINE_CHOICES, Engine, Layout, ModelSpec, TrainingSpec

MEMORY_PYTORCH = "pytorch"
MEMORY_MEGATRON = "megatron"
TORCH_DDP_BUCKET_BYTES = 25 * 2**20  # torch.nn.parallel.DistributedDataParallel(bucket_cap_mb=25), the default


@dataclass(frozen=True)
class EngineRule:
    """One thing an engine cannot run: a vectorized predicate (True where a candidate breaks it) and
    the reason in one layout's numbers."""

    name: str
    reads: tuple[str, ...]  # the layout fields it reads (a refusal blames these)
    broken: Callable[[Candidates, ModelSpec, TrainingSpec], np.ndarray]
    detail: Callable[[Layout, ModelSpec, TrainingSpec], str]
    text: str  # the rule in general (the search's rejection counts, a plan's infeasible_reason)


@dataclass(frozen=True)
class EngineInfo:
    name: Engine
    title: str
    version: str  # the version whose code this entry was read from, and that launch files target
    recipe: str  # MEMORY_PYTORCH or MEMORY_MEGATRON (cost_models/memory.py)
    compute_stacks: tuple[str, ...]  # DeviceProfile.frameworks entries, the first the device has wins
    launch_formats: tuple[str, ...]  # launch/writers.py formats that start it, the default first (none: no files)
    rules: tuple[EngineRule, ...]
    source: str  # where the rules and recipe were read
    # the share of ZeRO-1/2's parameter all-gather left exposed after the optimizer step (0: behind the next
    # forward; EngineTuning.param_gather_exposed overrides it)
    param_gather_exposed: float = 0.0
    # the share of ZeRO-1/2's gradient reduction run after the backward as a whole-gradient all-reduce (0: reduce-
    # scattered behind the last micro-batch's backward; EngineTuning.grad_reduce_exposed overrides it)
    grad_reduce_exposed: float = 0.0
    # the data-parallel gradient reduction's buckets, one collective (and its latency) each: max(bucket_params,
    # bucket_params_per_dp x dp) parameters of gradient per bucket, or bucket_bytes of it; (0, 0, 0): one collective
    # per stage (FSDP's per-layer collectives are costed apart, cost_models/step.py)
    bucket_params: float = 0.0
    bucket_params_per_dp: float = 0.0
    bucket_bytes: float = 0.0
    # the buckets apply only where the engine wraps the model in DDP (tp = pp = 1, ZeRO <= 1: the executor,
    # executor/parallel.py); elsewhere one collective per stage
    buckets_ddp_only: bool = False
    # how the engine splits the decoder layers over pipeline ranks (specs/stages.py: berth's rule or nanotron's)
    split: str = stages.SPLIT_ENDS_LIGHTER
    # the engine wraps every stage in torch DDP at ZeRO-0 with dp > 1, whose 16-bit buckets persist beside its own
    # fp32 gradient buffer (nanotron; cost_models/memory.py gradient_buckets)
    ddp_beside_grad_buffer: bool = False
    # whole-stage parameter copies that ZeRO-1's post-step all-gather allocates in one block each, reserved
    # beyond what the largest segment the activations left cached holds (nanotron: torch NCCL's stacked output;
    # cost_models/memory.py gather_block_bytes). 0: the engine gathers into its parameters in place
    zero1_gather_blocks: float = 0.0
    # parameter tensors per decoder layer whose dp slices ZeRO-1's gather copies back one eager op each, dp x tensors
    # launches after the collective (nanotron distributed.py all_gather_coalesced; cost_models/step.py gather_copies_s)
    zero1_gather_tensors_per_layer: int = 0
    # the engine's own loss, nanotron's vocabulary-parallel cross-entropy on an fp32 cast of the logits, which turns
    # its saved softmax into the gradient in place (cost_models/memory.py logits_bytes); False: the recipe's branches
    sharded_loss: bool = False
    # a decoder layer saves more than Megatron's recipe (cost_models/memory.py layer_activation_bytes): SwiGLU run
    # unfused keeps act(gate) too; with as many kv heads as heads, the permuted q/k/v block stays alive behind q
    # while k and v are copied for the rotary kernel (nanotron models/llama.py)
    glu_unfused: bool = False
    mha_qkv_kept: bool = False
    # full-width [tokens, hidden] blocks per decoder layer (and one for the embedding) that the forward hands to a
    # sequence-parallel reduce-scatter and then frees: torch's NCCL process group records each on its stream, so the
    # caching allocator cannot reuse it until the GPU has run the collective, and where nothing syncs the host between
    # the forward and the backward (pp = 1) the host runs ahead and they are all reserved at once at the loss
    # (nanotron: RowLinear's and the embedding's reduce_scatter_tensor; cost_models/memory.py unsynced_collective_bytes)
    unsynced_rs_blocks: float = 0.0
    sp_gather_buffers: float = 0.0  # persistent [tokens, hidden] sequence-parallel gather buffers (memory.py)
    # FP8 (TrainingSpec.fp8): the recipes the engine runs (none: it refuses FP8), whose kernels cast ("te": Transformer
    # Engine, casts fused into its norms and cast-transpose kernels, weights cast once per step; "torchao": dynamic
    # casts of every operand on every call, cost_models/compute.py fp8_cast_bytes), the bytes per element a linear layer
    # saves its input in for the backward (0: as in bf16) and the persistent FP8 weight copy per linear parameter
    # (doubled by its transpose where the device needs one, DeviceProfile.fp8_transposed_copies; cost_models/memory.py)
    fp8_recipes: tuple[str, ...] = ()
    fp8_kernels: str = ""
    fp8_saved_input_bytes: float = 0.0
    fp8_weight_cache_bytes: float = 0.0
    # from this ZeRO stage on, the engine keeps the linear weights themselves in FP8 (Megatron's --fp8-param-gather,
    # which needs the distributed optimizer: the FP8 weight and its transpose replace the 16-bit one, no cache beside
    # it, and the post-step all-gather moves 1 byte per parameter); 0: never
    fp8_params_from_zero: int = 0
    # bytes per element of the sequence-parallel all-gathers of a linear's input under FP8 (0: the compute precision's):
    # Transformer Engine casts the sequence shard and gathers it in FP8, forward and again for the backward's wgrad
    # (module/linear.py, tensor/float8_tensor.py: its Float8 quantizer gathers row-wise FP8); reduce-scatters: 16-bit
    fp8_gather_bytes: float = 0.0
    # under FP8 the engine's recipe accumulates and reduces the gradients in bf16, not fp32: NeMo's and
    # Megatron-Bridge's FP8 performance recipes (NeMo scripts/performance/helpers.py set_precision_configs:
    # grad_reduce_in_fp32 = False), which berth's Megatron files follow (--grad-reduce-in-bf16)
    fp8_grads_bf16: bool = False
    # the routed experts' GEMMs run in FP8 too (Megatron: Transformer Engine's grouped linears, megatron-core
    # transformer_config.py needs TE >= 1.7 for MoE FP8); False: torchao's Float8Linear converts nn.Linear only
    fp8_experts: bool = False
    # ZeRO-1 under DDP (tp = pp = 1) hands out whole tensors (torch's ZeroRedundancyOptimizer: the executor;
    # cost_models/memory.py whole_tensor_share); False: even slices (flat buffers, FSDP2)
    zero1_whole_tensors: bool = False
    # fitted parameters whose mechanism the engine's code has, offered a fit's budget first (engine_fit.identifiable)
    fit_first: tuple[str, ...] = ()
    memory_headroom: float = tree.DEFAULT_MEMORY_HEADROOM  # the search's default; wider where the recipe misses more

    def headroom(self, asked: float | None) -> float:
        """The search's memory headroom: the one asked for, else the engine's."""
        return self.memory_headroom if asked is None else asked

    @property
    def label(self) -> str:
        return f"{self.name} ({self.version})"


def _n(c: Candidates) -> np.ndarray:
    return np.zeros(len(c.tp), dtype=bool)


def _order(*names: str) -> list[int]:
    return [AXIS_ORDER_CHOICES.index(n) for n in names]


TEXTS = {
    "too_few_microbatches": "torch.distributed.pipelining's 1F1B schedules need num_microbatches >= pp",
    "microbatches_not_multiple_of_pp": "interleaved_1f1b needs num_microbatches divisible by pp",
    "megatron_no_gpipe": "Megatron-LM runs 1F1B or interleaved 1F1B, no GPipe",
    "megatron_axis_order": "Megatron-LM orders axes tp-dp-pp or tp-pp-dp",
    "megatron_fsdp_partial_shard": "Megatron FSDP (ZeRO-2/3) shards over all of dp",
    "megatron_moe_needs_sp": "Megatron-LM needs sequence parallelism for mixture of experts with tp",
    "torchtitan_model": "torchtitan's Llama 3 builder: SwiGLU, RMSNorm, no qkv bias, no dropout, no experts",
    "torchtitan_zero1": "torchtitan's FSDP2 has no ZeRO-1, nor ZeRO-0 with cp (use 2 or 3)",
    "torchtitan_axis_order": "torchtitan's mesh is pp, dp, tp (tp-dp-pp)",
    "torchtitan_precision": "torchtitan trains in bf16 or fp32 with fused attention",
    "deepspeed_cp": "DeepSpeed has no ring-attention context parallelism",
    "deepspeed_moe_expert_tp": "DeepSpeed's AutoEP runs whole experts per rank: expert_tp 1 only",
    "deepspeed_moe_tp_without_ep": "DeepSpeed's AutoEP folds tensor parallelism into ep: tp > 1 needs ep > 1",
    "megatron_rope_scaling": "Megatron-LM's Llama 3 rope scaling fixes all but the factor",
    "torchtitan_tied_pipeline": "torchtitan does not tie embeddings with pp > 1",
    "deepspeed_uneven_stages": "DeepSpeed's PipelineModule takes no per-stage layer counts (even stages only)",
    "deepspeed_sequence_parallel": "DeepSpeed has no Megatron-style sequence parallelism",
    "deepspeed_schedule": "DeepSpeed's pipeline engine runs 1F1B only",
    "deepspeed_selective_recompute": "DeepSpeed checkpoints whole layers (no selective recompute)",
    "deepspeed_axis_order": "DeepSpeed's topology is pipe-data-model (tp-dp-pp)",
    "deepspeed_pipeline_zero": "DeepSpeed's pipeline engine refuses ZeRO-2/3",
    "deepspeed_pipeline_tp": "DeepSpeed's pipeline with tp needs a Megatron-style mpu",
    "deepspeed_partial_shard": "DeepSpeed 0.19 shards over all dp ranks (shard = dp)",
    "nanotron_model": "nanotron's LlamaForTraining: SwiGLU, RMSNorm, no qkv bias, dropout or experts",
    "nanotron_zero": "nanotron shards optimizer state only (ZeRO 0 or 1, over all of dp)",
    "nanotron_cp": "nanotron (e24d2483) has no context parallelism",
    "nanotron_schedule": "nanotron runs all-forward-all-backward (gpipe) or 1F1B, not interleaved",
    "nanotron_1f1b_microbatches": "nanotron's 1F1B needs num_microbatches >= pp - 1",
    "nanotron_selective_recompute": "nanotron recomputes whole layers (recompute_layer) only",
    "nanotron_axis_order": "nanotron's ranks are (ep, pp, dp, tp): tp-dp-pp",
}


def _not_tp_dp_pp(c: Candidates, m: ModelSpec, t: TrainingSpec) -> np.ndarray:
    """The axis order is not tp-dp-pp (tp innermost, pp outermost), the only one torchtitan, DeepSpeed, nanotron run."""
    return ~np.isin(c.axis_order, _order("tp-dp-pp"))


def _context_parallel(c: Candidates, m: ModelSpec, t: TrainingSpec) -> np.ndarray:
    """Context parallelism (cp > 1), which DeepSpeed and nanotron do not have."""
    return c.cp > 1


def _selective(c: Candidates, m: ModelSpec, t: TrainingSpec) -> np.ndarray:
    """Selective recomputation (an engine that checkpoints whole layers only refuses it)."""
    return c.recompute == RECOMPUTE_SELECTIVE


def _rule(name: str, reads: tuple[str, ...], broken, detail) -> EngineRule:
    return EngineRule(name, reads, broken, detail, TEXTS[name])


# torch.distributed.pipelining's Schedule1F1B / ScheduleInterleaved1F1B refuse fewer micro-batches than
# stages (torch/distributed/pipelining/schedules.py, _PipelineSchedule._validate: "n_microbatches must be
# >= pp"); Megatron-LM, DeepSpeed and nanotron run them (their warm-up is min(pp - rank - 1, m) micro-batches).
TORCH_PIPELINE_MICROBATCHES = _rule(
    "too_few_microbatches",
    ("num_microbatches", "pp", "schedule"),
    lambda c, m, t: (c.schedule != SCHEDULE_GPIPE) & (c.pp > 1) & (c.num_microbatches < c.pp),
    lambda x, m, t: (
        f"torch.distributed.pipelining's 1F1B schedules need num_microbatches >= pp; {x.num_microbatches} < {x.pp}"
    ),
)
# Megatron-LM's interleaved schedule (megatron/core/pipeline_parallel/schedules.py,
# forward_backward_pipelining_with_interleaving) and torch's interleaved schedule take micro-batches in groups of pp
INTERLEAVED_GROUPS = _rule(
    "microbatches_not_multiple_of_pp",
    ("num_microbatches", "pp", "schedule"),
    lambda c, m, t: (c.schedule == SCHEDULE_INTERLEAVED) & (c.num_microbatches % c.pp != 0),
    lambda x, m, t: f"interleaved_1f1b needs num_microbatches divisible by pp; {x.num_microbatches} by {x.pp}",
)

# Megatron-LM's Llama 3 rope scaling (megatron/core/models/common/embeddings/rope_utils.py apply_rope_scaling)
# takes only the factor (--rope-scaling-factor); the rest is fixed
MEGATRON_ROPE_SCALING = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
MEGATRON_VOCAB_DIVISOR = 128  # it pads the vocabulary to a multiple of this x tp (--make-vocab-size-divisible-by)


def _megatron_rope(m: ModelSpec) -> bool:
    sc = m.rope_scaling
    return sc is not None and {k: getattr(sc, k) for k in MEGATRON_ROPE_SCALING} != MEGATRON_ROPE_SCALING


MEGATRON_RULES = (
    INTERLEAVED_GROUPS,
    _rule(
        "megatron_no_gpipe",
        ("schedule", "pp"),
        lambda c, m, t: (c.schedule == SCHEDULE_GPIPE) & (c.pp > 1),
        lambda x, m, t: "schedule gpipe: Megatron runs 1F1B or interleaved 1F1B",
    ),
    _rule(
        "megatron_axis_order",
        ("axis_order",),
        lambda c, m, t: ~np.isin(c.axis_order, _order("tp-dp-pp", "tp-pp-dp")),
        lambda x, m, t: f"axis_order {x.axis_order}: Megatron orders tp-dp-pp or (--use-tp-pp-dp-mapping) tp-pp-dp",
    ),
    _rule(
        "megatron_fsdp_partial_shard",
        ("zero_stage", "shard", "dp"),
        lambda c, m, t: (c.zero_stage >= 2) & (c.shard < c.dp),
        lambda x, m, t: (
            f"zero_stage {x.zero_stage} with shard {x.shard} < dp {x.dp}: Megatron FSDP's hybrid mode "
            "shards over its own outer data-parallel groups, which berth does not map (use shard = dp)"
        ),
    ),
    _rule(
        "megatron_moe_needs_sp",
        ("tp", "sequence_parallel"),
        lambda c, m, t: np.full(len(c.tp), m.is_moe) & (c.tp > 1) & (c.sequence_parallel == 0),
        lambda x, m, t: (
            f"tp {x.tp} with mixture of experts: Megatron needs sequence parallelism with tp "
            "(megatron/training/arguments.py validate_args)"
        ),
    ),
)

_TT_SHARDS = (" with cp {cp}: FSDP2 shards over dp_shard x cp (use 2 or 3)", ": FSDP2 shards gradients too (use 2)")
TORCHTITAN_RULES = (
    TORCH_PIPELINE_MICROBATCHES,
    INTERLEAVED_GROUPS,
    _rule(
        "torchtitan_model",
        ("tp",),
        lambda c, m, t: np.full(
            len(c.tp), m.is_moe or m.mlp != "swiglu" or m.norm != "rmsnorm" or m.qkv_bias or m.dropout
        ),
        lambda x, m, t: (
            f"mixture of experts ({m.num_experts} experts, ep {x.ep}): berth writes torchtitan's Llama 3 builder, "
            "which has no experts; torchtitan's MoE models (deepseek_v3 with MLA, qwen3) and their "
            "parallelism.expert_parallel_degree are not mapped"
            if m.is_moe
            else f"model {m.name} ({m.mlp}, {m.norm}, qkv bias {m.qkv_bias}, dropout {m.dropout}): torchtitan's "
            "Llama 3 builder is SwiGLU with RMSNorm, no qkv biases (make_gqa_config), no dropout"
        ),
    ),
    _rule(
        "torchtitan_tied_pipeline",
        ("pp",),
        lambda c, m, t: np.full(len(c.tp), m.tied_embeddings) & (c.pp > 1),
        lambda x, m, t: (
            "tied embeddings with pp > 1: torchtitan raises 'Weight tying is not supported with Pipeline Parallel'"
        ),
    ),
    _rule(  # and ZeRO-0 with cp: parallelize.py applies fully_shard over dp_shard x cp whatever the stage asks
        "torchtitan_zero1",
        ("zero_stage", "cp"),
        lambda c, m, t: (c.zero_stage == 1) | ((c.zero_stage == 0) & (c.cp > 1)),
        lambda x, m, t: f"zero_stage {x.zero_stage}" + _TT_SHARDS[x.zero_stage].format(cp=x.cp),
    ),
    _rule(
        "torchtitan_axis_order",
        ("axis_order",),
        _not_tp_dp_pp,
        lambda x, m, t: f"axis_order {x.axis_order}: torchtitan's mesh is pp, dp, tp (tp-dp-pp)",
    ),
    _rule(
        "torchtitan_precision",
        ("tp",),
        lambda c, m, t: np.full(len(c.tp), t.precision == "fp16" or not t.flash_attention),
        lambda x, m, t: (
            "precision fp16: torchtitan trains in bfloat16 or float32"
            if t.precision == "fp16"
            else "flash_attention false: torchtitan 0.3 language models attend with FlexAttention or varlen only "
            "(sdpa removed: torchtitan/models/common/config_utils.py:97)"
        ),
    ),
)


def _uneven(c: Candidates, m: ModelSpec) -> np.ndarray:
    first, middle, last, _ = stages.stage_split(m.num_layers, c.pp, c.virtual_stages)
    return (c.pp > 1) & ((np.asarray(first) != np.asarray(middle)) | (np.asarray(last) != np.asarray(middle)))


def _layers_text(num_layers: int, pp: int) -> str:
    """ ": 11, 11, 10" (the planned stages' layers), or nothing where the split leaves a stage empty."""
    if not bool(np.asarray(stages.split(num_layers, pp, 1)[3])):
        return ""
    return ": " + ", ".join(map(str, stages.stage_layers(num_layers, pp)))


DEEPSPEED_RULES = (
    _rule(
        "deepspeed_cp",
        ("cp",),
        _context_parallel,
        lambda x, m, t: f"cp {x.cp}: DeepSpeed has no ring-attention context parallelism (Ulysses splits heads)",
    ),
    # AutoEP (the config's expert_parallel section; deepspeed/module_inject/auto_ep_folding.py
    # validate_folding_global) runs experts with ep over the stage, no expert tensor parallelism
    _rule(
        "deepspeed_moe_expert_tp",
        ("expert_tp",),
        lambda c, m, t: np.full(len(c.tp), m.is_moe) & (c.expert_tp != 1),
        lambda x, m, t: (
            f"expert_tp {x.etp}: AutoEP (expert_parallel) reserves expert_tensor_parallel_size and "
            "accepts only 1 (auto_ep_folding.validate_folding_global); use expert_tp 1"
        ),
    ),
    _rule(
        "deepspeed_moe_tp_without_ep",
        ("tp", "ep"),
        lambda c, m, t: np.full(len(c.tp), m.is_moe) & (c.tp > 1) & (c.ep == 1),
        lambda x, m, t: "tp > 1 with ep 1: AutoEP's tensor-parallel folding requires autoep_size > 1",
    ),
    _rule(
        "deepspeed_uneven_stages",
        ("pp",),
        lambda c, m, t: _uneven(c, m),
        lambda x, m, t: (
            f"uneven pipeline stages ({m.num_layers} layers on pp {x.pp}{_layers_text(m.num_layers, x.pp)}): "
            "DeepSpeed's PipelineModule takes no "
            "per-stage layer counts (partition_method 'uniform' puts the remainder on the first stages, "
            "'parameters' and 'type:' balance weights), so it would not build the planned stages"
        ),
    ),
    _rule(
        "deepspeed_sequence_parallel",
        ("sequence_parallel",),
        lambda c, m, t: c.sequence_parallel > 0,
        lambda x, m, t: "sequence_parallel: DeepSpeed has no Megatron-style sequence parallelism",
    ),
    _rule(
        "deepspeed_schedule",
        ("schedule", "pp"),
        lambda c, m, t: (c.pp > 1) & (c.schedule != SCHEDULE_1F1B),
        lambda x, m, t: f"schedule {x.schedule}: DeepSpeed's pipeline engine runs 1F1B only",
    ),
    _rule(
        "deepspeed_selective_recompute",
        ("recompute",),
        _selective,
        lambda x, m, t: "recompute selective: DeepSpeed checkpoints whole layers",
    ),
    _rule(
        "deepspeed_axis_order",
        ("axis_order",),
        _not_tp_dp_pp,
        lambda x, m, t: f"axis_order {x.axis_order}: DeepSpeed's topology is pipe-data-model (tp-dp-pp)",
    ),
    _rule(
        "deepspeed_pipeline_zero",
        ("pp", "zero_stage"),
        lambda c, m, t: (c.pp > 1) & (c.zero_stage >= 2),
        lambda x, m, t: (
            f"zero_stage {x.zero_stage} with pp > 1: DeepSpeed's pipeline engine asserts ZeRO-2 and "
            "ZeRO-3 are incompatible with pipeline parallelism"
        ),
    ),
    _rule(
        "deepspeed_pipeline_tp",
        ("pp", "tp"),
        lambda c, m, t: (c.pp > 1) & (c.tp > 1),
        lambda x, m, t: "tp > 1 with pp > 1: DeepSpeed's 3D parallelism needs a Megatron-style mpu",
    ),
    _rule(
        "deepspeed_partial_shard",
        ("shard", "dp", "zero_stage"),
        lambda c, m, t: (c.zero_stage > 0) & (c.shard < c.dp),
        lambda x, m, t: (
            f"shard {x.shard} < dp {x.dp}: DeepSpeed 0.19 removed MiCS (zero_optimization.mics_shard_size), "
            "its sharding over sub-groups; hpZ (zero_hpz_partition_size) only adds a secondary weight copy and still "
            "shards gradients and optimizer state over all dp ranks"
        ),
    ),
)

# nanotron at e24d2483 (src/nanotron/...): config/parallelism_config.py ParallelismArgs (dp, pp, tp, pp_engine
# "afab" | "1f1b", tp_mode "all_reduce" | "reduce_scatter" = sequence parallelism, recompute_layer: whole layers),
# config/config.py OptimizerArgs.zero_stage with optim/zero.py (ZeRO-1 over the dp group; no ZeRO-2/3),
# parallel/context.py (ranks reshaped (ep, pp, dp, tp): tp innermost), parallel/pipeline_parallel/engine.py
# (OneForwardOneBackwardPipelineEngine asserts nb_microbatches >= pp - 1), models/llama.py (the only dense model).
NANOTRON_RULES = (
    _rule(
        "nanotron_model",
        ("tp",),
        lambda c, m, t: np.full(
            len(c.tp), any((m.is_moe, m.mlp != "swiglu", m.norm != "rmsnorm", m.qkv_bias, m.dropout))
        ),
        lambda x, m, t: (
            f"model {m.name} ({m.mlp}, {m.norm}, qkv bias {m.qkv_bias}, dropout {m.dropout}, experts {m.num_experts}): "
            "nanotron's LlamaForTraining is SwiGLU, RMSNorm, no qkv biases, no dropout; its MoE models are examples"
        ),
    ),
    _rule(
        "nanotron_zero",
        ("zero_stage", "shard", "dp"),
        lambda c, m, t: (c.zero_stage >= 2) | ((c.zero_stage == 1) & (c.shard < c.dp)),
        lambda x, m, t: (
            f"zero_stage {x.zero_stage}, shard {x.shard} of dp {x.dp}: nanotron's ZeRO (optim/zero.py) shards the "
            "optimizer state only, over the whole dp group (a zero_stage above 1 runs as ZeRO-1, so it is refused "
            "rather than predicted as ZeRO-2/3)"
        ),
    ),
    _rule(
        "nanotron_cp",
        ("cp",),
        _context_parallel,
        lambda x, m, t: f"cp {x.cp}: nanotron's ParallelismArgs has dp, pp, tp and expert_parallel_size only",
    ),
    _rule(
        "nanotron_schedule",
        ("schedule", "virtual_stages"),
        lambda c, m, t: (c.schedule == SCHEDULE_INTERLEAVED) | (c.virtual_stages > 1),
        lambda x, m, t: (
            f"schedule {x.schedule}, virtual_stages {x.virtual_stages}: nanotron's pp_engine is 'afab' or '1f1b', "
            "one chunk per rank"
        ),
    ),
    _rule(
        "nanotron_1f1b_microbatches",
        ("num_microbatches", "pp", "schedule"),
        lambda c, m, t: (c.schedule == SCHEDULE_1F1B) & (c.pp > 1) & (c.num_microbatches < c.pp - 1),
        lambda x, m, t: (
            f"num_microbatches {x.num_microbatches} < pp - 1 = {x.pp - 1}: nanotron's "
            "OneForwardOneBackwardPipelineEngine asserts nb_microbatches >= pp - 1"
        ),
    ),
    _rule(
        "nanotron_selective_recompute",
        ("recompute",),
        _selective,
        lambda x, m, t: "recompute selective: nanotron's recompute_layer checkpoints whole decoder layers",
    ),
    _rule(
        "nanotron_axis_order",
        ("axis_order",),
        _not_tp_dp_pp,
        lambda x, m, t: f"axis_order {x.axis_order}: nanotron's ranks are (ep, pp, dp, tp), i.e. tp-dp-pp",
    ),
)

ENGINES: dict[str, EngineInfo] = {
    e.name: e
    for e in (
        EngineInfo(
            "executor",
            "berth's bundled torch.distributed executor",
            "berth executor (torch 2.13)",
            MEMORY_PYTORCH,
            ("pytorch",),
            ("torchrun", "slurm", "kubernetes"),
            (TORCH_PIPELINE_MICROBATCHES, INTERLEAVED_GROUPS),
            "executor/ (its own rules: specs/validity.py, applies=EXECUTOR); torch DDP's default buckets "
            "(torch/nn/parallel/distributed.py bucket_cap_mb=25)",
            bucket_bytes=TORCH_DDP_BUCKET_BYTES,
            buckets_ddp_only=True,
            zero1_whole_tensors=True,
        ),
        EngineInfo(
            "torchtitan",
            "torchtitan",
            "torchtitan 0.3.0",
            MEMORY_PYTORCH,
            ("torchtitan", "pytorch"),
            ("torchtitan",),
            TORCHTITAN_RULES,
            "torchtitan 0.3.0: torchtitan/distributed/parallel_dims.py, torchtitan/models/llama3/infra/parallelize.py; "
            "FP8: components/quantization/float8.py Float8LinearConverter (recipe_name rowwise | rowwise_with_gw_hp, "
            "torchao's Float8Linear: saves the bf16 input and weight, casts both on every call; no FP8 all-gather)",
            fp8_recipes=("rowwise", "rowwise_with_gw_hp"),
            fp8_kernels="torchao",
        ),
        EngineInfo(
            "megatron",
            "Megatron-LM (NeMo, Megatron-Bridge)",
            "Megatron-LM main @ d98e8a6 (2026-08-22, megatron-core 0.20.0)",
            MEMORY_MEGATRON,
            ("megatron", "pytorch"),
            ("megatron",),
            MEGATRON_RULES,
            "Megatron-LM: megatron/training/arguments.py validate_args, megatron/core/pipeline_parallel/schedules.py, "
            "docs/source/api-guide/dist_optimizer.md, megatron/core/distributed/distributed_data_parallel.py "
            "(bucket_size = max(40000000, 1000000 * dp) parameters)",
            bucket_params=40e6,
            bucket_params_per_dp=1e6,
            # --fp8-recipe delayed | tensorwise (megatron/core/fp8_utils.py get_fp8_recipe: TE DelayedScaling,
            # Float8CurrentScaling) with Transformer Engine's linears (qkv, proj, fc1, fc2; the output layer is
            # Megatron's own ColumnParallelLinear, bf16); TE saves each linear's input as one FP8 copy (module/linear.py
            # update_usage: the transpose kept on Hopper) and keeps a persistent FP8 weight workspace (module/base.py
            # _fp8_workspaces, refreshed when Megatron sets is_first_microbatch), unless the weights are FP8 parameters
            # (--fp8-param-gather with the distributed optimizer, megatron/core/fp8_utils.py quantize_param_shard)
            fp8_recipes=("delayed", "tensorwise"),
            fp8_kernels="te",
            fp8_saved_input_bytes=1.0,
            fp8_weight_cache_bytes=1.0,
            fp8_params_from_zero=1,
            fp8_gather_bytes=1.0,
            fp8_grads_bf16=True,
            fp8_experts=True,
        ),
        EngineInfo(
            "deepspeed",
            "DeepSpeed",
            "DeepSpeed 0.19.8",
            MEMORY_MEGATRON,
            ("torchtitan", "pytorch"),
            ("deepspeed",),
            DEEPSPEED_RULES,
            "DeepSpeed 0.19.8: deepspeed/runtime/pipe/engine.py, deepspeed/runtime/bf16_optimizer.py "
            "(16-bit weights, fp32 gradient accumulation, fp32 master and Adam state over dp); "
            "deepspeed/runtime/zero/stage_1_and_2.py step(): the updated partitions are all-gathered after the step; "
            "reduce_bucket_size 5e8 elements (deepspeed/runtime/zero/config.py)",
            param_gather_exposed=1.0,
            bucket_params=5e8,
        ),
        EngineInfo(
            "llmfoundry",
            "MosaicML llm-foundry (Composer, FSDP)",
            "llm-foundry 0.x (2023-24 benchmark tables)",
            MEMORY_PYTORCH,
            ("llmfoundry", "pytorch"),
            (),
            (),
            "mosaicml/llm-foundry scripts/train/benchmarking (FSDP FULL_SHARD, fused cross-entropy, triton attention)",
        ),
        EngineInfo(
            "nanotron",
            "nanotron (Hugging Face)",
            "nanotron e24d2483 (2025-02-19)",
            MEMORY_MEGATRON,
            ("torchtitan", "pytorch"),
            ("nanotron",),
            NANOTRON_RULES,
            "nanotron e24d2483: models/base.py build_model (the compute-balanced pipeline split, specs/stages.py), "
            "helpers.py and optim/gradient_accumulator.py (16-bit weights, a full fp32 gradient buffer, fp32 master "
            "and Adam state sharded by ZeRO-1), trainer.py (ZeRO-1: one all-reduce of the whole fp32 gradients after "
            "the pipeline, then the updated shards all-gathered through distributed.py all_gather_coalesced, whose "
            "equal-sized outputs torch stacks into one whole-stage block, copied back a (rank, tensor) slice an op; "
            "ZeRO-0: DDP with 25 MB buckets, 16-bit, "
            "kept beside the fp32 buffer), models/llama.py (SwiGLU unfused; with as many kv heads as heads the "
            "permuted q/k/v block kept behind q) and parallel/tensor_parallel/functional.py (its vocabulary-parallel "
            "loss on an fp32 cast of the logits); launch: config/config.py (get_config_from_file), run_train.py",
            param_gather_exposed=1.0,
            grad_reduce_exposed=1.0,
            bucket_bytes=TORCH_DDP_BUCKET_BYTES,
            split=stages.SPLIT_COMPUTE_BALANCED,
            ddp_beside_grad_buffer=True,
            zero1_gather_blocks=1.0,
            zero1_gather_tensors_per_layer=6,  # models/llama.py: 2 RMSNorms, qkv_proj, o_proj, gate_up_proj, down_proj
            sharded_loss=True,
            glu_unfused=True,
            mha_qkv_kept=True,
            unsynced_rs_blocks=2.0,
            sp_gather_buffers=2.0,  # functional.py MemoryBuffer "allgather", "allgather2" (async, as the sweep ran)
            fit_first=("pipeline_latency_scale",),  # p2p.py _send_meta syncs the host at every pipeline send
            memory_headroom=0.10,  # the recipe's miss on the sweep, 7.4 % at the median (docs/accuracy.md)
        ),
        EngineInfo(
            "generic",
            "a PyTorch stack to calibrate (textbook mixed precision)",
            "generic (no version: calibrate it with berth calibrate --runs)",
            MEMORY_MEGATRON,
            ("torchtitan", "pytorch"),
            (),
            (INTERLEAVED_GROUPS,),
            "Rajbhandari et al. 2020 (ZeRO), Sec. 3.1 and 5 (the updated partitions all-gathered after the step); "
            "Narayanan et al. 2021 (1F1B with any micro-batch count); torch DDP's default buckets (bucket_cap_mb=25)",
            param_gather_exposed=1.0,
            bucket_bytes=TORCH_DDP_BUCKET_BYTES,
            fp8_recipes=("tensorwise", "rowwise", "rowwise_with_gw_hp"),
            fp8_kernels="torchao",
            memory_headroom=0.10,  # a recipe not read from the engine's code: no better known than nanotron's
        ),
    )
}
assert tuple(ENGINES) == ENGINE_CHOICES
ENGINE_RULE_NAMES: tuple[str, ...] = tuple(
    dict.fromkeys(r.name for e in ENGINES.values() for r in e.rules)  # every rule once, in table order
)


def engine_of(training: TrainingSpec) -> EngineInfo:
    return ENGINES[training.engine]


def split_rule(training: TrainingSpec) -> str:
    """The training's engine's pipeline split rule (specs/stages.py)."""
    return ENGINES[training.engine].split


def megatron_memory(training: TrainingSpec) -> bool:
    """The training's engine keeps Megatron's memory recipe (else the PyTorch one)."""
    return ENGINES[training.engine].recipe == MEMORY_MEGATRON


def engine_of_format(fmt: str) -> EngineInfo | None:
    """The engine a launch format starts (None: no engine's)."""
    return next((e for e in ENGINES.values() if fmt in e.launch_formats), None)


def param_gather_exposed(training: TrainingSpec) -> float:
    """The share of ZeRO-1/2's parameter all-gather run exposed after the step: the fitted value, else the engine's."""
    fitted = training.tuning.param_gather_exposed
    return engine_of(training).param_gather_exposed if fitted is None else fitted


def ddp_wrapped(c: Candidates) -> np.ndarray:
    """Where the executor (and a PyTorch stack like it) wraps the model in DDP: tp = pp = 1 and ZeRO <= 1
    (executor/parallel.py); elsewhere it shards or splits the model."""
    return (np.asarray(c.tp) == 1) & (np.asarray(c.pp) == 1) & (np.asarray(c.zero_stage) < 2)


def reduction_buckets(training: TrainingSpec, c: Candidates, params, reduced_bytes_per_param, dp) -> np.ndarray:
    """How many collectives the engine reduces `params` parameters' gradients in over `dp` ranks (at least 1):
    its bucket size (EngineInfo.bucket_*), from its code."""
    e = engine_of(training)
    params = np.asarray(params, dtype=float)
    per_bucket = np.maximum(e.bucket_params, e.bucket_params_per_dp * np.asarray(dp, dtype=float))
    if e.bucket_bytes:
        per_bucket = np.maximum(per_bucket, e.bucket_bytes / np.asarray(reduced_bytes_per_param, dtype=float))
    n = np.where(per_bucket > 0, np.maximum(np.ceil(params / np.maximum(per_bucket, 1.0)), 1.0), 1.0)
    if e.buckets_ddp_only:
        n = np.where(ddp_wrapped(c), n, 1.0)
    return n


def grad_reduce_exposed(training: TrainingSpec) -> float:
    """The share of ZeRO-1/2's gradient reduction run exposed after the backward: the fitted value, else the
    engine's."""
    fitted = training.tuning.grad_reduce_exposed
    return engine_of(training).grad_reduce_exposed if fitted is None else fitted


RULE_BY_NAME: dict[str, EngineRule] = {r.name: r for e in ENGINES.values() for r in e.rules}


def rule_broken(
    name: str, c: Candidates, model: ModelSpec, training: TrainingSpec, engine: str | None = None
) -> np.ndarray:
    """Where the candidates break the engine rule `name` (all False when the engine, the training's by
    default, has no such rule)."""
    e = ENGINES[engine or training.engine]
    if not any(r.name == name for r in e.rules):
        return _n(c)
    return np.asarray(RULE_BY_NAME[name].broken(c, model, training), dtype=bool) & np.ones(len(c.tp), dtype=bool)


def refusal_text(engine: str, reason: str) -> str:
    """The one wording of an engine's refusal: its version and the reason (the planner's and the launch files')."""
    return f"{ENGINES[engine].version} cannot run it: {reason}"


def engine_refusal(layout: Layout, model: ModelSpec, training: TrainingSpec, engine: str | None = None) -> str | None:
    """Why the engine (the training's by default) cannot run this layout (the first of its rules that fails),
    or None: the search's mask, `berth launch` and the API's launch all read this one table."""
    c = Candidates.from_layouts([layout])
    e = ENGINES[engine or training.engine]
    for rule in e.rules:
        if bool(np.asarray(rule.broken(c, model, training))[0]):
            return refusal_text(e.name, rule.detail(layout, model, training))
    return None


# the EngineInfo fields that add to an engine's memory recipe (cost_models/memory.py reads each)
MEMORY_EXTRA_FIELDS = (
    "ddp_beside_grad_buffer",
    "zero1_gather_blocks",
    "sharded_loss",
    "glu_unfused",
    "mha_qkv_kept",
    "unsynced_rs_blocks",
    "sp_gather_buffers",
)


def memory_extras(e: EngineInfo) -> tuple[str, ...]:
    """What the engine holds beyond its memory recipe: the MEMORY_EXTRA_FIELDS it sets."""
    return tuple(name for name in MEMORY_EXTRA_FIELDS if getattr(e, name))


def fp8_refusal(training: TrainingSpec, device: DeviceProfile) -> str | None:
    """Why this training's FP8 recipe cannot run (None: it can, or the training is bf16): the engine must run the
    recipe (EngineInfo.fp8_recipes, from its code) and the device must have FP8 tensor cores with a measured speed."""
    if training.fp8 is None:
        return None
    e = engine_of(training)
    if training.fp8 not in e.fp8_recipes:
        if e.fp8_recipes:
            return f"{e.version} runs the FP8 recipes {', '.join(e.fp8_recipes)}, not '{training.fp8}'"
        others = ", ".join(f"{x.name} ({'/'.join(x.fp8_recipes)})" for x in ENGINES.values() if x.fp8_recipes)
        return f"{e.version} has no FP8 training; engines berth plans FP8 for: {others}"
    if not device.has_fp8:
        why = "no FP8 tensor cores" if not device.peak_flops_per_s.get("fp8") else "no measured FP8 GEMM speed"
        return f"{device.display_name} has {why} (hardware_profiles/devices/{device.name}.json)"
    return None


def check_fp8(training: TrainingSpec, device: DeviceProfile, field: str = "training.fp8") -> None:
    """Refuse (BerthError naming `field`) an FP8 recipe the engine or the device cannot run: every path that turns a
    request, a plan file or a run record into a prediction or a launch file calls this."""
    refusal = fp8_refusal(training, device)
    if refusal is not None:
        raise BerthError(field, training.fp8, refusal)


def engine_table() -> list[dict[str, object]]:
    """The engine table as data (`berth engines --json`, GET /v1/engines)."""
    return [
        {
            "name": e.name,
            "title": e.title,
            "version": e.version,
            "memory_recipe": e.recipe,
            "compute_stacks": list(e.compute_stacks),
            "launch_formats": list(e.launch_formats),
            "refuses": [{"rule": r.name, "text": r.text} for r in e.rules],
            "param_gather_exposed": e.param_gather_exposed,
            "grad_reduce_exposed": e.grad_reduce_exposed,
            "bucket_params": e.bucket_params,
            "bucket_params_per_dp": e.bucket_params_per_dp,
            "bucket_bytes": e.bucket_bytes,
            "buckets_ddp_only": e.buckets_ddp_only,
            "memory_headroom": e.memory_headroom,
            **{name: getattr(e, name) for name in MEMORY_EXTRA_FIELDS},
            "memory_extras": list(memory_extras(e)),
            "fp8_recipes": list(e.fp8_recipes),
            "pipeline_split": e.split,
            "source": e.source,
        }
        for e in ENGINES.values()
    ]
