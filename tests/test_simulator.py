"""The simulator: the network model's arithmetic by hand, the store routes, and replays that can
tell the policies apart (no devices: abstract states on bare device ids)."""

from __future__ import annotations

import json
import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tenplex_jax._src.cli import main
from tenplex_jax._src.elastic.trace import ResourceTrace
from tenplex_jax._src.simulator import network as net
from tenplex_jax_models import llm

C = tj.ParallelConfig
GB = 1e9


def _cluster(nodes=2, per_node=2, **extra) -> tj.planner.Cluster:
    """``nodes`` x ``per_node`` devices with round numbers: links 10 GB/s, NICs 1 GB/s per device,
    host links 2 GB/s, on-device copies 100 GB/s, storage 0.5 GB/s per node."""
    t = tj.planner.DeviceType(
        "gpu",
        memory=80 * 2**30,
        flops=1e14,
        link_bandwidth=10 * GB,
        host_bandwidth=2 * GB,
        memory_bandwidth=100 * GB,
    )
    n = nodes * per_node
    fields = {"storage_bandwidth": 0.5 * GB} | extra
    return tj.planner.Cluster(
        "test", (t,), (0,) * n, tuple(i // per_node for i in range(n)), 1 * GB, **fields
    )


def _state(rows=8, cols=4):
    """One float32 leaf with a logical name per dim, abstract."""
    with nnx.use_eager_sharding(False):
        return nnx.State(
            {
                "w": nnx.Param(
                    jax.ShapeDtypeStruct((rows, cols), jnp.float32), out_sharding=("embed", None)
                )
            }
        )


RULES = (("embed", "fsdp"),)


def _ptc(config, devices, cluster):
    return tj.PTC.of(_state(), RULES, config, devices, hosts=[cluster.nodes[d] for d in devices])


def test_nic_sharing_and_full_duplex_by_hand():
    network = net.Network(_cluster(per_node=2))
    t = net.Traffic.empty(network.cluster)
    # both devices of node 0 send 1 GB to node 1, and node 1 sends 2 GB back at the same time
    t.node["node_out"][:] = [2 * GB, 2 * GB]
    t.node["node_in"][:] = [2 * GB, 2 * GB]
    t.device["nic_out"][:] = [GB, GB, GB, GB]
    t.device["nic_in"][:] = [GB, GB, GB, GB]
    estimate = network.seconds(t)
    # a node's two NICs give 2 GB/s each way: 1 s, not 2 (full duplex) and not 0.5 (shared)
    assert estimate.seconds == pytest.approx(1.0)
    assert estimate.resources["node_out"] == pytest.approx(1.0)
    capped = net.Network(_cluster(per_node=2, node_network_bandwidth=0.5 * GB)).seconds(t)
    assert capped.seconds == pytest.approx(4.0) and capped.bottleneck.startswith("node_")


def test_device_route_of_a_plan_by_hand():
    cluster = _cluster(nodes=2, per_node=2)
    network = net.Network(cluster)
    src = _ptc(C(fsdp=4), [0, 1, 2, 3], cluster)  # 8x4 float32: 32 bytes per device
    dst = _ptc(C(fsdp=4), [2, 3, 0, 1], cluster)  # the nodes swap their halves
    traffic = net.device_traffic(tj.make_plan(src, dst), network)
    np.testing.assert_array_equal(traffic.device["nic_in"], [32, 32, 32, 32])
    np.testing.assert_array_equal(traffic.node["node_out"], [64, 64])
    assert network.seconds(traffic).seconds == pytest.approx(64 / (2 * GB))
    # a split on the same devices is an on-device copy, no network
    local = net.device_traffic(tj.make_plan(dst, _ptc(C(fsdp=4), [2, 3, 0, 1], cluster)), network)
    assert local.network_bytes == 0 and network.seconds(local).seconds == 0


def test_store_pulls_read_the_own_node_then_the_writer_then_a_replica():
    cluster = _cluster(nodes=4, per_node=1)
    network = net.Network(cluster)
    src = _ptc(C(fsdp=4), range(4), cluster)  # device i on node i holds rows 2i..2i+1
    dst = _ptc(C(fsdp=2), [0, 1], cluster)  # device 0 needs rows 0..3, device 1 rows 4..7
    plan = tj.make_plan(src, dst)
    objects = net.stored(src, replicas=1)
    held = net.holders(objects)
    assert held[("w", ((2, 4), (0, 4)))] == (1, 2)  # writer node 1, replica on node 2
    reads = net.pulls(plan, network, held)
    traffic = net.store_traffic(reads, network)
    # device 0 reads node 0's own object and node 1's; device 1 reads nodes 2 and 3 (32 B each)
    np.testing.assert_array_equal(traffic.node["node_out"], [0, 32, 32, 32])
    np.testing.assert_array_equal(traffic.device["h2d"], [64, 64, 0, 0])
    # node 1 failed: its object comes from its replica on node 2
    failed = net.store_traffic(net.pulls(plan, network, held, {1}), network)
    np.testing.assert_array_equal(failed.node["node_out"], [0, 0, 64, 32])
    # nodes 1 and 2 failed: rows 2..3 have no live copy (node 2's own object lives on node 3)
    lost = net.pulls(plan, network, held, {1, 2})
    assert lost.lost == (("w", ((2, 4), (0, 4))),)
    # through node 3: every byte not already there comes in (96), all 128 go out to the targets
    central = net.store_traffic(reads, network, via=3)
    assert central.node["node_in"][3] == 96 and central.node["node_out"][3] == 128


def test_restore_reads_each_box_once_per_node_and_copies_it_to_each_device():
    cluster = _cluster(nodes=1, per_node=4)
    dst = _ptc(C(data=2, fsdp=2), range(4), cluster)  # two replicas of two boxes on one node
    traffic = net.restore_traffic(dst, net.Network(cluster))
    assert traffic.node["storage_read"][0] == 128  # the leaf once
    np.testing.assert_array_equal(traffic.device["h2d"], [64, 64, 64, 64])
    estimate = net.Network(cluster).seconds(traffic)
    assert estimate.seconds == pytest.approx(128 / (0.5 * GB))
    assert estimate.bottleneck == "storage_read node 0"


def test_a_trace_scales_by_whole_multiples():
    trace = ResourceTrace(
        "t",
        4,
        10,
        (
            tj.elastic.TraceEvent(2, "preempt", count=1),
            tj.elastic.TraceEvent(3, "fail", devices=(3,)),
        ),
    )
    big = tj.simulator.scale(trace, 16)
    assert big.devices == 16 and big.events[0].count == 4
    assert big.events[1].devices == (12, 13, 14, 15)
    with pytest.raises(tj.errors.LayoutError, match="multiple"):
        tj.simulator.scale(trace, 6)


def _simulation(nodes=16, **costs):
    cluster = _cluster(nodes=nodes, per_node=8)
    return tj.simulator.Simulation(
        cluster,
        llm.profile(),
        llm.abstract_state(),
        llm.LLM_RULES,
        global_batch=256,
        costs=tj.simulator.Costs(**costs),
    )


TRACE = ResourceTrace.from_dict(
    {
        "name": "small",
        "devices": 16,
        "steps": 100,
        "minutes": 600,
        "checkpoint_every": 20,
        "events": [
            {"step": 20, "kind": "preempt", "count": 4},
            {"step": 45, "kind": "fail", "count": 1},
            {"step": 60, "kind": "offer", "count": 4},
            {"step": 85, "kind": "fail", "count": 2},
        ],
    }
)


@pytest.fixture(scope="module")
def replay():
    return tj.simulator.simulate(_simulation(), TRACE)


def test_replay_orders_the_policies_and_accounts_every_second(replay):
    kinds = [r["kind"] for r in replay["events"]]
    assert kinds == ["preempt", "fail", "offer", "fail"]
    assert [r["devices_after"] for r in replay["events"]] == [96, 88, 120, 104]
    p = replay["policies"]
    assert p["tenplex"]["goodput"] > p["checkpoint-restart"]["goodput"] > 0
    assert p["central"]["stall_seconds"] > p["tenplex"]["stall_seconds"]
    for policy in p.values():  # stalls + lost + productive + periodic stops fill the wall time
        assert policy["productive_seconds"] + policy["stall_seconds"] <= policy["wall_seconds"]
    for row in replay["events"]:
        t = row["policies"]["tenplex"]
        assert t["seconds"] == pytest.approx(
            t["commit"] + t["transfer"] + t["restore"] + t["restart"] + t["compile"]
        )
        assert (t["compile"] > 0) == (row["kind"] == "fail")  # announced layouts compiled ahead
        assert row["bytes_moved"] > 0 and row["plan_seconds"] < 5


def test_adjacent_failures_beyond_the_replicas_fall_back_to_the_checkpoint(replay):
    one, two = (r for r in replay["events"] if r["kind"] == "fail")
    assert not one["policies"]["tenplex"]["fallback"]  # one node: its replica lives on
    # two adjacent nodes: some writer's replica died with it; the checkpoint serves
    assert two["policies"]["tenplex"]["fallback"] and two["policies"]["tenplex"]["lost_leaves"]
    assert two["policies"]["tenplex"]["restore"] > 0
    # checkpoints every 120 minutes: the failure at minute 510 loses the 30 minutes since 480
    assert 0.9 * 1800 < two["policies"]["tenplex"]["lost_seconds"] <= 1800
    assert one["policies"]["tenplex"]["lost_seconds"] < one["step_seconds_before"] * 10
    more = tj.simulator.simulate(_simulation(replicas=2), TRACE)
    assert not any(r["policies"]["tenplex"]["fallback"] for r in more["events"])


def test_the_cli_writes_the_table_json_and_plot(tmp_path, capsys):
    cluster = tmp_path / "c.toml"
    cluster.write_text(
        'name = "c"\nnetwork_gbps = 50\nstorage_gbps = 5\n[types.h100]\n'
        'memory_gib = 80\ntflops = 400\nlink_gbps = 450\n[[nodes]]\ntype = "h100"\n'
        "count = 8\nrepeat = 16\n"
    )
    trace = tmp_path / "t.toml"
    trace.write_text(
        "devices = 16\nsteps = 10\nminutes = 60\n[[events]]\nstep = 5\n"
        'kind = "preempt"\ncount = 8\n'
    )
    args = ["simulate", "--cluster", str(cluster), "--trace", str(trace), "--batch", "256"]
    assert main([*args, "--out", str(tmp_path / "out")]) == 0
    text = capsys.readouterr().out
    assert "goodput" in text and "checkpoint-restart" in text
    assert (tmp_path / "out" / "simulate.png").stat().st_size > 0
    assert main([*args, "--json", "--policy", "tenplex"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert list(result["policies"]) == ["tenplex"] and len(result["events"]) == 1
    assert math.isclose(result["minutes"], 60)
    assert main([*args, "--policy", "nope"]) == 2


def test_cluster_fields_for_the_simulator_are_checked():
    base = {
        "types": {"g": {"memory_gib": 8, "tflops": 1, "link_gbps": 1, "host_link_gbps": 3}},
        "nodes": [{"type": "g", "count": 2}],
    }
    cluster = tj.planner.Cluster.from_dict(base | {"storage_gbps": 4, "node_network_gbps": 9})
    assert cluster.types[0].host_bandwidth == 3e9 and cluster.storage_bandwidth == 4e9
    assert cluster.node_network_bandwidth == 9e9
    with pytest.raises(tj.errors.PlanError, match="unknown fields"):
        tj.planner.Cluster.from_dict(base | {"storage": 4})
    with pytest.raises(tj.errors.PlanError, match="storage_gbps > 0"):
        tj.planner.Cluster.from_dict(base | {"storage_gbps": 0})
