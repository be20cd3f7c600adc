"""The executor's decoder matches its ModelSpec and trains (single process, CPU)."""

import math

import pytest

torch = pytest.importorskip("torch")

from berth.executor.model import build_model, loss_fn, synthetic_batch  # noqa: E402
from berth.specs.models import presets  # noqa: E402
from berth.specs.tree import ModelSpec  # noqa: E402

SMALL_LLAMA = ModelSpec(
    name="small-llama",
    num_layers=2,
    hidden_size=128,
    num_attention_heads=8,
    num_kv_heads=2,
    ffn_hidden_size=352,
    vocab_size=512,
    mlp="swiglu",
    norm="rmsnorm",
)


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


def test_peak_counts_an_unseen_free_at_the_latest_when_its_address_is_reused():
    """The CPU profiler misses frees made on gloo worker threads (functional collectives' outputs):
    a block whose address is allocated again was freed by then (the next test: any overlap); a known free
    releases its block; a free of a block the count never saw (allocated before profiling) changes nothing."""
    from berth.executor.train import peak_allocated

    mb = 2**20
    at = 100 * mb  # addresses far enough apart that no two blocks overlap
    events = [
        (0, 1 * at, 10 * mb),  # alive before training starts
        (5, 2 * at, 4 * mb),
        (6, 2 * at, -4 * mb),  # seen alloc and free
        (7, 3 * at, 6 * mb),  # freed on another thread: no free event
        (8, 3 * at, 6 * mb),  # the same address again: the first block is gone
        (9, 99 * at, -30 * mb),  # an object of a previous run dies: not in the count
        (10, 4 * at, 1 * mb),
    ]
    assert peak_allocated(events, since=4) == 17 * mb
    # without the reuse rule 10 + 6 + 6 + 1 = 23 MiB; subtracting the unknown free, 16 - 30 + 1
    assert peak_allocated(events, since=11) is None  # nothing recorded after the mark
    assert peak_allocated(events[:1], since=0) == 10 * mb


def test_peak_releases_an_unseen_free_when_a_later_block_overlaps_it():
    """Two live blocks cannot overlap: a block freed unseen (DDP's old gradient bucket, once in CI) is released by
    the first allocation that overlaps it, wherever that starts (the rebuilt bucket was mapped 1.75 MiB into the
    old one); a block that only touches its end, or lies before it, releases nothing."""
    from berth.executor.train import peak_allocated

    mb = 2**20
    old = 1000 * mb  # a 37.75 MiB block freed on another thread: no free event
    events = [
        (0, old, int(37.75 * mb)),
        (1, old + int(37.75 * mb), 1 * mb),  # right after it: no overlap
        (2, old - 2 * mb, 2 * mb),  # right before it: no overlap
        (3, old + int(1.75 * mb), 36 * mb),  # inside it: the old block is gone
        (4, 5000 * mb, 10 * mb),
    ]
    # without the overlap rule the old block stays: 37.75 + 1 + 2 + 36 + 10 = 86.75 MiB
    assert peak_allocated(events, since=0) == pytest.approx((1 + 2 + 36 + 10) * mb)
    # a block that starts before the old one and reaches into it releases it, and the 2 MiB block it covers: the
    # peak is the three blocks before it (40.75 MiB), then 1 + 5 + 10
    events[3] = (3, old - 4 * mb, 5 * mb)
    assert peak_allocated(events, since=0) == pytest.approx((37.75 + 1 + 2) * mb)
    events[4] = (4, 5000 * mb, 40 * mb)
    assert peak_allocated(events, since=0) == pytest.approx((1 + 5 + 40) * mb)
