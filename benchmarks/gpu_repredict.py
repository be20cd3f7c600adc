"""Re-predict a GPU evidence run's whole steps several ways, to see which of the profile's terms its error comes from.

    python -m benchmarks.gpu_repredict                       # benchmarks/results/gpu-h200 (the latest H200 run)
    python -m benchmarks.gpu_repredict --folder DIR --device NAME

For every full-run report (`report-*.json`, mode "full") in the folder, the plan it ran (its model, training and
layout) is predicted as `berth compare --cluster local` predicts it on a machine without a GPU
(`topology/clusters.py local_cluster` with a profile), with:
1. `profile.json` of the folder, as `berth profile` measured it there (what the run was predicted with);
2. the same, with the attention terms (`attention_shape`, `attention_peak_fraction`) of the bundled device profile;
3. the bundled device profile (nothing measured on that machine), with the run's device memory;
4. where profile.json predates them (`berth profile` did not time them: no `measurements.gemm_alignment`), profile.json
   with the bundled profile's GEMM alignment slowdowns (`gemm_shape` misaligned_slowdown, odd_slowdown: an odd
   vocabulary's LM head, GPT-2 XL's 50,257, runs 6x slower), which the current code gives a new profile;
5. with `--dispatch-exposed F`, that profile (4, or 1 where there is no 4) with every compute stack's
   `dispatch_exposed_fraction` at F (a what-if: the share of the host's dispatch per layer pass the GPU waits on; the
   bundled profiles have 1.0).
Errors are predicted / measured - 1. Prints a table and writes repredict-attention.json into the folder (with the
code as it is: the README's tables quote what each run predicted then). Nothing is fitted: each variant swaps named
terms to show whether they carry the error.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

from berth.hardware_profiles import DeviceProfile, load_device, profile_from_data
from berth.planner.search import predict_layouts
from berth.specs.tree import Layout, ModelSpec, TrainingSpec
from berth.topology import clusters

ROOT = Path(__file__).resolve().parents[1]
FOLDER = ROOT / "benchmarks" / "results" / "gpu-h200"
# the GEMM shape model's slowdowns at misaligned row lengths (cost_models/compute.py alignment_slowdown), measured
# after the evidence runs in this folder: their profile.json files predate them (1.0, no slowdown)
ALIGNMENT_TERMS = ("misaligned_slowdown", "odd_slowdown")
ALIGNED = "profile.json, bundled GEMM alignment terms"


def full_runs(folder: Path) -> list[dict]:
    """The reports of the folder's full runs that ran, by file name."""
    reports = [json.loads(path.read_text()) for path in sorted(folder.glob("report-*.json"))]
    return [r for r in reports if r["mode"] == "full" and r["status"] == "ok"]


def with_dispatch_exposed(device: DeviceProfile, fraction: float) -> DeviceProfile:
    """The device with every compute stack's dispatch_exposed_fraction at `fraction` (specs/hardware.py
    FrameworkCompute: a layer pass takes max(dispatch, device) + this x min(dispatch, device))."""
    stacks = {k: v.model_copy(update={"dispatch_exposed_fraction": fraction}) for k, v in device.frameworks.items()}
    return device.model_copy(update={"frameworks": stacks})


def run(folder: Path = FOLDER, device: str = "h200", dispatch_exposed: float | None = None) -> dict:
    profile = json.loads((folder / "profile.json").read_text())  # its raw measurements below
    measured_device, server = profile_from_data(profile)
    bundled = load_device(device)
    variants = {
        "profile.json as measured": measured_device,
        "profile.json, attention terms of the bundled profile": measured_device.model_copy(
            update={
                "attention_shape": bundled.attention_shape,
                "attention_peak_fraction": bundled.attention_peak_fraction,
            }
        ),
        f"bundled {device} profile": bundled.model_copy(update={"memory_bytes": measured_device.memory_bytes}),
    }
    current = measured_device  # the profile as the current code would have made it
    timed = "gemm_alignment" in profile.get("measurements", {})
    if not timed and measured_device.gemm_shape is not None and bundled.gemm_shape is not None:
        aligned = {k: getattr(bundled.gemm_shape, k) for k in ALIGNMENT_TERMS}
        current = measured_device.model_copy(
            update={"gemm_shape": measured_device.gemm_shape.model_copy(update=aligned)}
        )
        variants[ALIGNED] = current
    if dispatch_exposed is not None:
        on = ALIGNED if current is not measured_device else "profile.json"
        variants[f"{on}, dispatch_exposed_fraction {dispatch_exposed:g}"] = with_dispatch_exposed(
            current, dispatch_exposed
        )
    runs = full_runs(folder)
    shown = folder.relative_to(ROOT) if folder.is_relative_to(ROOT) else folder
    result: dict = {"folder": str(shown), "device": device, "variants": {}}
    for name, dev in variants.items():
        # the GPU's profile read on this machine: local_gpus() would describe this host's GPUs, if any
        real, clusters.local_gpus = clusters.local_gpus, lambda: []
        try:
            cluster = clusters.local_cluster(1, (dev, server))
        finally:
            clusters.local_gpus = real
        rows = []
        for report in runs:
            plan = report["plan"]
            model, layout = ModelSpec.model_validate(plan["model"]), Layout.model_validate(plan["layout"])
            p = predict_layouts(model, TrainingSpec.model_validate(plan["training"]), cluster, [layout])[0].prediction
            rows.append(
                {
                    "run": f"{model.name} ({layout.short()})",
                    "measured_step_time_s": report["measured"]["step_time_s"],
                    "predicted_step_time_s": p.step_time_s,
                    "error": p.step_time_s / report["measured"]["step_time_s"] - 1.0,
                }
            )
        err = np.array([r["error"] for r in rows])
        result["variants"][name] = {
            "runs": rows,
            "mean_abs_error": float(np.mean(np.abs(err))),
            "bias": float(np.mean(err)),
        }
    return result


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--folder", default=str(FOLDER), help="a results folder of benchmarks.gpu_validation")
    ap.add_argument("--device", default="h200", help="the bundled device profile of that GPU")
    ap.add_argument("--dispatch-exposed", type=float, help="add a variant with this dispatch_exposed_fraction (0-1)")
    args = ap.parse_args(argv)
    folder = Path(args.folder).resolve()
    result = run(folder, args.device, args.dispatch_exposed)
    for name, v in result["variants"].items():
        errors = " ".join(f"{r['error']:+.3f}" for r in v["runs"])
        print(f"{name:72s} {errors}   mean |error| {v['mean_abs_error']:.3f}  bias {v['bias']:+.3f}")
    if args.dispatch_exposed is not None:
        print("not saved: a what-if (--dispatch-exposed)")
        return 0
    out = folder / "repredict-attention.json"
    out.write_text(json.dumps(result, indent=1))
    print(f"saved {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
