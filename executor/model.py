"""A GPT/Llama-style decoder built from a ModelSpec (the one conversion from spec to runtime).

Projections have no bias and are separate matrices (wq, wk, wv, wo; w1, w2 and, for SwiGLU, w3)
so that DTensor's colwise/rowwise plans split them by heads and by ffn columns. The attention
reads the local head count from the tensor shapes, so the same code runs unsplit or tp-split.
Positions use rotary embeddings (no parameters), so the parameter count equals
ModelSpec.num_params exactly.

Context parallelism runs on PyTorch's context-parallel API (executor/context_parallel.py `apply_cp`,
called by executor/parallel.py): the batch is split by its head-tail load balancer (a rank holds
chunks r and 2cp-1-r of the 2 cp chunks of every sequence, the split of torchtitan and Megatron-LM),
each Attention rotates its tokens at their global positions (`ContextParallel`), and its inner
`CausalAttention` module, wrapped by the API's `_ContextParallel` style, receives q, k, v as
sequence-sharded DTensors whose fused SDPA op the API runs as ring attention.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor

from berth.cost_models.memory import vocab_rows
from berth.specs.tree import ModelSpec

if TYPE_CHECKING:
    from berth.executor.context_parallel import ContextParallel

ROPE_THETA = 10000.0
INIT_STD = 0.02  # GPT-2 / Megatron initialization
RESIDUAL_PROJECTIONS = ("wo", "w2")  # scaled by 1/sqrt(2L): they add into the residual stream


def norm_layer(spec: ModelSpec) -> nn.Module:
    return nn.RMSNorm(spec.hidden_size) if spec.norm == "rmsnorm" else nn.LayerNorm(spec.hidden_size)


def rotary(x: torch.Tensor, positions: torch.Tensor | None = None) -> torch.Tensor:
    """Rotary position embedding on (batch, heads, seq, head_dim) (Su et al. 2021); `positions`:
    the tokens' global positions (default 0..seq-1)."""
    seq, dim = x.shape[-2], x.shape[-1]
    inv = 1.0 / (ROPE_THETA ** (torch.arange(0, dim, 2, device=x.device, dtype=torch.float32) / dim))
    if positions is None:  # one kernel, as the H100 measurements ran it (benchmarks/op_census.py counts it)
        positions = torch.arange(seq, device=x.device, dtype=torch.float32)
    angles = torch.outer(positions.to(device=x.device, dtype=torch.float32), inv)
    cos, sin = angles.cos().to(x.dtype), angles.sin().to(x.dtype)
    x1, x2 = x[..., 0::2], x[..., 1::2]
    return torch.stack((x1 * cos - x2 * sin, x1 * sin + x2 * cos), dim=-1).flatten(-2)


# devices whose SDPA never reaches a fused op the context-parallel API shards (CausalAttention)
STAND_IN_DEVICES = ("cpu",)


class CausalAttention(nn.Module):
    """Causal softmax attention of (batch, heads, seq, head_dim) q, k, v; k and v may have fewer
    heads (grouped-query). Context parallelism wraps it (executor/context_parallel.py, torchtitan's
    inner attention): q, k, v then arrive as sequence-sharded DTensors, and the fused SDPA op they
    reach runs as the API's ring attention. On CUDA that op is what F.scaled_dot_product_attention
    selects (flash, efficient or cuDNN); on CPU, whose SDPA selects ops the API cannot shard, the
    flash op is called directly and runs the CPU stand-in kernel executor/context_parallel.py
    registers."""

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        groups = q.shape[1] // k.shape[1]
        if not isinstance(q, DTensor):  # one rank holds the whole sequence
            if groups > 1:
                k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
            return F.scaled_dot_product_attention(q, k, v, is_causal=True)
        if q.device.type in STAND_IN_DEVICES:
            return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=True)[0]
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=groups > 1)


class Attention(nn.Module):
    """`tp` > 1 builds one tensor-parallel rank's slice (heads / tp) directly (rank-slice proxy)."""

    def __init__(self, spec: ModelSpec, tp: int = 1):
        super().__init__()
        h, d = spec.hidden_size, spec.head_dim
        heads, kv = spec.num_attention_heads // tp, spec.kv_heads // tp
        self.head_dim = d
        self.wq = nn.Linear(h, heads * d, bias=False)
        self.wk = nn.Linear(h, kv * d, bias=False)
        self.wv = nn.Linear(h, kv * d, bias=False)
        self.wo = nn.Linear(heads * d, h, bias=False)
        self.inner = CausalAttention()
        self.context_parallel: ContextParallel | None = None  # set by executor/context_parallel.py apply_cp

    def core(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """Scores, softmax and context: the part selective recomputation re-runs."""
        return self.inner(q, k, v)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        k = self.wk(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        v = self.wv(x).view(b, s, -1, self.head_dim).transpose(1, 2)
        cp = self.context_parallel
        pos = cp.positions(s, x.device) if cp is not None else None  # global positions of this rank's tokens
        out = self.core(rotary(q, pos), rotary(k, pos), v)
        return self.wo(out.transpose(1, 2).reshape(b, s, -1))


class MLP(nn.Module):
    def __init__(self, spec: ModelSpec, tp: int = 1, ffn: int | None = None):
        super().__init__()
        h, f = spec.hidden_size, (ffn or spec.ffn_hidden_size) // tp
        self.w1 = nn.Linear(h, f, bias=False)
        self.w2 = nn.Linear(f, h, bias=False)
        self.w3 = nn.Linear(h, f, bias=False) if spec.mlp == "swiglu" else None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.w3 is not None:
            return self.w2(F.silu(self.w1(x)) * self.w3(x))
        return self.w2(F.gelu(self.w1(x)))


class AllToAll(torch.autograd.Function):
    """torch.distributed.all_to_all_single with uneven splits, differentiable: the backward sends
    the gradients back along the reversed splits (gloo implements all_to_all_single on CPU)."""

    @staticmethod
    def forward(ctx, x, send: list[int], recv: list[int], group) -> torch.Tensor:
        ctx.send, ctx.recv, ctx.group = send, recv, group
        out = x.new_empty((sum(recv), *x.shape[1:]))
        dist.all_to_all_single(out, x.contiguous(), recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad) -> tuple[torch.Tensor, None, None, None]:
        out = grad.new_empty((sum(ctx.send), *grad.shape[1:]))
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class MoE(nn.Module):
    """A mixture-of-experts MLP (Mixtral / DeepSeek style): a router (h x E linear), softmax over the
    experts, the top-k kept and renormalized, each token's output the weighted sum of its k experts
    (SwiGLU or GELU MLPs of moe_ffn_hidden_size), plus the shared experts (one MLP of
    num_shared x their ffn, the same function as their sum). No capacity limit: no token is dropped,
    so one process and any ep give the same result up to summation order.

    Expert parallelism (`berth.executor.parallel.apply_ep`): the experts are a ModuleDict keyed by their
    global index; a rank keeps its num_experts / ep of them and `ep_group` is set. The (token, expert)
    pairs are sorted by expert, sent to the rank holding the expert with one all-to-all (dispatch),
    run there, and sent back with a second (combine); backward runs the two in reverse."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.top_k = spec.experts_per_token
        self.num_experts = spec.num_experts
        self.router = nn.Linear(spec.hidden_size, spec.num_experts, bias=False)
        self.experts = nn.ModuleDict({str(e): MLP(spec, ffn=spec.expert_ffn) for e in range(spec.num_experts)})
        self.shared = MLP(spec, ffn=spec.num_shared_experts * spec.shared_ffn) if spec.num_shared_experts else None
        self.ep_group = None
        self.ep_size = 1

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        probs = F.softmax(self.router(x).float(), dim=-1)
        weights, experts = torch.topk(probs, self.top_k, dim=-1)
        return (weights / weights.sum(-1, keepdim=True)).to(x.dtype), experts

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        weights, experts = self.route(x)
        token = torch.arange(x.shape[0], device=x.device).repeat_interleave(self.top_k)
        expert, weight = experts.reshape(-1), weights.reshape(-1)
        order = torch.argsort(expert, stable=True)
        token, expert, weight = token[order], expert[order], weight[order]
        inputs = x[token]
        out = self._run_local(inputs, expert) if self.ep_group is None else self._dispatch(inputs, expert)
        y = torch.zeros_like(x).index_add(0, token, out * weight[:, None])
        if self.shared is not None:
            y = y + self.shared(x)
        return y.reshape(shape)

    def _run_local(self, inputs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        out = torch.zeros_like(inputs)
        for key, module in self.experts.items():
            rows = (expert == int(key)).nonzero().squeeze(1)
            out = out.index_copy(0, rows, module(inputs[rows]))
        return out

    def _dispatch(self, inputs: torch.Tensor, expert: torch.Tensor) -> torch.Tensor:
        per_rank = self.num_experts // self.ep_size
        send = torch.bincount(expert // per_rank, minlength=self.ep_size)
        recv = torch.empty_like(send)
        dist.all_to_all_single(recv, send, group=self.ep_group)
        send_list, recv_list = send.tolist(), recv.tolist()
        recv_expert = expert.new_empty(sum(recv_list))
        dist.all_to_all_single(recv_expert, expert.contiguous(), recv_list, send_list, group=self.ep_group)
        received = AllToAll.apply(inputs, send_list, recv_list, self.ep_group)
        out = self._run_local(received, recv_expert)
        return AllToAll.apply(out, recv_list, send_list, self.ep_group)


class Block(nn.Module):
    def __init__(self, spec: ModelSpec, tp: int = 1, index: int = 0):
        super().__init__()
        self.attention_norm = norm_layer(spec)
        self.attention = Attention(spec, tp)
        self.ffn_norm = norm_layer(spec)
        moe = spec.is_moe and index >= spec.first_k_dense
        self.feed_forward = MoE(spec) if moe else MLP(spec, tp)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


def padded_vocab(spec: ModelSpec, tp: int = 1) -> int:
    """The vocabulary the executor builds: vocab_size padded to a multiple of tp, so the embedding and the
    LM head split evenly over the tensor-parallel ranks (Megatron-LM and torchtitan likewise run any
    vocabulary at any tp). The rows per rank are the cost model's (`berth.cost_models.memory.vocab_rows`,
    the one rule). The padded ids are never inputs nor targets (`synthetic_batch` draws from vocab_size)
    and their logits are masked out of the softmax (`_pad_vocabulary`): the padded model computes what
    the unpadded one does."""
    return int(vocab_rows(spec, tp)) * tp


def _pad_vocabulary(model: Decoder, vocab: int) -> None:
    """Grow the embedding and the LM head to `vocab` rows: the real rows keep their weights (the same
    draws as the unpadded model), the padded rows are zeros, and the head gets a frozen bias of 0 on the
    real logits and -inf on the padded ones, so they take no share of the softmax, get no gradient and
    stay zero (tensor parallelism shards the bias with the head's rows: ColwiseParallel)."""
    spec = model.spec
    real, h = spec.vocab_size, spec.hidden_size
    if vocab == real or model.tok_embeddings is None or model.output is None:
        return
    rng = torch.get_rng_state()  # building modules draws an init: keep the global stream as unpadded
    emb = nn.Embedding(vocab, h)
    head = nn.Linear(h, vocab, bias=True)
    torch.set_rng_state(rng)
    with torch.no_grad():
        emb.weight.zero_()
        emb.weight[:real] = model.tok_embeddings.weight
        head.weight.zero_()
        head.weight[:real] = model.output.weight
        head.bias.zero_()
        head.bias[real:] = float("-inf")
    head.bias.requires_grad_(False)
    if spec.tied_embeddings:
        head.weight = emb.weight
    model.tok_embeddings, model.output = emb, head


class Decoder(nn.Module):
    """Embedding, blocks, final norm, LM head. Layers live in a ModuleDict keyed by their global
    index so a pipeline stage can drop the others and keep names stable (torchtitan's pattern);
    a stage without the embedding or head has them set to None."""

    def __init__(self, spec: ModelSpec):
        super().__init__()
        self.spec = spec
        self.tok_embeddings: nn.Embedding | None = nn.Embedding(spec.vocab_size, spec.hidden_size)
        self.layers = nn.ModuleDict({str(i): Block(spec, index=i) for i in range(spec.num_layers)})
        self.norm: nn.Module | None = norm_layer(spec)
        self.output: nn.Linear | None = nn.Linear(spec.hidden_size, spec.vocab_size, bias=False)
        if spec.tied_embeddings:
            self.output.weight = self.tok_embeddings.weight

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        h = self.tok_embeddings(tokens) if self.tok_embeddings is not None else tokens
        for layer in self.layers.values():
            h = layer(h)
        h = self.norm(h) if self.norm is not None else h
        return self.output(h) if self.output is not None else h


def build_model(spec: ModelSpec, seed: int = 0, dtype: torch.dtype = torch.float32, tp: int = 1) -> Decoder:
    """The same weights on every rank for the same seed (the build order the reference notes); the
    vocabulary padded to a multiple of the layout's `tp` (`padded_vocab`, `_pad_vocabulary`)."""
    torch.manual_seed(seed)
    model = Decoder(spec)
    residual_std = INIT_STD / (2 * spec.num_layers) ** 0.5
    for name, p in model.named_parameters():
        if p.dim() > 1:
            residual = name.rsplit(".", 2)[-2] in RESIDUAL_PROJECTIONS
            nn.init.normal_(p, mean=0.0, std=residual_std if residual else INIT_STD)
    _pad_vocabulary(model, padded_vocab(spec, tp))
    return model.to(dtype)


def synthetic_batch(
    spec: ModelSpec, batch: int, seq_len: int, seed: int, step: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """Token ids and next-token targets from a fixed seed (the same on every rank).

    Each sequence walks a fixed random successor map over the vocabulary from a random start, so
    the data are learnable (the loss falls within a few steps) yet cost nothing to make."""
    successor = torch.randperm(spec.vocab_size, generator=torch.Generator().manual_seed(seed))
    g = torch.Generator().manual_seed(seed * 1_000_003 + step + 1)
    data = torch.empty(batch, seq_len + 1, dtype=torch.long)
    data[:, 0] = torch.randint(0, spec.vocab_size, (batch,), generator=g)
    for i in range(seq_len):
        data[:, i + 1] = successor[data[:, i]]
    return data[:, :-1].contiguous(), data[:, 1:].contiguous()


def loss_fn(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits.float().flatten(0, 1), targets.flatten(0, 1))
