"""A step a process lowered before loads untraced: what a survivor of a change does when it runs
its script again. New function objects of the same program (same code, equal closures: a new
``train_step(graphdef)`` of an equal model and optimizer) are known; another program, a script's
function compiled anew, or a closure over device arrays are traced. The load gives the bits the
compile gave, and a damaged entry is one miss and one compile."""

from __future__ import annotations

import functools
import json
import os
import pathlib
import shutil
import subprocess
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import tenplex_jax as tj
from tenplex_jax._src.batch import BATCH_AXES, Batch, device_batch
from tenplex_jax._src.data import BatchLayout
from tenplex_jax._src.elastic import programs
from tenplex_jax._src.elastic.executables import ExecutableCache
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.ptc import PTC
from tenplex_jax_models import LOGICAL_RULES, build_state, train_step
from tests.helpers import host_copy, tiny_samples

BATCH, CONFIG = 24, tj.ParallelConfig(data=4)
TRACES: list[str] = []  # one entry per trace of a counted step


def counted(inner, name: str = "step"):
    """``inner`` with a note in TRACES each time JAX traces it."""

    def step(state, batch):
        TRACES.append(name)
        return inner(state, batch)

    return step


def step_of(lr: float = 3e-3):
    """A new function object of the tiny GPT's step: a new model and optimizer built each call."""
    return counted(train_step(build_state("tiny", lr, abstract=True)[0]))


class Job:
    """One layout on 4 devices, its first batch and initial state."""

    def __init__(self):
        self.devices = jax.devices()[:4]
        self.dataset = tj.DatasetPTC(tiny_samples(), BATCH, seed=1)
        self.sample = jax.tree.map(np.asarray, self.dataset.load(np.zeros(1, np.int64)))
        self.ptc = PTC.of(
            build_state("tiny", 3e-3, abstract=True)[1], LOGICAL_RULES, CONFIG, self.devices
        )
        self.layout = BatchLayout(BATCH, ranks=4, grad_units=4)
        self.mesh = self.ptc.mesh(self.devices)

    def steps(self, fn, directory, program: str | None = None) -> StepCache:
        cache = ExecutableCache(directory)
        return StepCache(fn, self.sample, self.devices, executables=cache, program=program)

    def run(self, steps: StepCache):
        """(the compiled entry, the outputs of one step from the initial state)."""
        compiled = steps.get(self.ptc, self.layout, ahead=False).result()
        init = lambda: build_state("tiny", 3e-3)[1]
        state = jax.jit(init, out_shardings=self.ptc.shardings(self.mesh))()
        data, weights, _ = device_batch(self.dataset, 0, self.layout, self.mesh)
        batch = Batch(data, weights, self.layout, self.mesh, BATCH_AXES)
        return compiled, host_copy(compiled.executable(state, batch))


@pytest.fixture(scope="module")
def compiled(tmp_path_factory):
    """The layout's step compiled once into a directory, its outputs, and the job."""
    programs.forget()
    TRACES.clear()
    job, directory = Job(), tmp_path_factory.mktemp("executables")
    first = job.steps(step_of(), directory)
    compiled, want = job.run(first)
    first.close()  # waits for the entry's write
    assert (compiled.traced, compiled.loaded, first.compiles, TRACES) == (True, False, 1, ["step"])
    yield job, directory, want
    programs.forget()


@pytest.fixture
def job(compiled, tmp_path):
    """The job, the compiled entry copied into ``tmp_path`` and the compile's outputs; this
    process remembers the program (the fixture lowered it)."""
    job, directory, want = compiled
    for entry in directory.iterdir():
        shutil.copy(entry, tmp_path / entry.name)
    TRACES.clear()
    return job, want


def assert_same(got, want):
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")


def test_the_same_program_anew_loads_untraced_with_the_compiles_bits(job, tmp_path):
    job, want = job
    again = job.steps(step_of(), tmp_path)  # a new graphdef, optimizer and closure: equal
    compiled, got = job.run(again)
    again.close()
    assert (compiled.traced, compiled.loaded, again.compiles, again.loads) == (False, True, 0, 1)
    assert TRACES == []  # nothing traced
    assert_same(got, want)


def test_another_program_a_script_anew_or_device_arrays_are_traced(job, tmp_path):
    job, want = job
    # another learning rate: another program (its optimizer's closures differ), compiled
    other = job.steps(step_of(lr=1e-2), tmp_path)
    compiled, got = job.run(other)
    other.close()
    assert (compiled.traced, compiled.loaded, other.compiles) == (True, False, 1)
    assert any(not np.array_equal(a, b) for a, b in zip(got, want))
    # a script run again: its functions are new code objects, whatever their source
    source = "def step(state, batch):\n    return inner(state, batch)\n"
    for _ in range(2):
        space = {"inner": train_step(build_state("tiny", 3e-3, abstract=True)[0])}
        exec(compile(source, "script.py", "exec"), space)
        steps = job.steps(space["step"], tmp_path)
        compiled, _ = job.run(steps)
        steps.close()
        assert compiled.traced and compiled.loaded  # the same program text: loaded, but traced
    # a closure over an array on devices has no fingerprint
    scale = jnp.ones(())
    inner = train_step(build_state("tiny", 3e-3, abstract=True)[0])
    assert programs.fingerprint(lambda s, b: jax.tree.map(lambda x: x * scale, inner(s, b))) is None


def test_a_remembered_programs_damaged_entry_is_one_miss_and_one_compile(job, tmp_path):
    job, want = job
    (entry,) = tmp_path.glob("*.xla")
    data = bytearray(entry.read_bytes())
    data[-1] ^= 0xFF
    entry.write_bytes(bytes(data))
    again = job.steps(step_of(), tmp_path)
    compiled, got = job.run(again)
    again.close()
    assert (compiled.traced, compiled.loaded, again.compiles, again.loads) == (True, False, 1, 0)
    cache = again.executables
    assert (cache.hits, cache.misses, len(cache.problems)) == (0, 1, 1), cache.problems
    assert "sha256" in cache.problems[0]
    assert_same(got, want)
    assert again.executables.writes == 1  # rewritten whole: the next load is untraced again
    compiled, _ = job.run(job.steps(step_of(), tmp_path))
    assert not compiled.traced


def test_a_fingerprint_is_equal_for_equal_programs_only():
    graphdef = lambda lr=3e-3: build_state("tiny", lr, abstract=True)[0]
    same = programs.fingerprint(train_step(graphdef()))
    assert same is not None and same == programs.fingerprint(train_step(graphdef()))
    assert same != programs.fingerprint(train_step(graphdef(1e-2)))

    def scaled(array):
        return lambda x: x * array

    # scalars by type and value: these trace to other programs though Python calls them equal
    assert programs.fingerprint(scaled(1)) != programs.fingerprint(scaled(1.0))
    assert programs.fingerprint(scaled(True)) != programs.fingerprint(scaled(1))
    assert programs.fingerprint(scaled(0.0)) != programs.fingerprint(scaled(-0.0))
    assert programs.fingerprint(scaled(0.5)) == programs.fingerprint(scaled(0.5))
    a, b = np.arange(3.0), np.arange(3.0)
    assert programs.fingerprint(scaled(a)) == programs.fingerprint(scaled(b))  # by bytes
    assert programs.fingerprint(scaled(a)) != programs.fingerprint(scaled(a + 1))
    assert programs.fingerprint(scaled([1, 2])) != programs.fingerprint(scaled([1, 3]))
    cycle: list = []
    cycle.append(cycle)
    assert programs.fingerprint(scaled(cycle)) is None
    assert programs.fingerprint(scaled({1: [2]})) == programs.fingerprint(scaled({1: [2]}))
    assert programs.fingerprint(scaled(bytearray(b"x"))) is None  # no hash, no parts
    owner = object()  # no value hash: by identity
    assert programs.fingerprint(scaled(owner)) == programs.fingerprint(scaled(owner))
    assert programs.fingerprint(scaled(owner)) != programs.fingerprint(scaled(object()))
    partial = functools.partial(np.add, 1)
    assert programs.fingerprint(scaled(partial)) == programs.fingerprint(
        scaled(functools.partial(np.add, 1))
    )
    assert programs.fingerprint(jax.jit(lambda x: x)) is None  # not a plain function


def fresh_program(job: Job, lr: float, directory):
    """A step this process has not lowered (``lr``), and its outputs compiled the usual way (in
    ``directory``/reference); then forgotten, as in a process that never lowered it."""
    fn = step_of(lr=lr)
    reference = job.steps(fn, directory / "reference")
    _, want = job.run(reference)
    reference.close()
    programs.forget()
    TRACES.clear()
    return fn, want


def test_a_layout_lowered_ahead_without_its_devices_compiles_untraced_with_the_bits(
    compiled, tmp_path
):
    """A planned growth: the grown layout's devices do not exist before the change, so each
    process lowers its step on the layout's AbstractMesh; once they do, the step compiles from
    that lowering, nothing traced, to the executable a compile on the devices gives."""
    job = compiled[0]
    fn, want = fresh_program(job, 2e-3, tmp_path)
    before = StepCache(fn, job.sample, job.devices[:2], executables=ExecutableCache(tmp_path))
    assert before.lower_ahead(job.ptc, job.layout, abstract=True).result()  # 2 of its 4 devices
    before.close()
    assert (TRACES, before.compiles) == (["step"], 0)
    after = job.steps(fn, tmp_path)
    step, got = job.run(after)
    after.close()
    assert (step.traced, step.loaded, after.compiles, TRACES) == (False, False, 1, ["step"])
    assert_same(got, want)
    assert after.executables.problems == []
    assert len(list(tmp_path.glob("*.xla"))) == 1  # stored under the key the devices' lowering has
    again = job.steps(step_of(lr=2e-3), tmp_path)
    step, got = job.run(again)
    again.close()
    assert (step.loaded, again.compiles, TRACES) == (True, 0, ["step"])
    assert_same(got, want)


def test_a_layout_compiled_for_a_topology_of_devices_it_lacks_loads_untraced_with_the_bits(
    compiled, tmp_path
):
    """A planned growth on CPU: process 0 compiles the grown step for a compile-only topology
    of the devices the grown job will have (here 1 process x 4: this process's first 4 devices'
    ids), and stores it. A process that has those devices then loads it: untraced where it was
    compiled (the lowering is remembered), traced elsewhere unless the step is named; the bits
    of a normal compile."""
    from tenplex_jax._src.multihost import distributed
    from tenplex_jax._src.multihost.processes import free_port

    job = compiled[0]
    fn, want = fresh_program(job, 4e-3, tmp_path)
    cache = ExecutableCache(tmp_path)
    before = StepCache(fn, job.sample, job.devices[:1], executables=cache, program="tiny/4e-3")
    with distributed.cpu_topology(1, 4, port=free_port()) as devices:
        assert [(d.id, d.process_index) for d in devices] == [(i, 0) for i in range(4)]
        assert all(d not in jax.devices() for d in devices)  # another client's
        ptc = PTC.of(build_state("tiny", 3e-3, abstract=True)[1], LOGICAL_RULES, CONFIG, devices)
        step = before.compile_for(ptc, job.layout, devices)
    before.close()  # waits for the entry's write
    assert (TRACES, before.compiles, step.seconds > 0) == (["step"], 1, True)
    assert len(list(tmp_path.glob("*.xla"))) == len(list(tmp_path.glob("*.program"))) == 1
    after = job.steps(fn, tmp_path, program="tiny/4e-3")
    step, got = job.run(after)
    after.close()
    assert (step.traced, step.loaded, after.compiles, TRACES) == (False, True, 0, ["step"])
    assert_same(got, want)
    programs.forget()  # a process that did not compile it: traces, then loads
    elsewhere = job.steps(step_of(lr=4e-3), tmp_path)
    step, got = job.run(elsewhere)
    elsewhere.close()
    assert (step.traced, step.loaded, elsewhere.compiles) == (True, True, 0)
    assert_same(got, want)
    programs.forget()  # such a process with the step's name: loads it untraced
    named = job.steps(step_of(lr=4e-3), tmp_path, program="tiny/4e-3")
    step, got = job.run(named)
    named.close()
    assert (step.traced, step.loaded, named.compiles) == (False, True, 0)
    assert_same(got, want)


def test_a_named_program_loads_untraced_in_a_new_process(job, tmp_path):
    """A process that lowers a named step stores what the lowering gave beside its executable;
    a new process (run here: nothing remembered, its own hash seed) loads that step with
    nothing traced and the compile's bits. Another name, or no name, is traced there."""
    job, want = job
    programs.forget()
    named = job.steps(step_of(), tmp_path, program="tiny/v1")
    compiled, got = job.run(named)
    named.close()  # waits for the entries' writes
    assert (compiled.traced, compiled.loaded, named.compiles, TRACES) == (True, True, 0, ["step"])
    assert len(list(tmp_path.glob("*.program"))) == 1 and not named.executables.problems
    assert_same(got, want)
    root = pathlib.Path(__file__).resolve().parents[2]
    done = subprocess.run(
        [sys.executable, "-m", "tests.core.test_programs", str(tmp_path), "tiny/v1", "tiny/v2", ""],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=root,
        env={**os.environ, "PYTHONHASHSEED": "7"},
    )
    assert done.returncode == 0, done.stderr[-3000:]
    runs = json.loads(done.stdout.splitlines()[-1])
    assert [(r["traced"], r["loaded"], r["compiles"]) for r in runs] == [
        (False, True, 0),  # the same name: loaded untraced
        (True, True, 0),  # another name: traced, then the same program text loaded
        (True, True, 0),  # no name: a new process's code is unknown to it
    ]
    assert runs[0]["traces"] == 0 and not any(r["problems"] for r in runs)
    # how its gradients were taken came with it: whether changes are bitwise, known untraced
    assert runs[0]["gradients"] == [named.seen.every, named.seen.some, named.seen.plain]
    for i in range(3):
        with np.load(tmp_path / f"got{i}.npz") as got:
            assert_same([got[f"arr_{j}"] for j in range(len(got.files))], want)


def test_a_named_programs_damaged_entry_is_one_miss_and_one_lowering(job, tmp_path):
    job, want = job
    programs.forget()
    named = job.steps(step_of(), tmp_path, program="tiny/v1")
    job.run(named)
    named.close()
    (entry,) = tmp_path.glob("*.program")
    entry.write_bytes(entry.read_bytes()[:-1])  # a torn write
    programs.forget()
    TRACES.clear()
    again = job.steps(step_of(), tmp_path, program="tiny/v1")
    compiled, got = job.run(again)
    again.close()  # the entry written again, whole
    assert (compiled.traced, compiled.loaded, TRACES) == (True, True, ["step"])
    assert len(again.executables.problems) == 1 and "bytes" in again.executables.problems[0]
    assert_same(got, want)
    programs.forget()
    compiled, got = job.run(job.steps(step_of(), tmp_path, program="tiny/v1"))
    assert (compiled.traced, compiled.loaded) == (False, True)
    assert_same(got, want)


def _in_a_new_process(directory: pathlib.Path, names: list[str]) -> None:
    """One step of the tiny GPT per name ("": unnamed), each a new StepCache on ``directory``:
    its outputs in ``got<i>.npz``, and a JSON line of how each was had."""
    job, runs = Job(), []
    for i, name in enumerate(names):
        TRACES.clear()
        steps = job.steps(step_of(), directory, program=name or None)
        compiled, got = job.run(steps)
        steps.close()
        np.savez(directory / f"got{i}.npz", *got)
        cache = steps.executables
        runs.append(
            {
                "traced": compiled.traced,
                "loaded": compiled.loaded,
                "compiles": steps.compiles,
                "traces": len(TRACES),
                "problems": cache.problems,
                "gradients": [steps.seen.every, steps.seen.some, steps.seen.plain],
            }
        )
    print(json.dumps(runs))


if __name__ == "__main__":  # a new process of the named-program test
    import tests.conftest  # noqa: F401  (the suite's devices and flags)

    _in_a_new_process(pathlib.Path(sys.argv[1]), sys.argv[2:])
