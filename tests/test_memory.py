"""Memory formulas against Korthikanti 2022 Sec. 4 and Rajbhandari 2020 (ZeRO)."""

import numpy as np
import pytest

from cost_models import memory, pipeline
from cost_models.candidates import (
    RECOMPUTE_FULL,
    RECOMPUTE_NONE,
    RECOMPUTE_SELECTIVE,
    SCHEDULE_1F1B,
    SCHEDULE_GPIPE,
    SCHEDULE_INTERLEAVED,
)
from planner.specs import TrainingSpec
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
    assert _layer(RECOMPUTE_NONE, tp=t, sp=1, framework="pytorch") == pytest.approx(_layer(RECOMPUTE_NONE, tp=t, sp=1)
                                                                                   + extra)
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
    from cost_models.candidates import Candidates
    from planner.specs import Layout

    t = TrainingSpec(seq_len=1, global_batch_size=8, precision=precision, framework=framework)
    dp = dp or shard
    c = Candidates.from_layouts([Layout(tp=tp, dp=dp, shard=shard, zero_stage=zero, micro_batch_size=1,
                                        num_microbatches=8 // dp)])
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
    from cost_models.candidates import Candidates
    from planner.specs import Layout

    return Candidates.from_layouts([Layout(**layout)])


@pytest.mark.parametrize("zero", [2, 3])
def test_fsdp2_mixed_precision_shards_the_fp32_master_gradients_and_state(zero):
    """torchtitan / the executor with FSDP2 MixedPrecisionPolicy(bf16, reduce fp32): 16 bytes per
    parameter over the shard group; ZeRO-2 keeps the gathered bf16 stage from forward to backward."""
    s = _states("bf16", "pytorch", zero=zero, shard=8)
    assert s["parameters"] + s["gradients"] + s["optimizer_state"] == pytest.approx(16 / 8)
    assert s["gathered"] == (2.0 if zero == 2 else 0.0) and s["autocast"] == 0.0
    # dp with tp runs under FSDP2 too (the executor's rule), even at zero 0
    assert memory.precision_recipe(TrainingSpec(seq_len=1, global_batch_size=1),
                                   _cands(tp=2, dp=2)) == memory.RECIPE_FSDP2


def test_fp32_training_keeps_two_optimizer_states():
    s = _states("fp32", "pytorch")
    assert (s["parameters"], s["gradients"], s["optimizer_state"], s["autocast"]) == (4.0, 4.0, 8.0, 0.0)


def _peak_grads(**layout):
    """Gradient bytes held at the peak phase, and the phase's logits, for a 4-layer model in fp32."""
    from cost_models.candidates import Candidates
    from planner.specs import Layout
    from planner.topology import cluster_from_preset

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
    from cost_models.candidates import Candidates
    from planner.specs import Layout
    from planner.topology import cluster_from_preset

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
    from cost_models.candidates import Candidates
    from planner.specs import Layout
    from planner.topology import cluster_from_preset

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
