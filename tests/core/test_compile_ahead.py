"""Announced layouts are ready: a change known in advance finds its step compiled, for the exact
layout (config, device order, batch layout) it picks, and no guess takes its compile's place."""

from __future__ import annotations

import dataclasses
import sys
import threading
import time

import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.elastic.events import Event
from tenplex_jax._src.elastic.steps import _Turns
from tenplex_jax._src.elastic.trace import upcoming
from tenplex_jax_models import LOGICAL_RULES
from tests.helpers import host_copy, tiny_init, tiny_samples, tiny_step

C = tj.ParallelConfig
STEP = tiny_step()
# a layout for every count the trace or a guess of one device fewer reaches: the old compile-ahead
# compiled the guesses (7 devices, then 5) beside the announced layouts
CONFIGS = {8: C(data=2, fsdp=4), 7: C(data=7), 6: C(data=3, fsdp=2), 5: C(data=5), 4: C(fsdp=4)}
CONFIGS[3] = C(data=3)
TRACE = tj.elastic.ResourceTrace.from_dict(
    {
        "devices": 8,
        "steps": 6,
        "events": [
            {"step": 3, "kind": "preempt", "devices": [6, 7]},  # -> 0..5, data=3,fsdp=2
            {"step": 5, "kind": "redeploy", "devices": [2, 3, 4, 5]},  # fsdp=4: 2..5 keep some
        ],
    }
)


def wait_compiled(job, devices, timeout=120.0) -> bool:
    """Train as slowly as it takes: wait until the step of the layout the job would pick on
    ``devices`` (``job.is_compiled``) is ready; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not job.is_compiled(devices):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.01)
    return True


def test_replayed_changes_find_the_exact_layout_compiled_ahead_and_no_guess():
    job = tj.ElasticJob(
        LOGICAL_RULES,
        tj.DatasetPTC(tiny_samples(), 24, seed=1),
        grad_units=8,
        config=CONFIGS.__getitem__,
        options=tj.elastic.JobOptions(compile_ahead=True, exact_step_times=True),
    )
    state = job.start(tiny_init)
    step = job.jit(STEP)
    submitted, ready = [], []

    def on_step(job, metrics):
        if job.step == 1:  # both changes are announced before the first one is posted
            first, second = upcoming(job, TRACE.events)
            after_first = job._target(first)
            keys = [job._key(after_first), job._key(job._target(second, after_first))]
            submitted.extend(job.steps_cache.status(k) is not None for k in keys)
        for e in TRACE.events:
            if e.step == job.step:  # the step before a change: its key must become ready
                ready.append(wait_compiled(job, job.devices_after(e.kind, e.devices, e.count)))

    with job:
        tj.elastic.replay(job, state, step, TRACE, on_step=on_step)
    assert submitted == [True, True]
    assert ready == [True, True], "the layout compiled ahead is not the one the change uses"
    assert [(r.decision, r.compile) for r in job.records] == [
        ("shrink", "cached"),
        ("move", "cached"),
    ]
    futures = {(str(c), ids): f for (c, ids, _), f in job.steps_cache._futures.items()}
    for r in job.records:  # the first step of each change ran what compile-ahead had compiled
        assert futures[r.config_after, tuple(r.devices_after)].result().ahead
    used = {(str(CONFIGS[8]), tuple(range(8)))}  # the initial layout
    used |= {(r.config_after, tuple(r.devices_after)) for r in job.records}
    compiled = set(futures)
    # every compile was of a layout the job then used: no stale device order, and no guess while
    # a change was announced (the run ends at the first step after the last change, before one)
    assert compiled == used and job.compiles == len(used), (sorted(compiled), sorted(used))


@pytest.mark.parametrize(
    "events, want",
    [
        ([], []),
        ([(2, "preempt", None, 2)], [(0, 1, 2, 3, 4, 5)]),
        # two events at one boundary are one change; the third boundary is not announced yet
        (
            [(2, "preempt", None, 2), (2, "offer", [7], None), (4, "fail", [0], None)]
            + [(6, "redeploy", [1], None)],
            [(0, 1, 2, 3, 4, 5, 7), (1, 2, 3, 4, 5, 7)],
        ),
    ],
)
def test_upcoming_gives_the_devices_after_each_of_the_next_two_changes(events, want):
    dataset = tj.DatasetPTC(np.zeros((8, 2), np.float32), global_batch=8)
    job = tj.ElasticJob((), dataset, config=lambda n: C(data=n))
    job.start({"w": np.zeros((8, 2), np.float32)})
    trace = [
        tj.elastic.TraceEvent(s, k, None if d is None else tuple(d), c) for s, k, d, c in events
    ]
    assert upcoming(job, trace) == want


def test_upcoming_starts_after_the_events_still_waiting_for_their_step():
    """An event posted but not applied (a notice waiting for its layout's step) is the next
    change: the ones after it are counted from its devices."""
    dataset = tj.DatasetPTC(np.zeros((8, 2), np.float32), global_batch=8)
    job = tj.ElasticJob((), dataset, config=lambda n: C(data=n))
    job.start({"w": np.zeros((8, 2), np.float32)})
    job.preempt([6, 7])  # posted; no boundary has run
    later = [tj.elastic.TraceEvent(5, "preempt", (4, 5)), tj.elastic.TraceEvent(9, "offer", (6,))]
    assert upcoming(job, later) == [(0, 1, 2, 3, 4, 5), (0, 1, 2, 3)]


def test_a_change_asked_about_before_is_not_allocated_again(monkeypatch):
    """The device order of a change's layout (``allocate``: a linear program, milliseconds) is
    solved once per (layout before, config, devices): compile-ahead and ``is_compiled`` ask for
    it, and the change then moves onto that very layout without solving it again."""
    import tenplex_jax._src.elastic.job as job_module

    solved = []
    real = job_module.allocate

    def counted(src, dst):
        solved.append((src.device_ids, dst.config))
        return real(src, dst)

    job = tj.ElasticJob(
        LOGICAL_RULES,
        tj.DatasetPTC(tiny_samples(), 24, seed=1),
        config=CONFIGS.__getitem__,
        options=tj.elastic.JobOptions(compile_ahead=False),
    )
    with job:
        state = job.start(tiny_init)
        job.jit(STEP)
        monkeypatch.setattr(job_module, "allocate", counted)
        before = job.ptc
        assert not job.is_compiled(range(6))
        assert job.is_compiled(range(6)) is False and len(solved) == 1
        job.preempt([6, 7])
        state, _ = job.next(state)
        assert len(solved) == 1, solved  # the change took the layout solved when asked
        fresh = real(before, before.relayout(CONFIGS[6], [job.devices[i] for i in range(6)]))
        assert job.ptc == fresh and job.ptc.config == CONFIGS[6]
        assert not job.is_compiled(range(4))  # from the new layout: solved anew
        assert solved[1:] == [(job.ptc.device_ids, CONFIGS[4])]


@pytest.mark.parametrize("option", [tj.elastic.JobOptions.switch_interval, None])
def test_a_background_compile_lowers_the_switch_interval_and_puts_it_back(option):
    """While a step traces on a compile thread, Python's switch interval is at most the option
    (the job's loop would otherwise wait up to 5 ms for the GIL at each JAX call); when no
    compile runs it is the user's again, after a failed compile too, and a value the user set
    meanwhile is kept. None leaves it alone."""
    seen, user = [], sys.getswitchinterval()

    def step(state, batch):  # its body runs at trace time, on the compile's thread
        seen.append(sys.getswitchinterval())
        if len(seen) == 2:
            raise ValueError("a step that fails to trace")
        if len(seen) == 3:
            sys.setswitchinterval(0.002)  # the user's own change, during a compile
        return state, {}  # no work: what is tested happens while it traces

    options = tj.elastic.JobOptions(compile_ahead=True, switch_interval=option)
    job = tj.ElasticJob(
        LOGICAL_RULES, tj.DatasetPTC(tiny_samples(), 24, seed=1), grad_units=8, options=options
    )

    def ahead(ids) -> None:  # compile the layout of ``ids`` on a compile thread; wait for it
        target = job._target(tuple(ids))
        job.steps_cache.get(target, job._layout(target.config), ahead=True).exception()

    sys.setswitchinterval(0.005)
    try:
        with job:
            job.start(tiny_init)
            job.jit(step)  # the first layout compiles on a compile thread
            ahead(range(8))
            assert sys.getswitchinterval() == pytest.approx(0.005)
            ahead(range(4))  # fails to trace
            assert sys.getswitchinterval() == pytest.approx(0.005)
            ahead(range(6))  # the user changes the setting while it traces
            assert sys.getswitchinterval() == pytest.approx(0.002)
    finally:
        sys.setswitchinterval(user)
    want = 0.005 if option is None else option
    assert seen == pytest.approx([want] * 3)


def _notice_job(step, notice: float = 60.0, compile_ahead: bool = True):
    """A job whose notices wait ``notice`` seconds; without ``compile_ahead`` it compiles no
    guess (a notice still queues its own layout's step)."""
    options = tj.elastic.JobOptions(
        notice_seconds=notice, exact_step_times=True, compile_ahead=compile_ahead
    )
    job = tj.ElasticJob(
        LOGICAL_RULES, tj.DatasetPTC(tiny_samples(), 24, seed=1), grad_units=8, options=options
    )
    return job, job.start(tiny_init), job.jit(step)


def test_a_notice_trains_on_its_devices_until_the_new_layout_is_compiled():
    """With ``notice_seconds``, a preemption notice whose layout is not compiled yet queues it
    ahead and the job trains on all its devices; the first boundary after the compile is ready
    moves the job, with nothing to wait for. The run's params equal, bit for bit, a run that
    never changed devices (data parallelism over gradient units), and every batch is the same."""
    gate = threading.Event()  # holds the six-device step's trace until the test lets it go

    def step(state, batch):
        if batch.mesh.devices.size == 6:
            assert gate.wait(120), "the test never released the compile"
        return STEP(state, batch)

    job, state, run = _notice_job(step)
    samples = []
    with job:
        for i in range(8):
            if i == 2:
                job.preempt([6, 7])
            if i == 5:  # three boundaries waited: release the compile, wait until it is ready
                gate.set()
                assert wait_compiled(job, range(6))
            state, batch = job.next(state)
            if i < 5:
                assert list(job.ptc.device_ids) == list(range(8)), i  # trains on, on all 8
                assert job.records == []
            state, _ = run(state, batch)
            samples.append(job.samples[job.samples >= 0])  # the real rows, in order
        [record] = job.records
        got = host_copy(state)
    assert (record.step, record.decision, record.notice_steps) == (5, "shrink", 3)
    assert record.compile == "cached"  # ready at the boundary: nothing was waited for
    assert record.devices_after == list(range(6))

    fixed, state, run = _notice_job(STEP, compile_ahead=False)  # the bits of a fixed run
    with fixed:
        for i in range(8):
            state, batch = fixed.next(state)
            np.testing.assert_array_equal(fixed.samples[fixed.samples >= 0], samples[i])
            state, _ = run(state, batch)
        want = host_copy(state)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")


def test_which_events_wait_for_their_step():
    """Only a notice or a redeploy waits, alone in the queue, within its time, for a step that
    is not ready; a failure, an event with another behind it, one past its time or a job without
    a notice applies at the next boundary, as does one whose step is compiled."""
    gate = threading.Event()

    def step(state, batch):  # no work: only whether an event waits for it is tested
        if batch.mesh.devices.size == 4:
            assert gate.wait(120)
        return state, {}

    job, _, _ = _notice_job(step)
    with job:
        cases = {
            "notice": ([Event("preempt", (4, 5, 6, 7))], True),
            "redeploy": ([Event("redeploy", (0, 1, 2, 3))], True),
            "failure": ([Event("fail", (4, 5, 6, 7))], False),
            "another behind it": ([Event("preempt", (4, 5, 6, 7)), Event("fail", (7,))], False),
            "past its time": (
                [Event("preempt", (4, 5, 6, 7), posted=time.perf_counter() - 61)],
                False,
            ),
            "no change": ([Event("redeploy", tuple(range(8)))], False),
        }
        for name, (queued, waits) in cases.items():
            job._pending.clear()
            job._notice = None
            job._pending.extend(queued)
            assert job._waits(queued[0]) is waits, name
        gate.set()
        assert wait_compiled(job, range(4))
        job._pending.clear()
        job._notice = None
        job._pending.append(Event("preempt", (4, 5, 6, 7)))
        assert not job._waits(job._pending[0]), "compiled"
        job._pending.clear()
    quiet, _, _ = _notice_job(step, notice=0.0, compile_ahead=False)
    with quiet:
        quiet._pending.append(Event("preempt", (4, 5, 6, 7)))
        assert not quiet._waits(quiet._pending[0])
    with pytest.raises(tj.errors.LayoutError, match=r"JobOptions.notice_seconds is seconds >= 0"):
        dataclasses.replace(quiet.options, notice_seconds=-1)


# -- background lowerings take turns ------------------------------------------------------------


def _lower_in_threads(turns: _Turns, tickets: list[int], order: list[int]) -> list:
    """A thread per ticket, started in the order given, each recording its turn."""

    def lower(ticket):
        with turns.turn(ticket):
            order.append(ticket)

    threads = [threading.Thread(target=lower, args=(t,)) for t in tickets]
    for thread in threads:
        thread.start()
    return threads


def _started(turns: _Turns, *tickets: int) -> bool:
    with turns._changed:
        return turns._changed.wait_for(lambda: set(tickets) <= turns._started, timeout=30)


def test_background_lowerings_take_turns_in_the_order_they_were_asked_for():
    turns, order = _Turns(grace=60.0), []
    first, second, third = (turns.ticket() for _ in range(3))
    threads = _lower_in_threads(turns, [third, second], order)
    assert _started(turns, third, second) and order == []  # both wait for the first
    threads += _lower_in_threads(turns, [first], order)
    for thread in threads:
        thread.join(timeout=30)
    assert order == [first, second, third]
    with turns.turn(None):  # a compile on the caller's thread never waits
        order.append("now")
    assert turns._open == set() and not turns._busy


def test_a_dropped_ticket_or_one_that_never_starts_holds_no_one_up():
    turns, order = _Turns(grace=60.0), []
    cancelled, waiting = turns.ticket(), turns.ticket()
    (thread,) = _lower_in_threads(turns, [waiting], order)
    assert _started(turns, waiting) and order == []
    turns.drop(cancelled)  # its compile was cancelled before it started
    thread.join(timeout=30)
    assert order == [waiting]
    impatient, order = _Turns(grace=0.01), []
    queued, ready = impatient.ticket(), impatient.ticket()  # queued: behind a busy thread
    (thread,) = _lower_in_threads(impatient, [ready], order)
    thread.join(timeout=30)
    assert order == [ready] and impatient._open == {queued}
