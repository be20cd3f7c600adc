"""The one rule table (specs/validity.py RULES) evaluated every way it is used agrees with
itself: the vectorized mask over many candidates at once (the search), the one-layout evaluation
with its explanation (compare / --layout / --fix, specs/layouts.py), the search's pruning before
rows are built, and the executor's pre-flight check (executor/checks.py), on a few thousand seeded
random layouts, valid and not, over models and trainings that exercise every rule.
"""

import numpy as np
import pytest

from berth.executor.checks import UnsupportedLayout
from berth.executor.checks import check_layout as executor_check
from berth.planner.search import predict_layouts, search
from berth.specs.candidates import Candidates
from berth.specs.errors import BerthError
from berth.specs.layouts import check_layout as planner_check
from berth.specs.tree import (
    AXIS_ORDER_CHOICES,
    RECOMPUTE_CHOICES,
    SCHEDULE_CHOICES,
    Layout,
    ModelSpec,
    SearchSpec,
    TrainingSpec,
)
from berth.specs.validity import (
    EXECUTOR,
    EXECUTOR_RULES,
    PLAN,
    PLAN_RULES,
    REASON_CODES,
    RULES,
    Facts,
    evaluate_rules,
    prune,
    reason_codes,
    violations,
)
from berth.topology.clusters import cluster_from_preset

# vocabulary 50,257 (GPT-2's) divides by no tp > 1: the planner plans it (the engines pad the
# vocabulary), the bundled executor does not split it
GPT2_LIKE = ModelSpec(
    name="gpt2-like",
    num_layers=6,
    hidden_size=768,
    num_attention_heads=12,
    ffn_hidden_size=3072,
    vocab_size=50257,
    mlp="gelu",
    norm="layernorm",
)
MODELS = [
    GPT2_LIKE,
    ModelSpec(
        name="tied",
        num_layers=5,
        hidden_size=512,
        num_attention_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=1376,
        vocab_size=1024,
        tied_embeddings=True,
    ),
    ModelSpec(
        name="moe",
        num_layers=4,
        hidden_size=256,
        num_attention_heads=8,
        ffn_hidden_size=1024,
        vocab_size=1000,
        num_experts=8,
        experts_per_token=2,
        moe_ffn_hidden_size=512,
    ),
    ModelSpec(
        name="odd-ffn", num_layers=7, hidden_size=384, num_attention_heads=6, ffn_hidden_size=1000, vocab_size=32000
    ),
]
TRAININGS = [
    TrainingSpec(seq_len=64, global_batch_size=16),
    TrainingSpec(seq_len=96, global_batch_size=12, flash_attention=False),
    TrainingSpec(seq_len=2048, global_batch_size=8, framework="megatron"),
    TrainingSpec(seq_len=8192, global_batch_size=16),
    TrainingSpec(seq_len=128, global_batch_size=16, engine="deepspeed"),
    TrainingSpec(seq_len=128, global_batch_size=16, precision="fp16", engine="torchtitan"),
    TrainingSpec(seq_len=128, global_batch_size=16, engine="nanotron"),
]


def random_layouts(rng: np.random.Generator, n: int, world: int, batch: int) -> list[Layout]:
    """Layouts over small values that break every rule now and then; half of them derive dp, the
    micro-batches, shard and the schedule the way a valid layout would, so that many break none."""
    pick = lambda values: values[int(rng.integers(len(values)))]  # noqa: E731
    out = []
    for k in range(n):
        x = dict(
            tp=pick([1, 1, 2, 3, 4, 8]),
            cp=pick([1, 1, 1, 2, 4, 3]),
            pp=pick([1, 1, 2, 3, 4, 8]),
            dp=pick([1, 2, 4, 8]),
            ep=pick([1, 1, 2, 4, 3]),
            shard=pick([1, 1, 2, 4, 3]),
            zero_stage=pick([0, 1, 2, 3]),
            recompute=pick(RECOMPUTE_CHOICES),
            micro_batch_size=pick([1, 2, 4]),
            num_microbatches=pick([1, 2, 4, 8, 6]),
            virtual_stages=pick([1, 1, 2, 3]),
            schedule=pick(SCHEDULE_CHOICES),
            sequence_parallel=bool(pick([0, 1])),
            axis_order=pick(AXIS_ORDER_CHOICES),
            expert_tp=pick([None, None, None, 1, 2]),
        )
        if k % 2:
            x["dp"] = max(1, world // (x["tp"] * x["cp"] * x["pp"]))
            x["num_microbatches"] = max(1, batch // (x["dp"] * x["micro_batch_size"]))
            x["zero_stage"], x["shard"] = (0, 1) if x["zero_stage"] == 0 else (x["zero_stage"], x["dp"])
            x["ep"] = pick([1, 2]) if x["cp"] == 1 else 1
            x["schedule"] = "interleaved_1f1b" if x["virtual_stages"] > 1 else pick(["1f1b", "gpipe"])
            x["sequence_parallel"] = x["sequence_parallel"] and x["tp"] > 1
            x["expert_tp"] = pick([None, None, 1])  # MoE parallel folding: whole experts per rank
        out.append(Layout(**x))
    return out


def cases(seed: int = 0, per_case: int = 200):
    rng = np.random.default_rng(seed)
    for model in MODELS:
        for training in TRAININGS:
            world = int(rng.choice([8, 16]))  # one or two DGX H100 nodes
            yield Facts(model, training, world), random_layouts(rng, per_case, world, training.global_batch_size)


def test_vectorized_and_per_layout_evaluation_agree():
    """4,800 layouts: the rule matrix of all of a case's layouts at once equals each layout's own
    evaluation, the search's reason code is the first broken PLAN rule, every broken rule explains
    itself in the layout's numbers, and the search's pruning keeps every layout no PLAN rule refuses."""
    seen: set[str] = set()
    valid = 0
    for facts, layouts in cases():
        c = Candidates.from_layouts(layouts)
        matrix = np.stack(evaluate_rules(c, facts, RULES), axis=1)
        codes = reason_codes(c, facts)
        for i, layout in enumerate(layouts):
            row = {r.name for r, b in zip(RULES, matrix[i], strict=True) if b}
            seen |= row
            plan = violations(layout, facts, PLAN)
            execu = violations(layout, facts, EXECUTOR)
            assert [r.name for r, _ in plan] == [r.name for r in PLAN_RULES if r.name in row], layout
            assert [r.name for r, _ in execu] == [r.name for r in EXECUTOR_RULES if r.name in row], layout
            assert codes[i] == (REASON_CODES[plan[0][0].name] if plan else 0)
            for _, why in plan + execu:
                assert why and "{" not in why
            if not plan:
                valid += 1
                one = np.ones(1, dtype=np.int64)
                assert prune(facts, tp=layout.tp * one, cp=layout.cp * one, pp=layout.pp * one, virtual_stages=one)[0]
                assert prune(facts, pp=layout.pp * one, virtual_stages=layout.virtual_stages * one)[0]
    assert seen == {r.name for r in RULES}, f"rules never broken: {sorted({r.name for r in RULES} - seen)}"
    assert valid > 50


def test_the_edges_refuse_exactly_what_the_table_refuses():
    """specs/layouts.py check_layout (compare, --layout, the API) refuses a whole layout exactly
    when a PLAN rule is broken and names the first; the executor's pre-flight refuses exactly when an
    EXECUTOR rule is broken and lists them all."""
    for facts, layouts in cases(seed=1, per_case=40):
        cluster = cluster_from_preset("dgx-h100", facts.world // 8)
        for layout in layouts:
            if layout.pp == 1 and layout.schedule == "gpipe":
                layout = layout.model_copy(update={"schedule": "1f1b"})  # one stage: what the completion does
            plan = violations(layout, facts, PLAN)
            try:
                planner_check(layout.model_dump(), facts.model, facts.training, cluster)
                assert not plan, layout
            except BerthError as err:
                assert plan and plan[0][1] in str(err), (layout, err)
            execu = violations(
                layout,
                facts.__class__(facts.model, facts.training, facts.world, ranks="processes of the launch"),
                EXECUTOR,
            )
            try:
                executor_check(facts.model, facts.training, layout, facts.world)
                assert not execu, layout
            except UnsupportedLayout as err:
                assert execu and all(why in str(err) for _, why in execu), (layout, err)


def test_compared_layouts_carry_what_the_table_refuses_in_their_own_numbers():
    """`berth compare` and POST /v1/compare keep a layout that breaks a rule as a row: predicted for all of a case's
    random layouts at once (planning.compare), each plan has no prediction and an infeasible_reason that starts with
    the first broken PLAN rule's name and says it in the layout's numbers exactly when the table refuses it; the
    others are predicted (fit or not). A refused layout among many leaves the others' predictions as they are alone."""
    from berth.planner.planning import compare

    refused = 0
    for facts, layouts in cases(seed=2, per_case=40):
        cluster = cluster_from_preset("dgx-h100", facts.world // 8)
        plans = compare(facts.model, facts.training, cluster, [x.model_dump() for x in layouts])
        for layout, p in zip(layouts, plans, strict=True):
            broken = violations(p.layout, facts, PLAN)
            if broken:
                refused += 1
                assert p.prediction is None and p.infeasible_reason.startswith(broken[0][0].name + ": "), layout
                assert broken[0][1] in p.infeasible_reason
            else:
                assert p.prediction is not None and not (p.infeasible_reason or "").startswith(
                    tuple(r.name + ":" for r in PLAN_RULES)
                )
        ok = [i for i, p in enumerate(plans) if p.prediction is not None][:3]
        alone = compare(facts.model, facts.training, cluster, [layouts[i].model_dump() for i in ok]) if ok else []
        assert [p.prediction for p in alone] == [plans[i].prediction for i in ok]
    assert refused > 100


def test_a_planned_layout_the_executor_refuses_is_refused_by_an_executor_only_rule():
    """The drift this table removed: the planner planned tp=2 with a vocabulary of 50,257 and the
    executor refused it with rules of its own. Now the executor pads the vocabulary (executor/model.py
    padded_vocab) and runs that layout; it refuses a planned layout only by a rule tagged EXECUTOR
    alone, and says which."""
    training = TrainingSpec(seq_len=1024, global_batch_size=16)
    cluster = cluster_from_preset("dgx-h100", 1)
    layout = Layout(tp=2, dp=4, micro_batch_size=2, num_microbatches=2)
    plan = predict_layouts(GPT2_LIKE, training, cluster, [layout])[0]
    assert plan.infeasible_reason is None and plan.prediction is not None
    executor_check(GPT2_LIKE, training, plan.layout, plan.layout.world_size)  # runs: the vocabulary is padded
    with pytest.raises(UnsupportedLayout, match="does not divide ffn"):
        odd_ffn = GPT2_LIKE.model_copy(update={"ffn_hidden_size": 3071})
        executor_check(odd_ffn, training, plan.layout, plan.layout.world_size)
    facts = Facts(GPT2_LIKE, training, cluster.world_size)
    for model in (GPT2_LIKE, MODELS[2]):
        for p in search(model, training, cluster, SearchSpec(top=20)).plans:
            for rule, _ in violations(p.layout, Facts(model, training, facts.world), EXECUTOR):
                assert rule.applies == frozenset({EXECUTOR}), (p.layout.short(), rule.name)
