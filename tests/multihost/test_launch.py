"""Multi-process elastic training under ``tenplex-jax launch``: real processes, stores and kills.

One launched job (``examples/elastic_gpt.py``, the script that also runs alone: GPT tiny, 4
processes x 2 CPU devices, replicas=1, a commit every 2 steps, an orbax checkpoint every 4) runs
through two failures, each injected by PID at a known step while the job is paused at a step
boundary (``--pause-after``, commits finished):

1. after step 3: SIGKILL worker 3 and its store. The job goes on with 3 processes, the three
   survivors in their own processes, from their memory: each writes the boxes of the state at
   step 3 that it takes its turn for to its own store (a live version), and the new generation
   reads it; lost steps 0, though the last commit is of step 2. Slot 1's warm standby process is
   killed too: its survivor takes its rank.
2. after step 6: SIGKILL worker 2 and both stores holding its shards of the commit (2 and 0;
   worker 0 goes with its store). The one process left (slot 1's, the same process since
   generation 0) holds a replica of every shard: lost steps 0 again. (Where no survivor holds
   some shard, ``test_launch_bitwise.py`` rewinds to the orbax checkpoint.)
3. after step 7: a planned resize to 2 processes (``RUN_DIR/resize``): the process finds the
   request at the next step boundary (step 8), commits synchronously and stays; a new slot gets a
   new store, and a fresh process (the spare standby is killed before it is used); lost steps = 0.
   The grown layout's step is compiled ahead, so nobody compiles at the change.

The final params must equal, bit for bit, a single-process run of 10 steps fed the same batches,
and the steps that count must have trained each global batch of the dataset order exactly once.
"""

from __future__ import annotations

import json
import os
import signal

import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.multihost.commit import stored_objects
from tenplex_jax._src.multihost.rundir import Ahead, Grown, LiveReport
from tenplex_jax._src.multihost.spec import Action, Request, Restore
from tenplex_jax.multihost import RunDir, Source, store
from tests.helpers import (
    LAUNCH_SAMPLES,
    ROOT,
    reaped,
    reference_run,
)
from tests.multihost.launching import (
    TIMEOUT,
    alive,
    kill,
    last,
    launch,
    launch_example,
    log_tail,
    paused,
    wait_for,
)

STEPS = 10


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    run = tmp_path_factory.mktemp("launch")
    flags = ["--checkpoint-dir", str(run / "ckpt"), "--checkpoint-every", "4", "--grace", "1"]
    script = ["--log", str(run / "steps.jsonl"), "--pause-after", "3,6,7"]
    proc = launch_example(run, 4, STEPS, flags=flags, script=script)
    children: list[int] = []
    with reaped(proc):
        want = reference_run(STEPS)  # while the job starts: this process would wait idle otherwise
        wait_for(lambda: last(run, "stores") is not None, "the stores", proc)
        stores = {int(k): v["pid"] for k, v in last(run, "stores")["slots"].items()}
        children += stores.values()
        # failure 1: worker 3 and its store, once all four processes paused after step 3
        wait_for(lambda: paused(run, 3, 4), "generation 0 to pause after step 3", proc)
        # a failure comes after the first seconds: process 0 has compiled the next layout ahead,
        # and processes 1 and 2, which stay, have lowered it
        ready = lambda: RunDir(run).ahead(0, processes=3)
        wait_for(ready, "the compile-ahead after a loss", proc)
        workers, standbys = last(run, "generation")["pids"], last(run, "standby")["pids"]
        children += workers + list(standbys.values())
        kill(standbys["1"])  # slot 1's warm process dies before it is used: the spare takes it
        kill(stores[3])
        kill(workers[3])
        # failure 2: worker 2 and both stores holding its shards (its own, 2, and its replica, 0)
        wait_for(lambda: paused(run, 6, 3), "generation 1 to pause after step 6", proc)
        workers = last(run, "generation")["pids"]
        children += workers + list(last(run, "standby")["pids"].values())
        assert len(workers) == 3
        kill(stores[2])
        kill(stores[0])
        kill(workers[2])
        # a planned resize to 2 processes (one new slot, with a new store), asked after step 7
        wait_for(lambda: paused(run, 7, 1), "generation 2 to pause after step 7", proc)
        spare = [e["pids"]["-1"] for e in RunDir(run).events("standby")][-1]
        children.append(spare)
        kill(spare)  # the spare dies before the growth needs it: the new slot starts fresh
        (run / "resize").write_text("2")
        wait_for(lambda: (run / "control.json").exists(), "the launcher's request", proc)
        (run / "resume-7").write_text("")
        children += last(run, "generation")["pids"]
        children += [pid for e in RunDir(run).events("standby") for pid in e["pids"].values()]
        proc.wait(TIMEOUT)
    log = (run / "launcher.log").read_text(errors="replace")
    return {
        "run": run,
        "dir": RunDir(run),
        "returncode": proc.returncode,
        "log": log,
        "children": children,
        "reference": want,
    }


@pytest.fixture(scope="module")
def reference(job):
    return job["reference"]


def test_job_survives_two_failures_and_finishes(job):
    assert job["returncode"] == 0, job["log"][-3000:]
    gens = job["dir"].events("generation")
    assert [g["processes"] for g in gens] == [4, 3, 1, 2], job["log"][-3000:]
    assert [g["slots"] for g in gens] == [[0, 1, 2, 3], [0, 1, 2], [1], [1, 4]]
    restores = [(g["restore"], g["step"]) for g in gens]
    assert restores == [("init", 0), ("live", 3), ("live", 6), ("store", 8)]
    # 0 wherever a replica lived: at both failures, from the survivors' memory
    assert [g["lost_steps"] for g in gens] == [None, 0, 0, 0]
    assert not [e for e in job["dir"].events() if e["event"] in ("rewind", "fallback")]
    kinds = [e["event"] for e in job["dir"].events()]
    assert kinds.count("failure") == 2 and kinds.count("resize") == 1
    # every survivor stayed in its process: slot 1's process ran all four generations; the new
    # slot 4 started fresh, its spare standby killed before it was used
    kept = [[False] * 4, [True] * 3, [True], [True, False]]
    assert [g["kept"] for g in gens] == kept
    assert [g["warm"] for g in gens] == kept
    pids = [g["pids"] for g in gens]
    assert pids[1] == pids[0][:3] and pids[2] == [pids[0][1]] and pids[3][0] == pids[0][1]
    lost = job["dir"].events("standby_lost")
    assert [e["slot"] for e in lost] == [-1], lost
    # the growth's store for slot 4 started when the growth was asked for, before the change
    ordered = [e for e in job["dir"].events() if e["event"] in ("request", "growing", "resize")]
    assert [e["event"] for e in ordered] == ["request", "growing", "resize"], ordered
    stores = job["dir"].events("stores")
    assert stores[-1]["slots"]["4"]["pid"] == ordered[1]["slots"]["4"]
    assert alive(job["children"]) == []  # every worker and store was reaped


def test_no_process_compiles_a_layout_compiled_before(job):
    """After the loss of a process, every process of the new generation loads the step process
    0 compiled ahead (the first N - 1 processes' devices, whichever process died), and the
    survivors, which lowered it beside process 0, load it without tracing it again. At the
    growth nobody compiles: process 0 compiled the grown layout ahead, for a compile-only
    topology of two processes (it said so before the change), and loads it untraced; so does
    the new process, the example's step being named."""
    run = job["dir"]
    assert run.read(Ahead, 0, 0) == Ahead(processes=3, compiled=True)
    got = [(r.loaded, r.compiles, r.traced) for r in run.first_steps(1)]
    assert got == [(True, 0, False)] * 3, got
    assert run.read(Grown, 2, 0) == Grown(processes=2, remembered=True)
    grown = [(r.loaded, r.compiles, r.traced) for r in run.first_steps(3)]
    assert grown == [(True, 0, False), (True, 0, False)], grown


def test_params_equal_an_uninterrupted_run_bitwise(job, reference):
    want, _, _ = reference
    with np.load(job["run"] / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")


def test_every_global_batch_trained_exactly_once(job, reference):
    _, want, _ = reference
    records = [json.loads(line) for line in (job["run"] / "steps.jsonl").read_text().splitlines()]
    gens = job["dir"].events("generation")
    # a generation's steps count up to where the next one restored from
    ends = [g["step"] for g in gens[1:]] + [STEPS]
    counted = [r for r in records if r["step"] <= ends[r["generation"]]]
    assert [r["step"] for r in counted] == list(range(1, STEPS + 1))
    for g, first in zip(
        gens, [min(r["step"] for r in records if r["generation"] == n) for n in range(len(gens))]
    ):
        assert first == g["step"] + 1  # the dataset cursor resumed at the restored step
    for r, samples in zip(counted, want):
        got = np.asarray(r["samples"])
        np.testing.assert_array_equal(got[got >= 0], samples, err_msg=f"step {r['step']}")
    stream = np.concatenate(want)  # 10 x 24 over 100 samples: two epochs and 40 of the third
    for epoch in (stream[:LAUNCH_SAMPLES], stream[LAUNCH_SAMPLES : 2 * LAUNCH_SAMPLES]):
        assert sorted(epoch) == list(range(LAUNCH_SAMPLES))
    assert len(set(stream[2 * LAUNCH_SAMPLES :])) == 40


def test_survivors_resume_from_their_memory_each_box_written_once(job):
    run = job["dir"]
    reports = [run.restored(1, i) for i in range(3)]
    assert all(r.source == Source.LIVE and r.step == 3 for r in reports), reports
    kept = [run.read(LiveReport, 0, i) for i in range(3)]
    assert [(k.step, k.newest, k.why, k.orphans) for k in kept] == [(3, 3, None, ())] * 3, kept
    # data=8: every process holds every leaf; the survivors take turns by leaf, so each leaf is
    # written once (the whole state's bytes) and every survivor writes some
    assert sum(k.nbytes for k in kept) == reports[0].state_bytes
    assert min(k.nbytes for k in kept) > 0
    assert all(3 not in r.pull.by_slot for r in reports)  # store 3 is dead: nothing from it
    # the second failure: the survivors (process 1, and process 0 if the launcher saw it alive
    # before its store's death) wrote the state at step 6; slot 1's process read it back
    parts = [k for p in range(3) if (k := run.read(LiveReport, 1, p)) is not None]
    assert {(k.step, k.why) for k in parts} == {(6, None)}, parts
    assert sum(k.nbytes for k in parts) == reports[0].state_bytes
    report = run.restored(2)
    assert report.source == Source.LIVE and report.step == 6 and report.kept


def test_launcher_replaces_a_failed_generation_and_stops_on_sigterm(tmp_path):
    """Process management alone (a stub worker, no JAX): a worker exits 3 while its peer hangs;
    the peer is killed after the grace period, the next generation runs on the slot left, and
    SIGTERM ends the job through the control file; every worker and store is reaped."""
    flags = ["--nprocs", "2", "--grace", "0.5"]
    proc = launch(tmp_path, ROOT / "tests" / "multihost" / "launch_stub.py", flags)
    with reaped(proc):
        wait_for(lambda: (tmp_path / "ready-g1-p0").exists(), "generation 1", proc)
        stores = [v["pid"] for v in last(tmp_path, "stores")["slots"].values()]
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(TIMEOUT) == 0, (tmp_path / "launcher.log").read_text()
    found = RunDir(tmp_path).events()
    gens = [e for e in found if e["event"] == "generation"]
    assert [(g["processes"], g["slots"], g["restore"]) for g in gens] == [
        (2, [0, 1], "init"),
        (1, [0], "init"),
    ]
    failure = next(e for e in found if e["event"] == "failure")
    assert failure["lost_slots"] == [1] and "exited with status 3" in failure["detail"]
    assert [e["event"] for e in found][-2:] == ["request", "stop"]
    assert alive(stores + gens[0]["pids"] + gens[1]["pids"]) == []


@pytest.mark.parametrize(
    "config, hosts",
    [
        (tj.ParallelConfig(fsdp=8), [0, 0, 1, 1, 2, 2, 3, 3]),
        (tj.ParallelConfig(data=4, fsdp=2), [0, 0, 1, 1, 2, 2, 3, 3]),
        (tj.ParallelConfig(data=3, fsdp=2), [0, 0, 1, 1, 2, 2]),
    ],
)
def test_a_commit_writes_each_distinct_box_once_spread_over_the_processes(config, hosts):
    from tests.helpers import RULES, abstract_state

    ptc = tj.PTC.of(abstract_state(), RULES, config, range(len(hosts)), hosts=hosts)
    slots = [5, 6, 7, 9][: max(hosts) + 1]  # any slot numbers
    objects = stored_objects(ptc, slots, replicas=1)
    for leaf in ptc.leaves:
        boxes = ptc.boxes(leaf)
        mine = [o for o in objects if o.path == leaf.path]
        assert sorted(o.box for o in mine) == sorted(set(boxes.values())), leaf.path
        for o in mine:
            assert boxes[o.device] == o.box and hosts[o.device] == o.process
            assert o.slots == (slots[o.process], slots[(o.process + 1) % len(slots)])
    load = [sum(o.nbytes for o in objects if o.process == p) for p in range(len(slots))]
    assert sum(load) == sum(o.nbytes for o in objects) and min(load) > 0.5 * max(load), load


@pytest.mark.parametrize(
    "config, survivors, orphaned",
    [
        (tj.ParallelConfig(data=4, fsdp=2), [0, 2, 3], False),  # every process holds it all
        (tj.ParallelConfig(data=2, fsdp=4), [1, 2, 3], False),  # process 0's boxes are on 2's
        (tj.ParallelConfig(data=2, fsdp=4), [0, 1, 3], False),
        (tj.ParallelConfig(data=2, fsdp=4), [2, 3], False),
        (tj.ParallelConfig(data=2, fsdp=4), [0, 2], True),  # fsdp's boxes of 1 and 3: nobody's
        (tj.ParallelConfig(fsdp=8), [0, 1, 2], True),
    ],
)
def test_a_live_version_is_written_by_survivors_once_per_box_or_names_the_orphans(
    config, survivors, orphaned
):
    from tenplex_jax._src.multihost.commit import live_objects
    from tests.helpers import RULES, abstract_state

    hosts = [0, 0, 1, 1, 2, 2, 3, 3]
    ptc = tj.PTC.of(abstract_state(), RULES, config, range(8), hosts=hosts)
    slots = [5, 6, 7, 9]
    objects, orphans = live_objects(ptc, slots, survivors)
    sharded = [leaf.path for leaf in ptc.leaves if len(set(ptc.boxes(leaf).values())) > 1]
    assert bool(orphans) == orphaned and set(orphans) <= set(sharded)
    if orphaned:
        assert orphans == tuple(sorted(sharded))  # every sharded leaf loses a box
        return
    for leaf in ptc.leaves:
        boxes = ptc.boxes(leaf)
        mine = [o for o in objects if o.path == leaf.path]
        assert sorted(o.box for o in mine) == sorted(set(boxes.values())), leaf.path
        for o in mine:  # written by a survivor holding it, renumbered, kept in its store alone
            writer = survivors[o.process]
            assert boxes[o.device] == o.box and hosts[o.device] == writer
            assert o.slots == (slots[writer],)
    load = [sum(o.nbytes for o in objects if o.process == p) for p in range(len(survivors))]
    assert min(load) > 0, load


def test_a_stored_version_of_another_state_is_refused_naming_the_leaf():
    from tenplex_jax_models import GPTConfig
    from tests.helpers import RULES, abstract_state

    small = tj.PTC.of(abstract_state(GPTConfig.small()), RULES, tj.ParallelConfig(fsdp=2), [0, 1])
    tiny = tj.PTC.of(abstract_state(), RULES, tj.ParallelConfig(fsdp=2), [0, 1])
    back = tj.PTC.from_json(json.loads(json.dumps(tiny.to_json())), tiny)
    assert back == tiny and back.rules == tiny.rules
    assert back.relayout(tj.ParallelConfig(data=2), [2, 3]) == tiny.relayout(
        tj.ParallelConfig(data=2), [2, 3]
    )
    with pytest.raises(
        tj.errors.PlanError,
        match=(
            r"another state.*42 leaves are in both with another shape or dtype: '0/b1' is "
            r"float32\[2, 256\] spec=P\('pipe', 'tensor'\) in the record, float32\[2, 64\] "
            r"spec=P\('pipe', 'tensor'\) in the state asked for"
        ),
    ):
        tj.PTC.from_json(small.to_json(), tiny)


def test_a_complete_version_deletes_the_older_ones(job):
    """Slot 1's store lived through every generation; restarted on its directory (the disk tier),
    it holds the last version only: each complete commit deleted the versions before it."""
    from tenplex_jax._src.multihost.commit import version_of

    proc = store.StoreProcess.start(job["run"] / "stores" / "1")
    try:
        client = store.StoreClient(proc.address)
        arrays = {version_of(o.path) for o in client.list("v") + client.list("l")}
        markers = {version_of(p) for p in client.list_json("v") + client.list_json("l")}
        client.close()
    finally:
        proc.stop()
    assert arrays == markers == {(STEPS, False)}  # the live versions went with the rest


def test_a_launched_job_refuses_in_process_device_changes_and_finishes(tmp_path):
    """The same ElasticJob API in a launched process (1 process, real jax.distributed): devices
    are the launcher's, device events refuse, the script's own checkpoint dir reaches the
    launcher (its fallback), and finish ends the job. As a plain restart would
    (``--no-executable-cache --no-standby``): no executable is stored, no standby started."""
    flags = ["--nprocs", "1", "--no-executable-cache", "--no-standby"]
    script = ROOT / "tests" / "multihost" / "launched_checks.py"
    proc = launch(tmp_path, script, flags, [str(tmp_path)])
    with reaped(proc):
        assert proc.wait(TIMEOUT) == 0, log_tail(proc)
    seen = json.loads((tmp_path / "checks.json").read_text())
    assert seen["launched"] is True and seen["processes"] == 1 and seen["step"] == 2
    assert seen["kind"] == "LaunchedJob"  # tj.ElasticJob(...) built the launched role
    assert "runs on every device of its processes" in seen["devices_refused"]
    assert "change by generation" in seen["preempt_refused"]
    rows = np.arange(96, dtype=np.float32).reshape(24, 4)  # the script's dataset
    order = tj.DatasetPTC(rows, global_batch=8)
    trained = np.concatenate([order.indices(0)[0], order.indices(1)[0]])
    np.testing.assert_array_equal(seen["w"], rows[trained].sum(0))
    checkpoint = json.loads((tmp_path / "checkpoint.json").read_text())
    assert checkpoint["directory"] == str(tmp_path / "ckpt")
    assert tj.latest_checkpoint(tmp_path / "ckpt") == 2  # finish saved the last step
    run = RunDir(tmp_path)
    assert [e["event"] for e in run.events()][-1] == "finished"
    assert not (tmp_path / "executables").exists()
    assert run.events("standby") == []
    [record] = run.first_steps(0)
    assert not record.loaded and record.compiles == 1
    restored = run.restored(0)
    assert (restored.source, restored.step, restored.warm, restored.kept) == (
        "init",
        0,
        False,
        False,
    )
    assert restored.started <= restored.joined <= restored.restoring <= restored.restored


def test_a_launched_job_needs_the_launchers_description_and_entry_point(monkeypatch):
    """Outside the launcher's entry point a LaunchedJob is refused, with or without the job's
    description in the environment, and the environment never switches what
    ``tj.ElasticJob(...)`` builds (only ``tj.elastic.use_job_class`` does)."""
    dataset = tj.DatasetPTC(np.zeros((8, 2), np.float32), global_batch=8)
    with pytest.raises(tj.errors.LayoutError, match=r"no job description from the launcher"):
        tj.multihost.LaunchedJob((), dataset)
    spec = tj.multihost.JobSpec(
        coordinator="127.0.0.1:1",
        process_id=0,
        num_processes=1,
        devices_per_process=2,
        generation=0,
        slots=(0,),
        stores={0: "127.0.0.1:2"},
        replicas=0,
        commit_every=1,
        restore=Restore(source=Source.INIT),
        run_dir="/nonexistent",
    )
    assert tj.multihost.JobSpec.from_env(spec.to_env()) == spec
    monkeypatch.setenv(*next(iter(spec.to_env().items())))
    with pytest.raises(tj.errors.LayoutError, match=r"python -m tenplex_jax.multihost SCRIPT"):
        tj.multihost.LaunchedJob((), dataset)
    with tj.ElasticJob((), dataset) as job:
        assert type(job) is tj.ElasticJob


def test_a_generation_ending_on_a_checkpoint_step_saves_its_checkpoint(job):
    """The planned resize lands at step 8, a multiple of --checkpoint-every 4: its synchronous
    commit saves the orbax checkpoint the step is due (the next generation starts there and
    commits nothing at it), so a later fallback finds step 8, not 4."""
    from tenplex_jax._src.checkpoint import saved_steps

    resize = job["dir"].events("generation")[-1]  # the generation after the resize
    assert (resize["restore"], resize["step"]) == ("store", 8)
    assert 8 in saved_steps(job["run"] / "ckpt")


def test_a_resize_file_is_read_once_written_and_a_bad_count_is_ignored(tmp_path):
    # a writer creates the file empty, then writes: read in between, it was ignored, and the
    # growth it asked for never came (a fresh-ci failure of test_growth.py)
    from tenplex_jax._src.multihost.launch import Launcher
    from tenplex_jax._src.multihost.spec import LaunchOptions

    launcher = Launcher(LaunchOptions("train.py", nprocs=2, run_dir=str(tmp_path)), log=print)
    resize = tmp_path / "resize"
    resize.write_text("")
    assert launcher._request(2) is None and resize.exists()  # left for its writer
    resize.write_text("3\n")
    assert (
        launcher._request(2) == Request(action=Action.RESIZE, processes=3) and not resize.exists()
    )
    resize.write_text("three")
    assert launcher._request(2) is None and not resize.exists()
    assert [(e["event"], e.get("processes")) for e in RunDir(tmp_path).events()] == [
        ("request", 3),
        ("ignored", None),
    ]


def test_a_failure_names_no_survivor_whose_store_was_killed_with_it(tmp_path, monkeypatch):
    # processes killed together end one at a time: the launcher sees store 0's end first, while
    # store 1, killed with it, has not ended yet (stopped here, as a killed process that is
    # not reaped: it cannot answer); told it survived, slot 1's worker would never write its
    # part of the live version, and the job would rewind (a fresh-ci failure of this file's
    # two failures). Slot 2's store answers: it survives.
    from tenplex_jax._src.multihost import launch as launching
    from tenplex_jax._src.multihost.launch import Launcher, _Generation
    from tenplex_jax._src.multihost.rundir import RunEvent
    from tenplex_jax._src.multihost.spec import LaunchOptions

    monkeypatch.setattr(launching, "ANSWER_SECONDS", 0.5, raising=False)
    launcher = Launcher(LaunchOptions("train.py", nprocs=3, run_dir=str(tmp_path)), log=print)
    (tmp_path / "logs").mkdir()
    try:
        launcher._start_stores([0, 1, 2])
        stopped = launcher.slots[1].store
        os.kill(stopped.pid, signal.SIGSTOP)
        kill(launcher.slots[0].store.pid)
        launcher.slots[0].store.wait(30)
        gen = _Generation(3, [0, 1, 2], [], [], None, [], [])
        seen = launcher._failure(gen, [])
        assert seen.lost_slots == (0,)
        confirmed = launcher._confirmed(gen, seen)
        assert confirmed.kind == RunEvent.FAILURE and confirmed.lost_slots == (0, 1)
        assert "the store of slot 1 does not answer" in confirmed.detail
        os.kill(stopped.pid, signal.SIGCONT)
    finally:
        launcher._teardown()


def test_a_planned_growths_stores_start_before_the_change_and_are_reaped(tmp_path):
    """A growth 2 -> 3 asked for: the new slot's store starts at once (the generation trains on
    to the change meanwhile), and the change takes that store; one started for a growth that
    never came is reaped with the rest."""
    from tenplex_jax._src.multihost.launch import Launcher
    from tenplex_jax._src.multihost.spec import LaunchOptions

    launcher = Launcher(LaunchOptions("train.py", nprocs=2, run_dir=str(tmp_path)), log=print)
    (tmp_path / "logs").mkdir()
    pids = []
    try:
        launcher._start_stores([0, 1])
        launcher._prepare_stores(2, 3)
        [growing] = RunDir(tmp_path).events("growing")
        early = growing["slots"]["2"]
        pids += [early, *(s.store.pid for s in launcher.slots.values())]
        assert launcher._resized([0, 1], 3) == [0, 1, 2]
        assert launcher.slots[2].store.pid == early and launcher._early == {}
        with store.StoreClient(launcher.slots[2].address) as client:  # it listens
            assert client.ping()
        launcher._prepare_stores(3, 4)  # a growth that never comes
        pids.append(launcher._early[3][0].pid)
    finally:
        launcher._teardown()
    assert alive(pids) == []
