"""Per-GPU memory of a pipeline stage, as a breakdown of what the caching allocator reserves.

Model states follow what each training stack really holds, its precision recipe (RECIPE_*
below, `precision_recipe`): the bundled executor's fp32 parameters under autocast (with the
autocast cast cache), FSDP2 bf16 mixed precision (torchtitan), Megatron-LM's 16-bit parameters
with fp32 main parameters, Adam state and persistent gradient buffer (Megatron-LM
docs/source/api-guide/dist_optimizer.md: 18 bytes per parameter with bf16, 6 + 12/d with the
distributed optimizer), or plain fp32; sharded as in Rajbhandari et al. 2020 (ZeRO), Sec. 3.1
and 5: stage 1 shards the optimizer state, stage 2 also the gradients, stage 3 also the
parameters, over the `shard` group.

Activations follow Korthikanti et al. 2022, Sec. 4: per layer and micro-batch
sbh(34 + 5as/h) bytes with 16-bit activations, split as sbh(10 + 24/t + 5as/(ht)) under tensor
parallelism and sbh(34 + 5as/h)/t with sequence parallelism (Megatron-LM, which keeps the
attention and MLP inputs sharded and re-gathers them in backward; DTensor sequence parallelism,
framework "pytorch", keeps the gathered inputs: 2sbh of the 34 stay unsplit); selective recompute drops the
5as^2b score terms; full recompute keeps only the 2sbh layer input. Generalized here:
K and V are g = kv/heads the size of Q (GQA); the MLP keeps 2 (GELU) or 3 (SwiGLU: gate, up,
product) b x s x ffn tensors; dropout masks exist only when the model uses dropout;
FlashAttention replaces the score terms by its fp32 log-sum-exp (Dao 2022). An engine's entry adds
what its code keeps beyond this (specs/engines.py EngineInfo; nanotron: its unfused SwiGLU, the q/k/v
block its MHA attention keeps, its own vocabulary-parallel loss, ZeRO-1's stacked gather block).

What is alive at the peak is taken phase by phase, as the bundled executor's profiles show
(CPU profiler, peak op of each layout; benchmarks/data/reference/torch-distributed-cpu.md): the sum of every
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
gradient copy for the whole run on top of that; Megatron-LM's gradient buffer exists throughout.

The peak is what `torch.cuda.max_memory_reserved` measures: the terms above plus the allocator's
slack ("fragmentation": blocks the size of the step's largest short-lived tensor held reserved,
`largest_transient_bytes`), freed blocks a collective still uses while the host runs ahead
("collective_blocks", `unsynced_collective_bytes`), before the step ZeRO-1's gather block from the last one
("cached_gather", `gather_block_bytes`), the segment of 16-bit logits freed for their fp32 copy ("cached_logits",
`cached_logits_bytes`) and framework tensors. The capacity what it needs must fit in
(`allocator_capacity_bytes`; `peak_memory`: all but the collective blocks and the cached segments, which the
allocator hands back before it fails) is the device memory less what the driver keeps, the CUDA
context outside the allocator and NCCL's buffers. Checked on one H100 by benchmarks/memory_fidelity.py.
"""

from __future__ import annotations

from dataclasses import replace
from typing import NamedTuple

import numpy as np

from berth.cost_models.arrays import ArrayOrFloat
from berth.cost_models.pipeline import layers_in_flight, microbatches_in_flight
from berth.specs import stages
from berth.specs.candidates import RECOMPUTE_FULL, RECOMPUTE_NONE, SCHEDULE_GPIPE, Candidates
from berth.specs.engines import EngineInfo, ddp_wrapped, engine_of, megatron_memory, split_rule
from berth.specs.hardware import DeviceProfile
from berth.specs.tree import EngineTuning, ModelSpec, TrainingSpec

FP32_BYTES = 4
HALF_BYTES = 2  # a bf16/fp16 element
MASK_BYTES = 1  # dropout masks are stored as bytes
# Per logit: the stage output (e bytes) and the fp32 log-softmax output the loss saves, for every
# micro-batch whose loss backward has not run yet; during one loss backward the log-softmax's
# incoming gradient and the logits' gradient (fp32). Measured e + 12 bytes with one micro-batch
# in flight on CPU fp32; GPipe's last stage holds the first part for all its micro-batches. In
# 16-bit training the loss works on an fp32 copy (`logits.float()`) and the 16-bit head output is
# freed once the loss is computed: 12 bytes per logit at the loss backward with one micro-batch in
# flight (h100-microbench/head.json: 12.0-13.0 bytes per logit beside the head's weight, its
# gradient and its bf16 copy at 8k-16k tokens).
LOGITS_SAVED_BYTES = 4
LOGITS_BACKWARD_BYTES = 8
# vocabulary-parallel cross-entropy (tp > 1; DTensor loss_parallel, as Megatron's) holds two more
# fp32 copies of the local logits in its backward (measured: +1.2 MB per sequence of 256 tokens
# at vocabulary 1024 / tp 2 on CPU fp32, i.e. about 2.3 copies)
LOSS_PARALLEL_EXTRA_BYTES = 8
FSDP_PARAM_BUFFERS = 2  # the gathered layer and the prefetched next one (FSDP, Zhao 2023 Sec. 3.3)
FSDP_GRAD_BUFFERS = 1  # the unsharded gradient of the layer being reduce-scattered
ADAM_STATES = 2  # AdamW's exp_avg and exp_avg_sq, fp32 (torch.optim.AdamW; Megatron's optimizer too)

# Precision recipes: what a framework holds per parameter, from the framework, the precision and
# the layout (`precision_recipe`). Each one's bytes are in `model_state_bytes`.
RECIPE_FP32 = 0  # fp32 training: fp32 parameters, gradients, AdamW exp_avg and exp_avg_sq (4 + 4 + 8)
# PyTorch without FSDP2 (the bundled executor on one device, DDP, ZeroRedundancyOptimizer, DTensor tp
# or pipelining without dp): fp32 parameters under bf16/fp16 autocast (executor/train.py). fp32
# gradients and AdamW state (4 + 4 + 8) and autocast's cast cache: a 16-bit copy of every weight a
# matmul used, kept until the autocast region (the whole step's forward and backward) exits
# (torch.autocast docs, "cache_enabled"), i.e. 2 bytes per parameter at every phase but the step.
RECIPE_AUTOCAST = 1
# FSDP2 `fully_shard` with MixedPrecisionPolicy(param_dtype=bf16, reduce_dtype=fp32) (torchtitan; the
# executor for zero >= 2 and for dp with tp or pp): fp32 sharded parameters (the master), fp32 sharded
# gradients, AdamW state on the shard (4 + 4 + 8 over the shard group), and the all-gathered bf16
# parameters of the layers in use (`sharding_buffer_bytes`; the whole model under ZeRO-2).
RECIPE_FSDP2 = 2
# Megatron-LM mixed precision (Float16OptimizerWithFloat16Params / DistributedOptimizer): 16-bit
# parameters, fp32 main parameters + exp_avg + exp_avg_sq (K = 12, sharded over dp by the distributed
# optimizer, zero >= 1), and a persistent contiguous gradient buffer (DistributedDataParallel's
# grad buffer, allocated once, never freed), fp32 with bf16 (accumulate_allreduce_grads_in_fp32,
# which Megatron sets for bf16) and 16-bit with fp16; with fp16 the optimizer step copies the
# main gradients to fp32 (4 bytes on the optimizer's shard, at the step only).
RECIPE_MEGATRON = 3


def _cp(c) -> np.ndarray:
    return np.asarray(getattr(c, "cp", 1))


def expert_tp_of(c) -> np.ndarray:
    """The candidates' expert-tensor-parallel degree (Candidates.expert_tp; tp where a struct has none)."""
    etp = getattr(c, "expert_tp", None)
    return np.asarray(c.tp if etp is None else etp)


def expert_fold(c) -> np.ndarray:
    """tp / expert_tp: how many times more ranks hold each expert shard than hold each dense shard (1 with
    expert_tp = tp; tp with expert_tp = 1). MoE parallel folding (Liu et al. 2025, arXiv 2504.14960, Sec. 3;
    Megatron-LM megatron/core/parallel_state.py initialize_model_parallel): the experts run on
    expert_tp x ep x expert-dp x pp over the attention's tp x cp x dp x pp ranks, expert-dp =
    world / (expert_tp x ep x pp) = tp x dp / (expert_tp x ep) (cp 1 here: ep_with_cp)."""
    tp = np.asarray(c.tp, dtype=float)
    return tp / np.maximum(np.asarray(expert_tp_of(c), dtype=float), 1.0)


def precision_recipe(training: TrainingSpec, c) -> np.ndarray:
    """The precision recipe code of each candidate (constants above); the data-parallel ranks of
    FSDP2 are dp x cp (torchtitan's dp_shard_cp mesh)."""
    zero, dp = np.asarray(c.zero_stage), np.asarray(c.dp) * _cp(c)
    if training.precision == "fp32":
        return np.full(np.shape(zero), RECIPE_FP32)
    if megatron_memory(training):
        return np.full(np.shape(zero), RECIPE_MEGATRON)
    fsdp2 = (zero >= 2) | ((dp > 1) & ((np.asarray(c.tp) > 1) | (np.asarray(c.pp) > 1)))
    return np.where(fsdp2, RECIPE_FSDP2, RECIPE_AUTOCAST)


def bf16_gradients(training: TrainingSpec) -> bool:
    """The engine's FP8 recipe keeps Megatron's gradient buffer and its reduction in bf16
    (EngineInfo.fp8_grads_bf16)."""
    return training.fp8 is not None and engine_of(training).fp8_grads_bf16


def dp_collective_bytes(training: TrainingSpec, c) -> tuple[np.ndarray, np.ndarray]:
    """(gathered, reduced) bytes per parameter of each candidate's data-parallel collectives, by its
    precision recipe (constants above): parameters are gathered as the recipe computes with them
    (FSDP2's param_dtype, Megatron's 16-bit parameters; fp32 where the optimizer updates fp32
    parameters and hands them back, ZeroRedundancyOptimizer), gradients reduced as the recipe holds
    them (FSDP2's reduce_dtype fp32, Megatron's fp32 grad buffer with bf16, the executor's fp32
    gradients; 16-bit only in Megatron's fp16 recipe). Under FP8 an engine that keeps FP8 parameters from some ZeRO
    stage on (EngineInfo.fp8_params_from_zero: Megatron's --fp8-param-gather) gathers 1 byte a parameter there (the
    embedding, norms and head, 16-bit in its code, are counted at 1 byte too: a small share of a stage)."""
    recipe = precision_recipe(training, c)
    e = float(training.bytes_per_element)
    megatron = recipe == RECIPE_MEGATRON
    gathered = np.where((recipe == RECIPE_FSDP2) | megatron, e, float(FP32_BYTES))
    from_zero = engine_of(training).fp8_params_from_zero
    if training.fp8 is not None and from_zero:
        gathered = np.where(np.asarray(c.zero_stage) >= from_zero, 1.0, gathered)
    reduced = np.where(megatron & ((training.precision == "fp16") | bf16_gradients(training)), e, float(FP32_BYTES))
    return gathered, reduced


def vocab_rows(model: ModelSpec, tp) -> ArrayOrFloat:
    """Vocabulary rows of the embedding and of the LM head one tensor-parallel rank holds and computes:
    the vocabulary padded to a multiple of tp, split evenly (ceil(V / tp)). The bundled executor pads
    so (executor/model.py `padded_vocab`, this function); torchtitan's uneven DTensor shard gives its
    largest rank as many. Megatron-LM pads further, to a multiple of 128 x tp
    (--make-vocab-size-divisible-by), not counted here."""
    tp = np.asarray(tp, dtype=float)
    return np.ceil(model.vocab_size / tp)


def padded_vocab(model: ModelSpec, tp) -> ArrayOrFloat:
    """The vocabulary padded to a multiple of tp (`vocab_rows` x tp): vocab_size itself where tp divides it,
    so the expressions below that take it / tp give the unpadded figures to the last bit there."""
    return vocab_rows(model, tp) * np.asarray(tp, dtype=float)


def stage_params(
    model: ModelSpec,
    pp,
    tp,
    first: bool,
    vpp=1,
    middle: bool = False,
    ep=1,
    part: str = "all",
    etp=None,
    rule: str = stages.SPLIT_ENDS_LIGHTER,
) -> ArrayOrFloat:
    """Parameters on one rank of the first (or last) pipeline stage after the tp split.

    The stage's decoder layers follow the engine's split `rule` (specs/stages.py; `vpp` virtual stages).
    The first stage holds the input embedding, the last the LM head and final norm; with
    pp = 1 one stage holds both (a single matrix if the embeddings are tied). Megatron keeps a
    copy of a tied embedding on the last stage when pp > 1. `middle`: a middle stage (its layers
    only).

    Mixture of experts: a rank holds num_experts / ep of each MoE layer's routed experts, split by
    `etp` (expert-tensor parallelism; None: tp, Megatron-LM's default for --expert-tensor-parallel-size;
    1: whole experts, MoE parallel folding, Liu et al. 2025 Sec. 3); the experts per layer are the mean
    over the layers (first_k_dense layers counted as if spread).
    `part`: "all", "dense" (all but the routed experts) or "expert" (the routed experts only).
    """
    edge = 0.0 if part == "expert" else 1.0
    local = local_layer_params(model, tp, ep, etp, part)
    first_layers, middle_layers, last_layers, _ = stages.rule_stage_split(model, pp, vpp, rule)
    if middle:
        return np.asarray(middle_layers, dtype=float) * local
    pp = np.asarray(pp, dtype=float)
    layers = np.asarray(first_layers if first else last_layers, dtype=float) * local
    emb = edge * (padded_vocab(model, tp) * model.hidden_size) / tp
    head = np.where((pp == 1) & model.tied_embeddings, 0.0, emb) + edge * model.final_norm_params
    if first:
        return layers + emb + np.where(pp == 1, head, 0.0)
    return layers + head + np.where(pp == 1, emb, 0.0)


def local_layer_params(model: ModelSpec, tp, ep=1, etp=None, part: str = "all") -> ArrayOrFloat:
    """One decoder layer's parameters on one rank (routed experts / ep / etp, the rest / tp; MoE: the mean
    layer; etp None: tp). `part` as in `stage_params`."""
    ep = np.asarray(ep, dtype=float)
    experts = model.expert_params_per_layer
    dense = 0.0 if part == "expert" else (model.params_per_layer - experts) / np.asarray(tp, dtype=float)
    routed = 0.0 if part == "dense" else experts / ep / np.asarray(tp if etp is None else etp, dtype=float)
    return dense + routed + 0.0 * ep


def largest_tensor_params(model: ModelSpec, tp, first: bool, last) -> ArrayOrFloat:
    """Elements of the largest single parameter tensor one tensor-parallel rank of a stage holds, in the
    bundled executor's shapes (executor/model.py): the embedding on the first stage and the untied LM head
    on the last (vocab_rows x hidden each), else a decoder layer's largest matrix (the MLP's hidden x
    ffn / tp, or attention's hidden x heads x head_dim / tp). `last`: a bool or an array of them."""
    tp = np.asarray(tp, dtype=float)
    h = float(model.hidden_size)
    layer = np.maximum(h * model.ffn_hidden_size, h * model.num_attention_heads * model.head_dim) / tp
    holds = np.asarray(first) | (np.asarray(last) & (not model.tied_embeddings))
    return np.maximum(layer, np.where(holds, vocab_rows(model, tp) * h, 0.0))


def whole_tensor_share(params, largest, shard) -> ArrayOrFloat:
    """Parameters of the most loaded rank when ZeRO-1 hands out whole tensors rather than an even slice of
    a flat buffer: torch's ZeroRedundancyOptimizer (torch/distributed/optim/zero_redundancy_optimizer.py
    `_partition_parameters`: tensors sorted largest first, each to the rank holding the fewest elements so
    far: the bundled executor's ZeRO-1 under DDP, executor/parallel.py) and the rank-slice proxy, which
    shards so (executor/proxy.py `shard_parameters`). The rank that takes the largest tensor takes more
    only once every other rank holds more than it does, so it holds max(largest, params / shard), the
    second within one of the small tensors that fill the ranks evenly. For an embedding larger than
    params / shard (a 4-layer slice of llama3-8b over 8: 525 M against 1.9 B / 8) its optimizer state is
    the embedding's. Measured on CPU (2 gloo ranks, a tied 32,000 x 256 embedding of 9.9 M parameters):
    the ranks peak 49.5 MiB apart, the embedding's Adam state less the layers', and ZeRO-1 lowers the
    larger rank's peak by 13.0 MiB from ZeRO-0's, as this share predicts (an even share: 37.7)."""
    shard = np.asarray(shard, dtype=float)
    return np.where(shard > 1, np.maximum(largest, np.asarray(params, dtype=float) / shard), params)


def largest_stage_params(
    model: ModelSpec, pp, tp, vpp=1, ep=1, etp=None, rule: str = stages.SPLIT_ENDS_LIGHTER
) -> ArrayOrFloat:
    """Parameters on one rank of the pipeline stage that holds the most: the first or the last (an
    embedding or head more), or a middle one where the split gives it more layers (pp > 2)."""
    ends = np.maximum(
        stage_params(model, pp, tp, True, vpp, ep=ep, etp=etp, rule=rule),
        stage_params(model, pp, tp, False, vpp, ep=ep, etp=etp, rule=rule),
    )
    mid = np.where(
        np.asarray(pp) > 2, stage_params(model, pp, tp, False, vpp, middle=True, ep=ep, etp=etp, rule=rule), 0.0
    )
    return np.maximum(ends, mid)


def expert_share(model: ModelSpec, c, rule: str = stages.SPLIT_ENDS_LIGHTER) -> tuple[np.ndarray, np.ndarray]:
    """(parameters on one rank of the largest stage, the share of them that are routed experts): the
    split data-parallel costs (step.py) and the checkpoint (goodput.py) weigh dense and expert parts by."""
    etp = expert_tp_of(c)
    stage = np.asarray(largest_stage_params(model, c.pp, c.tp, c.virtual_stages, c.ep, etp, rule))
    if not model.is_moe:
        return stage, np.zeros_like(stage)
    expert = stage_params(model, c.pp, c.tp, True, c.virtual_stages, ep=c.ep, part="expert", etp=etp, rule=rule)
    return stage, np.clip(expert / np.maximum(stage, 1.0), 0.0, 1.0)


def expert_candidates(c, split_dp: bool = False) -> Candidates:
    """The candidates as the routed experts see them: replicated over the expert-data-parallel group,
    dp / ep ranks with expert_tp = tp (ep ranks carved out of dp, as Megatron-LM and torchtitan do), and
    tp x dp / (ep x expert_tp) ranks in general (Megatron-LM's expert_data_parallel_size, parallel_state.py
    initialize_model_parallel; `expert_fold`), so ZeRO shards their states over shard x fold / ep of them
    (at least 1; exact when ep divides shard x fold, as with shard = dp).
    `split_dp`: dp becomes that group too (their gradient reduction's group); memory keeps dp, which
    only picks the precision recipe, the same for every parameter of a rank."""
    from dataclasses import replace

    ep = np.maximum(np.asarray(c.ep, dtype=float), 1.0)
    fold = expert_fold(c)
    shard = np.maximum(np.asarray(c.shard, dtype=float) * fold / ep, 1.0)
    return replace(c, dp=np.asarray(c.dp) * fold / ep, shard=shard) if split_dp else replace(c, shard=shard)


def dispatch_share(c) -> np.ndarray:
    """The share of its micro-batch's tokens one rank dispatches to the experts: 1 with expert_tp = tp
    (every tp rank of an ep group dispatches them; Megatron gathers the sequence-parallel shards over the
    expert-tp group), expert_tp / tp with expert_tp < tp (sequence parallelism is required then: each tp
    rank routes its own seq / tp tokens, Megatron-LM's MoEAlltoAllTokenDispatcher with an expert-tp group of
    expert_tp ranks, megatron/core/transformer/moe/token_dispatcher.py)."""
    etp, tp = np.asarray(expert_tp_of(c), dtype=float), np.asarray(c.tp, dtype=float)
    return np.where(etp != tp, etp / tp, 1.0)


def model_state_bytes(training: TrainingSpec, params, c) -> dict[str, np.ndarray]:
    """What the precision recipe (module constants) holds per rank for `params` parameters of the
    stage: "parameters" (the stored ones: fp32 master or 16-bit; sharded by FSDP2 and ZeRO-3),
    "gathered" (FSDP2 without resharding after forward, ZeRO-2: the whole stage's unsharded compute
    copy from forward to backward), "gradients" (the step's gradients: sharded for ZeRO >= 2),
    "grad_element" (bytes of one unsharded gradient element, for accumulation), "grad_buffer"
    (Megatron's persistent buffer), "optimizer_state" (sharded for ZeRO >= 1), "autocast" (the
    cast cache) and "step_extra" (Megatron fp16's fp32 main gradients at the optimizer step)."""
    e = training.bytes_per_element
    recipe = precision_recipe(training, c)
    zero = np.asarray(c.zero_stage)
    # ZeRO / FSDP shard over shard x cp ranks: the cp ranks hold the same parameters, and torchtitan's
    # FSDP mesh is dp_shard x cp, Megatron's distributed optimizer shards over dp x cp
    shard = np.asarray(c.shard, dtype=float) * _cp(c)
    fsdp2 = (not megatron_memory(training)) & (
        (zero >= 2) | ((np.asarray(c.dp) * _cp(c) > 1) & ((np.asarray(c.tp) > 1) | (np.asarray(c.pp) > 1)))
    )
    megatron = recipe == RECIPE_MEGATRON
    master = np.where(megatron, e, FP32_BYTES)  # bytes of a stored parameter
    p = params * master / np.where((zero >= 3) | fsdp2, shard, 1.0)
    gathered = np.where(fsdp2 & (zero < 3), params * e, 0.0)
    grad_element = np.where(recipe == RECIPE_FSDP2, e, np.where(megatron, 0.0, FP32_BYTES))
    g = params * np.where(megatron, 0.0, FP32_BYTES) / np.where((zero >= 2) | fsdp2, shard, 1.0)
    buffer_element = np.where((training.precision == "bf16") & ~bf16_gradients(training), FP32_BYTES, e)
    grad_buffer = np.where(megatron, params * buffer_element / np.where(zero >= 2, shard, 1.0), 0.0)
    opt_div = np.where(zero >= 1, shard, 1.0)
    adam = ADAM_STATES * FP32_BYTES
    o = params * np.where(megatron, adam + FP32_BYTES, adam) / opt_div
    autocast = np.where(recipe == RECIPE_AUTOCAST, params * HALF_BYTES, 0.0)
    step_extra = np.where(megatron & (training.precision == "fp16"), params * FP32_BYTES / opt_div, 0.0)
    return {
        "parameters": p,
        "gathered": gathered,
        "gradients": g,
        "grad_element": grad_element,
        "grad_buffer": grad_buffer,
        "optimizer_state": o,
        "autocast": autocast,
        "step_extra": step_extra,
    }


def linear_inputs_saved_split(training: TrainingSpec, sp) -> np.ndarray:
    """Whether a layer saves its column-parallel linears' input (QKV's, the MLP's first) split by tp: under sequence
    parallelism with Megatron's recipe, which then gathers it again in the backward for the weight gradient
    (Korthikanti 2022 Sec. 4.2.2; Megatron-LM tensor_parallel/layers.py, nanotron tensor_parallel/functional.py
    `_ColumnLinearAsyncCommunication.backward` with tp_recompute_allgather, its default), charged in
    cost_models/step.py. DTensor's sequence parallelism (the PyTorch recipe) keeps the gathered input instead."""
    return (np.asarray(sp) > 0) & megatron_memory(training)


def layer_activation_bytes(
    model: ModelSpec, training: TrainingSpec, b, tp, sp, recompute, recipe=None
) -> tuple[np.ndarray, ArrayOrFloat]:
    """Activation bytes one layer keeps per micro-batch on one tp rank, and the whole layer's (what
    full recompute re-materializes). Korthikanti 2022 Sec. 4 for 16-bit residual streams (Megatron,
    FSDP2); the executor's fp32-parameter autocast recipe in `_autocast_layer_bytes`."""
    e, s, h, f = training.bytes_per_element, training.seq_len, model.hidden_size, model.ffn_hidden_size
    a, g = model.num_attention_heads, model.kv_ratio
    recipe = precision_recipe_of(training, tp) if recipe is None else recipe
    sbh = b * s * h
    hidden_split = np.where(sp > 0, tp, 1)
    masks = 2 * MASK_BYTES if model.dropout else 0
    # norm inputs (2), QKV input, MLP input, dropout masks: replicated across tp unless sp; the
    # QKV and MLP inputs stay gathered under DTensor sp (framework "pytorch")
    linear_split = np.where(linear_inputs_saved_split(training, sp), tp, 1)
    # FP8 (TrainingSpec.fp8) where the engine saves a linear's input as one FP8 copy (EngineInfo.fp8_saved_input_bytes,
    # Transformer Engine): the QKV and MLP inputs (normed) and the activation into fc2 at that size; the attention
    # output stays 16-bit (the attention kernel keeps it for its own backward) and the output projection saves an FP8
    # copy of it beside (`copy`)
    engine = engine_of(training)
    fp8_inputs = training.fp8 is not None and engine.fp8_saved_input_bytes > 0
    saved = engine.fp8_saved_input_bytes if fp8_inputs else e
    copy = saved if fp8_inputs else 0.0
    unsplit = (2 * e + masks) * sbh / hidden_split + 2 * saved * sbh / linear_split
    # Q, K, V, attention output, and the MLP intermediates (and what the engine's code keeps beyond them:
    # _kept_qkv, an unfused SwiGLU's act(gate)): split by tp.
    mlp_tensors = (4 if engine.glu_unfused else 3) if model.mlp == "swiglu" else 2
    split = (e * (2 + 2 * g + _kept_qkv(model, engine)) + copy) * sbh + ((mlp_tensors - 1) * e + saved) * b * s * f
    if training.flash_attention:
        scores = FP32_BYTES * b * a * s  # log-sum-exp per row
    else:
        scores = (e + (MASK_BYTES + e if model.dropout else 0)) * b * a * s * s
    full_layer = unsplit + split / tp + scores / tp
    # selective: Megatron-LM recomputes the attention core (Korthikanti Sec. 5): the s^2 terms go,
    # which flash attention never stores; FSDP2 (torchtitan) runs op-level selective checkpointing
    selective = np.where(
        recipe == RECIPE_FSDP2,
        _op_sac_bytes(model, training, b, tp, sp),
        full_layer - np.where(training.flash_attention, 0.0, scores / tp),
    )
    checkpoint = e * sbh / hidden_split
    auto_full, auto_selective, auto_checkpoint = _autocast_layer_bytes(model, training, b, tp, sp)
    autocast = recipe == RECIPE_AUTOCAST
    full_layer = np.where(autocast, auto_full, full_layer)
    selective = np.where(autocast, auto_selective, selective)
    checkpoint = np.where(autocast, auto_checkpoint, checkpoint)
    return np.where(
        recompute == RECOMPUTE_FULL,
        checkpoint,
        np.where(recompute == RECOMPUTE_NONE, full_layer, selective),
    ), full_layer


def _kept_qkv(model: ModelSpec, engine: EngineInfo) -> float:
    """Hidden-sized tensors a layer keeps beyond Q, K, V and the attention output. nanotron's
    attention (models/llama.py CausalSelfAttention at e24d2483) with as many kv heads as heads
    permutes the QKV projection's output into one contiguous q/k/v block and concatenates k and v
    into a second block for the rotary kernel; flash-attn's RotaryEmbedding rotates q in place, so
    q stays a view of the first block, and flash-attn saves it: the first block's k and v (2 h)
    stay alive beside their copy. With fewer kv heads it copies q, k and v apart: nothing stays."""
    return 2.0 if engine.mha_qkv_kept and model.kv_heads == model.num_attention_heads else 0.0


def precision_recipe_of(training: TrainingSpec, tp) -> int:
    """The recipe of a single-device-style layout (no dp) of width tp: for callers of the layer
    formula that have no whole candidate."""
    if training.precision == "fp32":
        return RECIPE_FP32
    return RECIPE_MEGATRON if megatron_memory(training) else RECIPE_AUTOCAST


# The executor's layer under autocast with fp32 parameters (executor/model.py Block): the residual
# stream is fp32 (the embedding lookup is not autocast, and x + bf16 promotes to fp32), each
# projection casts its fp32 norm output to bf16 on its own (3 casts for q, k, v; 2 for SwiGLU's w1
# and w3, 1 for GELU), GQA's K and V are expanded to every head (repeat_interleave) before SDPA,
# and the context is copied for the output projection. Per token and layer, output excluded:
# fp32 mid-layer residual 4h + casts 2h each, unsplit by tp; q, expanded k and v, SDPA output and
# its copy 10h and the MLP's 2f tensors (SwiGLU: w1 out, silu out, w3 out, product; GELU: w1 out,
# gelu out), split by tp; flash's fp32 log-sum-exp. Checked against h100-microbench/layer.json
# (`retained_bytes` minus the bf16 weight copies the measurement includes): 1B and 8B layers at
# tp 1-8, seq 2k-8k, within 3 % (tests/test_memory.py). The layer's input, the previous layer's
# fp32 output (4h), is stored too and counted here.
AUTOCAST_RESIDUAL_BYTES = FP32_BYTES
AUTOCAST_ATTENTION_TENSORS = 5  # q, expanded k, expanded v, SDPA output, its copy for wo


def _autocast_layer_bytes(
    model: ModelSpec, training: TrainingSpec, b, tp, sp
) -> tuple[ArrayOrFloat, ArrayOrFloat, ArrayOrFloat]:
    """(full layer, selective, full-recompute checkpoint) bytes of the executor's autocast layer.
    Selective (executor/parallel.py `_selective`: the attention core checkpointed) keeps the core's
    inputs (q, and k, v before the GQA expansion: 2h + 4hg) instead of the expanded k, v and the
    SDPA output (6h): 1B mbs 2 measured 1.36 GB less allocated at its peak with selective than
    without (h100-microbench/mem_detail.json), 16 layers x 8192 tokens x 5.07h; this gives 5h."""
    s, h, f = training.seq_len, model.hidden_size, model.ffn_hidden_size
    a, g = model.num_attention_heads, model.kv_ratio
    tokens = b * s
    hidden_split = np.where(sp > 0, tp, 1)
    casts = 3 + (2 if model.mlp == "swiglu" else 1)
    residual = AUTOCAST_RESIDUAL_BYTES * h  # per token: one fp32 hidden vector (the executor has no dropout)
    unsplit = 2 * residual / hidden_split + HALF_BYTES * h * casts
    attention = AUTOCAST_ATTENTION_TENSORS * HALF_BYTES * h
    mlp = (4 if model.mlp == "swiglu" else 2) * HALF_BYTES * f
    scores = FP32_BYTES * a if training.flash_attention else HALF_BYTES * a * s
    full = tokens * (unsplit + (attention + mlp + scores) / tp)
    saved = 3 * HALF_BYTES * h - 2 * HALF_BYTES * h * g + scores  # expanded k, v, output - core inputs
    selective = full - tokens * saved / tp
    checkpoint = tokens * residual / hidden_split
    return full, selective, checkpoint


def _op_sac_bytes(model: ModelSpec, training: TrainingSpec, b, tp, sp) -> ArrayOrFloat:
    """torchtitan's op-level selective activation checkpointing (activation_checkpoint.mode
    "selective", selective_ac_option "op"; `_custom_policy` in
    torchtitan/parallelisms/parallelize_llama.py at the benchmarked commit,
    torchtitan/distributed/activation_checkpoint.py today): each block is checkpointed with a
    policy that saves the outputs of the attention kernel (output and log-sum-exp) and of every
    second matmul of the block (in call order: wq, wk, wv, wo, w1, w3, w2 -> wq, wv, w1, w2
    kept), and recomputes the rest. Stored per layer: the block input (16-bit) and those
    outputs; q/k/v/w1/w3 outputs split by tp, wo/w2 outputs full width (sequence-split under sp)."""
    e, s, h, f = training.bytes_per_element, training.seq_len, model.hidden_size, model.ffn_hidden_size
    a, g = model.num_attention_heads, model.kv_ratio
    tokens = b * s
    hidden_split = np.where(sp > 0, tp, 1)
    # (bytes per token, split by tp?) of each matmul output, in call order
    mms = [(h, True), (h * g, True), (h * g, True), (h, False), (f, True)]
    if model.mlp == "swiglu":
        mms.append((f, True))
    mms.append((h, False))
    kept = sum(e * n / (tp if split else hidden_split) for i, (n, split) in enumerate(mms) if i % 2 == 0)
    lse = FP32_BYTES * a / tp if training.flash_attention else e * a * s / tp
    attention_out = e * h / tp
    block_input = e * h / hidden_split
    return tokens * (block_input + kept + attention_out + lse)


def selective_recompute_s(model: ModelSpec, training: TrainingSpec, c, fwd_s, attention_s, gemm_fwd_s) -> np.ndarray:
    """Seconds one layer's selective recomputation costs, by what each stack recomputes
    (`layer_activation_bytes`): the attention core (the executor, Megatron-LM), or under FSDP2
    torchtitan's op-level policy, which keeps the attention output and every other matmul's output
    and recomputes the rest: every second matmul (wk, wo, w3: that share of the layer's matmul
    weights, applied to the forward GEMM time) and all the forward's other work (norms, rotary,
    activation function, residual adds: the forward less its GEMMs and attention)."""
    h, f, g = model.hidden_size, model.ffn_hidden_size, model.kv_ratio
    weights = [h * h, h * h * g, h * h * g, h * h, h * f] + ([h * f] if model.mlp == "swiglu" else []) + [f * h]
    share = sum(w for i, w in enumerate(weights) if i % 2 == 1) / sum(weights)
    rest = np.maximum(np.asarray(fwd_s) - attention_s - gemm_fwd_s, 0.0)
    op_sac = share * np.asarray(gemm_fwd_s) + rest
    return np.where(precision_recipe(training, c) == RECIPE_FSDP2, op_sac, attention_s)


def moe_activation_bytes(model: ModelSpec, training: TrainingSpec, b, tp, sp, etp=None) -> ArrayOrFloat:
    """What an MoE layer keeps beyond its compute view's (ModelSpec.compute_view: the active experts'
    intermediates as one MLP's), per micro-batch on one tp rank, averaged over the layers: the top-k
    permuted copies of the token hidden states the experts' GEMMs take (saved for their weight
    gradients), the experts' outputs before the weighted combine (saved for the routing weights'
    gradient), each k x h per token, and the router's fp32 probabilities (E per token). With
    expert-tensor parallelism = tp every tp rank holds all of its micro-batch's tokens (split over tp
    only under sequence parallelism); with expert_tp < tp (`etp`; None: tp) a rank's experts take the
    tokens its expert-tp group gathered, expert_tp / tp of them (`dispatch_share`)."""
    if not model.is_moe:
        return 0.0
    tokens = b * training.seq_len / np.where(np.asarray(sp) > 0, tp, 1)
    if etp is not None:
        tokens = tokens * np.where(np.asarray(etp) != np.asarray(tp), etp, 1)
    per_token = (
        2 * model.experts_per_token * model.hidden_size * training.bytes_per_element + FP32_BYTES * model.num_experts
    )
    return model.num_moe_layers / model.num_layers * tokens * per_token


def activation_bytes(
    model: ModelSpec,
    training: TrainingSpec,
    c,
    stage: ArrayOrFloat,
    first: bool,
    layers=None,
    moe_model: ModelSpec | None = None,
) -> tuple[ArrayOrFloat, ArrayOrFloat]:
    """(stored, working) activations of the stage: stored layers x in-flight micro-batches plus
    the embedding output on the first stage or the final norm input on the last; and (full
    recompute) the one layer re-materialized during its backward. `layers`: the stage's decoder
    layers (default: the first or last stage's by the split rule). `moe_model`: the MoE model whose
    compute view `model` is (`moe_activation_bytes` added to every layer not fully recomputed)."""
    per_layer, full_layer = layer_activation_bytes(
        model, training, c.micro_batch_size, c.tp, c.sequence_parallel, c.recompute, precision_recipe(training, c)
    )
    if moe_model is not None and moe_model.is_moe:
        extra = moe_activation_bytes(
            moe_model, training, c.micro_batch_size, c.tp, c.sequence_parallel, expert_tp_of(c)
        )
        per_layer = per_layer + np.where(c.recompute == RECOMPUTE_FULL, 0.0, extra)
        full_layer = full_layer + extra
    if layers is None:
        split = stages.rule_stage_split(model, c.pp, c.virtual_stages, split_rule(training))
        layers = split[0] if first else split[2]
    held = (
        layers_in_flight(model.num_layers, c.pp, c.virtual_stages, c.num_microbatches, c.schedule, stage, layers)
        * per_layer
    )
    working = np.where(c.recompute == RECOMPUTE_FULL, full_layer, 0.0)
    inflight = microbatches_in_flight(c.pp, c.virtual_stages, c.num_microbatches, c.schedule, stage)
    edge = boundary_bytes(model, training, c) * (inflight if first else 1.0)
    return held + edge, working


def boundary_bytes(model: ModelSpec, training: TrainingSpec, c) -> ArrayOrFloat:
    """One micro-batch's hidden states between layers (split over tp under sequence parallelism)."""
    return (
        training.bytes_per_element
        * c.micro_batch_size
        * training.seq_len
        * model.hidden_size
        / np.where(c.sequence_parallel > 0, c.tp, 1)
    )


def pipeline_buffer_bytes(model: ModelSpec, training: TrainingSpec, c) -> ArrayOrFloat:
    """Receive buffers torch.distributed.pipelining (framework "pytorch", pp > 1) allocates up front
    for every micro-batch of each local stage and keeps for the whole step: activations into all
    but the model's first stage, gradients into all but its last, i.e. 2v - 1 boundary tensors per
    micro-batch on the first and the last rank (PipelineStage._prepare_forward_infra and
    _prepare_backward_infra, torch 2.x; measured by benchmarks/accuracy.py). Megatron-LM receives
    into transient tensors: none."""
    torch_pipeline = (np.asarray(c.pp) > 1) & (not megatron_memory(training))
    receivers = np.where(torch_pipeline, 2.0 * np.asarray(c.virtual_stages, dtype=float) - 1.0, 0.0)
    return boundary_bytes(model, training, c) * c.num_microbatches * receivers


def logit_count(model: ModelSpec, training: TrainingSpec, b, tp) -> ArrayOrFloat:
    """Logits of a micro-batch of `b` sequences on one tp rank (the vocabulary padded and split over tp)."""
    return np.asarray(b, dtype=float) * training.seq_len * padded_vocab(model, tp) / tp


def logits_bytes(model: ModelSpec, training: TrainingSpec, b, tp, in_flight=1.0) -> ArrayOrFloat:
    """Logits on the last stage at its loss backward: the output and the saved fp32 log-softmax of
    each of `in_flight` micro-batches, plus the gradients of the one in backward (vocabulary split
    over tp). PyTorch in 16-bit computes the loss on an fp32 copy and frees the 16-bit output of
    the micro-batch in its loss backward (LOGITS_SAVED_BYTES comment)."""
    parallel_loss = np.where(np.asarray(tp) > 1, LOSS_PARALLEL_EXTRA_BYTES, 0)
    e = training.bytes_per_element
    if engine_of(training).sharded_loss:
        # the engine's own loss, whatever `cross_entropy` says: nanotron's _ShardedCrossEntropy
        # (parallel/tensor_parallel/functional.py at e24d2483), at any tp, on the fp32 cast of the head's
        # output (llama.py cast_to_fp32; the same tensor in fp32 training). The cast and the max-shifted copy
        # that becomes the saved softmax are alive together; the 16-bit output is freed by then, but its
        # segment cannot hold a 4-byte copy, so it stays reserved (`cached_logits_bytes`): e + 8 bytes per logit in
        # 16-bit training, 8 in fp32. The backward turns the softmax into the gradient in place and casts it to 16 bits
        # (4 + e, less). Every other micro-batch whose loss backward has not run keeps its softmax.
        live = FP32_BYTES * (1.0 + in_flight) * logit_count(model, training, b, tp)
        return live + cached_logits_bytes(model, training, b, tp)
    if fused_loss(training):
        # the 16-bit logits of each micro-batch in flight, saved by the kernel, which writes their
        # gradient into them (flash-attn's CrossEntropyLoss(inplace_backward=True), llm-foundry)
        per_logit = e * in_flight + 0.0 * parallel_loss
    elif not megatron_memory(training) and training.precision != "fp32":
        per_logit = LOGITS_SAVED_BYTES * in_flight + e * (in_flight - 1.0) + LOGITS_BACKWARD_BYTES + parallel_loss
    else:
        per_logit = (e + LOGITS_SAVED_BYTES) * in_flight + LOGITS_BACKWARD_BYTES + parallel_loss
    return per_logit * logit_count(model, training, b, tp)


def cached_logits_bytes(model: ModelSpec, training: TrainingSpec, b, tp) -> ArrayOrFloat:
    """The part of `logits_bytes` that only the allocator's cache holds: the segment of the 16-bit head output that
    an engine computing its loss on an fp32 cast (EngineInfo.sharded_loss: nanotron) frees before the cast's
    max-shifted copy, too small to carve that copy from. A whole free segment, which the caching allocator
    releases before a cudaMalloc fails (`peak_memory`): reserved, not needed to fit. On the Ultra-Scale
    Playbook's sweep the 1B model at tp 1, pp 2, 8 sequences a micro-batch ran where its last stage needs 72 GiB
    live and reserves 80 with this segment, over the 78 the allocator can have (benchmarks/engine_sweep.py)."""
    if not engine_of(training).sharded_loss or training.bytes_per_element == FP32_BYTES:
        return 0.0 * np.asarray(b, dtype=float)
    return training.bytes_per_element * logit_count(model, training, b, tp)


def fused_loss(training: TrainingSpec) -> bool:
    """The loss is a fused 16-bit cross-entropy kernel (`cross_entropy` "fused"), unless the engine runs its own
    (EngineInfo.sharded_loss)."""
    return training.cross_entropy == "fused" and not engine_of(training).sharded_loss


def largest_transient_bytes(model: ModelSpec, training: TrainingSpec, c, holds_head) -> ArrayOrFloat:
    """The largest short-lived tensor of a step: the fp32 logits (or their gradient) of one
    micro-batch on the stage with the LM head, else an MLP activation gradient. The caching
    allocator keeps the segment such a tensor was carved from reserved beside the blocks the
    next peak allocates (`allocator_transient_blocks` in the device profile)."""
    tokens = np.asarray(c.micro_batch_size, dtype=float) * training.seq_len
    logit_bytes = training.bytes_per_element if fused_loss(training) else FP32_BYTES
    logits = np.where(holds_head, logit_bytes * logit_count(model, training, c.micro_batch_size, c.tp), 0.0)
    mlp = training.bytes_per_element * tokens * model.ffn_hidden_size / c.tp
    return np.maximum(logits, mlp)


def sharding_buffer_bytes(model: ModelSpec, training: TrainingSpec, tp, zero, ep=1, etp=None) -> np.ndarray:
    """Unsharded buffers of FSDP / ZeRO-3 (gathered layers) and ZeRO-2/3 (gradient reduce-scatter)."""
    layer = local_layer_params(model, tp, ep, etp) * training.bytes_per_element
    params = np.where(zero >= 3, FSDP_PARAM_BUFFERS * layer, 0.0)
    grads = np.where(zero >= 2, FSDP_GRAD_BUFFERS * layer, 0.0)
    return params + grads


def gradient_buckets(c, training: TrainingSpec) -> ArrayOrFloat:
    """1 where the data-parallel wrapper keeps a persistent unsharded gradient copy: PyTorch DDP
    with gradient_as_bucket_view, which the executor uses for zero <= 1 when dp is the only axis
    (Megatron's persistent buffer is its `grad_buffer`, counted by the recipe), and nanotron's DDP
    at ZeRO-0 with dp > 1, whatever tp and pp (trainer.py wraps the model in DDP unless it
    accumulates in fp32 under ZeRO-1; its 16-bit buckets sit beside the fp32 accumulation buffer:
    EngineInfo.ddp_beside_grad_buffer)."""
    if engine_of(training).ddp_beside_grad_buffer:
        return ((np.asarray(c.zero_stage) == 0) & (np.asarray(c.dp) > 1)).astype(float)
    return (ddp_wrapped(c) & (np.asarray(c.dp) > 1) & (not megatron_memory(training))).astype(float)


def gather_block_bytes(model: ModelSpec, training: TrainingSpec, c: Candidates, params, transient) -> np.ndarray:
    """The block ZeRO-1's post-step parameter all-gather allocates where the engine does not gather in
    place, reserved beside the segments the activations left cached (`params`: the stage's parameters).
    nanotron (`optim/zero.py _all_gather_params` -> `distributed.py all_gather_coalesced` at e24d2483)
    flattens its shard and the dp per-rank outputs, then calls `dist.all_gather` with a list of
    equal-sized outputs, which torch's NCCL process group stacks into one whole-stage buffer
    (`ProcessGroupNCCL::allgather`, `newLikeFlat`) before copying back: a block of the stage's
    parameters in the compute precision. What of it the step's largest cached block (`transient`, the fp32
    logits of a micro-batch or an MLP tensor) cannot hold is new reserved memory; the input and the
    per-rank outputs (1/dp of it each) are carved from the cached segments. The outputs are of equal
    size where dp divides every parameter, i.e. the hidden size (each of nanotron's parameters is a
    multiple of it; `_partition_parameters` gives the last ranks one element less otherwise, and
    torch then broadcasts rank by rank into the outputs, stacking nothing).
    EngineInfo.zero1_gather_blocks counts such blocks; 0 elsewhere (Megatron's distributed optimizer
    and DeepSpeed gather into the parameter buffer itself)."""
    blocks = engine_of(training).zero1_gather_blocks
    dp = np.asarray(c.dp)
    on = (np.asarray(c.zero_stage) == 1) & (dp > 1) & (model.hidden_size % dp == 0)
    return np.where(on, np.maximum(blocks * params * training.bytes_per_element - transient, 0.0), 0.0)


def unsynced_collective_bytes(model: ModelSpec, training: TrainingSpec, c) -> np.ndarray:
    """Blocks freed by the host but still reserved at the loss: the full-width outputs the forward hands to a
    sequence-parallel reduce-scatter (EngineInfo.unsynced_rs_blocks per decoder layer, and the embedding's).
    nanotron at e24d2483 (`parallel/tensor_parallel/functional.py` `_RowLinearAsyncCommunication.forward`, `nn.py`
    `TensorParallelEmbedding.forward`) computes the row-parallel linear's partial sums at full width, reduce-scatters
    them into a new sequence shard and drops them; torch's NCCL process group records such an input on its stream
    and the caching allocator does not hand the block out again until the GPU has run the collective. With pp = 1
    nothing syncs the host between the forward and the backward, so it runs ahead of the GPU and every such block
    of the forward is still reserved when the backward begins. With pp > 1 each send between stages syncs the host
    (`pipeline_parallel/p2p.py` `_send_meta` copies its metadata from host memory and asserts on the device copy),
    so none are left at the peak. On the Ultra-Scale Playbook's nanotron sweep (benchmarks/engine_sweep.py) the
    reserved peak at pp = 1, tp = 4-32 sat 1.8-2.0 GiB (8B model, 32 layers) and 0.6-0.9 GiB (1B, 16 layers) per
    sequence above the recipe whatever tp, and not at pp > 1: 2 blocks of 4,096 x 4,096 bf16 per layer are 2.0 GiB,
    of 4,096 x 2,048 0.5 GiB."""
    blocks = engine_of(training).unsynced_rs_blocks
    on = (np.asarray(c.pp) == 1) & (np.asarray(c.tp) > 1) & (np.asarray(c.sequence_parallel) > 0)
    tokens = np.asarray(c.micro_batch_size, dtype=float) * training.seq_len
    block = training.bytes_per_element * tokens * model.hidden_size
    return np.where(on & (blocks > 0), block * (blocks * model.num_layers + 1.0), 0.0)


def sp_gather_buffer_bytes(model: ModelSpec, training: TrainingSpec, c) -> np.ndarray:
    """Buffers a tensor-parallel rank keeps for the whole run to all-gather sequence-parallel activations into
    (EngineInfo.sp_gather_buffers of [micro-batch tokens, hidden] each, tp > 1 with sequence parallelism). nanotron at
    e24d2483 gathers into a global `MemoryBuffer` (`parallel/utils.py`: one tensor per name, grown, never freed):
    "allgather", the column-parallel linears' input in the forward and again in the backward
    (`tp_recompute_allgather`, its default), and with `tp_linear_async_communication`, which the sweep's
    `scripts/scaling_benchmarks.py` sets with REDUCE_SCATTER, "allgather2", the row-parallel linears' output
    gradient (`_RowLinearAsyncCommunication.backward`). On the Ultra-Scale Playbook's sweep (benchmarks/
    engine_sweep.py) the recipe's median miss of rank 0's reserved peak at tp 16-32 went -8.9 % -> -5.1 % (8B) and
    -16.9 % -> -13.1 % (1B) with them, at tp 2-8 -6.9 % -> -6.6 % and -4.4 % -> -3.5 %."""
    on = (np.asarray(c.tp) > 1) & (np.asarray(c.sequence_parallel) > 0)
    tokens = np.asarray(c.micro_batch_size, dtype=float) * training.seq_len
    return np.where(
        on, engine_of(training).sp_gather_buffers * training.bytes_per_element * tokens * model.hidden_size, 0.0
    )


def allocator_capacity_bytes(device: DeviceProfile, world_size: int = 1) -> float:
    """What the caching allocator can reserve on one device: the memory nvidia-smi reports less
    what the driver keeps back (torch's "total capacity" is this much smaller), the CUDA context and
    libraries outside the allocator, and the collective library's buffers when there are peers.
    The predicted peak (`peak_memory`) is the allocator's reserved peak, the figure
    `torch.cuda.max_memory_reserved` measures; it fits when it is at most this."""
    outside = device.driver_reserved_bytes + device.cuda_context_bytes
    if world_size > 1:
        outside += device.communicator_bytes
    return float(device.memory_bytes - outside)


def fp8_weight_cache_bytes(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, c, first: bool, middle: bool, rule: str
) -> ArrayOrFloat:
    """The persistent FP8 copies of the stage's decoder-layer weights an engine keeps under FP8 training
    (EngineInfo.fp8_weight_cache_bytes per parameter: Transformer Engine's workspace, module/base.py
    _fp8_workspaces; twice that where the device needs transposed copies, DeviceProfile.fp8_transposed_copies);
    0 without FP8, and from the ZeRO stage on which the engine keeps FP8 parameters instead
    (EngineInfo.fp8_params_from_zero). Counted with the parameters."""
    engine = engine_of(training)
    if training.fp8 is None or not engine.fp8_weight_cache_bytes:
        return 0.0
    first_layers, middle_layers, last_layers, _ = stages.rule_stage_split(model, c.pp, c.virtual_stages, rule)
    layers = middle_layers if middle else first_layers if first else last_layers
    cached = engine.fp8_params_from_zero == 0 or (np.asarray(c.zero_stage) < engine.fp8_params_from_zero)
    copies = 2.0 if device.fp8_transposed_copies else 1.0
    per_param = np.where(cached, engine.fp8_weight_cache_bytes * copies, 0.0)
    return per_param * np.asarray(layers, dtype=float) * local_layer_params(model, c.tp, c.ep, expert_tp_of(c))


def stage_memory_breakdown(
    model: ModelSpec,
    training: TrainingSpec,
    device: DeviceProfile,
    c,
    first: bool,
    buckets: bool = True,
    middle: bool = False,
    whole_tensors: bool = False,
) -> dict[str, np.ndarray]:
    """Breakdown (dict of arrays, bytes) of the first or the last pipeline stage at its peak
    phase (module docstring); `middle`: the second stage (pp rank 1, the middle stage with the most
    micro-batches in flight; its layers only). `buckets=False` leaves out the data-parallel gradient
    buckets (a single-process proxy of one rank has none). `whole_tensors`: ZeRO-1 shards the optimizer
    state by whole tensors at every layout (`whole_tensor_share`: the rank-slice proxy), not only where the
    engine's DDP does (EngineInfo.zero1_whole_tensors). Every term is inside the caching allocator: their
    sum is the reserved peak."""
    first = first and not middle
    stage = 0.0 if first else 1.0 if middle else np.asarray(c.pp, dtype=float) - 1.0
    etp = expert_tp_of(c)
    rule = split_rule(training)
    params = stage_params(model, c.pp, c.tp, first, c.virtual_stages, middle, ep=c.ep, etp=etp, rule=rule)
    st = model_state_bytes(training, params, c)
    if model.is_moe:  # the routed experts' states shard over the expert-data-parallel group (expert_candidates)
        experts = stage_params(
            model, c.pp, c.tp, first, c.virtual_stages, middle, ep=c.ep, part="expert", etp=etp, rule=rule
        )
        dense = model_state_bytes(training, params - experts, c)
        moe = model_state_bytes(training, experts, expert_candidates(c))
        st = {k: dense[k] + moe[k] if k != "grad_element" else dense[k] for k in dense}
    act_model = model.compute_view()
    # context parallelism: each rank holds s / cp tokens of every sequence, so every activation,
    # logit and buffer term below sees a micro-batch of mbs / cp (parameters are not divided by cp)
    c = replace(c, micro_batch_size=np.asarray(c.micro_batch_size) / _cp(c)) if np.any(_cp(c) > 1) else c
    zero1 = np.asarray(c.zero_stage) == 1
    whole = zero1 & (whole_tensors | (ddp_wrapped(c) & engine_of(training).zero1_whole_tensors))
    if np.any(whole):  # the optimizer state of the rank that holds the stage's largest tensor
        o, shard = st["optimizer_state"], np.maximum(np.asarray(c.shard, dtype=float) * _cp(c), 1.0)
        last = (not first and not middle) | (np.asarray(c.pp) == 1)
        largest = largest_tensor_params(model, c.tp, first, last)
        st = {
            **st,
            "optimizer_state": np.where(whole, o * whole_tensor_share(params, largest, shard) / (params / shard), o),
        }
    p, g, o = st["parameters"], st["gradients"], st["optimizer_state"]
    p = p + fp8_weight_cache_bytes(model, training, device, c, first, middle, rule)
    unsharded = params * st["grad_element"]
    layers = stages.rule_stage_split(model, c.pp, c.virtual_stages, rule)[1] if middle else None
    stored, working = activation_bytes(act_model, training, c, stage, first, layers, moe_model=model)
    holds_head = ((np.asarray(c.pp) == 1) | (not first)) & (not middle)
    # micro-batches past the head but not yet through their loss backward: all of them under GPipe
    loss_in_flight = np.where((c.schedule == SCHEDULE_GPIPE) & (np.asarray(c.pp) > 1), c.num_microbatches, 1)
    logits = np.where(holds_head, logits_bytes(model, training, c.micro_batch_size, c.tp, loss_in_flight), 0.0)
    cached_logits = np.where(holds_head, cached_logits_bytes(model, training, c.micro_batch_size, c.tp), 0.0)
    buffers = sharding_buffer_bytes(model, training, c.tp, c.zero_stage, c.ep, etp)
    # reserved from the post-step gather on, and the pool only grows: every phase carries it
    largest = largest_transient_bytes(act_model, training, c, holds_head)
    gather_block = gather_block_bytes(model, training, c, params, largest)
    buffers = buffers + gather_block
    receive = pipeline_buffer_bytes(model, training, c)
    gathers = sp_gather_buffer_bytes(model, training, c)
    inflight = microbatches_in_flight(c.pp, c.virtual_stages, c.num_microbatches, c.schedule, stage)
    accumulating = np.asarray(c.num_microbatches, dtype=float) > inflight + 1e-9
    accumulated = np.where(accumulating, np.where(np.asarray(c.zero_stage) >= 3, g, unsharded), 0.0)
    # the buckets hold gradients in the element the wrapper reduces: the recipe's, or 16-bit beside a
    # Megatron-style fp32 buffer (whose grad_element is 0: its buffer is `grad_buffer`)
    bucket_element = np.where(st["grad_element"] > 0, st["grad_element"], training.bytes_per_element)
    persistent = gradient_buckets(c, training) * params * bucket_element if buckets else np.zeros_like(p)
    held_grads = persistent + accumulated + st["grad_buffer"]
    # one layer's gradients and its largest backward temporary (an MLP activation gradient)
    layer_grads = np.where(
        (accumulated > 0) | (st["grad_buffer"] > 0),
        0.0,
        local_layer_params(model, c.tp, c.ep, etp) * st["grad_element"],
    )
    mlp_temp = training.bytes_per_element * c.micro_batch_size * training.seq_len * act_model.ffn_hidden_size / c.tp
    # FSDP2 without resharding after forward (ZeRO-2, and zero 0 with tp/pp) keeps the whole
    # gathered stage from forward to backward beside its shards; after the backward it reshards:
    # the optimizer step sees only the sharded parameters. Autocast's cast cache is dropped when
    # the autocast region exits, before the optimizer step.
    fwd_params = p + st["gathered"]
    autocast = st["autocast"]
    zeros = np.zeros_like(p)
    phases = [
        {
            "parameters": fwd_params,
            "gradients": held_grads,
            "autocast_copies": autocast,
            "activations": stored,
            "logits": logits - cached_logits,
            "cached_logits": cached_logits,
            "sharding_buffers": buffers,
            "pipeline_buffers": receive,
            "gather_buffers": gathers,
        },
        {
            "parameters": fwd_params,
            "gradients": held_grads + layer_grads,
            "autocast_copies": autocast,
            "activations": stored + working + mlp_temp,
            "logits": zeros,
            "cached_logits": zeros,
            "sharding_buffers": buffers,
            "pipeline_buffers": receive,
            "gather_buffers": gathers,
        },
        {
            "parameters": p,
            "gradients": np.maximum(g, persistent) + st["grad_buffer"] + st["step_extra"],
            "autocast_copies": zeros,
            "activations": zeros,
            "logits": zeros,
            "cached_logits": zeros,
            "sharding_buffers": gather_block,
            "pipeline_buffers": receive,
            "gather_buffers": gathers,
        },
    ]
    # reserved from the forward's end through the backward, beside the first two phases
    unsynced = unsynced_collective_bytes(act_model, training, c)
    sums = np.stack([sum(ph.values()) for ph in phases])
    totals = sums + np.stack([unsynced, unsynced, zeros])
    which = np.argmax(totals, axis=0)
    # Before the step ZeRO-1's gather block is the last step's, a free segment in the allocator's cache (cached_gather)
    # that it releases before it fails; the step's phase holds it live, so what must fit is at least that phase's bytes.
    cached_gather = np.where(which < 2, np.clip(np.choose(which, sums) - sums[2], 0.0, gather_block), 0.0)
    loss, layer, opt = phases
    at_loss, at_layer = which == 0, which == 1  # np.where, not np.choose, which first stacks its choices
    chosen = {k: np.where(at_loss, loss[k], np.where(at_layer, layer[k], opt[k])) for k in loss}
    dynamic = sum(chosen[k] for k in ("activations", "logits", "cached_logits", "sharding_buffers", "pipeline_buffers"))
    transient = np.where(which < 2, largest, 0.0)
    if model.is_moe:  # the dispatched tokens (top-k copies of the micro-batch's hidden states) and their gradient
        dispatched = (
            dispatch_share(c)
            * training.bytes_per_element
            * np.asarray(c.micro_batch_size, dtype=float)
            * training.seq_len
            * model.experts_per_token
            * model.hidden_size
        )
        transient = np.where(which < 2, np.maximum(transient, dispatched), 0.0)
    return {
        "parameters": chosen["parameters"],
        "gradients": chosen["gradients"],
        "optimizer_state": o,
        "autocast_copies": chosen["autocast_copies"],
        "activations": chosen["activations"],
        "logits": chosen["logits"],
        "cached_logits": chosen["cached_logits"],
        "sharding_buffers": chosen["sharding_buffers"] - cached_gather,
        "pipeline_buffers": chosen["pipeline_buffers"],
        "gather_buffers": chosen["gather_buffers"],
        "fragmentation": device.allocator_fragmentation_fraction * dynamic
        + device.allocator_transient_blocks * transient,
        "collective_blocks": np.where(which < 2, unsynced, 0.0),
        "cached_gather": cached_gather,
        "framework": np.full_like(p, device.framework_overhead_bytes),
    }


STATE_TERMS = ("parameters", "gradients", "autocast_copies", "sharding_buffers", "cached_gather")
ACTIVATION_TERMS = ("activations", "pipeline_buffers", "gather_buffers")


def tuned_breakdown(b: dict[str, np.ndarray], tuning: EngineTuning, tp=1) -> dict[str, np.ndarray]:
    """A stage's breakdown with the engine's fitted memory parameters (EngineTuning; planner/engine_fit.py):
    the model-state terms x state_bytes_scale, the optimizer state x optimizer_bytes_scale, the activation
    terms x activation_scale, the saved activations' share activation_tp_unsharded held whole on every one of
    the `tp` ranks (x (1 + u (tp - 1)): the recipe splits them all by tp), the logits x logits_scale,
    fixed_bytes added to the framework term, and the allocator's reserve over what is allocated
    (reserve_fraction x the rest) added to its fragmentation term. Neutral values return `b`."""
    if tuning.neutral:
        return b
    out = {k: v * tuning.state_bytes_scale if k in STATE_TERMS else v for k, v in b.items()}
    out["optimizer_state"] = b["optimizer_state"] * tuning.optimizer_bytes_scale
    out.update({k: b[k] * tuning.activation_scale for k in ACTIVATION_TERMS})
    u = tuning.activation_tp_unsharded
    if u:
        out["activations"] = out["activations"] * (1.0 + u * (np.asarray(tp, dtype=float) - 1.0))
    out["logits"] = b["logits"] * tuning.logits_scale
    out["cached_logits"] = b["cached_logits"] * tuning.logits_scale
    out["framework"] = b["framework"] + tuning.fixed_bytes
    out["fragmentation"] = b["fragmentation"] + tuning.reserve_fraction * sum(out.values())
    return out


class PeakMemory(NamedTuple):
    """`peak_memory`'s answer, per candidate (bytes)."""

    peak: np.ndarray  # the reserved peak: the worse of the first, the last and (uneven stages) the second stage
    breakdown: dict[str, np.ndarray]  # that stage's terms
    first_stage: np.ndarray  # rank 0's reserved peak, which an engine's log reports (MeasuredRun.memory_rank)
    last_stage: np.ndarray  # the last stage's (the LM head and loss): nanotron's log line (planner/run_logs.py)
    required: np.ndarray  # what must fit in the allocator's capacity, the most any stage needs
    # what the allocator holds without waiting on a collective (the search's headroom applies to it): before any hand
    # back, so it can pass the capacity, and the peak, where a cached gather block must be handed back to fit
    held: np.ndarray


def peak_memory(
    model: ModelSpec, training: TrainingSpec, device: DeviceProfile, c, capacity: float | None = None
) -> PeakMemory:
    """The reserved peak per GPU, its breakdown, rank 0's, what must fit and what the allocator holds (PeakMemory).

    What must fit is a stage's reserved peak less its collective blocks, cached gather and cached logits: blocks
    only the allocator's cache holds. When a cudaMalloc fails, PyTorch's caching allocator first waits for the events of
    blocks freed while a stream still used them and returns them to its pool, then frees its cached segments and
    retries (c10/cuda/CUDACachingAllocator.cpp `release_cached_blocks`: `synchronize_and_free_events`, then
    `release_blocks`): such blocks inflate the reserved figure where memory is to spare, but never make a run fail.
    So where a stage fits within `capacity` (the allocator's, `allocator_capacity_bytes`) its reserved peak is at
    most that: what those blocks would take beyond it is handed back (one that does not fit reports its whole sum).
    What must fit is the peak phase's live bytes; where the collective blocks make a phase the peak, a later phase
    may need a little more (unchanged here: the optimizer step with a gather block at pp = 1, tp > 1), and under a
    fitted tuning the terms scale apart after the phases are chosen. On the Ultra-Scale Playbook's sweep
    (benchmarks/engine_sweep.py) the 8B layouts at tp 1, pp 4-8, two sequences a micro-batch and ZeRO-1, whose
    gather block sits beside a full pipeline's activations, ran and reserved 75-77 GiB where the whole sum is 79.

    The search's headroom (cost_models/step.py) applies to what the allocator holds without waiting on a
    collective's stream, the peak less the collective blocks only. The cached gather counts there: where it does
    not fit beside the rest the allocator must free its cached segments, syncing the device, and allocate them
    again; all 9 of the sweep's 8B runs that reserved over 90 % of the capacity ran below half their predicted
    throughput. The collective blocks do not: the fastest 8B layouts on 128 and 256 GPUs (tp 8, 8 sequences a
    micro-batch, pp 1) held 16 GiB of them and reserved 63-67 GiB, where a fit predicted 75.

    With an even split the middle stages hold fewer in-flight micro-batches than the first and no
    embedding or head, so they are never the peak. With an uneven one (specs/stages.py: berth's
    rule where pp x vpp does not divide the layers, nanotron's wherever its middle ranks hold more
    layers than an end) a middle stage can: the second stage, the middle one with the most
    micro-batches in flight, is taken too, with as many layers as the fullest middle stage (under
    nanotron's split that one may sit further down with fewer micro-batches in flight: an
    over-estimate, never the peak there, since rank 0 holds at least as many layers)."""

    def stage(**where) -> tuple[dict[str, np.ndarray], np.ndarray, np.ndarray, np.ndarray]:
        b = tuned_breakdown(stage_memory_breakdown(model, training, device, c, **where), training.tuning, c.tp)
        total = np.asarray(sum(b.values()), dtype=float)
        held = total - b["collective_blocks"]
        need = held - b["cached_gather"] - b["cached_logits"]  # unchanged by the hand-back: it takes only those
        if capacity is not None:  # where the stage fits, handed back as the peak reaches the capacity: collective first
            over = np.where(need <= capacity, np.maximum(total - capacity, 0.0), 0.0)
            for term in ("collective_blocks", "cached_gather", "cached_logits"):
                back = np.minimum(over, b[term])
                b, over, total = {**b, term: b[term] - back}, over - back, total - back
        return b, total, need, held

    first, total_first, need_first, held_first = stage(first=True)
    last, total_last, need_last, held_last = stage(first=False)
    use_first = total_first >= total_last
    breakdown = {k: np.where(use_first, first[k], last[k]) for k in first}
    peak = np.maximum(total_first, total_last)
    required, held = np.maximum(need_first, need_last), np.maximum(held_first, held_last)
    n_first, n_middle, n_last, _ = stages.rule_stage_split(model, c.pp, c.virtual_stages, split_rule(training))
    uneven = (np.asarray(c.pp) > 2) & ((n_middle > n_first) | (n_middle > n_last))
    if np.any(uneven):
        mid, total_mid, need_mid, held_mid = stage(first=False, middle=True)
        use_mid = uneven & (total_mid > peak)
        breakdown = {k: np.where(use_mid, mid[k], breakdown[k]) for k in breakdown}
        peak = np.where(use_mid, total_mid, peak)
        required = np.where(uneven, np.maximum(required, need_mid), required)
        held = np.where(uneven, np.maximum(held, held_mid), held)
    return PeakMemory(peak, breakdown, total_first, total_last, required, held)
