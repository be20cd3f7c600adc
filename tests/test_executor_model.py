"""The executor's decoder matches its ModelSpec and trains (single process, CPU)."""

import math

import pytest

torch = pytest.importorskip("torch")

from executor.model import build_model, loss_fn, synthetic_batch  # noqa: E402
from planner.models import presets  # noqa: E402
from planner.specs import ModelSpec  # noqa: E402

SMALL_LLAMA = ModelSpec(name="small-llama", num_layers=2, hidden_size=128, num_attention_heads=8,
                        num_kv_heads=2, ffn_hidden_size=352, vocab_size=512, mlp="swiglu", norm="rmsnorm")


@pytest.mark.parametrize("spec", [presets()["tiny-gpt"], SMALL_LLAMA], ids=["tiny-gpt", "small-llama"])
def test_parameter_count_equals_spec(spec):
    model = build_model(spec)
    assert sum(p.numel() for p in model.parameters()) == spec.num_params


def test_same_seed_same_weights_and_loss_falls():
    spec = SMALL_LLAMA
    a, b = build_model(spec, seed=3), build_model(spec, seed=3)
    assert all(torch.equal(x, y) for x, y in zip(a.parameters(), b.parameters(), strict=True))
    tokens, targets = synthetic_batch(spec, batch=4, seq_len=32, seed=0, step=0)
    first = loss_fn(a(tokens), targets)
    assert abs(first.item() - math.log(spec.vocab_size)) < 0.5  # near-uniform at init
    opt = torch.optim.AdamW(a.parameters(), lr=3e-3)
    for _ in range(5):
        opt.zero_grad()
        loss = loss_fn(a(tokens), targets)
        loss.backward()
        opt.step()
    assert loss.item() < first.item()
