"""Which part of a model the layer model misses: one decoder layer of the bundled executor and its LM head, timed
for a model and its one-change variants, beside the cost model's prediction of each.

The H200 evidence run (benchmarks/results/gpu-h200/README.md) left GPT-2 XL's whole steps 8-18 % slower than
predicted in the compute term, and its attention timed at its own shapes within 0.99-1.04 of the prediction. What
else it has that the layer model's fit (h100-microbench layer.json: SwiGLU and RMSNorm models, hidden sizes that are
multiples of 128) never saw: LayerNorm, a GELU MLP, hidden 1600 (not a multiple of 128) and a vocabulary of 50,257.
Each variant changes one of them, so the measured-over-predicted ratios say which one carries the miss:

- layer (executor/model.py `Block(spec, 1)`, fp32 parameters under bf16 autocast, as h100_bench.py `layer` times
  it): forward and forward + backward at seq 4096 and micro-batches 1, 4 and 16, against compute.layer_compute_s;
- head (a bias-free Linear and fp32 cross-entropy, as h100_bench.py `head` times it): forward + backward against
  compute.lm_head_compute_s, at the vocabulary and at it padded to a multiple of 128.

    python -m benchmarks.layer_variants --measure --out DIR     # on a GPU: DIR/layer-variants.json
    python -m benchmarks.layer_variants --measure-gemms --out DIR   # on a GPU: DIR/head-gemms.json, the head's GEMMs
    python -m benchmarks.layer_variants --measure-gemms --vocabs V1,V2 --hidden H --out DIR  # head-gemms-alignment.json
    python -m benchmarks.layer_variants FILE [--device h200]    # anywhere: predicted beside measured

Timed with `berth profile`'s timer (executor/profile.py `timer`: the median of CUDA events, the host clock on CPU;
the H200 files in benchmarks/results/gpu-h200 took 6 repetitions after 2 warm-ups). The timing runs on CPU too
(tests/test_gpu_paths.py, tiny shapes); nothing is fitted.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from berth.cost_models import compute
from berth.hardware_profiles import load_device, load_profile_file
from berth.specs.models import load_model
from berth.specs.tree import ModelSpec, TrainingSpec

FRAMEWORK = "pytorch"  # the bundled executor's compute stack (benchmarks/layer_fidelity.py)
ROOT = Path(__file__).resolve().parents[1]
BASE = ROOT / "examples" / "models" / "gpt2-xl.json"  # the HF config the H200 run planned from
SEQ = 4096
BATCHES = (1, 4, 16)
HEAD_BATCHES = (4, 16)


def variants(base: ModelSpec) -> dict[str, ModelSpec]:
    """The model and its one-change variants (name -> spec): norm, MLP, hidden size 1536 / 2048 (multiples of 128,
    head dim kept at the model's), and a SwiGLU + RMSNorm model at 2048 as the fit's own kind of layer."""
    d = base.hidden_size // base.num_attention_heads

    def sized(h: int, **kw: Any) -> ModelSpec:
        return base.model_copy(update={"hidden_size": h, "num_attention_heads": h // d, "ffn_hidden_size": 4 * h, **kw})

    return {
        "as is": base,
        "rmsnorm": base.model_copy(update={"norm": "rmsnorm"}),
        "swiglu": base.model_copy(update={"mlp": "swiglu"}),
        "hidden 1536": sized(1536),
        "hidden 2048": sized(2048),
        "hidden 2048, swiglu + rmsnorm": sized(2048, mlp="swiglu", norm="rmsnorm"),
    }


def head_shapes(base: ModelSpec) -> list[tuple[int, int]]:
    """(hidden, vocabulary) of the heads timed: the model's, its vocabulary padded to a multiple of 128, and at
    hidden 2048."""
    padded = -(-base.vocab_size // 128) * 128
    return [(base.hidden_size, base.vocab_size), (base.hidden_size, padded), (2048, base.vocab_size)]


def measure(
    base: ModelSpec, seq: int = SEQ, batches=BATCHES, head_batches=HEAD_BATCHES, device: str = "cuda", reps: int = 6
) -> dict:
    """Time every variant's layer and every head shape on `device` (built as h100_bench.py builds them)."""
    import torch
    import torch.nn.functional as F

    from berth.executor.model import Block
    from berth.executor.profile import timer

    dev = torch.device(device)
    dtype = torch.bfloat16
    timed = timer(dev)
    layers, heads = [], []
    for name, spec in variants(base).items():
        with dev:
            blk = Block(spec, 1)
        for b in batches:
            x = torch.randn(b, seq, spec.hidden_size, device=dev, requires_grad=True)

            def f(blk=blk, x=x):
                with torch.autocast(dev.type, dtype=dtype):
                    return blk(x)

            g = torch.randn_like(f())

            def fb(f=f, g=g):
                f().backward(g)

            layers.append(
                {"variant": name, "spec": spec.model_dump(), "seq": seq, "batch": b,
                 "fwd_s": timed(f, reps), "fwd_bwd_s": timed(fb, reps)}
            )  # fmt: skip
            del x, g
        del blk
    for h, vocab in head_shapes(base):
        lin = torch.nn.Linear(h, vocab, bias=False, device=dev)
        for b in head_batches:
            x = torch.randn(b * seq, h, device=dev, requires_grad=True)
            tgt = torch.randint(0, vocab, (b * seq,), device=dev)

            def hb(lin=lin, x=x, tgt=tgt):
                with torch.autocast(dev.type, dtype=dtype):
                    logits = lin(x)
                F.cross_entropy(logits.float(), tgt).backward()

            heads.append({"hidden": h, "vocab": vocab, "tokens": b * seq, "fwd_bwd_s": timed(hb, max(reps - 1, 1))})
            del x, tgt
        del lin
    return {**machine(dev.type), "base": base.name, "layers": layers, "heads": heads}


def machine(device_type: str = "cuda") -> dict:
    """The device and torch a measurement ran on."""
    import torch

    cuda = device_type == "cuda" and torch.cuda.is_available()
    return {"device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__}


def measure_head_gemms(
    base: ModelSpec, tokens=(16384,), device: str = "cuda", reps: int = 6, shapes: list[tuple[int, int]] | None = None
) -> list[dict]:
    """The LM head's three GEMMs (executor/profile.py head_gemm_passes: forward, dgrad, wgrad) in bf16 at each head
    shape's vocabulary and at it rounded up to a multiple of 8 (16-byte rows of bf16); `shapes`: (hidden,
    vocabulary) pairs timed as given instead."""
    import torch

    from berth.executor.profile import head_gemm_passes, timer

    dev = torch.device(device)
    timed = timer(dev)
    rows = []
    pairs = [(h, v) for h, vocab in head_shapes(base) for v in sorted({vocab, -(-vocab // 8) * 8})]
    for h, v in pairs if shapes is None else shapes:
        for t in tokens:
            for name, fn in head_gemm_passes(dev, t, h, v).items():
                rows.append({"hidden": h, "vocab": v, "tokens": t, "gemm": name, "seconds": timed(fn, reps)})
    return rows


def predicted(data: dict, device: str) -> dict:
    """Each measured row with the cost model's prediction and measured / predicted."""
    profile = load_profile_file(device)[0] if Path(device).is_file() else load_device(device)
    rows = []
    for r in data["layers"]:
        spec = ModelSpec.model_validate(r["spec"])
        training = TrainingSpec(seq_len=r["seq"], global_batch_size=1, framework=FRAMEWORK)
        f, bw, _ = compute.layer_compute_s(spec, training, profile, float(r["batch"]), 1.0, 0.0)
        rows.append(
            {"variant": r["variant"], "batch": r["batch"],
             "fwd": r["fwd_s"] / float(f), "fwd_bwd": r["fwd_bwd_s"] / float(f + bw),
             "fwd_bwd_s": r["fwd_bwd_s"], "predicted_fwd_bwd_s": float(f + bw)}
        )  # fmt: skip
    heads = []
    for r in data["heads"]:
        spec = load_model(str(BASE)).model_copy(update={"hidden_size": r["hidden"], "vocab_size": r["vocab"]})
        training = TrainingSpec(seq_len=r["tokens"], global_batch_size=1, framework=FRAMEWORK)
        p = float(compute.lm_head_compute_s(spec, training, profile, 1.0, 1.0))
        heads.append({**r, "predicted_s": p, "ratio": r["fwd_bwd_s"] / p})
    return {"device_profile": device, "layers": rows, "heads": heads}


def report(result: dict) -> str:
    lines = [f"measured / predicted ({result['device_profile']} profile)", "layer (seq 4096)"]
    lines.append(f"  {'variant':32s} {'mbs':>4s} {'fwd':>6s} {'fwd+bwd':>8s}")
    for r in result["layers"]:
        lines.append(f"  {r['variant']:32s} {r['batch']:4d} {r['fwd']:6.3f} {r['fwd_bwd']:8.3f}")
    lines.append("LM head + loss, forward + backward")
    for r in result["heads"]:
        lines.append(f"  hidden {r['hidden']:5d} vocab {r['vocab']:6d} tokens {r['tokens']:6d} {r['ratio']:6.3f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file", nargs="?", help="a layer-variants.json to score (default: measure with --measure)")
    ap.add_argument("--measure", action="store_true", help="time the variants on this machine's GPU")
    ap.add_argument("--measure-gemms", action="store_true", help="time the LM heads' GEMMs on this machine's GPU")
    ap.add_argument("--vocabs", help="with --measure-gemms: comma-separated vocabularies to time (at --hidden)")
    ap.add_argument("--hidden", type=int, default=1600, help="with --vocabs: the head's hidden size")
    ap.add_argument("--out", default=".", help="with --measure / --measure-gemms: the folder to write into")
    ap.add_argument(
        "--device", default="h200", help="the bundled device profile, or a `berth profile` file, to predict with"
    )
    a = ap.parse_args(argv)
    if a.measure_gemms:
        shapes = [(a.hidden, int(v)) for v in a.vocabs.split(",")] if a.vocabs else None
        rows = measure_head_gemms(load_model(str(BASE)), shapes=shapes)
        path = Path(a.out) / ("head-gemms-alignment.json" if shapes else "head-gemms.json")
        path.write_text(json.dumps({**machine(), "rows": rows}, indent=1) + "\n")
        for r in rows:
            print(f"{r['hidden']:5d} {r['vocab']:6d} {r['tokens']:6d} {r['gemm']:5s} {r['seconds'] * 1e3:8.3f} ms")
        return 0
    if a.measure:
        data = measure(load_model(str(BASE)))
        path = Path(a.out) / "layer-variants.json"
        path.write_text(json.dumps(data, indent=1) + "\n")
        print(f"wrote {path}")
    elif a.file:
        data = json.loads(Path(a.file).read_text())
    else:
        ap.error("give a layer-variants.json, or --measure on a GPU")
    result = predicted(data, a.device)
    print(report(result))
    if a.file:
        out = Path(a.file).with_name("layer-variants-predicted.json")
        out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
