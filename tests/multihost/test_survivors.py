"""Survivors keep running: a launched job loses process 0 while the others are in a collective
with it, then loses another process while the job re-forms.

``examples/elastic_gpt.py`` under ``tenplex-jax launch`` (GPT tiny, 3 processes x 2 CPU devices,
replicas=1, a commit every 2 steps). Process 0 alone is held after step 3 (``--pause-only 0``);
the others go on into step 4, whose collectives wait for it. The test SIGKILLs process 0 — the
one that hosted JAX's coordination service before the launcher did — and its store, so the
others are blocked in a collective with a dead peer (gloo's never time out). Then, as soon as
generation 1 is formed, it SIGKILLs generation 1's process 1: a second failure during the change.

What must hold: the two processes left after the first kill are the same processes in
generation 1 (their PIDs; the launcher says ``kept``); generation 2 runs on the one slot left (its
process, or its standby when that process was blocked joining generation 1 with the dead peer,
which only a kill ends); the job finishes; its final params equal, bit for bit, an uninterrupted
single-process run fed the same batches; generation 1's processes compile nothing (each loads its
step).
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
    wait_for,
)

STEPS = 8


def test_survivors_stay_in_their_processes_through_two_failures(tmp_path):
    run, rundir = tmp_path, RunDir(tmp_path)
    proc = launch_example(run, 3, STEPS, script=["--pause-after", "3", "--pause-only", "0"])
    children: list[int] = []
    with reaped(proc):
        want, _, _ = reference_run(STEPS)  # while the job starts
        held = [run / "paused-3-p0", run / "passed-3-p1", run / "passed-3-p2"]
        wait_for(
            lambda: all(path.exists() for path in held),
            "process 0 held after step 3, the others in step 4",
            proc,
        )
        ready = lambda: rundir.ahead(0, processes=3)
        wait_for(ready, "the compile-ahead after a loss", proc)
        stores = {int(k): v["pid"] for k, v in last(run, "stores")["slots"].items()}
        first = last(run, "generation")["pids"]
        children += [*stores.values(), *first]
        children += [pid for e in rundir.events("standby") for pid in e["pids"].values()]
        kill(first[0])
        kill(stores[0])
        wait_for(lambda: last(run, "generation")["generation"] == 1, "generation 1", proc)
        second = last(run, "generation")["pids"]
        kill(second[1])  # the second failure, while generation 1 forms
        proc.wait(TIMEOUT)
    assert proc.returncode == 0, log_tail(proc)
    gens = rundir.events("generation")
    assert [g["processes"] for g in gens] == [3, 2, 1], log_tail(proc)
    assert [g["kept"] for g in gens[:2]] == [[False] * 3, [True, True]]
    assert gens[1]["pids"] == first[1:]
    assert gens[2]["slots"] == [1] and gens[2]["warm"] == [True]
    assert len(rundir.events("failure")) == 2
    # generation 1's processes loaded the step process 0 compiled ahead, without tracing it
    # (they had lowered it beside process 0); generation 1 ended before its own compile-ahead
    # (for one process) could run, so generation 2 may compile
    for record in rundir.first_steps(1):
        assert record.loaded and record.compiles == 0 and not record.traced, record
    with np.load(run / "final.npz") as final:
        got = [final[f"arr_{i}"] for i in range(len(final.files))]
    assert len(got) == len(want)
    for i, (a, b) in enumerate(zip(got, want)):
        np.testing.assert_array_equal(a, b, err_msg=f"leaf {i}")
    assert alive(children) == []  # every worker, standby and store was reaped
