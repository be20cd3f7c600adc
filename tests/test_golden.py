"""Golden cases: the published A100 runs in shared/reference/published_runs_a100.json.

How each source counts: Narayanan 2021 reports TFLOP/s by its Eq. 3, which counts the extra
forward of full recomputation (4 passes); Korthikanti 2022 reports iteration times directly. We
compare step times: for Narayanan the step time implied by Eq. 3 FLOPs / (GPUs x TFLOP/s), for
Korthikanti the measured one. Nothing in the A100 profile was fitted to these runs: the GEMM
efficiency is the MAMF best-shape fraction and the links are datasheet and nccl-tests figures.

Tolerance: each run within 20% and the mean absolute error within 12%. The runs include work the
model leaves out (data loading, fp16 loss scaling, logging, the tied-embedding all-reduce), the
published TFLOP/s are rounded (~0.5%), and 2021-era kernels fall short of the best-shape GEMM
efficiency; 20% still separates a good layout from a mediocre one (Table 1 spans 2x in layouts).

Excluded: Narayanan 2021 Table 2's ZeRO-3 rows, run with DeepSpeed's ZeRO-3 of 2021. berth models
an FSDP-style ZeRO-3 whose gathers overlap compute over all NIC rails; those runs reached
44-144 TFLOP/s and degrade with scale in a way that implementation, not the hardware, explains.
"""


from planner.search import predict_layouts
from planner.specs import Layout, ModelSpec, TrainingSpec
from planner.topology import cluster_from_preset

PER_RUN_TOLERANCE = 0.20
MEAN_TOLERANCE = 0.12


def _schedule(row, pp, vpp):
    if pp == 1:
        return "1f1b"
    return "interleaved_1f1b" if vpp > 1 else "1f1b"


def golden_rows(rows):
    out = []
    for r in rows:
        d = r["derived"]
        tp = r["tp"] or d.get("tp")
        if r["completeness"] != "full" or tp is None or "zero3" in r["id"]:
            continue
        measured = r["step_time_s"] or d.get("implied_step_time_s")
        if measured is None:
            continue
        out.append(r)
    return out


def predict_row(r):
    d = r["derived"]
    tp, pp = r["tp"] or d["tp"], r["pp"] or d["pp"]
    n, batch = r["num_gpus"], r["global_batch_size"] or d["global_batch_size"]
    dp, mbs = n // (tp * pp), r["micro_batch_size"]
    vpp = r["virtual_pipeline_stages"] or d.get("virtual_pipeline_stages") or 1
    recompute = "selective" if str(r["activation_recompute"]).startswith("selective") else "full"
    model = ModelSpec(name=r["id"], num_layers=r["num_layers"], hidden_size=r["hidden_size"],
                      num_attention_heads=r["num_attention_heads"], ffn_hidden_size=4 * r["hidden_size"],
                      vocab_size=r["vocab_size"], mlp="gelu", tied_embeddings=True, dropout=True)
    training = TrainingSpec(seq_len=r["seq_len"], global_batch_size=batch, precision="fp16",
                            flash_attention=False, framework="megatron")
    layout = Layout(tp=tp, pp=pp, dp=dp, micro_batch_size=mbs, num_microbatches=batch // (dp * mbs),
                    virtual_stages=vpp, schedule=_schedule(r, pp, vpp), recompute=recompute,
                    sequence_parallel=bool(r["sequence_parallel"]))
    return predict_layouts(model, training, cluster_from_preset("dgx-a100-80g", n // 8), [layout])[0]


def test_published_runs(published_runs):
    rows = golden_rows(published_runs)
    assert len(rows) >= 20
    errors = {}
    for r in rows:
        plan = predict_row(r)
        assert plan.infeasible_reason is None, (r["id"], plan.infeasible_reason)
        assert plan.prediction.fits and plan.prediction.peak_memory_bytes <= 80 * 2**30, r["id"]
        measured = r["step_time_s"] or r["derived"]["implied_step_time_s"]
        errors[r["id"]] = plan.prediction.step_time_s / measured - 1.0
    worst = max(errors, key=lambda k: abs(errors[k]))
    assert abs(errors[worst]) <= PER_RUN_TOLERANCE, (worst, errors[worst])
    mean = sum(abs(e) for e in errors.values()) / len(errors)
    assert mean <= MEAN_TOLERANCE, mean


def test_selective_recompute_beats_full_as_published(published_runs):
    """Korthikanti 2022 Table 5: sequence parallel + selective recompute is ~29-32% faster than
    full recompute for every model; the prediction must order them the same way."""
    by_id = {r["id"]: r for r in published_runs}
    for size in ("22B", "175B", "530B", "1T"):
        full = predict_row(by_id[f"korthikanti2022_t5_{size}_fullrecompute"]).prediction.step_time_s
        sel = predict_row(by_id[f"korthikanti2022_t5_{size}_sp_selective"]).prediction.step_time_s
        assert 1.15 < full / sel < 1.6, (size, full / sel)
