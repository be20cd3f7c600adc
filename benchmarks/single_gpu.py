"""Single-GPU step times: berth's prediction against whole training steps measured on one H100.

Data: benchmarks/data/reference/h100-microbench/full-step-runs.json: `berth validate --cluster local` on
one H100 80GB HBM3 (the bundled executor: eager PyTorch, fp32 parameters under bf16 autocast,
AdamW foreach=False) for single-GPU plans of llama-3.2-1b and -3b, seq 4096, global batch 16;
median step time after warm-up. Runs with status "oom" have no time and are skipped (listed).

Each run is predicted as `--cluster local` predicts on that machine: the h100-sxm profile with
the GPU's 81559 MiB, one GPU, engine "executor", bf16, the run's layout. Nothing here is
fitted: the profile's figures come from the microbenchmarks (benchmarks/layer_fidelity.py).

Run: `python -m benchmarks.single_gpu` (prints per run, saves benchmarks/results/single_gpu.json);
`--dispatch-exposed F` predicts with every compute stack's dispatch_exposed_fraction at F and saves nothing.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

import numpy as np

import benchmarks
from berth.hardware_profiles import load_device, load_server, server_names
from berth.planner.search import predict_layouts
from berth.specs.layouts import complete_layout, parse_spec
from berth.specs.tree import ClusterSpec, ModelSpec, TrainingSpec

REFERENCE = benchmarks.REFERENCE / "h100-microbench"
OUT = Path(__file__).parent / "results" / "single_gpu.json"
DEVICE = "h100-sxm"
GPU_MEMORY_MIB = 81559  # the run's nvidia-smi total (full-step-runs.json "device")
TARGET_MAPE = 0.10  # issue 12


def load_runs(reference: Path = REFERENCE) -> list[dict]:
    path = reference / "full-step-runs.json"
    if not path.is_file():
        raise FileNotFoundError(f"reference data not found: {path}")
    return json.loads(path.read_text())["runs"]


def local_h100() -> ClusterSpec:
    """One H100 as `--cluster local` sees it (topology/clusters.py local_cluster, GPU branch)."""
    device = load_device(DEVICE).model_copy(update={"memory_bytes": GPU_MEMORY_MIB * 2**20})
    server = next(load_server(s) for s in server_names() if load_server(s).device == DEVICE)
    return ClusterSpec(
        name="local",
        nodes=1,
        gpus_per_node=1,
        device=device,
        intra_node=server.intra_node,
        inter_node=server.inter_node,
        collective_base_latency_s=server.collective_base_latency_s,
        comm_overlap_efficiency=server.comm_overlap_efficiency,
    )


def predict_run(run: dict, cluster: ClusterSpec) -> dict:
    spec = run["model"]
    model = ModelSpec(**{k: v for k, v in spec.items() if k in ModelSpec.model_fields})
    training = TrainingSpec(
        seq_len=run["seq_len"], global_batch_size=run["global_batch"], precision="bf16", engine="executor"
    )
    layout = complete_layout(parse_spec(run["layout"]), training, 1)
    plan = predict_layouts(model, training, cluster, [layout])[0]
    p = plan.prediction
    return {
        "model": model.name,
        "layout": run["layout"],
        "status": run["status"],
        "measured_step_time_s": run.get("measured_step_time_s"),
        "predicted_step_time_s": p.step_time_s,
        "predicted_then_s": run["predicted_then"]["step_time_s"],
        "predicted_mfu": p.mfu,
        "breakdown_s": {k: float(v) for k, v in (p.time_breakdown_s or {}).items()},
    }


def run(reference: Path = REFERENCE, dispatch_exposed: float | None = None) -> dict:
    """The runs predicted and scored; `dispatch_exposed`: a what-if with every compute stack's
    dispatch_exposed_fraction at that value (benchmarks/gpu_repredict.py with_dispatch_exposed)."""
    cluster = local_h100()
    if dispatch_exposed is not None:
        from benchmarks.gpu_repredict import with_dispatch_exposed

        cluster = cluster.model_copy(update={"device": with_dispatch_exposed(cluster.device, dispatch_exposed)})
    rows = [predict_run(r, cluster) for r in load_runs(reference)]
    scored = [r for r in rows if r["status"] == "ok" and r["measured_step_time_s"]]
    for r in scored:
        r["error"] = r["predicted_step_time_s"] / r["measured_step_time_s"] - 1.0
    err = np.array([r["error"] for r in scored])
    then = np.array([r["predicted_then_s"] / r["measured_step_time_s"] - 1.0 for r in scored])
    return {
        "device": DEVICE,
        "runs": rows,
        "n": len(scored),
        "mape": float(np.mean(np.abs(err))),
        "worst": float(np.max(np.abs(err))),
        "bias": float(np.mean(err)),
        "mape_before": float(np.mean(np.abs(then))),
        "target_mape": TARGET_MAPE,
        "skipped": [f"{r['model']} {r['layout']} ({r['status']})" for r in rows if r not in scored],
    }


def main(argv: list[str]) -> int:
    exposed = float(argv[argv.index("--dispatch-exposed") + 1]) if "--dispatch-exposed" in argv else None
    result = run(dispatch_exposed=exposed)
    print(f"single-GPU steps on one H100 ({result['device']} profile, --cluster local, engine executor)")
    for r in result["runs"]:
        if "error" in r:
            print(
                f"  {r['model']:<13} {r['layout']:<52} measured {r['measured_step_time_s']:6.3f} s  predicted "
                f"{r['predicted_step_time_s']:6.3f} s  ({r['error']:+.3f})  before {r['predicted_then_s']:6.3f} s"
            )
    for s in result["skipped"]:
        print(f"  skipped: {s}")
    print(
        f"step-time MAPE {result['mape']:.3f} (worst {result['worst']:.3f}, bias {result['bias']:+.3f}); "
        f"before this model {result['mape_before']:.3f}; target <= {TARGET_MAPE}"
    )
    if exposed is not None:
        print(f"not saved: a what-if (--dispatch-exposed {exposed:g})")
        return 0
    OUT.parent.mkdir(parents=True, exist_ok=True)
    OUT.write_text(json.dumps(result, indent=2, default=float))
    print(f"saved {OUT}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
