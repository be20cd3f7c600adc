# ruff: noqa
# fmt: off
# The script as it ran on the H100 (benchmarks/data/reference/PROVENANCE.md), kept unformatted; only its
# imports changed: the berth package names (berth.executor, berth.specs) for the bare folders it once
# put on sys.path, so that it runs wherever berth is installed (pip install -e '.[executor]').
"""H100 microbenchmarks for berth's cost model: GEMM shapes, attention, one decoder layer of the
bundled executor (executor/model.py Block) per model and tp slice, LM head + loss, AdamW, bandwidth.
Each section is written to $OUT/<section>.json as soon as it ends."""
import json
import os
import sys
import time

import torch
import torch.nn.functional as F

from berth.executor.model import Block
from berth.specs.models import load_model

OUT = os.environ["OUT"]
dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
BF = torch.bfloat16
SECTIONS = sys.argv[1:] or ["gemm", "attention", "layer", "head", "optimizer", "bandwidth"]


def timed(fn, reps=10, warm=3):
    for _ in range(warm):
        fn()
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    ts = []
    for _ in range(reps):
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        ts.append(a.elapsed_time(b) / 1e3)
    ts.sort()
    return ts[len(ts) // 2]


def save(name, rows, t0):
    with open(f"{OUT}/{name}.json", "w") as f:
        json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__,
                   "seconds": time.time() - t0, "rows": rows}, f)
    print(name, len(rows), "rows", f"{time.time() - t0:.0f}s", flush=True)


def gemm():
    t0, rows, seen = time.time(), [], set()
    for h, ffn, heads, kv in ((2048, 8192, 32, 8), (4096, 14336, 32, 8), (5120, 13824, 40, 40),
                              (8192, 28672, 64, 8), (12288, 49152, 96, 96), (16384, 53248, 128, 8)):
        d = h // heads
        for tp in (1, 2, 4, 8):
            if heads % tp or kv % tp and kv >= tp:
                continue
            qkv = (heads + 2 * max(kv // tp * tp, tp)) * d // tp
            for m in (2048, 4096, 8192, 16384, 32768):
                for name, k, n in (("qkv", h, qkv), ("o", h // tp, h), ("up", h, ffn // tp), ("down", ffn // tp, h)):
                    for kind, (mm, kk, nn) in (("fwd", (m, k, n)), ("dgrad", (m, n, k)), ("wgrad", (k, m, n))):
                        key = (mm, kk, nn)
                        if key in seen:
                            continue
                        seen.add(key)
                        x = torch.randn(mm, kk, device=dev, dtype=BF)
                        w = torch.randn(kk, nn, device=dev, dtype=BF)
                        t = timed(lambda x=x, w=w: x @ w, reps=10)
                        rows.append({"m": mm, "k": kk, "n": nn, "proj": name, "pass": kind, "h": h, "tp": tp,
                                     "seconds": t, "tflops": 2 * mm * kk * nn / t / 1e12})
                        del x, w
        save("gemm", rows, t0)
    return rows


def attention():
    t0, rows = time.time(), []
    for heads, kv, d in ((32, 8, 64), (32, 8, 128), (64, 8, 128), (128, 8, 128), (96, 96, 128), (40, 40, 128)):
        for tp in (1, 2, 4, 8):
            if heads % tp:
                continue
            hq, hk = heads // tp, max(kv // tp, 1)
            for s in (2048, 4096, 8192):
                for b in (1, 2):
                    if b * hq * s * d * 2 * 8 > 8e9:
                        continue
                    for mode in ("repeat", "gqa"):
                        q = torch.randn(b, hq, s, d, device=dev, dtype=BF, requires_grad=True)
                        k = torch.randn(b, hk, s, d, device=dev, dtype=BF, requires_grad=True)
                        v = torch.randn(b, hk, s, d, device=dev, dtype=BF, requires_grad=True)

                        def fwd(q=q, k=k, v=v, mode=mode):
                            if mode == "repeat" and hq != hk:
                                g = hq // hk
                                return F.scaled_dot_product_attention(q, k.repeat_interleave(g, 1),
                                                                      v.repeat_interleave(g, 1), is_causal=True)
                            return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=hq != hk)

                        tf = timed(fwd, reps=8)
                        out = fwd()
                        go = torch.randn_like(out)
                        tb = timed(lambda out=out, go=go: torch.autograd.grad(out, (q, k, v), go, retain_graph=True),
                                   reps=8)
                        flops = 4 * b * hq * s * s * d * 0.5
                        rows.append({"heads": hq, "kv_heads": hk, "head_dim": d, "seq": s, "batch": b, "mode": mode,
                                     "tp": tp, "fwd_s": tf, "bwd_s": tb, "fwd_tflops": flops / tf / 1e12,
                                     "bwd_tflops": 2.5 * flops / tb / 1e12})
                        del q, k, v, out, go
                        if mode == "repeat" and hq == hk:
                            break
    save("attention", rows, t0)


def layer():
    t0, rows = time.time(), []
    names = ["llama-3.2-1b", "llama3-8b", "mistral-7b", "llama2-13b", "llama3-70b", "qwen2.5-72b", "gpt3-175b",
             "llama3.1-405b"]
    here = os.path.dirname(__file__)
    for name in names:
        spec = load_model(os.path.join(here, "llama-3.2-1b.json") if name == "llama-3.2-1b" else name)
        for tp in (1, 2, 4, 8):
            if spec.num_attention_heads % tp or spec.kv_heads % tp and spec.kv_heads > tp:
                continue
            if spec.hidden_size >= 12288 and tp < 4:
                continue
            torch.cuda.empty_cache()
            with torch.device(dev):
                blk = Block(spec, tp)
            for s in (2048, 4096, 8192):
                for b in (1, 2):
                    if spec.hidden_size >= 8192 and s * b > 8192 and tp < 4:
                        continue
                    row = {"model": name, "hidden": spec.hidden_size, "ffn": spec.ffn_hidden_size,
                           "heads": spec.num_attention_heads, "kv_heads": spec.kv_heads, "tp": tp, "seq": s,
                           "batch": b}
                    try:
                        torch.cuda.empty_cache()
                        blk.zero_grad(set_to_none=True)
                        x = torch.randn(b, s, spec.hidden_size, device=dev, requires_grad=True)
                        torch.cuda.synchronize()
                        base = torch.cuda.memory_allocated()

                        def f(blk=blk, x=x):
                            with torch.autocast("cuda", dtype=BF):
                                return blk(x)

                        y = f()
                        torch.cuda.synchronize()
                        row["retained_bytes"] = torch.cuda.memory_allocated() - base - y.numel() * y.element_size()
                        g = torch.randn_like(y)
                        del y
                        row["fwd_s"] = timed(f, reps=6)

                        def fb(blk=blk, x=x, g=g):
                            y = f()
                            y.backward(g)

                        torch.cuda.reset_peak_memory_stats()
                        row["fwd_bwd_s"] = timed(fb, reps=6)
                        row["peak_bytes_over_params"] = torch.cuda.max_memory_allocated() - base
                        row["param_count"] = sum(p.numel() for p in blk.parameters())
                        flops = 2 * row["param_count"] * b * s + 4 * b * s * s * spec.hidden_size // tp * 0.5
                        row["fwd_tflops"] = flops / row["fwd_s"] / 1e12
                        row["fwd_bwd_tflops"] = 3 * flops / row["fwd_bwd_s"] / 1e12
                        del x, g
                    except torch.OutOfMemoryError as e:
                        row["error"] = "oom: " + str(e)[:100]
                    rows.append(row)
            del blk
            save("layer", rows, t0)
    save("layer", rows, t0)


def head():
    t0, rows = time.time(), []
    for h, V in ((2048, 128256), (4096, 32000), (4096, 128256), (5120, 152064), (8192, 128256), (12288, 51200)):
        for tp in (1, 8):
            for tokens in (4096, 8192, 16384):
                row = {"hidden": h, "vocab": V, "tp": tp, "tokens": tokens}
                try:
                    torch.cuda.empty_cache()
                    lin = torch.nn.Linear(h, V // tp, bias=False, device=dev)
                    x = torch.randn(tokens, h, device=dev, requires_grad=True)
                    tgt = torch.randint(0, V // tp, (tokens,), device=dev)
                    torch.cuda.synchronize()
                    base = torch.cuda.memory_allocated()
                    torch.cuda.reset_peak_memory_stats()

                    def fb(lin=lin, x=x, tgt=tgt):
                        with torch.autocast("cuda", dtype=BF):
                            logits = lin(x)
                        loss = F.cross_entropy(logits.float(), tgt)
                        loss.backward()

                    row["fwd_bwd_s"] = timed(fb, reps=5)
                    row["peak_bytes_over_params"] = torch.cuda.max_memory_allocated() - base
                    row["logits_bf16_bytes"] = tokens * (V // tp) * 2
                    del lin, x, tgt
                except torch.OutOfMemoryError as e:
                    row["error"] = "oom: " + str(e)[:100]
                rows.append(row)
    save("head", rows, t0)


def optimizer():
    t0, rows = time.time(), []
    for n in (10**8, 5 * 10**8, 10**9):
        for mode in ("foreach_false", "foreach", "fused"):
            torch.cuda.empty_cache()
            ps = [torch.nn.Parameter(torch.randn(n // 100, device=dev)) for _ in range(100)]
            for p in ps:
                p.grad = torch.randn_like(p)
            kw = {"foreach": False} if mode == "foreach_false" else {"foreach": True} if mode == "foreach" else {
                "fused": True}
            opt = torch.optim.AdamW(ps, lr=1e-4, **kw)
            t = timed(opt.step, reps=5, warm=2)
            rows.append({"params": n, "mode": mode, "seconds": t, "ns_per_param": t / n * 1e9})
            del ps, opt
    save("optimizer", rows, t0)


def bandwidth():
    t0, rows = time.time(), []
    for n in (1 << 24, 1 << 26, 1 << 28):
        x = torch.randn(n, device=dev)
        y = torch.empty_like(x)
        t = timed(lambda x=x, y=y: torch.mul(x, 2.0, out=y), reps=10)
        rows.append({"op": "mul fp32", "elements": n, "seconds": t, "GBps": 2 * 4 * n / t / 1e9})
        xb = x.to(BF)
        t = timed(lambda xb=xb: xb.clone(), reps=10)
        rows.append({"op": "clone bf16", "elements": n, "seconds": t, "GBps": 2 * 2 * n / t / 1e9})
        del x, y, xb
    t = timed(lambda: torch.mul(torch.ones(8, device=dev), 2.0), reps=200)
    rows.append({"op": "tiny op launch (ones+mul)", "seconds": t})
    save("bandwidth", rows, t0)


for sec in SECTIONS:
    try:
        globals()[sec]()
    except Exception as e:  # noqa: BLE001
        print(sec, "failed", repr(e)[:300], flush=True)
