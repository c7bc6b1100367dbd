"""Planned changes under ``tenplex-jax launch``: a shrink whose step is ready before the change,
then a growth during whose preparation a process is killed. Beside ``test_launch.py``, whose
module job runs long (and grows once, its step compiled ahead): this runs on another worker.

One launched job (``examples/elastic_gpt.py``, GPT tiny, 3 processes x 2 CPU devices, paused
after steps 3 and 5):

1. after step 3, a planned resize to 2 processes: the generation ends at a step boundary once
   process 0 has compiled the two-process layout ahead (the layout after the loss of any one
   process), so the new generation's processes, the two that stay, load its step: nothing is
   compiled, no step lost;
2. after step 5, a growth to 3 processes: the processes are told of it and lower (process 0
   compiles) its step while the job waits at the step boundary, and process 1 is SIGKILLed once
   it has lowered it, before the change. The growth does not happen; the survivor goes on alone
   from its own memory at step 5 (the last commit is of step 4).

The final params equal an uninterrupted run's, bit for bit.
"""

from __future__ import annotations

import numpy as np

from tenplex_jax.multihost import RunDir
from tests.helpers import reaped, reference_run
from tests.multihost.launching import (
    TIMEOUT,
    alive,
    kill,
    last,
    launch_example,
    log_tail,
    paused,
    wait_for,
)

STEPS = 8


def test_a_shrink_loads_its_step_and_a_kill_while_a_growth_is_prepared_leaves_a_working_job(
    tmp_path,
):
    run = RunDir(tmp_path)
    proc = launch_example(tmp_path, 3, STEPS, script=["--pause-after", "3,5"])
    children: list[int] = []
    with reaped(proc):
        want, _, _ = reference_run(STEPS)
        wait_for(lambda: paused(tmp_path, 3, 3), "the pause after step 3", proc)
        children += last(tmp_path, "generation")["pids"]
        # the shrink ends the generation at the next boundary, step 4, once the step after the
        # loss of a process (the shrunk layout) is compiled: not later, at the pause after 5
        wait_for(lambda: run.ahead(0, processes=1), "the compile-ahead of 2 processes", proc)
        (tmp_path / "resize").write_text("2")
        wait_for(lambda: (tmp_path / "control.json").exists(), "the shrink's request", proc)
        (tmp_path / "resume-3").write_text("")
        wait_for(lambda: paused(tmp_path, 5, 2), "the shrunk job's pause after step 5", proc)
        (tmp_path / "resize").write_text("3")
        told = tmp_path / "grown-g1-p1.json"  # process 1 has lowered the grown step
        wait_for(told.exists, "the growth's preparation", proc)
        workers = last(tmp_path, "generation")["pids"]
        children += list(last(tmp_path, "growing")["slots"].values())
        children += [pid for e in run.events("standby") for pid in e["pids"].values()]
        kill(workers[1])
        (tmp_path / "resume-5").write_text("")
        proc.wait(TIMEOUT)
    assert proc.returncode == 0, log_tail(proc)
    gens = run.events("generation")
    got = [(g["processes"], g["kept"], g["restore"], g["step"]) for g in gens]
    assert got == [
        (3, [False] * 3, "init", 0),
        (2, [True, True], "store", 4),
        (1, [True], "live", 5),
    ]
    # nothing lost at the shrink, nor at the kill: the survivor held step 5, past the commit of 4
    assert gens[1]["lost_steps"] == 0 and gens[2]["lost_steps"] == 0, gens
    # the shrink: asked after step 3, at a boundary it waited for the compile; the processes that
    # stay loaded the step process 0 compiled ahead, untraced
    request = run.events("request")[0]
    assert (request["action"], request["processes"]) == ("resize", 2)
    assert request["time"] < gens[1]["time"]
    shrunk = [(r.loaded, r.compiles, r.traced) for r in run.first_steps(1)]
    assert shrunk == [(True, 0, False)] * 2, shrunk
    # the growth: prepared, then a failure instead
    kinds = [e["event"] for e in run.events()]
    assert kinds.count("growing") == 1 and kinds.count("resize") == 1, kinds
    assert kinds.index("growing") < kinds.index("failure"), kinds
    with np.load(tmp_path / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    assert alive(children) == []  # the workers, standbys and the growth's store were reaped
