"""Slow is not dead: a launched job whose processes are starved of the CPU, one of them frozen
outright for longer than a coordination-service heartbeat timeout once was, ends in the
generation it started in, with every step and the params of a run nobody slowed.

``examples/elastic_gpt.py`` under ``tenplex-jax launch`` (GPT tiny, 2 processes x 2 CPU devices,
replicas=1, a commit every 2 steps). Process 1 alone is held after step 2 (``--pause-only 1``);
process 0 goes on into step 3, whose collectives wait for it. The test then stops process 1
(SIGSTOP: no heartbeat, no reply, no progress; what a host far past its cores does to a process
at worst) for ``FROZEN`` seconds, and afterwards throttles both processes to about a tenth of a
core each (stopped 90 % of every 0.5 s) for ``STARVED`` seconds: a load of about 10 per process,
without spending the suite's cores on hogs. The launcher's own death detection (an exit, a
connection reset) must see nothing, and JAX's coordination service must not fail a task that
only missed heartbeats for a while (the abort "Unexpected heartbeat request from an
already-in-error task").
"""

from __future__ import annotations

import contextlib
import os
import signal
import time

import numpy as np

from tenplex_jax.multihost import RunDir
from tests.helpers import reaped, reference_run
from tests.multihost.launching import TIMEOUT, alive, last, launch_example, log_tail, wait_for

STEPS = 6
FROZEN = 15.0  # seconds process 1 is stopped: past the service's old 10 s heartbeat timeout
STARVED = 10.0  # seconds both processes run at a tenth of a core
PERIOD, RUNNING = 0.5, 0.05  # each period of the throttle: stopped, then running this long


def signal_all(pids, sig) -> None:
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def test_a_job_starved_and_frozen_for_a_while_ends_in_its_first_generation(tmp_path):
    run, rundir = tmp_path, RunDir(tmp_path)
    proc = launch_example(run, 2, STEPS, script=["--pause-after", "2", "--pause-only", "1"])
    with reaped(proc):
        want, _, _ = reference_run(STEPS)  # while the job starts
        held = [run / "paused-2-p1", run / "passed-2-p0"]
        wait_for(lambda: all(p.exists() for p in held), "process 1 held, process 0 in step 3", proc)
        pids = last(run, "generation")["pids"]
        try:
            os.kill(pids[1], signal.SIGSTOP)
            (run / "resume-2").write_text("")
            time.sleep(FROZEN)  # the fault itself: how long the process is frozen
            os.kill(pids[1], signal.SIGCONT)
            end = time.monotonic() + STARVED
            while time.monotonic() < end and proc.poll() is None:
                signal_all(pids, signal.SIGSTOP)
                time.sleep(PERIOD - RUNNING)
                signal_all(pids, signal.SIGCONT)
                time.sleep(RUNNING)
        finally:
            signal_all(pids, signal.SIGCONT)
        proc.wait(TIMEOUT)
    assert proc.returncode == 0, log_tail(proc)
    gens = rundir.events("generation")
    assert [g["generation"] for g in gens] == [0], log_tail(proc)  # no generation change
    assert rundir.events("failure") == [], log_tail(proc)
    with np.load(run / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    assert alive(pids) == []
