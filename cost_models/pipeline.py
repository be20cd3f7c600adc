"""Pipeline schedules: micro-batches in flight per stage and the bubble.

GPipe (Huang et al. 2019) runs all m forwards before the backwards, so every stage holds m
micro-batches; with one stage there is no pipeline (each micro-batch's backward follows its
forward, as gradient accumulation does), so it holds one, whatever the schedule is called.
1F1B (PipeDream-Flush; Narayanan 2021 Sec. 2.2.1) holds at most p - i on stage i.
The interleaved schedule with v chunks per rank (Narayanan 2021 Sec. 2.2.2) warms up with
(p - i - 1) x 2 + (v - 1) x p chunk-micro-batches plus the one in flight (Megatron-LM
schedules.py); on stage 0 that is L(1 + (p - 1)/(pv)) layers' worth (Korthikanti 2022 Sec. 4.2.3).
The bubble is (p - 1)/v micro-batch times (Narayanan 2021, Sec. 2.2).
"""

from __future__ import annotations

import numpy as np

from berth.cost_models.arrays import ArrayOrFloat
from berth.specs.candidates import SCHEDULE_GPIPE, SCHEDULE_INTERLEAVED


def layers_in_flight(num_layers: int, pp, vpp, nmb, schedule, stage, stage_layers=None) -> np.ndarray:
    """Layer-micro-batches whose activations stage `stage` holds at its peak. `stage_layers`: the
    decoder layers of that stage (specs/stages.py; default num_layers / pp, the even split); under
    the interleaved schedule its in-flight chunks are counted at the stage's mean chunk size."""
    pp = np.asarray(pp, dtype=float)
    vpp = np.asarray(vpp, dtype=float)
    nmb = np.asarray(nmb, dtype=float)
    per_stage = num_layers / pp if stage_layers is None else np.asarray(stage_layers, dtype=float)
    gpipe = nmb * per_stage
    one_f_one_b = np.minimum(nmb, pp - stage) * per_stage
    chunks = np.minimum(nmb * vpp, (pp - stage - 1.0) * 2.0 + (vpp - 1.0) * pp + 1.0)
    interleaved = chunks * per_stage / vpp
    return np.where(
        (schedule == SCHEDULE_GPIPE) & (pp > 1),
        gpipe,
        np.where(schedule == SCHEDULE_INTERLEAVED, interleaved, one_f_one_b),
    )


def microbatches_in_flight(pp, vpp, nmb, schedule, stage) -> np.ndarray:
    """Micro-batches that have started but not finished their backward on `stage` (for the
    per-micro-batch buffers such as embedding outputs)."""
    return layers_in_flight(1, pp, vpp, nmb, schedule, stage) * np.asarray(pp, dtype=float)


def bubble_s(pp, vpp, mean_microbatch_s) -> ArrayOrFloat:
    """Idle time of the pipeline fill and drain: (p - 1)/v micro-batch times."""
    return (np.asarray(pp, dtype=float) - 1.0) / np.asarray(vpp, dtype=float) * mean_microbatch_s
