"""Data-parallel overlap (cost_models/step.py: _dp_times, pipelined_exposed_s): exposed time can
never be less than the traffic minus the compute window it overlaps, and it never falls when the
links get slower. The traffic is priced here from the collective primitives and the window read
from the step's own compute breakdown, not from the overlap formula under test."""

import numpy as np
import pytest

from berth.cost_models import comm, memory
from berth.cost_models.step import OVERLAP_COMPUTE_SLOWDOWN, evaluate, overlapped_s, pipelined_exposed_s
from berth.specs.candidates import Candidates
from berth.specs.models import load_model
from berth.specs.tree import Layout, TrainingSpec
from berth.topology.clusters import cluster_from_preset


def test_pipelined_exposure_bounds():
    rng = np.random.default_rng(0)
    traffic = rng.uniform(0.0, 2.0, 500)
    window = rng.uniform(0.0, 2.0, 500)
    chunks = rng.integers(1, 128, 500).astype(float)
    overlap = 0.7
    exposed = pipelined_exposed_s(traffic, window, chunks, overlap)
    assert np.all(exposed >= traffic - overlap * window - 1e-12)  # a window hides at most what it lasts
    assert np.all(exposed >= traffic / chunks - 1e-12)  # the first (last) chunk has nothing to hide behind
    assert np.all(exposed <= traffic + 1e-12)
    assert pipelined_exposed_s(0.0, 1.0, 8, overlap) == 0.0
    more = pipelined_exposed_s(traffic * 1.5, window, chunks, overlap)
    assert np.all(more >= exposed)


FAT_TREE = dict(fabric="fat-tree", nodes_per_leaf=4)


def _fsdp_case(oversubscription=4.0, nodes=16):
    """The fat-tree example of docs/guide.md with the layout the old overlap model ranked first."""
    model = load_model("llama3-70b")
    training = TrainingSpec(seq_len=4096, global_batch_size=64)
    cluster = cluster_from_preset("dgx-h100", nodes, oversubscription=oversubscription, **FAT_TREE)
    layout = Layout(tp=2, dp=64, zero_stage=3, shard=8, recompute="full", sequence_parallel=True)
    return model, training, cluster, Candidates.from_layouts([layout])


def test_fsdp_exposed_at_least_traffic_minus_window():
    """1.74 s of gathers, reduce-scatters and the replica all-reduce against 1.69 s of compute (at
    0.7 usable: 1.18 s) came out as 22 ms exposed before the window was shared; now at least
    traffic - usable window, whatever the compute model makes the window."""
    model, training, cluster, c = _fsdp_case()
    ev = evaluate(model, training, cluster, c)
    params = np.maximum(memory.stage_params(model, c.pp, c.tp, True), memory.stage_params(model, c.pp, c.tp, False))
    nbytes = params * training.bytes_per_element
    shard, stride = c.shard.astype(float), c.strides()["dp"]
    gather = comm.all_gather_s(cluster, nbytes, shard, stride)
    scatter = comm.reduce_scatter_s(cluster, nbytes, shard, stride)
    replicas = comm.all_reduce_s(cluster, nbytes / shard, c.dp / shard, stride * c.shard)
    traffic = c.num_microbatches * (2 * gather + scatter) + replicas
    t = ev.time_breakdown_s
    window = t["compute"] + t["recompute"]
    assert traffic[0] > 1.5  # the 1.74 s
    assert t["dp_comm"][0] >= traffic[0] - cluster.comm_overlap_efficiency * window[0] - 1e-9


@pytest.mark.parametrize("zero,shard", [(0, 1), (1, 64), (2, 8), (3, 64), (3, 8)])
def test_exposed_dp_time_monotone_in_bandwidth(zero, shard):
    """Slower uplinks never make data-parallel time (or the step) shorter."""
    model = load_model("llama3-8b")
    training = TrainingSpec(seq_len=4096, global_batch_size=128)
    layout = Layout(tp=2, dp=64, zero_stage=zero, shard=shard, micro_batch_size=1, num_microbatches=2)
    c = Candidates.from_layouts([layout])
    dp, step = [], []
    for over in (1.0, 2.0, 4.0, 8.0, 16.0):
        ev = evaluate(model, training, cluster_from_preset("dgx-h100", 16, oversubscription=over, **FAT_TREE), c)
        dp.append(ev.time_breakdown_s["dp_comm"][0])
        step.append(ev.step_time_s[0])
    assert np.all(np.diff(dp) >= -1e-12), dp
    assert np.all(np.diff(step) >= -1e-12), step
    assert dp[-1] > dp[0]  # at 16:1 the traffic outgrows the window


def test_zero3_gathers_every_microbatch():
    """FSDP gathers the parameters in each micro-batch's forward and backward: at the same global
    batch, 8 micro-batches of 1 expose more than 1 micro-batch of 8 when the traffic outlasts
    the window (one rail per node: 1/8 of the DGX's NIC bandwidth per GPU)."""
    model = load_model("llama3-8b")
    training = TrainingSpec(seq_len=2048, global_batch_size=128)
    cluster = cluster_from_preset("dgx-h100", 2, fabric="fat-tree", nodes_per_leaf=1, oversubscription=8.0)
    few = Layout(dp=16, zero_stage=3, shard=16, micro_batch_size=8, num_microbatches=1)
    many = Layout(dp=16, zero_stage=3, shard=16, micro_batch_size=1, num_microbatches=8)
    ev = evaluate(model, training, cluster, Candidates.from_layouts([few, many]))
    assert ev.time_breakdown_s["dp_comm"][1] > 2 * ev.time_breakdown_s["dp_comm"][0]


@pytest.mark.parametrize(
    "framework,precision,tp,zero,want",
    [
        ("pytorch", "bf16", 1, 0, (4, 4)),  # the executor's DDP: fp32 parameters and gradients under autocast
        ("pytorch", "bf16", 1, 1, (4, 4)),  # ZeroRedundancyOptimizer hands back updated fp32 parameters
        ("pytorch", "bf16", 8, 0, (2, 4)),  # FSDP2 (dp with tp): bf16 param_dtype gathers, fp32 reduce_dtype
        ("pytorch", "bf16", 1, 3, (2, 4)),
        ("megatron", "bf16", 8, 1, (2, 4)),  # 16-bit parameters, fp32 grad buffer (accumulate_allreduce_grads_in_fp32)
        ("megatron", "fp16", 8, 1, (2, 2)),  # Megatron fp16: 16-bit grad buffer
    ],
)
def test_collectives_carry_the_recipes_dtypes(framework, precision, tp, zero, want):
    training = TrainingSpec(seq_len=4096, global_batch_size=64, framework=framework, precision=precision)
    c = Candidates.from_layouts([Layout(tp=tp, dp=8, zero_stage=zero, shard=8 if zero else 1)])
    gathered, reduced = memory.dp_collective_bytes(training, c)
    assert (gathered[0], reduced[0]) == want


def test_fp32_gradients_cost_twice_the_traffic_of_fp16_ones():
    """Megatron's DDP all-reduce of the same layout over an oversubscribed fat tree: the bf16 recipe's
    fp32 grad buffer exposes more than the fp16 recipe's 16-bit one, by at most the doubled traffic."""
    model, _, cluster, _ = _fsdp_case()
    c = Candidates.from_layouts([Layout(tp=8, dp=8, micro_batch_size=1, num_microbatches=8)])
    exposed = {}
    for precision in ("bf16", "fp16"):
        training = TrainingSpec(seq_len=4096, global_batch_size=64, framework="megatron", precision=precision)
        exposed[precision] = evaluate(model, training, cluster, c).time_breakdown_s["dp_comm"][0]
    params = memory.stage_params(model, c.pp, c.tp, True)
    half = comm.all_reduce_s(cluster, params * 2, c.dp, c.strides()["dp"])[0]
    assert exposed["fp16"] > 0
    assert exposed["fp16"] < exposed["bf16"] <= exposed["fp16"] + half + 1e-9


def test_hidden_traffic_still_slows_the_compute_it_overlaps():
    """Traffic a window hides is not free: the compute beside it runs OVERLAP_COMPUTE_SLOWDOWN slower
    (arXiv:2507.03114: 18.9% on average). Exposed traffic costs itself; the sum never exceeds it."""
    traffic = np.array([0.0, 1.0, 1.0, 1.0])
    exposed = np.array([0.0, 0.0, 0.4, 1.0])
    cost = overlapped_s(traffic, exposed)
    assert cost == pytest.approx([0.0, OVERLAP_COMPUTE_SLOWDOWN, 0.4 + 0.6 * OVERLAP_COMPUTE_SLOWDOWN, 1.0])
    # in a step: the 8B FSDP layout on one DGX H100 hides its gathers and reduce-scatters, and pays for them
    model, training = load_model("llama3-8b"), TrainingSpec(seq_len=8192, global_batch_size=16)
    cluster = cluster_from_preset("dgx-h100", 1)
    c = Candidates.from_layouts([Layout(dp=8, zero_stage=3, shard=8, micro_batch_size=1, num_microbatches=2)])
    params = memory.stage_params(model, c.pp, c.tp, True)
    gathered, reduced = memory.dp_collective_bytes(training, c)
    per_mb = 2 * comm.all_gather_s(cluster, params * gathered, c.shard, 1) + comm.reduce_scatter_s(
        cluster, params * reduced, c.shard, 1
    )
    dp = evaluate(model, training, cluster, c).time_breakdown_s["dp_comm"][0]
    assert dp >= OVERLAP_COMPUTE_SLOWDOWN * 2 * per_mb[0] * (1 - 1 / model.num_layers)
