"""Op census: the bytes a decoder layer's non-GEMM, non-attention kernels move, counted from the code.

Why: the bundled executor's layer work outside GEMMs and attention is fitted to an H100
(`benchmarks/layer_fidelity.py`, hardware_profiles/devices/h100-sxm.json `frameworks.pytorch`).
Other eager stacks (torchtitan) were never measured here; their entry is derived by counting what
their layer does against what the executor's does, with the same instrument, on CPU:

- The layer runs forward and backward under a TorchDispatchMode that sees every aten kernel. Each
  kernel that is not a view, a GEMM (mm, addmm, bmm) or the attention kernel counts its tensors'
  bytes (inputs and outputs, each at its own size: what a streaming kernel reads and writes) and
  one dispatch. Bytes are split by what they scale with (`_kind`): the layer's weights (casts,
  gradient casts), the ffn intermediate (tokens x ffn), per-token scalars (ignored), and the
  rest (tokens x hidden: norms, rotary, residual adds, activation casts, K/V expansion).
- The executor's `nn.RMSNorm` is one fused kernel each way on CUDA (aten::_fused_rms_norm, PyTorch
  >= 2.9; the H100 measurements ran 2.11), where CPU decomposes it: it is counted as one kernel
  (`_FusedNorm`). torchtitan's hand-written RMSNorm is eager Python ops on every device.
- `TorchtitanBlock` transcribes the ops of torchtitan's Llama block at the commit its published
  H100 benchmark ran (pytorch/torchtitan 9dec370, 2024-12, `torchtitan/models/llama/model.py`,
  `torchtitan/models/norms.py`, train_configs/llama3_8b.toml `norm_type = "rmsnorm"`): fp32 RMSNorm
  (`x.float()`, pow, mean, rsqrt, mul, `type_as`, times weight), complex-multiply rotary in fp32,
  `repeat_kv` (expand + reshape copies), contiguous attention output, SwiGLU, bf16 residual stream
  (FSDP2 bf16 parameters, no autocast).

Derivation (`derive`): the torchtitan entry of each device = that device's executor entry x
(torchtitan count / executor count): hidden bytes forward and backward by their byte ratio (the
executor's fitted bytes per counted byte carry over: same GPU, same kind of eager kernels), host
dispatch by the ratio of kernel counts (GEMM and attention launches included). ffn bytes are the
executor's (the census counts the same SwiGLU); weight bytes: none forward (bf16 parameters),
6 per parameter backward (bf16 gradient to fp32 for FSDP2's fp32 reduce-scatter); the exposed share of
the host/device overlap is the executor's.

Run: `python -m benchmarks.op_census` prints the census and the derived values and saves
benchmarks/results/op_census.json; `--write` also stores the derived entries in every device
profile that has a "torchtitan" entry.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from berth.executor.model import Block
from berth.specs.tree import ModelSpec

DEVICES = Path(__file__).resolve().parents[1] / "hardware_profiles" / "devices"
OUT = Path(__file__).parent / "results" / "op_census.json"
# A small Llama-3-shaped layer (GQA ratio 1/4 as Llama 3 8B/70B/405B; ffn 3x) on CPU: every count
# is per token and per hidden (or ffn) unit, so the size only needs to separate the kinds.
HIDDEN, HEADS, KV_HEADS, FFN, SEQ = 512, 8, 2, 1536, 256
GEMMS = {"mm", "addmm", "bmm"}
ATTENTION = {"_scaled_dot_product_flash_attention_for_cpu", "_scaled_dot_product_flash_attention_for_cpu_backward"}
NO_DATA = {"_unsafe_view", "detach", "alias", "ones_like"}  # views or the loss seed, not layer work
TT_WEIGHT_BYTES_BWD = 6.0  # bf16 gradient cast to fp32 for the reduce-scatter (FSDP2 reduce_dtype fp32)
ROPE_THETA = 500_000.0
DERIVED = (
    "hidden_bytes_fwd",
    "hidden_bytes_bwd",
    "dispatch_fwd_s",
    "dispatch_bwd_s",
    "weight_bytes_fwd",
    "weight_bytes_bwd",
    "dispatch_exposed_fraction",
)


class _Census(TorchDispatchMode):
    def __init__(self, ffn: int, weight_shapes: set[tuple[int, ...]]):
        super().__init__()
        self.ffn, self.weight_shapes = ffn, weight_shapes
        self.bytes = {"hidden": 0, "ffn": 0, "weight": 0, "per_token": 0}
        self.kernels = {"other": 0, "gemm": 0, "attention": 0}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func.is_view or name in NO_DATA:
            return out
        if name in GEMMS or name in ATTENTION:
            self.kernels["gemm" if name in GEMMS else "attention"] += 1
            return out
        tensors = [t for t in tree_flatten((args, kwargs, out))[0] if isinstance(t, torch.Tensor)]
        self.kernels["other"] += 1
        self.bytes[self._kind(tensors)] += sum(t.numel() * t.element_size() for t in tensors)
        return out

    def _kind(self, tensors) -> str:
        if any(t.dim() == 2 and tuple(t.shape) in self.weight_shapes for t in tensors):
            return "weight"
        if any(t.dim() >= 2 and t.shape[-1] == self.ffn for t in tensors):
            return "ffn"
        if max(t.numel() for t in tensors) < SEQ * HIDDEN // 8:
            return "per_token"  # rsqrt of a (tokens, 1) statistic, rotary tables: negligible
        return "hidden"


class _FusedNorm(torch.autograd.Function):
    """CUDA's fused RMSNorm as the census sees it: one kernel reading x and the weight and writing y
    forward; one reading the gradient, x and the weight and writing the input gradient backward."""

    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x, weight)
        return torch.ops.aten.mul.Tensor(x, weight)

    @staticmethod
    def backward(ctx, grad):
        x, weight = ctx.saved_tensors
        return torch.ops.aten.addcmul.default(grad, x, weight), None


def _fuse_norms(block: nn.Module) -> None:
    for m in block.modules():
        if isinstance(m, nn.RMSNorm):
            m.forward = lambda x, m=m: _FusedNorm.apply(x, m.weight)


# ----------------------------------------------------- torchtitan's Llama block at 9dec370 (2024-12)
class _TTNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        return (y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)).type_as(x) * self.weight


def _rotary(xq, xk, angles):
    q = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    k = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    angles = angles.view(1, q.shape[1], 1, q.shape[-1])
    return torch.view_as_real(q * angles).flatten(3).type_as(xq), torch.view_as_real(k * angles).flatten(3).type_as(xk)


def _repeat_kv(x, n: int):
    b, s, kv, d = x.shape
    return x if n == 1 else x[:, :, :, None, :].expand(b, s, kv, n, d).reshape(b, s, kv * n, d)


class TorchtitanBlock(nn.Module):
    """The ops of torchtitan's Llama TransformerBlock at 9dec370 (bf16 parameters, as FSDP2 gathers them)."""

    def __init__(self, h: int, heads: int, kv_heads: int, ffn: int, seq: int):
        super().__init__()
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, h // heads
        d = self.head_dim
        self.wq, self.wk = nn.Linear(h, heads * d, bias=False), nn.Linear(h, kv_heads * d, bias=False)
        self.wv, self.wo = nn.Linear(h, kv_heads * d, bias=False), nn.Linear(heads * d, h, bias=False)
        self.w1, self.w3 = nn.Linear(h, ffn, bias=False), nn.Linear(h, ffn, bias=False)
        self.w2 = nn.Linear(ffn, h, bias=False)
        self.attention_norm, self.ffn_norm = _TTNorm(h), _TTNorm(h)
        inv = 1.0 / (ROPE_THETA ** (torch.arange(0, d, 2).float() / d))
        freqs = torch.outer(torch.arange(seq, dtype=torch.float32), inv)
        self.angles = torch.polar(torch.ones_like(freqs), freqs)  # complex64, not a buffer: .to(bf16) leaves it

    def attention(self, x):
        b, s, _ = x.shape
        q = self.wq(x).view(b, s, -1, self.head_dim)
        k = self.wk(x).view(b, s, -1, self.head_dim)
        v = self.wv(x).view(b, s, -1, self.head_dim)
        q, k = _rotary(q, k, self.angles)
        n = self.heads // self.kv_heads
        k, v = _repeat_kv(k, n), _repeat_kv(v, n)
        o = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), is_causal=True)
        return self.wo(o.transpose(1, 2).contiguous().view(b, s, -1))

    def forward(self, x):
        h = x + self.attention(self.attention_norm(x))
        z = self.ffn_norm(h)
        return h + self.w2(F.silu(self.w1(z)) * self.w3(z))


class MPTBlock(nn.Module):
    """The ops of llm-foundry's MPT block as its A100 benchmarks ran it (mosaicml/llm-foundry
    b2a43a147, 2023-10, `llmfoundry/models/layers/blocks.py`, `attention.py`, `norm.py`, yamls
    `scripts/train/yamls/pretrain/mpt-*.yaml`): low-precision LayerNorm (one bf16 kernel), fused
    Wqkv with bias split into views, the Triton flash kernel on (b, s, h, d) views (no copies),
    GELU MLP with biases, bf16 residual stream (FSDP mixed precision DEFAULT: bf16 parameters)."""

    def __init__(self, h: int, heads: int, ffn: int):
        super().__init__()
        self.heads = heads
        self.norm_1, self.norm_2 = nn.LayerNorm(h), nn.LayerNorm(h)
        self.Wqkv, self.out_proj = nn.Linear(h, 3 * h), nn.Linear(h, h)
        self.up_proj, self.down_proj = nn.Linear(h, ffn), nn.Linear(ffn, h)

    def forward(self, x):
        b, s, h = x.shape
        q, k, v = self.Wqkv(self.norm_1(x)).chunk(3, dim=2)
        q, k, v = (t.view(b, s, self.heads, -1).transpose(1, 2) for t in (q, k, v))
        o = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.out_proj(o.transpose(1, 2).reshape(b, s, h))
        return x + self.down_proj(F.gelu(self.up_proj(self.norm_2(x))))


def census(block: nn.Module, x: torch.Tensor, autocast: bool) -> dict:
    """Per pass: bytes per token per hidden unit, per token per ffn unit, per weight parameter, and
    kernels (non-GEMM/attention, GEMM, attention)."""
    weights = [p for p in block.parameters() if p.dim() == 2]
    shapes = {tuple(p.shape) for p in weights}
    tokens, nparams = x.shape[0] * x.shape[1], sum(p.numel() for p in weights)
    fwd = _Census(FFN, shapes)
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), fwd:
        y = block(x)
    bwd = _Census(FFN, shapes)
    grad = torch.randn_like(y)
    with bwd:
        y.backward(grad)

    def per(c: _Census) -> dict:
        return {
            "hidden_bytes": c.bytes["hidden"] / (tokens * HIDDEN),
            "ffn_bytes": c.bytes["ffn"] / (tokens * FFN),
            "weight_bytes": c.bytes["weight"] / nparams,
            "kernels": c.kernels,
            "all_kernels": sum(c.kernels.values()),
        }

    return {"forward": per(fwd), "backward": per(bwd)}


def executor_census() -> dict:
    spec = ModelSpec(
        name="census",
        num_layers=1,
        hidden_size=HIDDEN,
        num_attention_heads=HEADS,
        num_kv_heads=KV_HEADS,
        ffn_hidden_size=FFN,
        vocab_size=1024,
        mlp="swiglu",
        norm="rmsnorm",
    )
    torch.manual_seed(0)
    block = Block(spec)
    _fuse_norms(block)
    return census(block, torch.randn(1, SEQ, HIDDEN, requires_grad=True), autocast=True)


def torchtitan_census() -> dict:
    torch.manual_seed(0)
    block = TorchtitanBlock(HIDDEN, HEADS, KV_HEADS, FFN, SEQ).to(torch.bfloat16)
    x = torch.randn(1, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True)
    return census(block, x, autocast=False)


def mpt_census() -> dict:
    torch.manual_seed(0)
    block = MPTBlock(HIDDEN, HEADS, FFN).to(torch.bfloat16)
    return census(block, torch.randn(1, SEQ, HIDDEN, dtype=torch.bfloat16, requires_grad=True), autocast=False)


def derive(executor_entry: dict, executor: dict, torchtitan: dict) -> dict:
    """The torchtitan entry from a device's executor entry and the two censuses (module docstring)."""
    ratio = {p: torchtitan[p]["hidden_bytes"] / executor[p]["hidden_bytes"] for p in ("forward", "backward")}
    kernels = {p: torchtitan[p]["all_kernels"] / executor[p]["all_kernels"] for p in ("forward", "backward")}
    return {
        **executor_entry,
        "hidden_bytes_fwd": round(executor_entry["hidden_bytes_fwd"] * ratio["forward"], 2),
        "hidden_bytes_bwd": round(executor_entry["hidden_bytes_bwd"] * ratio["backward"], 2),
        "dispatch_fwd_s": round(executor_entry["dispatch_fwd_s"] * kernels["forward"], 7),
        "dispatch_bwd_s": round(executor_entry["dispatch_bwd_s"] * kernels["backward"], 7),
        "weight_bytes_fwd": 0.0,
        "weight_bytes_bwd": TT_WEIGHT_BYTES_BWD,
        "dispatch_exposed_fraction": executor_entry["dispatch_exposed_fraction"],
    }


STACKS = {"torchtitan": torchtitan_census, "llmfoundry": mpt_census}  # derived entries, by profile key


def run(write: bool = False) -> dict:
    ex = executor_census()
    counts = {name: make() for name, make in STACKS.items()}
    result = {
        "shape": {"hidden": HIDDEN, "heads": HEADS, "kv_heads": KV_HEADS, "ffn": FFN, "seq": SEQ},
        "census": {"executor": ex, **counts},
        "devices": {},
    }
    for path in sorted(DEVICES.glob("*.json")):
        data = json.loads(path.read_text())
        frameworks = data.get("frameworks", {})
        if "pytorch" not in frameworks or "torchtitan" not in frameworks:
            continue
        entries = {}
        for name, count in counts.items():
            derived = derive(frameworks["pytorch"], ex, count)
            # the stored entry's keys and order, and what the census does not derive (optimizer,
            # loss, exposed fraction: as the torchtitan entry's)
            base = frameworks.get(name, frameworks["torchtitan"])
            entries[name] = {k: derived[k] if k in DERIVED else v for k, v in base.items()}
        result["devices"][data["name"]] = entries
        if write and any(frameworks.get(n) != e for n, e in entries.items()):
            frameworks.update(entries)
            path.write_text(json.dumps(data, indent=2) + "\n")
    return result


def main(argv: list[str]) -> int:
    result = run(write="--write" in argv)
    for name, c in result["census"].items():
        f, b = c["forward"], c["backward"]
        print(
            f"{name:<12} forward: {f['hidden_bytes']:6.1f} B/token/hidden, {f['ffn_bytes']:4.1f} B/token/ffn, "
            f"{f['weight_bytes']:3.1f} B/param, {f['all_kernels']:3d} kernels;  backward: {b['hidden_bytes']:6.1f}, "
            f"{b['ffn_bytes']:4.1f}, {b['weight_bytes']:3.1f}, {b['all_kernels']:3d} kernels"
        )
    for device, entries in result["devices"].items():
        for name, entry in entries.items():
            print(
                f"  {device:<10} {name:<11} hidden {entry['hidden_bytes_fwd']}/{entry['hidden_bytes_bwd']} B, "
                f"dispatch {entry['dispatch_fwd_s'] * 1e3:.3f}/{entry['dispatch_bwd_s'] * 1e3:.3f} ms"
            )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2) + "\n")
    print(f"saved {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
