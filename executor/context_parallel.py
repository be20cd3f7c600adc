"""Context parallelism with PyTorch's context-parallel API (torch.distributed.tensor.experimental),
as torchtitan applies it: the same calls on every device.

- `apply_cp`: `_enable_context_parallel_dispatcher()` routes the fused SDPA ops of sequence-sharded
  DTensors (aten._scaled_dot_product_{flash,efficient,cudnn}_attention and their backwards) to the
  API's ring attention (`_templated_ring_attention`: the local block first, then the cp - 1 blocks
  of K and V passed around the ring, each partial output merged by its log-sum-exp in fp32;
  backward passes K, V and the partial dK, dV the same way). The `_ContextParallel` style on every
  Attention's inner `CausalAttention` (executor/model.py) wraps q, k, v as DTensors sharded on the
  sequence dim of the cp mesh and unwraps the output. `set_rotate_method(ROTATE_METHOD)`.
- `shard_batch`: `_context_parallel_shard` with the API's head-tail load balancer
  (`_HeadTailLoadBalancer`: rank r holds chunks r and 2cp-1-r of the 2 cp chunks of every sequence,
  so every rank has the same causal work); it also switches the ring to its load-balanced schedule.
- `ContextParallel.positions`: the global positions of a rank's tokens, from the same load balancer's
  indices, for the rotary embedding.

The CPU stand-in for the fused kernel. On CUDA, F.scaled_dot_product_attention of the DTensors selects
flash (or efficient / cuDNN) attention and the API takes it from there. CPU SDPA selects
aten._scaled_dot_product_flash_attention_for_cpu or the math path, which the API does not shard
(torch 2.13: "Operator aten._scaled_dot_product_flash_attention_for_cpu.default does not have a
sharding strategy registered"), and aten._scaled_dot_product_flash_attention has no CPU kernel. So on
CPU `CausalAttention` calls aten._scaled_dot_product_flash_attention itself, and `apply_cp` registers
`flash_attention_cpu` / `flash_attention_backward_cpu` as its CPU kernel (torch.library, only while
the op has none): exact softmax attention in fp32 returning the output and the fp32 log-sum-exp
(batch, heads, q_len) that the ring merges, as the CUDA flash kernel does, with grouped-query
attention (fewer K/V heads) as flash supports it. Everything above the kernel (the DTensor dispatch,
the ring, the merge, the load balancer) is the API's own code, the same on GPU and CPU.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

FLASH_OP = "aten::_scaled_dot_product_flash_attention"
FLASH_BACKWARD_OP = "aten::_scaled_dot_product_flash_attention_backward"
# "alltoall": every ring step sends the rank's current K, V block to the next rank (a permutation
# all-to-all: the point-to-point ring of Liu et al. 2023 that cost_models/step.py cp_exchange_s
# prices); the API's default "allgather" gathers all blocks at the first step instead
ROTATE_METHOD = "alltoall"

_LIBRARY: torch.library.Library | None = None  # keeps the CPU kernels registered for the process


def _expand(kv: torch.Tensor, heads: int) -> torch.Tensor:
    """K or V with each of its heads repeated for the query heads of its group (grouped-query)."""
    groups = heads // kv.shape[1]
    return kv.repeat_interleave(groups, dim=1) if groups > 1 else kv


def _scores(query: torch.Tensor, key: torch.Tensor, is_causal: bool, scale: float | None) -> tuple[torch.Tensor, float]:
    scale = query.shape[-1] ** -0.5 if scale is None else scale
    s = torch.matmul(query.float(), _expand(key, query.shape[1]).float().transpose(-2, -1)) * scale
    if is_causal:
        if query.shape[2] != key.shape[2]:
            raise NotImplementedError("causal attention with unequal query and key lengths")
        keep = torch.ones(query.shape[2], key.shape[2], dtype=torch.bool, device=query.device).tril()
        s = s.masked_fill(~keep, float("-inf"))
    return s, scale


def flash_attention_cpu(
    query, key, value, dropout_p=0.0, is_causal=False, return_debug_mask=False, *, scale=None
) -> tuple:
    """aten._scaled_dot_product_flash_attention on CPU: (output, logsumexp, cum_seq_q, cum_seq_k,
    max_q, max_k, rng_state, unused, debug_attn_mask) as the CUDA kernel returns them for dense
    inputs (cum_seq_* undefined, an empty debug mask)."""
    if dropout_p != 0.0 or return_debug_mask:
        raise NotImplementedError("the CPU flash attention stand-in has no dropout and no debug mask")
    s, _ = _scores(query, key, is_causal, scale)
    lse = torch.logsumexp(s, dim=-1)
    out = torch.matmul(torch.exp(s - lse.unsqueeze(-1)), _expand(value, query.shape[1]).float())
    empty = query.new_empty(0)
    seed, offset = torch.empty(2, dtype=torch.uint64), torch.empty((), dtype=torch.uint64)
    return out.to(query.dtype), lse, None, None, query.shape[2], key.shape[2], seed, offset, empty


def flash_attention_backward_cpu(
    grad_out,
    query,
    key,
    value,
    out,
    logsumexp,
    cum_seq_q,
    cum_seq_k,
    max_q,
    max_k,
    dropout_p,
    is_causal,
    philox_seed,
    philox_offset,
    *,
    scale=None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The flash backward from the saved output and log-sum-exp (Dao 2023, Alg. 2): P = exp(S - lse),
    dV = P^T dO, dS = P (dO V^T - rowsum(dO * O)), dQ = scale dS K, dK = scale dS^T Q; a K/V head's
    gradients summed over its query-head group. With the ring's merged output and log-sum-exp this
    gives a block's exact share of the gradients."""
    s, scale = _scores(query, key, is_causal, scale)
    p = torch.exp(s - logsumexp.float().unsqueeze(-1))
    d_out = grad_out.float()
    d_value = torch.matmul(p.transpose(-2, -1), d_out)
    d_p = torch.matmul(d_out, _expand(value, query.shape[1]).float().transpose(-2, -1))
    d_s = p * (d_p - (d_out * out.float()).sum(-1, keepdim=True))
    d_query = torch.matmul(d_s, _expand(key, query.shape[1]).float()) * scale
    d_key = torch.matmul(d_s.transpose(-2, -1), query.float()) * scale
    groups = query.shape[1] // key.shape[1]
    if groups > 1:
        b, h, n, _ = d_key.shape
        d_key = d_key.view(b, h // groups, groups, n, -1).sum(2)
        d_value = d_value.view(b, h // groups, groups, n, -1).sum(2)
    return d_query.to(query.dtype), d_key.to(key.dtype), d_value.to(value.dtype)


def register_cpu_flash_kernel() -> bool:
    """Register the CPU stand-in for aten._scaled_dot_product_flash_attention and its backward,
    only where the op has no CPU kernel; True if this call registered it."""
    global _LIBRARY
    if torch._C._dispatch_has_kernel_for_dispatch_key(FLASH_OP, "CPU"):
        return False
    library = torch.library.Library("aten", "IMPL")
    library.impl(FLASH_OP.split("::")[1], flash_attention_cpu, "CPU")
    if not torch._C._dispatch_has_kernel_for_dispatch_key(FLASH_BACKWARD_OP, "CPU"):
        library.impl(FLASH_BACKWARD_OP.split("::")[1], flash_attention_backward_cpu, "CPU")
    _LIBRARY = library
    return True


def load_balancer(seq_len: int, cp: int, device: torch.device | str) -> Any:
    """torch's head-tail load balancer (chunks r and 2cp-1-r of every sequence on cp rank r)."""
    from torch.distributed.tensor.experimental._attention import _HeadTailLoadBalancer

    return _HeadTailLoadBalancer(seq_len, cp, device)


class ContextParallel:
    """This rank's place in its cp group, for the rotary positions of the tokens it holds."""

    def __init__(self, rank: int, size: int):
        self.rank, self.size = rank, size
        self._positions: dict[tuple[int, str], torch.Tensor] = {}  # every layer asks for the same ones

    def positions(self, local_len: int, device: torch.device | str) -> torch.Tensor:
        """Global positions of this rank's `local_len` tokens: its shard of the load balancer's order."""
        key = (local_len, str(device))
        if key not in self._positions:
            order = load_balancer(local_len * self.size, self.size, device)._generate_indices()[0]
            self._positions[key] = order.chunk(self.size)[self.rank].to(device)
        return self._positions[key]


def apply_cp(model: nn.Module, cp_mesh, rank: int) -> None:
    """Ring attention over `cp_mesh` (a 1-D DeviceMesh) on every Attention of `model`."""
    from torch.distributed.tensor.experimental._attention import (
        _ContextParallel,
        _enable_context_parallel_dispatcher,
        set_rotate_method,
    )
    from torch.distributed.tensor.parallel import parallelize_module

    from berth.executor.model import Attention

    if cp_mesh.device_type == "cpu":
        register_cpu_flash_kernel()
    _enable_context_parallel_dispatcher()
    set_rotate_method(ROTATE_METHOD)
    style = _ContextParallel(seq_dim=2, attention_type=_ContextParallel.AttentionType.SDPA)
    place = ContextParallel(rank, cp_mesh.size())
    for sub in model.modules():
        if isinstance(sub, Attention):
            sub.context_parallel = place
            parallelize_module(sub.inner, cp_mesh, style)


def shard_batch(cp_mesh, tensors: list[torch.Tensor], seq_dim: int = 1) -> list[torch.Tensor]:
    """This rank's tokens of full sequences (`seq_dim`), by the API's head-tail load balancer."""
    from torch.distributed.tensor.experimental._attention import _context_parallel_shard

    seq_len = tensors[0].shape[seq_dim]
    balancer = load_balancer(seq_len, cp_mesh.size(), tensors[0].device)
    shards = _context_parallel_shard(cp_mesh, tensors, [seq_dim] * len(tensors), load_balancer=balancer)
    return [t for t in shards if isinstance(t, torch.Tensor)]  # tensors in, tensors out (no BlockMask)
