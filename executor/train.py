"""Run a layout's training steps with torch.distributed (gloo on CPU, NCCL on CUDA).

This module covers the data-parallel axis (dp, shard, zero_stage), activation recomputation and
gradient accumulation. Layouts with tp > 1 or pp > 1 are refused with a clear message until the
tensor- and pipeline-parallel paths land.

Build order (shared/reference/torch-distributed-cpu.md): identical seeded model on every rank,
activation checkpointing per block, then the data-parallel wrapper.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch
import torch.distributed as dist
from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import fully_shard
from torch.distributed.optim import ZeroRedundancyOptimizer
from torch.nn.parallel import DistributedDataParallel
from torch.utils.checkpoint import checkpoint

from executor.model import Attention, build_model, loss_fn, synthetic_batch
from planner.specs import Layout, ModelSpec, TrainingSpec

LEARNING_RATE = 1e-3


class UnsupportedLayout(ValueError):
    pass


@dataclass
class StepRecord:
    losses: list[float] = field(default_factory=list)
    step_times_s: list[float] = field(default_factory=list)


def check_supported(layout: Layout) -> None:
    if layout.tp > 1 or layout.pp > 1:
        raise UnsupportedLayout(f"layout {layout.short()}: the executor runs dp/zero/recompute layouts "
                                "only so far (tp = pp = 1)")


def _selective(model) -> None:
    """Re-run the attention core (scores, softmax, context) in backward (Korthikanti 2022)."""
    for module in model.modules():
        if isinstance(module, Attention):
            core = module.core
            module.core = lambda q, k, v, _core=core: checkpoint(_core, q, k, v, use_reentrant=False)


def prepare(spec: ModelSpec, layout: Layout, seed: int, world: int):
    """Model and optimizer for this rank with the layout's recompute and data parallelism."""
    model = build_model(spec, seed)
    if layout.recompute == "full":
        for key, block in list(model.layers.items()):
            model.layers[key] = checkpoint_wrapper(block)
    elif layout.recompute == "selective":
        _selective(model)
    if world == 1:
        return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=False)
    if layout.zero_stage <= 1:
        ddp = DistributedDataParallel(model)
        if layout.zero_stage == 1:
            opt = ZeroRedundancyOptimizer(ddp.parameters(), optimizer_class=torch.optim.AdamW, lr=LEARNING_RATE)
        else:
            opt = torch.optim.AdamW(ddp.parameters(), lr=LEARNING_RATE, foreach=False)
        return ddp, opt
    replicate = layout.dp // layout.shard
    mesh = (init_device_mesh("cpu", (replicate, layout.shard), mesh_dim_names=("replicate", "shard"))
            if replicate > 1 else init_device_mesh("cpu", (layout.shard,), mesh_dim_names=("shard",)))
    reshard = layout.zero_stage >= 3
    for block in model.layers.values():
        fully_shard(block, mesh=mesh, reshard_after_forward=reshard)
    fully_shard(model, mesh=mesh, reshard_after_forward=reshard)
    return model, torch.optim.AdamW(model.parameters(), lr=LEARNING_RATE, foreach=False)


def run_steps(spec: ModelSpec, training: TrainingSpec, layout: Layout, steps: int, seed: int = 0) -> StepRecord:
    """Train `steps` steps; every rank takes its dp slice of the same seeded global batch.
    Returns the global-batch mean loss of each step and the wall time of each step."""
    check_supported(layout)
    world = dist.get_world_size() if dist.is_initialized() else 1
    rank = dist.get_rank() if dist.is_initialized() else 0
    model, opt = prepare(spec, layout, seed, world)
    per_rank = layout.micro_batch_size * layout.num_microbatches
    record = StepRecord()
    for step in range(steps):
        tokens, targets = synthetic_batch(spec, training.global_batch_size, training.seq_len, seed, step)
        mine = slice(rank * per_rank, (rank + 1) * per_rank)
        tokens, targets = tokens[mine], targets[mine]
        if world > 1:
            dist.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        total = torch.zeros(())
        for mb in range(layout.num_microbatches):
            rows = slice(mb * layout.micro_batch_size, (mb + 1) * layout.micro_batch_size)
            loss = loss_fn(model(tokens[rows]), targets[rows]) / layout.num_microbatches
            loss.backward()
            total += loss.detach()
        opt.step()
        record.step_times_s.append(time.perf_counter() - start)
        if world > 1:
            dist.all_reduce(total)
            total /= world
        record.losses.append(total.item())
    return record
