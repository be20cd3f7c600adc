"""The parallel axes, named as torchtitan names its device-mesh dimensions, and where each sits.

The one table of axes the specs, the search, the placement math and the executor's mesh derive
from. Adding an axis (docs/axes.md): a member of `Axis`, its `AxisFacts` row in `AXES`, a field of
`berth.specs.tree.Layout` (and `berth.specs.candidates.Candidates`) named as the axis, its rules in
`berth.specs.validity.RULES`, the cost terms that price it, the executor's mesh and the launch
mappings.

Placement over ranks (innermost first): the axes of `Layout.axis_order` (tp, dp, pp in any order;
the search tries tp innermost), with cp right outside tp (torchtitan's mesh pp, dp_replicate,
dp_shard, cp, tp; Megatron-LM's tp-cp-ep-dp-pp), so that world = tp x cp x pp x dp. ep is no
dimension of its own: its ranks are carved out of dp (consecutive dp ranks, the dp stride apart).

This module imports nothing of berth: the specs import it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum


class Axis(StrEnum):
    """A parallel axis; the value is the Layout field, the torchtitan mesh name and the plan's word."""

    TP = "tp"  # tensor parallelism (Megatron-LM column/row-parallel linears)
    CP = "cp"  # context parallelism (ring / all-gather KV attention over sequence chunks)
    PP = "pp"  # pipeline parallelism (layers split into stages)
    DP = "dp"  # data parallelism (replicate x shard under ZeRO / FSDP)
    EP = "ep"  # expert parallelism (MoE experts spread over ranks carved out of dp)


@dataclass(frozen=True)
class AxisFacts:
    """What the rest of berth needs to know of an axis."""

    axis: Axis
    title: str  # the plan's and the docs' name of it
    ordered: bool  # one of the axes `Layout.axis_order` permutes (tp, dp, pp)
    spans_world: bool  # a factor of the world size (ranks = the product of these axes' sizes)
    outside: Axis | None  # placed right outside this axis in every order (cp: outside tp)
    within: Axis | None  # carved out of this axis's ranks, no rank dimension of its own (ep: dp)
    mesh_dims: tuple[str, ...]  # the executor's DeviceMesh dimensions it becomes (executor/parallel.py)


AXES: dict[Axis, AxisFacts] = {
    a.axis: a
    for a in (
        AxisFacts(Axis.TP, "tensor", ordered=True, spans_world=True, outside=None, within=None, mesh_dims=("tp",)),
        AxisFacts(Axis.CP, "context", ordered=False, spans_world=True, outside=Axis.TP, within=None, mesh_dims=("cp",)),
        AxisFacts(
            Axis.DP, "data", ordered=True, spans_world=True, outside=None, within=None, mesh_dims=("replicate", "shard")
        ),  # FSDP2's hybrid mesh: replicate outside shard
        AxisFacts(Axis.PP, "pipeline", ordered=True, spans_world=True, outside=None, within=None, mesh_dims=("pp",)),
        AxisFacts(Axis.EP, "expert", ordered=False, spans_world=False, outside=None, within=Axis.DP, mesh_dims=()),
    )
}

ORDERED_AXES: tuple[str, ...] = tuple(a.axis.value for a in AXES.values() if a.ordered)  # ("tp", "dp", "pp")
# the executor's DeviceMesh, outermost first (torchtitan: pp, dp_replicate, dp_shard, cp, tp)
MESH_AXES: tuple[Axis, ...] = (Axis.PP, Axis.DP, Axis.CP, Axis.TP)
MESH_DIMS: tuple[str, ...] = tuple(d for a in MESH_AXES for d in AXES[a].mesh_dims)
MESH_DIM_AXIS: dict[str, str] = {d: a.value for a in MESH_AXES for d in AXES[a].mesh_dims}  # mesh dim -> axis


def with_cp(order) -> tuple[str, ...]:
    """An axis order (innermost first, of the ordered axes tp, dp and pp) with every unordered
    world axis placed right outside the axis it sits beside (cp: right outside tp)."""
    beside = {f.outside.value: f.axis.value for f in AXES.values() if f.outside is not None and f.spans_world}
    out: list[str] = []
    for axis in order:
        out.append(axis)
        if axis in beside:
            out.append(beside[axis])
    return tuple(out)


# the axes whose sizes multiply to the world size, innermost first in the default order tp-dp-pp:
# ("tp", "cp", "dp", "pp")
RANK_AXES: tuple[str, ...] = with_cp(ORDERED_AXES)
