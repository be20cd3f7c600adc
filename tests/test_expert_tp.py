"""Expert-tensor parallelism (Layout.expert_tp): MoE parallel folding (Liu et al. 2025, arXiv 2504.14960;
Megatron-LM --expert-tensor-parallel-size). With expert_tp = 1 each rank holds num_experts / ep whole
experts, routes its own seq / tp tokens (sequence parallelism) over an ep group of consecutive ranks,
and reduces the experts' gradients over tp x dp / ep ranks; expert_tp left out is tp, today's layout.
Hand-checkable cases on Mixtral 8x7B: the parameters, the states, the all-to-all's level and bytes,
the tp collectives, the rules, the grammar and the launch flag."""

import numpy as np
import pytest

from berth.cost_models import comm, memory
from berth.cost_models.step import A2A_PER_MOE_LAYER, MOE_IMBALANCE, _tp_layer_s, evaluate
from berth.executor.checks import UnsupportedLayout
from berth.executor.checks import check_layout as executor_check
from berth.launch.writers import artifacts
from berth.planner.search import predict_layouts, search
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.layouts import check_layout, parse_spec
from berth.specs.models import presets
from berth.specs.tree import Layout, SearchSpec, TrainingSpec
from berth.specs.validity import EXECUTOR, PLAN, Facts, violations
from berth.topology.clusters import cluster_from_preset

MIXTRAL = presets()["mixtral-8x7b"]
TRAINING = TrainingSpec(seq_len=4096, global_batch_size=256, framework="megatron")
TWO_NODES = cluster_from_preset("dgx-h100", 2)
EXPERTS = MIXTRAL.expert_params_per_moe_layer * MIXTRAL.num_layers  # every Mixtral layer is MoE


def layout(**kw) -> Layout:
    base = dict(tp=2, dp=8, ep=8, zero_stage=1, shard=8, micro_batch_size=1, num_microbatches=32)
    base["sequence_parallel"] = True
    return Layout(**(base | kw))


def test_default_is_tp_and_round_trips():
    x = layout()
    assert x.expert_tp is None and x.etp == 2 and "etp" not in x.short()
    folded = layout(expert_tp=1)
    assert folded.etp == 1 and "etp=1" in folded.short()
    c = Candidates.from_layouts([x, folded, layout(expert_tp=2)])
    assert c.expert_tp.tolist() == [2, 1, 2]
    assert [c.layout(i).expert_tp for i in range(3)] == [None, 1, None]  # = tp is the default, stored as such
    assert parse_spec("tp=2,ep=8,etp=1") == {"tp": 2, "ep": 8, "expert_tp": 1}


def test_expert_parameters_are_whole_experts_split_by_ep_only():
    for tp, ep in ((2, 4), (2, 8), (4, 8)):
        split = memory.stage_params(MIXTRAL, 1, tp, True, ep=ep)  # expert_tp = tp
        whole = memory.stage_params(MIXTRAL, 1, tp, True, ep=ep, etp=1)
        # the experts: E / ep whole experts instead of E / ep split by tp; the rest the same
        assert float(whole - split) == pytest.approx(EXPERTS / ep * (1 - 1 / tp))
        assert float(memory.stage_params(MIXTRAL, 1, tp, True, ep=ep, part="dense", etp=1)) == pytest.approx(
            float(memory.stage_params(MIXTRAL, 1, tp, True, ep=ep, part="dense"))
        )
        assert float(memory.stage_params(MIXTRAL, 1, tp, True, ep=ep, part="expert", etp=1)) == pytest.approx(
            EXPERTS / ep
        )
    # doubling ep halves the experts on a rank
    four, eight = (memory.stage_params(MIXTRAL, 1, 2, True, ep=ep, part="expert", etp=1) for ep in (4, 8))
    assert float(four) == pytest.approx(2 * float(eight))
    # expert_tp = tp given explicitly is the default, to the bit
    assert memory.stage_params(MIXTRAL, 4, 2, False, ep=8, etp=2) == memory.stage_params(MIXTRAL, 4, 2, False, ep=8)


def test_expert_states_shard_over_the_expert_data_parallel_group():
    """Megatron's distributed optimizer shards the experts' main parameters and Adam state over the
    expert-data-parallel group: dp / ep = 1 rank with expert_tp = tp, tp x dp / ep = 2 with expert_tp = 1."""
    c = Candidates.from_layouts([layout(), layout(expert_tp=1)])
    mem = memory.stage_memory_breakdown(MIXTRAL, TRAINING, TWO_NODES.device, c, True)
    optimizer = (memory.ADAM_STATES + 1) * memory.FP32_BYTES  # Megatron: fp32 main parameters + exp_avg(_sq)
    dense = (MIXTRAL.num_params - EXPERTS) / 2  # tp 2, sharded over dp 8
    assert mem["optimizer_state"][0] == pytest.approx(optimizer * (dense / 8 + EXPERTS / 8 / 2 / 1))
    assert mem["optimizer_state"][1] == pytest.approx(optimizer * (dense / 8 + EXPERTS / 8 / 2))
    folded = memory.expert_candidates(c, split_dp=True)
    assert folded.dp.tolist() == [1.0, 2.0] and folded.shard.tolist() == [1.0, 2.0]


def test_all_to_all_inside_the_node_and_no_tp_collective_in_the_experts():
    """tp 2 x dp 8 on two 8-GPU nodes, ep 8: with expert_tp = tp the ep group is 8 dp ranks at stride 2,
    16 GPUs, two nodes; with expert_tp = 1 it is ranks 0-7, one node, and each rank sends its own
    seq / tp tokens. The MLP's tp collective goes (every Mixtral layer is MoE, no shared expert)."""
    c = Candidates.from_layouts([layout(), layout(expert_tp=1)])
    ev = evaluate(MIXTRAL, TRAINING, TWO_NODES, c)
    tokens = TRAINING.seq_len * 2 * MIXTRAL.hidden_size * 2  # seq x k x h x bf16
    per_layer = [
        comm.all_to_all_s(TWO_NODES, tokens, 8.0, 2),  # stride tp = 2: spans both nodes
        comm.all_to_all_s(TWO_NODES, tokens / 2, 8.0, 1),  # consecutive ranks, s / tp tokens each
    ]
    layers, nmb = MIXTRAL.num_layers, 32
    for i in range(2):
        want = nmb * layers * A2A_PER_MOE_LAYER * MOE_IMBALANCE * per_layer[i]
        assert ev.time_breakdown_s["ep_comm"][i] == pytest.approx(want, rel=1e-9)
    assert comm.group_level(TWO_NODES, 8.0, 1) == 0 < comm.group_level(TWO_NODES, 8.0, 2)
    assert ev.time_breakdown_s["ep_comm"][1] < ev.time_breakdown_s["ep_comm"][0] / 4
    act = 2 * 1 * TRAINING.seq_len * MIXTRAL.hidden_size
    one = comm.all_reduce_s(TWO_NODES, act, 2.0, 1)
    assert float(_tp_layer_s(TWO_NODES, act, 2.0, 1)) == pytest.approx(2 * one)
    edge = 2 * one  # the embedding's and the head's all-reduce (pp = 1: one stage holds both)
    # Megatron's recipe under sequence parallelism: the backward gathers QKV's input again; the routed experts take
    # their tokens from the dispatcher (no second gather), whatever their expert_tp
    again = comm.all_gather_s(TWO_NODES, act, 2.0, 1)
    assert ev.time_breakdown_s["tp_comm"][0] == pytest.approx(nmb * (layers * (2 * 2 * one + again) + edge))
    # with expert_tp = 1 the experts hold the MLP whole: its collectives go
    assert ev.time_breakdown_s["tp_comm"][1] == pytest.approx(nmb * (layers * (2 * 1 * one + again) + edge))


def test_expert_tp_between_one_and_tp():
    """tp 4 x dp 4 on two nodes, ep 4, expert_tp 2 (Megatron's --expert-tensor-parallel-size 2): each rank
    holds E / ep experts split in 2, sends its own seq / tp tokens over an ep group of ranks 2 apart (inside
    a node), and its expert-tp pair of consecutive ranks all-gathers what the pair received (the
    reduce-scatter of the combine moves the same bytes): the all-to-all of expert_tp 1 plus that gather."""
    x = {"tp": 4, "dp": 4, "ep": 4, "shard": 4, "num_microbatches": 64}
    c = Candidates.from_layouts([layout(expert_tp=1, **x), layout(expert_tp=2, **x)])
    ev = evaluate(MIXTRAL, TRAINING, TWO_NODES, c)
    own = TRAINING.seq_len * 2 * MIXTRAL.hidden_size * 2 / 4  # seq / tp x k x h x bf16
    per_layer = [
        comm.all_to_all_s(TWO_NODES, own, 4.0, 1),
        comm.all_to_all_s(TWO_NODES, own, 4.0, 2) + comm.all_gather_s(TWO_NODES, 2 * own, 2.0, 1),
    ]
    assert comm.group_level(TWO_NODES, 4.0, 2) == 0  # the ep group of 4 ranks 2 apart stays in a node
    for i in range(2):
        want = 64 * MIXTRAL.num_layers * A2A_PER_MOE_LAYER * MOE_IMBALANCE * per_layer[i]
        assert ev.time_breakdown_s["ep_comm"][i] == pytest.approx(want, rel=1e-9)
    # the experts on a rank: split in 2, so half of expert_tp 1's; the dense layers as with any expert_tp
    expert = [memory.stage_params(MIXTRAL, 1, 4, True, ep=4, part="expert", etp=e) for e in (1, 2, 4)]
    assert float(expert[0]) == pytest.approx(EXPERTS / 4) and float(expert[1]) == pytest.approx(EXPERTS / 8)
    assert float(expert[2]) == pytest.approx(EXPERTS / 16)
    # the experts' saved inputs: the pair's gathered tokens, twice expert_tp 1's
    saved = [memory.moe_activation_bytes(MIXTRAL, TRAINING, 1, 4, 1, e) for e in (1, 2)]
    assert float(saved[1]) == pytest.approx(2 * float(saved[0]))
    # Megatron's launch carries it
    (plan,) = predict_layouts(
        MIXTRAL, TRAINING, cluster_from_preset("dgx-h100", 2), [layout(expert_tp=2, recompute="full", **x)]
    )
    assert "--expert-tensor-parallel-size 2" in artifacts(plan, "megatron")["megatron-args.txt"]


def test_rules_and_their_refusals():
    facts = Facts.of(MIXTRAL, TRAINING, TWO_NODES)

    def broken(x, who=PLAN):
        return [r.name for r, _ in violations(x, facts, who)]

    assert broken(layout(expert_tp=1)) == []
    assert (
        broken(layout(tp=2, dp=4, pp=2, ep=8, expert_tp=1, shard=4, num_microbatches=64)) == []
    )  # ep 8 > dp 4: ep x 1 | tp x dp
    assert broken(layout(tp=4, dp=4, ep=4, expert_tp=2, shard=4, num_microbatches=64)) == []
    assert "expert_tp_not_divide_tp" in broken(layout(tp=4, dp=4, ep=4, expert_tp=3, shard=4))
    assert "expert_tp_needs_sequence_parallel" in broken(layout(expert_tp=1, sequence_parallel=False))
    assert "ep_not_divide_dp" in broken(
        layout(dp=4, ep=8, shard=4, tp=4, num_microbatches=64)
    )  # expert_tp = tp: ep must divide dp
    order = layout(tp=2, dp=4, pp=2, shard=4, expert_tp=1, axis_order="tp-pp-dp")
    assert "expert_tp_needs_pp_outermost" in broken(order)
    dense = presets()["llama3-8b"]
    assert "expert_tp_needs_moe" in [
        r.name for r, _ in violations(layout(ep=1, expert_tp=1), Facts.of(dense, TRAINING, TWO_NODES))
    ]
    # the bundled executor runs experts as the dense layers only: its pre-flight check names the field
    assert "expert_tp_in_executor" in broken(layout(expert_tp=1), EXECUTOR)
    with pytest.raises(UnsupportedLayout, match="expert_tp = 1 != tp = 2"):
        executor_check(MIXTRAL, TRAINING, layout(expert_tp=1), 16)
    # the edges: one line naming the field and the values that would do
    with pytest.raises(BerthError, match=r"expert_tp.*valid: 1, 2, 4"):
        check_layout(parse_spec("tp=4,dp=4,ep=4,etp=3,sp=1,zero=1"), MIXTRAL, TRAINING, TWO_NODES)


def test_search_tries_whole_experts_and_fix_pins_them():
    result = search(MIXTRAL, TRAINING, TWO_NODES, SearchSpec(top=3, fix={"tp": 2, "expert_tp": 1}))
    assert result.plans and all(p.layout.etp == 1 and p.layout.sequence_parallel for p in result.plans)
    # a divisor between 1 and tp is searched where fix names it (ep x 2 dividing tp x dp)
    result = search(MIXTRAL, TRAINING, TWO_NODES, SearchSpec(top=5, fix={"tp": 4, "expert_tp": 2}))
    assert result.plans and all(p.layout.etp == 2 and p.layout.sequence_parallel for p in result.plans)
    assert all((p.layout.tp * p.layout.dp) % (p.layout.ep * 2) == 0 for p in result.plans)
    # unfixed: expert_tp = 1 is among what is searched, and it wins here (the ep group stays in the node)
    best = search(MIXTRAL, TRAINING, TWO_NODES, SearchSpec(top=1, fix={"tp": 2, "ep": 8}))
    assert best.plans[0].layout.etp == 1
    with pytest.raises(BerthError, match="fix.expert_tp=3.*valid: 1, 2, 4"):
        search(MIXTRAL, TRAINING, TWO_NODES, SearchSpec(top=1, fix={"tp": 4, "expert_tp": 3}))


def test_megatron_launch_carries_expert_tp():
    (plan,) = predict_layouts(
        MIXTRAL, TRAINING, TWO_NODES, [layout(expert_tp=1, recompute="full")], memory_headroom=0.0
    )
    assert plan.infeasible_reason is None, plan.infeasible_reason
    text = artifacts(plan, "megatron")["megatron-args.txt"]
    for flag in ("--tensor-model-parallel-size 2", "--expert-model-parallel-size 8", "--expert-tensor-parallel-size 1"):
        assert flag in text, flag
    (default,) = predict_layouts(MIXTRAL, TRAINING, TWO_NODES, [layout(recompute="full")], memory_headroom=0.0)
    assert "--expert-tensor-parallel-size 2" in artifacts(default, "megatron")["megatron-args.txt"]


def test_default_predictions_unchanged_by_an_explicit_expert_tp_equal_to_tp():
    x = [layout(), layout(expert_tp=2)]
    ev = evaluate(MIXTRAL, TRAINING, TWO_NODES, Candidates.from_layouts(x))
    assert ev.step_time_s[0] == ev.step_time_s[1] and ev.peak_memory_bytes[0] == ev.peak_memory_bytes[1]
    assert np.isfinite(ev.step_time_s).all()
