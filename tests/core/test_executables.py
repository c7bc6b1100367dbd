"""The executable cache: a layout's step compiled once, then loaded, by a new cache or a new job.

Every step is the tiny GPT's AdamW train step. A load must give the same bits as the compile it
replaces, and no XLA compile (counted by JAX itself); an entry that is corrupt, truncated, not
an entry, or from another JAX must be a miss that recompiles and rewrites; a directory the job
cannot write must cost only the cache.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import threading

import jax
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src import compat
from tenplex_jax._src.batch import BATCH_AXES, Batch, device_batch
from tenplex_jax._src.data import BatchLayout
from tenplex_jax._src.elastic import executables
from tenplex_jax._src.elastic.executables import HEADER, ExecutableCache
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.ptc import PTC
from tenplex_jax_models import LOGICAL_RULES, build_state
from tests.helpers import host_copy, tiny_init, tiny_samples, tiny_step

C = tj.ParallelConfig
BATCH = 24
CONFIG = C(data=8)  # the job's own on 8 devices: its compile there is JAX's in-memory hit
STEP = tiny_step()


class Layout:
    """The one layout the StepCache tests compile: its PTC, batch layout, sample and batch."""

    def __init__(self):
        self.dataset = tj.DatasetPTC(tiny_samples(), BATCH, seed=1)
        self.sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
        abstract = build_state("tiny", 3e-3, abstract=True)[1]
        self.ptc = PTC.of(abstract, LOGICAL_RULES, CONFIG, jax.devices())
        self.layout = BatchLayout(BATCH, ranks=8, grad_units=8)
        self.mesh = self.ptc.mesh(jax.devices())

    def steps(self, directory, **kwargs) -> StepCache:
        cache = ExecutableCache(directory, **kwargs)
        return StepCache(STEP, self.sample, jax.devices(), executables=cache)

    def run(self, steps: StepCache) -> list[np.ndarray]:
        """One step from the initial state on the first batch, with the step ``steps`` has."""
        compiled = steps.get(self.ptc, self.layout, ahead=False).result()
        state = jax.jit(tiny_init, out_shardings=self.ptc.shardings(self.mesh))()
        data, weights, _ = device_batch(self.dataset, 0, self.layout, self.mesh)
        batch = Batch(data, weights, self.layout, self.mesh, BATCH_AXES)
        return host_copy(compiled.executable(state, batch))


@pytest.fixture(scope="module")
def stored(tmp_path_factory):
    """A directory holding the layout's executable, and the bits its compile gave."""
    layout, directory = Layout(), tmp_path_factory.mktemp("executables")
    steps = layout.steps(directory)
    want = layout.run(steps)
    steps.close()  # waits for the entry's write
    assert (steps.compiles, steps.loads, steps.executables.writes) == (1, 0, 1)
    return layout, directory, want


@pytest.fixture
def backend_compiles():
    """XLA backend compiles while the test runs, as JAX itself reports them."""
    seen = []

    def listen(event, seconds, **_):
        if event == "/jax/core/compile/backend_compile_duration":
            seen.append(seconds)

    jax.monitoring.register_event_duration_secs_listener(listen)
    yield seen
    jax.monitoring.unregister_event_duration_listener(listen)


def copy(directory: pathlib.Path, tmp_path: pathlib.Path) -> pathlib.Path:
    return pathlib.Path(shutil.copytree(directory, tmp_path / "executables"))


def entry(directory: pathlib.Path) -> pathlib.Path:
    (path,) = directory.glob("*.xla")
    return path


def assert_same(got, want):
    assert len(got) == len(want)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)


# -- a StepCache over the directory ---------------------------------------------------------------


def test_a_new_step_cache_loads_the_layout_instead_of_compiling(stored, tmp_path, backend_compiles):
    layout, directory, want = stored
    steps = layout.steps(copy(directory, tmp_path))
    got = layout.run(steps)
    steps.close()
    assert (steps.compiles, steps.loads) == (0, 1)
    (compiled,) = steps.done()
    assert compiled.loaded and not compiled.ahead
    assert_same(got, want)  # the loaded executable computes the compiled one's bits
    assert not backend_compiles  # XLA compiled nothing (the state's init is JAX's in-memory hit)


@pytest.mark.parametrize(
    "damage, reason",
    [
        (lambda data: data[:-1] + bytes([data[-1] ^ 0x01]), "sha256 does not match"),
        (lambda data: data[: len(data) // 2], "the header says"),
        (lambda data: data[: HEADER.size // 2], "shorter than the"),
        (lambda data: b"garbage!" + data[8:], "not an executable entry"),
    ],
    ids=["flipped byte", "truncated payload", "truncated header", "garbage header"],
)
def test_a_damaged_entry_is_a_logged_miss_that_recompiles_and_rewrites(
    stored, tmp_path, damage, reason
):
    layout, directory, want = stored
    directory = copy(directory, tmp_path)
    path = entry(directory)
    path.write_bytes(damage(path.read_bytes()))
    lines = []
    steps = layout.steps(directory, log=lines.append)
    got = layout.run(steps)
    steps.close()
    assert (steps.compiles, steps.loads) == (1, 0)
    assert len(lines) == 1 and reason in lines[0] and str(path) in lines[0]
    assert_same(got, want)
    again = layout.steps(directory)  # the recompile overwrote the entry with a whole one
    assert_same(layout.run(again), want)
    again.close()
    assert (again.compiles, again.loads) == (0, 1)


def test_another_jax_version_is_a_miss(stored, tmp_path, monkeypatch):
    layout, directory, _ = stored
    steps = StepCache(STEP, layout.sample, jax.devices())
    mesh, state, batch = steps._abstract(layout.ptc, layout.layout)
    lowered, _ = steps._lower(mesh, layout.ptc, state, batch)
    steps.close()
    cache = ExecutableCache(copy(directory, tmp_path))
    assert cache.load(lowered, mesh) is not None  # this JAX's entry
    key = cache.key(lowered, mesh)
    upgraded = {**executables._versions(), "jax": "99.0.0"}
    monkeypatch.setattr(executables, "_versions", lambda: upgraded)  # the module's test seam
    assert cache.key(lowered, mesh) != key
    assert cache.load(lowered, mesh) is None
    assert (cache.hits, cache.misses, cache.problems) == (1, 1, [])  # a plain miss, not damage


@pytest.fixture
def jax_persistent_cache(tmp_path):
    """JAX's persistent compilation cache on, in its own directory, with JAX's in-memory
    executables dropped (so that a compile reads it); all put back after the test."""
    names = [
        "jax_compilation_cache_dir",
        "jax_persistent_cache_min_compile_time_secs",
        "jax_persistent_cache_min_entry_size_bytes",
    ]
    before = {n: getattr(jax.config, n) for n in names}
    jax.clear_caches()
    tj.elastic.enable_compilation_cache(tmp_path / "jax-cache")
    yield
    for name, value in before.items():
        jax.config.update(name, value)
    compat.reset_compilation_cache()
    jax.clear_caches()


def test_an_executable_jaxs_persistent_cache_served_is_never_stored(
    stored, tmp_path, jax_persistent_cache
):
    layout, _, want = stored
    fresh = layout.steps(tmp_path / "fresh")
    assert_same(layout.run(fresh), want)  # JAX's cache missed: compiled, stored in both
    fresh.close()
    assert fresh.executables.writes == 1 and not fresh.executables.problems
    for round in ("read from JAX's cache", "JAX's in-memory copy of what it read"):
        if round == "read from JAX's cache":
            jax.clear_caches()
        lines = []
        served = layout.steps(tmp_path / "served", log=lines.append)
        assert_same(layout.run(served), want)
        served.close()
        assert (served.compiles, served.executables.writes) == (1, 0), round
        assert len(lines) == 1 and "JAX's persistent compilation cache served it" in lines[0]
        assert list(served.executables.directory.glob("*.xla")) == []
        assert len(list(served.executables.directory.glob("*.none"))) == 1  # followers compile
    # what the rule prevents: the served executable, stored anyway, loads and then cannot run
    mesh, state, batch = served._abstract(layout.ptc, layout.layout)
    lowered, _ = served._lower(mesh, layout.ptc, state, batch)
    (compiled,) = served.done()
    stored_anyway = ExecutableCache(tmp_path / "stored anyway")
    assert stored_anyway.store(lowered, mesh, compiled.executable).result()
    loaded = layout.steps(stored_anyway.directory)
    with pytest.raises(jax.errors.JaxRuntimeError, match=r"not found"):
        layout.run(loaded)
    assert loaded.loads == 1


def test_concurrent_writers_of_one_key_leave_a_whole_entry_for_every_reader(tmp_path):
    cache = ExecutableCache(tmp_path)
    key = "ab" * 32
    payloads = [bytes([i]) * (1 << 20) for i in range(8)]  # 1 MiB each, told apart by byte
    seen, stop = [], threading.Event()

    def read():
        while not stop.is_set():
            try:
                data = cache.path(key).read_bytes()
            except FileNotFoundError:
                continue
            payload, problem = executables._verified_payload(data, bytes.fromhex(key))
            seen.append(problem or payload[:1])

    reader = threading.Thread(target=read)
    reader.start()
    writers = [threading.Thread(target=cache._write, args=(key, p)) for p in payloads * 2]
    for w in writers:
        w.start()
    for w in writers:
        w.join()
    stop.set()
    reader.join()
    cache.close()
    assert cache.writes == 16 and not cache.problems
    assert seen and all(isinstance(s, bytes) and len(s) == 1 for s in seen), set(map(str, seen))
    assert [p.name for p in tmp_path.iterdir()] == [cache.path(key).name]  # no temp file left


class _Compiled:
    """What ``lowered.compile()`` returns, as far as the persistent cache's bookkeeping reads it;
    its runtime executable a fresh object (JAX's cannot be weakly referenced either)."""

    def __init__(self):
        self.executable = object()

    def runtime_executable(self):
        return self.executable


class _Lowered:
    """A program whose compile JAX's persistent cache serves (``hit``) or not."""

    def __init__(self, hit: bool):
        self.hit = hit

    def compile(self):
        if self.hit:  # the event JAX records on the compiling thread when its cache serves
            jax.monitoring.record_event("/jax/compilation_cache/cache_hits")
        return _Compiled()


def test_a_freed_served_executables_id_never_marks_a_new_one_as_served():
    # an executable's id is its address: freed, it goes to the next object made, which then
    # counted as served and was never stored (two tests' failures in a full run)
    compiled, served = compat.compile_noting_persistent_cache(_Lowered(hit=True))
    assert served
    gone = id(compiled.runtime_executable())
    del compiled
    fresh = []
    for _ in range(50):
        compiled, served = compat.compile_noting_persistent_cache(_Lowered(hit=False))
        fresh.append((id(compiled.runtime_executable()), served))
        del compiled
    assert not any(served for _, served in fresh)
    assert gone not in {i for i, _ in fresh}  # (held, the served one's id stays its own)


# -- the job's option ---------------------------------------------------------------------------


def make_job(directory, log=None):
    options = tj.elastic.JobOptions(
        compile_ahead=False, exact_step_times=True, executable_cache=directory, log=log
    )
    job = tj.ElasticJob(
        LOGICAL_RULES, tj.DatasetPTC(tiny_samples(), BATCH, seed=1), grad_units=8, options=options
    )
    state = job.start(tiny_init)
    return job, state, job.jit(STEP)


def train(directory, steps=3, events=None):
    job, state, step = make_job(directory)
    with job:
        while job.step < steps:
            if job.step in (events or {}):
                events[job.step](job)
            state, batch = job.next(state)
            state, _ = step(state, batch)
    return job, host_copy(state)


def test_a_second_job_going_through_the_same_layouts_compiles_nothing(tmp_path, backend_compiles):
    shrink = {1: lambda job: job.preempt([6, 7])}
    first, want = train(tmp_path, events=shrink)
    assert (first.compiles, first.loads) == (2, 0)  # data=8, then data=6
    compiled = len(backend_compiles)
    second, got = train(tmp_path, events=shrink)
    assert (second.compiles, second.loads) == (0, 2)
    assert len(backend_compiles) == compiled  # XLA compiled nothing for the second job
    assert all(c.loaded for c in second.steps_cache.done())
    assert_same(got, want)


def test_a_directory_the_job_cannot_write_costs_only_the_cache(tmp_path):
    blocked = tmp_path / "a file"
    blocked.write_text("not a directory")
    lines = []
    job, state, step = make_job(blocked / "executables", log=lines.append)
    with job:
        for _ in range(2):
            state, batch = job.next(state)
            state, metrics = step(state, batch)
    assert np.isfinite(float(metrics["loss"]))
    assert (job.compiles, job.loads) == (1, 0)
    assert any("executable cache: not loaded: NotADirectoryError" in line for line in lines)
    assert any("executable cache: executable not stored in" in line for line in lines)


@pytest.mark.parametrize("value", [3, "", b"dir"])
def test_job_options_refuse_an_executable_cache_that_is_not_a_path(value):
    with pytest.raises(tj.errors.LayoutError, match=r"JobOptions.executable_cache is a directory"):
        tj.elastic.JobOptions(executable_cache=value)
    assert tj.elastic.JobOptions(executable_cache="x").executable_cache == pathlib.Path("x")
    assert os.fspath(tj.elastic.JobOptions(executable_cache=pathlib.Path("x")).executable_cache)
