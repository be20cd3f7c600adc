"""Memory formulas against Korthikanti 2022 Sec. 4 and Rajbhandari 2020 (ZeRO)."""

import numpy as np
import pytest

from berth.cost_models import memory, pipeline
from berth.specs.candidates import (
    RECOMPUTE_FULL,
    RECOMPUTE_NONE,
    RECOMPUTE_SELECTIVE,
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
)
from berth.specs.tree import TrainingSpec
from tests.conftest import gpt

S, B, H, A = 2048, 4, 6144, 64


def _layer(recompute, tp=1, sp=0, framework="megatron"):
    """A layer with a 16-bit residual stream: Megatron-LM, or PyTorch under FSDP2 mixed precision."""
    m = gpt(layers=48, hidden=H, heads=A)
    t = TrainingSpec(seq_len=S, global_batch_size=B, precision="fp16", flash_attention=False, framework=framework)
    recipe = memory.RECIPE_MEGATRON if framework == "megatron" else memory.RECIPE_FSDP2
    per_layer, _ = memory.layer_activation_bytes(m, t, B, np.array(tp), np.array(sp), np.array(recompute), recipe)
    return float(per_layer)


def test_no_parallelism_is_sbh_34_plus_5as_over_h():
    assert _layer(RECOMPUTE_NONE) == pytest.approx(S * B * H * (34 + 5 * A * S / H))


def test_tensor_parallel_without_sp():
    t = 8
    expected = S * B * H * (10 + 24 / t + 5 * A * S / (H * t))
    assert _layer(RECOMPUTE_NONE, tp=t) == pytest.approx(expected)


def test_tensor_and_sequence_parallel():
    t = 8
    assert _layer(RECOMPUTE_NONE, tp=t, sp=1) == pytest.approx(S * B * H / t * (34 + 5 * A * S / H))


def test_dtensor_sequence_parallel_keeps_the_gathered_linear_inputs():
    """PyTorch (DTensor) sp stores the all-gathered QKV and MLP inputs (2 bytes x 2 sbh in fp16)
    that Megatron-LM keeps sharded; without sp the two frameworks agree."""
    t = 8
    extra = 2 * 2 * S * B * H * (1 - 1 / t)
    assert _layer(RECOMPUTE_NONE, tp=t, sp=1, framework="pytorch") == pytest.approx(
        _layer(RECOMPUTE_NONE, tp=t, sp=1) + extra
    )
    assert _layer(RECOMPUTE_NONE, tp=t, framework="pytorch") == pytest.approx(_layer(RECOMPUTE_NONE, tp=t))


def test_selective_recompute_drops_score_terms():
    t = 8
    assert _layer(RECOMPUTE_SELECTIVE, tp=t, sp=1) == pytest.approx(S * B * H * 34 / t)


def test_full_recompute_keeps_the_layer_input():
    assert _layer(RECOMPUTE_FULL) == pytest.approx(2 * S * B * H)
    assert _layer(RECOMPUTE_FULL, tp=8, sp=1) == pytest.approx(2 * S * B * H / 8)


def test_flash_attention_removes_the_s_squared_term():
    m = gpt(layers=48, hidden=H, heads=A)
    t = TrainingSpec(seq_len=S, global_batch_size=B, precision="fp16", flash_attention=True, framework="megatron")
    per_layer, _ = memory.layer_activation_bytes(m, t, B, np.array(1), np.array(0), np.array(RECOMPUTE_NONE))
    assert float(per_layer) == pytest.approx(S * B * H * 34 + 4 * B * A * S)


def test_layers_in_flight_by_schedule():
    L, p, m, v = 96, 8, 64, 3
    args = (np.array(p), np.array(1), np.array(m))
    assert pipeline.layers_in_flight(L, *args, np.array(SCHEDULE_GPIPE), 0) == m * L / p
    assert pipeline.layers_in_flight(L, *args, np.array(SCHEDULE_1F1B), 0) == L  # p micro-batches
    assert pipeline.layers_in_flight(L, *args, np.array(SCHEDULE_1F1B), p - 1) == L / p
    inter = pipeline.layers_in_flight(L, np.array(p), np.array(v), np.array(m), np.array(SCHEDULE_INTERLEAVED), 0)
    assert inter == pytest.approx(L * (1 + (p - 1) / (p * v)))  # Korthikanti Sec. 4.2.3


def _states(precision, framework, zero=0, shard=1, dp=None, tp=1):
    from berth.specs.candidates import Candidates
    from berth.specs.tree import Layout

    t = TrainingSpec(seq_len=1, global_batch_size=8, precision=precision, framework=framework)
    dp = dp or shard
    c = Candidates.from_layouts(
        [Layout(tp=tp, dp=dp, shard=shard, zero_stage=zero, micro_batch_size=1, num_microbatches=8 // dp)]
    )
    return {k: float(v[0]) for k, v in memory.model_state_bytes(t, 1.0, c).items()}


@pytest.mark.parametrize("zero,expected", [(0, 2 + 4 + 12), (1, 2 + 4 + 12 / 8)])
def test_megatron_holds_16_bit_parameters_an_fp32_grad_buffer_and_12_bytes_of_optimizer_state(zero, expected):
    """Megatron-LM bf16: 16-bit parameters, the persistent fp32 gradient buffer (never sharded by
    the distributed optimizer), fp32 main parameters + Adam (K = 12, sharded for zero 1)."""
    s = _states("bf16", "megatron", zero=zero, shard=8 if zero else 1, dp=8)
    assert s["parameters"] + s["grad_buffer"] + s["optimizer_state"] == pytest.approx(expected)
    assert s["gradients"] == 0.0 and s["autocast"] == 0.0
    fp16 = _states("fp16", "megatron")
    assert fp16["grad_buffer"] == 2.0 and fp16["step_extra"] == 4.0  # fp16 buffer; fp32 main grads at the step


def test_executor_autocast_recipe_holds_fp32_state_and_a_bf16_cast_cache():
    """The bundled executor on one GPU (and DDP): fp32 parameters and gradients, AdamW's two fp32
    states, and autocast's bf16 copy of every weight: 18 bytes per parameter."""
    s = _states("bf16", "pytorch")
    assert (s["parameters"], s["gradients"], s["optimizer_state"], s["autocast"]) == (4.0, 4.0, 8.0, 2.0)
    assert memory.precision_recipe(TrainingSpec(seq_len=1, global_batch_size=1), _cands()) == memory.RECIPE_AUTOCAST


def _cands(**layout):
    from berth.specs.candidates import Candidates
    from berth.specs.tree import Layout

    return Candidates.from_layouts([Layout(**layout)])


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp2_mixed_precision_shards_the_fp32_master_gradients_and_state(zero):
    """torchtitan / the executor with FSDP2 MixedPrecisionPolicy(bf16, reduce fp32): 16 bytes per
    parameter over the shard group; ZeRO-2 keeps the gathered bf16 stage from forward to backward."""
    s = _states("bf16", "pytorch", zero=zero, shard=8)
    assert s["parameters"] + s["gradients"] + s["optimizer_state"] == pytest.approx(16 / 8)
    assert s["gathered"] == (2.0 if zero == 2 else 0.0) and s["autocast"] == 0.0
    # dp with tp runs under FSDP2 too (the executor's rule), even at zero 0
    assert (
        memory.precision_recipe(TrainingSpec(seq_len=1, global_batch_size=1), _cands(tp=2, dp=2)) == memory.RECIPE_FSDP2
    )


def test_fp32_training_keeps_two_optimizer_states():
    s = _states("fp32", "pytorch")
    assert (s["parameters"], s["gradients"], s["optimizer_state"], s["autocast"]) == (4.0, 4.0, 8.0, 0.0)


def _peak_grads(**layout):
    """Gradient bytes held at the peak phase, and the phase's logits, for a 4-layer model in fp32."""
    from berth.specs.candidates import Candidates
    from berth.specs.tree import Layout
    from berth.topology.clusters import cluster_from_preset

    m = gpt(layers=4, hidden=256, heads=4)
    t = TrainingSpec(seq_len=256, global_batch_size=8, precision="fp32")
    c = Candidates.from_layouts([Layout(**layout)])
    device = cluster_from_preset("dgx-a100-80g", 1).device
    last = layout.get("pp", 1) - 1
    br = memory.stage_memory_breakdown(m, t, device, c, first=last == 0)
    params = float(memory.stage_params(m, c.pp, c.tp, last == 0)[0]) * 4
    return float(br["gradients"][0]) / params, float(br["logits"][0])


def test_gradients_at_the_peak_follow_accumulation_and_buckets():
    """Measured on the executor (module docstring of cost_models/memory.py): set_to_none frees
    gradients each step, so the loss-backward peak of a single micro-batch holds none; gradient
    accumulation holds them unsharded (sharded for ZeRO-3); DDP buckets hold a copy throughout."""
    none, logits = _peak_grads(micro_batch_size=8)
    assert none == 0.0 and logits > 0  # the peak is the loss backward, before any gradient exists
    assert _peak_grads(micro_batch_size=2, num_microbatches=4)[0] == 1.0
    assert _peak_grads(dp=2, micro_batch_size=4)[0] == 1.0  # DDP bucket
    assert _peak_grads(dp=2, micro_batch_size=2, num_microbatches=2)[0] == 2.0  # bucket + no_sync copy
    assert _peak_grads(dp=2, zero_stage=3, shard=2, micro_batch_size=2, num_microbatches=2)[0] == 0.5
    assert _peak_grads(dp=2, zero_stage=2, shard=2, micro_batch_size=2, num_microbatches=2)[0] == 1.0
    # GPipe runs every forward before the first backward: nothing accumulated at its peak
    assert _peak_grads(pp=2, micro_batch_size=1, num_microbatches=8, schedule="gpipe")[0] == 0.0
    assert _peak_grads(pp=2, micro_batch_size=1, num_microbatches=8, schedule="1f1b")[0] == 1.0


def test_pipeline_buffers_of_torch_pipelining():
    """GPipe's last stage holds every micro-batch's logits and saved log-softmax until its loss
    backward; torch.distributed.pipelining (framework "pytorch") preallocates a receive buffer per
    micro-batch for activations and gradients of each local stage, which Megatron-LM does not."""
    from berth.specs.candidates import Candidates
    from berth.specs.tree import Layout
    from berth.topology.clusters import cluster_from_preset

    m = gpt(layers=4, hidden=256, heads=4)
    device = cluster_from_preset("dgx-a100-80g", 1).device

    def last_stage(framework, **layout):
        t = TrainingSpec(seq_len=256, global_batch_size=8, precision="fp32", framework=framework)
        c = Candidates.from_layouts([Layout(pp=2, micro_batch_size=1, num_microbatches=8, **layout)])
        return {k: float(v[0]) for k, v in memory.stage_memory_breakdown(m, t, device, c, first=False).items()}

    logit = 256 * m.vocab_size  # one micro-batch's logits
    gpipe, one_f = last_stage("megatron", schedule="gpipe"), last_stage("megatron", schedule="1f1b")
    assert gpipe["logits"] == pytest.approx(((4 + 4) * 8 + 8) * logit)
    assert one_f["logits"] == pytest.approx((4 + 4 + 8) * logit)
    boundary = 4 * 256 * 256
    for v, schedule in ((1, "1f1b"), (2, "interleaved_1f1b")):
        pt = last_stage("pytorch", schedule=schedule, virtual_stages=v)
        mg = last_stage("megatron", schedule=schedule, virtual_stages=v)
        assert pt["pipeline_buffers"] == pytest.approx((2 * v - 1) * 8 * boundary)
        assert mg["pipeline_buffers"] == 0.0 and pt["activations"] == pytest.approx(mg["activations"])


def test_fsdp2_zero2_in_fp32_holds_a_sharded_copy_beside_the_gathered_parameters():
    """FSDP2 ZeRO-2 (framework pytorch) keeps the gathered model from forward to backward next to
    its fp32 shards; in mixed precision the shards are the master copy the optimizer state counts."""
    from berth.specs.candidates import Candidates
    from berth.specs.tree import Layout
    from berth.topology.clusters import cluster_from_preset

    m = gpt(layers=4, hidden=256, heads=4)
    device = cluster_from_preset("dgx-a100-80g", 1).device
    c = Candidates.from_layouts([Layout(dp=4, zero_stage=2, shard=4, micro_batch_size=2, num_microbatches=1)])

    def params(precision, framework):
        t = TrainingSpec(seq_len=256, global_batch_size=8, precision=precision, framework=framework)
        return float(memory.stage_memory_breakdown(m, t, device, c, first=True)["parameters"][0])

    full = m.num_params * 4
    assert params("fp32", "pytorch") == pytest.approx(full * (1 + 1 / 4), rel=1e-6)
    assert params("fp32", "megatron") == pytest.approx(full, rel=1e-6)
    # bf16: the gathered bf16 stage (2 bytes) beside the fp32 master shard (4 / 4)
    assert params("bf16", "pytorch") == pytest.approx(full * (2 + 4 / 4) / 4, rel=1e-6)


# ---- measured on one H100 (benchmarks/data/reference/h100-microbench) ----------------------------


def _bench(name):
    import json

    from tests.conftest import REFERENCE, require_reference

    return json.loads(require_reference(REFERENCE / "h100-microbench" / name).read_text())["rows"]


def test_executor_layer_bytes_match_layer_json():
    """The executor's decoder layer under autocast (fp32 parameters): what the forward keeps for
    backward, output excluded, measured at tp 1-8 and seq 2k-8k for eight models. The measurement
    includes the layer's bf16 weight copies (autocast's cache) and excludes its input; rows whose
    figures are odd (peak over parameters negative: measured right after a resize) are left out."""
    from berth.specs.models import load_model

    errors = []
    for r in _bench("layer.json"):
        if r.get("retained_bytes") is None or r.get("peak_bytes_over_params", 0) <= 0:
            continue
        m = (
            load_model(r["model"])
            if r["model"] != "llama-3.2-1b"
            else gpt(layers=16, hidden=2048, heads=32, vocab=128256).model_copy(
                update={"num_kv_heads": 8, "ffn_hidden_size": 8192, "mlp": "swiglu", "norm": "rmsnorm"}
            )
        )
        m = m.model_copy(update={"dropout": False})  # the executor's layer has no dropout
        t = TrainingSpec(seq_len=r["seq"], global_batch_size=r["batch"], precision="bf16")
        tp = np.array(r["tp"])
        per_layer, _ = memory.layer_activation_bytes(
            m, t, r["batch"], tp, np.array(0), np.array(RECOMPUTE_NONE), memory.RECIPE_AUTOCAST
        )
        layer_input = memory.AUTOCAST_RESIDUAL_BYTES * r["batch"] * r["seq"] * m.hidden_size
        predicted = float(per_layer) - layer_input + 2 * r["param_count"]
        errors.append(predicted / r["retained_bytes"] - 1)
    assert len(errors) >= 100
    assert max(abs(e) for e in errors) < 0.03, max(errors, key=abs)
    assert np.mean(np.abs(errors)) < 0.01


def test_fp32_loss_holds_12_bytes_per_logit_as_head_json():
    """LM head under bf16 autocast + fp32 cross-entropy (head.json): beside the head's weight
    gradient (fp32) and bf16 copy, the peak is 12-13.3 bytes per logit where the logits dominate
    (16k tokens, bf16 logits at least twice those weight bytes); the model's 12 (`logits_bytes`, one
    micro-batch in flight: saved fp32 log-softmax, its incoming and outgoing gradients) is within
    12 %. Other rows are shaped by the weight-gradient moment or a warm cache (peak 0)."""
    t = TrainingSpec(seq_len=1, global_batch_size=1, precision="bf16")
    m = gpt(layers=1, hidden=64, heads=1, vocab=1)
    per_logit = float(memory.logits_bytes(m, t, 1, np.array(1)))
    assert per_logit == 12.0
    rows = []
    for r in _bench("head.json"):
        weights = r["hidden"] * r["vocab"] / r["tp"] * (4 + 2)  # fp32 weight gradient + bf16 weight copy
        logits = r["tokens"] * r["vocab"] / r["tp"]
        if r["peak_bytes_over_params"] > 0 and r["tokens"] >= 16384 and 2 * logits >= 2 * weights:
            rows.append((r["peak_bytes_over_params"] - weights) / logits)
    assert len(rows) >= 2
    for measured in rows:
        assert per_logit == pytest.approx(measured, rel=0.12)


def test_selective_recompute_with_flash_attention_means_what_each_engine_recomputes():
    """Under flash attention no s^2 scores exist to drop. The executor's selective (the attention
    core checkpointed, executor/parallel.py) keeps the core's inputs instead of the expanded K/V and
    the output: 6h - 4hg bytes per token and layer less (mem_detail.json: 1B, mbs 2, 1.36 GB less
    allocated over 16 layers x 8192 tokens = 5.07h; here 5h); torchtitan's op-level SAC (FSDP2)
    keeps only the attention output and every second matmul's; Megatron's core-attention
    recompute saves nothing with flash (only the log-sum-exp)."""
    from berth.specs.models import load_model

    m = load_model("llama3-8b")
    h, g = m.hidden_size, m.kv_ratio
    t = TrainingSpec(seq_len=4096, global_batch_size=2, precision="bf16")

    def layer(recompute, recipe, training=t):
        return float(
            memory.layer_activation_bytes(m, training, 2, np.array(1), np.array(0), np.array(recompute), recipe)[0]
        )

    tokens = 2 * 4096
    saved = layer(RECOMPUTE_NONE, memory.RECIPE_AUTOCAST) - layer(RECOMPUTE_SELECTIVE, memory.RECIPE_AUTOCAST)
    assert saved == pytest.approx(tokens * (6 * h - 4 * h * g + 4 * m.num_attention_heads))
    sac = layer(RECOMPUTE_SELECTIVE, memory.RECIPE_FSDP2)
    assert sac < 0.5 * layer(RECOMPUTE_NONE, memory.RECIPE_FSDP2)
    assert sac > layer(RECOMPUTE_FULL, memory.RECIPE_FSDP2)
    mg = t.model_copy(update={"framework": "megatron"})
    lse = 4 * m.num_attention_heads * tokens
    assert layer(RECOMPUTE_SELECTIVE, memory.RECIPE_MEGATRON, mg) == pytest.approx(
        layer(RECOMPUTE_NONE, memory.RECIPE_MEGATRON, mg), abs=lse
    )


def test_capacity_is_what_the_allocator_can_reserve():
    """An H100 80GB: nvidia-smi's 81559 MiB less the 480 MiB torch never sees (79.18 GiB total
    capacity) less the 767 MiB CUDA context outside the allocator; NCCL's buffers once there are peers."""
    from berth.hardware_profiles import load_device

    d = load_device("h100-sxm")
    one = memory.allocator_capacity_bytes(d, 1)
    assert one == 81559 * 2**20 - 480 * 2**20 - 767 * 2**20
    assert memory.allocator_capacity_bytes(d, 8) == one - d.communicator_bytes
    cpu = load_device("cpu-host")
    assert memory.allocator_capacity_bytes(cpu, 2) == cpu.memory_bytes


def test_a_tight_plan_is_never_ranked_and_says_why():
    """Plans whose peak is above capacity x (1 - headroom) get reason memory_tight: still `fits`
    (below the capacity) but not ranked; the search's plans all leave the headroom free."""
    from berth.planner.planning import compare, make_search, plan
    from berth.topology.clusters import cluster_from_preset

    m = gpt(layers=8, hidden=2048, heads=16, vocab=50257)
    cluster = cluster_from_preset("dgx-h100", 1)
    t = TrainingSpec(seq_len=4096, global_batch_size=64, precision="bf16")
    layouts = [f"dp=8,zero=3,shard=8,mbs={b},nmb={8 // b}" for b in (1, 2, 4, 8)]
    plans = compare(m, t, cluster, layouts, memory_headroom=0.0)
    capacity = plans[0].prediction.memory_capacity_bytes
    peaks = [p.prediction.peak_memory_bytes / capacity for p in plans]
    fitting = [x for x in peaks if x <= 1.0]
    assert fitting, peaks
    headroom = 1.0 - max(fitting) + 0.01  # just enough to make the largest fitting layout tight
    tight = compare(m, t, cluster, layouts, memory_headroom=headroom)
    i = peaks.index(max(fitting))
    assert tight[i].infeasible_reason.startswith("memory_tight") and tight[i].prediction.fits
    assert plans[i].infeasible_reason is None
    result = plan(m, t, cluster, make_search(top=50, memory_headroom=headroom))
    assert result.rejected.get("memory_tight", 0) >= 1
    assert all(p.prediction.peak_memory_bytes <= capacity * (1 - headroom) for p in result.plans)


def test_the_default_headroom_is_the_engines():
    """Without a headroom asked for, a layout is tight by its engine's (EngineInfo.memory_headroom): 5 % for the
    executor, 10 % for nanotron, whose recipe misses its measured peaks by more; one asked for overrides both."""
    from berth.planner.planning import compare
    from berth.specs.engines import ENGINES
    from berth.topology.clusters import cluster_from_preset

    assert ENGINES["executor"].memory_headroom == 0.05 and ENGINES["nanotron"].memory_headroom == 0.10
    m = gpt(layers=14, hidden=2048, heads=16, vocab=50257).model_copy(
        update={"mlp": "swiglu", "norm": "rmsnorm", "ffn_hidden_size": 5632, "dropout": False}
    )
    cluster = cluster_from_preset("dgx-h100", 1)
    layouts = [f"tp=2,dp=4,mbs={b},nmb={16 // b}" for b in (1, 2, 4, 8, 16)]
    seen = set()
    for engine in ("executor", "nanotron"):
        t = TrainingSpec(seq_len=4096, global_batch_size=64, precision="bf16", engine=engine)
        exact = compare(m, t, cluster, layouts, memory_headroom=0.0)
        share = [p.prediction.peak_memory_bytes / p.prediction.memory_capacity_bytes for p in exact]
        default = compare(m, t, cluster, layouts)
        wide = compare(m, t, cluster, layouts, memory_headroom=0.10)
        for x, d, w in zip(share, default, wide, strict=True):
            tight = (d.infeasible_reason or "").startswith("memory_tight")
            assert tight == (1 - ENGINES[engine].memory_headroom < x <= 1), (engine, x, d.infeasible_reason)
            assert (w.infeasible_reason or "").startswith("memory_tight") == (0.9 < x <= 1)
            seen.add((engine, tight))
    assert {("nanotron", True), ("executor", True)} <= seen, "no layout inside a headroom: the test checks nothing"


def test_memory_headroom_is_validated_where_it_enters():
    """A headroom outside 0..0.5 is a clear error naming the field (CLI exit 2, API 422)."""
    from berth.api.schemas import SearchRequest
    from berth.planner.planning import compare, make_search
    from berth.specs.errors import BerthError
    from berth.topology.clusters import cluster_from_preset

    with pytest.raises(BerthError, match="memory_headroom"):
        make_search(memory_headroom=0.9)
    with pytest.raises(BerthError, match="memory_headroom"):
        compare(
            gpt(),
            TrainingSpec(seq_len=2048, global_batch_size=8),
            cluster_from_preset("dgx-h100", 1),
            ["tp=8"],
            memory_headroom=-0.1,
        )
    with pytest.raises(ValueError, match="memory_headroom"):
        SearchRequest(memory_headroom=1.0)
    assert make_search(memory_headroom=0.2).memory_headroom == 0.2


def test_rank_slice_proxy_is_predicted_with_the_recipe_it_runs():
    """The rank-slice proxy (executor/proxy.py) runs one rank's slice in one process: fp32 weights
    under autocast, no FSDP2, even for a layout whose full run would use FSDP2 (dp with tp)."""
    from berth.cost_models.step import proxy_prediction
    from berth.planner.search import predict_layouts
    from berth.specs.tree import Layout
    from berth.topology.clusters import cluster_from_preset

    m = gpt(layers=4, hidden=1024, heads=8)
    t = TrainingSpec(seq_len=1024, global_batch_size=8, precision="bf16")
    (p,) = predict_layouts(
        m,
        t,
        cluster_from_preset("dgx-h100", 1),
        [Layout(tp=2, dp=4, zero_stage=1, shard=4, micro_batch_size=1, num_microbatches=2)],
        memory_headroom=0.0,
    )
    assert p.prediction.memory_breakdown_bytes["autocast_copies"] == 0.0  # the full run: FSDP2
    _, breakdown, _ = proxy_prediction(p, 4, True)
    assert breakdown["memory.autocast_copies"] > 0.0
