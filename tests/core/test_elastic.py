"""Elastic training in one process: preemption, device failure, growth, compile cache, traces.

Every run trains the tiny GPT with gradient units on (data, fsdp) layouts, so the params after a
run with events must equal those of a run without any, bit for bit, and every step must see the
samples the fixed run saw.
"""

from __future__ import annotations

import ctypes
import os
import signal
import sys
import threading
import weakref

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.elastic import core
from tenplex_jax_models import LOGICAL_RULES, build_state
from tests.helpers import host_copy, tiny_init, tiny_samples, tiny_step

C = tj.ParallelConfig
STEPS = 6
BATCH = 24
STEP = tiny_step()


def make_job(
    configs: dict[int, tj.ParallelConfig] | None = None,
    *,
    compile_ahead: bool = False,
    exact_step_times: bool = True,
    **kwargs,
):
    dataset = tj.DatasetPTC(tiny_samples(), BATCH, seed=1)  # 100 samples: epochs end mid-batch

    def config(n):  # the contract: LayoutError when the rule has no layout for n devices
        if n not in configs:
            raise tj.errors.LayoutError(f"this test's rule has no layout for {n} devices")
        return configs[n]

    options = tj.elastic.JobOptions(compile_ahead=compile_ahead, exact_step_times=exact_step_times)
    job = tj.ElasticJob(
        LOGICAL_RULES,
        dataset,
        grad_units=8,
        config=None if configs is None else config,
        options=options,
        **kwargs,
    )
    state = job.start(tiny_init)
    return job, state, job.jit(STEP)


def train(job, state, step, events=None, steps=STEPS):
    """Train to ``steps``; ``events[i](job, state)`` runs before boundary ``i``; (state, samples)"""
    events = dict(events or {})
    seen = {}
    while job.step < steps:
        if job.step in events:
            events.pop(job.step)(job, state)
        state, batch = job.next(state)
        seen[job.step - 1] = job.samples[job.samples >= 0]
        state, _ = step(state, batch)
    job.close()
    return host_copy(state), [seen[i] for i in range(steps)]


@pytest.fixture(scope="module")
def fixed():
    """The reference: STEPS steps on 8 devices (data=8), no event."""
    job, state, step = make_job()
    assert job.ptc.config == C(data=8)
    return train(job, state, step)


def assert_same_run(got, want):
    state, samples = got
    want_state, want_samples = want
    for i, (a, b) in enumerate(zip(samples, want_samples)):
        np.testing.assert_array_equal(a, b, err_msg=f"samples of step {i}")
    assert np.unique(np.concatenate(samples[:4])).size == 4 * BATCH  # first epoch: no repeats
    for a, b in zip(state, want_state):
        np.testing.assert_array_equal(a, b)


def poison(state, device: int) -> int:
    """Overwrite every buffer ``device`` holds with 0xFF bytes (NaN): a read of it shows."""
    poisoned = 0
    for leaf in jax.tree.leaves(state):
        if jax.dtypes.issubdtype(leaf.dtype, jax.dtypes.extended):
            continue
        for shard in leaf.addressable_shards:
            if shard.device.id == device and shard.data.nbytes:
                raw = (ctypes.c_ubyte * shard.data.nbytes).from_address(
                    shard.data.unsafe_buffer_pointer()
                )
                np.frombuffer(raw, np.uint8)[:] = 0xFF
                if leaf.dtype == np.float32:  # the device's own buffer now reads NaN
                    assert np.isnan(np.asarray(shard.data)).all()
                poisoned += 1
    return poisoned


# -- plans around failed devices (pure) ----------------------------------------------------------


def abstract():
    return build_state("tiny", 3e-3, abstract=True)[1]


def test_plan_reads_replicas_never_a_failed_device():
    src = tj.PTC.of(abstract(), LOGICAL_RULES, C(data=2, fsdp=4), range(8))
    dst = tj.PTC.of(abstract(), LOGICAL_RULES, C(data=7), [0, 2, 3, 4, 5, 6, 7])
    plan = tj.make_plan(src, dst, failed=[1])
    sources = {p.src_device for leaf in plan.leaves for s in leaf.shards for p in s.pieces}
    assert 1 not in sources and 5 in sources  # device 1's fsdp shard comes from its replica, 5
    assert plan.bytes_moved > 0
    with pytest.raises(tj.errors.PlanError, match=r"uses failed devices \[1\]"):
        tj.make_plan(src, src, failed=[1])


def test_plan_without_replica_names_the_lost_leaves_and_boxes():
    src = tj.PTC.of(abstract(), LOGICAL_RULES, C(fsdp=8), range(8))
    dst = tj.PTC.of(abstract(), LOGICAL_RULES, C(data=7), range(7))
    with pytest.raises(tj.errors.LostShardsError, match=r"failed devices \[7\]") as caught:
        tj.make_plan(src, dst, failed=[7])
    lost = dict(caught.value.lost)
    sharded = {leaf.path for leaf in src.leaves if "fsdp" in str(leaf.spec)}
    assert set(lost) == sharded and sharded  # exactly the fsdp-sharded leaves; counters survive
    assert "model/tok_embed" in str(caught.value)
    leaf = src.leaf("model/tok_embed")
    assert list(lost["model/tok_embed"]) == [src.boxes(leaf)[7]]


def test_reshard_around_a_failed_device_never_reads_its_buffers():
    state = build_state("tiny", 3e-3)[1]
    src = tj.PTC.of(state, LOGICAL_RULES, C(data=2, fsdp=4), jax.devices())
    state = tj.place(state, src)
    want = host_copy(state)
    assert poison(state, 2) > 0
    dst = src.relayout(C(data=7), [d for d in jax.devices() if d.id != 2])
    state, _ = tj.reshard(state, tj.make_plan(src, tj.allocate(src, dst), failed=[2]))
    for a, b in zip(host_copy(state), want):
        np.testing.assert_array_equal(a, b)


def test_trace_format_refuses_bad_events_by_rule():
    from tenplex_jax._src.elastic.trace import ResourceTrace

    good = {"devices": 8, "steps": 10, "events": [{"step": 2, "kind": "fail", "count": 1}]}
    assert ResourceTrace.from_dict(good).events[0].count == 1
    for event, rule in [
        ({"step": 2, "kind": "reboot", "count": 1}, "kind must be one of"),
        ({"step": 12, "kind": "fail", "count": 1}, r"lie in 1\.\.9"),
        ({"step": 2, "kind": "fail"}, "exactly one of devices"),
        ({"step": 2, "kind": "offer", "devices": [8]}, r"lie in 0\.\.7"),
    ]:
        with pytest.raises(tj.errors.LayoutError, match=rule):
            ResourceTrace.from_dict(good | {"events": [event]})


def test_checkpoint_restart_pays_save_restore_compile_and_reruns_after_a_failure():
    from tenplex_jax._src.elastic.trace import RestartCosts, checkpoint_restart

    rec = lambda step, kind, decision: tj.elastic.EventRecord(
        step=step,
        kind=kind,
        source="trace",
        devices_before=[],
        devices_after=[],
        config_before="data=8",
        config_after="data=4",
        decision=decision,
    )
    records = [rec(10, "preempt", "shrink"), rec(25, "fail", "rebuild"), rec(30, "offer", "stay")]
    costs = RestartCosts(1.0, {"data=4": 2.0}, {"data=4": 5.0})
    out = checkpoint_restart(
        records,
        {"data=4": 0.5},
        costs,
        steps=40,
        checkpoint_every=20,
        useful_seconds=20.0,
        wall_seconds=30.0,
        elastic_overhead_seconds=4.0,
    )
    assert [e["seconds"] for e in out["events"]] == [8.0, 2.0 + 5.0 + 5 * 0.5, 0.0]
    assert out["events"][1]["lost_steps"] == 5  # steps 20..24 since the checkpoint at 20
    assert out["periodic_saves"] == 1  # step 20 (step 0's is start-up)
    assert out["seconds"] == 30.0 - 4.0 + 8.0 + 9.5 + 1.0
    assert out["goodput"] == 20.0 / out["seconds"]


# -- events in a training loop ------------------------------------------------------------------


def test_sigterm_shrinks_at_the_next_step_boundary_data_exactly_once(fixed):
    job, state, step = make_job()
    previous = signal.getsignal(signal.SIGTERM)
    timer = []

    def notice(job, state):  # the signal arrives from another thread, mid-step
        timer.append(threading.Timer(0.0, os.kill, (os.getpid(), signal.SIGTERM)))
        timer[0].start()
        timer[0].join()

    with job.handle_sigterm():
        got = train(job, state, step, {3: notice})
    assert signal.getsignal(signal.SIGTERM) is previous
    (record,) = job.records
    assert (record.kind, record.source, record.step, record.decision) == (
        "preempt",
        "SIGTERM",
        3,
        "shrink",
    )
    assert record.devices_after == list(range(7)) and record.config_after == "data=7"
    assert record.stall_seconds is not None and record.stall_seconds > record.reshard_seconds
    assert [c for _, _, c in job.step_log] == ["data=8"] * 3 + ["data=7"] * 3
    assert_same_run(got, fixed)


def test_failed_device_rebuilt_from_replicas_continues_bitwise(fixed):
    job, state, step = make_job({8: C(data=2, fsdp=4), 7: C(data=7)}, compile_ahead=True)

    def fail(job, state):
        poison(state, 7)  # its buffers are gone: a plan reading them would train on NaN
        job.fail([7])

    got = train(job, state, step, {2: fail})
    (record,) = job.records
    assert record.decision == "rebuild" and record.lost_steps == 0
    assert record.devices_after == list(range(7)) and record.bytes_moved > 0
    assert record.compile in ("cached", "waited")  # one device fewer was compiled ahead
    assert_same_run(got, fixed)


def test_no_replica_falls_back_to_the_last_checkpoint(fixed, tmp_path):
    # fsdp=4, not 8: on jax >= 0.11 XLA's CPU erf_inv (jax.random.normal) rounds differently on
    # shards 4 elements wide, so an init jitted into fsdp=8 of the tiny GPT is not bitwise the
    # data=8 one; fsdp=4 shards are 8 wide, and hold no replica either
    job, state, step = make_job(
        {4: C(fsdp=4), 3: C(data=3)},
        initial=range(4),
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=3,
    )
    got = train(job, state, step, {5: lambda job, state: job.fail([3])})
    (record,) = job.records
    assert record.decision == "restore" and record.lost_steps == 2  # steps 3, 4 rerun
    assert record.devices_after == [0, 1, 2]
    assert "model/tok_embed" in record.error and "held only by failed devices" in record.error
    assert [c[0] for c in job.checkpoints] == [0, 3]
    assert [i for i, _, _ in job.step_log] == list(range(STEPS))
    assert_same_run(got, fixed)  # the rerun steps saw the same samples: the cursor rewound


def test_a_preemption_s_checkpoint_is_saved_after_the_first_step_on_its_layout(fixed, tmp_path):
    """Saved beside the change's first step, the checkpoint would take that step's CPU: it is
    saved at the next boundary without a change (step 3), and a periodic one due at a change's
    boundary (step 4, with a second notice there) moves on to the next one too (step 5)."""
    # data=5, which no other test here compiles: one that counts the backend's compiles finds
    # data=6 in JAX's own cache when a test before it, in its process, compiled it
    job, state, step = make_job(
        {8: C(data=8), 7: C(data=7), 5: C(data=5)},
        checkpoint_dir=tmp_path / "ckpt",
        checkpoint_every=4,
    )
    preempt = lambda *d: lambda job, state: job.preempt(list(d))
    got = train(job, state, step, {2: preempt(7), 4: preempt(5, 6)})
    first, second = job.records
    assert [c[0] for c in job.checkpoints] == [0, 3, 5]
    assert first.commit_seconds == job.checkpoints[1][1] > 0
    assert second.commit_seconds == job.checkpoints[2][1] > 0
    assert tj.latest_checkpoint(tmp_path / "ckpt") == 5  # written whole (close waits for it)
    assert_same_run(got, fixed)


def test_no_replica_and_no_checkpoint_raises_the_clear_error():
    # the layout of the test above, whose init is compiled already; the failure comes at a
    # step boundary, so no step need compile
    job, state, _ = make_job({4: C(fsdp=4), 3: C(data=3)}, initial=range(4))
    state, _ = job.next(state)
    job.fail([3])
    with pytest.raises(tj.errors.LostShardsError, match="held only by failed devices"):
        job.next(state)
    job.close()


def test_returning_to_a_config_hits_the_compile_cache():
    backend = []  # XLA backend compiles, counted by JAX itself

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            backend.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    before_grow = []
    job, state, step = make_job()
    events = {
        1: lambda job, s: job.preempt([6, 7]),
        3: lambda job, s: (before_grow.append(len(backend)), job.offer([6, 7])),
    }
    try:
        train(job, state, step, events, steps=5)
    finally:
        jax.monitoring.unregister_event_duration_listener(listen)
    shrink, grow = job.records
    assert (shrink.compile, grow.compile) == ("compiled", "cached")
    assert grow.decision == "grow" and grow.devices_after == list(range(8))
    assert job.compiles == 2 and job.cache_hits == 1  # data=8, data=6; data=8 again from cache
    assert before_grow[0] >= 1  # the shrink compiled data=6 (data=8 may come from JAX's cache)
    assert len(backend) == before_grow[0]  # going back to data=8 compiled nothing


# -- the job as an object: what it owns, what it leaves alone ------------------------------------


def _compile_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("tenplex-compile")]


@pytest.mark.parametrize(
    "fields, match",
    [
        (
            {"method": "fast"},
            r"JobOptions.method must be one of \('plan', 'device_put'\), got 'fast'",
        ),
        ({"preempt_devices": 0}, r"JobOptions.preempt_devices is an int >= 1, got 0"),
        ({"batch_axes": "data"}, r"JobOptions.batch_axes is a sequence of axis names, got 'data'"),
        ({"batch_axes": ("data", "rows")}, r"distinct mesh axes among .*got \('data', 'rows'\)"),
        ({"compile_ahead": 1}, r"JobOptions.compile_ahead is a bool, got 1"),
        ({"log": "stdout"}, r"JobOptions.log is a callable"),
        (
            {"switch_interval": 0},
            r"JobOptions.switch_interval is seconds in \(0, 1\] or None, got 0",
        ),
        ({"switch_interval": "5ms"}, r"JobOptions.switch_interval is seconds .* got '5ms'"),
    ],
)
def test_job_options_refuse_a_bad_field_naming_it(fields, match):
    with pytest.raises(tj.errors.LayoutError, match=match):
        tj.elastic.JobOptions(**fields)


@pytest.mark.parametrize("program", ["", 3, b"gpt/v1"])
def test_jit_refuses_a_program_name_that_is_not_a_non_empty_str(program):
    job = tj.ElasticJob(LOGICAL_RULES, tj.DatasetPTC(tiny_samples(), BATCH, seed=1))
    with pytest.raises(tj.errors.LayoutError, match=f"job.jit's program is .* got {program!r}"):
        job.jit(STEP, program=program)
    assert job.steps_cache is None  # nothing made


def test_one_process_builds_an_elastic_job_unless_a_runtime_says_what_it_builds():
    dataset = tj.DatasetPTC(np.zeros((8, 2), np.float32), global_batch=8)
    options = tj.elastic.JobOptions(batch_axes=["fsdp"])
    assert options.batch_axes == ("fsdp",)  # frozen and hashable, as the record
    with tj.ElasticJob((), dataset, options=options) as job:
        assert type(job) is tj.ElasticJob and job.launched is False
        assert (job.process_index, job.generation, job.run_dir, job.restored) == (0, 0, None, None)
    with pytest.raises(tj.errors.LayoutError, match=r"options= is a tj.elastic.JobOptions"):
        tj.ElasticJob((), dataset, options={"compile_ahead": False})

    class Outer:
        def __init__(self, *args, **kwargs):
            self.args = args, kwargs

    class Inner(Outer):
        pass

    with tj.elastic.use_job_class(Outer):
        outer = tj.ElasticJob((), dataset, grad_units=4)
        with tj.elastic.use_job_class(Inner):  # the innermost wins, until it is left
            inner = tj.ElasticJob((), dataset)
        again = tj.ElasticJob((), dataset)
    assert (type(outer), type(inner), type(again)) == (Outer, Inner, Outer)
    assert outer.args == (((), dataset), {"grad_units": 4})  # the same arguments
    with tj.ElasticJob((), dataset) as job:  # after the block: the one-process job again
        assert type(job) is tj.ElasticJob


def test_leaving_the_job_stops_its_compile_threads_and_changes_no_jax_setting():
    names = [
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
        "jax_enable_x64",
        "jax_default_matmul_precision",
    ]
    before = {n: getattr(jax.config, n) for n in names}
    assert not _compile_threads()
    with tj.ElasticJob(LOGICAL_RULES, tj.DatasetPTC(tiny_samples(), BATCH), grad_units=8) as job:
        state = job.start(tiny_init)
        step = job.jit(STEP)  # compile-ahead on: the guess of one device fewer compiles
        state, batch = job.next(state)
        step(state, batch)
        assert _compile_threads()
    assert not _compile_threads()
    assert {n: getattr(jax.config, n) for n in names} == before


def test_steps_run_asynchronously_but_the_first_on_each_layout(fixed):
    job, state, step = make_job(exact_step_times=False)
    got = train(job, state, step, {3: lambda job, s: job.preempt([7])})
    assert [(i, c) for i, _, c in job.step_log] == [(0, "data=8"), (3, "data=7")]
    (record,) = job.records
    assert record.stall_seconds is not None  # the first step on data=7 was waited for
    assert_same_run(got, fixed)


def test_a_waited_step_reads_the_next_batch_beside_it(fixed, monkeypatch):
    """With exact step times the host reads the next global batch while the step it waits for
    runs; a boundary hands it out only for the layout and the data position it was read for."""
    job, state, step = make_job()
    reads = []

    def device_batch(dataset, i, layout, mesh, axes):
        reads.append((i, mesh.devices.size))
        return read(dataset, i, layout, mesh, axes)

    read = core.device_batch
    monkeypatch.setattr(core, "device_batch", device_batch)
    seen = {}

    def boundary(state):
        state, batch = job.next(state)
        seen.setdefault(job.step - 1, job.samples[job.samples >= 0])
        return state, batch

    state, batch = boundary(state)
    state, _ = step(state, batch)
    assert reads == [(0, 8), (1, 8)]  # step 1 was read while step 0 ran ...
    state, batch = boundary(state)
    assert reads == [(0, 8), (1, 8)]  # ... and is not read again
    state, _ = step(state, batch)
    job.preempt([7])
    state, batch = boundary(state)  # onto 7 devices: step 2, read for 8, is read again
    assert reads == [(0, 8), (1, 8), (2, 8), (2, 7)] and batch.mesh.devices.size == 7
    state, _ = step(state, batch)
    rewound = job.dataset.state()  # at step 3
    state, batch = boundary(state)
    state, _ = step(state, batch)
    job.dataset.restore(rewound)  # as a checkpoint fallback rewinds it: step 4 was read
    state, batch = boundary(state)
    assert reads[-3:] == [(3, 7), (4, 7), (3, 7)]
    np.testing.assert_array_equal(job.samples[job.samples >= 0], fixed[1][3])
    job.close()
    for i in range(4):
        np.testing.assert_array_equal(seen[i], fixed[1][i], err_msg=f"samples of step {i}")


def test_the_arrays_a_step_is_done_with_are_freed_while_the_next_step_runs():
    """The batch a step read and the state it donated are freed once the next step has been
    dispatched, not where the loop drops them (each free lets go of the GIL, which a background
    lowering then holds); leaving the job frees the last ones."""
    job, state, step = make_job()
    freed = {}

    def note(what):
        frame = sys._getframe(1)
        while frame is not None and frame.f_code is not core._JobCore._run.__code__:
            frame = frame.f_back
        dispatched = frame is not None and "dispatched" in frame.f_locals
        freed[what] = "while a step runs" if dispatched else "elsewhere"

    for i in range(3):
        state, batch = job.next(state)
        weakref.finalize(batch, note, f"batch {i}")
        weakref.finalize(jax.tree.leaves(state)[0], note, f"state {i}")
        state, _ = step(state, batch)
    del batch
    assert freed == {
        "batch 0": "while a step runs",
        "state 0": "while a step runs",
        "batch 1": "while a step runs",
        "state 1": "while a step runs",
    }
    job.close()
    assert freed["batch 2"] == freed["state 2"] == "elsewhere"


def test_redeploy_moves_onto_exactly_the_given_devices(fixed):
    job, state, step = make_job()
    events = {
        2: lambda job, s: job.redeploy([0, 1, 2, 3]),
        4: lambda job, s: job.redeploy([2, 3, 4, 5, 6, 7]),
    }
    got = train(job, state, step, events)
    assert [(r.decision, sorted(r.devices_after), r.config_after) for r in job.records] == [
        ("move", [0, 1, 2, 3], "data=4"),
        ("move", [2, 3, 4, 5, 6, 7], "data=6"),
    ]
    assert job.records[1].bytes_kept > 0  # devices 2 and 3 kept their replicas
    assert_same_run(got, fixed)
    with pytest.raises(tj.errors.LayoutError, match=r"redeploy names the devices.*unusable: \[9\]"):
        job.devices_after("redeploy", [0, 9])


def test_start_resumes_from_the_latest_checkpoint_with_the_data_cursor(fixed, tmp_path):
    job, state, step = make_job(checkpoint_dir=tmp_path, checkpoint_every=2)
    train(job, state, step, steps=3)  # saves steps 0 and 2
    assert [s for s, _ in job.checkpoints] == [0, 2]
    job, state, step = make_job(checkpoint_dir=tmp_path, checkpoint_every=2)
    assert job.resumed == 2 and job.step == 2
    seen = {}
    while job.step < STEPS:
        state, batch = job.next(state)
        seen[job.step - 1] = job.samples[job.samples >= 0]
        state, _ = step(state, batch)
    job.finish(state)  # a final checkpoint of the last step
    job.close()
    assert [s for s, _ in job.checkpoints] == [2, 4, 6]
    for i in range(2, STEPS):
        np.testing.assert_array_equal(seen[i], fixed[1][i])
    for a, b in zip(host_copy(state), fixed[0]):
        np.testing.assert_array_equal(a, b)
    assert tj.latest_checkpoint(tmp_path) == STEPS


def test_a_compile_ahead_that_failed_is_compiled_again_when_its_layout_is_needed(monkeypatch):
    job, _, _ = make_job()
    cache, target = job.steps_cache, job._target(tuple(range(6)))
    layout, real, calls = job._layout(target.config), type(cache).compile, []

    def flaky(self, ptc, layout, ahead=False, ticket=None):  # the compile ahead fails, once
        calls.append(ahead)
        if ahead:
            raise RuntimeError("injected: the compile ahead failed")
        return real(self, ptc, layout, ahead, ticket)

    monkeypatch.setattr(type(cache), "compile", flaky)
    with pytest.raises(RuntimeError, match="injected"):
        cache.get(target, layout, ahead=True).result()
    assert cache.status(cache.key(target, layout)) == "failed"
    assert cache.get(target, layout, ahead=False).result().executable is not None
    assert calls == [True, False] and cache.status(cache.key(target, layout)) == "ready"
    job.close()
