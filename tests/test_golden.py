"""Golden cases: published runs in benchmarks/data/reference/published_runs_a100.json and
published_runs_more.json, each predicted with the layout and engine its source used
(`benchmarks/published.py`: `case_for` builds the model, training, cluster and layout, and turns
each source's figure into a measured step time).

- Megatron-LM on A100 (Narayanan 2021 Tables 1-2, Korthikanti 2022 Table 5 and Sec. 6.3):
  fp16, unfused attention, full or selective recompute, tp/pp/interleaving as published.
- PyTorch FSDP (ZeRO-3, FULL_SHARD) on A100 40/80 GB: MosaicML llm-foundry's MPT runs, 125M-70B,
  seq 512-65536, with and without full recompute.
- PyTorch FSDP on H100 80GB: the same README's H100 BF16 tables (benchmarks/data/mosaicml_h100_bf16.json,
  70 runs, FULL_SHARD and SHARD_GRAD_OP, 8-512 GPUs).
- torchtitan on H100: Llama 3.1 8B, FSDP2 over 8 and 128 GPUs, bf16, eager (the compiled and FP8
  rows are not expressible; benchmarks/published.py lists why each skipped run is skipped).
- Megatron-Core mixture of experts with expert parallelism on H100, bf16 (benchmarks/data/
  published_runs_moe_cp.json): Mixtral 8x7B on 64 GPUs (TP 1, EP 8, PP 4, VP 8; Megatron-LM's MoE
  README, MCore v0.8 and v0.9) and Mixtral 8x22B on 128 GPUs (TP 2, EP 8, PP 8, VP 7; the Megatron
  MoE team's ModelZoo scripts of 2025-12 and 2026-03). No bf16 context-parallel or uneven-stage run
  beyond Llama 3 405B's (the last two tests) was found that berth can express (docs/accuracy.md, "Against real
  GPUs", says where it was looked for).

Tolerances (step time, predicted / measured - 1; NO_REGRESSION says why each family's bound is
where it is): each source family's median |error| within
TARGET_MEDIAN (12%) and its worst within TARGET_WORST (30%), the targets of issue 12; the
Megatron runs, checked since the first release, each within 20% and 12% on average. The runs
include work the model leaves out (data loading, loss scaling, logging), the published figures
are rounded (~0.5%), and the H100 rows ran on a 96 GB, 500 W part predicted from the 80 GB,
700 W profile with a stated clock derate (benchmarks/published.py: H100_96GB_*).

The reference data are required: they are part of the repository (benchmarks/data/reference,
PROVENANCE.md there), and a missing file is a failure that says where the data were looked for,
never a skip.
"""

import statistics

import pytest

from benchmarks.published import REFERENCE, TARGET_MEDIAN, TARGET_WORST, Skip, case_for, load_runs, predict

MEGATRON_PER_RUN = 0.20
MEGATRON_MEAN = 0.12
MEGATRON = ("narayanan2021", "korthikanti2022")
MOE = ("megatron_core_moe_readme_2024", "megatron_moe_modelzoo_2025")


@pytest.fixture(scope="module")
def published_runs():
    try:
        return load_runs(REFERENCE)
    except FileNotFoundError as err:
        pytest.fail(str(err))


@pytest.fixture(scope="module")
def results(published_runs):
    out = {}
    for row in published_runs:
        try:
            out[row["id"]] = predict(case_for(row))
        except Skip:
            continue
    return out


def _family(results, *families):
    return [r for r in results.values() if r.case.family in families]


def test_usable_runs_are_all_there(results):
    """Every family the issue names is predicted; a reader change that drops rows fails here."""
    counts = {
        f: len(_family(results, f))
        for f in (*MEGATRON, "mosaicml_llmfoundry", "mosaicml_llmfoundry_h100", "torchtitan_bench_202412", *MOE)
    }
    assert counts["narayanan2021"] + counts["korthikanti2022"] >= 25, counts
    assert counts["mosaicml_llmfoundry"] >= 130, counts
    assert counts["mosaicml_llmfoundry_h100"] >= 70, counts
    assert counts["torchtitan_bench_202412"] >= 2, counts
    assert counts["megatron_core_moe_readme_2024"] >= 2, counts
    assert counts["megatron_moe_modelzoo_2025"] >= 3, counts


def test_megatron_runs(results):
    rows = _family(results, *MEGATRON)
    for r in rows:
        assert r.reason is None, (r.case.id, r.reason)
        assert r.fits, (r.case.id, r.peak_gib)
    worst = max(rows, key=lambda r: abs(r.error))
    assert abs(worst.error) <= MEGATRON_PER_RUN, (worst.case.id, worst.error)
    mean = sum(abs(r.error) for r in rows) / len(rows)
    assert mean <= MEGATRON_MEAN, mean


# Families that do not meet issue 12's targets yet, and why (docs/accuracy.md, "Against real GPUs"). Strict:
# the mark must go when the family meets the target.
NOT_YET = {
    "torchtitan_bench_202412": "eager Llama 3.1 8B at 36% MFU on 500 W HBM2e H100s, predicted 13-14% fast after the "
    "op census, FlashAttention-2, the part's HBM2e bandwidth and overlap slowdown (no "
    "measurement of that part or its power cap)",
}
# Today's level per family (median |error|, worst |error|): a change that makes a family worse fails.
NO_REGRESSION = {
    "narayanan2021": (0.12, 0.20),
    "korthikanti2022": (0.12, 0.20),
    "mosaicml_llmfoundry": (0.06, 0.28),
    "torchtitan_bench_202412": (0.15, 0.16),
    # 6.9% / -23.6% when added (mean -5.9%: optimistic where a small micro-batch gives FSDP's collectives a
    # short window, 13B at 2 x 2,048 tokens, and at 8,192 tokens with 21 accumulation steps)
    "mosaicml_llmfoundry_h100": (0.08, 0.26),
    # -3.4% and +3.2% when added: one layout, published at 438 (MCore v0.8) and 468 TFLOP/s (v0.9), 7% apart
    # from software alone, so no prediction sits closer than ~3.4% to both; 10% = that spread plus 3%.
    "megatron_core_moe_readme_2024": (0.10, 0.10),
    # +47%, +50%, +54% when added, with the experts split by tp and the ep group at stride tp across two nodes;
    # +4.0%, +6.3%, +8.6% with the runs' MoE parallel folding expressed (Layout.expert_tp = 1: whole experts,
    # the EP 8 all-to-all inside one NVLink node). 10% = the worst plus about the 2.2% spread between the two
    # dropless runs of one layout (2025-12 and 2026-03 software).
    "megatron_moe_modelzoo_2025": (0.08, 0.10),
}


def _target_param(family):
    marks = [pytest.mark.xfail(strict=True, reason=NOT_YET[family])] if family in NOT_YET else []
    return pytest.param(family, marks=marks, id=family)


def _median_worst(results, family):
    rows = _family(results, family)
    errors = {r.case.id: r.error for r in rows}
    worst = max(errors, key=lambda k: abs(errors[k]))
    return statistics.median(abs(e) for e in errors.values()), worst, errors[worst]


@pytest.mark.parametrize("family", [_target_param(f) for f in NO_REGRESSION])
def test_family_step_time(results, family):
    """Issue 12's targets per source family: median |error| <= 12%, worst <= 30%."""
    median, worst, error = _median_worst(results, family)
    assert median <= TARGET_MEDIAN, (family, median)
    assert abs(error) <= TARGET_WORST, (family, worst, error)


@pytest.mark.parametrize("family", list(NO_REGRESSION))
def test_family_no_regression(results, family):
    median_bound, worst_bound = NO_REGRESSION[family]
    median, worst, error = _median_worst(results, family)
    assert median <= median_bound, (family, median)
    assert abs(error) <= worst_bound, (family, worst, error)


def test_fsdp_throughput_trends(results):
    """MosaicML's runs of one model at one sequence length on 8..128 A100 40GB GPUs differ by
    under 7% in tokens/s per GPU for 3B and 7B (FSDP over 1600 Gbps RoCE); the prediction must
    not invent a collapse with scale either."""
    for size in ("3b", "7b"):
        rows = [
            r
            for r in _family(results, "mosaicml_llmfoundry")
            if f"_{size}_a100_40gb_" in r.case.id and r.case.id.endswith("_s2048_bf16")
        ]
        assert len(rows) >= 4, size
        tps = [
            r.case.training.global_batch_size
            * r.case.training.seq_len
            / (r.predicted_step_s * r.case.cluster.world_size)
            for r in rows
        ]
        assert max(tps) / min(tps) < 1.15, (size, tps)


def test_published_moe_layouts_fit(results):
    """The Megatron-Core MoE layouts ran: each is valid for berth (ep, ZeRO-1, interleaved stages) and
    predicted to fit in 80 GB."""
    rows = _family(results, *MOE)
    assert rows
    for r in rows:
        assert r.reason is None, (r.case.id, r.reason)
        assert r.fits, (r.case.id, round(r.peak_gib, 1))
        assert r.case.layout.ep == 8 and r.breakdown_s["ep_comm"] > 0, r.case.id


def test_published_fsdp_layouts_fit(results):
    rows = _family(results, "mosaicml_llmfoundry", "torchtitan_bench_202412")
    misfits = [(r.case.id, round(r.peak_gib, 1)) for r in rows if not r.fits]
    assert not misfits, misfits


def test_selective_recompute_beats_full_as_published(published_runs):
    """Korthikanti 2022 Table 5: sequence parallel + selective recompute is ~29-32% faster than
    full recompute for every model; the prediction must order them the same way."""
    by_id = {r["id"]: r for r in published_runs}
    for size in ("22B", "175B", "530B", "1T"):
        full = predict(case_for(by_id[f"korthikanti2022_t5_{size}_fullrecompute"])).predicted_step_s
        sel = predict(case_for(by_id[f"korthikanti2022_t5_{size}_sp_selective"])).predicted_step_s
        assert 1.15 < full / sel < 1.6, (size, full / sel)


def test_missing_reference_data_is_a_clear_error(tmp_path):
    """Without the reference data the loader names the path it looked in (the fixture turns
    this into a failure, not a skip)."""
    with pytest.raises(FileNotFoundError, match=str(tmp_path)):
        load_runs(tmp_path)


def test_missing_reference_files_fail_the_tests_that_read_them(tmp_path):
    """Every test reading benchmarks/data/reference goes through tests/conftest.py require_reference: a
    missing file fails the test naming the path, never skips it."""
    from tests.conftest import require_reference

    with pytest.raises(pytest.fail.Exception, match="reference data missing: " + str(tmp_path)):
        require_reference(tmp_path / "gemm.json")
    assert require_reference(REFERENCE) == REFERENCE


# Llama 3 405B as Meta trained it (Dubey et al. 2024, "The Llama 3 Herd of Models", Table 4): TP 8, CP 1,
# PP 16, seq 8192, 16M tokens a batch (2048 sequences), BF16 on H100 (80 GB HBM3, 700 W, Grand Teton: 8 GPUs on
# NVLink a server, 400 Gb/s RoCE per GPU): 430 TFLOP/s per GPU (43% MFU) on 8,192 GPUs (DP 64) and 400 (41%) on
# 16,384 (DP 128); 126 layers on 16 stages, one layer fewer on the first and the last (Sec. 3.3.2). Predicted
# with `berth plan llama3.1-405b --fix tp=8,cp=1,pp=16` on dgx-h100 (its best plan; Meta's schedule details beyond
# Table 4 are not all published). Meta's figures include work berth leaves out (data loading, logging, stragglers
# at 16K GPUs) and berth's best plan need not be Meta's: 15% either way, inside issue 12's 30% worst case.
LLAMA3_405B_META = [(1024, 430.0), (2048, 400.0)]  # (dgx-h100 nodes, TFLOP/s per GPU)
LLAMA3_405B_TOLERANCE = 0.15  # predicted 399 and 359 (-7% and -10%) when added


@pytest.mark.parametrize("nodes, tflops", LLAMA3_405B_META, ids=["8192gpu", "16384gpu"])
def test_llama3_405b_as_meta_trained_it(nodes, tflops):
    from berth.planner.search import search
    from berth.specs.models import load_model
    from berth.specs.tree import SearchSpec, TrainingSpec
    from berth.topology.clusters import cluster_from_preset

    cluster = cluster_from_preset("dgx-h100", nodes)
    result = search(
        load_model("llama3.1-405b"),
        TrainingSpec(seq_len=8192, global_batch_size=2048),
        cluster,
        SearchSpec(top=1, fix={"tp": 8, "cp": 1, "pp": 16}),
    )
    (best,) = result.plans
    assert best.stage_layers == [7, *[8] * 14, 7] and best.layout.dp == cluster.world_size // 128
    pr = best.prediction
    predicted = pr.model_flops_per_step / pr.step_time_s / cluster.world_size / 1e12
    assert predicted == pytest.approx(tflops, rel=LLAMA3_405B_TOLERANCE), (best.layout.short(), predicted)


# Llama 3 405B long-context training (Dubey et al. 2024, Table 4, third row; Sec. 3.3.2): 16,384 H100, TP 8, CP 16,
# PP 16, seq 131,072, 16M tokens a batch (128 sequences: DP 8 = 16,384 / (8 x 16 x 16), which the GPU count and
# the tokens per batch both imply), 380 TFLOP/s per GPU (38% BF16 MFU). Meta's CP all-gathers K and V (Sec. 3.3.2);
# berth costs a ring whose KV traffic hides behind each step's attention (cost_models/step.py cp_exchange_s):
# with GQA (8 kv heads) the all-gather is small next to the attention at 131k either way.
# The FLOP count matters here as it does not at 8k: berth's model FLOPs count the full s x s score and context
# products (Narayanan 2021, as torchtitan and Megatron count MFU); a causal kernel does half of them. Table 4 does
# not say which it counts. At 8k the two differ by 3%, at 131k by 40%: with the full count Meta's 38% MFU would be
# 27% of real work, far below the 41-43% the same cluster ran at 8k, so the causal count is the comparison taken
# (hardware FLOPs of a causal kernel), and the full count is held to the 30% of issue 12's worst case.
# Predicted when added (`berth plan llama3.1-405b --seq-len 131072 --fix tp=8,cp=16,pp=16`): 329 TFLOP/s causal
# (-14%), 460 full count (+21%).
LLAMA3_405B_LONG_TFLOPS = 380.0
LLAMA3_405B_LONG_TOLERANCE = 0.15  # causal count
LLAMA3_405B_LONG_FULL_COUNT_TOLERANCE = 0.30


def test_llama3_405b_long_context_with_cp16():
    from berth.cost_models import flops
    from berth.planner.search import search
    from berth.specs.models import load_model
    from berth.specs.tree import SearchSpec, TrainingSpec
    from berth.topology.clusters import cluster_from_preset

    cluster = cluster_from_preset("dgx-h100", 2048)
    model, training = load_model("llama3.1-405b"), TrainingSpec(seq_len=131072, global_batch_size=128)
    result = search(model, training, cluster, SearchSpec(top=1, fix={"tp": 8, "cp": 16, "pp": 16}))
    (best,) = result.plans
    pr = best.prediction
    assert best.layout.dp == 8 and best.layout.cp == 16 and pr.fits
    assert pr.time_breakdown_s["cp_comm"] < 0.05 * pr.step_time_s  # the KV exchange hides behind attention
    core = (
        (1 + flops.BACKWARD_TO_FORWARD)
        * model.num_layers
        * flops.attention_core_flops(model, training.seq_len, training.global_batch_size)
    )
    full = pr.model_flops_per_step / pr.step_time_s / cluster.world_size / 1e12
    causal = (pr.model_flops_per_step - core / 2) / pr.step_time_s / cluster.world_size / 1e12
    assert causal == pytest.approx(LLAMA3_405B_LONG_TFLOPS, rel=LLAMA3_405B_LONG_TOLERANCE), (
        best.layout.short(),
        causal,
        full,
    )
    assert full == pytest.approx(LLAMA3_405B_LONG_TFLOPS, rel=LLAMA3_405B_LONG_FULL_COUNT_TOLERANCE), full
