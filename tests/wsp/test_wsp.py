"""Virtual workers with wave synchronous parallel, for real: threads on the 8 fake CPU devices and
processes of their own, a parameter server on tensor store processes on 127.0.0.1, the reference
GPT; D = 0 against the synchronous step it equals, a SIGKILLed VW process mid-wave, the demo's
death and join, the planner."""

from __future__ import annotations

import dataclasses
import json
import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import tenplex_jax as tj
from tenplex_jax._src import tree
from tenplex_jax._src.cli import main
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.wsp.ledger import Ledger
from tenplex_jax.errors import WSPError
from tenplex_jax.wsp import (
    Coordinator,
    ParameterServer,
    Processes,
    Threads,
    VWEvent,
    VWEventKind,
    WaveRecord,
    plan_workers,
    weights_of,
)
from tenplex_jax_models import build_state, example_losses
from tenplex_jax_models import wsp as job_parts
from tests.helpers import Stores
from tests.wsp.wsp_jobs import tails

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

        steps = _steps(parts)

        def make(name, devices):
            return job_parts.virtual_worker(
                parts, name, devices, store_addresses, state, distance=0, steps=steps
            )

        with Coordinator(ps, Threads(make)) as coordinator:
            coordinator.add([0], [0])  # on one device: one compiled step
            coordinator.wait(timeout=300)
        assert not coordinator.runner.errors
        ledger = ps.ledger()
        got = ps.pull(ledger)
    records = coordinator.records()
    # D = 0: every wave starts from the weights holding every VW's previous waves, and wave k
    # trains minibatches 2k and 2k + 1 (one on each VW, whichever claims first)
    assert all(r.wave == r.slowest for r in records)
    assert sorted(
        tuple(sorted(m for r in records if r.wave == k for m in r.minibatches))
        for k in range(waves)
    ) == [(2 * k, 2 * k + 1) for k in range(waves)]
    # the synchronous equivalent: w <- w - lr * (g(2k) + g(2k + 1)), both at the same w
    model = nnx.merge(graphdef, state)["model"]
    dataset = parts["dataset"]
    grad = nnx.jit(nnx.grad(lambda m, b: jnp.mean(example_losses(m, b))))
    sgd = jax.jit(lambda params, a, b: jax.tree.map(lambda p, x, y: p - lr * (x + y), params, a, b))
    for k in range(waves):
        g = [grad(model, dataset.read(dataset.indices(m)[0])) for m in (2 * k, 2 * k + 1)]
        nnx.update(model, sgd(nnx.state(model, nnx.Param), g[0], g[1]))
    want = {f"model/{p}": np.asarray(v) for p, v in _flat(nnx.state(model, nnx.Param)).items()}
    assert set(want) == set(got)
    for path in want:
        np.testing.assert_allclose(got[path], want[path], rtol=2e-5, atol=2e-6, err_msg=path)
    assert max(np.abs(got[p] - initial[p]).max() for p in got) > 1e-3  # training moved them


def _steps(parts) -> StepCache:
    """A step cache the VWs of a test share: a VW on the devices of another compiles nothing."""
    return job_parts.step_cache(parts, jax.devices())


def _flat(state) -> dict:
    paths, leaves, _ = tree.arrays(state)
    return dict(zip(paths, leaves))


PROCESS_TOTAL = 48  # minibatches of the run in processes


@dataclasses.dataclass(frozen=True)
class ProcessRun:
    """What the run in processes left: the ledger (its whole log), the records, the runner, its
    run folder, whether vw2 had said it was built when the first VW joined, the VW killed, its
    lease then and when it was killed."""

    ledger: Ledger
    records: list
    runner: Processes
    run_dir: pathlib.Path
    built_before_first_join: bool
    victim: str
    leased: tuple[int, ...]
    killed: float


@pytest.fixture(scope="module")
def process_run(tmp_path_factory) -> ProcessRun:
    """VWs in processes of their own, added together: vw1 (device 0), vw2 (device 1, its build
    3 s longer) and vw3 (device 2, its build fails); once they train, the one first caught
    mid-wave (it has pushed a wave and holds the next one's lease; which one depends on the
    machine's load) beside the other is SIGKILLed. Slowdown 4: each wave holds its lease three
    times its compute longer, so the kill lands mid-wave, not after a push it raced."""
    root = tmp_path_factory.mktemp("processes")
    run_dir, started = root / "run", Stores(root)
    own = {"vw2": ["--option", "build_seconds=3"], "vw3": ["--option", "fail=true"]}
    options = ["--minibatches", "2", "--distance", "1", "--timeout", "3", "--slowdown", "4"]
    paths = [str(ROOT), os.environ.get("PYTHONPATH")]  # (as tests/tools/test_cli.py's _demo)
    try:
        with pytest.MonkeyPatch.context() as patch:
            patch.setenv("PYTHONPATH", os.pathsep.join(filter(None, paths)))
            addresses = [started.start(f"s{i}").address for i in range(2)]
            with ParameterServer(addresses) as ps:
                ps.create(weights_of(job_parts.job(1)["init"]()), total=PROCESS_TOTAL)
                runner = Processes(
                    "tests.wsp.wsp_jobs:job",
                    addresses,
                    run_dir,
                    options=options,
                    options_for=lambda name, devices: own.get(name, []),
                )
                with Coordinator(ps, runner) as coordinator:  # every process reaped, whatever
                    coordinator.add([0], [1], [2])
                    deadline, ledger = time.monotonic() + 300, ps.ledger()
                    while not ledger.clocks:
                        assert time.monotonic() < deadline, f"no VW joined: {tails(run_dir)}"
                        ledger = ps.wait(1.0)  # the next change of the ledger
                    built = "built in" in (run_dir / "vw2.log").read_text()
                    victim = None
                    while victim is None and not ledger.done and time.monotonic() < deadline:
                        ledger = ps.wait(1.0)
                        caught = [
                            vw
                            for vw in sorted(ledger.leases)
                            if ledger.committed.get(vw, 0) >= 1 and set(ledger.clocks) - {vw}
                        ]
                        victim = next(iter(caught), None)
                    assert victim, f"no VW was caught mid-wave beside another: {ledger}"
                    leased = ledger.leases[victim].minibatches
                    coordinator.kill(victim)
                    killed = time.time()
                    coordinator.wait(timeout=300)
                    ledger = ps.history()
            yield ProcessRun(
                ledger=ledger,
                records=coordinator.records(),
                runner=runner,
                run_dir=run_dir,
                built_before_first_join=built,
                victim=victim,
                leased=leased,
                killed=killed,
            )
    finally:
        started.reap()


def test_a_sigkilled_vw_process_is_dropped_and_its_minibatches_trained_by_others(process_run):
    run, ledger = process_run, process_run.ledger
    other = ({"vw1", "vw2"} - {run.victim}).pop()
    assert ledger.done and ledger.dropped == (run.victim,), tails(run.run_dir)
    assert sorted(ledger.trained()) == list(range(PROCESS_TOTAL))  # exactly once, after the death
    by = {m: vw for vw, _, ms in ledger.log for m in ms}
    assert all(by[m] == other for m in run.leased)  # the dead VW's lease, trained by the other
    assert {r.vw for r in run.records if r.started > run.killed} == {other}  # it went on
    dead = [r for r in run.records if r.vw == run.victim and set(r.minibatches) & set(run.leased)]
    assert not dead


class _Building(Threads):
    """VWs as threads whose last one stays building (its thread never starts), as a VW in
    processes does while it compiles."""

    def launch(self, *handles) -> None:
        super().launch(*(h for h in handles if h.worker.name != "vw3"))

    def alive(self, handle) -> bool:
        return handle.worker.name == "vw3" or super().alive(handle)

    def wait(self, handle, timeout: float) -> None:
        if handle.worker.name != "vw3":  # a thread never started cannot be joined
            super().wait(handle, timeout)


def test_vws_added_together_in_processes_join_together_whatever_their_builds_take(process_run):
    # vw2 builds 3 s longer than vw1 and vw3 fails while it builds: vw1 is held until vw2 is
    # built (it does not train alone meanwhile), and vw3's failure holds nobody
    run, ledger = process_run, process_run.ledger
    assert run.built_before_first_join, tails(run.run_dir)  # the first VW in the ledger joined
    assert [name for name, _ in run.runner.errors] == ["vw3"]  # (the killed VW is no failure)
    assert "as the test asked" in (run.run_dir / "vw3.log").read_text()
    assert set(ledger.starts) == {"vw1", "vw2"}  # vw3 never joined
    assert set(ledger.left) == {"vw1", "vw2"} - {run.victim}  # the other left when done


def test_a_follower_ending_itself_once_the_runner_killed_its_leader_is_no_failure(
    tmp_path, monkeypatch
):
    # a VW over two processes, killed by the runner (a trace's failure): the follower sees its
    # leader gone and exits with 1 on its own, here before the kill reaches it (the order the
    # fault gave): the VW was ended, it did not fail
    from tenplex_jax._src.multihost import processes

    read, write = os.pipe()  # the follower reads till the leader, its writer, is gone
    leader = subprocess.Popen(
        [sys.executable, "-c", "import time; time.sleep(600)"], pass_fds=(write,)
    )
    follower = subprocess.Popen(
        [sys.executable, "-c", "import sys; sys.stdin.read(); sys.exit(1)"], stdin=read
    )
    os.close(read)
    os.close(write)
    kill = processes.kill

    def leader_first(proc, *args, **kwargs):
        kill(proc, *args, **kwargs)
        if proc is leader:
            follower.wait(30)

    monkeypatch.setattr(processes, "kill", leader_first)
    runner = Processes("tenplex_jax_models.wsp:job", ["127.0.0.1:1"], tmp_path)
    runner.started["vw1"] = (leader, follower)
    try:
        runner.kill((leader, follower))
    finally:
        for proc in (leader, follower):
            kill(proc)
    assert follower.returncode == 1 and leader.returncode == -9
    assert runner.errors == []


def test_a_follower_killed_before_its_leader_failed_is_a_failure_while_its_waiter_lags(
    tmp_path, monkeypatch
):
    # the order a loaded machine gave: the follower was SIGKILLed, its leader's collective
    # failed and it exited 1, and the runner ended the VW before its thread waiting for the
    # follower had reaped it (Popen.poll says None while that thread holds Popen's lock): the
    # follower's death is a failure all the same, not the runner's kill
    from tenplex_jax._src.multihost import processes

    leader = subprocess.Popen([sys.executable, "-c", "raise SystemExit(1)"])
    follower = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    runner = Processes("tenplex_jax_models.wsp:job", ["127.0.0.1:1"], tmp_path)
    runner.started["vw1"] = (leader, follower)
    kill, killed = processes.kill, []
    monkeypatch.setattr(processes, "kill", lambda proc, *args, **kwargs: killed.append(proc))
    held, release = threading.Event(), threading.Event()

    def waiter():  # the runner's thread that waits for the follower, not yet scheduled
        with follower._waitpid_lock:  # (not public API: the lock Popen.wait holds)
            held.set()
            release.wait(60)

    thread = threading.Thread(target=waiter)
    thread.start()
    try:
        assert held.wait(30)
        os.kill(follower.pid, signal.SIGKILL)
        os.waitid(os.P_PID, follower.pid, os.WEXITED | os.WNOWAIT)  # dead, not reaped
        leader.wait(30)
        assert follower.poll() is None  # what the runner read before
        runner.kill((leader, follower))
    finally:
        release.set()
        thread.join()
        for proc in (leader, follower):
            kill(proc)
    assert killed == [leader, follower]
    assert sorted(runner.errors) == [
        ("vw1", "process 0 exited with status 1"),
        ("vw1", "process 1 was killed by SIGKILL"),
    ]


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

    ledger = Ledger(total=2).join("vw1").join("vw2")
    for vw in ("vw1", "vw2"):
        ledger, _ = ledger.claim(vw, 0, 1)
        ledger = ledger.commit(vw, 0)
    ledger = ledger.leave("vw1")
    record = WaveRecord.from_json(
        {"vw": "vw1", "wave": 0, "minibatches": [0], "samples": [], "losses": [1.0]}
        | {"slowest": 0, "pulled": False, "started": 0.0, "ended": 0.0, "local_versions": [0]}
        | {"local_staleness": [0], "global_staleness": [0]}
        | dict.fromkeys(wsp_demo.SECONDS, 0.0)
    )
    kill = VWEvent(kind=VWEventKind.KILL, vw="vw2", devices=(1,), time=1.0)

    def proof(records, events) -> bool:
        return wsp_demo.exactly_once(2, ledger, records, events)

    assert proof([record], [kill])
    assert not proof([record], [])  # a commit without a record by a VW never killed
    assert not proof([], [kill])  # vw1's record lost
    assert not proof([record, record], [kill])  # a wave recorded twice


def test_wait_joined_returns_once_every_added_vw_is_a_member(store_addresses):
    parts = job_parts.job(1)
    state = parts["init"]()
    with ParameterServer(store_addresses) as ps:
        ps.create(weights_of(state), total=10_000)  # far from done while the test looks

        steps = _steps(parts)

        def make(name, devices):
            return job_parts.virtual_worker(
                parts, name, devices, store_addresses, state, steps=steps
            )

        with Coordinator(ps, _Building(make)) as coordinator:
            coordinator.add([0], [0])  # on one device: one compiled step
            coordinator.wait_joined(timeout=300)
            assert {"vw1", "vw2"} <= set(ps.ledger().clocks)
            coordinator.add([0])  # still building when the wait gives up
            with pytest.raises(WSPError, match=r"\['vw3'\] did not join") as error:
                coordinator.wait_joined(timeout=1.0)
            assert error.value.reason == "busy"
            coordinator.remove("vw3")  # no longer running: not waited for
            coordinator.wait_joined(timeout=1.0)
            coordinator.stop(timeout=300)


def test_the_demo_survives_a_death_and_a_join_exactly_once(tmp_path):
    assert main(["wsp", "--steps", "96", "--out", str(tmp_path)]) == 0
    summary = json.loads((tmp_path / "summary.json").read_text())
    assert summary["exactly_once"] and summary["samples_exactly_once"]
    assert summary["dropped"] == ["vw2"] and summary["weights_finite"]
    kinds = [(e["kind"], e["vw"]) for e in summary["events"]]
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
    assert [(built[n]["devices"], built[n]["config"], built[n]["nm"]) for n in sorted(built)] == [
        ([0, 1, 2, 3], "pipe=2,data=2", 4),
        ([4, 5], "data=2", 2),
        ([6, 7], "data=2", 1),
        ([4, 5], "data=2", 2),  # the joiner
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
    assert _minibatches([roomy, tight], [1.0, 1.0], model) == [2, 1]


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
    assert choice.alternatives and all(
        choice.throughput >= a.throughput for a in choice.alternatives
    )
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
    assert {a.grouping for a in choice.alternatives} | {choice.grouping} == {
        "node",
        "equal",
        "hybrid",
    }
    odd = tj.planner.Cluster("odd", (fast, slow), (0,) * 3 + (1,) * 3, (0,) * 3 + (1,) * 3, 10e9)
    with pytest.raises(tj.errors.PlanError, match=r"hybrid grouping needs.*\[3, 3\]"):
        plan_workers(odd, model, minibatch=8, groupings=("hybrid",))
    with pytest.raises(tj.errors.PlanError, match="objective"):
        plan_workers(cluster, model, minibatch=8, objective="speed")


def _slides_cluster():
    """HetPipe's slides: four nodes of four GPUs of one type each, V, R, G and Q."""
    types = (_device("V", 110), _device("R", 120), _device("G", 45), _device("Q", 37))
    kinds = tuple(k for k in range(4) for _ in range(4))
    return tj.planner.Cluster("slides", types, kinds, kinds, 7e9)


def test_the_hybrid_grouping_builds_the_slides_vws_two_types_two_of_each_balanced():
    model = _model()
    cluster = _slides_cluster()
    hybrid = plan_workers(cluster, model, minibatch=8, groupings=("hybrid",))
    assert len(hybrid.workers) == 4
    for worker in hybrid.workers:  # two types, two devices of each (half a node each)
        kinds = sorted(cluster.types[cluster.kinds[d]].name for d in worker.devices)
        assert len(set(kinds)) == 2 and kinds[0] == kinds[1] and kinds[2] == kinds[3], kinds
        assert worker.kinds().count("2x") == 2
    # the pairing kept is the most balanced of the three: a fast type with a slow one
    pairs = {frozenset(w.types) for w in hybrid.workers}
    assert pairs == {frozenset("VG"), frozenset("RQ")}
    assert hybrid.balance < 1.05 and "other pairings" in hybrid.how
    tried = [float(x) for x in re.findall(r" (\d+\.\d+)", hybrid.how.split("other pairings")[1])]
    assert len(tried) == 2 and min(tried) > hybrid.balance
    equal = plan_workers(cluster, model, minibatch=8, groupings=("equal",))
    assert all(len(set(w.types)) == 4 for w in equal.workers)  # ED: one of each type
    by_node = plan_workers(cluster, model, minibatch=8, groupings=("node",))
    assert all(len(set(w.types)) == 1 for w in by_node.workers)  # NP: one type each
    three = tj.planner.Cluster(
        "three", cluster.types[:3], cluster.kinds[:12], cluster.nodes[:12], 7e9
    )
    with pytest.raises(tj.errors.PlanError, match=r"even number of them, got 3"):
        plan_workers(three, model, minibatch=8, groupings=("hybrid",))


def test_a_wave_estimate_fills_and_drains_the_pipeline_once():
    from tenplex_jax._src.wsp.planner import WorkerPlan

    choice = plan_workers(_slides_cluster(), _model(), minibatch=8, groupings=("equal",))
    worker = choice.workers[0]
    assert worker.stages == 4
    # a wave of Nm minibatches through S stages: (Nm + S - 1) ticks of the slowest stage, not
    # Nm steps: one more minibatch adds one tick (and its part outside the pipeline)
    plan = lambda nm: dataclasses.replace(worker, minibatches=nm)
    tick = worker.stage_seconds + worker.serial_seconds
    assert plan(5).wave_seconds - plan(4).wave_seconds == pytest.approx(tick)
    bare = WorkerPlan((0,), worker.candidate, 3, 2.0, 0.0, 0.0, ("V",))  # S = 4 stages
    assert bare.wave_seconds == (3 + 4 - 1) * 2.0
    assert (
        dataclasses.replace(bare, serial_seconds=0.5, sync_seconds=1.0).wave_seconds == 12 + 1.5 + 1
    )
    assert worker.wave_seconds == pytest.approx(
        (worker.minibatches + 3) * worker.stage_seconds
        + worker.minibatches * worker.serial_seconds
        + worker.sync_seconds
    )
    assert worker.wave_seconds < worker.minibatches * worker.candidate.step_time * 2
    assert choice.throughput == pytest.approx(
        sum(w.minibatches for w in choice.workers) * 8 / max(w.wave_seconds for w in choice.workers)
    )


def test_the_explanation_names_every_grouping_with_its_vws_and_wave_estimate():
    choice = plan_workers(_slides_cluster(), _model(), minibatch=8)
    text = choice.explain()
    assert f"'{choice.grouping}' (chosen)" in text and "(Nm + S - 1)" in text
    for option in (choice, *choice.alternatives):
        assert f"'{option.grouping}' (" in text
        longest = max(w.wave_seconds for w in option.workers)
        assert f"longest wave {longest:.4f} s" in text
        for w in option.workers:
            assert f"{w.kinds()}: {w.candidate.config}" in text and w.formula() in text
    assert {o.grouping for o in (choice, *choice.alternatives)} == set(tj.wsp.Grouping)
    assert text.count("fewer samples/s than") == 2 and text in str(choice)


def _model():
    layers = tuple(
        tj.planner.LayerProfile(1e11, 20_000_000, 50_000_000, 2_000_000) for _ in range(16)
    )
    return tj.planner.ModelProfile("m", layers, tj.planner.LayerProfile(1e10, 1_000_000, 0, 0))
