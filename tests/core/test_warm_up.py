"""A step compiled ahead is run once on zeros before its change (``JobOptions.warm_up``), so the
first step after the change does not pay the executable's one-time work; training keeps its
bits, the records say which steps were warmed, and a warm-up that cannot run is skipped."""

from __future__ import annotations

import threading
import types

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.elastic import steps as steps_module
from tenplex_jax._src.elastic.steps import Compiled
from tenplex_jax._src.elastic.trace import upcoming
from tenplex_jax_models import LOGICAL_RULES
from tests.core.test_compile_ahead import CONFIGS, TRACE
from tests.helpers import host_copy, tiny_init, tiny_samples, tiny_step

STEP = tiny_step()


def job_of(**options) -> tj.ElasticJob:
    return tj.ElasticJob(
        LOGICAL_RULES,
        tj.DatasetPTC(tiny_samples(), 24, seed=1),
        grad_units=8,
        config=CONFIGS.__getitem__,
        options=tj.elastic.JobOptions(exact_step_times=True, **options),
    )


def replayed(warm_up: bool):
    """The trace replayed, each change's step waited for before it: (job, final state on the
    host, losses, samples, the first layout's key)."""
    job = job_of(warm_up=warm_up)
    state = job.start(tiny_init)
    step = job.jit(STEP)
    first = job._key(job.ptc)
    losses, samples = [], []

    def on_step(job, metrics):
        losses.append(np.asarray(metrics["loss"]))
        samples.append(job.samples.copy())
        for e in TRACE.events:
            if e.step == job.step:  # the next boundary changes: its step, ready (and warmed)
                target = job._target(upcoming(job, [e])[0])
                job.steps_cache._futures[job._key(target)].result(timeout=300)

    with job:
        state = tj.elastic.replay(job, state, step, TRACE, on_step=on_step)
        host = host_copy(state)
    return job, host, losses, samples, first


def test_a_step_compiled_ahead_is_warmed_up_before_its_change_and_the_bits_are_the_same():
    warm, warm_state, warm_losses, warm_samples, first = replayed(warm_up=True)
    cold, cold_state, cold_losses, cold_samples, _ = replayed(warm_up=False)
    assert [r.compile for r in warm.records] == ["cached", "cached"]
    assert all(r.warm_up_seconds is not None and r.warm_up_seconds > 0 for r in warm.records)
    # the two announced layouts, and maybe the guess after the last change
    assert warm.steps_cache.warm_ups >= 2
    assert (
        warm.steps_cache._futures[first].result().warm_up_seconds is None
    )  # the first layout's step is not run twice
    assert [r.compile for r in cold.records] == ["cached", "cached"]
    assert [r.warm_up_seconds for r in cold.records] == [None, None]
    assert cold.steps_cache.warm_ups == 0
    # the warm-up touched neither the state nor the data: the same bits, the same samples
    for got, want in zip(warm_state, cold_state, strict=True):
        np.testing.assert_array_equal(got, want)
    np.testing.assert_array_equal(warm_losses, cold_losses)
    for got, want in zip(warm_samples, cold_samples, strict=True):
        np.testing.assert_array_equal(got, want)


@pytest.fixture(scope="module")
def started():
    """A job started on 8 devices and its step cache; the layout of 6 devices to warm."""
    job = job_of(compile_ahead=False)
    state = job.start(tiny_init)
    job.jit(STEP)
    target = job._target((0, 1, 2, 3, 4, 5))
    with job:
        yield job, state, target


def test_a_warm_up_runs_the_step_on_zeros_laid_out_for_its_layout_under_the_dispatch_lock(
    started,
):
    job, _, target = started
    cache, layout = job.steps_cache, job._layout(target.config)
    seen = []

    def executable(state, batch):  # stands for the compiled step: what it was called with
        seen.append((cache.dispatch.locked(), state, batch))
        return state, {}

    before = cache.warm_ups
    step = cache.warm_up(target, layout, Compiled(executable, 0.0, True))
    assert step.warm_up_seconds is not None and cache.warm_ups == before + 1
    [(locked, state, batch)] = seen
    assert locked, "a warm-up's call must be in one order with the job's steps"
    shardings = target.shardings(target.mesh(job.steps_cache.devices))
    for leaf, sharding in zip(jax.tree.leaves(state), jax.tree.leaves(shardings), strict=True):
        assert leaf.sharding.is_equivalent_to(sharding, leaf.ndim)
        np.testing.assert_array_equal(np.asarray(leaf), 0)
    assert batch.layout == layout and batch.mesh == target.mesh(job.steps_cache.devices)
    for leaf in jax.tree.leaves(batch.data):
        assert leaf.shape[0] == layout.rows
        np.testing.assert_array_equal(np.asarray(leaf), 0)
    np.testing.assert_array_equal(np.asarray(batch.weights), 1)  # no row is padding


def test_the_jobs_steps_are_called_under_the_dispatch_lock(started):
    job, state, _ = started
    calls = []

    class Recording:  # the cache's lock, noting each time a step's call takes it
        def __init__(self, lock):
            self.lock = lock

        def __enter__(self):
            self.lock.acquire()
            calls.append(threading.current_thread().name)

        def __exit__(self, *exc):
            self.lock.release()

    job.steps_cache.dispatch = Recording(job.steps_cache.dispatch)
    try:
        step = job._run
        for _ in range(2):
            state, batch = job.next(state)
            state, _ = step(state, batch)
    finally:
        job.steps_cache.dispatch = job.steps_cache.dispatch.lock
    assert calls == [threading.current_thread().name] * 2


def test_a_layout_over_another_process_is_not_warmed_up(started, monkeypatch):
    job, _, target = started
    cache = job.steps_cache
    called = []
    step = Compiled(lambda *args: called.append(args), 0.0, True)
    before = cache.warm_ups
    monkeypatch.setattr(jax, "process_index", lambda: 1)  # the devices are process 0's
    assert cache.warm_up(target, job._layout(target.config), step) is step
    assert called == [] and cache.warm_ups == before


def test_a_warm_up_that_fails_leaves_the_step_as_it_is_and_says_why(started, monkeypatch):
    job, _, target = started
    cache = job.steps_cache
    lines = []
    monkeypatch.setattr(cache, "log", lines.append)

    def executable(state, batch):
        raise RuntimeError("no memory for a second state")

    step = Compiled(executable, 0.0, True)
    before = cache.warm_ups
    assert cache.warm_up(target, job._layout(target.config), step) is step
    assert cache.warm_ups == before
    [line] = lines
    assert "not warmed up" in line and "no memory for a second state" in line
    assert str(target.config) in line


def test_warm_up_is_a_bool():
    with pytest.raises(tj.errors.LayoutError, match=r"JobOptions\.warm_up is a bool, got 1"):
        tj.elastic.JobOptions(warm_up=1)


def test_a_warm_up_that_would_crowd_a_devices_memory_is_skipped(started, monkeypatch):
    """Where devices keep memory statistics (a GPU's), the step's arguments, outputs and
    temporaries (its executable's memory analysis) must fit in half of the fullest device's
    free memory; else the warm-up is skipped and the log says why. The CPU keeps none."""
    job, _, target = started
    cache, layout = job.steps_cache, job._layout(target.config)
    step = cache.get(target, layout, ahead=False).result()
    mesh = target.mesh(cache.devices)
    m = step.executable.memory_analysis()
    need = m.argument_size_in_bytes + m.output_size_in_bytes - m.alias_size_in_bytes
    need += m.temp_size_in_bytes
    assert need > 0 and steps_module._crowded(step, mesh) is None  # CPU: no statistics

    class Device:  # a device whose statistics say how much of it is in use
        def __init__(self, in_use):
            self.in_use = in_use

        def memory_stats(self):
            return {"bytes_limit": 4 * need, "bytes_in_use": self.in_use}

    def fake(in_use):
        return types.SimpleNamespace(devices=np.array([Device(0), Device(in_use)]))

    assert steps_module._crowded(step, fake(0)) is None  # 2x the need free
    why = steps_module._crowded(step, fake(3 * need))  # the fullest has 1x free
    assert f"{need:,} bytes a device" in why and f"the {need:,} bytes free" in why
    lines, called = [], []
    monkeypatch.setattr(cache, "log", lines.append)
    monkeypatch.setattr(steps_module, "_crowded", lambda step, mesh: "crowded")
    skipped = Compiled(lambda *args: called.append(args), 0.0, True)
    assert cache.warm_up(target, layout, skipped) is skipped and not called
    assert lines == [
        f"the step for {target.config} on {list(target.device_ids)} not warmed up: crowded"
    ]
