"""Rank-slice proxy: one rank's share of a plan too big for this machine, run on one device.

    python -m berth.executor.proxy --plan plan.json --stage first --layers 2 --steps 5 --warmup 2 --out r.json

What the rank holds and does, built directly at its size (no collectives):
- the layers of one pipeline stage (first or last; `--layers` shrinks the depth, nothing else),
  with the embedding on the first stage and the final norm and LM head on the last (both when
  pp = 1), at the widths left after the tp split: heads / tp, kv heads / tp, ffn / tp, vocab / tp;
- sequence parallelism emulated by shape: norms and residuals run on seq / tp tokens, the input of
  the attention and the MLP is repeated tp times where the all-gather would assemble it, and their
  outputs are cut back to seq / tp where the reduce-scatter would;
- the planned micro-batch size and recomputation, and the micro-batches in the order the
  schedule runs them on that stage (gpipe: all forwards then all backwards; 1f1b: pp - stage - 1
  forwards of warm-up, then one forward one backward; interleaved_1f1b: as 1f1b with the number of
  micro-batches in flight the cost model gives for it);
- the optimizer over the rank's shard: for zero >= 1 AdamW steps over a 1/shard share of the
  parameters (the partition ZeroRedundancyOptimizer makes: whole tensors, so rank 0's share is at
  least the largest, the embedding; cost_models/memory.py whole_tensor_share predicts it), so the
  state and the step time are those of the shard;
- the last stage's loss is the executor's (fp32 cross-entropy over the rank's vocabulary rows, on
  random targets): the logits' memory is the one the full run holds. A first stage of a pipeline
  backpropagates a scalar of its output instead of the gradient the next stage would send.

It cannot reproduce the tp/sp collectives, pipeline sends, the bubble, data-parallel traffic or
FSDP's parameter and gradient sharding (it holds the full tp-slice of parameters and gradients,
i.e. what zero <= 1 holds); the report says so.
"""

from __future__ import annotations

import argparse
import json
import os
import time
from pathlib import Path

import torch
from torch import nn

from berth.cost_models.memory import vocab_rows
from berth.executor.checks import PROGRESS_PREFIX
from berth.executor.device import rank_device
from berth.executor.model import INIT_STD, Block, loss_fn, norm_layer
from berth.executor.parallel import apply_recompute
from berth.executor.train import PeakMemory
from berth.executor.worker import machine
from berth.specs.tree import Plan


class SequenceParallelBlock(nn.Module):
    """A block whose norms and residual see seq / tp tokens (the sequence-parallel shapes)."""

    def __init__(self, block: Block, tp: int):
        super().__init__()
        self.block, self.tp = block, tp

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        local = x.shape[1]
        b = self.block
        x = x + b.attention(b.attention_norm(x).repeat(1, self.tp, 1))[:, :local]
        return x + b.feed_forward(b.ffn_norm(x).repeat(1, self.tp, 1))[:, :local]


class StageSlice(nn.Module):
    """One rank's slice of one pipeline stage."""

    def __init__(self, plan: Plan, layers: int, first: bool, last: bool):
        super().__init__()
        spec, x = plan.model, plan.layout
        tp, sp = x.tp, x.sequence_parallel and x.tp > 1
        self.sp_tp = tp if sp else 1
        rows = int(vocab_rows(spec, tp))  # the padded vocabulary's rows on one tp rank
        self.embed = nn.Embedding(rows, spec.hidden_size) if first else None
        blocks = [Block(spec, tp) for _ in range(layers)]
        self.layers = nn.ModuleDict(
            {str(i): SequenceParallelBlock(blk, tp) if sp else blk for i, blk in enumerate(blocks)}
        )
        self.norm = norm_layer(spec) if last else None
        self.head = nn.Linear(spec.hidden_size, rows, bias=False) if last else None
        for p in self.parameters():
            if p.dim() > 1:
                nn.init.normal_(p, std=INIT_STD)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.embed is not None:
            x = self.embed(x)
            if self.sp_tp > 1:
                x = x[:, : x.shape[1] // self.sp_tp]  # the embedding's output is reduce-scattered
        for layer in self.layers.values():
            x = layer(x)
        if self.head is not None and self.norm is not None:  # the last stage's, both or neither
            x = self.norm(x)
            if self.sp_tp > 1:
                x = x.repeat(1, self.sp_tp, 1)  # all-gathered before the vocab-parallel head
            x = self.head(x)
        return x


def schedule_order(schedule: str, pp: int, stage: int, nmb: int, in_flight: int) -> list[tuple[str, int]]:
    """("F"|"B", micro-batch) in the order the schedule runs them on `stage`."""
    if schedule == "gpipe":
        return [("F", i) for i in range(nmb)] + [("B", i) for i in range(nmb)]
    warm = min(max(in_flight - 1, 0), nmb)
    order = [("F", i) for i in range(warm)]
    done = 0
    for i in range(warm, nmb):
        order += [("F", i), ("B", done)]
        done += 1
    order += [("B", i) for i in range(done, nmb)]
    return order


def shard_parameters(params: list[nn.Parameter], shard: int) -> list[nn.Parameter]:
    """A 1/shard share of the parameters by size (greedy, largest first, as
    ZeroRedundancyOptimizer partitions them); the share of rank 0."""
    loads = [0] * shard
    mine = []
    for p in sorted(params, key=lambda p: -p.numel()):
        r = loads.index(min(loads))
        loads[r] += p.numel()
        if r == 0:
            mine.append(p)
    return mine


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--plan", required=True)
    ap.add_argument("--stage", choices=("first", "last"), default="first")
    ap.add_argument("--layers", type=int, required=True)
    ap.add_argument("--in-flight", type=int, required=True)
    ap.add_argument("--steps", type=int, default=5)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", required=True)
    args = ap.parse_args()
    torch.set_num_threads(int(os.environ.get("BERTH_THREADS_PER_RANK", "1")))
    plan = Plan.model_validate(json.loads(Path(args.plan).read_text()))
    x, spec, training = plan.layout, plan.model, plan.training
    try:
        device = rank_device(0)
    except RuntimeError as err:
        from berth.executor.worker import _error_record

        Path(f"{args.out}.rank0.error.json").write_text(json.dumps(_error_record(err, torch.device("cpu"))))
        raise
    cuda = device.type == "cuda"
    first, last = args.stage == "first", args.stage == "last" or x.pp == 1
    stage = 0 if first else x.pp - 1
    try:
        memory = PeakMemory(device)
        memory.start()
        torch.manual_seed(args.seed)
        model = StageSlice(plan, args.layers, first, last).to(device)
        apply_recompute(model, x.recompute)
        params = list(model.parameters())
        opt_params = shard_parameters(params, x.shard) if x.zero_stage >= 1 else params
        opt = torch.optim.AdamW(opt_params, lr=1e-4, foreach=False)
        s_in = training.seq_len // (x.tp if x.sequence_parallel and x.tp > 1 and not first else 1)
        g = torch.Generator(device="cpu").manual_seed(args.seed)
        rows = int(vocab_rows(spec, x.tp))  # the padded vocabulary's rows on one tp rank: token ids and targets
        if first:
            inputs = [
                torch.randint(0, rows, (x.micro_batch_size, training.seq_len), generator=g)
                for _ in range(x.num_microbatches)
            ]
        else:
            inputs = [
                torch.randn(x.micro_batch_size, s_in, spec.hidden_size, generator=g) for _ in range(x.num_microbatches)
            ]
        inputs = [t.to(device) for t in inputs]
        # the last stage's loss is the executor's own (fp32 cross-entropy over the rank's vocabulary rows), whose
        # logits the cost model's memory counts; a first stage of a pipeline hands its output on
        targets = [
            torch.randint(0, rows, (x.micro_batch_size, training.seq_len), generator=g).to(device)
            for _ in range(x.num_microbatches if last else 0)
        ]
        order = schedule_order(x.schedule, x.pp, stage, x.num_microbatches, args.in_flight)
        dtype = torch.bfloat16 if training.precision == "bf16" else torch.float16
        autocast = training.precision != "fp32"
        sync = torch.cuda.synchronize if cuda else (lambda: None)
        rec: dict[str, list[float]] = {"forward_s": [], "backward_s": [], "optimizer_s": [], "step_compute_s": []}
        memory.mark()
        for step in range(args.warmup + args.steps):
            outs: dict[int, torch.Tensor] = {}
            fwd = bwd = 0.0
            for op, mb in order:
                sync()
                t0 = time.perf_counter()
                if op == "F":
                    inp = inputs[mb] if first else inputs[mb].detach().requires_grad_(True)
                    with torch.autocast(device.type, dtype=dtype, enabled=autocast):
                        out = model(inp)
                    outs[mb] = out
                else:
                    out = outs.pop(mb)
                    # the first stage of a pipeline: a scalar standing in for the gradient the next stage sends
                    loss = loss_fn(out, targets[mb]) if last else out.float().square().mean()
                    (loss / x.num_microbatches).backward()
                sync()
                dt = time.perf_counter() - t0
                if op == "F":
                    fwd += dt
                else:
                    bwd += dt
            sync()
            t0 = time.perf_counter()
            opt.step()
            for p in params:
                p.grad = None
            sync()
            opt_s = time.perf_counter() - t0
            if step + 1 == 2:
                memory.stop()
            rec["forward_s"].append(fwd)
            rec["backward_s"].append(bwd)
            rec["optimizer_s"].append(opt_s)
            rec["step_compute_s"].append(fwd + bwd + opt_s)
            line = {
                "plan": 0,
                "step": step + 1,
                "of": args.warmup + args.steps,
                "loss": None,
                "step_time_s": fwd + bwd + opt_s,
            }
            print(PROGRESS_PREFIX + json.dumps(line), flush=True)
        memory.stop()
    except BaseException as err:
        from berth.executor.worker import _error_record

        Path(f"{args.out}.rank0.error.json").write_text(json.dumps(_error_record(err, device)))
        raise
    result = {
        **rec,
        "warmup": args.warmup,
        "peak_memory_bytes": memory.peak,
        "memory_method": memory.method,
        "device": device.type,
        "machine": machine(),
        "stage": stage,
        "layers": args.layers,
        "params": sum(p.numel() for p in params),
        "optimizer_params": sum(p.numel() for p in opt_params),
        "order": order,
    }
    Path(args.out).write_text(json.dumps(result))


if __name__ == "__main__":
    main()
