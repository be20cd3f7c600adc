"""Topology graphs change the answer: fast domains, shared links, placement and mixed devices."""

import copy
import json

import pytest

from berth.hardware_profiles import load_server
from berth.planner.planning import make_search, plan
from berth.planner.search import predict_layouts
from berth.specs.errors import BerthError
from berth.specs.models import load_model
from berth.specs.tree import Layout, ModelSpec, TrainingSpec
from berth.topology.clusters import cluster_from_node_link, cluster_from_preset
from berth.topology.graphs import cluster_graph, to_node_link

GB = 1e9


def levels(cluster):
    return [(lv.gpus, lv.link.kind, lv.link.bandwidth_bytes_per_s / GB, lv.limited_by) for lv in cluster.levels]


def best(model, training, cluster, fix=""):
    return plan(model, training, cluster, make_search(top=1, fix=fix)).plans[0]


def test_hierarchies_of_the_presets():
    assert levels(cluster_from_preset("dgx-h100", 2)) == [(8, "nvswitch", 450, "path"), (16, "infiniband", 50, "path")]
    # bridged pairs, two pairs on a socket through their PCIe switch uplinks, sockets over the CPU link,
    # and a 400 Gb/s NIC per pair
    assert levels(cluster_from_preset("pcie-h100", 2)) == [
        (2, "nvlink", 300, "path"),
        (4, "pcie", 32, "shared"),
        (8, "pcie", 8, "shared"),
        (16, "infiniband", 25, "shared"),
    ]
    assert levels(cluster_from_preset("aws-p4d", 2))[-1] == (16, "ethernet", 6.25, "shared")  # 4 NICs for 8 GPUs
    fat = cluster_from_preset("dgx-h100", 16, "fat-tree", 4, 4.0)
    assert levels(fat) == [
        (8, "nvswitch", 450, "path"),
        (32, "infiniband", 50, "path"),
        (128, "infiniband", 12.5, "shared"),
    ]  # the spine gives a GPU a quarter of its NIC


def test_node_link_round_trip_gives_the_preset():
    data = json.loads(json.dumps(to_node_link(cluster_graph([(load_server("dgx-a100-80g"), 3)]))))
    from_file = cluster_from_node_link(data, "dgx-a100-80g")
    assert from_file.levels == cluster_from_preset("dgx-a100-80g", 3).levels
    assert from_file.hosts == ("n0", "n1", "n2")


def test_pcie_boxes_with_bridged_pairs_keep_tp_at_most_2():
    for name, nodes, batch in (("llama3-8b", 1, 64), ("llama3-70b", 4, 64)):
        model, training = load_model(name), TrainingSpec(seq_len=4096, global_batch_size=batch)
        assert best(model, training, cluster_from_preset("pcie-h100", nodes)).layout.tp <= 2
    # wide tp costs little on NVSwitch nodes and a lot over PCIe (the measured compute model makes thin
    # tp slices slower everywhere, so the best layout need not use tp 8 even on NVSwitch)
    model, training = load_model("llama3-70b"), TrainingSpec(seq_len=4096, global_batch_size=64)

    def tp8_penalty(preset):
        cluster = cluster_from_preset(preset, 4)
        tp8 = best(model, training, cluster, fix="tp=8").prediction.step_time_s
        return tp8 / best(model, training, cluster).prediction.step_time_s

    assert tp8_penalty("dgx-h100") < 1.3 and tp8_penalty("pcie-h100") > 1.8


def test_tp16_across_two_dgx_nodes_is_far_slower_than_tp8_inside_one():
    model = ModelSpec(
        name="wide",
        num_layers=32,
        hidden_size=8192,
        num_attention_heads=64,
        ffn_hidden_size=28672,
        vocab_size=32000,
        mlp="swiglu",
        norm="rmsnorm",
    )
    training = TrainingSpec(seq_len=4096, global_batch_size=32)
    tp16, tp8 = predict_layouts(
        model,
        training,
        cluster_from_preset("dgx-h100", 2),
        [
            Layout(tp=16, micro_batch_size=1, num_microbatches=32),
            Layout(tp=8, pp=2, micro_batch_size=1, num_microbatches=32),
        ],
    )
    assert tp16.prediction.step_time_s > 1.4 * tp8.prediction.step_time_s
    assert tp16.prediction.time_breakdown_s["tp_comm"] > 2.5 * tp8.prediction.time_breakdown_s["tp_comm"]
    assert [g.crosses_slow_link for g in tp16.placement.groups if g.axis == "tp"] == [True]
    assert [g.crosses_slow_link for g in tp8.placement.groups if g.axis == "tp"] == [False]


def _slow_nic_graph(nodes: int, slow_node: int, gbps: float) -> dict:
    data = to_node_link(cluster_graph([(load_server("dgx-h100"), nodes)]))
    slow = copy.deepcopy(data)
    for link in slow["links"]:
        ends = (link["source"], link["target"])
        if any(e.startswith(f"n{slow_node}.") for e in ends) and any(e.startswith("rail") for e in ends):
            link["bandwidth_GBps"] = gbps
    return data, slow


def test_one_node_with_a_slower_nic_lowers_dp_throughput_for_the_whole_job():
    data, slow = _slow_nic_graph(4, 3, 12.5)
    fast_c, slow_c = cluster_from_node_link(data, "fast"), cluster_from_node_link(slow, "slow")
    assert slow_c.levels[-1].link.bandwidth_bytes_per_s == 12.5 * GB  # the ring through it sets the pace
    model, training = load_model("llama3-8b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    layout = Layout(tp=1, dp=32, micro_batch_size=2, num_microbatches=1)
    f, s = predict_layouts(model, training, fast_c, [layout]) + predict_layouts(model, training, slow_c, [layout])
    assert s.prediction.time_breakdown_s["dp_comm"] > 2 * f.prediction.time_breakdown_s["dp_comm"]
    assert s.prediction.tokens_per_s < f.prediction.tokens_per_s
    assert best(model, training, slow_c).prediction.tokens_per_s < best(model, training, fast_c).prediction.tokens_per_s


def test_fat_tree_with_4_to_1_oversubscription_keeps_dp_inside_a_leaf():
    model, training = load_model("llama3-70b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    over = cluster_from_preset("dgx-h100", 16, "fat-tree", 4, 4.0)
    flat = cluster_from_preset("dgx-h100", 16, "fat-tree", 4, 1.0)
    chosen = best(model, training, over, fix="tp=8,pp=4")
    dp = next(g for g in chosen.placement.groups if g.axis == "dp")
    assert dp.nodes_spanned <= 4 and dp.level == "4 hosts"  # the leaf
    inside, across = (
        Layout(tp=8, pp=4, dp=4, micro_batch_size=1, num_microbatches=16, axis_order=o)
        for o in ("tp-dp-pp", "tp-pp-dp")
    )
    a, b = predict_layouts(model, training, over, [inside, across])
    assert b.prediction.time_breakdown_s["dp_comm"] > 4 * a.prediction.time_breakdown_s["dp_comm"]  # the spine
    assert b.prediction.step_time_s > 1.05 * a.prediction.step_time_s
    a, b = predict_layouts(model, training, flat, [inside, across])
    assert b.prediction.step_time_s == pytest.approx(a.prediction.step_time_s, rel=0.02)  # non-blocking: no matter


def test_plan_carries_rank_map_and_groups_that_realize_its_order():
    model, training = load_model("llama3-70b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    p = best(model, training, cluster_from_preset("dgx-h100", 4))
    pl, x = p.placement, p.layout
    assert pl.axis_order == x.axis_order and len(pl.rank_map) == x.world_size
    for axis in ("tp", "dp", "pp"):
        groups = pl.process_groups[axis]
        assert sorted(r for g in groups for r in g) == list(range(x.world_size))
        for g in groups:
            assert len({pl.rank_map[r][a] for r in g for a in ("tp", "dp", "pp") if a != axis}) <= 2
    tp = next(g for g in pl.groups if g.axis == "tp")
    assert tp.nodes_spanned == 1  # tp fits in a node, and stays there
    assert all(e["node"] * 8 + e["local_rank"] == e["rank"] for e in pl.rank_map)


def test_mixed_cluster_is_bounded_by_the_smallest_memory_and_paced_by_the_slowest_device():
    data = to_node_link(cluster_graph([(load_server("dgx-a100-80g"), 2), (load_server("aws-p4d"), 2)]))
    c = cluster_from_node_link(data, "mixed")
    assert c.devices == {"a100-80g": 16, "a100-40g": 16}
    assert c.device.memory_bytes == pytest.approx(40 * 2**30, rel=0.01)
    assert c.device.name == "a100-40g" and any("slowest" in n for n in c.notes)
    # a layout that fits 80 GB but not 40 GB is rejected on the mixed cluster
    model, training = load_model("llama3-8b"), TrainingSpec(seq_len=4096, global_batch_size=64)
    layout = Layout(tp=1, dp=32, zero_stage=3, shard=32, micro_batch_size=2, num_microbatches=1)
    (mixed,) = predict_layouts(model, training, c, [layout])
    (big,) = predict_layouts(model, training, cluster_from_preset("dgx-a100-80g", 4), [layout])
    assert big.prediction.fits and not mixed.prediction.fits


@pytest.mark.parametrize(
    "mutate, field, words",
    [
        (
            lambda d: d["links"].append({"source": "n0.g0", "target": "n0.g0", "kind": "nvlink", "bandwidth_GBps": 1}),
            "links[",
            "self-loop",
        ),
        (lambda d: d["links"][0].update(bandwidth_GBps=0), "bandwidth_GBps", "positive"),
        (lambda d: d["links"][0].update(efficiency=1.5), "efficiency", "(0, 1]"),
        (lambda d: d["nodes"][0].update(device="h900"), "device", "unknown device"),
        (lambda d: d["nodes"].append(dict(d["nodes"][0])), "id", "duplicate"),
        (
            lambda d: d["nodes"].append({"id": "lonely", "kind": "gpu", "device": "h100-sxm", "host": "n9"}),
            "cluster.graph",
            "disconnected",
        ),
        (
            lambda d: (
                d["nodes"].append({"id": "n1.g8", "kind": "gpu", "device": "h100-sxm", "host": "n1"})
                or d["links"].append(
                    {"source": "n1.g8", "target": "n1.nvswitch", "kind": "nvswitch", "bandwidth_GBps": 450}
                )
            ),
            "nodes",
            "different GPU counts",
        ),
    ],
)
def test_bad_graphs_name_the_element(mutate, field, words):
    data = to_node_link(cluster_graph([(load_server("dgx-h100"), 2)]))
    mutate(data)
    with pytest.raises(BerthError) as err:
        cluster_from_node_link(data)
    assert field in err.value.field and words in str(err.value)


def test_fabric_options_are_checked():
    with pytest.raises(BerthError, match="oversubscription"):
        cluster_from_preset("dgx-h100", 4, "fat-tree", 2, 0.5)
    with pytest.raises(BerthError, match="nodes_per_leaf"):
        cluster_from_preset("dgx-h100", 4, "fat-tree", 8, 2.0)
    with pytest.raises(BerthError, match="fat-tree"):
        cluster_from_preset("dgx-h100", 4, "rails", None, 2.0)
