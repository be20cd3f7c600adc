"""The op census (benchmarks/op_census.py) behind the derived framework entries of the device
profiles, and the attention-kernel generations (TrainingSpec.attention_kernel)."""

import numpy as np
import pytest

pytest.importorskip("torch", reason="the op census runs the layers with torch")

from benchmarks import op_census  # noqa: E402
from berth.cost_models import compute  # noqa: E402
from berth.hardware_profiles import load_device  # noqa: E402
from berth.specs.models import presets  # noqa: E402
from berth.specs.tree import TrainingSpec  # noqa: E402
from tests.conftest import require_reference  # noqa: E402


@pytest.fixture(scope="module")
def census():
    return op_census.run(write=False)


def test_profiles_hold_the_derived_entries(census):
    """Every profile's torchtitan and llmfoundry entries are what the census derives from that
    profile's executor entry: change the census or the executor fit and `--write` must be rerun."""
    assert census["devices"], "no device profile with a torchtitan entry"
    for name, entries in census["devices"].items():
        device = load_device(name)
        for stack, entry in entries.items():
            assert device.frameworks[stack].model_dump() == pytest.approx(entry), (name, stack)


def test_census_sees_what_each_stack_does(census):
    c = census["census"]
    ex, tt, mpt = c["executor"], c["torchtitan"], c["llmfoundry"]
    # torchtitan's hand-written fp32 RMSNorm and complex rotary move more than the executor's fused
    # norm; MPT's fused LayerNorm without rotary far less
    assert tt["forward"]["hidden_bytes"] > ex["forward"]["hidden_bytes"] > 2 * mpt["forward"]["hidden_bytes"]
    assert tt["backward"]["hidden_bytes"] > ex["backward"]["hidden_bytes"] > mpt["backward"]["hidden_bytes"]
    # the executor casts each fp32 weight to bf16 under autocast (6 bytes per parameter); FSDP2 and
    # Composer gather bf16 weights
    assert ex["forward"]["weight_bytes"] == pytest.approx(6.0)
    assert tt["forward"]["weight_bytes"] == mpt["forward"]["weight_bytes"] == 0.0
    # seven GEMMs forward (fourteen backward) in a SwiGLU Llama block, four (eight) in MPT's
    assert ex["forward"]["kernels"]["gemm"] == tt["forward"]["kernels"]["gemm"] == 7
    assert ex["backward"]["kernels"]["gemm"] == 14 and mpt["backward"]["kernels"]["gemm"] == 8
    assert ex["forward"]["all_kernels"] > tt["forward"]["all_kernels"] > mpt["forward"]["all_kernels"]


@pytest.mark.parametrize(
    ("device", "kernel", "scale"),
    [
        ("a100-80g", "flash1", 0.5),
        ("a100-80g", "flash2", 1.0),
        ("h100-sxm", "flash2", 0.54),
        ("h100-sxm", "sdpa", 1.0),
    ],
)
def test_attention_kernel_generation(device, kernel, scale):
    """An older kernel runs the same FLOPs at its share of the measured efficiency."""
    dev, model = load_device(device), presets()["llama3-8b"]
    base = TrainingSpec(seq_len=8192, global_batch_size=8)
    older = base.model_copy(update={"attention_kernel": kernel})
    f0, b0 = compute.attention_core_s(model, base, dev, np.array([1.0]), np.array([1.0]))
    f1, b1 = compute.attention_core_s(model, older, dev, np.array([1.0]), np.array([1.0]))
    assert f1 == pytest.approx(f0 / scale) and b1 == pytest.approx(b0 / scale)


def test_unknown_attention_kernel_is_refused():
    with pytest.raises(ValueError, match="attention_kernel"):
        TrainingSpec(seq_len=2048, global_batch_size=8, attention_kernel="flash9")


def test_executor_dispatch_is_its_kernel_count_times_one_eager_op():
    """The h100-sxm executor entry's host dispatch is the census's kernel count of today's
    executor layer x the measured host time of one eager op: an executor change that adds kernels
    to the layer fails here until the profile is refitted (`benchmarks.layer_fidelity --fit`)."""
    from benchmarks import layer_fidelity

    require_reference(layer_fidelity.REFERENCE / "bandwidth.json")
    fw = load_device("h100-sxm").frameworks["pytorch"]
    dispatch = layer_fidelity.host_dispatch()
    assert fw.dispatch_fwd_s == pytest.approx(dispatch["dispatch_fwd_s"], rel=1e-3)
    assert fw.dispatch_bwd_s == pytest.approx(dispatch["dispatch_bwd_s"], rel=1e-3)
