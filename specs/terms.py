"""The one registry of the cost model's terms: every key of `time_breakdown_s` (cost_models/step.py
`evaluate`) and of `memory_breakdown_bytes` (cost_models/memory.py `stage_memory_breakdown`), with
its unit, display label, what it is, and what the edges need of it: the plan tables
(cli/render.py), the executor's measured regions (cost_models/breakdown.py), the report colours
(cli/plots.py), the placement's axis -> term map (planner/placement.py) and the API's
description of a Prediction (specs/tree.py).

A term the cost model emits but this registry lacks fails tests/test_terms.py; order here is the
order of every table, breakdown and figure. Pure data: no numpy, no torch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

ALWAYS = "always"  # shown in every breakdown table
EMITTED = "emitted"  # shown when a plan's breakdown holds it (ep_comm: MoE models only)


@dataclass(frozen=True)
class TimeTerm:
    """One key of `time_breakdown_s` (seconds per training step, of the stage that sets the pace)."""

    name: str
    label: str  # the row label in tables (after "time: ") and the bar label in figures
    description: str
    colour: str  # report figures (cli/plots.py)
    regions: tuple[str, ...]  # executor regions (executor/timing.py) whose exclusive times add up to it
    measured_by: str  # how the executor measures it (a ValidationReport's breakdown says it)
    axis: str | None = None  # the parallel axis whose process groups carry it (placement)
    shown_when: str = ALWAYS  # ALWAYS, EMITTED, or an axis name: shown when a plan uses that axis (size > 1)
    unit: Literal["s"] = "s"


@dataclass(frozen=True)
class MemoryTerm:
    """One key of `memory_breakdown_bytes` (bytes per GPU at the predicted peak, inside the caching allocator: their sum
    is the predicted reserved peak; the CUDA context and the driver's share are taken off the capacity instead)."""

    name: str  # also its row label in tables (after "memory: ")
    description: str
    measured_by: str | None = None  # None: not measured apart (in the measured total only)
    unit: Literal["bytes"] = "bytes"

    @property
    def label(self) -> str:
        return self.name


TIME: tuple[TimeTerm, ...] = (
    TimeTerm(
        "compute",
        "compute",
        "forward and backward GEMMs, attention and the rest of the layers, embedding, LM head and loss",
        "#4c72b0",
        ("forward", "backward"),
        "forward and backward of the rank's layers, embedding, LM head and loss (per micro-batch, or "
        "PipelineStage.forward_one_chunk / backward_one_chunk and the schedule's loss), exclusive of "
        "everything nested in them",
    ),
    TimeTerm(
        "recompute",
        "recompute",
        "activation recomputation in the backward (selective: attention core; full: the whole layer)",
        "#8172b3",
        ("recompute",),
        "the checkpointed block (full) or attention core (selective) when it runs again inside "
        "backward, tensor-parallel collectives of the re-run included (as the cost model has it)",
    ),
    TimeTerm(
        "tp_comm",
        "tp_comm",
        "tensor-parallel collectives (all-reduce, or all-gather and reduce-scatter under sequence parallelism)",
        "#dd8452",
        ("tp_all_reduce", "tp_all_gather", "tp_reduce_scatter", "tp_all_to_all"),
        "functional collectives (DTensor) on the tensor-parallel group: issue and wait_tensor, by kind",
        axis="tp",
    ),
    TimeTerm(
        "cp_comm",
        "cp_comm",
        "context-parallel exchange of keys and values, the part attention does not hide",
        "#da8bc3",
        ("cp_all_to_all", "cp_all_gather", "cp_all_reduce"),
        "collectives on the context-parallel group: the ring steps of PyTorch's context-parallel API, "
        "K and V (and dK, dV in backward) sent to the next rank as a permutation all-to-all (the cost "
        "model's ring exchange; its exposed part), and the cp gradient all-reduce after FSDP2",
        axis="cp",
        shown_when="cp",
    ),
    TimeTerm(
        "pp_comm",
        "pp_comm",
        "pipeline sends and receives of activations and their gradients",
        "#937860",
        ("pp_transfer",),
        "issuing the pipeline's sends and receives (the schedule's _batch_p2p); their transfer overlaps "
        "the waits and is counted in bubble",
        axis="pp",
    ),
    TimeTerm(
        "bubble",
        "bubble",
        "pipeline fill and drain (the schedule's idle time)",
        "#c8c8c8",
        ("pp_wait",),
        "waiting for the pipeline's sends and receives to complete (the schedule's _wait_batch_p2p): the "
        "neighbouring stage not there yet (fill, drain, stage imbalance) and the transfer itself, which one "
        "rank's clock cannot tell apart (a gloo send completes only once the peer has posted its receive)",
    ),
    TimeTerm(
        "dp_comm",
        "dp_comm",
        "data-parallel gradient reduction and ZeRO/FSDP gathers, the part the backward does not hide",
        "#55a868",
        ("dp_all_reduce", "dp_all_gather", "dp_reduce_scatter", "dp_broadcast"),
        "collectives on the data-parallel groups: FSDP2 unshard / wait_for_unshard (all-gather with its "
        "copy-in and copy-out) and post_backward (reduce-scatter, HSDP all-reduce), ZeRO-1 broadcasts; "
        "DDP: from the last gradient accumulated to the end of backward (the wait for the buckets' "
        "all-reduce)",
        axis="dp",
    ),
    TimeTerm(
        "optimizer",
        "optimizer",
        "the optimizer step (memory-bound over the local parameters)",
        "#c44e52",
        ("optimizer",),
        "optimizer.step(), exclusive of collectives it issues (ZeRO-1)",
    ),
    TimeTerm(
        "ep_comm",
        "ep_comm",
        "mixture of experts: the token dispatch and combine all-to-alls",
        "#64b5cd",
        ("dp_all_to_all", "ep_all_to_all"),
        "the MoE token dispatch and combine (all_to_all_single on the expert-parallel group, ep ranks of dp)",
        axis="ep",
        shown_when=EMITTED,
    ),
)

MEMORY: tuple[MemoryTerm, ...] = (
    MemoryTerm(
        "parameters",
        "the rank's stored parameters (shards under ZeRO-3/FSDP2) and, from "
        "forward to backward, a gathered stage that is not resharded after forward",
        "local bytes of the rank's parameters (shards under FSDP/ZeRO) at the end of the step",
    ),
    MemoryTerm(
        "gradients",
        "gradients held: accumulated, in data-parallel buckets, Megatron's "
        "persistent buffer, or one layer's in the backward",
        "local bytes of .grad at the end of the step (after the optimizer, before zero_grad)",
    ),
    MemoryTerm(
        "optimizer_state",
        "the optimizer's states of the precision recipe (sharded for ZeRO >= 1)",
        "local bytes of the optimizer's state tensors at the end of the step",
    ),
    MemoryTerm("autocast_copies", "autocast's cast cache: 16-bit copies of fp32 weights inside the autocast region"),
    MemoryTerm("activations", "activations saved for the backward, and the working set of the layer in backward"),
    MemoryTerm("logits", "the LM head's logits and their loss intermediates, of the micro-batches past the head"),
    MemoryTerm(
        "cached_logits",
        "the 16-bit logits' segment, freed for their fp32 copy, which it cannot hold (nanotron's loss): cached, "
        "released before it fails, so not needed to fit, but within the headroom",
    ),
    MemoryTerm("sharding_buffers", "unsharded buffers of ZeRO-2/3 and FSDP (gathered layers, gradient reduce-scatter)"),
    MemoryTerm("pipeline_buffers", "receive buffers torch.distributed.pipelining allocates for every micro-batch"),
    MemoryTerm("gather_buffers", "persistent buffers sequence-parallel linears all-gather into (nanotron)"),
    MemoryTerm(
        "fragmentation",
        "what the caching allocator reserves beyond the allocated peak (a share of the dynamic terms, transient "
        "blocks)",
    ),
    MemoryTerm(
        "collective_blocks",
        "freed blocks a collective still holds where the engine's host runs ahead of the GPU: reserved while "
        "memory allows, reclaimed by the allocator (synchronizing) before it fails, so not needed to fit",
    ),
    MemoryTerm(
        "cached_gather",
        "ZeRO-1's stacked all-gather block from the last step (nanotron), a free segment the allocator keeps "
        "cached beside the activations: released before it fails, so not needed to fit, but within the headroom",
    ),
    MemoryTerm(
        "framework",
        "tensors the framework allocates beside the model's terms (the device profile's framework_overhead_bytes)",
    ),
)

TIME_NAMES: tuple[str, ...] = tuple(t.name for t in TIME)
MEMORY_NAMES: tuple[str, ...] = tuple(t.name for t in MEMORY)
TIME_BY_NAME: dict[str, TimeTerm] = {t.name: t for t in TIME}
MEMORY_BY_NAME: dict[str, MemoryTerm] = {t.name: t for t in MEMORY}
AXIS_TERMS: dict[str, str] = {t.axis: t.name for t in TIME if t.axis}  # axis -> the term its traffic lands in


def describe(terms: tuple[TimeTerm, ...] | tuple[MemoryTerm, ...]) -> str:
    """One line per term (name, unit: what it is): the API's description of a breakdown."""
    return "; ".join(f"{t.name} ({t.unit}): {t.description}" for t in terms)


# What a plan's `bottleneck` names (cost_models/step.py BOTTLENECK_TERMS groups the terms; one text for the
# table legend, --help and the JSON schema).
BOTTLENECK_DEFINITION = (
    "the time term that takes the largest share of the step (compute, recompute, tp_comm, cp_comm, dp_comm, "
    "pipeline_bubble = bubble + pp_comm, optimizer, ep_comm: time_breakdown_s), or 'memory' when the layout "
    "does not fit or is memory_tight (compare's table names the rule it breaks: out_of_memory, memory_tight, ...)"
)
