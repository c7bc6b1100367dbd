"""The simulator: the network model's arithmetic by hand, the store routes, and replays that can
tell the policies apart (no devices: abstract states on bare device ids)."""

from __future__ import annotations

import functools
import json
import math

import hypothesis
import numpy as np
import pytest
from hypothesis import strategies as st

import tenplex_jax as tj
from tenplex_jax._src.cli import main
from tenplex_jax._src.elastic.trace import ResourceTrace
from tenplex_jax._src.simulator import network as net
from tenplex_jax_models import llm
from tests.helpers import GB, sim_cluster, sim_ptc

C = tj.ParallelConfig


def test_nic_sharing_and_full_duplex_by_hand():
    network = net.Network(sim_cluster(per_node=2))
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
    capped = net.Network(sim_cluster(per_node=2, node_network_bandwidth=0.5 * GB)).seconds(t)
    assert capped.seconds == pytest.approx(4.0) and capped.bottleneck.startswith("node_")


def test_device_route_of_a_plan_by_hand():
    cluster = sim_cluster(nodes=2, per_node=2)
    network = net.Network(cluster)
    src = sim_ptc(C(fsdp=4), [0, 1, 2, 3], cluster)  # 8x4 float32: 32 bytes per device
    dst = sim_ptc(C(fsdp=4), [2, 3, 0, 1], cluster)  # the nodes swap their halves
    traffic = net.device_traffic(tj.make_plan(src, dst), network)
    np.testing.assert_array_equal(traffic.device["nic_in"], [32, 32, 32, 32])
    np.testing.assert_array_equal(traffic.node["node_out"], [64, 64])
    assert network.seconds(traffic).seconds == pytest.approx(64 / (2 * GB))
    # a split on the same devices is an on-device copy, no network
    local = net.device_traffic(
        tj.make_plan(dst, sim_ptc(C(fsdp=4), [2, 3, 0, 1], cluster)), network
    )
    assert local.network_bytes == 0 and network.seconds(local).seconds == 0


def test_store_pulls_read_the_own_node_then_the_writer_then_a_replica():
    cluster = sim_cluster(nodes=4, per_node=1)
    network = net.Network(cluster)
    src = sim_ptc(C(fsdp=4), range(4), cluster)  # device i on node i holds rows 2i..2i+1
    dst = sim_ptc(C(fsdp=2), [0, 1], cluster)  # device 0 needs rows 0..3, device 1 rows 4..7
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
    cluster = sim_cluster(nodes=1, per_node=4)
    dst = sim_ptc(C(data=2, fsdp=2), range(4), cluster)  # two replicas of two boxes on one node
    traffic = net.restore_traffic(dst, net.Network(cluster))
    assert traffic.node["storage_read"][0] == 128  # the leaf once
    np.testing.assert_array_equal(traffic.device["h2d"], [64, 64, 64, 64])
    estimate = net.Network(cluster).seconds(traffic)
    assert estimate.seconds == pytest.approx(128 / (0.5 * GB))
    assert estimate.bottleneck == "storage_read node 0"


def test_a_trace_scales_to_the_cluster_both_ways():
    trace = ResourceTrace(
        "t",
        4,
        10,
        (
            tj.elastic.TraceEvent(2, "preempt", count=1),
            tj.elastic.TraceEvent(3, "fail", devices=(3,)),
            tj.elastic.TraceEvent(4, "offer", devices=(0, 1)),
        ),
    )
    big = tj.simulator.scale(trace, 16)  # a whole multiple: device i is devices 4i..4i+3
    assert big.devices == 16 and big.events[0].count == 4
    assert big.events[1].devices == (12, 13, 14, 15)
    odd = tj.simulator.scale(trace, 6)  # by proportion: 1.5 devices each, counts rounded up
    assert odd.events[0].count == 2 and odd.events[1].devices == (4, 5)
    assert odd.events[2].devices == (0, 1, 2)
    small = tj.simulator.scale(trace, 2)  # two trace devices share one; never zero of them
    assert small.events[0].count == 1 and small.events[1].devices == (1,)
    assert small.events[2].devices == (0,)


def _simulation(nodes=16, **costs):
    cluster = sim_cluster(nodes=nodes, per_node=8)
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
    assert [r.kind for r in replay.events] == ["preempt", "fail", "offer", "fail"]
    assert [r.devices_after for r in replay.events] == [96, 88, 120, 104]
    p = replay.policies
    assert set(p) == set(tj.simulator.Policy)
    assert p["tenplex"].goodput > p[tj.simulator.Policy.CHECKPOINT_RESTART].goodput > 0
    assert p["central"].stall_seconds > p["tenplex"].stall_seconds
    for policy in p.values():  # stalls + lost + productive + periodic stops fill the wall time
        assert policy.productive_seconds + policy.stall_seconds <= policy.wall_seconds
    for row in replay.events:
        t = row.policies["tenplex"]
        assert t.seconds == pytest.approx(t.commit + t.transfer + t.restore + t.restart + t.compile)
        assert (t.compile > 0) == (row.kind == "fail")  # announced layouts compiled ahead
        assert row.bytes_moved > 0 and row.plan_seconds > 0  # timed, never bounded: any machine
    # the JSON the command writes: the records as dicts, the enums as their strings
    data = json.loads(replay.to_json())
    assert data["policies"]["tenplex"]["goodput"] == p["tenplex"].goodput
    assert (
        data["events"][1]["policies"]["central"]["seconds"]
        == replay.events[1].policies["central"].seconds
    )
    assert data["checkpoint"]["rule"] == replay.checkpoint.rule == "trace"
    assert data["events"][2]["decision"] in ("grow", "stay") and data["costs"]["replicas"] == 1


def test_adjacent_failures_beyond_the_replicas_fall_back_to_the_checkpoint(replay):
    one, two = (r.policies["tenplex"] for r in replay.events if r.kind == "fail")
    assert not one.fallback  # one node: its replica lives on
    # two adjacent nodes: some writer's replica died with it; the checkpoint serves
    assert two.fallback and two.lost_leaves and two.restore > 0
    # checkpoints every 120 minutes: the failure at minute 510 loses the 30 minutes since 480
    assert 0.9 * 1800 < two.lost_seconds <= 1800
    assert one.lost_seconds < replay.events[1].step_seconds_before * 10
    more = tj.simulator.simulate(_simulation(replicas=2), TRACE)
    assert not any(r.policies["tenplex"].fallback for r in more.events)


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


# --- every shipped cluster x trace x model preset: a result, or a one-line refusal; the job's
# devices as a scheduler hands them out (idle devices kept, waiting with none, fewer per node) ---


def _shipped():
    """The cluster and trace files in meshes/ (a trace has ``steps``)."""
    import pathlib
    import tomllib

    clusters, traces = [], []
    for path in sorted((pathlib.Path(__file__).parents[2] / "meshes").glob("*.toml")):
        (traces if "steps" in tomllib.loads(path.read_text()) else clusters).append(path)
    return clusters, traces


@functools.cache
def _preset(name: str):
    """(abstract state, rules, profile, global batch) of a ``--model`` preset, as the command
    line builds it."""
    from tenplex_jax._src.cli.simulate import DEFAULT_BATCH
    from tenplex_jax_models import LOGICAL_RULES, build_state, profile_of

    if name == "llm-70b":
        return llm.abstract_state(), llm.LLM_RULES, llm.profile(), DEFAULT_BATCH[name]
    state = build_state(name, lr=1e-3, abstract=True)[1]
    return state, LOGICAL_RULES, profile_of(name), DEFAULT_BATCH.get(name, 64)


def _outcome(cluster, name: str, trace, **costs):
    """``simulate``'s result, or the TenplexError it raised (checked to be one line naming the
    model and the cluster); any other exception propagates."""
    state, rules, profile, batch = _preset(name)
    sim = tj.simulator.Simulation(
        cluster, profile, state, rules, batch, costs=tj.simulator.Costs(**costs)
    )
    try:
        result = tj.simulator.simulate(sim, trace)
    except tj.errors.TenplexError as error:
        message = str(error)
        assert "\n" not in message and message, repr(message)
        assert profile.name in message and cluster.name in message, message
        return error
    # work a failure lost leaves the clock's training segments, so a later fallback to the
    # checkpoint cannot count it twice (it once made goodput negative)
    for summary in result.policies.values():
        assert 0.0 <= summary.goodput <= 1.0 + 1e-9, summary
    return result


def test_a_layout_uses_fewer_devices_of_a_node_when_a_prime_count_fits_none():
    state, rules, profile, batch = _preset("gpt100m")
    cpu8 = tj.planner.Cluster.load(_shipped()[0][0].parent / "cpu8.toml")
    sim = tj.simulator.Simulation(cpu8, profile, state, rules, batch)
    layout = sim.layout(range(7))  # fsdp=7 divides no dim, data=7 does not fit 2 GiB
    assert layout.devices == tuple(range(len(layout.devices))) and 4 <= len(layout.devices) < 7
    with pytest.raises(tj.errors.PlanError, match=r"gpt100m.* 2 devices of 'cpu8'"):
        sim.layout(range(2))


def _trace(devices, *events, steps=100, minutes=100):
    return ResourceTrace.from_dict(
        {"name": "t", "devices": devices, "steps": steps, "minutes": minutes, "events": events}
    )


def test_a_job_with_no_device_waits_then_resumes_on_an_offer():
    cluster = sim_cluster(nodes=2, per_node=4)
    trace = _trace(
        8,
        {"step": 20, "kind": "preempt", "count": 8},
        {"step": 30, "kind": "fail", "count": 1},  # nothing left to take: no effect
        {"step": 60, "kind": "offer", "count": 4},
    )
    result = _outcome(cluster, "tiny", trace)
    wait, idle, resume = result.events
    assert (wait.decision, wait.devices_after, wait.config_after) == ("wait", 0, "(no device)")
    assert idle.decision == tj.simulator.Outcome.WAIT and idle.policies["tenplex"].seconds == 0
    assert resume.decision == "resume" and resume.devices_after == 4
    for policy, summary in result.policies.items():
        # 40 of the 100 minutes without a device: a stall, never training
        assert wait.policies[policy].wait == pytest.approx(40 * 60)
        assert summary.stall_seconds >= 40 * 60
        assert summary.productive_seconds <= 60 * 60
    points = result.timeline["tenplex"]
    assert (20.0, 0) in [(round(p.minute, 6), p.devices) for p in points]
    # with no offer after it, the job waits to the end
    alone = _outcome(cluster, "tiny", _trace(8, {"step": 50, "kind": "fail", "count": 8}))
    assert alone.policies["tenplex"].productive_seconds <= 50 * 60


def test_a_declined_offer_stays_with_the_job_and_a_preemption_takes_it_first():
    # gpt tiny on 8 devices: the offer of 4 more at the last step cannot pay for a restart
    cluster = sim_cluster(nodes=3, per_node=4)
    trace = _trace(
        12,
        {"step": 10, "kind": "preempt", "count": 4},
        {"step": 98, "kind": "offer", "count": 4},
        {"step": 99, "kind": "preempt", "count": 4},
    )
    result = _outcome(cluster, "tiny", trace)
    shrink, offer, preempt = result.events
    assert shrink.decision == "change" and offer.decision == "stay"
    assert offer.devices_after == 12 and offer.used_after == 12  # the layout declined
    assert not offer.growth.grow and offer.growth.remaining_steps >= 0
    # the preemption takes the 4 idle devices the job holds: its layout stays
    assert preempt.decision == "keep" and preempt.devices_after == 8
    assert preempt.config_after == shrink.config_after
    assert preempt.policies["tenplex"].seconds == 0


def _device_types():
    """Every device type of the shipped clusters, once."""
    types = {}
    for path in _shipped()[0]:
        for t in tj.planner.Cluster.load(path).types:
            types.setdefault(t.name, t)
    return tuple(types.values())


_TYPES = _device_types()


@st.composite
def _clusters(draw):
    nodes = draw(
        st.lists(
            st.tuples(st.integers(0, len(_TYPES) - 1), st.integers(1, 4)), min_size=1, max_size=3
        )
    )
    kinds = tuple(k for k, count in nodes for _ in range(count))
    ids = tuple(n for n, (_, count) in enumerate(nodes) for _ in range(count))
    gbps = draw(st.sampled_from([7, 25, 50]))
    return tj.planner.Cluster("random", _TYPES, kinds, ids, gbps * GB)


@st.composite
def _traces(draw):
    devices = draw(st.integers(1, 12))
    steps = draw(st.lists(st.integers(1, 49), max_size=6).map(sorted))
    events = []
    for step in steps:
        kind = draw(st.sampled_from(["preempt", "fail", "offer", "redeploy"]))
        ids = st.lists(st.integers(0, devices - 1), min_size=1, max_size=devices, unique=True)
        if kind == "redeploy" or draw(st.booleans()):
            events.append({"step": step, "kind": kind, "devices": draw(ids)})
        else:
            events.append({"step": step, "kind": kind, "count": draw(st.integers(1, devices))})
    minutes = draw(st.sampled_from([None, 5, 600]))
    data = {"name": "random", "devices": devices, "steps": 50, "events": events}
    return ResourceTrace.from_dict(data | ({"minutes": minutes} if minutes else {}))


@hypothesis.settings(max_examples=40, deadline=None, derandomize=True)
@hypothesis.given(cluster=_clusters(), trace=_traces())
def test_any_small_cluster_and_trace_simulates_or_refuses_in_one_line(cluster, trace):
    outcome = _outcome(cluster, "tiny", trace)
    if isinstance(outcome, tj.simulator.SimulationResult):
        assert len(outcome.events) == len(trace.events)
        for row in outcome.events:
            assert row.decision in ("change", "grow", "stay", "keep", "wait", "resume")
            assert isinstance(row.decision, tj.simulator.Outcome)
            assert row.devices_after <= cluster.num_devices


@pytest.mark.parametrize(
    "path",
    # the clusters of 1,024 and 4,096 devices take minutes: their matrix is run by
    # ``benchmarks/simulate_matrix.py`` and recorded in RESULTS.md
    [p for p in _shipped()[0] if tj.planner.Cluster.load(p).num_devices <= 64],
    ids=lambda path: path.stem,
)
def test_every_shipped_cluster_trace_and_model_simulates_or_refuses_in_one_line(path):
    from tenplex_jax._src.cli.simulate import MODELS

    traces = _shipped()[1]
    assert len(traces) >= 2
    cluster = tj.planner.Cluster.load(path)
    refused = []
    for trace_path in traces:
        trace = ResourceTrace.load(trace_path)
        for name in MODELS:
            outcome = _outcome(cluster, name, trace)
            if isinstance(outcome, tj.simulator.SimulationResult):
                for summary in outcome.policies.values():
                    assert 0.0 <= summary.goodput <= 1.0, (trace_path.stem, name, summary)
            else:  # the model does not fit: the planner found no layout on the devices left
                assert isinstance(outcome, tj.errors.PlanError), outcome
                assert "no layout of" in str(outcome), outcome
                refused.append(name)
    # the small presets run on every cluster but the 4096 devices their batch of 64 cannot use
    if cluster.num_devices <= 1024:
        assert not {"tiny", "small"} & set(refused), refused
