"""Plausibility guards: what the search ranks first must stay within the MFU that comparable
published runs reached, and the published layouts' predicted tokens/s within a stated tolerance
of what they measured. A model that promises 72% MFU for Llama 3 8B on 8 H100 fails here.

Each range runs from the lowest published model-FLOPs MFU of the closest counterparts less
PESSIMISM (the 30% worst-case step-time target of issue 12) to the highest plus OPTIMISM (a
layout better than the published ones may exist, but not one much better than the best):

- Llama 3 8B, seq 8192, on 8 and 128 H100: the issue's stated 30-45% (torchtitan, Dec 2024, eager
  bf16 FSDP: 5,762 and 5,605 tokens/s per GPU = 36% and 35% of 989 TFLOP/s on 500 W parts).
- Llama 3 70B on H100: Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4: 38-43% bf16 MFU
  on 8K-16K H100 with tp/pp/cp/FSDP; and the same size with the FSDP layouts the search ranks
  first, MosaicML's MPT-70B on 32-64 A100 80GB: 48.6-53.3% (published_runs_more.json).
- Llama 3.1 405B on 16K H100: Dubey et al. 2024, Table 4, 38-43%.
- GPT-3 175B on A100: Narayanan 2021 Table 2 (PTD, full recompute) 33.9-36.8%; Korthikanti
  2022 Table 5, 51.4% with selective recompute and sequence parallelism.
- GPT 1T on A100: Narayanan 2021 Table 1, 39.2% on 3072 GPUs; Korthikanti 2022 Table 5, 56.3%.
"""

import pytest

from benchmarks.published import REFERENCE, Skip, case_for, load_runs, predict
from berth.planner.search import search
from berth.specs.models import load_model
from berth.specs.tree import SearchSpec, TrainingSpec
from berth.topology.clusters import cluster_from_preset

PESSIMISM = 0.30  # issue 12's worst-case step-time error
OPTIMISM = 0.10  # headroom over the best published run for a better layout


def published_range(lowest: float, highest: float) -> tuple[float, float]:
    return lowest * (1.0 - PESSIMISM), highest * (1.0 + OPTIMISM)


FAT_TREE = dict(fabric="fat-tree", nodes_per_leaf=4, oversubscription=4.0)
H100_8B = (0.30, 0.45)  # issue 12
H100_70B = published_range(0.38, 0.533)
H100_405B = published_range(0.38, 0.43)
A100_175B = published_range(0.339, 0.514)
A100_1T = published_range(0.392, 0.563)

# Llama 3 8B's top plans sit above the 30-45%: the compute model, fitted to one 700 W H100
# (layer.json: an 8B layer at 0.47-0.50 of peak), puts the executor's best 8B plan near 51%, where
# torchtitan's only published eager run reached 36% on a 500 W part. Strict: the mark must go when
# the model (or a measurement of a full 8B step) settles it.
OPEN_8B = pytest.mark.xfail(
    strict=True,
    reason="issue 12: 8B top plans ~51% MFU vs the published 36% "
    "(500 W H100); open until a full 8B H100 step is measured",
)

# GPT-3 175B on 1024 A100: the top plan is tp=4 with ZeRO-3 over 256 ranks at 52.3% MFU (56.5% before
# hidden traffic was charged its overlap slowdown), near the best published 175B run (Megatron's 51.4%;
# DeepSpeed's 2021 ZeRO-3 46% at 384 GPUs, falling with scale). A guard against the prediction
# climbing again, not a settled case.

CASES = [
    # model, cluster preset, nodes, seq, global batch, fabric options, MFU range of the top plans
    pytest.param("llama3-8b", "dgx-h100", 1, 8192, 16, {}, H100_8B, marks=OPEN_8B),  # torchtitan Table 1
    pytest.param("llama3-8b", "dgx-h100", 16, 8192, 256, {}, H100_8B, marks=OPEN_8B),  # torchtitan Table 3
    ("llama3-70b", "dgx-h100", 8, 8192, 256, {}, H100_70B),  # README, first example
    ("llama3-70b", "dgx-h100", 16, 4096, 64, FAT_TREE, H100_70B),  # docs/guide.md, fat tree
    ("gpt3-175b", "dgx-a100-80g", 128, 2048, 1536, {}, A100_175B),  # docs/design.md, search speed
    ("gpt-1t", "dgx-a100-80g", 384, 2048, 3072, {}, A100_1T),  # search_speed
    ("llama3.1-405b", "dgx-h100", 2048, 8192, 2048, {}, H100_405B),  # search_speed
]
IDS = [
    "llama3-8b-1xdgx-h100",
    "llama3-8b-16xdgx-h100",
    "llama3-70b-8xdgx-h100",
    "llama3-70b-16xfat-tree",
    "gpt3-175b-128xdgx-a100",
    "gpt-1t-384xdgx-a100",
    "llama3.1-405b-2048xdgx-h100",
]
TOP = 3  # the plans a user sees first
# Published layouts: predicted tokens/s per GPU at most OPTIMISTIC_TOKENS x the published figure
# (the model's dangerous direction; 1.5 = the step 33% too fast) and at least PESSIMISTIC_TOKENS x
# it (0.75 = the step 33% too slow). Every usable run, the gap docs/accuracy.md names (test_golden.NOT_YET)
# included: today the worst is MPT-70B on 64 A100 40GB at 1.34.
OPTIMISTIC_TOKENS = 1.5
PESSIMISTIC_TOKENS = 0.75
# Families outside those bounds, each with its reason (test_golden.NOT_YET): checked apart, strict, so the
# mark must go when they come inside.
# (megatron_moe_modelzoo_2025 was here at 0.65-0.68x until Layout.expert_tp expressed its MoE parallel folding.)
OUTSIDE_BOUNDS: dict[str, str] = {}


@pytest.mark.parametrize("model,preset,nodes,seq,batch,fabric,mfu_range", CASES, ids=IDS)
def test_top_plans_within_published_mfu(model, preset, nodes, seq, batch, fabric, mfu_range):
    result = search(
        load_model(model),
        TrainingSpec(seq_len=seq, global_batch_size=batch),
        cluster_from_preset(preset, nodes, **fabric),
        SearchSpec(top=TOP),
    )
    low, high = mfu_range
    for plan in result.plans:
        mfu = plan.prediction.mfu
        assert low <= mfu <= high, (plan.layout.short(), round(mfu, 3), mfu_range)


def _tokens_ratios(families=None, exclude=()):
    """{run id: predicted / published tokens/s per GPU} of the usable runs of `families` (all when
    None), less those of `exclude`."""
    try:
        rows = load_runs(REFERENCE)
    except FileNotFoundError as err:
        pytest.fail(str(err))
    ratios = {}
    for row in rows:
        if (families is not None and row["source_id"] not in families) or row["source_id"] in exclude:
            continue
        try:
            r = predict(case_for(row))
        except Skip:
            continue
        ratios[r.case.id] = r.case.measured_step_s / r.predicted_step_s  # predicted / published tokens/s
    return ratios


def test_published_layouts_tokens_per_s():
    """Every usable published run (benchmarks/published.py) but the named families: predicted /
    published tokens/s per GPU between PESSIMISTIC_TOKENS and OPTIMISTIC_TOKENS."""
    ratios = _tokens_ratios(exclude=OUTSIDE_BOUNDS)
    off = {k: round(v, 3) for k, v in ratios.items() if not PESSIMISTIC_TOKENS <= v <= OPTIMISTIC_TOKENS}
    assert len(ratios) >= 160
    assert not off, f"{len(off)} of {len(ratios)} outside their bounds: {off}"


@pytest.mark.parametrize(
    "family",
    [pytest.param(f, marks=pytest.mark.xfail(strict=True, reason=why), id=f) for f, why in OUTSIDE_BOUNDS.items()],
)
def test_named_families_tokens_per_s(family):
    ratios = _tokens_ratios(families={family})
    assert ratios, family
    off = {k: round(v, 3) for k, v in ratios.items() if not PESSIMISTIC_TOKENS <= v <= OPTIMISTIC_TOKENS}
    assert not off, off
