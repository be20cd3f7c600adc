"""A100 compute efficiency from published runs: one parameter fitted on one source, scored on the others.

The A100 profiles (a100-80g, a100-40g) carry the H100's measured GEMM and flash-attention shape
models (benchmarks/layer_fidelity.py) with the asymptotes scaled by the best-shape matmul ratio
(MAMF 0.869 / 0.803). No A100 microbenchmarks exist here, so this checks that derivation against
whole published iterations and fits a single factor on the asymptotes:

- fit set: Narayanan et al. 2021 (Megatron-LM, Tables 1-2; A100 80GB, fp16, unfused attention,
  large GEMMs: the runs that isolate GEMM efficiency best);
- scored: Korthikanti et al. 2022 (Megatron-LM, same cluster, a year later) and MosaicML's
  llm-foundry FSDP runs (A100 40 and 80 GB, flash attention, bf16).

The factor minimizes the median |log(predicted / measured)| step time of the fit set. The cases
(layouts, engine facts, FLOP accounting) are benchmarks/published.py's; nothing else changes.

Outcome (2026-11-23): the fit gives 1.054; held-out Megatron (Korthikanti 2022) improves (median
|error| 0.105 -> 0.062) but MosaicML gets worse (0.124 -> 0.162), whose error grows with the
sequence length (-3% at 512 tokens, -41% at 65,536: its attention, not its GEMMs, is slower than
the model). The families disagree on the factor, so the profiles keep the derivation (factor 1);
this benchmark stays as the check of it.

Run: `python -m benchmarks.a100_fit` (prints and saves benchmarks/results/a100_fit.json).
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import numpy as np
from scipy.optimize import minimize_scalar

from benchmarks import published
from berth.specs.hardware import DeviceProfile

OUT = Path(__file__).parent / "results" / "a100_fit.json"
FIT_FAMILIES = ("narayanan2021",)
SCALE_BOUNDS = (0.7, 1.4)


def scaled(device: DeviceProfile, scale: float) -> DeviceProfile:
    """The device with its GEMM and attention asymptotes x scale (capped at 1)."""
    g = device.gemm_shape.model_copy(update={"max_fraction": min(1.0, device.gemm_shape.max_fraction * scale)})

    def p(pass_model):
        return pass_model.model_copy(
            update={
                "max_fraction": min(1.0, pass_model.max_fraction * scale),
                "max_fraction_small_head": min(1.0, pass_model.max_fraction_small_head * scale),
            }
        )

    a = device.attention_shape.model_copy(
        update={"forward": p(device.attention_shape.forward), "backward": p(device.attention_shape.backward)}
    )
    return device.model_copy(update={"gemm_shape": g, "attention_shape": a})


def _errors(cases, scale: float) -> list[float]:
    out = []
    for case in cases:
        cluster = case.cluster.model_copy(update={"device": scaled(case.cluster.device, scale)})
        r = published.predict(published.Case(**{**case.__dict__, "cluster": cluster}))
        out.append(r.predicted_step_s / case.measured_step_s - 1.0)
    return out


def _stats(errs: list[float]) -> dict:
    return {
        "runs": len(errs),
        "median_abs_error": statistics.median(abs(e) for e in errs),
        "mean_error": statistics.fmean(errs),
        "worst_abs_error": max(abs(e) for e in errs),
    }


def run() -> dict:
    usable, _ = published.cases(published.load_runs())
    a100 = [c for c in usable if c.cluster.device.name.startswith("a100")]
    fit = [c for c in a100 if c.family in FIT_FAMILIES]
    families = sorted({c.family for c in a100})

    def loss(scale):
        return statistics.median(abs(np.log1p(e)) for e in _errors(fit, scale))

    best = minimize_scalar(loss, bounds=SCALE_BOUNDS, method="bounded", options={"xatol": 1e-3})
    scale = float(best.x)
    result = {
        "fit_families": list(FIT_FAMILIES),
        "scale": scale,
        "asymptotes_before": {c.cluster.device.name: c.cluster.device.gemm_shape.max_fraction for c in a100},
        "families": {},
    }
    for fam in families:
        cs = [c for c in a100 if c.family == fam]
        result["families"][fam] = {
            "role": "fit" if fam in FIT_FAMILIES else "scored",
            "before": _stats(_errors(cs, 1.0)),
            "after": _stats(_errors(cs, scale)),
        }
    return result


def main(argv: list[str]) -> int:
    result = run()
    print(f"A100 asymptote scale fitted on {', '.join(result['fit_families'])}: {result['scale']:.3f}")
    for fam, r in result["families"].items():
        b, a = r["before"], r["after"]
        print(
            f"  {fam:<22} {r['role']:<6} n={b['runs']:>3}  median |err| {b['median_abs_error']:.3f} -> "
            f"{a['median_abs_error']:.3f}  mean {b['mean_error']:+.3f} -> {a['mean_error']:+.3f}  "
            f"worst {b['worst_abs_error']:.3f} -> {a['worst_abs_error']:.3f}"
        )
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2))
    print(f"saved {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
