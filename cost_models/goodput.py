"""Checkpoints, failures, goodput and cost of every candidate (vectorized).

Checkpoint: the persistent training state is the model weights in the compute precision plus
the optimizer's K bytes per parameter (fp32 master, Adam moments; Rajbhandari 2020 Sec. 3.1).
The ranks that hold distinct state write it in parallel: one data-parallel replica
(tp x pp ranks, x ep with expert parallelism), or tp x pp x shard x cp ranks when ZeRO shards the
state (`checkpoint_bytes`). Writing takes
the longer of total / the filesystem's aggregate write bandwidth and one writer's share / one
client's write bandwidth (a synchronous checkpoint: training stalls for it).

Failures: a job on N GPUs fails at rate N x (failures per GPU-hour); its mean time between
failures is M. Young (1974) gives the checkpoint interval that maximizes useful work,
tau = sqrt(2 delta M); Daly (2006, Eq. 37) adds higher-order terms,
tau = sqrt(2 delta M) [1 + sqrt(delta / 2M) / 3 + (delta / 2M) / 9] - delta for delta < 2M, else M.
Each failure loses on average half an interval of compute plus its checkpoint and the restart
time R. To first order (Young 1974), the useful fraction of wall time is
  tau / (tau + delta) x (1 - (R + (tau + delta) / 2) / M),
and goodput = tokens/s x that fraction.

Cost: GPU-hours x price; energy from the device TDP (an upper bound: GPUs rarely draw TDP).
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import numpy as np

from berth.cost_models import memory
from berth.cost_models.arrays import ArrayOrFloat
from berth.specs.candidates import Candidates
from berth.specs.engines import split_rule
from berth.specs.tree import ClusterSpec, ModelSpec, TrainingSpec

SECONDS_PER_HOUR = 3600.0
JOULES_PER_KWH = 3.6e6


@dataclass(frozen=True)
class Goodput:
    checkpoint_bytes_total: np.ndarray
    checkpoint_bytes_per_rank: np.ndarray
    checkpoint_writers: np.ndarray
    checkpoint_write_s: np.ndarray
    mtbf_s: float
    checkpoint_interval_s: np.ndarray
    lost_work_per_failure_s: np.ndarray
    checkpoint_stall_s_per_step: np.ndarray
    goodput_fraction: ArrayOrFloat
    goodput_tokens_per_s: np.ndarray

    def at(self, i: int) -> dict[str, float]:
        """Candidate i's figures as plain floats."""
        return {f.name: float(v if np.ndim(v) == 0 else v[i]) for f in fields(self) for v in [getattr(self, f.name)]}


def checkpoint_bytes(
    model: ModelSpec, training: TrainingSpec, c: Candidates
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(total bytes, bytes per writing rank, writers) of one checkpoint.

    The writers are the ranks holding distinct state: a replica's tp x pp ranks; x ep where the
    routed experts are split over ep ranks; under ZeRO >= 1, x shard x cp (the state is sharded over
    shard x cp ranks: cost_models/memory.py, model_state_bytes), the experts' over shard / ep x cp of
    each expert group (memory.expert_candidates). Per rank: the stage that holds the most (the
    first or last stage an embedding more, a middle one more layers when the split is uneven), its
    dense and expert parts each divided by the ranks sharing them."""
    per_param = training.bytes_per_element + training.optimizer_bytes_per_param
    total = np.full(len(c), float(model.num_params * per_param))
    zero = np.asarray(c.zero_stage) >= 1
    ep = np.maximum(np.asarray(c.ep, dtype=float), 1.0)
    shard_cp = np.asarray(c.shard, dtype=float) * np.asarray(c.cp, dtype=float)
    dense_ranks = np.where(zero, shard_cp, 1.0)
    # the experts' states shard over their expert-data-parallel share of the ZeRO group (memory.expert_candidates)
    expert_ranks = np.where(zero, memory.expert_candidates(c).shard * c.cp, 1.0)
    writers = (c.tp * c.pp) * np.where(zero, np.maximum(shard_cp, ep), ep)
    stage, share = memory.expert_share(model, c, split_rule(training))
    per_rank = stage * per_param * ((1.0 - share) / dense_ranks + share / expert_ranks)
    return total, per_rank, writers.astype(float)


def daly_interval_s(write_s, mtbf_s: float) -> np.ndarray:
    """Daly 2006, Eq. 37: the checkpoint interval (compute time between checkpoints)."""
    write_s = np.asarray(write_s, dtype=float)
    x = write_s / (2.0 * mtbf_s)
    tau = np.sqrt(2.0 * write_s * mtbf_s) * (1.0 + np.sqrt(x) / 3.0 + x / 9.0) - write_s
    return np.where(write_s < 2.0 * mtbf_s, np.maximum(tau, write_s), mtbf_s)


def useful_fraction(interval_s, write_s, restart_s: float, mtbf_s: float) -> ArrayOrFloat:
    """Young 1974 to first order: the share of wall time that is useful training."""
    interval_s, write_s = np.asarray(interval_s, dtype=float), np.asarray(write_s, dtype=float)
    lost = restart_s + (interval_s + write_s) / 2.0
    return np.clip(interval_s / (interval_s + write_s) * (1.0 - lost / mtbf_s), 0.0, 1.0)


def goodput(
    model: ModelSpec, training: TrainingSpec, cluster: ClusterSpec, c: Candidates, step_time_s, tokens_per_s
) -> Goodput:
    total, per_rank, writers = checkpoint_bytes(model, training, c)
    aggregate = cluster.storage_write_bytes_per_s_per_gpu * cluster.world_size
    write_s = np.maximum(total / aggregate, per_rank / cluster.storage_client_write_bytes_per_s)
    mtbf_s = SECONDS_PER_HOUR / (cluster.failures_per_gpu_hour * cluster.world_size)
    interval = np.maximum(daly_interval_s(write_s, mtbf_s), step_time_s)  # at most one checkpoint a step
    fraction = useful_fraction(interval, write_s, cluster.restart_s, mtbf_s)
    return Goodput(
        checkpoint_bytes_total=total,
        checkpoint_bytes_per_rank=per_rank,
        checkpoint_writers=writers,
        checkpoint_write_s=write_s,
        mtbf_s=mtbf_s,
        checkpoint_interval_s=interval,
        lost_work_per_failure_s=cluster.restart_s + (interval + write_s) / 2.0,
        checkpoint_stall_s_per_step=write_s * step_time_s / interval,
        goodput_fraction=fraction,
        goodput_tokens_per_s=tokens_per_s * fraction,
    )


def cost(cluster: ClusterSpec, step_time_s, goodput_tokens_per_s, token_budget: float | None) -> dict[str, np.ndarray]:
    """Cost per step, per million useful tokens and for the token budget (None without a price),
    and energy per million useful tokens in kWh from the device TDP (None without one)."""
    world = cluster.world_size
    out = {}
    if cluster.price_per_gpu_hour is not None:
        per_second = world * cluster.price_per_gpu_hour / SECONDS_PER_HOUR
        out["cost_per_step"] = per_second * step_time_s
        out["cost_per_million_tokens"] = per_second / goodput_tokens_per_s * 1e6
        if token_budget:
            out["cost_for_token_budget"] = per_second * token_budget / goodput_tokens_per_s
    if cluster.device.tdp_watts:
        watts = world * cluster.device.tdp_watts
        out["energy_kwh_per_million_tokens"] = watts / goodput_tokens_per_s * 1e6 / JOULES_PER_KWH
    return out
