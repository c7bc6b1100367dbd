"""Re-planning a live job of virtual workers when its cluster changes: the coordinator plans the
VWs of the new devices (``Nm`` by their speed), applies the plan at a wave boundary, and the job
trains every minibatch exactly once, in the dataset's order, on a parameter server on 127.0.0.1."""

from __future__ import annotations

import jax
import pytest

import tenplex_jax as tj
from tenplex_jax._src.wsp.replan import planner_for
from tenplex_jax.elastic import ResourceTrace
from tenplex_jax.errors import PlanError, WSPError
from tenplex_jax.wsp import Coordinator, ParameterServer, Threads, VWEventKind, weights_of
from tenplex_jax_models import profile_of
from tenplex_jax_models import wsp as job_parts

TOTAL = 48
# a fast node (devices 0, 1) and a node 2.5x slower (2, 3): together, the fast VW runs Nm = 2
CLUSTER = tj.planner.Cluster.from_dict(
    {
        "name": "two-speeds",
        "network_gbps": 10,
        "types": {
            "fast": {"memory_gib": 16, "tflops": 2.0, "link_gbps": 50},
            "slow": {"memory_gib": 16, "tflops": 0.8, "link_gbps": 50},
        },
        "nodes": [{"type": "fast", "count": 2}, {"type": "slow", "count": 2}],
    }
)


def _until(ps, trained: int):
    ledger = ps.ledger()
    while ledger.trained_count < trained and not ledger.done:
        ledger = ps.wait(5.0)  # answered at the next commit
    return ledger


@pytest.fixture
def job(stores):
    addresses = [stores.start(f"s{i}").address for i in range(2)]
    parts = job_parts.job(2)
    state = parts["init"]()
    steps = job_parts.step_cache(parts, jax.devices())
    return addresses, parts, state, steps


def _coordinator(ps, addresses, parts, state, steps, planner) -> Coordinator:
    def make(name, devices):  # each VW as its plan says
        plan = coordinator.plan_of(devices)
        assert str(plan.candidate.config) == str(parts["config"])  # the job's layout: data=2
        return job_parts.virtual_worker(
            parts,
            name,
            devices,
            addresses,
            state,
            minibatches=plan.minibatches,
            distance=1,
            timeout=3.0,
            steps=steps,
        )

    coordinator = Coordinator(ps, Threads(make), planner=planner)
    return coordinator


def test_a_cluster_change_replans_the_running_vws_at_a_wave_boundary_losing_no_minibatch(job):
    addresses, parts, state, steps = job
    planner = planner_for(CLUSTER, profile_of("tiny"), 8, groupings=("node",))
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(state), total=TOTAL)
        with _coordinator(ps, addresses, parts, state, steps, planner) as coordinator:
            first = coordinator.replan([0, 1])  # one VW: Nm 1
            _until(ps, 6)
            grown = coordinator.replan([0, 1, 2, 3])  # the fast VW re-planned to Nm 2
            _until(ps, 20)
            shrunk = coordinator.replan([0, 1])  # the slow node gone: back to one VW, Nm 1
            coordinator.wait(timeout=240)
        assert not coordinator.runner.errors
        ledger = ps.history()
    assert (first.stopped, first.started) == ((), ("vw1",))
    assert (grown.kept, grown.stopped, grown.started) == ((), ("vw1",), ("vw2", "vw3"))
    assert [coordinator.gone["vw1"].devices, coordinator.gone["vw2"].devices] == [(0, 1)] * 2
    assert {w.minibatches for w in grown.plan.workers if w.devices == (0, 1)} == {2}
    assert (shrunk.stopped, shrunk.started) == (("vw2", "vw3"), ("vw4",))
    # no minibatch lost or trained twice, and each wave trained its minibatches' samples
    assert ledger.done and sorted(ledger.trained()) == list(range(TOTAL))
    records = coordinator.records()
    layout = tj.data.BatchLayout(8, ranks=2)
    for record in records:
        expect = [parts["dataset"].samples(k, layout)[0] for k in record.minibatches]
        assert list(record.samples) == [int(s) for rows in expect for s in rows if s >= 0]
    nm = {"vw1": 1, "vw2": 2, "vw3": 1, "vw4": 1}
    by_vw = {vw: [r for r in records if r.vw == vw] for vw in nm}
    for vw, waves in by_vw.items():  # each ran its plan's Nm, and every wave it claimed pushed
        assert waves and all(len(r.minibatches) <= nm[vw] for r in waves)
    assert any(len(r.minibatches) == 2 for r in by_vw["vw2"])
    for replanned in (grown, shrunk):  # each left at a wave boundary: all its waves committed
        for vw, clock in replanned.clocks.items():
            assert [r.wave for r in by_vw[vw]] == list(range(clock)) and vw in ledger.left
    assert [e.kind for e in coordinator.events].count(VWEventKind.REPLAN) == 3


def test_a_trace_replans_on_offers_and_preemptions(job):
    addresses, parts, state, steps = job
    planner = planner_for(CLUSTER, profile_of("tiny"), 8, groupings=("node",))
    trace = ResourceTrace.from_dict(
        {
            "devices": 4,
            "steps": TOTAL,
            "events": [
                {"step": 4, "kind": "offer", "devices": [2, 3]},
                {"step": 16, "kind": "preempt", "devices": [2, 3]},
            ],
        }
    )
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(state), total=TOTAL)
        with _coordinator(ps, addresses, parts, state, steps, planner) as coordinator:
            coordinator.replan([0, 1])
            coordinator.follow(trace, group=2, timeout=240)
            coordinator.wait(timeout=240)
        assert not coordinator.runner.errors
        ledger = ps.history()
    assert ledger.done and sorted(ledger.trained()) == list(range(TOTAL))
    assert [r.devices for r in coordinator.replans] == [(0, 1), (0, 1, 2, 3), (0, 1)]
    assert [len(r.plan.workers) for r in coordinator.replans] == [1, 2, 1]


def test_a_replan_without_a_planner_or_a_fitting_plan_changes_nothing(job):
    addresses, _, state, _ = job
    refuse = lambda devices: (_ for _ in ()).throw(PlanError("no layout fits"))
    outside = planner_for(CLUSTER, profile_of("tiny"), 8, groupings=("node",))
    wrong = lambda devices: outside([0, 1, 2, 3])  # a plan over devices it was not given
    nothing = Threads(lambda name, devices: None)
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(state), total=TOTAL)
        bare, refusing, outside_plan = (
            Coordinator(ps, nothing, planner=p) for p in (None, refuse, wrong)
        )
        with pytest.raises(WSPError, match="needs the coordinator's planner"):
            bare.replan([0, 1])
        with pytest.raises(PlanError, match="no layout fits"):
            refusing.replan([0, 1])
        with pytest.raises(WSPError, match=r"planned for \[0, 1\], its VWs use \[0, 1, 2, 3\]"):
            outside_plan.replan([0, 1])
        for coordinator in (bare, refusing, outside_plan):
            assert not coordinator.members and not coordinator.replans and not coordinator.events
