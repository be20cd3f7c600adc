"""The device an executor process runs on, and CUDA set up before anything asks it for memory.

Every entry point (berth.executor.worker, berth.executor.proxy, berth.executor.profile and its collective workers)
gets its device here. On CUDA, `init_cuda` selects the device and initialises CUDA (the caching
allocator and the device's context) before the first memory call: `torch.cuda.reset_peak_memory_stats`,
`max_memory_reserved` and `memory_allocated` go straight to the allocator without initialising
CUDA themselves, and on a fresh process they fail with "Invalid device argument" (what
`berth validate --proxy rank-slice` hit on an H100).
"""

from __future__ import annotations

import os

import torch

from berth.executor.checks import REQUIRE_GPU_ENV

_READY: set[int] = set()


def cuda_wanted() -> bool:
    """CUDA is used when torch sees a GPU, unless BERTH_DEVICE=cpu."""
    return os.environ.get("BERTH_DEVICE", "auto") != "cpu" and torch.cuda.is_available()


def init_cuda(device: torch.device) -> torch.device:
    """Select `device` and initialise CUDA on it (idempotent): set_device, the lazy init that
    creates the caching allocator, and a synchronize that creates the device's context."""
    index = device.index if device.index is not None else 0
    if index not in _READY:
        torch.cuda.set_device(index)
        torch.cuda.init()
        torch.cuda.synchronize(index)
        _READY.add(index)
    return torch.device("cuda", index)


def rank_device(local_rank: int | None = None, need_gpu: bool | None = None) -> torch.device:
    """This process's device: cuda:LOCAL_RANK (initialised) when CUDA is wanted, else the CPU.
    `need_gpu` (default: $BERTH_REQUIRE_GPU=1, which `berth validate` sets for a GPU plan): running
    on the CPU would measure the wrong machine, so it is an error."""
    if need_gpu is None:
        need_gpu = os.environ.get(REQUIRE_GPU_ENV) == "1"
    if not cuda_wanted():
        if need_gpu:
            raise RuntimeError(
                "the plan is for GPUs but torch sees no CUDA device (torch "
                f"{torch.__version__}, BERTH_DEVICE={os.environ.get('BERTH_DEVICE', 'auto')})"
            )
        return torch.device("cpu")
    local = int(os.environ.get("LOCAL_RANK", "0")) if local_rank is None else local_rank
    return init_cuda(torch.device("cuda", local))
