"""Hand-computed FLOP counts (Narayanan 2021 Eq. 3, Korthikanti 2022 Eq. 7/8)."""

import numpy as np
import pytest

from berth.cost_models import flops
from berth.specs.candidates import RECOMPUTE_FULL, RECOMPUTE_NONE, RECOMPUTE_SELECTIVE
from berth.specs.tree import ModelSpec, TrainingSpec
from tests.conftest import gpt


def test_gpt_layer_forward_is_24bsh2_plus_4bs2h():
    m = gpt(layers=2, hidden=1024, heads=16)
    b, s, h = 3, 512, 1024
    assert flops.layer_forward_flops(m, s, b) == 24 * b * s * h**2 + 4 * b * s**2 * h


def test_model_flops_match_korthikanti_eq7_for_gpt3():
    m = gpt(layers=96, hidden=12288, heads=96)
    t = TrainingSpec(seq_len=2048, global_batch_size=64)
    B, L, s, h, V = 64, 96, 2048, 12288, 51200
    eq7 = 72 * B * L * s * h**2 * (1 + s / (6 * h) + V / (12 * h * L))
    assert flops.model_flops_per_step(m, t) == pytest.approx(eq7, rel=1e-12)


def test_full_recompute_gives_narayanan_eq3_four_passes():
    m = gpt(layers=96, hidden=12288, heads=96)
    t = TrainingSpec(seq_len=2048, global_batch_size=64)
    B, L, s, h, V = 64, 96, 2048, 12288, 51200
    eq3 = 96 * B * s * L * h**2 * (1 + s / (6 * h) + V / (16 * L * h))
    rec = flops.recompute_flops_per_step(m, t, np.array([RECOMPUTE_FULL]))[0]
    assert flops.model_flops_per_step(m, t) + rec == pytest.approx(eq3, rel=1e-12)


def test_selective_recompute_adds_attention_core_only_eq8():
    m = gpt(layers=4, hidden=512, heads=8)
    t = TrainingSpec(seq_len=1024, global_batch_size=2)
    codes = np.array([RECOMPUTE_NONE, RECOMPUTE_SELECTIVE])
    extra = flops.recompute_flops_per_step(m, t, codes)
    assert extra[0] == 0
    assert extra[1] == 4 * 4 * 2 * 1024**2 * 512  # L x 4 b s^2 h


def test_gqa_and_swiglu_counts():
    m = ModelSpec(
        num_layers=1,
        hidden_size=64,
        num_attention_heads=8,
        num_kv_heads=2,
        ffn_hidden_size=128,
        vocab_size=100,
        mlp="swiglu",
    )
    b, s, h, f = 1, 16, 64, 128
    kv_width = 2 * 8  # kv heads x head_dim
    proj = 2 * b * s * h * (h + 2 * kv_width) + 2 * b * s * h * h
    assert flops.attention_projection_flops(m, s, b) == proj
    assert flops.mlp_flops(m, s, b) == 3 * 2 * b * s * h * f
