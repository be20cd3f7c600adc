"""The engine loop on a measured sweep (benchmarks/engine_sweep.py, the Ultra-Scale Playbook's nanotron runs):
the saved figures (benchmarks/results/engine_sweep.json, quoted in the README) are what the code computes now,
and calibrating on 12 probed runs of one GPU count moves the other groups' ranking and throughput the right way."""

import json
from pathlib import Path

import pytest

from benchmarks import engine_sweep
from berth.cost_models.memory import allocator_capacity_bytes
from berth.planner.engine_fit import CEILING
from berth.specs.validity import REASON_CODES

RULE_NAMES = set(REASON_CODES) - {"out_of_memory", "memory_tight"}

SAVED = Path(engine_sweep.__file__).resolve().parent / "results" / "engine_sweep.json"
KEYS = (
    *engine_sweep.HEADLINE,
    "rho_between_twins_median",  # the data against itself (twin_scores): the same whatever is predicted
    "rho_berth_on_twins_median",
)


@pytest.fixture(scope="module")
def result():
    return engine_sweep.main(["--no-write"])


def test_the_saved_figures_are_what_the_code_computes(result):
    saved = json.loads(SAVED.read_text())
    assert saved["probe_gpus"] == result["probe_gpus"] and saved["probes"] == result["probes"]
    for size, r in result["models"].items():
        s = saved["models"][size]
        assert [p["layout"] for p in s["probes"]] == [p["layout"] for p in r["probes"]]
        for phase in ("before", "after"):
            for k in KEYS:
                assert r[phase][k] == pytest.approx(s[phase][k], abs=0.02), (size, phase, k)
            # the diagnostic of runs a second a micro-batch slower than predicted (docs/accuracy.md: stalled runs)
            assert abs(r[phase]["stalled"] - s[phase]["stalled"]) <= 5, (size, phase)


def test_twin_scores_compare_the_sweep_with_itself():
    """The repeatability diagnostic on a hand-made group: five layouts run at ZeRO-0 and ZeRO-1 (the fourth's ZeRO-1
    run the fastest), a sixth pair whose ZeRO-1 twin berth refused (left out). Choosing by the ZeRO-1 figures picks
    the fourth layout, whose ZeRO-0 run is 20 % short of the best ZeRO-0 run: that is the worse way, the regret."""
    import numpy as np

    z0, z1 = [10.0, 20.0, 30.0, 40.0, 50.0, 60.0], [9.0, 19.0, 29.0, 52.0, 51.0, 70.0]
    tok = np.array(z0 + z1)
    pred = np.array([1.0, 2.0, 3.0, 4.0, 5.0, 6.0] * 2)
    ok = np.ones(12, dtype=bool)
    ok[11] = False
    pairs = np.array([[i, i + 6] for i in range(6)])
    t = engine_sweep.twin_scores(pairs, tok, pred, ok)
    assert t["pairs"] == 5
    assert t["rho_between_twins"] == pytest.approx(0.9)
    assert t["rho_berth_on_twins"] == pytest.approx((1.0 + 0.9) / 2)
    assert t["regret_by_twin"] == pytest.approx(1.0 - 40.0 / 50.0)
    few = engine_sweep.twin_scores(pairs[:4], tok, pred, ok)
    assert few["pairs"] == 4 and few["rho_between_twins"] is None
    assert engine_sweep.twin_summary([few])["twin_groups"] == 0
    assert engine_sweep.twin_summary([t, few])["regret_by_twin_worst"] == pytest.approx(0.2)


def test_calibration_on_probes_improves_the_groups_it_never_saw(result):
    """Ranking and throughput improve from either model's probes, and over the three probe counts saved (32, 64 and
    128 GPUs) the median rho rises by more than 0.05 on average (0.14 from the 1B probes, 0.12 from the 8B's). The
    first choice is not asserted: before calibration it is already the best or within 3.2 % of it in most groups,
    and a fit of 12 probes moves it both ways (docs/accuracy.md). The same loop from the generic engine predicts
    throughput closer and ranks better after calibration from either model's probes (rho 0.74 -> 0.83 from the 8B's:
    before the fit offered the budget of the ZeRO exposure it found undetermined to the pipeline floor, the probes'
    slow pipelines went into latency_scale, 52x, which ranked every tensor-parallel layout down: 0.59)."""
    for size, r in result["models"].items():
        b, a = r["before"], r["after"]
        assert len(r["probes"]) == 12 and r["fitted"]
        assert a["rho_median"] > b["rho_median"], size
        assert a["throughput_error_median"] < b["throughput_error_median"], size
        # berth's nanotron entry refuses one row of runs.json: the 1B at pp 16, whose last rank nanotron's split leaves
        # without a block; its trainer's logging raises there, and 51 of the 52 such configurations crashed
        # (specs/stages.py; how the one row was written is not known: docs/accuracy.md)
        assert a["refused"] == b["refused"] == 1
        assert [i for g in r["groups_after"] for i in g["refused_ids"]] == ["usp_1B_16n_dp1_tp8_pp16_mbs1_ga256_z0"]
        loops = [r] + [o[size] for o in result["other_probe_gpus"].values()]
        before = sum(x["before"]["rho_median"] for x in loops) / len(loops)
        after = sum(x["after"]["rho_median"] for x in loops) / len(loops)
        assert after > before + 0.05, (size, before, after)
        g = result["generic"][size]  # the same loop from the generic engine
        assert g["after"]["throughput_error_median"] < g["before"]["throughput_error_median"], size
        assert g["before"]["refused"] == 0, size
        assert g["after"]["rho_median"] > g["before"]["rho_median"], size


def test_the_nanotron_entry_predicts_better_than_the_generic_engine(result):
    """Its split rule and recipe, read from nanotron's code, leave the fit less to learn: on the groups not probed
    the nanotron entry predicts memory far closer before calibration (9 % against 37 %) and throughput closer after
    it than the calibrated generic engine (8B / 1B probes: 13 / 21 % against 17 / 25 %), with no run that ran
    predicted not to fit (the generic engine's fits: 34 / 4). It does not rank better than the calibrated generic
    engine (median rho 0.85 / 0.79 against 0.83 / 0.81), nor choose better (docs/accuracy.md)."""
    for size, r in result["models"].items():
        g = result["generic"][size]
        assert r["before"]["memory_abs_error_median"] < 0.5 * g["before"]["memory_abs_error_median"], size
        assert r["after"]["throughput_error_median"] < g["after"]["throughput_error_median"], size
        assert r["after"]["ran_predicted_not_to_fit"] == 0 < g["after"]["ran_predicted_not_to_fit"], size


def rules_refuse(run) -> bool:
    from berth.specs.layouts import layout_problems

    return bool(layout_problems(run.layout, run.model, run.training, run.cluster))


def test_the_cli_loop_a_team_runs_gives_the_saved_figures(tmp_path):
    """The loop through the CLI, as a team (or a reviewer with another model size) runs it: `berth probe` among the
    layouts that ran on 64 GPUs, `berth calibrate --runs` on the probes' measured values (the README's example
    file), `berth compare --json` of another group's layouts: the same probes, and the compare's pick is the
    benchmark's first choice (its regret, the saved one). The configurations that crashed go along as a reviewer may
    pass them: those the nanotron entry's rules refuse are not picked (probe says so) and are rows with their rule
    in the compare, the others' rows as without them."""
    import subprocess
    import sys

    berth = [sys.executable, "-m", "berth.cli.main"]
    saved = json.loads(SAVED.read_text())["models"]["8B"]
    ran, crashed = engine_sweep.records()
    model = tmp_path / "nanotron-8b.json"
    group = {g: [r for r in ran if r["size"] == "8B" and r["cluster"]["nodes"] * 8 == g] for g in (64, 128)}
    failed = {g: [r["layout"] for r in crashed if r["size"] == "8B" and r["cluster"]["nodes"] * 8 == g] for g in group}
    model.write_text(json.dumps(group[64][0]["model"]))
    layouts = tmp_path / "layouts.txt"
    layouts.write_text("# the 8B layouts that ran on 64 GPUs\n" + "\n".join(r["layout"] for r in group[64]) + "\n")
    common = ["--cluster", "aws-p5", "--seq-len", "4096", "--global-batch", "256", "--engine", "nanotron"]
    errors = []

    def run(*args):
        r = subprocess.run([*berth, *args], capture_output=True, text=True, timeout=600)
        assert r.returncode == 0, r.stderr[-2000:]
        errors.append(r.stderr)
        return r.stdout

    crashed64 = [r for r in crashed if r["size"] == "8B" and r["cluster"]["nodes"] == 8]
    refused = [r["layout"] for r, x in zip(crashed64, engine_sweep.as_runs(crashed64), strict=True) if rules_refuse(x)]
    assert refused  # e.g. nanotron's 1F1B needs num_microbatches >= pp - 1
    picks = json.loads(
        run(
            "probe",
            str(model),
            *common,
            *("--nodes", "8", "--runs", "12", "--layouts", str(layouts), "--json"),
            *(a for x in refused for a in ("--layout", x)),
        )
    )
    assert [p["layout"] for p in picks["picks"]] == [p["layout"] for p in saved["probes"]]
    assert f"note: {len(refused)} of the {len(group[64]) + len(refused)} given layouts break a rule" in errors[-1]
    example = engine_sweep.EXAMPLE  # the probes' measured values, as the README's calibrate reads them
    recs = [json.loads(x) for x in example.read_text().splitlines() if not x.startswith("#")]
    assert [r.layout.short() for r in engine_sweep.as_runs(recs)] == [p["layout"] for p in saved["probes"]]
    profile = tmp_path / "profile.json"
    said = run("calibrate", "--runs", str(example), "--out", str(profile))
    # a probe whose reserved peak reached the allocator's ceiling is read as a lower bound, its step left out
    runs = engine_sweep.as_runs(recs)
    assert {r.training.engine for r in runs} == {"nanotron"}
    cap = allocator_capacity_bytes(runs[0].cluster.device, runs[0].cluster.world_size)
    at_cap = sum(r["peak_memory_gib"] * 2**30 >= CEILING * cap for r in recs)
    assert at_cap == json.loads(profile.read_text())["fit"]["runs"]["at_ceiling"]
    assert (f"{at_cap} run(s) reached the allocator's ceiling" in " ".join(said.split())) == (at_cap > 0)
    # the memory fit refused a held-out probe that ran: calibrate says the recipe's memory is kept
    assert "not to fit: the prior's memory parameters are kept" in " ".join(said.split())
    # its six memory parameters share that reason: the table gives it once, then "as above" (5); so do the two
    # ZeRO exposures, the second of which was offered the first's budget and left as undetermined (1)
    assert said.count("as above") == 6, said
    # the group's layouts as a user passes them: the first by --layout, the rest in a --layouts file
    rest = tmp_path / "layouts128.txt"
    rest.write_text("\n".join(r["layout"] for r in group[128][1:]) + "  # the rest\n")
    args = ["--layout", group[128][0]["layout"], "--layouts", str(rest)]
    answer = json.loads(
        run("compare", str(model), *common, "--nodes", "16", "--profile", str(profile), *args, "--json")
    )
    assert len(answer["candidates"]) == len(group[128])
    tok = [r["tokens_per_s_per_gpu"] for r in group[128]]
    regret = 1.0 - tok[answer["choice"]] / max(tok)
    want = next(g for g in saved["groups_after"] if g["model"] == "8B" and g["gpus"] == 128)
    assert regret == pytest.approx(want["regret"], abs=1e-9)
    both = tmp_path / "ran-and-crashed128.txt"
    both.write_text("\n".join(r["layout"] for r in group[128][1:]) + "\n" + "\n".join(failed[128]) + "\n")
    args = ["--layout", group[128][0]["layout"], "--layouts", str(both)]
    wider = json.loads(run("compare", str(model), *common, "--nodes", "16", "--profile", str(profile), *args, "--json"))
    assert wider["candidates"][: len(group[128])] == answer["candidates"]
    rows = wider["candidates"][len(group[128]) :]
    assert len(rows) == len(failed[128]) and any(r["prediction"] is None for r in rows)
    assert all(r["infeasible_reason"].split(":")[0] in RULE_NAMES for r in rows if r["prediction"] is None)
    assert any("nanotron e24d2483 (2025-02-19) cannot run it" in (r["infeasible_reason"] or "") for r in rows)


def test_nanotron_memory_read_from_its_code_predicts_the_sweep_uncalibrated(monkeypatch):
    """What nanotron holds, read from its code (specs/engines.py: the stacked block of ZeRO-1's post-step gather,
    its vocabulary-parallel loss on an fp32 cast, the unfused SwiGLU and MHA's kept q/k/v block), predicts rank 0's
    reserved peak of the sweep's runs with no calibration: median |error| 26 % with Megatron's recipe alone (and
    the DDP buckets), 11 % with these; and ZeRO-1 runs are no longer under-predicted against ZeRO-0 ones (pp = 1,
    8B: 0.77 against 0.87 of the measured peak without them, 0.87 both with them)."""
    import dataclasses

    import numpy as np

    from berth.cost_models.step import evaluate
    from berth.specs.candidates import Candidates
    from berth.specs.engines import ENGINES, MEMORY_EXTRA_FIELDS

    ran, _ = engine_sweep.records("nanotron")
    groups: dict = {}
    for r in ran:
        groups.setdefault((r["size"], r["cluster"]["nodes"]), []).append(r)

    def ratios():
        ratio, zero, pp, size = [], [], [], []
        for recs in groups.values():
            runs = engine_sweep.as_runs(recs)
            f = runs[0]
            cap = CEILING * allocator_capacity_bytes(f.cluster.device, f.cluster.world_size) / 2**30
            ev = evaluate(f.model, f.training, f.cluster, Candidates.from_layouts([r.layout for r in runs]))
            for i, (rec, run) in enumerate(zip(recs, runs, strict=True)):
                if rec["peak_memory_gib"] < cap:  # a peak at the allocator's cap is a lower bound
                    ratio.append(float(ev.first_stage_memory_bytes[i]) / 2**30 / rec["peak_memory_gib"])
                    zero.append(run.layout.zero_stage)
                    pp.append(run.layout.pp)
                    size.append(rec["size"])
        return map(np.asarray, (ratio, zero, pp, size))

    ratio, zero, pp, size = ratios()
    assert len(ratio) > 900
    assert np.median(np.abs(ratio - 1)) < 0.12
    flat = (pp == 1) & (size == "8B")
    assert abs(np.median(ratio[flat & (zero == 1)]) - np.median(ratio[flat & (zero == 0)])) < 0.05
    # the same entry without what nanotron holds beyond Megatron's recipe (its DDP buckets kept)
    off = {n: type(getattr(ENGINES["nanotron"], n))() for n in MEMORY_EXTRA_FIELDS if n != "ddp_beside_grad_buffer"}
    monkeypatch.setitem(ENGINES, "nanotron", dataclasses.replace(ENGINES["nanotron"], **off))
    ratio, zero, pp, size = ratios()
    assert np.median(np.abs(ratio - 1)) > 0.2
    flat = (pp == 1) & (size == "8B")
    assert np.median(ratio[flat & (zero == 0)]) - np.median(ratio[flat & (zero == 1)]) > 0.08


def test_reduce_scatter_blocks_the_host_runs_ahead_of_are_the_sweeps_memory_at_pp_1(monkeypatch):
    """At pp = 1 with tensor parallelism the sweep's reserved peak sat above nanotron's recipe by about 2 GiB (8B) and
    0.8 GiB (1B) per sequence whatever tp; the forward's row-parallel outputs handed to reduce-scatters and still
    reserved while the host runs ahead (specs/engines.py unsynced_rs_blocks, cost_models/memory.py) close it: the
    median predicted / measured over those runs is 0.86-0.87 without them and within 4 % of 1 with them, for both
    models; at pp > 1 nothing changes."""
    import dataclasses

    import numpy as np

    from berth.cost_models.step import evaluate
    from berth.specs.candidates import Candidates
    from berth.specs.engines import ENGINES

    ran, _ = engine_sweep.records("nanotron")
    groups: dict = {}
    for r in ran:
        groups.setdefault((r["size"], r["cluster"]["nodes"]), []).append(r)

    def ratios():
        out: dict = {}
        for (size, _), recs in groups.items():
            runs = engine_sweep.as_runs(recs)
            f = runs[0]
            cap = CEILING * allocator_capacity_bytes(f.cluster.device, f.cluster.world_size) / 2**30
            ev = evaluate(f.model, f.training, f.cluster, Candidates.from_layouts([r.layout for r in runs]))
            for i, (rec, run) in enumerate(zip(recs, runs, strict=True)):
                if rec["peak_memory_gib"] < cap and run.layout.tp > 1:
                    key = (size, run.layout.pp == 1)
                    out.setdefault(key, []).append(
                        float(ev.first_stage_memory_bytes[i]) / 2**30 / rec["peak_memory_gib"]
                    )
        return {k: float(np.median(v)) for k, v in out.items()}

    held = ratios()
    monkeypatch.setitem(ENGINES, "nanotron", dataclasses.replace(ENGINES["nanotron"], unsynced_rs_blocks=0.0))
    without = ratios()
    for size in ("1B", "8B"):
        assert abs(held[(size, True)] - 1.0) < 0.04, (size, held)
        assert without[(size, True)] < 0.9, (size, without)
        assert held[(size, False)] == pytest.approx(without[(size, False)])


def test_ddp_buckets_over_16_to_32_nodes_wait_on_nccls_tree_not_a_ring(monkeypatch):
    """nanotron's ZeRO-0 reduces its gradients through torch DDP in 25 MiB buckets, one all-reduce each. Over 16-32
    nodes a ring's 2 (n - 1) latency steps per bucket add up to a second and more; NCCL runs its tree there
    (cost_models/comm.py). Uncalibrated, the 8B model's ZeRO-0 runs without a pipeline (tp <= 8) at 128 and 256
    GPUs: measured / predicted step time within 10 % of 1 at the median with the tree; with the ring alone the
    256-GPU runs were predicted 1.3x slower than they ran."""
    import numpy as np

    from berth.cost_models import comm
    from berth.planner.engine_fit import predict_runs
    from berth.specs.tree import EngineTuning

    ran, _ = engine_sweep.records("nanotron")

    def ratio(gpus: int) -> float:
        recs = [
            r
            for r in ran
            if r["size"] == "8B"
            and r["cluster"]["nodes"] * 8 == gpus
            and ",pp=1," in r["layout"]
            and "zero=0" in r["layout"]
            and int(r["layout"].split(",")[0][3:]) <= 8
        ]
        runs = engine_sweep.as_runs(recs)
        t, _, _, _, _ = predict_runs(runs, EngineTuning())
        measured = np.array([r.step_time_s for r in runs])
        return float(np.median(measured / t))

    assert abs(ratio(128) - 1.0) < 0.1 and abs(ratio(256) - 1.0) < 0.1, (ratio(128), ratio(256))
    monkeypatch.setattr(
        comm, "all_reduce_s", lambda c, n, s, st: comm.collective_time_s(c, n, s, st, comm.ALL_REDUCE_PASSES)
    )
    assert ratio(256) < 0.85


def test_the_backward_gathers_the_inputs_sequence_parallelism_saved_split(monkeypatch):
    """nanotron (like Megatron-LM) saves a column-parallel linear's input split over the sequence and all-gathers it
    again in the backward for the weight gradient (tp_recompute_allgather, its default): the backward's tensor-parallel
    traffic a half more than the forward's. Uncalibrated, on the sweep's runs without a pipeline inside a node (tp 2-8,
    up to 256 GPUs), the predicted step falls behind the measured one as tp grows: the 1B model's tp 8 at 0.83 of
    its tp 2 (median predicted / measured), 0.87 with the backward's gathers charged; the 8B model's moves from
    4.3 % under to 0.2 % under (with ZeRO-1's copy-back charged, which weighs on tp 2's larger dp; before it 2.4 %
    under to 2.5 % over). What the ranking gains shows after calibration (docs/accuracy.md, ten probe sets)."""
    import numpy as np

    from berth.cost_models import memory
    from berth.planner.engine_fit import predict_runs
    from berth.specs.tree import EngineTuning

    ran, _ = engine_sweep.records("nanotron")
    groups: dict = {}
    for r in ran:
        if r["cluster"]["nodes"] <= 32 and ",pp=1," in r["layout"] and not r["layout"].startswith("tp=1,"):
            groups.setdefault((r["size"], r["cluster"]["nodes"]), []).append(r)

    def spread() -> dict[str, float]:
        """Per model: median predicted / measured at tp 8 over that at tp 2."""
        out: dict = {}
        for (size, _), recs in groups.items():
            runs = engine_sweep.as_runs(recs)
            t, _, cap, _, _ = predict_runs(runs, EngineTuning())
            for i, (rec, run) in enumerate(zip(recs, runs, strict=True)):
                # runs that reserved 90 % of the memory or more ran slowed by the allocator's retries
                if run.layout.tp in (2, 8) and rec["peak_memory_gib"] * 2**30 <= 0.9 * cap[i]:
                    out.setdefault((size, run.layout.tp), []).append(t[i] / run.step_time_s)
        return {s: float(np.median(out[(s, 8)]) / np.median(out[(s, 2)])) for s in ("1B", "8B")}

    charged = spread()
    monkeypatch.setattr(memory, "linear_inputs_saved_split", lambda training, sp: np.zeros_like(sp, dtype=bool))
    left_out = spread()
    assert abs(charged["1B"] - 1.0) < abs(left_out["1B"] - 1.0) - 0.03, (charged, left_out)
    assert left_out["8B"] < charged["8B"] < 1.03 and abs(charged["8B"] - 1.0) < 0.01, (charged, left_out)


def test_zero1s_cached_gather_block_is_handed_back_not_needed_to_fit():
    """nanotron's ZeRO-1 gather block (cost_models/memory.py gather_block_bytes) is, beside the next step's
    activations, a free segment the caching allocator releases before a cudaMalloc fails: it is reserved, not needed
    to fit. Counted as needed, the uncalibrated entry predicted 3 of the sweep's runs that ran not to fit, among them
    the 8B's tp 1 x pp 4 and pp 8 layouts on 32 GPUs with two sequences a micro-batch (they reserved 75.5 and
    77.1 GiB); handed back, 1 (a last stage's logits, which no log reports; none since the 16-bit logits' segment is
    handed back too: the next test). Those two stay out of the ranking (the
    search's headroom counts the block, memory.peak_memory), rank 0's reserved peak is predicted at most the
    capacity, within 4 % of what they reserved, and the plan's reason gives what must fit and what the allocator
    holds with the block."""
    import numpy as np

    from berth.cost_models.step import evaluate
    from berth.planner.planning import compare
    from berth.specs.candidates import Candidates
    from berth.specs.validity import MEMORY_TIGHT

    ran, _ = engine_sweep.records("nanotron")
    groups: dict = {}
    for r in ran:
        groups.setdefault((r["size"], r["cluster"]["nodes"]), []).append(r)
    needed = counted = tight = 0
    for (size, nodes), recs in groups.items():
        runs = engine_sweep.as_runs(recs)
        f = runs[0]
        cap = allocator_capacity_bytes(f.cluster.device, f.cluster.world_size)
        ev = evaluate(f.model, f.training, f.cluster, Candidates.from_layouts([r.layout for r in runs]))
        needed += int(np.sum(ev.required_memory_bytes > cap))
        counted += int(np.sum(ev.held_memory_bytes > cap))  # the block counted as needed
        for i, (rec, run) in enumerate(zip(recs, runs, strict=True)):
            if size == "8B" and nodes == 4 and run.layout.tp == 1 and run.layout.micro_batch_size == 2:
                assert run.layout.pp in (4, 8) and run.layout.zero_stage == 1
                assert ev.required_memory_bytes[i] <= cap < ev.held_memory_bytes[i]
                assert int(ev.reason[i]) == MEMORY_TIGHT
                seen = float(ev.first_stage_memory_bytes[i])
                assert seen <= cap and seen / 2**30 == pytest.approx(rec["peak_memory_gib"], rel=0.04)
                tight += 1
                # the plan says so: its breakdown sums to the peak it reports, and the reason gives both figures
                (p,) = compare(run.model, run.training, run.cluster, [run.layout.short()])
                assert sum(p.prediction.memory_breakdown_bytes.values()) == pytest.approx(
                    p.prediction.peak_memory_bytes
                )
                assert p.prediction.fits and p.prediction.peak_memory_bytes == pytest.approx(cap)
                need, held = float(ev.required_memory_bytes[i]) / 2**30, float(ev.held_memory_bytes[i]) / 2**30
                assert (
                    f"needs {need:.1f} GiB per GPU, {held:.1f} with the blocks it keeps cached," in p.infeasible_reason
                )
                assert "(0.0% left)" in p.infeasible_reason
    assert (needed, counted, tight) == (0, 3, 2)


def test_the_16_bit_logits_segment_is_cached_not_needed_to_fit():
    """nanotron computes its loss on an fp32 cast of the head's output (EngineInfo.sharded_loss): the 16-bit output
    is freed before the cast's max-shifted copy, whose 4 bytes a logit its 2-byte segment cannot hold, so the segment
    stays cached (cost_models/memory.py cached_logits_bytes), and the allocator releases it before a cudaMalloc
    fails. The 1B model on 64 GPUs at tp 1, pp 2 and 8 sequences a micro-batch (8 x 4,096 x 131,072 logits on the
    last stage) ran; counted as needed, its last stage's 79.8 GiB was over the 77.9 the allocator can have, and it
    was the one run of the sweep predicted not to fit. Live it needs 71.8: it fits, out of the ranking (the headroom
    counts the segment), while rank 0, which its log reports, is predicted within 3 % of what it reserved."""
    from berth.cost_models.memory import peak_memory
    from berth.cost_models.step import evaluate
    from berth.specs.candidates import Candidates
    from berth.specs.validity import MEMORY_TIGHT

    ran, _ = engine_sweep.records("nanotron")
    (rec,) = [
        r for r in ran if r["size"] == "1B" and r["cluster"]["nodes"] == 8 and r["layout"].startswith("tp=1,pp=2,")
        and "mbs=8," in r["layout"] and r["layout"].endswith("zero=0")
    ]  # fmt: skip
    (run,) = engine_sweep.as_runs([rec])
    c = Candidates.from_layouts([run.layout])
    cap = allocator_capacity_bytes(run.cluster.device, run.cluster.world_size)
    mem = peak_memory(run.model, run.training, run.cluster.device, c)
    last = mem.breakdown  # the last stage's: the larger
    logits = 8 * 4096 * 131072  # the sweep's vocabulary (nanotron-1B)
    assert float(last["cached_logits"][0]) == pytest.approx(2 * logits)  # the 16-bit output
    assert float(last["logits"][0]) == pytest.approx(8 * logits)  # the fp32 cast and the saved softmax
    gib = 2.0**30
    assert float(mem.required[0]) / gib == pytest.approx(71.8, abs=0.1) and float(mem.peak[0]) > cap
    assert float(mem.required[0]) + 2 * logits == pytest.approx(float(mem.peak[0]))
    ev = evaluate(run.model, run.training, run.cluster, c)
    assert int(ev.reason[0]) == MEMORY_TIGHT and float(ev.required_memory_bytes[0]) <= cap
    assert float(ev.first_stage_memory_bytes[0]) / gib == pytest.approx(rec["peak_memory_gib"], rel=0.03)


def test_the_loop_runs_on_rows_of_another_size_as_the_held_out_sizes_come(tmp_path, monkeypatch):
    """The sweep's other sizes are held back; their rows may come without this folder's `derived` fields and
    without runs on the probed GPU count. The benchmark then reads the shape as it reads the crashed rows (untied
    embeddings, as many kv heads as heads), probes the GPU count nearest the one asked for with the most runs and
    says so, and skips crashed configurations of sizes none of whose runs ran. Here the 1B's rows relabelled as a 3B
    shape (28 layers, hidden 3072, FFN 8192) without 64-GPU runs: the loop probes 128 GPUs."""
    rows = json.loads((engine_sweep.DATA / "runs.json").read_text())
    other = [
        {k: v for k, v in r.items() if k != "derived"}
        | {"model_name": "Llama 3B", "num_layers": 28, "hidden_size": 3072, "ffn_hidden_size": 8192}
        for r in rows
        if r["model_name"].split()[1] == "1B" and r["num_gpus"] != 64
    ]
    (tmp_path / "runs.json").write_text(json.dumps(other))
    (tmp_path / "crashed.json").write_text((engine_sweep.DATA / "crashed.json").read_text())
    monkeypatch.setattr(engine_sweep, "DATA", tmp_path)
    ran, crashed = engine_sweep.records()
    assert ran and not crashed  # the crashed configurations are the 1B's and 8B's
    assert all(not r["model"]["tied_embeddings"] and r["model"]["num_kv_heads"] == 32 for r in ran)
    data = engine_sweep.loaded()
    r = engine_sweep.loop(data, "3B", 64, 12)
    assert {x["cluster"]["nodes"] for x in r["probe_records"]} == {16}  # 128 GPUs: 121 runs against 32's 68
    assert r["probe_gpus"] == 128
    assert r["after"]["groups"] == len(data[0]) - 1 and r["after"]["refused"] == 0


def test_zero1s_copy_back_costs_the_host_an_eager_op_per_rank_and_tensor(monkeypatch):
    """nanotron's ZeRO-1 splits every parameter of a stage over all dp ranks and, after the gather, copies each rank's
    slice of each tensor back one `copy_` at a time (distributed.py all_gather_coalesced): dp x tensors eager ops on
    the host after the step (cost_models/step.py gather_copies_s, at the H100's measured 12.75 us an op). Uncalibrated,
    over the sweep's ZeRO-1 runs without a pipeline (tp <= 8, 16-256 GPUs), what the measured step leaves beyond the
    predicted one grew by about 10 us per (rank, tensor) pair without it and by none with it (a robust line through
    the runs); the ZeRO-0 runs, which gather nothing, stay flat either way."""
    import numpy as np
    from scipy.optimize import least_squares

    from berth.cost_models import step
    from berth.planner.engine_fit import predict_runs
    from berth.specs.tree import EngineTuning

    ran, _ = engine_sweep.records("nanotron")
    recs = [
        r
        for r in ran
        if 2 <= r["cluster"]["nodes"] <= 32 and ",pp=1," in r["layout"] and int(r["layout"].split(",")[0][3:]) <= 8
    ]
    runs = engine_sweep.as_runs(recs)
    pairs = np.array([r.layout.dp * (6 * r.model.num_layers + 3) for r in runs], dtype=float)
    zero = np.array([r.layout.zero_stage for r in runs])

    def slope_us(stage: int) -> float:
        t = predict_runs(runs, EngineTuning()).time
        left = np.array([r.step_time_s for r in runs]) - t
        x, y = pairs[zero == stage], left[zero == stage]
        fit = least_squares(lambda p: p[0] * 1e-6 * x + p[1] - y, [0.0, 0.0], loss="soft_l1", f_scale=0.05)
        return float(fit.x[0])

    charged = slope_us(1), slope_us(0)
    monkeypatch.setattr(step, "gather_copies_s", lambda *a: 0.0)
    left_out = slope_us(1), slope_us(0)
    assert abs(charged[0]) < 2.0 < 6.0 < left_out[0], (charged, left_out)
    assert abs(charged[1]) < 2.0 and charged[1] == pytest.approx(left_out[1]), (charged, left_out)


def test_the_copy_back_loop_costs_the_host_what_the_cost_model_counts():
    """COPY_BACK_OPS_PER_PAIR (cost_models/step.py): nanotron's all_gather_coalesced (distributed.py at e24d2483),
    run here on CPU as its code runs it, less the collective, costs the host per (rank, tensor) pair 1.5-1.6 times
    one torch.mul of 8 elements, the op `berth profile` times for kernel_overhead_s. A host-clock ratio on a shared
    CPU: the bound is loose."""
    import time

    import torch

    from berth.cost_models.step import COPY_BACK_OPS_PER_PAIR

    def coalesced(output_tensor_lists, input_tensor_list):  # nanotron's, the dist.all_gather left out
        size = len(output_tensor_lists[0])
        output_tensor_lists = [[out[r] for out in output_tensor_lists] for r in range(size)]
        torch._utils._flatten_dense_tensors(input_tensor_list)
        buffers = [torch._utils._flatten_dense_tensors(out) for out in output_tensor_lists]
        for originals, gathered in zip(output_tensor_lists, buffers, strict=True):
            parts = torch._utils._unflatten_dense_tensors(gathered, originals)
            for original, part in zip(originals, parts, strict=True):
                original.copy_(part)

    dp, tensors = 32, 99
    params = [torch.zeros(dp * 4, dtype=torch.bfloat16) for _ in range(tensors)]

    def step() -> None:
        coalesced([[p[r * 4 : (r + 1) * 4] for r in range(dp)] for p in params], [p[:4] for p in params])

    x = torch.randn(8)

    def best(fn, reps: int) -> float:
        times = []
        for _ in range(5):
            t0 = time.perf_counter()
            for _ in range(reps):
                fn()
            times.append((time.perf_counter() - t0) / reps)
        return min(times)

    pair = best(step, 10) / (dp * tensors)
    op = best(lambda: torch.mul(x, 2.0), 2000)
    assert 0.75 * COPY_BACK_OPS_PER_PAIR < pair / op < 1.5 * COPY_BACK_OPS_PER_PAIR, pair / op


def test_re_weighting_the_recipes_terms_in_sample_stays_above_the_memory_target():
    """benchmarks/sweep_memory_bound.py (docs/accuracy.md, "What is still off"): each term of rank 0's breakdown with
    its own non-negative scale and a fixed offset, fitted on all the sweep's runs at once (in sample) by least squares
    and by least absolute deviations, improves on the recipe but stays above the issue's 5 % median: far more freedom
    than the engine fit's memory parameters, which scale groups of these terms, has."""
    from benchmarks import sweep_memory_bound

    b = sweep_memory_bound.bound()
    assert b["runs"] > 1000
    assert 0.05 < b["least_absolute_median_abs_error"] < b["least_squares_median_abs_error"]
    assert b["least_squares_median_abs_error"] < b["recipe_median_abs_error"] < 0.09
