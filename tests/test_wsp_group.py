"""A virtual worker whose devices span processes (HetPipe's equal grouping: a VW over nodes): its
processes run one SPMD program in a ``jax.distributed`` job of their own, the leader decides for
all of them; the same weights as the VW in one process, and its death, from any of its processes,
touches no other VW."""

from __future__ import annotations

import json
import pickle

import numpy as np
import pytest

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.multihost.processes import kill
from tenplex_jax._src.wsp.group import _dumps, _loads
from tenplex_jax.wsp import Coordinator, Group, ParameterServer, Processes, weights_of
from tenplex_jax_models import wsp as job_parts


def test_a_group_of_one_decides_alone_and_raises_what_it_raised():
    group = Group()
    assert group.leader and group.agree(lambda: 7) == 7 and group.decisions == 0
    with pytest.raises(WSPError, match="dropped") as raised:
        group.agree(lambda: (_ for _ in ()).throw(WSPError("dropped", "dropped")))
    assert raised.value.reason == "dropped"
    assert group.replicated(arrays := [np.ones(2)], mesh=None) == arrays  # nothing to gather


def test_a_decisions_arrays_travel_beside_it_and_come_back_in_place():
    weights = {"model/w": np.arange(600, dtype=np.float32).reshape(20, 30), "model/b": np.ones(3)}
    arrays: list = []
    payload = _dumps(("ledger", 3, weights), arrays)
    assert [a.shape for a in arrays] == [(20, 30), (3,)]  # by reference, not in the pickle
    assert len(payload) < 200  # the arrays' 2424 bytes are not in it
    copies = [np.array(a) for a in arrays]  # what a follower's broadcast gives
    name, clock, got = _loads(payload, copies)
    assert (name, clock) == ("ledger", 3) and got.keys() == weights.keys()
    for path in weights:
        np.testing.assert_array_equal(got[path], weights[path])
    error = pickle.loads(pickle.dumps(WSPError("vw1 was dropped", "dropped")))
    assert error.reason == "dropped"  # a leader's error reaches a follower whole


def _run(addresses, tmp_path, devices, node_devices, total=8):
    """One VW on ``devices`` (its processes by ``node_devices``), pipelined (4 devices: two stages,
    each data parallel) with AdamW; the parameter server's weights and the ledger after."""
    parts = job_parts.job(len(devices))
    with ParameterServer(addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=total)
        runner = Processes(
            "tenplex_jax_models.wsp:job",
            addresses,
            tmp_path,
            options=["--minibatches", "2", "--distance", "0", "--timeout", "5"],
            node_devices=node_devices,
        )
        with Coordinator(ps, runner) as coordinator:
            coordinator.add(devices)
            handle = coordinator.members["vw1"].handle
            coordinator.wait(timeout=240)
            records = coordinator.records()
        return ps.pull(), ps.history(), handle, records


@pytest.mark.slow
def test_a_vw_over_two_processes_trains_the_weights_it_trains_in_one(stores, tmp_path):
    devices = [0, 1, 2, 3]  # pipe=2 over data=2: its stages' collectives cross the processes
    addresses = [stores.start(f"two{i}").address for i in range(2)]
    split, ledger, handle, records = _run(addresses, tmp_path / "two", devices, 2)
    assert len(handle) == 2 and [p.returncode for p in handle] == [0, 0]
    assert ledger.done and sorted(ledger.trained()) == list(range(8))
    assert [r["minibatches"] for r in records] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert all(r["idle_ticks"] == 1 for r in records)  # one pipeline fill per wave
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


@pytest.mark.slow
def test_a_vws_follower_killed_ends_its_vw_and_the_others_train_its_minibatches(stores, tmp_path):
    store_addresses = [stores.start(f"s{i}").address for i in range(2)]
    total = 32
    parts = job_parts.job(1)
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=total)
        runner = Processes(
            "tenplex_jax_models.wsp:job",
            store_addresses,
            tmp_path,
            # slowdown 3: a wave holds its lease twice its compute longer, so the kill lands
            # mid-wave
            options=["--minibatches", "1", "--distance", "1", "--timeout", "3", "--slowdown", "3"],
            node_devices=1,
        )
        with Coordinator(ps, runner) as coordinator:
            coordinator.add([0, 1], [2])  # vw1 over two processes (nodes 0 and 1), vw2 in one
            leader, follower = coordinator.members["vw1"].handle
            ledger = ps.ledger()
            while not (ledger.committed.get("vw1", 0) >= 1 and "vw1" in ledger.leases):
                assert not ledger.done, f"vw1 never held a lease after a push: {ledger}"
                ledger = ps.wait(1.0)
            leased = ledger.leases["vw1"].minibatches
            kill(follower)
            # the runner ends the VW whole: its leader would wait for the follower for ever,
            # heartbeating
            assert leader.wait(30) == -9
            coordinator.wait(timeout=240)
            ledger = ps.history()
    assert ledger.done and "vw1" in ledger.dropped
    assert sorted(ledger.trained()) == list(range(total))  # exactly once, after the death
    by = {m: vw for vw, _, ms in ledger.log for m in ms}
    assert {by[m] for m in leased} == {"vw2"}  # the dead VW's lease, trained by the other
