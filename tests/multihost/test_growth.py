"""A planned growth under ``tenplex-jax launch``: its step is ready before the change (every
process loads it, nothing is compiled at the change), and a kill while it is prepared leaves a
working job. Beside ``test_launch.py``, whose module job runs long: these run on another worker."""

from __future__ import annotations

import json
import os

import numpy as np
import pytest

from tests.helpers import events, reaped, reference_run
from tests.multihost.launching import TIMEOUT, kill, last, launch_example, step_records, wait_for


def test_a_planned_growth_is_compiled_ahead_and_every_process_loads_it(tmp_path):
    """A planned resize 1 -> 2 (the recovery benchmark's growth, on the tiny GPT): the grown
    layout's devices do not exist before the change, so the launcher announces the growth when
    it starts the new store, and the survivor, process 0 on CPU, compiles the grown step ahead
    for a compile-only topology of 2 processes while the job trains on; the launcher asks for
    the growth once it has. In the new generation the survivor loads it untraced, and the new
    process, which traces its step, loads it too: nothing is compiled at the change."""
    from tenplex_jax_benchmarks.recovery import recover_once

    result = recover_once(
        "store", tmp_path, model="tiny", nprocs=2, devices_per_proc=2, change="grow"
    )
    gens = [e for e in events(tmp_path) if e["event"] == "generation"]
    assert [(g["processes"], g["lost_steps"]) for g in gens] == [(1, None), (2, 0)]
    lowered = json.loads((tmp_path / "grown-g0-p0.json").read_text())
    assert lowered == {"processes": 2, "remembered": True}
    survivor, new = step_records(tmp_path, 1)
    assert (survivor["traced"], survivor["loaded"], survivor["compiles"]) == (False, True, 0)
    assert (new["traced"], new["loaded"], new["compiles"]) == (True, True, 0), new
    assert result["step_traced"] == [False, True]


def test_a_process_killed_while_a_growth_is_prepared_leaves_a_working_job(tmp_path):
    """A kill while a growth is prepared: the processes were told of it and compile or lower
    its step while the job waits at a step boundary, and one of them is SIGKILLed once it has
    lowered it, before the change. The growth does not happen; the survivor goes on alone from
    the stores and the job's params equal an uninterrupted run's, bit for bit."""
    steps = 6
    proc = launch_example(tmp_path, 2, steps, script=["--pause-after", "3"])
    children: list[int] = []
    with reaped(proc):
        want, _, _ = reference_run(steps)
        paused = lambda: all((tmp_path / f"paused-3-p{i}").exists() for i in range(2))
        wait_for(paused, "the pause after step 3", proc)
        (tmp_path / "resize").write_text("3")
        told = tmp_path / "grown-g0-p1.json"  # process 1 has lowered the grown step
        wait_for(told.exists, "the growth's preparation", proc)
        workers = last(tmp_path, "generation")["pids"]
        children += workers + list(last(tmp_path, "growing")["slots"].values())
        kill(workers[1])
        (tmp_path / "resume-3").write_text("")
        proc.wait(TIMEOUT)
    log = (tmp_path / "launcher.log").read_text(errors="replace")
    assert proc.returncode == 0, log[-3000:]
    kinds = [e["event"] for e in events(tmp_path)]
    assert "growing" in kinds and "failure" in kinds and "resize" not in kinds, kinds
    gens = [e for e in events(tmp_path) if e["event"] == "generation"]
    assert [(g["processes"], g["kept"]) for g in gens] == [(2, [False, False]), (1, [True])]
    assert gens[1]["restore"].startswith("store:"), gens[1]
    with np.load(tmp_path / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    for pid in children:  # the workers and the growth's store were reaped
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
