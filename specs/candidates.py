"""Candidate layouts as a struct of numpy arrays (one entry per candidate), one column per Layout
field, named as the field (choice fields hold codes into their CHOICES)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields

import numpy as np

from berth.specs.axes import RANK_AXES, with_cp
from berth.specs.tree import AXIS_ORDER_CHOICES, RECOMPUTE_CHOICES, SCHEDULE_CHOICES, Layout

RECOMPUTE_NONE, RECOMPUTE_SELECTIVE, RECOMPUTE_FULL = 0, 1, 2
SCHEDULE_GPIPE, SCHEDULE_1F1B, SCHEDULE_INTERLEAVED = 0, 1, 2
_NOT_GIVEN = np.ones(0, dtype=np.int64)  # default of the optional columns: __post_init__ puts ones in its place


@dataclass(frozen=True)
class Candidates:
    tp: np.ndarray
    pp: np.ndarray
    dp: np.ndarray
    shard: np.ndarray
    zero_stage: np.ndarray
    recompute: np.ndarray  # codes into RECOMPUTE_CHOICES
    micro_batch_size: np.ndarray
    num_microbatches: np.ndarray
    virtual_stages: np.ndarray
    schedule: np.ndarray  # codes into SCHEDULE_CHOICES
    sequence_parallel: np.ndarray  # 0/1
    axis_order: np.ndarray  # codes into AXIS_ORDER_CHOICES (innermost axis first)
    # context-parallel degree (not given: 1 for every candidate); cp sits right outside tp
    cp: np.ndarray = field(default_factory=lambda: _NOT_GIVEN)
    ep: np.ndarray = field(
        default_factory=lambda: _NOT_GIVEN
    )  # expert-parallel degree (carved out of dp); ones when not given
    # expert-tensor-parallel degree in effect (Layout.etp: tp where the layout leaves expert_tp out); tp when not given
    expert_tp: np.ndarray = field(default_factory=lambda: _NOT_GIVEN)

    def __post_init__(self) -> None:
        if self.cp is _NOT_GIVEN:
            object.__setattr__(self, "cp", np.ones_like(self.tp))
        if self.ep is _NOT_GIVEN:
            object.__setattr__(self, "ep", np.ones_like(self.tp))
        if self.expert_tp is _NOT_GIVEN:
            object.__setattr__(self, "expert_tp", self.tp)

    def __len__(self) -> int:
        return int(self.tp.shape[0])

    @classmethod
    def from_layouts(cls, layouts: list[Layout]) -> Candidates:
        def col(values: list[int]) -> np.ndarray:
            return np.asarray(values, dtype=np.int64)

        return cls(
            tp=col([x.tp for x in layouts]),
            pp=col([x.pp for x in layouts]),
            dp=col([x.dp for x in layouts]),
            shard=col([x.shard for x in layouts]),
            zero_stage=col([x.zero_stage for x in layouts]),
            recompute=col([RECOMPUTE_CHOICES.index(x.recompute) for x in layouts]),
            micro_batch_size=col([x.micro_batch_size for x in layouts]),
            num_microbatches=col([x.num_microbatches for x in layouts]),
            virtual_stages=col([x.virtual_stages for x in layouts]),
            schedule=col([SCHEDULE_CHOICES.index(x.schedule) for x in layouts]),
            sequence_parallel=col([int(x.sequence_parallel) for x in layouts]),
            axis_order=col([AXIS_ORDER_CHOICES.index(x.axis_order) for x in layouts]),
            cp=col([x.cp for x in layouts]),
            ep=col([x.ep for x in layouts]),
            expert_tp=col([x.etp for x in layouts]),
        )

    def layout(self, i: int) -> Layout:
        return Layout(
            tp=int(self.tp[i]),
            pp=int(self.pp[i]),
            dp=int(self.dp[i]),
            shard=int(self.shard[i]),
            zero_stage=int(self.zero_stage[i]),
            recompute=RECOMPUTE_CHOICES[int(self.recompute[i])],
            micro_batch_size=int(self.micro_batch_size[i]),
            num_microbatches=int(self.num_microbatches[i]),
            virtual_stages=int(self.virtual_stages[i]),
            schedule=SCHEDULE_CHOICES[int(self.schedule[i])],
            sequence_parallel=bool(self.sequence_parallel[i]),
            axis_order=AXIS_ORDER_CHOICES[int(self.axis_order[i])],
            cp=int(self.cp[i]),
            ep=int(self.ep[i]),
            expert_tp=None if self.expert_tp[i] == self.tp[i] else int(self.expert_tp[i]),
        )

    def strides(self) -> dict[str, np.ndarray]:
        """Rank distance between neighbours along tp, cp, dp and pp: the product of the sizes of the axes inside it
        in the candidate's axis order, cp right outside tp (tp-dp-pp: 1, tp, tp x cp, tp x cp x dp)."""
        sizes = {axis: getattr(self, axis) for axis in RANK_AXES}
        out = {axis: np.ones(len(self), dtype=np.int64) for axis in sizes}
        for code, name in enumerate(AXIS_ORDER_CHOICES):
            mask = self.axis_order == code
            if not mask.any():
                continue
            stride = np.ones(len(self), dtype=np.int64)
            for axis in with_cp(name.split("-")):
                out[axis] = np.where(mask, stride, out[axis])
                stride = stride * sizes[axis]
        return out

    def take(self, index: np.ndarray | slice) -> Candidates:
        return Candidates(**{f.name: getattr(self, f.name)[index] for f in fields(self)})

    @classmethod
    def concat(cls, parts: list[Candidates]) -> Candidates:
        return cls(**{f.name: np.concatenate([getattr(p, f.name) for p in parts]) for f in fields(cls)})
