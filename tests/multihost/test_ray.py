"""The elastic job on a Ray cluster: simulated nodes on 127.0.0.1 (``ray.cluster_utils.Cluster``,
each node its own raylet), ``examples/elastic_gpt.py`` launched by the Ray launcher through the
death of the coordinator's node, a node that joins, and a node dying with its replica holder:
the survivors' live replicas serve both deaths, nothing lost.

The cluster and the job run in a network namespace of their own (``unshare -rn``: a user and
network namespace, no privilege needed) whose only interfaces are loopback and a decoy: Ray's own
node-address lookup finds no route out and answers 127.0.0.1, so every Ray socket is on loopback,
and anything bound to every interface would show on the decoy's address.
``tests/multihost/ray_job.py`` is the side inside; this side checks what it wrote, against the
same script run uninterrupted here.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys

import numpy as np
import psutil
import pytest

from tenplex_jax.multihost import RunDir
from tests.helpers import ROOT, reference_run

STEPS = 12
# seconds for the whole driver: the cluster's start-up, four generations and their compiles,
# several times what they take on a loaded 2-core machine
DRIVER_SECONDS = 900


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    out = tmp_path_factory.mktemp("ray")
    unshare = shutil.which("unshare")
    assert unshare, "the Ray test runs the cluster in a network namespace: util-linux's unshare"
    command = [
        unshare,
        "-rn",
        sys.executable,
        str(ROOT / "tests" / "multihost" / "ray_job.py"),
        str(out),
        str(STEPS),
    ]
    with open(out / "driver.log", "wb") as log:
        proc = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
    try:
        want = reference_run(STEPS)  # meanwhile, the uninterrupted run in this process
        proc.wait(timeout=DRIVER_SECONDS)
    except subprocess.TimeoutExpired:
        pass  # reported below, with the driver's log
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(30)
    driver = (out / "driver.log").read_text(errors="replace")
    assert proc.returncode == 0 and (out / "result.json").exists(), (
        f"the Ray driver (tests/multihost/ray_job.py) exited with {proc.returncode} "
        f"(-9: killed after {DRIVER_SECONDS} s); its log ends:\n{driver[-6000:]}"
    )
    result = json.loads((out / "result.json").read_text())
    run = RunDir(out / "run")
    return {"out": out, "run": run, "result": result, "driver": driver, "reference": want}


def test_the_job_survives_node_deaths_and_grows_onto_a_joining_node(job):
    result, run = job["result"], job["run"]
    assert result.get("returncode") == 0 and not result["notes"], (
        "\n".join(result["notes"]) + "\n" + job["driver"][-4000:]
    )
    gens = run.events("generation")
    assert [g["processes"] for g in gens] == [3, 2, 3, 1]
    assert [g["restore"] for g in gens] == ["init", "live", "store", "live"]
    # process 0's node died: its slot is gone; the others go on in their own processes (the
    # coordination service runs in the launcher), from their memory
    assert gens[1]["slots"] == [1, 2] and gens[1]["step"] == 4
    assert gens[1]["lost_steps"] == 0
    # the survivors kept their processes through every change; the new node's is cold
    assert gens[1]["kept"] == [True, True] and gens[2]["kept"] == [True, True, False]
    assert gens[1]["warm"] == [True, True] and gens[2]["warm"] == [True, True, False]
    assert gens[1]["pids"] == gens[0]["pids"][1:] == gens[2]["pids"][:2]
    assert gens[3]["kept"] == [True] and gens[3]["pids"] == gens[0]["pids"][1:2]
    # the joining node: growth paid over the planned run; a planned resize, nothing lost
    offer = run.events("offer")[0]
    assert offer["grow"] and offer["gain_seconds"] > offer["cost_seconds"] > 0
    assert offer["source"] == "launcher" and offer["remaining_steps"] > 0
    assert gens[2]["slots"] == [1, 2, 3] and gens[2]["lost_steps"] == 0
    # a node and its replica holder: the commit of step 10 lost copies of some shards, but the
    # node left holds every shard at step 10 in memory: nothing lost, no fallback
    assert (gens[3]["restore"], gens[3]["step"], gens[3]["lost_steps"]) == ("live", 10, 0)
    assert not [e for e in run.events() if e["event"] in ("rewind", "fallback", "replicas_lost")]
    assert run.events()[-1]["event"] == "finished"


def test_params_equal_an_uninterrupted_run_bitwise_and_every_batch_once(job):
    want, samples, _ = job["reference"]
    with np.load(job["out"] / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    records = [json.loads(line) for line in (job["out"] / "steps.jsonl").read_text().splitlines()]
    gens = job["run"].events("generation")
    # a generation's steps count up to the earliest step a later generation restored
    ends = [min([g["step"] for g in gens[n + 1 :]] + [STEPS]) for n in range(len(gens))]
    counted = [r for r in records if r["step"] <= ends[r["generation"]]]
    assert [r["step"] for r in counted] == list(range(1, STEPS + 1))
    for r, want_samples in zip(counted, samples):
        got_samples = np.asarray(r["samples"])
        np.testing.assert_array_equal(got_samples[got_samples >= 0], want_samples)


def test_every_socket_stays_on_loopback_and_the_stores_need_the_token(job):
    result = job["result"]
    assert len(result["sockets"]) > 10  # Ray's, the stores', the coordinator's, gloo's
    assert result["beyond_loopback"] == []
    assert result["no_token"] == "auth"  # a client without the token is refused
    token = result["token"]
    assert len(token) == 64
    for path in [
        *job["run"].path.rglob("*"),
        job["out"] / "driver.log",
        job["out"] / "steps.jsonl",
    ]:
        if path.is_file() and path.name != "token" and path.stat().st_size < 50 << 20:
            assert token not in path.read_text(errors="replace"), path
    # every process of the job is gone: Ray's, the stores, the workers
    out = str(job["out"])
    left = [
        p.info
        for p in psutil.process_iter(["pid", "cmdline"])
        if any(out in part for part in (p.info["cmdline"] or []))
    ]
    assert not left, left


def test_a_node_that_died_unreported_is_lost_with_the_failure_the_launcher_saw(
    tmp_path, monkeypatch
):
    """The race behind a rewind after two nodes died together (the job above, once): Ray
    reports each node's death seconds later, one node at a time, so when the launcher sees the
    first, a process of the other still looks alive. Named a survivor, it would never write its
    part of the live version, which then lacks it. Here the actors of slots 1 and 2 (each
    standing for its node, a process of its own beside it) are SIGKILLed and the launcher has
    seen slot 2's failure alone: before it tells the survivors, slot 1 is found silent and lost
    with it; slot 0, whose actor lives, is the one survivor."""
    import ray

    from tenplex_jax._src.multihost.launch import _Generation, _Outcome, _Slot
    from tenplex_jax._src.multihost.ray import RayLauncher, Remote
    from tenplex_jax.multihost import LaunchOptions, Restore, RunEvent, Source

    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "0")
    ray.init(num_cpus=1, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
    launcher = RayLauncher(LaunchOptions("train.py", nprocs=3, run_dir=tmp_path))
    started = []
    try:
        node = ray.get_runtime_context().get_node_id()
        command = [sys.executable, "-c", "import sys; sys.stdin.read()"]
        for slot in range(3):
            actor = launcher._actor(node)
            pid = ray.get(actor.stand_by.remote(command, {}), timeout=120)
            started += _processes([pid])  # (psutil's handle: never a later process of that pid)
            launcher.nodes[slot], launcher.hosts[slot] = node, actor
            launcher.slots[slot] = _Slot(slot, Remote(actor, pid, node), "127.0.0.1:0")
        pid_of = lambda actor: ray.get(actor.__ray_call__.remote(lambda _: os.getpid()), timeout=60)
        dying = [pid_of(launcher.hosts[s]) for s in (1, 2)]
        for pid in dying:  # the nodes of slots 1 and 2 die together
            os.kill(pid, signal.SIGKILL)
        _, alive = psutil.wait_procs(_processes(dying) + started[1:], timeout=60)
        assert not alive, alive
        gen = _Generation(
            number=0,
            slots=[0, 1, 2],
            workers=[],
            logs=[],
            restore=Restore(source=Source.INIT, step=0),
            warm=[],
            kept=[],
        )
        seen = _Outcome(kind=RunEvent.FAILURE, lost_slots=(2,), detail="process 2 was killed")
        confirmed = launcher._confirmed(gen, seen)
        assert confirmed.lost_slots == (1, 2)
        assert confirmed.detail == "process 2 was killed; the node of slot 1 does not answer"
        assert launcher._survivors([0, 1, 2], confirmed) == [0]
        # every other slot answers: the failure stays as it was seen
        assert launcher._confirmed(gen, confirmed) == confirmed
    finally:
        for proc in started:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()
        ray.shutdown()


def _processes(pids) -> list[psutil.Process]:
    """The processes of ``pids`` that still exist."""
    out = []
    for pid in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            out.append(psutil.Process(pid))
    return out
