"""Why a candidate layout cannot run: a reason code per candidate, vectorized.

An infeasible candidate is a mask plus a reason, never an exception (DESIGN convention 4).
Code 0 means valid; otherwise the first failing rule in REASONS order is reported.
"""

from __future__ import annotations

import numpy as np

from cost_models.candidates import SCHEDULE_GPIPE, SCHEDULE_INTERLEAVED, Candidates
from planner import stages
from planner.specs import AXIS_ORDER_CHOICES, ClusterSpec, ModelSpec, TrainingSpec

VALID = 0
# The smallest load-balanced chunk (seq_len / (2 cp) tokens) a layout may use: below it each ring
# step's attention block is too small to hide its KV transfer, and flash kernels tile by 64-128.
# 16 keeps tiny test models (seq 64, cp 2) valid; the search asks much more (planner/search.py).
CP_MIN_CHUNK_TOKENS = 16
REASONS: tuple[tuple[str, str], ...] = (
    ("", ""),
    ("world_size_mismatch", "tp x cp x pp x dp must equal the number of GPUs"),
    ("tp_not_divide_heads", "tp must divide the attention heads"),
    ("tp_not_divide_kv_heads", "tp must divide the key/value heads"),
    ("cp_not_divide_seq", "context parallelism splits each sequence into 2 x cp chunks (load-balanced causal "
     "split): seq_len must be divisible by 2 x cp"),
    ("cp_chunk_too_small", f"context parallelism needs chunks of seq_len / (2 x cp) >= {CP_MIN_CHUNK_TOKENS} tokens"),
    ("cp_needs_flash_attention", "context parallelism (ring attention) runs on flash attention: cp > 1 needs "
     "training.flash_attention"),
    ("stage_without_layers", "the layer split over pp x virtual_stages leaves a pipeline stage without a layer "
     "(planner/stages.py)"),
    ("batch_not_divisible", "dp x micro_batch_size x num_microbatches must equal the global batch"),
    ("shard_not_divide_dp", "shard must divide dp"),
    ("shard_without_zero", "shard > 1 needs zero_stage >= 1"),
    ("virtual_stages_need_interleaved", "virtual_stages > 1 needs schedule interleaved_1f1b"),
    ("interleaved_needs_virtual_stages", "interleaved_1f1b needs virtual_stages > 1 and pp > 1"),
    ("sequence_parallel_needs_tp", "sequence_parallel needs tp > 1"),
    ("too_few_microbatches", "1F1B schedules need num_microbatches >= pp"),
    ("microbatches_not_multiple_of_pp", "interleaved_1f1b needs num_microbatches divisible by pp"),
    ("megatron_cannot_express", "framework megatron: Megatron-LM runs no GPipe, orders axes tp-dp-pp or tp-pp-dp, "
     "ZeRO-2/3 (Megatron FSDP) shard over all of dp, and mixture of experts with tp needs sequence parallelism "
     "(planner/launch.py refuses the rest)"),
    ("ep_needs_moe", "ep > 1 needs a mixture-of-experts model (num_experts > 0)"),
    ("ep_not_divide_experts", "ep must divide num_experts (each ep rank holds num_experts / ep experts)"),
    ("ep_not_divide_dp", "ep must divide dp (expert-parallel ranks are carved out of the data-parallel ranks)"),
    ("ep_with_cp", "ep > 1 with cp > 1 is not modelled (Megatron-LM and torchtitan fold the cp ranks into the "
     "expert-parallel group; berth carves ep out of dp only)"),
    ("out_of_memory", "predicted peak memory exceeds the device memory"),
    ("memory_tight", "predicted peak memory is within the memory headroom of the device memory"),
)
REASON_CODES = {name: i for i, (name, _) in enumerate(REASONS)}
OUT_OF_MEMORY = REASON_CODES["out_of_memory"]
MEMORY_TIGHT = REASON_CODES["memory_tight"]  # fits, but closer to the capacity than the search's memory headroom
# the axis orders Megatron-LM has: its default, and --use-tp-pp-dp-mapping
MEGATRON_ORDERS = [AXIS_ORDER_CHOICES.index("tp-dp-pp"), AXIS_ORDER_CHOICES.index("tp-pp-dp")]


def structural_rules(c: Candidates, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec) -> list:
    """One boolean array per rule of REASONS[1:] that does not depend on the cost model (True:
    the candidate breaks it), in REASONS order. The search masks with them and the one-layout
    check (`planner.layouts.check_layout`) explains with them: the rules live only here."""
    one_f_one_b = (c.schedule != SCHEDULE_GPIPE) & (c.pp > 1)
    rules = [
        c.tp * c.cp * c.pp * c.dp != cluster.world_size,
        model.num_attention_heads % c.tp != 0,
        model.kv_heads % c.tp != 0,
        (c.cp > 1) & (training.seq_len % (2 * c.cp) != 0),
        (c.cp > 1) & (training.seq_len // (2 * c.cp) < CP_MIN_CHUNK_TOKENS),
        (c.cp > 1) & (not training.flash_attention),
        ~stages.split(model.num_layers, c.pp, c.vpp)[3],
        c.dp * c.mbs * c.nmb != training.global_batch_size,
        c.dp % c.shard != 0,
        (c.zero == 0) & (c.shard > 1),
        (c.vpp > 1) & (c.schedule != SCHEDULE_INTERLEAVED),
        (c.schedule == SCHEDULE_INTERLEAVED) & ((c.vpp == 1) | (c.pp == 1)),
        (c.sp > 0) & (c.tp == 1),
        one_f_one_b & (c.nmb < c.pp),
        (c.schedule == SCHEDULE_INTERLEAVED) & (c.nmb % c.pp != 0),
        # the vectorized form of planner/launch.py _megatron_refusal (tests/test_launch.py checks they agree)
        (training.framework == "megatron") & (((c.schedule == SCHEDULE_GPIPE) & (c.pp > 1))
                                              | ~np.isin(c.order, MEGATRON_ORDERS)
                                              | ((c.zero >= 2) & (c.shard < c.dp))
                                              | ((model.num_experts > 0) & (c.tp > 1) & (c.sp == 0))),
        (c.ep > 1) & (model.num_experts == 0),
        (c.ep > 1) & (model.num_experts % np.maximum(c.ep, 1) != 0),
        c.dp % np.maximum(c.ep, 1) != 0,
        (c.ep > 1) & (c.cp > 1),
    ]
    return rules


def structural_reasons(c: Candidates, model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec):
    """Reason codes for every rule that does not depend on the cost model."""
    rules = structural_rules(c, model, training, cluster)
    reason = np.zeros(len(c), dtype=np.int64)
    for code in range(len(rules), 0, -1):  # the first failing rule wins
        reason = np.where(rules[code - 1], code, reason)
    return reason


def describe(code: int) -> str:
    name, text = REASONS[code]
    return f"{name}: {text}" if name else ""
