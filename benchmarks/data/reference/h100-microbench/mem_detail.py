# ruff: noqa
# fmt: off
# The script as it ran on the H100 (benchmarks/data/reference/PROVENANCE.md), kept unformatted; only its
# imports changed: the berth package names (berth.executor, berth.specs) for the bare folders it once
# put on sys.path, so that it runs wherever berth is installed (pip install -e '.[executor]').
"""Allocator detail of full single-GPU training steps of the bundled executor (executor.train.run_steps):
peak allocated vs peak reserved, retries, inactive split bytes, state after the step. $OUT/mem_detail.json"""
import gc
import json
import os
import subprocess
import sys

import torch

from berth.executor.train import run_steps
from berth.specs.models import load_model
from berth.specs.tree import Layout, TrainingSpec

dev = torch.device("cuda", 0)
torch.cuda.set_device(dev)
torch.cuda.init()
here = os.path.dirname(__file__)
cfgs = [("llama-3.2-1b.json", 4096, 16, 1, 16, "none"), ("llama-3.2-1b.json", 4096, 16, 2, 8, "none"),
        ("llama-3.2-1b.json", 4096, 16, 2, 8, "selective"), ("llama-3.2-1b.json", 4096, 16, 4, 4, "full"),
        ("llama-3.2-3b.json", 4096, 16, 1, 16, "none"),
        ("llama-3.2-3b.json", 4096, 16, 2, 8, "full"), ("qwen2.5-1.5b.json", 2048, 16, 4, 4, "none"),
        ("gpt2-xl.json", 2048, 16, 4, 4, "none"), ("gpt2-xl.json", 2048, 16, 8, 2, "full"),
        ("llama-3.2-1b.json", 4096, 16, 4, 4, "none")]
rows = []
for f, s, gb, mbs, nmb, rc in cfgs:
    gc.collect()
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    spec = load_model(os.path.join(here, f))
    row = {"model": f, "seq": s, "global_batch": gb, "mbs": mbs, "nmb": nmb, "recompute": rc,
           "params": spec.num_params}
    try:
        rec = run_steps(spec, TrainingSpec(seq_len=s, global_batch_size=gb, precision="bf16"),
                        Layout(tp=1, pp=1, dp=1, micro_batch_size=mbs, num_microbatches=nmb, recompute=rc),
                        steps=2, warmup=1, device=dev)
        st = torch.cuda.memory_stats()
        row.update(status="ok", step_s=sorted(rec.step_times_s[1:])[0], peak_reserved=rec.peak_memory_bytes,
                   peak_allocated=torch.cuda.max_memory_allocated(), num_alloc_retries=st["num_alloc_retries"],
                   inactive_split_peak=st["inactive_split_bytes.all.peak"],
                   allocated_after=torch.cuda.memory_allocated(), reserved_after=torch.cuda.memory_reserved())
    except torch.OutOfMemoryError as e:
        row.update(status="oom", error=str(e)[:300], peak_allocated=torch.cuda.max_memory_allocated(),
                   peak_reserved=torch.cuda.max_memory_reserved())
    smi = subprocess.run(["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
                         capture_output=True, text=True).stdout.strip()
    row["nvidia_smi_used_mib"] = smi
    rows.append(row)
    print(json.dumps({k: (round(v / 2**30, 2) if isinstance(v, (int, float)) and v > 2**24 else v)
                      for k, v in row.items() if k != "error"}), flush=True)
    json.dump({"device": torch.cuda.get_device_name(0), "torch": torch.__version__, "rows": rows},
              open(os.path.join(os.environ["OUT"], "mem_detail.json"), "w"), indent=1)
