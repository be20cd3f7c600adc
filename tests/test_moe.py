"""Mixture of experts in the cost model: FLOPs of the active experts only, expert parameters split
by ep, the token all-to-all over the level the ep group spans, the ep rules, and plausibility of
the plans the search ranks first (Mixtral 8x7B on 16 H100, a DeepSeek-V3-style model on 1,024).

Plausibility, not a golden case: no published bf16 H100 training throughput of Mixtral or
DeepSeek with its full layout was found (DeepSeek-V3's own figures are FP8 on H800; Megatron-Core's
MoE README gives the Mixtral 8x7B recipe, EP8 x TP1 best, without a throughput). The bound on the
MFU of active parameters is the dense H100 range of tests/test_plausibility.py (Llama 3 70B/405B,
Dubey et al. 2024 Table 4: 38-43%, plus its 10% optimism) above, and half of its low end below:
an MoE step adds all-to-alls and smaller expert GEMMs to the dense work, so it reaches less.
"""

import numpy as np
import pytest

from berth.cost_models import comm, flops, memory
from berth.cost_models.step import MOE_IMBALANCE, evaluate
from berth.planner.search import predict_layouts, search
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.layouts import check_layout
from berth.specs.models import presets
from berth.specs.tree import Layout, SearchSpec, TrainingSpec
from berth.specs.validity import REASONS, structural_reasons
from berth.topology.clusters import cluster_from_preset

MIXTRAL = presets()["mixtral-8x7b"]
DEEPSEEK = presets()["deepseek-v3-style"]
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=256)
MFU_RANGE = (0.38 * 0.5, 0.43 * 1.1)


def test_flops_count_active_experts_only():
    b, s = TRAINING.global_batch_size, TRAINING.seq_len
    dense_twin = MIXTRAL.compute_view()  # one MLP of 2 x 14336: the two experts a token goes through
    assert dense_twin.ffn_hidden_size == 2 * 14336
    want = flops.model_flops_per_step(dense_twin, TRAINING) + 3 * 2.0 * b * s * 4096 * 8 * 32  # + router
    assert flops.model_flops_per_step(MIXTRAL, TRAINING) == pytest.approx(want, rel=1e-12)
    # ~6 x active parameters per token (the attention's s^2 terms aside)
    per_token = flops.model_flops_per_step(MIXTRAL, TRAINING) / (b * s)
    assert 6 * MIXTRAL.active_params < per_token < 6 * MIXTRAL.active_params * 1.3


def test_expert_parameters_and_their_states_split_by_ep():
    one, eight = (memory.stage_params(MIXTRAL, 1, 1, True, ep=ep) for ep in (1, 8))
    experts = MIXTRAL.expert_params_per_moe_layer * 32
    assert float(one) == pytest.approx(MIXTRAL.num_params)
    assert float(one - eight) == pytest.approx(experts * (1 - 1 / 8))
    # ZeRO-1 over dp 16: dense states / 16, expert states over dp / ep = 2 ranks, each holding 1 of 8 experts
    c = Candidates.from_layouts([Layout(dp=16, ep=8, zero_stage=1, shard=16, micro_batch_size=1, num_microbatches=16)])
    mem = memory.stage_memory_breakdown(MIXTRAL, TRAINING, cluster_from_preset("dgx-h100", 2).device, c, True)
    # beyond the dense twin's activations: top-k token copies and expert outputs (2 x k x h) and router probs (E)
    extra = memory.moe_activation_bytes(MIXTRAL, TRAINING, 1, 1, 0)
    assert extra == 4096 * (2 * 2 * 4096 * 2 + 4 * 8)
    adam = memory.ADAM_STATES * memory.FP32_BYTES
    want = adam * ((MIXTRAL.num_params - experts) / 16 + experts / 8 / 2)
    assert float(mem["optimizer_state"][0]) == pytest.approx(want, rel=1e-9)


def test_all_to_all_over_the_level_the_ep_group_spans():
    cluster = cluster_from_preset("dgx-h100", 2)
    nbytes = 64e6
    inside, across, none = comm.all_to_all_s(cluster, nbytes, np.array([8.0, 16.0, 1.0]), 1)
    assert none == 0.0
    node = cluster.levels[0].link
    assert inside == pytest.approx(
        nbytes * 7 / 8 / (node.bandwidth_bytes_per_s * node.collective_efficiency)
        + 7 * node.hop_latency_s
        + cluster.collective_base_latency_s
    )
    assert across > 5 * inside  # 16 ranks leave the node: the network share per GPU
    # the step: 4 all-to-alls per MoE layer and micro-batch, MOE_IMBALANCE x the mean load
    c = Candidates.from_layouts(
        [Layout(dp=16, ep=ep, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=16) for ep in (1, 8)]
    )
    ev = evaluate(MIXTRAL, TRAINING, cluster, c)
    dispatched = 2 * 4096 * 2 * 4096
    want = 16 * 32 * 4 * MOE_IMBALANCE * comm.all_to_all_s(cluster, dispatched, 8.0, 1)
    assert ev.time_breakdown_s["ep_comm"][0] == 0.0
    assert ev.time_breakdown_s["ep_comm"][1] == pytest.approx(want, rel=1e-9)


def test_ep_rules_and_refusals():
    cluster = cluster_from_preset("dgx-h100", 2)
    c = Candidates.from_layouts(
        [
            Layout(dp=16, ep=3, micro_batch_size=1, num_microbatches=16),
            Layout(dp=16, ep=16, micro_batch_size=1, num_microbatches=16),
            Layout(tp=8, dp=2, ep=4, micro_batch_size=1, num_microbatches=128),
        ]
    )
    names = [REASONS[r][0] for r in structural_reasons(c, MIXTRAL, TRAINING, cluster)]
    assert names == ["ep_not_divide_experts", "ep_not_divide_experts", "ep_not_divide_dp"]
    dense = presets()["tiny-gpt"]
    with pytest.raises(BerthError, match="mixture-of-experts"):
        check_layout({"dp": 16, "ep": 2}, dense, TRAINING, cluster)
    with pytest.raises(BerthError, match="must divide dp"):
        check_layout({"tp": 8, "ep": 4}, MIXTRAL, TRAINING, cluster)
    (plan,) = predict_layouts(
        MIXTRAL,
        TRAINING,
        cluster,
        [Layout(dp=16, ep=8, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=16)],
    )
    assert plan.layout.ep == 8 and plan.model_dump(mode="json")["layout"]["ep"] == 8
    (ep,) = [g for g in plan.placement.groups if g.axis == "ep"]  # inside a node: ep ranks are dp's innermost
    assert (ep.size, ep.stride, ep.nodes_spanned, ep.crosses_slow_link) == (8, 1, 1, False)
    assert ep.time_s == pytest.approx(plan.prediction.time_breakdown_s["ep_comm"])


@pytest.mark.parametrize(
    "model, nodes, batch", [(MIXTRAL, 2, 256), (DEEPSEEK, 128, 4096)], ids=["mixtral-8x7b-16", "deepseek-v3-style-1024"]
)
def test_top_plans_use_ep_within_plausible_mfu(model, nodes, batch):
    """The best plan's MFU (of active parameters) is in MFU_RANGE, and expert parallelism is among
    the top 5: for Mixtral on 16 H100 the best is ep2 (ZeRO-3, full recompute); for the DeepSeek-style
    model ep = 1 with tp4 pp16 and ep8 over dp 1,024 (ZeRO-3) come within 0.1% of each other."""
    training = TrainingSpec(seq_len=4096, global_batch_size=batch)
    result = search(model, training, cluster_from_preset("dgx-h100", nodes), SearchSpec(top=5))
    best = result.plans[0]
    assert MFU_RANGE[0] <= best.prediction.mfu <= MFU_RANGE[1], best.prediction.mfu
    assert any(p.layout.ep > 1 for p in result.plans), [p.layout.short() for p in result.plans]
    ep_plans = [p for p in result.plans if p.layout.ep > 1]
    assert all(p.prediction.time_breakdown_s["ep_comm"] > 0 for p in ep_plans)


def test_checkpoint_writers_hold_distinct_expert_shares():
    """Each ep rank holds other experts: without ZeRO the writers are tp x pp x ep, with ZeRO-1 over 16
    ranks each of 16 writes its shard of the dense part and of its expert group's experts; the shares
    add up to the checkpoint (pp = 1)."""
    from berth.cost_models.goodput import checkpoint_bytes

    c = Candidates.from_layouts(
        [
            Layout(dp=16, ep=8, micro_batch_size=1, num_microbatches=16),
            Layout(dp=16, ep=8, zero_stage=1, shard=16, micro_batch_size=1, num_microbatches=16),
        ]
    )
    total, per_rank, writers = checkpoint_bytes(MIXTRAL, TRAINING, c)
    assert list(writers) == [8, 16]
    assert per_rank[1] * writers[1] == pytest.approx(total[1], rel=1e-9)
    # without ZeRO, the rank writing the dense part writes it once, and its 1/8 of the experts
    per_param = TRAINING.bytes_per_element + TRAINING.optimizer_bytes_per_param
    dense = MIXTRAL.num_params - MIXTRAL.expert_params_per_layer * MIXTRAL.num_moe_layers
    assert per_rank[0] == pytest.approx(
        (dense + MIXTRAL.expert_params_per_layer * MIXTRAL.num_moe_layers / 8) * per_param, rel=1e-6
    )
