"""Layer fidelity: the cost model's own compute terms against one H100's measurements.

Data: benchmarks/data/reference/h100-microbench (README and PROVENANCE there; one H100 80GB HBM3, torch 2.11):
gemm.json (bf16 GEMMs by shape and pass), attention.json (flash SDPA forward/backward),
layer.json (one decoder layer of the bundled executor, `executor/model.py: Block(spec, tp)`, fp32
parameters under bf16 autocast: forward and forward+backward seconds), head.json (LM head + fp32
cross-entropy), optimizer.json (AdamW).

What it does:
- GEMM and attention: fits the device's shape models (cost_models/compute.py) and scores them on
  held-out shapes (GEMMs: leave one hidden size out; attention: leave one head configuration out).
  The timings of isolated kernels carry a host floor (~30 us of Python dispatch per call on an idle
  GPU, ~180 us for an autograd.grad call); the fit models it as max(kernel, floor) and the
  device model keeps only the kernel part (dispatch is a framework term, below).
- Layer: predicts every usable row of layer.json with `compute.layer_compute_s` (forward, and
  forward + backward) on the h100-sxm profile; the three free parameters of the bundled executor's
  framework entry (LAYER_FREE: bytes per token per hidden unit forward and backward, and the
  exposed share of the host/device overlap) are fitted on the rows of half the models and scored
  on the rows of the other half, and the reverse. The host dispatch per pass is not fitted: the
  layer's kernel count (benchmarks/op_census.py) x the measured host time of one eager op
  (`host_dispatch`).
  The other entries (ffn_bytes, weight_bytes, optimizer bytes) are counted from the executor's
  code and not fitted. Usable rows: a row slower by more than MONOTONE_SLACK than a row of the
  same model and tp slice with at least its sequence and batch (strictly more work) is a timing
  outlier and left out (4 of 328 figures).
- Head: fits loss_bytes_per_logit and head_dispatch_s to head.json.

Run: `python -m benchmarks.layer_fidelity` (prints and saves benchmarks/results/layer_fidelity.json);
`--fit` also prints the fitted values for the profile (hardware_profiles/devices/h100-sxm.json).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import least_squares

import benchmarks
from berth.cost_models import compute
from berth.hardware_profiles import load_device
from berth.specs.hardware import (
    AttentionPassModel,
    AttentionShapeModel,
    DeviceProfile,
    GemmShapeModel,
)
from berth.specs.models import presets
from berth.specs.tree import ModelSpec, TrainingSpec

REFERENCE = benchmarks.REFERENCE / "h100-microbench"
OUT = Path(__file__).parent / "results" / "layer_fidelity.json"
DEVICE = "h100-sxm"
FRAMEWORK = "pytorch"  # the bundled executor (eager PyTorch, fp32 parameters under bf16 autocast)

# Targets of issue 12 for held-out models (forward and forward+backward rows together).
TARGET_MAPE = 0.08
TARGET_WORST = 0.25
MONOTONE_SLACK = 0.05  # a row more than 5% slower than a row with strictly more work is an outlier
LAYER_FREE = ("hidden_bytes_fwd", "hidden_bytes_bwd", "dispatch_exposed_fraction")
LAYER_SCALE = np.array([50.0, 100.0, 0.5])  # typical magnitudes, to condition the fit
LAYER_UPPER = np.array([1e3, 1e3, 2.0])  # in units of LAYER_SCALE: the exposed fraction is <= 1
TINY_OP = "tiny op launch (ones+mul)"  # bandwidth.json: one call of two eager ops on an idle GPU


def load(name: str, reference: Path = REFERENCE) -> list[dict]:
    path = reference / f"{name}.json"
    if not path.is_file():
        raise FileNotFoundError(f"reference data not found: {path}")
    return [r for r in json.loads(path.read_text())["rows"] if "error" not in r]


def host_dispatch(reference: Path = REFERENCE) -> dict[str, float]:
    """The executor's host dispatch per layer pass, measured and counted rather than fitted: the kernels
    of its layer (benchmarks/op_census.py, forward and backward) x the host time of one eager op
    (bandwidth.json: a call of two tiny ops, halved). Fitting it to layer.json cannot tell it apart
    from device time on the large layers, where the GPU hides it."""
    from benchmarks.op_census import executor_census  # torch: the census runs the executor's layer

    rows = json.loads((reference / "bandwidth.json").read_text())["rows"]
    per_op = next(r["seconds"] for r in rows if r["op"] == TINY_OP) / 2.0
    kernels = executor_census()
    return {
        "dispatch_fwd_s": kernels["forward"]["all_kernels"] * per_op,
        "dispatch_bwd_s": kernels["backward"]["all_kernels"] * per_op,
    }


def _mape(pred, meas) -> dict[str, float]:
    err = np.asarray(pred) / np.asarray(meas) - 1.0
    return {
        "n": int(err.size),
        "mape": float(np.mean(np.abs(err))),
        "worst": float(np.max(np.abs(err))),
        "bias": float(np.mean(err)),
    }


# ----------------------------------------------------------------------------------------- GEMMs
def _gemm_arrays(rows):
    m, n, k, t = (np.array([r[key] for r in rows], float) for key in ("m", "n", "k", "seconds"))
    return m, n, k, t


def _gemm_kernel_s(shape: GemmShapeModel, peak: float, m, n, k):
    inv = (1.0 + shape.m_knee / m + shape.n_knee / n + shape.k_knee / k) / shape.max_fraction
    return 2.0 * m * n * k / peak * inv


def fit_gemm(rows, peak: float) -> tuple[GemmShapeModel, float]:
    """The shape model and the host floor of an isolated call, fitted on log time."""
    m, n, k, t = _gemm_arrays(rows)

    def model(x):
        return GemmShapeModel(max_fraction=min(x[0], 1.0), m_knee=x[1] * 100, n_knee=x[2] * 100, k_knee=x[3] * 100)

    def res(x):
        return np.log((_gemm_kernel_s(model(x), peak, m, n, k) + x[4] * 1e-5) / t)

    r = least_squares(res, [0.75, 0.5, 0.5, 0.5, 3.0], bounds=([0.05, 0, 0, 0, 0], [1.0, 100, 100, 100, 100]))
    return model(r.x), float(r.x[4] * 1e-5)


def score_gemm(shape: GemmShapeModel, floor: float, peak: float, rows) -> dict:
    m, n, k, t = _gemm_arrays(rows)
    pred = _gemm_kernel_s(shape, peak, m, n, k) + floor
    passes = np.array([r["pass"] for r in rows])
    out = {"all": _mape(pred, t)}
    big = t >= 4 * floor
    out["above_4x_floor"] = _mape(pred[big], t[big])  # where the kernel, not the call, dominates
    for p in ("fwd", "dgrad", "wgrad"):
        out[p] = _mape(pred[passes == p], t[passes == p])
    return out


def gemm_holdout(rows, peak: float) -> dict:
    """Leave one hidden size out: fit on the GEMMs of the other five, score its GEMMs."""
    hidden = np.array([r["h"] for r in rows])
    preds, meas = [], []
    for h in sorted(set(hidden.tolist())):
        train = [r for r, hh in zip(rows, hidden, strict=True) if hh != h]
        test = [r for r, hh in zip(rows, hidden, strict=True) if hh == h]
        shape, floor = fit_gemm(train, peak)
        m, n, k, t = _gemm_arrays(test)
        preds.append(_gemm_kernel_s(shape, peak, m, n, k) + floor)
        meas.append(t)
    return _mape(np.concatenate(preds), np.concatenate(meas))


# ------------------------------------------------------------------------------------- attention
def attention_rows(rows) -> list[dict]:
    """Native-kernel rows: `enable_gqa` (mode gqa) and multi-head rows (kv = heads). The executor's
    repeat_interleave of K and V is a framework cost, left to the layer fit."""
    return [r for r in rows if r["mode"] == "gqa" or r["heads"] == r["kv_heads"]]


def _attn_arrays(rows):
    return tuple(np.array([r[key] for r in rows], float) for key in ("heads", "head_dim", "seq", "batch"))


def _attn_kernel_s(p: AttentionPassModel, peak: float, heads, d, s, b, flops_mult):
    flops = flops_mult * 4.0 * b * heads * s * s * d * compute.CAUSAL_WORK_FRACTION
    eff = compute.attention_efficiency(p, d, s, b * heads * s)
    return flops / (peak * eff)


def fit_attention_pass(rows, peak: float, which: str) -> tuple[AttentionPassModel, float]:
    heads, d, s, b = _attn_arrays(rows)
    t = np.array([r[f"{which}_s"] for r in rows])
    mult = 1.0 if which == "fwd" else compute.ATTENTION_BACKWARD_FLOPS

    def model(x):
        return AttentionPassModel(
            max_fraction=min(x[0], 1.0),
            max_fraction_small_head=min(x[1], 1.0),
            seq_knee=x[2] * 1e3,
            rows_knee=x[3] * 1e4,
        )

    def res(x):
        return np.log((_attn_kernel_s(model(x), peak, heads, d, s, b, mult) + x[4] * 1e-5) / t)

    r = least_squares(res, [0.7, 0.6, 1.0, 5.0, 5.0], bounds=([0.05, 0.05, 0, 0, 0], [1.0, 1.0, 100, 1000, 100]))
    return model(r.x), float(r.x[4] * 1e-5)


def fit_attention(rows, peak: float) -> tuple[AttentionShapeModel, dict[str, float]]:
    f, ff = fit_attention_pass(rows, peak, "fwd")
    b, fb = fit_attention_pass(rows, peak, "bwd")
    return AttentionShapeModel(forward=f, backward=b), {"fwd": ff, "bwd": fb}


def score_attention(shape: AttentionShapeModel, floors: dict[str, float], peak: float, rows) -> dict:
    heads, d, s, b = _attn_arrays(rows)
    out = {}
    for which, p, mult in (("fwd", shape.forward, 1.0), ("bwd", shape.backward, compute.ATTENTION_BACKWARD_FLOPS)):
        t = np.array([r[f"{which}_s"] for r in rows])
        pred = _attn_kernel_s(p, peak, heads, d, s, b, mult) + floors[which]
        out[which] = _mape(pred, t)
        big = t >= 3 * floors[which]
        out[f"{which}_above_3x_floor"] = _mape(pred[big], t[big]) if big.any() else {}
    return out


def attention_holdout(rows, peak: float) -> dict:
    """Leave one count of heads per rank out (all its head dims, sequences and batches): fit on
    the others, score it."""
    config = [r["heads"] for r in rows]
    out = {}
    for which in ("fwd", "bwd"):
        preds, meas = [], []
        for c in sorted(set(config)):
            train = [r for r, cc in zip(rows, config, strict=True) if cc != c]
            test = [r for r, cc in zip(rows, config, strict=True) if cc == c]
            p, floor = fit_attention_pass(train, peak, which)
            heads, d, s, b = _attn_arrays(test)
            mult = 1.0 if which == "fwd" else compute.ATTENTION_BACKWARD_FLOPS
            preds.append(_attn_kernel_s(p, peak, heads, d, s, b, mult) + floor)
            meas.append(np.array([r[f"{which}_s"] for r in test]))
        out[which] = _mape(np.concatenate(preds), np.concatenate(meas))
    return out


# ------------------------------------------------------------------------------------ the layer
def _spec(row) -> ModelSpec:
    """The row's model: the preset of that name where berth has one (llama-3.2-1b is built from
    the row: SwiGLU, RMSNorm, as the benchmark's own JSON)."""
    known = presets().get(row["model"])
    if known is not None:
        return known
    return ModelSpec(
        name=row["model"],
        num_layers=16,
        hidden_size=row["hidden"],
        num_attention_heads=row["heads"],
        num_kv_heads=row["kv_heads"],
        ffn_hidden_size=row["ffn"],
        vocab_size=128256,
        mlp="swiglu",
        norm="rmsnorm",
    )


def usable_layer_rows(rows) -> tuple[np.ndarray, np.ndarray]:
    """(forward ok, forward+backward ok) per row: a figure more than MONOTONE_SLACK slower than a
    figure of the same model and tp slice with at least its sequence and batch is an outlier."""

    def ok(key):
        keep = np.ones(len(rows), bool)
        for i, r in enumerate(rows):
            for j, q in enumerate(rows):
                if (
                    i != j
                    and q["model"] == r["model"]
                    and q["tp"] == r["tp"]
                    and q["seq"] >= r["seq"]
                    and q["batch"] >= r["batch"]
                    and q[key] * (1 + MONOTONE_SLACK) < r[key]
                ):
                    keep[i] = False
        return keep

    return ok("fwd_s"), ok("fwd_bwd_s")


def predict_layers(device: DeviceProfile, rows) -> tuple[np.ndarray, np.ndarray]:
    """(forward, forward + backward) seconds of each row by compute.layer_compute_s, one
    vectorized call per (model, sequence length)."""
    fwd, total = np.zeros(len(rows)), np.zeros(len(rows))
    groups: dict[tuple, list[int]] = {}
    for i, r in enumerate(rows):
        groups.setdefault((r["model"], r["seq"]), []).append(i)
    for (_, seq), idx in groups.items():
        spec = _spec(rows[idx[0]])
        training = TrainingSpec(seq_len=seq, global_batch_size=1, framework=FRAMEWORK)
        b = np.array([rows[i]["batch"] for i in idx], float)
        tp = np.array([rows[i]["tp"] for i in idx], float)
        f, bw, _ = compute.layer_compute_s(spec, training, device, b, tp, np.zeros(len(idx)))
        fwd[idx], total[idx] = f, f + bw
    return fwd, total


def with_layer_values(device: DeviceProfile, values: dict[str, float]) -> DeviceProfile:
    fw = device.frameworks[FRAMEWORK].model_copy(update=values)
    return device.model_copy(update={"frameworks": {**device.frameworks, FRAMEWORK: fw}})


def fit_layer(device: DeviceProfile, rows, ok_f, ok_b) -> dict[str, float]:
    """The free framework parameters (LAYER_FREE) that minimize log errors of the usable rows."""
    mf = np.array([r["fwd_s"] for r in rows])
    mb = np.array([r["fwd_bwd_s"] for r in rows])

    def values(x):
        return dict(zip(LAYER_FREE, (x * LAYER_SCALE).tolist(), strict=True))

    def res(x):
        f, t = predict_layers(with_layer_values(device, values(x)), rows)
        return np.concatenate([np.log(f / mf)[ok_f], np.log(t / mb)[ok_b]])

    r = least_squares(res, np.ones(len(LAYER_FREE)), bounds=(0.0, LAYER_UPPER), diff_step=1e-4)
    return values(r.x)


def model_halves(rows) -> tuple[list[str], list[str]]:
    """The models sorted by hidden size (then name), alternately into two halves so that each
    spans small and large layers."""
    sizes = {r["model"]: r["hidden"] for r in rows}
    order = sorted(sizes, key=lambda m: (sizes[m], m))
    return order[0::2], order[1::2]


def layer_scores(device: DeviceProfile, rows, ok_f, ok_b, sel) -> dict:
    f, t = predict_layers(device, rows)
    mf = np.array([r["fwd_s"] for r in rows])
    mb = np.array([r["fwd_bwd_s"] for r in rows])
    sf, sb = sel & ok_f, sel & ok_b
    both = np.concatenate([f[sf] / mf[sf], t[sb] / mb[sb]])
    return {
        "forward": _mape(f[sf], mf[sf]),
        "forward_backward": _mape(t[sb], mb[sb]),
        "both": _mape(both, np.ones_like(both)),
    }


def layer_two_fold(device: DeviceProfile, rows, reference: Path = REFERENCE, dispatch: dict | None = None) -> dict:
    ok_f, ok_b = usable_layer_rows(rows)
    device = with_layer_values(device, dispatch or host_dispatch(reference))
    models = np.array([r["model"] for r in rows])
    out = {}
    for name, (fit_models, test_models) in (("fold_a", model_halves(rows)), ("fold_b", model_halves(rows)[::-1])):
        train = np.isin(models, fit_models)
        sub = [r for r, keep in zip(rows, train, strict=True) if keep]
        values = fit_layer(device, sub, ok_f[train], ok_b[train])
        fitted = with_layer_values(device, values)
        out[name] = {
            "fit_models": list(fit_models),
            "held_out_models": list(test_models),
            "values": values,
            "fit": layer_scores(fitted, rows, ok_f, ok_b, train),
            "held_out": layer_scores(fitted, rows, ok_f, ok_b, ~train),
        }
    out["profile"] = layer_scores(device, rows, ok_f, ok_b, np.ones(len(rows), bool))
    out["unusable"] = [
        f"{r['model']} tp{r['tp']} s{r['seq']} b{r['batch']} {which}"
        for r, a, b in zip(rows, ok_f, ok_b, strict=True)
        for which, ok in (("fwd", a), ("fwd_bwd", b))
        if not ok
    ]
    return out


# ------------------------------------------------------------------------------ head, optimizer
def _head_arrays(rows):
    return tuple(np.array([r[key] for r in rows], float) for key in ("hidden", "vocab", "tp", "tokens", "fwd_bwd_s"))


def predict_head(device: DeviceProfile, rows) -> np.ndarray:
    """LM head + loss as head.json measured it: compute.lm_head_compute_s less the embedding's
    dense gradient (the benchmark has no embedding)."""
    fw = device.frameworks[FRAMEWORK]
    out = np.zeros(len(rows))
    h, v, tp, tokens, _ = _head_arrays(rows)
    for i in range(len(rows)):
        spec = ModelSpec(
            num_layers=1, hidden_size=int(h[i]), num_attention_heads=16, ffn_hidden_size=int(h[i]), vocab_size=int(v[i])
        )
        training = TrainingSpec(seq_len=int(tokens[i]), global_batch_size=1, framework=FRAMEWORK)
        t = compute.lm_head_compute_s(spec, training, device, 1.0, tp[i])
        out[i] = t - compute.memory_bound_time_s(device, fw.weight_bytes_bwd * v[i] * h[i] / tp[i])
    return out


def fit_head(device: DeviceProfile, rows) -> dict[str, float]:
    t = _head_arrays(rows)[-1]

    def values(x):
        return {"loss_bytes_per_logit": float(x[0] * 10), "head_dispatch_s": float(x[1] * 1e-4)}

    def res(x):
        return np.log(predict_head(with_layer_values(device, values(x)), rows) / t)

    r = least_squares(res, [3.0, 3.0], bounds=(0.0, 1e3))
    return values(r.x)


def score_optimizer(device: DeviceProfile, rows) -> dict:
    """The executor's AdamW (foreach=False) rows against compute.optimizer_step_s. The 100M row
    (100 tensors of 1M) is dominated by per-tensor dispatch and reported apart."""
    training = TrainingSpec(seq_len=1, global_batch_size=1, framework=FRAMEWORK)
    out = {}
    for r in rows:
        if r["mode"] == "foreach_false":
            pred = float(compute.optimizer_step_s(device, training, float(r["params"])))
            out[str(r["params"])] = {
                "measured_s": r["seconds"],
                "predicted_s": pred,
                "error": pred / r["seconds"] - 1.0,
            }
    return out


# ------------------------------------------------------------------------------------------ run
def run(fit: bool = False, reference: Path = REFERENCE, device: DeviceProfile | None = None) -> dict:
    device = device or load_device(DEVICE)
    peak = device.peak_flops("bf16")
    gemm = load("gemm", reference)
    attn = attention_rows(load("attention", reference))
    layers = load("layer", reference)
    result: dict = {
        "device": device.name,
        "framework": FRAMEWORK,
        "targets": {"mape": TARGET_MAPE, "worst": TARGET_WORST},
    }
    # the host floor of an isolated call belongs to the measurement, not to the device model:
    # it is refitted here and added to the profile's kernel times when they are scored
    g_fit, floor = fit_gemm(gemm, peak)
    result["gemm"] = {
        "profile": score_gemm(device.gemm_shape, floor, peak, gemm),
        "call_floor_s": floor,
        "held_out_hidden_size": gemm_holdout(gemm, peak),
    }
    a_fit, floors = fit_attention(attn, peak)
    result["attention"] = {
        "profile": score_attention(device.attention_shape, floors, peak, attn),
        "call_floor_s": floors,
        "held_out_heads": attention_holdout(attn, peak),
    }
    dispatch = host_dispatch(reference)
    result["layer"] = layer_two_fold(device, layers, reference, dispatch)
    head = load("head", reference)
    result["head"] = _mape(predict_head(device, head), _head_arrays(head)[-1])
    result["optimizer"] = score_optimizer(device, load("optimizer", reference))
    if fit:
        ok_f, ok_b = usable_layer_rows(layers)
        dev = device.model_copy(update={"gemm_shape": g_fit, "attention_shape": a_fit})
        dev = with_layer_values(dev, dispatch)
        values = {**dispatch, **fit_layer(dev, layers, ok_f, ok_b)}
        result["fitted"] = {
            "gemm_shape": g_fit.model_dump(),
            "attention_shape": a_fit.model_dump(),
            "layer": values,
            "head": fit_head(with_layer_values(dev, values), head),
        }
    return result


def _line(name: str, s: dict) -> str:
    return f"  {name:<34} n={s['n']:>3}  MAPE {s['mape']:.3f}  worst {s['worst']:.3f}  bias {s['bias']:+.3f}"


def main(argv: list[str]) -> int:
    result = run(fit="--fit" in argv)
    g, a, lay = result["gemm"], result["attention"], result["layer"]
    print(f"device {result['device']}, framework {result['framework']} (bundled executor)")
    print("GEMM shape model (gemm.json)")
    print(_line("profile, all rows", g["profile"]["all"]))
    print(_line("held out by hidden size", g["held_out_hidden_size"]))
    print("flash attention shape model (attention.json, native GQA/MHA rows)")
    for w in ("fwd", "bwd"):
        print(_line(f"profile {w}", a["profile"][w]))
        print(_line(f"held out by heads per rank {w}", a["held_out_heads"][w]))
    print("decoder layer (layer.json), two folds by model")
    for fold in ("fold_a", "fold_b"):
        f = lay[fold]
        print(f" {fold}: fit on {', '.join(f['fit_models'])}")
        for part in ("forward", "forward_backward", "both"):
            print(_line(f"held out {part}", f["held_out"][part]))
    print(_line("profile values, all rows, both", lay["profile"]["both"]))
    print(f"  unusable (timing outliers): {', '.join(lay['unusable'])}")
    print(_line("LM head + loss (head.json)", result["head"]))
    for n, o in result["optimizer"].items():
        print(
            f"  AdamW foreach=False {int(n):>11,} params: measured {o['measured_s'] * 1e3:6.2f} ms, "
            f"predicted {o['predicted_s'] * 1e3:6.2f} ms ({o['error']:+.2f})"
        )
    if "fitted" in result:
        print(json.dumps(result["fitted"], indent=2))
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2, default=float))
    print(f"saved {OUT}")
    held = [lay[f]["held_out"]["both"] for f in ("fold_a", "fold_b")]
    ok = all(h["mape"] <= TARGET_MAPE and h["worst"] <= TARGET_WORST for h in held)
    print(f"held-out targets (MAPE <= {TARGET_MAPE:.2f}, worst <= {TARGET_WORST:.2f}): {'met' if ok else 'NOT met'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
