"""Context parallelism in the cost model: cp = 2 halves the activations and the attention work a rank
holds, keeps its parameters, and adds a KV exchange that is positive when nothing hides it and grows
with the sequence; the validity rules and the search's cp values."""

import numpy as np
import pytest

from berth.cost_models import compute, flops, memory, step
from berth.planner.search import cp_options, search
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.layouts import check_layout
from berth.specs.models import load_model
from berth.specs.tree import Layout, SearchSpec, TrainingSpec
from berth.specs.validity import REASON_CODES, structural_reasons
from berth.topology.clusters import cluster_from_preset

MODEL = load_model("llama3-8b")
CLUSTER = cluster_from_preset("dgx-h100", 2)
TRAINING = TrainingSpec(seq_len=32768, global_batch_size=16)


def test_cp2_halves_activation_memory_and_attention_per_rank_but_not_parameters():
    one, two = (
        Candidates.from_layouts([Layout(cp=cp, dp=16 // cp, micro_batch_size=1, num_microbatches=cp)]) for cp in (1, 2)
    )
    device = CLUSTER.device
    m1 = memory.stage_memory_breakdown(MODEL, TRAINING, device, one, first=True)
    m2 = memory.stage_memory_breakdown(MODEL, TRAINING, device, two, first=True)
    assert m2["activations"][0] == pytest.approx(m1["activations"][0] / 2, rel=1e-12)
    assert m2["logits"][0] == pytest.approx(m1["logits"][0] / 2, rel=1e-12)
    # the parameters are not split by cp (DDP here); ZeRO / FSDP shard them over shard x cp (torchtitan's
    # dp_shard_cp mesh, Megatron's distributed optimizer over dp x cp)
    assert m2["parameters"][0] == pytest.approx(m1["parameters"][0], rel=1e-12)
    z1, z2 = (
        Candidates.from_layouts(
            [Layout(cp=cp, dp=16 // cp, zero_stage=3, shard=16 // cp, micro_batch_size=1, num_microbatches=cp)]
        )
        for cp in (1, 2)
    )
    p1 = memory.stage_memory_breakdown(MODEL, TRAINING, device, z1, first=True)["parameters"][0]
    p2 = memory.stage_memory_breakdown(MODEL, TRAINING, device, z2, first=True)["parameters"][0]
    assert p2 == pytest.approx(p1, rel=1e-12)  # 16 ranks share them either way
    # attention: b s / cp queries against all s keys = total / cp FLOPs; the time follows within the kernel's
    # efficiency by shape (fewer rows per call)
    f1, b1 = compute.attention_core_s(MODEL, TRAINING, device, 1.0, 2)
    f2, b2 = compute.attention_core_s(MODEL, TRAINING, device, 0.5, 2)
    assert 0.5 <= f2 / f1 < 0.55 and 0.5 <= b2 / b1 < 0.55
    total = flops.attention_core_flops(MODEL, TRAINING.seq_len, 1)
    assert flops.attention_core_flops(MODEL, TRAINING.seq_len, 0.5) == pytest.approx(total / 2)
    # GEMMs see half the tokens
    g1, g2 = (
        compute.layer_gemm_forward_s(MODEL, TRAINING, device, 1.0, 2),
        compute.layer_gemm_forward_s(MODEL, TRAINING, device, 0.5, 2),
    )
    assert 0.5 <= g2 / g1 < 0.56


@pytest.mark.parametrize("stride", [2, 8])  # inside a node (NVLink), across nodes (InfiniBand)
def test_kv_exchange_is_positive_unhidden_and_grows_with_seq(stride):
    def exposed(seq, attention_s=0.0):
        training = TrainingSpec(seq_len=seq, global_batch_size=16)
        fwd, bwd = step.cp_exchange_s(
            MODEL, training, CLUSTER, np.array([0.5]), 2.0, np.array([2]), stride, attention_s, 2.5 * attention_s
        )
        return float(fwd[0]), float(bwd[0])

    f8, b8 = exposed(8192)
    f32, b32 = exposed(32768)
    assert 0 < f8 < f32 and 0 < b8 < b32
    assert b32 > f32  # backward sends K, V and dK, dV, and accumulates dQ, dK, dV
    hidden_f, hidden_b = exposed(32768, attention_s=1.0)  # a long attention step hides the transfer:
    assert 0 < hidden_f < f32 and 0 < hidden_b < b32  # the per-step merges of partial results remain
    from berth.cost_models.comm import p2p_s
    from berth.cost_models.compute import memory_bound_time_s

    q = 0.5 * 32768 * MODEL.num_attention_heads / 2 * MODEL.head_dim
    kv = 2 * 0.5 * 32768 * MODEL.kv_heads / 2 * MODEL.head_dim * 2  # K and V blocks, bf16
    send = float(p2p_s(CLUSTER, kv, np.array([2.0]), stride)[0])
    # hidden behind attention, the transfer still slows it (step.OVERLAP_COMPUTE_SLOWDOWN)
    assert hidden_f == pytest.approx(
        memory_bound_time_s(CLUSTER.device, step.CP_MERGE_PASSES * 4 * q) + step.OVERLAP_COMPUTE_SLOWDOWN * send
    )
    fwd, _ = step.cp_exchange_s(MODEL, TRAINING, CLUSTER, np.array([1.0]), 2.0, np.array([1]), 2, 0.0, 0.0)
    assert fwd[0] == 0.0  # cp = 1: no exchange


def test_cp_rules_have_reasons():
    c = Candidates.from_layouts(
        [Layout(cp=3, dp=16 // 3 or 1), Layout(cp=16, micro_batch_size=16), Layout(cp=2, dp=8, micro_batch_size=2)]
    )
    short = TrainingSpec(seq_len=384, global_batch_size=16)
    reasons = structural_reasons(c, MODEL, short, CLUSTER)
    assert reasons[0] == REASON_CODES["world_size_mismatch"]
    assert reasons[1] == REASON_CODES["cp_chunk_too_small"]  # 384 / 32 = 12 tokens a chunk
    assert reasons[2] == 0
    odd = TrainingSpec(seq_len=1000, global_batch_size=16)
    assert (
        structural_reasons(Candidates.from_layouts([Layout(cp=16, micro_batch_size=16)]), MODEL, odd, CLUSTER)[0]
        == REASON_CODES["cp_not_divide_seq"]
    )
    unfused = TrainingSpec(seq_len=4096, global_batch_size=16, flash_attention=False)
    assert (
        structural_reasons(Candidates.from_layouts([Layout(cp=2, dp=8, micro_batch_size=2)]), MODEL, unfused, CLUSTER)[
            0
        ]
        == REASON_CODES["cp_needs_flash_attention"]
    )
    with pytest.raises(BerthError, match="flash_attention"):
        check_layout({"cp": 2, "dp": 8}, MODEL, unfused, CLUSTER)
    with pytest.raises(BerthError, match="2 x cp"):
        check_layout({"cp": 16}, MODEL, short, CLUSTER)


def test_search_enumerates_cp_by_its_rule_and_fix_reaches_it():
    assert cp_options(TrainingSpec(seq_len=32768, global_batch_size=8), 16) == [1, 2, 4, 8]
    assert cp_options(TrainingSpec(seq_len=8192, global_batch_size=8), 16) == [1, 2]
    assert cp_options(TrainingSpec(seq_len=4096, global_batch_size=8), 16) == [1]
    assert cp_options(TrainingSpec(seq_len=131072, global_batch_size=8), 16) == [1, 2, 4, 8, 16]
    assert cp_options(TrainingSpec(seq_len=131072, global_batch_size=8, flash_attention=False), 16) == [1]
    result = search(MODEL, TRAINING, CLUSTER, SearchSpec(top=3, fix={"cp": 4}))
    assert result.plans and all(p.layout.cp == 4 for p in result.plans)
    assert "cp=4" in result.plans[0].layout.short()
    groups = {g.axis: g for g in result.plans[0].placement.groups}
    assert groups["cp"].size == 4 and groups["cp"].stride == result.plans[0].layout.tp


def test_checkpoint_writers_count_the_cp_ranks_zero_shards_over():
    """ZeRO shards the state over shard x cp ranks: each writes its own share, and the shares add up
    to the checkpoint (pp = 1: one stage holds every parameter)."""
    from berth.cost_models.goodput import checkpoint_bytes

    training = TrainingSpec(seq_len=8192, global_batch_size=16)
    c = Candidates.from_layouts(
        [Layout(cp=2, dp=8, zero_stage=3, shard=8, micro_batch_size=1), Layout(cp=2, dp=8, micro_batch_size=1)]
    )
    total, per_rank, writers = checkpoint_bytes(MODEL, training, c)
    assert list(writers) == [16, 1]
    assert per_rank * writers == pytest.approx(total, rel=1e-9)


def test_zero_shards_over_cp_ranks_when_dp_is_one():
    """torchtitan's Table 2 layout (Llama 3 8B at 262,144 tokens: FSDP over the 8 cp ranks, dp_shard 1):
    with dp = 1 ZeRO still shards over shard x cp ranks, so the search enumerates shard = 1 under ZeRO
    when cp > 1, and a fixed cp = 8, zero = 3 finds it; without cp, shard = 1 under ZeRO is refused."""
    one_node = cluster_from_preset("dgx-h100", 1)
    training = TrainingSpec(seq_len=131072, global_batch_size=8)
    result = search(MODEL, training, one_node, SearchSpec(top=3, fix={"cp": 8, "zero_stage": 3}))
    assert result.plans
    best = result.plans[0]
    assert (best.layout.dp, best.layout.shard, best.layout.zero_stage) == (1, 1, 3)
    # without ZeRO every rank holds the whole model state: nothing at cp = 8 fits
    unsharded = search(MODEL, training, one_node, SearchSpec(top=1, fix={"cp": 8, "zero_stage": 0}))
    assert not unsharded.plans and unsharded.rejected == {"out_of_memory": unsharded.searched}
    with pytest.raises(BerthError, match="shard x cp"):
        search(
            MODEL,
            TrainingSpec(seq_len=4096, global_batch_size=8),
            one_node,
            SearchSpec(top=1, fix={"zero_stage": 3, "shard": 1}),
        )


# ---------------------------------------------------------------------------------------------
# the executor's context parallelism: PyTorch's context-parallel API (executor/context_parallel.py)

GQA = MODEL.model_copy(
    update={"name": "tiny-gqa", "num_layers": 1, "hidden_size": 64, "num_attention_heads": 4, "num_kv_heads": 2}
)


def test_cpu_flash_stand_in_matches_sdpa_and_registers_only_once():
    """The CPU kernel of aten._scaled_dot_product_flash_attention (the stand-in for the fused kernel
    the API's ring calls): output, fp32 log-sum-exp and, through autograd's own formula, the backward
    match F.scaled_dot_product_attention (fp32, grouped-query, causal and not); once registered, the op
    has a CPU kernel and a second registration is refused."""
    import torch

    from berth.executor.context_parallel import FLASH_OP, register_cpu_flash_kernel

    register_cpu_flash_kernel()
    assert torch._C._dispatch_has_kernel_for_dispatch_key(FLASH_OP, "CPU")
    assert register_cpu_flash_kernel() is False
    g = torch.Generator().manual_seed(0)
    for kv_heads, causal in ((2, True), (4, False)):
        q = torch.randn(2, 4, 12, 8, generator=g, requires_grad=True)
        k, v = (torch.randn(2, kv_heads, 12, 8, generator=g, requires_grad=True) for _ in range(2))
        out, lse = torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=causal)[:2]
        grad = torch.randn(out.shape, generator=g)
        mine = torch.autograd.grad(out, (q, k, v), grad)
        ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=kv_heads < 4)
        theirs = torch.autograd.grad(ref, (q, k, v), grad)
        assert torch.allclose(out, ref, rtol=1e-5, atol=1e-6)
        scores = q @ k.repeat_interleave(4 // kv_heads, 1).transpose(-2, -1) / 8**0.5
        if causal:
            scores = scores.masked_fill(~torch.ones(12, 12, dtype=torch.bool).tril(), float("-inf"))
        assert lse.dtype == torch.float32 and torch.allclose(lse, scores.logsumexp(-1), rtol=1e-5)
        for a, b in zip(mine, theirs, strict=True):
            assert torch.allclose(a, b, rtol=1e-5, atol=1e-6)


def _ring_worker(rank: int, world: int, store: str, out_dir: str) -> None:
    """One cp rank: a grouped-query Attention under executor/context_parallel.py apply_cp on the sharded
    sequence, run twice: on the CPU stand-in, then down CausalAttention's CUDA branch with
    F.scaled_dot_product_attention replaced by a recording stand-in for CUDA's SDPA selection (it calls
    the flash op, as bf16 on an H100 selects). Saves each run's output and gradients."""
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from berth.executor import model as model_module
    from berth.executor.context_parallel import apply_cp, shard_batch
    from berth.executor.model import Attention

    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=world)
    mesh = init_device_mesh("cpu", (world,), mesh_dim_names=("cp",))
    calls = []

    def recording_sdpa(q, k, v, *, is_causal, enable_gqa):
        calls.append((type(q).__name__, tuple(k.shape), is_causal, enable_gqa))
        return torch.ops.aten._scaled_dot_product_flash_attention(q, k, v, is_causal=is_causal)[0]

    runs = {}
    for branch in ("cpu_stand_in", "cuda_branch"):
        if branch == "cuda_branch":
            model_module.STAND_IN_DEVICES = ()
            model_module.F.scaled_dot_product_attention = recording_sdpa
        torch.manual_seed(0)
        attention = Attention(GQA)
        x, grad = torch.randn(2, 16, GQA.hidden_size), torch.randn(2, 16, GQA.hidden_size)
        apply_cp(attention, mesh["cp"], rank)
        x_local, grad_local = shard_batch(mesh["cp"], [x, grad])
        x_local.requires_grad_(True)
        out = attention(x_local)
        out.backward(grad_local)
        runs[branch] = {
            "out": out.detach(),
            "dx": x_local.grad,
            "dw": {n: p.grad for n, p in attention.named_parameters()},
            "calls": list(calls),
        }
    torch.save(runs, f"{out_dir}/{rank}.pt")
    dist.destroy_process_group()


def test_ring_attention_on_gloo_matches_one_process(tmp_path):
    """Two gloo ranks run a grouped-query attention layer through the API (the head-tail split, the
    DTensor dispatch, the ring, the log-sum-exp merge): each rank's output and input gradient equal the
    one-process layer's on its tokens, and the weight gradients summed over the ranks equal the
    one-process ones (fp32, rel 1e-5), on the CPU stand-in and down the CUDA branch. The CUDA branch
    hands F.scaled_dot_product_attention the DTensors with is_causal and the un-repeated K, V (flash's
    grouped-query support: the ring moves kv_heads, as cost_models/step.py cp_exchange_s counts)."""
    import torch
    import torch.multiprocessing as mp

    from berth.executor.model import Attention

    world = 2
    mp.spawn(_ring_worker, args=(world, str(tmp_path / "store"), str(tmp_path)), nprocs=world)
    torch.manual_seed(0)
    attention = Attention(GQA)
    x = torch.randn(2, 16, GQA.hidden_size, requires_grad=True)
    grad = torch.randn(2, 16, GQA.hidden_size)
    out = attention(x)
    out.backward(grad)
    ranks = [torch.load(tmp_path / f"{r}.pt") for r in range(world)]

    def rel(a, b):
        return float((a - b).norm() / b.norm())

    for branch in ("cpu_stand_in", "cuda_branch"):
        for r, runs in enumerate(ranks):
            saved = runs[branch]
            assert rel(saved["out"], _head_tail(out.detach(), r, world)) < 1e-5
            assert rel(saved["dx"], _head_tail(x.grad, r, world)) < 1e-5
            # one call per layer forward, K of kv_heads (the DTensor shape: the global sequence)
            want = [("DTensor", (2, 2, 16, 16), True, True)] if branch == "cuda_branch" else []
            assert saved["calls"] == want
        for name, p in attention.named_parameters():
            assert rel(sum(runs[branch]["dw"][name] for runs in ranks), p.grad) < 1e-5, (branch, name)


def _head_tail(t, rank: int, cp: int):
    """Chunks rank and 2cp-1-rank of the 2 cp chunks along dim 1 (the split the API's load balancer makes)."""
    import torch

    chunks = t.chunk(2 * cp, dim=1)
    return torch.cat([chunks[rank], chunks[2 * cp - 1 - rank]], dim=1)
