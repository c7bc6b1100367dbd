"""A virtual worker whose devices span processes (HetPipe's equal grouping: a VW over nodes): its
processes run one SPMD program in a ``jax.distributed`` job of their own, the leader decides for
all of them; the same weights as the VW in one process, and its death, from any of its processes,
touches no other VW."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from tenplex_jax._src import tree
from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.multihost.processes import kill
from tenplex_jax._src.wsp import optimizer
from tenplex_jax._src.wsp.group import _dumps, _loads
from tenplex_jax.wsp import Coordinator, Group, ParameterServer, Processes, weights_of
from tenplex_jax_models import wsp as job_parts
from tests.helpers import TWO_BY_TWO
from tests.wsp.wsp_jobs import tails


def test_a_group_of_one_decides_alone_and_raises_what_it_raised():
    group = Group()
    assert group.leader and group.agree(lambda: 7) == 7 and group.decisions == 0
    with pytest.raises(WSPError, match="dropped") as raised:
        group.agree(lambda: (_ for _ in ()).throw(WSPError("dropped", "dropped")))
    assert raised.value.reason == "dropped"
    assert group.replicated(arrays := [np.ones(2)], mesh=None) == arrays  # nothing to gather


def test_a_decisions_arrays_travel_beside_it_and_come_back_in_place():
    weights = {
        "model/w": np.arange(600, dtype=np.float32).reshape(20, 30),
        "optimizer/step": np.array(3, np.uint32),  # a scalar stays one
    }
    arrays: list = []
    payload = _dumps(("ledger", 3, weights), arrays)
    assert [a.shape for a in arrays] == [(20, 30), ()]  # by reference, not in the pickle
    assert len(payload) < 200  # the arrays' 2404 bytes are not in it
    copies = [np.array(a) for a in arrays]  # what a follower's broadcast gives
    name, clock, got = _loads(payload, copies)
    assert (name, clock) == ("ledger", 3) and got.keys() == weights.keys()
    for path in weights:
        assert got[path].shape == weights[path].shape and got[path].dtype == weights[path].dtype
        np.testing.assert_array_equal(got[path], weights[path])
    error = pickle.loads(pickle.dumps(WSPError("vw1 was dropped", "dropped")))
    assert error.reason == "dropped"  # a leader's error reaches a follower whole


def _run(addresses, tmp_path, devices, nodes, executables=None, total=8):
    """One VW on ``devices`` (a process per node of theirs, ``nodes``), pipelined (4 devices: two
    stages, each data parallel) with AdamW, its programs in ``executables`` if given; the
    parameter server's weights and the ledger after."""
    parts = job_parts.job(len(devices))
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=total)
        runner = Processes(
            "tenplex_jax_models.wsp:job",
            addresses,
            tmp_path,
            options=["--minibatches", "2", "--distance", "0", "--timeout", "5"],
            nodes=nodes,
            executables=executables,
        )
        with Coordinator(ps, runner) as coordinator:
            coordinator.add(devices)
            handle = coordinator.members["vw1"].handle
            coordinator.wait(timeout=240)
            records = coordinator.records()
        return ps.pull(), ps.history(), handle, records


def test_a_vw_over_two_processes_trains_the_weights_it_trains_in_one(stores, tmp_path):
    devices = [0, 1, 2, 3]  # pipe=2 over data=2: its stages' collectives cross the processes
    addresses = [stores.start(f"two{i}").address for i in range(2)]
    # its wave program compiled for the executable cache (every output laid out on the mesh)
    # in two processes, against the plain jitted one in one
    executables = tmp_path / "executables"
    split, ledger, handle, records = _run(
        addresses, tmp_path / "two", devices, [0, 0, 1, 1], executables
    )
    assert len(list(executables.glob("*.xla"))) == 1  # stored, the two processes' one program
    assert len(handle) == 2 and [p.returncode for p in handle] == [0, 0]
    assert ledger.done and sorted(ledger.trained()) == list(range(8))
    assert [r.minibatches for r in records] == [(0, 1), (2, 3), (4, 5), (6, 7)]
    assert all(r.idle_ticks == 1 for r in records)  # one pipeline fill per wave
    # the follower decided nothing and wrote nothing; its program was the leader's
    assert not (tmp_path / "two" / "vw1.1.jsonl").exists()
    assert json.loads((tmp_path / "two" / "vw1.jsonl").read_text().splitlines()[0])["vw"] == "vw1"

    addresses = [stores.start(f"one{i}").address for i in range(2)]  # the same job, in one
    whole, _, handle, _ = _run(addresses, tmp_path / "one", devices, None)
    assert len(handle) == 1
    initial = weights_of(job_parts.job(4)["init"]())
    assert max(np.abs(whole[p] - initial[p]).max() for p in whole) > 1e-3  # it trained
    for path in whole:
        np.testing.assert_allclose(split[path], whole[path], rtol=1e-6, atol=1e-7, err_msg=path)


def test_a_vw_over_two_processes_takes_a_shared_optimizer_and_dies_whole_with_a_follower(
    stores, tmp_path
):
    store_addresses = [stores.start(f"s{i}").address for i in range(2)]
    total = 32
    parts = job_parts.job(1)
    state = parts["init"]()
    paths, leaves, _ = tree.arrays(state)
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(state), total=total)
        # an AdamW state shared before anyone joined (as a VW that left shares it): every
        # joiner takes it; vw1's leader hands it, scalar step counts too, to its follower
        moments = {p: np.asarray(x) for p, x in zip(paths, leaves) if not p.startswith("model/")}
        optimizer.share(ps, "vw0", 0, moments)
        runner = Processes(
            "tenplex_jax_models.wsp:job",
            store_addresses,
            tmp_path,
            # slowdown 5: a wave holds its lease four times its compute longer, so the kill
            # mostly lands mid-wave
            options=["--minibatches", "1", "--distance", "1", "--timeout", "3", "--slowdown", "5"],
            nodes=[0, 1, 2],
        )
        with Coordinator(ps, runner) as coordinator:
            coordinator.add([0, 1])  # vw1 over two processes (nodes 0 and 1)
            leader, follower = coordinator.members["vw1"].handle
            ledger = ps.ledger()
            while "vw1" not in ledger.clocks:  # vw2, in one process, would start far sooner
                assert leader.poll() is None, f"vw1 ended before it joined: {tails(tmp_path)}"
                ledger = ps.wait(1.0)
            coordinator.add([2])  # vw2
            while not (ledger.committed.get("vw1", 0) >= 1 and "vw1" in ledger.leases):
                assert not ledger.done, f"vw1 never held a lease after a push: {tails(tmp_path)}"
                ledger = ps.wait(1.0)
            leased, committed = ledger.leases["vw1"].minibatches, ledger.committed["vw1"]
            kill(follower)
            # the VW ends whole: the runner kills its leader (which would wait in a collective
            # for the follower for ever, heartbeating), unless the leader's collective failed
            # first and it exited at once
            assert leader.wait(30) not in (0, 3)  # failed, not left: it never leaves the ledger
            coordinator.wait(timeout=240)
            ledger = ps.history()
            # the follower's death is a failure to the runner (a leader that left by itself,
            # racing the runner's kill, may be one too); no other VW's process failed
            assert ("vw1", "process 1 was killed by SIGKILL") in runner.errors
            assert {vw for vw, _ in runner.errors} == {"vw1"}
    assert ledger.done and "vw1" in ledger.dropped
    assert sorted(ledger.trained()) == list(range(total))  # exactly once, after the death
    # the other VW trained on and finished the run, the dead VW's lease with it (what of it
    # had not been committed when the kill landed: under load a push may beat the kill)
    assert ledger.log[-1][0] == "vw2"
    by = {m: vw for vw, _, ms in ledger.log for m in ms}
    assert {by[m] for m in leased} <= {"vw2"} or ledger.committed["vw1"] > committed


def test_the_planned_demo_runs_each_vw_of_its_equal_grouping_in_a_process_per_node(tmp_path):
    from tenplex_jax._src.cli import wsp as wsp_demo

    cluster = tmp_path / "two-by-two.toml"
    cluster.write_text(TWO_BY_TWO)
    out = tmp_path / "out"
    options = wsp_demo.WSPOptions(
        out=out, steps=24, cluster=cluster, processes=True, grouping="equal"
    )
    summary = wsp_demo.run(options, log=lambda *a: None)
    assert summary.exactly_once and summary.samples_exactly_once and summary.weights_finite
    built = {v.name: v for v in summary.virtual_workers}
    # HetPipe's equal grouping: each VW a fast device of node 0 and a slow one of node 1, the
    # fast one's stage first with 12 of the 16 layers (padded to 12 + 12 rows); Nm = 2, one
    # minibatch in flight per stage; vw2 fails at 30 % and vw3 joins on its devices at 50 %
    assert [(built[n].devices, built[n].stages, built[n].nm) for n in sorted(built)] == [
        ((0, 2), (12, 4), 2),
        ((1, 3), (12, 4), 2),
        ((1, 3), (12, 4), 2),
    ]
    assert summary.distance == 1 and summary.dropped == ("vw2",)
    # the joiner started (whether it trains before the run ends is its compile's race)
    assert [(e.kind, e.vw) for e in summary.events][-2:] == [("kill", "vw2"), ("add", "vw3")]
    for name in built:  # two processes each, the leader's log and the follower's
        assert (out / "vws" / f"{name}.log").exists() and (out / "vws" / f"{name}.1.log").exists()
        assert not (out / "vws" / f"{name}.1.jsonl").exists()
    # the joiner's two processes loaded the programs the VW they replace compiled: none compiled
    for log in ("vw3.log", "vw3.1.log"):
        assert "executables: 1 loaded, 0 compiled" in (out / "vws" / log).read_text(), log
    for m in summary.minibatches:  # HetPipe's bounds: local staleness < Nm, global <= D
        assert 0 <= m.local_staleness < 2 and 0 <= m.global_staleness <= 1, m
    assert 1 in {m.local_staleness for m in summary.minibatches}  # minibatches in flight
    assert summary.last_losses and np.mean(summary.last_losses) < summary.first_loss
