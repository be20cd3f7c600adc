"""The engine loop measured on a real sweep: probe -> measure -> calibrate -> plan, on nanotron.

Data: benchmarks/data/reference/ultrascale-playbook/ (the Ultra-Scale Playbook's nanotron sweep on
H100, the 1B and 8B models: 1,027 runs with throughput and peak reserved memory, 616 configurations
that crashed; provenance in its README). The loop runs twice: from berth's nanotron entry
(specs/engines.py: its rules, memory recipe and compute-balanced pipeline split, read from its code),
as a team on nanotron would, and from the 'generic' engine, as a team on a stack berth has no
entry for would.

For each model: `berth probe` (planner/probe.py) picks K <= 12 layouts among the layouts that ran at
one GPU count (PROBE_GPUS); their measured step time and peak memory are read from the data, as a
team would read them from its runs; `berth calibrate --runs` (planner/engine_fit.py) fits the
engine on them; then every other group (model x GPU count) of both models is scored, before (the
engine's prior) and after:

- Spearman's rho between predicted and measured tokens/s over the layouts that ran;
- top-1 regret: 1 - measured tokens/s of berth's first choice among the layouts that ran (the fastest
  predicted among those it predicts to fit with the search's memory headroom, as `berth plan` ranks) /
  the best measured; also with ZeRO-0/1 twins merged (a layout run with both: the measured figures
  differ up to 40x from run noise, so the twin pair counts once, at its better measurement, and
  berth's prediction of the pair is its better one);
- top-3 hit: the best measured layout is among berth's three first choices;
- median and worst |throughput error|, the median signed memory error against reserved memory;
- runs that ran predicted not to fit, crashed configurations predicted to fit (an upper bound on
  misses: the data does not tell a crash from an out-of-memory), layouts that ran refused as invalid;
- a diagnostic, not a score: the runs that ran "stalled", measured more than STALL_S a micro-batch slower than
  predicted (the sweep's pipelines that wait about a second a micro-batch, docs/accuracy.md), and rho over the
  rest (chosen by the prediction's own miss, so it says where the ranking fails, not how good it is);
- another diagnostic: the sweep against itself (`twin_scores`): where a layout ran at ZeRO-0 and ZeRO-1, rho between
  the two measurements, berth's rho on the same layouts, and the regret of choosing by one twin's figures.

The records go through the same JSON-lines reader as a user's runs (planner/run_logs.py). Cluster:
the `aws-p5` preset (8 x H100 SXM per node, EFA; the sweep ran on Hugging Face's H100 cluster, whose
network the source does not state: the fit's inter-node bandwidth scale absorbs the difference).
Every model in runs.json is looped over, so the sweep's other sizes run as they come (`model_record`,
`loop`: rows without the `derived` fields; no runs on the probed GPU count, when the loop says which it probed).

    python -m benchmarks.engine_sweep            # prints, writes benchmarks/results/engine_sweep.json
"""

from __future__ import annotations

import argparse
import json
import math
import multiprocessing
import os
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
from scipy.stats import spearmanr

from berth.planner.engine_fit import CEILING, FOLDS, MeasuredRun, fit_engine, predict_runs
from berth.planner.probe import probe
from berth.planner.run_logs import read_runs
from berth.specs.tree import EngineTuning

HERE = Path(__file__).resolve().parent
DATA = HERE / "data" / "reference" / "ultrascale-playbook"
OUT = HERE / "results" / "engine_sweep.json"
EXAMPLE = HERE.parent / "examples" / "runs" / "nanotron-8b-probes.jsonl"  # the README's calibrate input
EXAMPLE_HEADER = (
    "# 12 runs of nanotron (Llama-style 8B, seq 4096, global batch 256) on 8 nodes of 8 x H100, measured by the\n"
    "# Ultra-Scale Playbook (benchmarks/data/reference/ultrascale-playbook/): the layouts `berth probe` picked\n"
    "# (benchmarks/engine_sweep.py writes this file), with their measured tokens/s per GPU and peak reserved memory\n"
)
PRESET = "aws-p5"
PROBE_GPUS = 64
OTHER_PROBE_GPUS = (32, 128)  # the loop again with the probes there (summaries only)
PROBES = 12
ENGINE = "nanotron"  # the engine the sweep ran; the loop is also run from "generic" (GENERIC)
GENERIC = "generic"
SEQ = 4096
# the figures a loop is judged by (its summary's medians over the groups): saved, quoted and compared by these names
HEADLINE = (
    "rho_median",
    "regret_median",
    "regret_twins_merged_median",
    "throughput_error_median",
    "memory_abs_error_median",
)
STALL_S = 0.4  # seconds a micro-batch beyond the prediction that mark a run "stalled" (a diagnostic, module docstring)


def model_record(row: dict) -> dict:
    """The run's model as a spec object: its shape, and the variant the FLOP accounting resolves (kv heads,
    tied embeddings; the README's `derived` fields; unresolved rows, and rows without them, take the first matching
    variant or else as many kv heads as heads and untied embeddings, as the crashed rows: the generating script at
    e24d2483 ties them below an FFN of 10,000, but 301 of the 460 resolved 1B rows, FFN 8,192, are untied)."""
    d = row.get("derived") or {}
    match = (d.get("variant_matches") or [{}])[0]
    kv = d.get("num_kv_heads") or match.get("kv_heads") or row["num_attention_heads"]
    tied = d.get("tied_embeddings")
    tied = match.get("tied_embeddings", False) if tied is None else tied
    return {
        "name": f"nanotron-{row['model_name'].split()[1]}",
        "num_layers": row["num_layers"],
        "hidden_size": row["hidden_size"],
        "num_attention_heads": row["num_attention_heads"],
        "num_kv_heads": kv,
        "ffn_hidden_size": row["ffn_hidden_size"],
        "vocab_size": row["vocab_size"],
        "mlp": "swiglu",
        "norm": "rmsnorm",
        "tied_embeddings": bool(tied),
    }


def layout_text(tp: int, pp: int, dp: int, mbs: int, ga: int, zero: int) -> str:
    # nanotron's REDUCE_SCATTER tensor-parallel mode is sequence parallelism; 1F1B with pp > 1
    text = f"tp={tp},pp={pp},dp={dp},mbs={mbs},nmb={ga},zero={zero}"
    return text + (",sp=1" if tp > 1 else "")


def records(engine: str = ENGINE) -> tuple[list[dict], list[dict]]:
    """(runs that ran, crashed configurations) as JSON-lines records; rows whose printed batch disagrees
    with their layout are left out (README: 'completeness: inconsistent')."""
    ran, crashed = [], []
    shapes = {}
    for row in json.loads((DATA / "runs.json").read_text()):
        size = row["model_name"].split()[1]
        shapes.setdefault(size, row)
        if row["completeness"] != "full":
            continue
        precise = (row.get("extra_metrics") or {}).get("precise_from_space_commit_708b73a") or {}
        ran.append(
            {
                "id": row["id"],
                "size": size,
                "model": model_record(row),
                "cluster": {"preset": PRESET, "nodes": row["num_gpus"] // 8},
                "seq_len": SEQ,
                "global_batch": row["global_batch_size"],
                "layout": layout_text(
                    row["tp"], row["pp"], row["dp"], row["micro_batch_size"], row["grad_accum_steps"], row["zero_stage"]
                ),
                "engine": engine,
                "status": "ok",
                "tokens_per_s_per_gpu": precise.get("tok_s_gpu", row["tokens_per_sec_per_gpu"]),
                "peak_memory_gib": precise.get("mem_reserved_GiB", row["memory_per_gpu_gib"]),
                "memory_kind": "reserved",
                # the benchmark CSV's row is written by global rank 0 with its own max_memory_reserved
                # (nanotron helpers.py log_throughput at e24d2483: `if dist.get_rank(world_pg) == 0: write_to_csv`)
                "memory_rank": "rank0",
                "_key": (size, row["tp"], row["pp"], row["dp"], row["micro_batch_size"], row["grad_accum_steps"]),
            }
        )
    for row in json.loads((DATA / "crashed.json").read_text())["runs"]:
        shape = shapes.get(row["model"])
        if shape is None:  # a model none of whose runs ran: no shape to read
            continue
        crashed.append(
            {
                "id": row["id"],
                "size": row["model"],
                "model": model_record(shape) | {"tied_embeddings": False},
                "cluster": {"preset": PRESET, "nodes": row["nodes"]},
                "seq_len": SEQ,
                "global_batch": row["gbs"],
                "layout": layout_text(row["tp"], row["pp"], row["dp"], row["mbs"], row["grad_accum"], row["zero"]),
                "engine": engine,
                "status": "oom",
            }
        )
    return ran, crashed


def as_runs(recs: list[dict]) -> list[MeasuredRun]:
    text = "\n".join(json.dumps({k: v for k, v in r.items() if not k.startswith("_") and k != "size"}) for r in recs)
    return read_runs(text, "ultrascale-playbook")


def group_scores(recs: list[dict], runs: list[MeasuredRun], tuning: EngineTuning) -> dict:
    """The scores of one group (one model on one GPU count) under `tuning`."""
    p = predict_runs(runs, tuning)
    t, cap, seen, ranked, fits = p.time, p.capacity, p.seen, p.ranked, p.fits
    tok = np.array([r["tokens_per_s_per_gpu"] for r in recs])
    mem = np.array([r["peak_memory_gib"] for r in recs]) * 2**30
    g = runs[0].cluster.world_size
    pred = runs[0].training.global_batch_size * SEQ / (t * g)  # tokens/s per GPU (0 where refused)
    refused = ~np.isfinite(t)
    # the search ranks only what fits with the memory headroom (a 'memory_tight' layout is not ranked, `ranked`):
    # berth's first choice is the fastest of those
    pred = np.where(refused, 0.0, pred)
    ok = ~refused
    rho = float(spearmanr(pred[ok], tok[ok]).statistic) if ok.sum() >= 3 else float("nan")
    best = tok.max()
    rank = np.where(ranked & ok, pred, -1.0)
    first = int(np.argmax(rank))
    top3 = np.argsort(-rank)[:3]
    # ZeRO-0/1 twins merged: one entry per layout without its ZeRO stage
    twins: dict[tuple, list[int]] = defaultdict(list)
    for i, r in enumerate(recs):
        twins[r["_key"]].append(i)
    merged_meas = {k: tok[v].max() for k, v in twins.items()}
    merged_pred = {k: rank[v].max() for k, v in twins.items()}
    pick = max(merged_pred, key=lambda k: merged_pred[k])
    # the data's own repeatability: a layout run at ZeRO-0 and at ZeRO-1 is the same work but for the optimizer step's
    # reduce-scatter and gather, so the two measurements say how well the sweep agrees with itself (twin_scores)
    zero = [r.layout.zero_stage for r in runs]
    pairs = [sorted(v, key=lambda i: zero[i]) for v in twins.values() if sorted(zero[i] for i in v) == [0, 1]]
    err = np.abs(pred[ok] / tok[ok] - 1.0)
    measured_s = np.array([r.step_time_s for r in runs], dtype=float)
    nmb = np.array([r.layout.num_microbatches for r in runs])
    excess = (measured_s - np.where(ok, t, 0.0)) / nmb  # seconds a micro-batch beyond the prediction
    stalled = ok & (excess > STALL_S)
    rest = ok & ~stalled
    pp = np.array([r.layout.pp for r in runs])

    def excess_median(rows: np.ndarray) -> float | None:
        return float(np.median(excess[rows])) if rows.any() else None

    return {
        "gpus": g,
        "runs": len(recs),
        "rho": rho,
        "regret": float(1.0 - tok[first] / best),
        "regret_twins_merged": float(1.0 - merged_meas[pick] / max(merged_meas.values())),
        "top3_hit": bool(int(np.argmax(tok)) in set(top3.tolist())),
        "median_error": float(np.median(err)) if err.size else float("nan"),
        "worst_error": float(np.max(err)) if err.size else float("nan"),
        # against the reported rank's prediction (rank 0's); whether a run fits is the peak's (`fits`)
        "memory_error_median": float(np.median(seen[ok] / mem[ok] - 1.0)) if ok.any() else float("nan"),
        "memory_abs_error_median": float(np.median(np.abs(seen[ok] / mem[ok] - 1.0))) if ok.any() else float("nan"),
        "ran_predicted_not_to_fit": int(np.sum(ok & ~fits)),
        # of those, runs whose reserved peak reached the allocator's ceiling: capped, not measured, and slowed by
        # the allocator's retries (planner/engine_fit.py CEILING)
        "ran_at_ceiling_predicted_not_to_fit": int(np.sum(ok & ~fits & (mem >= CEILING * cap))),
        "refused": int(refused.sum()),
        "refused_ids": [r.id for r, x in zip(runs, refused, strict=True) if x],  # which, to read them in runs.json
        "stalled": int(stalled.sum()),
        "twins": twin_scores(np.array(pairs, dtype=int).reshape(-1, 2), tok, pred, ok),
        "rho_unstalled": float(spearmanr(pred[rest], tok[rest]).statistic) if rest.sum() >= 3 else float("nan"),
        # the median excess a micro-batch with a pipeline and without (null: no such run): where it is a cluster's
        # size, not a layout's, one GPU count's probes cannot teach it (docs/accuracy.md, stalled runs)
        "excess_per_microbatch_s": {
            "pipeline": excess_median(ok & (pp > 1)),
            "no_pipeline": excess_median(ok & (pp == 1)),
        },
    }


def twin_scores(pairs: np.ndarray, tok: np.ndarray, pred: np.ndarray, ok: np.ndarray) -> dict:
    """A group's layouts that ran at both ZeRO-0 and ZeRO-1 (`pairs`: rows of their ZeRO-0 and ZeRO-1 indices): rho
    between the two measurements (the sweep measuring itself again), berth's rho on the
    same layouts (against each stage's measurement, the mean of the two), and the top-1 regret of choosing by one
    stage's measurements scored on the other's (the worse of the two ways). A diagnostic, not a score: ZeRO-0 and
    ZeRO-1 also differ in what they do (docs/accuracy.md), so this is not a bound in the strict sense."""
    pairs = pairs[ok[pairs].all(axis=1)] if len(pairs) else pairs
    if len(pairs) < 5:  # too few layouts for a rank correlation that says anything
        return {"pairs": int(len(pairs)), "rho_between_twins": None, "rho_berth_on_twins": None, "regret_by_twin": None}
    z0, z1 = tok[pairs[:, 0]], tok[pairs[:, 1]]
    berth = [spearmanr(pred[pairs[:, k]], tok[pairs[:, k]]).statistic for k in (0, 1)]
    regret = max(1.0 - z1[np.argmax(z0)] / z1.max(), 1.0 - z0[np.argmax(z1)] / z0.max())
    return {
        "pairs": int(len(pairs)),
        "rho_between_twins": float(spearmanr(z0, z1).statistic),
        "rho_berth_on_twins": float(np.mean(berth)),
        "regret_by_twin": float(regret),
    }


def crashed_predicted_to_fit(runs: list[MeasuredRun], tuning: EngineTuning) -> int:
    if not runs:
        return 0
    return int(np.sum(predict_runs(runs, tuning).fits))


def summary(groups: list[dict]) -> dict:
    def med(key: str) -> float:
        return float(np.nanmedian([g[key] for g in groups]))

    return {
        "groups": len(groups),
        "rho_median": med("rho"),
        "rho_min": float(np.nanmin([g["rho"] for g in groups])),
        "regret_median": med("regret"),
        "regret_worst": float(max(g["regret"] for g in groups)),
        "regret_twins_merged_median": med("regret_twins_merged"),
        "regret_twins_merged_worst": float(max(g["regret_twins_merged"] for g in groups)),
        "top3_hits": int(sum(g["top3_hit"] for g in groups)),
        "throughput_error_median": med("median_error"),
        "memory_error_median": med("memory_error_median"),
        "memory_abs_error_median": med("memory_abs_error_median"),
        "ran_predicted_not_to_fit": int(sum(g["ran_predicted_not_to_fit"] for g in groups)),
        "ran_at_ceiling_predicted_not_to_fit": int(sum(g["ran_at_ceiling_predicted_not_to_fit"] for g in groups)),
        "refused": int(sum(g["refused"] for g in groups)),
        "crashed_predicted_to_fit": int(sum(g["crashed_predicted_to_fit"] for g in groups)),
        "stalled": int(sum(g["stalled"] for g in groups)),
        "rho_unstalled_median": med("rho_unstalled"),
        **twin_summary([g["twins"] for g in groups]),
    }


def twin_summary(twins: list[dict]) -> dict:
    """`twin_scores` over the groups with enough twins: medians, and the worst regret of choosing by a twin."""
    scored = [t for t in twins if t["rho_between_twins"] is not None]

    def over(key: str, how) -> float | None:
        return float(how([t[key] for t in scored])) if scored else None

    return {
        "twin_groups": len(scored),
        "rho_between_twins_median": over("rho_between_twins", np.median),
        "rho_berth_on_twins_median": over("rho_berth_on_twins", np.median),
        "regret_by_twin_worst": over("regret_by_twin", max),
    }


def loaded(engine: str = ENGINE) -> tuple[dict, dict, dict]:
    """(records by group, their runs, the crashed configurations' runs by group); a group is (model, GPUs)."""
    ran, crashed = records(engine)
    by_group: dict[tuple[str, int], list[dict]] = defaultdict(list)
    for r in ran:
        by_group[(r["size"], r["cluster"]["nodes"] * 8)].append(r)
    runs = {k: as_runs(v) for k, v in sorted(by_group.items())}
    crashed_runs: dict[tuple[str, int], list[MeasuredRun]] = defaultdict(list)
    for r in crashed:
        crashed_runs[(r["size"], r["cluster"]["nodes"] * 8)].extend(as_runs([r]))
    return by_group, runs, crashed_runs


def loop(data: tuple[dict, dict, dict], size: str, probe_gpus: int, probes: int) -> dict:
    """Probe `probes` layouts of `size` on `probe_gpus` GPUs, calibrate on their measured values (as `berth
    calibrate` does: with its k-fold held-out check, which keeps the prior's memory parameters where the fitted
    ones hold out worse), and score every other group before (the prior) and after."""
    by_group, runs, crashed_runs = data
    prior = EngineTuning()
    key = (size, probe_gpus)
    if key not in runs:  # the model has no runs on that GPU count: the nearest count with the most runs
        counts = [g for s, g in runs if s == size]
        key = (size, min(counts, key=lambda g: (abs(math.log2(g / probe_gpus)), -len(runs[(size, g)]))))
    pool = runs[key]
    first = pool[0]
    picks = probe(first.model, first.training, first.cluster, probes, layouts=[r.layout for r in pool])
    index = [next(i for i, r in enumerate(pool) if r.layout == p.plan.layout) for p in picks]
    fit = fit_engine([pool[i] for i in index], prior, folds=FOLDS)
    scored: dict[str, list[dict]] = {"before": [], "after": []}
    for gk, recs in sorted(by_group.items()):
        if gk == key:
            continue
        for label, tuning in (("before", prior), ("after", fit.tuning)):
            s = group_scores(recs, runs[gk], tuning)
            s["model"] = gk[0]
            s["crashed_predicted_to_fit"] = crashed_predicted_to_fit(crashed_runs.get(gk, []), tuning)
            scored[label].append(s)
    return {
        "probe_gpus": key[1],  # the GPU count probed: the one asked for, or the nearest the model has runs on
        "probes": [{"layout": p.plan.layout.short(), "why": p.why} for p in picks],
        "probe_records": [by_group[key][i] for i in index],
        "fit": fit.document(f"nanotron-{size}")["tuning"],
        "fitted": fit.fitted,
        "not_fitted": fit.not_fitted,
        "set_aside": fit.set_aside,  # probes whose step time the fit set aside as outliers (planner/engine_fit.py)
        "fit_errors": fit.errors,
        "before": summary(scored["before"]),
        "after": summary(scored["after"]),
        "groups_after": scored["after"],
    }


_LOADED: dict[str, tuple[dict, dict, dict]] = {}  # the data per engine, read before the workers fork


def _one_loop(job: tuple[str, str, int, int]) -> dict:
    engine, size, gpus, probes = job
    return loop(_LOADED[engine], size, gpus, probes)


def _run_loops(jobs: list[tuple[str, str, int]], probes: int, data: dict[str, tuple[dict, dict, dict]]) -> list[dict]:
    """`loop` for each (engine, model, probe GPU count), in order: on two forked processes where the platform forks
    and has two cores (each loop is deterministic, so the figures are the same as one after the other)."""
    _LOADED.update(data)
    for engine in {j[0] for j in jobs} - set(_LOADED):
        _LOADED[engine] = loaded(engine)
    work = [(e, s, g, probes) for e, s, g in jobs]
    workers = min(2, os.cpu_count() or 1, len(work))
    if workers > 1 and "fork" in multiprocessing.get_all_start_methods():
        with multiprocessing.get_context("fork").Pool(workers) as pool:
            return pool.map(_one_loop, work, chunksize=1)
    return [_one_loop(w) for w in work]


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--probe-gpus", type=int, default=PROBE_GPUS)
    ap.add_argument("--probes", type=int, default=PROBES)
    ap.add_argument("--no-write", action="store_true")
    ap.add_argument("--engine", default=ENGINE, choices=(ENGINE, GENERIC))
    args = ap.parse_args(argv)
    t0 = time.time()
    data = loaded(args.engine)
    sizes = sorted({k[0] for k in data[1]})
    result: dict = {
        "probe_gpus": args.probe_gpus,
        "probes": args.probes,
        "preset": PRESET,
        "engine": args.engine,
        "models": {},
    }
    # every loop is independent: (engine, model, probe GPU count), run on up to two processes
    jobs = [(args.engine, size, args.probe_gpus) for size in sizes]
    if args.engine != GENERIC:  # the same loop from the generic engine: what the nanotron entry adds
        jobs += [(GENERIC, size, args.probe_gpus) for size in sizes]
    # the same loop with the probes on another GPU count: how much the figures hang on which runs were probed
    jobs += [(args.engine, size, g) for g in OTHER_PROBE_GPUS if g != args.probe_gpus for size in sizes]
    done = dict(zip(jobs, _run_loops(jobs, args.probes, {args.engine: data}), strict=True))
    for size in sizes:
        r = done[(args.engine, size, args.probe_gpus)]
        chosen_records = r.pop("probe_records")
        if size == "8B" and not args.no_write and args.probe_gpus == PROBE_GPUS and args.probes == PROBES:
            lines = (
                json.dumps({k: v for k, v in x.items() if not k.startswith("_") and k != "size"})
                for x in chosen_records
            )
            EXAMPLE.write_text(EXAMPLE_HEADER + "".join(line + "\n" for line in lines))
        result["models"][size] = r
    if args.engine != GENERIC:
        result["generic"] = {}
        for size in sizes:
            r = done[(GENERIC, size, args.probe_gpus)]
            result["generic"][size] = {k: r[k] for k in ("fitted", "set_aside", "before", "after")}
    result["other_probe_gpus"] = {}
    for g in OTHER_PROBE_GPUS:
        if g != args.probe_gpus:
            at = {size: done[(args.engine, size, g)] for size in sizes}
            result["other_probe_gpus"][str(g)] = {
                size: {"probe_gpus": r["probe_gpus"], "before": r["before"], "after": r["after"]}
                for size, r in at.items()
            }
    result["seconds"] = round(time.time() - t0, 1)
    print_result(result)
    if not args.no_write:
        OUT.write_text(json.dumps(result, indent=1, sort_keys=True) + "\n")
    return result


def print_result(result: dict) -> None:
    for size, r in result["models"].items():
        print(f"\nprobes: {size} model on {r['probe_gpus']} GPUs ({len(r['probes'])} runs); fitted {r['fitted']}")
        for p in r["probes"]:
            print(f"  {p['layout']}: {p['why']}")
        for run_id, why in r["set_aside"].items():
            print(f"  set aside: {run_id}: {why}")
        print(f"  scored on the other {r['after']['groups']} groups of both models:")
        keys = [
            ("rho_median", "median rho"),
            ("regret_median", "median top-1 regret"),
            ("regret_worst", "worst top-1 regret"),
            ("regret_twins_merged_median", "median regret, twins merged"),
            ("regret_twins_merged_worst", "worst regret, twins merged"),
            ("top3_hits", "top-3 hits"),
            ("throughput_error_median", "median |throughput error|"),
            ("memory_abs_error_median", "median |memory error|"),
            ("ran_predicted_not_to_fit", "ran, predicted not to fit"),
            ("ran_at_ceiling_predicted_not_to_fit", "  of them at the allocator's cap"),
            ("crashed_predicted_to_fit", "crashed, predicted to fit"),
            ("refused", "ran, refused as invalid"),
            ("stalled", f"stalled (> {STALL_S} s a micro-batch)"),
            ("rho_unstalled_median", "  median rho without them"),
            ("rho_between_twins_median", "median rho, ZeRO-0 vs 1 twins"),
            ("rho_berth_on_twins_median", "  berth's on the same layouts"),
            ("regret_by_twin_worst", "worst regret, chosen by a twin"),
        ]
        generic = result.get("generic", {}).get(size)
        columns = [("generic", generic["before"]), ("fitted", generic["after"])] if generic else []
        columns += [(f"{result['engine'][:8]}", r["before"]), ("fitted", r["after"])]
        print(f"  {'':32s} " + " ".join(f"{name:>9s}" for name, _ in columns))
        for k, label in keys:
            cells = [c[k] for _, c in columns]
            print(f"  {label:32s} " + " ".join(f"{v:9.3f}" if isinstance(v, float) else f"{v!s:>9s}" for v in cells))
        head = f"{'rho':>6s} {'regret':>7s} {'twins':>6s} {'top3':>5s} {'|err|':>6s} {'mem':>6s}"
        print(f"  {'group':12s} {head} stalled    excess s/micro-batch (pp > 1, pp = 1)  twins: rho (berth's)")
        for g in r["groups_after"]:
            ex = " ".join("   -" if v is None else f"{v:+.2f}" for v in g["excess_per_microbatch_s"].values())
            t = g["twins"]
            if t["rho_between_twins"] is not None:
                ex += f"      {t['rho_between_twins']:5.2f} ({t['rho_berth_on_twins']:.2f}) of {t['pairs']}"
            print(
                f"  {g['model']:>3s} {g['gpus']:4d} GPUs {g['rho']:6.2f} {g['regret']:7.3f} "
                f"{g['regret_twins_merged']:6.3f} {'yes' if g['top3_hit'] else 'no':>5s} {g['median_error']:6.2f} "
                f"{g['memory_error_median']:+6.2f} {g['stalled']:3d} of {g['runs']:<4d} {ex}"
            )
    other = result.get("other_probe_gpus", {})
    if other:
        print("\nthe same loop with the probes on other GPU counts (after calibration):")
        print(f"  {'probes on':14s} {'rho':>6s} {'regret':>7s} {'twins':>6s} {'|err|':>6s} {'|mem|':>6s}")
        for models in other.values():
            for size, r in models.items():
                a = r["after"]
                print(
                    f"  {size} {r['probe_gpus']:>4} GPUs   {a['rho_median']:6.3f} {a['regret_median']:7.3f} "
                    f"{a['regret_twins_merged_median']:6.3f} {a['throughput_error_median']:6.3f} "
                    f"{a['memory_abs_error_median']:6.3f}"
                )
    print(f"\n{result['seconds']} s")


if __name__ == "__main__":
    main()
