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
    m = gpt(layers=48, hidden=H, heads=A)
    t = TrainingSpec(seq_len=S, global_batch_size=B, precision="fp16", flash_attention=False, framework=framework)
    per_layer, _ = memory.layer_activation_bytes(m, t, B, np.array(tp), np.array(sp), np.array(recompute))
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
    t = TrainingSpec(seq_len=S, global_batch_size=B, precision="fp16", flash_attention=True)
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


@pytest.mark.parametrize("zero,expected", [(0, 16.0), (1, 4 + 12 / 8), (2, 2 + 14 / 8), (3, 16 / 8)])
def test_zero_stages_divide_model_states(zero, expected):
    t = TrainingSpec(seq_len=1, global_batch_size=1, precision="bf16")
    psi = 1e9
    p, g, o = memory.model_state_bytes(t, psi, np.array(zero), np.array(8))
    assert float(p + g + o) == pytest.approx(expected * psi)  # Rajbhandari 2020, Fig. 1


def test_fp32_training_keeps_two_optimizer_states():
    t = TrainingSpec(seq_len=1, global_batch_size=1, precision="fp32")
    p, g, o = memory.model_state_bytes(t, 1.0, np.array(0), np.array(1))
    assert (float(p), float(g), float(o)) == (4.0, 4.0, 8.0)


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
    assert params("bf16", "pytorch") == pytest.approx(full / 2, rel=1e-6)
