"""Virtual workers with wave synchronous parallel, for real: threads on the 8 fake CPU devices and
processes of their own, a parameter server on tensor store processes on 127.0.0.1, the reference
GPT; D = 0 against the synchronous step it equals, a SIGKILLed VW process mid-wave, the demo's
death and join, the planner."""

from __future__ import annotations

import json
import os
import pathlib
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tenplex_jax._src import tree
from tenplex_jax._src.cli import main
from tenplex_jax.errors import WSPError
from tenplex_jax.wsp import (
    Coordinator,
    ParameterServer,
    Processes,
    Threads,
    plan_workers,
    weights_of,
)
from tenplex_jax_models import build_state, example_losses
from tenplex_jax_models import wsp as job_parts
from tests.helpers import TWO_BY_TWO, Stores

ROOT = pathlib.Path(__file__).resolve().parents[2]


@pytest.fixture
def store_addresses(tmp_path):
    started = Stores(tmp_path)
    try:
        yield [started.start(f"s{i}").address for i in range(2)]
    finally:
        started.reap()


def test_d0_with_one_minibatch_and_sgd_is_synchronous_sgd_on_the_summed_gradients(store_addresses):
    lr, waves = 0.05, 3
    parts = job_parts.job(1, optimizer="sgd", lr=lr)
    graphdef, state, _ = build_state("tiny", lr, optimizer="sgd")  # what parts["init"] builds
    initial = weights_of(state)
    with ParameterServer(store_addresses) as ps:
        ps.create(initial, total=2 * waves)

        def make(name, devices):
            return job_parts.virtual_worker(
                parts, name, devices, store_addresses, state, distance=0
            )

        with Coordinator(ps, Threads(make)) as coordinator:
            coordinator.add([0], [5])
            coordinator.wait(timeout=300)
        assert not coordinator.runner.errors
        ledger = ps.ledger()
        got = ps.pull(ledger)
    records = coordinator.records()
    # D = 0: every wave starts from the weights holding every VW's previous waves, and wave k
    # trains minibatches 2k and 2k + 1 (one on each VW, whichever claims first)
    assert all(r["wave"] == r["slowest"] for r in records)
    assert sorted(
        tuple(sorted(m for r in records if r["wave"] == k for m in r["minibatches"]))
        for k in range(waves)
    ) == [(2 * k, 2 * k + 1) for k in range(waves)]
    # the synchronous equivalent: w <- w - lr * (g(2k) + g(2k + 1)), both at the same w
    model = nnx.merge(graphdef, state)["model"]
    dataset = parts["dataset"]
    grad = nnx.jit(nnx.grad(lambda m, b: jnp.mean(example_losses(m, b))))
    for k in range(waves):
        g = [grad(model, dataset.read(dataset.indices(m)[0])) for m in (2 * k, 2 * k + 1)]
        params = nnx.state(model, nnx.Param)
        nnx.update(model, jax.tree.map(lambda p, a, b: p - lr * (a + b), params, g[0], g[1]))
    want = {f"model/{p}": np.asarray(v) for p, v in _flat(nnx.state(model, nnx.Param)).items()}
    assert set(want) == set(got)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=2e-5, atol=2e-6, err_msg=path)
    assert max(np.abs(got[p] - initial[p]).max() for p in got) > 1e-3  # training moved them


def _flat(state) -> dict:
    paths, leaves, _ = tree.arrays(state)
    return dict(zip(paths, leaves))


def test_a_sigkilled_vw_process_is_dropped_and_its_minibatches_trained_by_others(
    store_addresses, tmp_path
):
    total = 48
    parts = job_parts.job(1)
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=total)
        # slowdown 4: each wave holds its lease three times its compute longer, so the SIGKILL
        # below lands mid-wave (before the push), not after a push it raced
        runner = Processes(
            "tenplex_jax_models.wsp:job",
            store_addresses,
            tmp_path / "run",
            options=["--minibatches", "2", "--distance", "1", "--timeout", "3", "--slowdown", "4"],
        )
        with Coordinator(ps, runner) as coordinator:  # every process reaped, whatever happens
            coordinator.add([0], [1], [2, 3])
            # the VWs join together, once all are built; which one is first caught mid-wave (it
            # has pushed a wave and holds the next one's lease) depends on the machine's load
            deadline, victim, ledger = time.monotonic() + 240, None, ps.ledger()
            while victim is None and not ledger.done and time.monotonic() < deadline:
                ledger = ps.wait(1.0)  # the next change of the ledger
                victim = next(
                    (
                        vw
                        for vw in sorted(ledger.leases)
                        if ledger.committed.get(vw, 0) >= 1 and set(ledger.clocks) - {vw}
                    ),
                    None,
                )
            assert victim, f"no VW was caught mid-wave beside another: {ledger}"
            leased = ledger.leases[victim].minibatches
            coordinator.kill(victim)
            killed = time.time()
            coordinator.wait(timeout=240)
            ledger = ps.history()
    others = {"vw1", "vw2", "vw3"} - {victim}
    assert ledger.done and victim in ledger.dropped
    assert sorted(ledger.trained()) == list(range(total))  # exactly once, after the death
    by = {m: vw for vw, _, ms in ledger.log for m in ms}
    assert all(by[m] in others for m in leased)  # the dead VW's lease, trained by others
    records = coordinator.records()
    assert {r["vw"] for r in records if r["started"] > killed} <= others
    assert [r for r in records if r["started"] > killed]  # the others went on
    assert not [r for r in records if r["vw"] == victim and set(r["minibatches"]) & set(leased)]


class _Building(Threads):
    """VWs as threads whose last one stays building (its thread never starts), as a VW in
    processes does while it compiles."""

    def launch(self, *handles) -> None:
        super().launch(*(h for h in handles if h[1].name != "vw3"))

    def alive(self, handle) -> bool:
        return handle[1].name == "vw3" or super().alive(handle)

    def wait(self, handle, timeout: float) -> None:
        if handle[1].name != "vw3":  # a thread never started cannot be joined
            super().wait(handle, timeout)


def test_vws_added_together_in_processes_join_together_whatever_their_builds_take(
    store_addresses, tmp_path, monkeypatch
):
    # vw2 builds 3 s longer than vw1 and vw3 fails while it builds: vw1 is held until vw2 is
    # built (it does not train alone meanwhile), and vw3's failure holds nobody
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]  # (as tests/tools/test_cli.py's _demo)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
    own = {"vw2": ["--option", "build_seconds=3"], "vw3": ["--option", "fail=true"]}
    parts = job_parts.job(1)
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(parts["init"]()), total=4)
        runner = Processes(
            "tests.wsp.wsp_jobs:job",
            store_addresses,
            tmp_path / "run",
            options=["--distance", "1", "--timeout", "5"],
            options_for=lambda name, devices: own.get(name, []),
        )
        with Coordinator(ps, runner) as coordinator:
            coordinator.add([0], [1], [2])
            deadline, ledger = time.monotonic() + 240, ps.ledger()
            while not ledger.clocks:
                assert time.monotonic() < deadline and not ledger.done
                ledger = ps.wait(1.0)
            # the first VW in the ledger joined after vw2 had said it was built
            assert "built in" in (tmp_path / "run" / "vw2.log").read_text()
            coordinator.wait(timeout=240)
            ledger = ps.history()
    assert [name for name, _ in runner.errors] == ["vw3"]
    assert "as the test asked" in (tmp_path / "run" / "vw3.log").read_text()
    assert ledger.done and sorted(ledger.trained()) == list(range(4))
    assert set(ledger.left) == {"vw1", "vw2"} and not ledger.dropped


def test_an_add_with_a_group_the_runner_refuses_starts_none_of_its_vws(store_addresses, tmp_path):
    # nodes 0, 0, 1, 1: [0, 1, 2] has two devices on node 0 and one on node 1
    with ParameterServer(store_addresses) as ps:
        ps.create({"w": np.zeros(4, np.float32)}, total=4)
        runner = Processes(
            "tenplex_jax_models.wsp:job", store_addresses, tmp_path, nodes=[0, 0, 1, 1]
        )
        with Coordinator(ps, runner) as coordinator:
            with pytest.raises(WSPError, match=r"unequal numbers of devices.*\{0: 2, 1: 1\}"):
                coordinator.add([3], [0, 1, 2])
            assert not coordinator.members and not coordinator.events
            (started,) = runner.started["vw1"]  # vw1 started, then was killed: it never joined
            assert started.poll() is not None and started.pid in runner.ended
            assert not runner._built and not ps.ledger().clocks


def test_the_demo_s_proof_takes_a_killed_vw_s_commit_without_its_record():
    # vw2 is SIGKILLed after its commit, before its record is written, and the run ends before
    # anyone waits for it (so it is never dropped): its commit has no record, rightly; vw1's
    # would be a lost record
    from tenplex_jax._src.cli import wsp as wsp_demo
    from tenplex_jax._src.wsp.ledger import Ledger

    ledger = Ledger(total=2).join("vw1").join("vw2")
    for vw in ("vw1", "vw2"):
        ledger, _ = ledger.claim(vw, 0, 1)
        ledger = ledger.commit(vw, 0)
    ledger = ledger.leave("vw1")
    record = {"vw": "vw1", "wave": 0, "minibatches": [0], "pulled": False, "idle_ticks": 0}
    record |= {"slowest": 0, "local_versions": [0], "losses": [1.0], "started": 0.0}
    record |= {"local_staleness": [0], "global_staleness": [0]}
    record |= dict.fromkeys(wsp_demo.SECONDS, 0.0)
    options = wsp_demo.WSPOptions(total=2)
    parts = {"dataset": job_parts.job(1)["dataset"]}
    kill = {"event": "kill", "vw": "vw2", "time": 1.0}

    def proof(records, events) -> bool:
        return wsp_demo.summarize(options, ledger, records, events, 1.0, parts)["exactly_once"]

    assert proof([record], [kill])
    assert not proof([record], [])  # a commit without a record by a VW never killed
    assert not proof([], [kill])  # vw1's record lost
    assert not proof([record, record], [kill])  # a wave recorded twice


def test_wait_joined_returns_once_every_added_vw_is_a_member(store_addresses):
    parts = job_parts.job(1)
    state = parts["init"]()
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(state), total=10_000)  # far from done while the test looks

        def make(name, devices):
            return job_parts.virtual_worker(parts, name, devices, store_addresses, state)

        with Coordinator(ps, _Building(make)) as coordinator:
            coordinator.add([0], [1])
            coordinator.wait_joined(timeout=120)
            assert {"vw1", "vw2"} <= set(ps.ledger().clocks)
            coordinator.add([2])  # still building when the wait gives up
            with pytest.raises(WSPError, match=r"\['vw3'\] did not join") as error:
                coordinator.wait_joined(timeout=1.0)
            assert error.value.reason == "busy"
            coordinator.remove("vw3")  # no longer running: not waited for
            coordinator.wait_joined(timeout=1.0)
            coordinator.stop(timeout=120)


def test_the_demo_survives_a_death_and_a_join_exactly_once(tmp_path):
    assert main(["demo", "--wsp", "--steps", "96", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exactly_once"] and summary["samples_exactly_once"]
    assert summary["dropped"] == ["vw2"] and summary["weights_finite"]
    kinds = [(e["event"], e["vw"]) for e in summary["events"]]
    assert kinds[-2:] == [("kill", "vw2"), ("add", "vw4")]
    per = summary["per_vw"]
    assert per["vw4"]["waves"] >= 1  # the joiner trained
    assert all(v["max_lead"] <= summary["distance"] for v in per.values())  # WSP's bound
    assert per["vw1"]["minibatches"] > per["vw3"]["minibatches"]  # Nm in proportion to speed
    # pushes run beside the compute, which waits for at most their time
    assert all(0 <= v["push_wait_seconds"] <= v["push_seconds"] for v in per.values())
    # vw1's two stages run each wave as one pipeline: they wait one tick per wave, not per
    # minibatch; the data-parallel VWs have no pipeline
    assert per["vw1"]["idle_ticks"] == per["vw1"]["waves"] < per["vw1"]["minibatches"]
    assert per["vw3"]["idle_ticks"] == 0
    built = {v["name"]: v for v in summary["virtual_workers"]}
    assert [(built[n]["devices"], built[n]["stages"], built[n]["nm"]) for n in sorted(built)] == [
        ([0, 1, 2, 3], 2, 4),
        ([4, 5], 1, 2),
        ([6, 7], 1, 1),
        ([4, 5], 1, 2),  # the joiner
    ]
    minibatches = summary["minibatches"]
    assert sorted(m["index"] for m in minibatches) == list(range(summary["total"]))
    for m in minibatches:  # HetPipe's bounds: local staleness < Nm, global staleness <= D
        assert 0 <= m["local_staleness"] < built[m["vw"]]["nm"], m
        assert 0 <= m["global_staleness"] <= summary["distance"], m
    vw1 = [m["local_staleness"] for m in minibatches if m["vw"] == "vw1"]
    # Nm - 1 once its pipeline is full (its last wave may be short: the run's last minibatches)
    assert vw1[:4] == [0, 1, 2, 3] and set(vw1[4:-4]) == {3}
    assert summary["last_losses"] and np.mean(summary["last_losses"]) < summary["first_loss"]
    assert (tmp_path / "loss.png").stat().st_size > 0


def test_the_planner_builds_the_demo_s_vws_with_uneven_stages_and_nm_in_flight(tmp_path):
    cluster = tmp_path / "two-by-two.toml"
    cluster.write_text(TWO_BY_TWO)
    out = tmp_path / "out"
    assert (
        main(["demo", "--wsp", "--cluster", str(cluster), "--steps", "24", "--out", str(out)]) == 0
    )
    summary = json.loads((out / "summary.json").read_text())
    assert summary["exactly_once"] and summary["samples_exactly_once"] and summary["weights_finite"]
    built = {v["name"]: v for v in summary["virtual_workers"]}
    # HetPipe's equal grouping: a fast and a slow device per VW, the fast one's stage first with
    # 12 of the 16 layers (padded to 12 + 12 rows); Nm = 2, one minibatch in flight per stage
    expected = [([0, 2], [12, 4], 2), ([1, 3], [12, 4], 2), ([1, 3], [12, 4], 2)]  # + the joiner
    got = [
        (built[n]["devices"], built[n]["layers_per_stage"], built[n]["nm"]) for n in sorted(built)
    ]
    assert got == expected and summary["distance"] == 1
    assert [(e["event"], e["vw"]) for e in summary["events"]][-2:] == [
        ("kill", "vw2"),
        ("add", "vw3"),
    ]
    for m in summary["minibatches"]:
        assert 0 <= m["local_staleness"] < 2 and 0 <= m["global_staleness"] <= 1, m
    assert 1 in {m["local_staleness"] for m in summary["minibatches"]}  # minibatches in flight
    assert summary["last_losses"] and np.mean(summary["last_losses"]) < summary["first_loss"]


def test_nm_is_what_memory_holds_in_flight_weight_versions_and_layer_inputs():
    from tenplex_jax._src.planner.search import Candidate
    from tenplex_jax._src.wsp.planner import _minibatches, in_flight_limit

    layer = tj.planner.LayerProfile(1e9, param_bytes=100_000_000, act_bytes=0, out_bytes=10**7)
    model = tj.planner.ModelProfile("m", (layer,) * 4, tj.planner.LayerProfile(1e9, 0, 0, 0))

    def candidate(limit):  # two stages of 2 layers, 8 samples; each device has used 1 GB
        stages = tj.pipelining.Stages((2, 2))
        return Candidate(tj.ParallelConfig(pipe=2), 2, stages, (0, 1), 1.0, (10**9,) * 2, limit, 8)

    # one more minibatch in flight: 2 layers' weights (200 MB) and their inputs for 8 samples
    # (160 MB) on each device of a stage; the tighter stage decides
    roomy, tight = candidate((1_500_000_000, 1_400_000_000)), candidate((1_300_000_000,) * 2)
    assert in_flight_limit(roomy, model) == 2 and in_flight_limit(tight, model) == 1
    assert _minibatches([((0, 1), roomy), ((2, 3), tight)], model) == [2, 1]


def _device(name, tflops, memory_gib=24, usd=1.0):
    return tj.planner.DeviceType(name, int(memory_gib * 2**30), tflops * 1e12, 50e9, usd)


def test_the_planner_groups_mixed_nodes_into_equal_vws_with_stages_by_speed():
    layers = tuple(
        tj.planner.LayerProfile(1e11, 20_000_000, 50_000_000, 2_000_000) for _ in range(16)
    )
    model = tj.planner.ModelProfile("m", layers, tj.planner.LayerProfile(1e10, 1_000_000, 0, 0))
    fast, slow = _device("fast", 120), _device("slow", 40, usd=0.3)
    cluster = tj.planner.Cluster(
        "het", (fast, slow), (0,) * 4 + (1,) * 4, (0,) * 4 + (1,) * 4, 10e9
    )
    choice = plan_workers(cluster, model, minibatch=8)
    assert choice.alternatives and all(choice.throughput >= t for _, t, _ in choice.alternatives)
    equal = plan_workers(cluster, model, minibatch=8, groupings=("equal",))
    assert len(equal.workers) == 4 and equal.distance == 1
    for worker in equal.workers:  # one fast and one slow device each: the fast stage has more
        assert worker.candidate.config.pipe == 2
        first, second = worker.candidate.stages.layers
        assert first > second
        assert worker.minibatches == 2  # a minibatch in flight on each stage
    by_node = plan_workers(cluster, model, minibatch=8, groupings=("node",))
    fast_vw, slow_vw = sorted(by_node.workers, key=lambda w: w.candidate.step_time)
    assert fast_vw.minibatches > slow_vw.minibatches == 1  # Nm in proportion to speed
    assert "synchronous" in str(choice) and choice.throughput > 0
    hybrid = plan_workers(cluster, model, minibatch=8, groupings=("hybrid",))
    # HetPipe's hybrid distribution: blocks of 2 adjacent devices of each node, 2 of each type
    assert [w.devices for w in hybrid.workers] == [(0, 1, 4, 5), (2, 3, 6, 7)]
    assert hybrid.grouping == "hybrid" and hybrid.distance == 1
    assert {g for g, _, _ in choice.alternatives} | {choice.grouping} == {"node", "equal", "hybrid"}
    odd = tj.planner.Cluster("odd", (fast, slow), (0,) * 3 + (1,) * 3, (0,) * 3 + (1,) * 3, 10e9)
    with pytest.raises(tj.errors.PlanError, match=r"hybrid grouping needs.*\[3, 3\]"):
        plan_workers(odd, model, minibatch=8, groupings=("hybrid",))
    with pytest.raises(tj.errors.PlanError, match="objective"):
        plan_workers(cluster, model, minibatch=8, objective="speed")
