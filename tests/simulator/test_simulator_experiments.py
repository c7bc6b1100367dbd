"""The simulator's experiments: fixed changes, policies charged alike, latency, failures from an
MTTF, Young/Daly checkpoints, GPT-3 sizes, and the flags of ``tenplex-jax simulate`` (no devices:
abstract states on bare device ids)."""

from __future__ import annotations

import dataclasses
import json
import math

import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.cli import main
from tenplex_jax._src.elastic.trace import ResourceTrace, TraceEvent
from tenplex_jax._src.errors import PlanError
from tenplex_jax._src.simulator import network as net
from tenplex_jax._src.simulator.costs import (
    Blocking,
    Costs,
    assumptions,
    checkpoint_interval,
    young_daly,
)
from tenplex_jax._src.simulator.failures import failure_trace, merge
from tenplex_jax._src.simulator.fixed import fixed_change
from tenplex_jax_models import LOGICAL_RULES, GPTConfig, build_state, llm, profile_of
from tests.helpers import sim_cluster, sim_ptc

C = tj.ParallelConfig


def _sim(nodes=4, per_node=4, model="llm-70b", **costs) -> tj.simulator.Simulation:
    """A 70B-class decoder (too big for 16 devices: fixed changes only), or a GPT preset."""
    if model == "llm-70b":
        state, rules, profile = llm.abstract_state(), llm.LLM_RULES, llm.profile()
    else:
        state, rules = build_state(model, lr=1e-3, abstract=True)[1], LOGICAL_RULES
        profile = profile_of(model)
    return tj.simulator.Simulation(
        sim_cluster(nodes, per_node), profile, state, rules, global_batch=256, costs=Costs(**costs)
    )


# -- costs ---------------------------------------------------------------------------------------


def test_costs_per_policy_and_their_checks():
    costs = Costs(restart_seconds={"tenplex": 5, "central": 5}, compile_seconds=90)
    assert costs.restart("tenplex") == 5 and costs.restart("checkpoint-restart") == 60
    assert costs.compile("central") == costs.compile("checkpoint-restart") == 90
    assert costs.compiled_ahead("offer") and not costs.compiled_ahead("fail")
    assert Costs(executable_cache=True).compiled_ahead("fail")
    assert not Costs(compile_ahead=False).compiled_ahead("preempt")
    with pytest.raises(PlanError, match=r"policy of Costs\.restart_seconds must be one of"):
        Costs(restart_seconds={"orbax": 1})
    with pytest.raises(PlanError, match="latency_seconds must be >= 0"):
        Costs(latency_seconds=-1)
    # a published MTTF at 1024 devices: 16 devices fail 64 times less often
    assert Costs(mttf_hours=7.9).mttf_seconds(16) == pytest.approx(7.9 * 3600 * 64)
    assert young_daly(2.0, 3600.0) == pytest.approx(120.0)


def test_checkpoint_interval_rules():
    trace = ResourceTrace("t", 4, 100, (TraceEvent(50, "fail", count=1),), 10, minutes=600)
    blocking = Blocking(copy=1.0, save=5.0)
    given = checkpoint_interval(Costs(checkpoint_minutes=7), trace, 600, blocking, 4)
    assert given.rule == "given" and given.minutes == 7
    by_trace = checkpoint_interval(Costs(), trace, 600, blocking, 4)
    assert by_trace.rule == "trace" and by_trace.minutes == pytest.approx(60)
    # one failure in 600 minutes: MTTF 36000 s; sqrt(2 * 1 * 36000) = 268 s
    yd = checkpoint_interval(Costs(young_daly=True), trace, 600, blocking, 4)
    assert yd.rule == "young-daly" and yd.minutes == pytest.approx(math.sqrt(72000) / 60)
    assert "Young/Daly" in yd.note and yd.mttf_hours == pytest.approx(10)
    # the MTTF flags win over the trace's failures; never shorter than a minute
    flags = checkpoint_interval(Costs(young_daly=True, mttf_hours=1e-3), trace, 600, blocking, 4)
    assert flags.minutes == pytest.approx(1.0)
    quiet = ResourceTrace("q", 4, 100, (), minutes=600)
    default = checkpoint_interval(Costs(young_daly=True), quiet, 600, blocking, 4)
    assert default.minutes == 30 and default.rule == "default"
    said = assumptions(Costs(), "checkpoint-restart", yd)
    assert "announced changes compiled ahead" in said and yd.note in said


# -- the network model: latency per request --------------------------------------------------------


def test_latency_is_paid_per_request_in_sequence_on_top_of_the_bytes():
    cluster = sim_cluster(nodes=4, per_node=1)
    src = sim_ptc(C(fsdp=4), range(4), cluster)
    dst = sim_ptc(C(fsdp=2), [0, 1], cluster)
    held = net.holders(net.stored(src, replicas=1))
    plain = net.Network(cluster)
    slow = net.Network(cluster, latency_seconds=0.5)
    traffic = net.store_traffic(net.pulls(tj.make_plan(src, dst), plain, held), plain)
    # each target device pulls 2 pieces: its node issues 2 requests
    np.testing.assert_array_equal(traffic.messages, [2, 2, 0, 0])
    base, late = plain.seconds(traffic), slow.seconds(traffic)
    assert late.latency == pytest.approx(1.0)
    assert late.seconds == pytest.approx(base.seconds + 1.0)
    # a save is a write request per object at its writer; a restore a read per box and node
    objects = net.stored(src, replicas=1)
    np.testing.assert_array_equal(net.save_traffic(objects, plain).messages, [1, 1, 1, 1])
    np.testing.assert_array_equal(net.commit_traffic(objects, plain).messages, [2, 2, 2, 2])
    np.testing.assert_array_equal(net.restore_traffic(dst, plain).messages, [1, 1, 0, 0])


# -- the network model: host work, the stores' rates, failure detection ----------------------------


COLUMNS = (None, "embed")  # the [8, 4] leaf split along its columns: a merge writes rows apart


def _cpu_cluster(nodes=1, per_node=4) -> tj.planner.Cluster:
    gpu = sim_cluster(nodes, per_node)
    cpu = dataclasses.replace(gpu.types[0], name="cpu", host_memory=True)
    return dataclasses.replace(gpu, types=(cpu,))


@pytest.mark.parametrize("kind", ["cpu", "gpu"])
def test_host_work_adds_to_a_cpu_nodes_copies_and_overlaps_an_accelerators(kind):
    cluster = _cpu_cluster() if kind == "cpu" else sim_cluster(nodes=1, per_node=4)
    plan = tj.make_plan(
        sim_ptc(C(fsdp=4), range(4), cluster, COLUMNS), sim_ptc(C(fsdp=2), [2, 3], cluster, COLUMNS)
    )
    plain = net.Network(cluster)
    fixed = net.Network(
        cluster, piece_seconds=1.0, shard_seconds=10.0, leaf_seconds=100.0, run_seconds=1000.0
    )
    traffic = net.device_traffic(plan, fixed)
    # devices 2 and 3 each build a [8, 2] shard from 2 column pieces: 8 rows written apart each
    np.testing.assert_array_equal(traffic.pieces, [0, 0, 2, 2])
    np.testing.assert_array_equal(traffic.shards, [0, 0, 1, 1])
    np.testing.assert_array_equal(traffic.leaves, [1])  # one node rebuilds the one leaf
    np.testing.assert_array_equal(traffic.runs, [0, 0, 16, 16] if kind == "cpu" else [0] * 4)
    base, est = plain.seconds(traffic).seconds, fixed.seconds(traffic)
    if kind == "cpu":  # every run costs: one process, in sequence, besides the copies
        work = 4 * 1.0 + 2 * 10.0 + 100.0 + 32 * 1000.0
        assert est.host_work == pytest.approx(work)
        assert est.seconds == pytest.approx(base + work)
    else:  # a strided box copies at bandwidth; the host work overlaps the copies
        work = 4 * 1.0 + 2 * 10.0 + 100.0
        assert est.host_work == 0.0 and est.resources["host_work"] == pytest.approx(work)
        assert (
            est.seconds == pytest.approx(max(base, work)) and est.bottleneck == "host_work node 0"
        )
    # a split along the rows is one run per piece
    rows = tj.make_plan(sim_ptc(C(fsdp=4), range(4), cluster), sim_ptc(C(fsdp=2), [2, 3], cluster))
    runs = net.device_traffic(rows, fixed).runs
    np.testing.assert_array_equal(runs, [0, 0, 2, 2] if kind == "cpu" else [0] * 4)


def test_the_stores_rates_bound_pulls_commits_and_the_central_node():
    cluster = sim_cluster(nodes=4, per_node=1)
    src = sim_ptc(C(fsdp=4), range(4), cluster)
    dst = sim_ptc(C(fsdp=2), [0, 1], cluster)
    objects = net.stored(src, replicas=1)
    plain = net.Network(cluster)
    rated = net.Network(cluster, store_get_bandwidth=1.0, store_put_bandwidth=0.5)
    reads = net.pulls(tj.make_plan(src, dst), plain, net.holders(objects))
    # 128 bytes in 4 boxes of 32, each read from the store that holds it: its writer's node
    traffic = net.store_traffic(reads, plain)
    np.testing.assert_array_equal(traffic.node["store_get"], [32, 32, 32, 32])
    np.testing.assert_array_equal(traffic.node["store_put"], [0, 0, 0, 0])
    assert rated.seconds(traffic).seconds == pytest.approx(32.0)  # 32 B at 1 B/s, every node
    assert rated.seconds(traffic).bottleneck.startswith("store node")
    # the target's 2 shards are built once on each of 2 devices; each node rebuilds the leaf
    np.testing.assert_array_equal(traffic.shards, [1, 1, 0, 0])
    np.testing.assert_array_equal(traffic.leaves, [1, 1, 0, 0])
    # central: node 0's store takes the 96 bytes from elsewhere and serves them again
    central = net.store_traffic(reads, plain, via=0)
    np.testing.assert_array_equal(central.node["store_put"], [96, 0, 0, 0])
    np.testing.assert_array_equal(central.node["store_get"], [128, 32, 32, 32])
    assert rated.seconds(central).seconds == pytest.approx(128 / 1.0 + 96 / 0.5)
    # a commit puts every copy into its holder's store: 2 copies of 32 bytes each
    commit = net.commit_traffic(objects, plain)
    np.testing.assert_array_equal(commit.node["store_put"], [64, 64, 64, 64])
    assert rated.seconds(commit).resources["store"] == pytest.approx(128.0)
    # without rates the stores are no limit, and their bytes are no resource of their own
    assert plain.seconds(central).seconds < rated.seconds(central).seconds
    assert "store_get" not in plain.seconds(central).resources
    with pytest.raises(PlanError, match="store_get_bandwidth must be > 0"):
        Costs(store_get_bandwidth=0)


def test_a_failure_is_charged_its_detection_for_every_policy_and_an_announced_change_none():
    sim = _sim(detect_seconds=15.0, executable_cache=True, restart_seconds=5)
    fail = fixed_change(
        sim, C(tensor=4, pipe=2, data=2), C(tensor=4, pipe=2), "fail", failed_nodes={3}
    )
    offer = fixed_change(sim, C(tensor=4, pipe=2), C(tensor=4, pipe=2, data=2), "offer")
    for policy, cost in fail.policies.items():
        moved = ("save",) if policy == "checkpoint-restart" else ("commit", "transfer")
        parts = ("detect", "restore", "restart", "compile") + moved
        assert cost.detect == 15.0, policy
        assert cost.seconds == pytest.approx(sum(getattr(cost, k) for k in parts)), policy
    assert all(cost.detect == 0.0 for cost in offer.policies.values())
    assert "a failure is noticed after 15 s" in assumptions(sim.costs, "tenplex")
    with pytest.raises(PlanError, match="detect_seconds must be >= 0"):
        Costs(detect_seconds=-1)


# -- fixed changes and fair policies ------------------------------------------------------------


def test_a_fixed_change_charges_every_policy_alike():
    sim = _sim(restart_seconds={"tenplex": 5, "central": 5, "checkpoint-restart": 60})
    row = fixed_change(sim, C(tensor=4, pipe=2), C(tensor=4, pipe=2, data=2))
    assert row.kind == "offer" and row.devices_after == 16 and row.bytes_moved > 0
    assert not row.fits_after  # 690 GB on 16 x 80 GB: the configs are the caller's
    p = row.policies
    for policy, cost in p.items():
        first = cost.save if policy == "checkpoint-restart" else cost.commit
        moving = cost.transfer + cost.restore
        assert cost.seconds == pytest.approx(first + moving + cost.restart + cost.compile)
        assert cost.compile == 0 and cost.compiled_ahead  # announced: every policy
    assert p["tenplex"].restart == 5 and p["checkpoint-restart"].restart == 60
    assert p["central"].network_bytes > p["tenplex"].network_bytes
    assert p["central"].transfer > p["tenplex"].transfer
    assert json.loads(row.to_json())["policies"]["central"]["transfer"] == p["central"].transfer
    # a failure compiles on demand for every policy, unless executables are cached
    failed = fixed_change(sim, C(tensor=4, pipe=2, data=2), C(tensor=4, pipe=2), "fail")
    assert all(c.compile == 120 for c in failed.policies.values())
    cached = fixed_change(
        _sim(executable_cache=True), C(tensor=4, pipe=2, data=2), C(tensor=4, pipe=2), "fail"
    )
    assert all(c.compile == 0 for c in cached.policies.values())
    with pytest.raises(PlanError, match="needs 32 devices"):
        fixed_change(sim, C(tensor=4), C(tensor=4, data=8))


def test_a_replay_charges_checkpoint_restart_no_commits_and_says_what_it_assumed():
    trace = ResourceTrace.from_dict(
        {
            "devices": 4,
            "steps": 100,
            "minutes": 600,
            "events": [
                {"step": 30, "kind": "preempt", "count": 1},
                {"step": 60, "kind": "fail", "count": 1},
            ],
        }
    )
    result = tj.simulator.simulate(_sim(model="small", young_daly=True), trace)
    assert result.checkpoint.rule == "young-daly"
    preempt, fail = result.events
    assert all(c.compile == 0 for c in preempt.policies.values())
    assert all(c.compile == 120 for c in fail.policies.values())
    for policy, said in result.assumptions.items():
        assert any("Young/Daly" in s for s in said), policy
    # with no failures and no changes, checkpoint-restart pays only its checkpoints' copies
    quiet = tj.simulator.simulate(_sim(model="small"), ResourceTrace("q", 4, 10, (), minutes=60))
    p = quiet.policies
    assert p["checkpoint-restart"].goodput > p["tenplex"].goodput


# -- failures from an MTTF -------------------------------------------------------------------------


def test_failures_come_at_the_rate_an_mttf_implies_a_node_at_a_time():
    nodes = [d // 8 for d in range(1024)]
    trace = failure_trace(nodes, 60 * 24 * 30, 7.9, 1024, repair_minutes=60, seed=1)
    fails = [e for e in trace.events if e.kind == "fail"]
    expected = 24 * 30 / 7.9  # 1024 devices: the published MTTF itself
    assert 0.75 * expected < len(fails) < 1.25 * expected
    assert all(len(e.devices) == 8 and len({d // 8 for d in e.devices}) == 1 for e in fails)
    offers = [e for e in trace.events if e.kind == "offer"]
    assert len(offers) >= len(fails) - 1 and offers[0].devices == fails[0].devices
    assert offers[0].step == pytest.approx(fails[0].step + 3600, abs=1)
    assert failure_trace(nodes, 600, 7.9, seed=1) == failure_trace(nodes, 600, 7.9, seed=1)
    # 1/N: 64 devices fail 16 times less often than 1024
    small = failure_trace(nodes[:64], 60 * 24 * 30, 7.9, 1024, seed=1)
    assert sum(e.kind == "fail" for e in small.events) < len(fails) / 5
    with pytest.raises(tj.errors.LayoutError, match="mttf_hours > 0"):
        failure_trace(nodes, 600, 0)


def test_merged_failures_replay_and_repaired_nodes_come_back():
    sim = _sim(model="small")
    failures = ResourceTrace(
        "f",
        16,
        36000,
        (
            TraceEvent(3600, "fail", tuple(range(12, 16))),
            TraceEvent(7200, "offer", (12, 13, 14, 15)),
        ),
        minutes=600,
    )
    base = ResourceTrace("b", 16, 10, (TraceEvent(5, "preempt", count=4),), minutes=600)
    both = merge(base, failures)
    assert [e.kind for e in both.events] == ["fail", "offer", "preempt"]
    assert both.steps == 36000 and both.events[2].step == 18000
    result = tj.simulator.simulate(sim, both)
    assert [r.devices_after for r in result.events] == [12, 16, 12]
    with pytest.raises(tj.errors.LayoutError, match="same devices"):
        merge(ResourceTrace("b8", 8, 10, (), minutes=600), failures)


# -- GPT-3 sizes and the command line -------------------------------------------------------------


def test_gpt3_presets_have_the_papers_dimensions():
    assert GPTConfig.by_name("gpt3-1.3b") == GPTConfig(50304, 2048, 2048, 24, 16, 8192)
    six = GPTConfig.by_name("gpt3-6.7b")
    assert (six.n_layers, six.d_model, six.n_heads) == (32, 4096, 32)
    assert GPTConfig.by_name("gpt3-2.7b").d_model == 2560


CLUSTER = (
    'name = "c"\nnetwork_gbps = 3\nnode_network_gbps = 12\nstorage_gbps = 1\n[types.g]\n'
    'memory_gib = 48\ntflops = 60\nlink_gbps = 20\nhost_link_gbps = 25\n[[nodes]]\ntype = "g"\n'
    "count = 4\nrepeat = 4\n"
)


def test_the_cli_simulates_a_fixed_change_of_a_gpt_by_its_dimensions(tmp_path, capsys):
    cluster = tmp_path / "c.toml"
    cluster.write_text(CLUSTER)
    args = ["simulate", "--cluster", str(cluster), "--layers", "4", "--d-model", "256"]
    args += ["--heads", "8", "--vocab", "1024", "--seq-len", "128", "--batch", "32"]
    args += ["--from", "tensor=4,pipe=2,data=1", "--to", "tensor=4,pipe=2,data=2"]
    args += ["--restart-seconds", "tenplex=5,central=5,checkpoint-restart=60"]
    args += ["--latency-seconds", "0.001", "--piece-seconds", "0.0001"]
    out = tmp_path / "out"
    assert main([*args, "--policy", "tenplex,checkpoint-restart", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "transfer/restore" in text and "announced changes compiled ahead" in text
    assert (out / "change.png").stat().st_size > 0
    row = json.loads((out / "change.json").read_text())  # what --json prints
    assert list(row["policies"]) == list(row["assumptions"]) == ["tenplex", "checkpoint-restart"]
    assert row["policies"]["tenplex"]["restart"] == 5 and row["policies"]["tenplex"]["latency"] > 0
    assert row["model"].startswith("gpt L4") and row["kind"] == "offer"
    assert main([*args[:-6], "--restart-seconds", "orbax=3"]) == 2
    assert main(["simulate", "--cluster", str(cluster), "--layers", "4"]) == 2
    assert main(["simulate", "--cluster", str(cluster), "--model", "tiny"]) == 2  # no trace
    # the stores' rates and the host work reach the model; a failure is charged its detection
    fail = [*args[:15], "--from", "tensor=4,pipe=2,data=2", "--to", "tensor=4,pipe=2,data=1"]
    fail += ["--kind", "fail", "--detect-seconds", "15", "--shard-seconds", "0.001", "--json"]
    assert main(fail) == 0
    plain = json.loads(capsys.readouterr().out)["policies"]["tenplex"]
    assert plain["detect"] == 15
    assert main([*fail, "--store-get-bandwidth", "1e6", "--store-put-bandwidth", "1e6"]) == 0
    rated = json.loads(capsys.readouterr().out)["policies"]["tenplex"]
    assert rated["transfer"] > plain["transfer"] and rated["bottleneck"].startswith("store node")
    assert main([*fail, "--store-get-bandwidth", "0"]) == 2


def test_the_cli_generates_failures_from_an_mttf(tmp_path, capsys):
    cluster = tmp_path / "c.toml"
    cluster.write_text(CLUSTER)
    args = ["simulate", "--cluster", str(cluster), "--model", "small", "--batch", "32"]
    args += ["--mttf-hours", "0.5", "--mttf-devices", "16", "--minutes", "240", "--seed", "2"]
    assert main([*args, "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    kinds = {r["kind"] for r in result["events"]}
    assert "fail" in kinds and result["checkpoint"]["rule"] == "young-daly"
    assert result["costs"]["mttf_hours"] == 0.5 and "assumptions" in result
    assert main([*args, "--checkpoint-minutes", "5", "--out", str(tmp_path / "o")]) == 0
    assert "checkpoint every 5.0 min" in capsys.readouterr().out
    assert (tmp_path / "o" / "simulate.png").stat().st_size > 0


def test_every_flag_is_in_the_help(capsys):
    assert main(["simulate", "--help"]) == 0
    text = capsys.readouterr().out
    for flag in (
        "--from",
        "--to",
        "--kind",
        "--layers",
        "--d-model",
        "--heads",
        "--vocab",
        "--seq-len",
        "--latency-seconds",
        "--piece-seconds",
        "--shard-seconds",
        "--leaf-seconds",
        "--run-seconds",
        "--detect-seconds",
        "--store-get-bandwidth",
        "--store-put-bandwidth",
        "--restart-seconds",
        "--compile-seconds",
        "--executable-cache",
        "--no-compile-ahead",
        "--trace-checkpoints",
        "--mttf-hours",
        "--mttf-devices",
        "--repair-minutes",
        "--seed",
        "--minutes",
        "gpt3-6.7b",
    ):
        assert flag in text, flag
