"""``tenplex-jax replay``: a resource trace end to end through the command line, in a process of
its own (the loop's own tests are in ``tests/core/test_elastic.py``)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types


def test_trace_replays_end_to_end_through_the_cli(tmp_path):
    trace = tmp_path / "trace.toml"
    trace.write_text(
        'name = "mini"\ndevices = 8\nsteps = 6\ncheckpoint_every = 3\n'
        '[[events]]\nstep = 2\nkind = "preempt"\ncount = 1\n'
        '[[events]]\nstep = 4\nkind = "offer"\ndevices = [7]\n'
    )
    out = tmp_path / "out"
    run = subprocess.run(
        [sys.executable, "-m", "tenplex_jax", "replay", str(trace), "--model", "tiny"]
        + ["--batch", "24", "--samples", "100", "--no-compile-ahead", "--out", str(out)],
        check=False,
        capture_output=True,
        text=True,
        timeout=300,
        cwd=os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
    )
    assert run.returncode == 0, run.stderr[-3000:]
    assert "goodput: elastic" in run.stdout
    summary = json.loads((out / "summary.json").read_text())
    events = summary["events"]
    assert [(e["kind"], e["decision"], e["compile"]) for e in events] == [
        ("preempt", "shrink", "compiled"),
        ("offer", "grow", "cached"),  # back on the first layout: no compile
    ]
    assert [e["devices_after"] for e in events] == [list(range(7)), list(range(8))]
    # the notice's checkpoint is saved at the next boundary without a change, after the first
    # step on the new layout (here with the periodic one of step 3), not beside that step
    assert events[0]["commit_seconds"] > 0
    assert [c["step"] for c in summary["checkpoints"]] == [0, 3]
    for e in events:  # the stall's phases; the first step is waited for, so it lies within
        phases = ("plan", "reshard", "compile_wait", "batch", "first_step")
        assert all(e[f"{p}_seconds"] > 0 for p in phases), e
        assert 0 < e["dispatch_seconds"] <= e["first_step_seconds"]
        assert sum(e[f"{p}_seconds"] for p in phases) <= e["stall_seconds"], e
    assert events[1]["estimate"]["grow"] and events[1]["estimate"]["remaining_steps"] == 2
    assert summary["exactly_once"] and summary["params_vs_fixed_run"] == "bitwise"
    goodput = summary["goodput"]
    assert 0 < goodput["elastic"] <= 1 and 0 < goodput["checkpoint_restart"] <= 1
    assert 0 < goodput["no_events"] <= 1
    assert goodput["elastic_over_no_events"] == goodput["elastic"] / goodput["no_events"]
    lost = goodput["lost_seconds_to"]  # the wall time besides steps, every second accounted
    besides = lost["event_stalls"] + lost["checkpoints"] + lost["rewound_steps"] + lost["loop"]
    assert abs(besides - (goodput["elastic_wall_seconds"] - goodput["useful_seconds"])) < 1e-6
    assert lost["event_stalls"] > 0 and lost["checkpoints"] > 0 and lost["loop"] > 0
    # no compile-ahead: no step ran beside a compile thread's work; the others are steps 1 and 5
    # (2 and 4 began with an event, 0 and 3 with a checkpoint)
    beside = lost["loop_beside_compiles"]
    assert beside["steps"] == 0 and beside["seconds"] == 0 and beside["other_steps"] == 2
    assert "seconds besides steps: event stalls" in run.stdout
    assert set(goodput["restart_costs"]["compile_seconds"]) == {"data=7", "data=8"}


def test_the_loop_s_gaps_beside_compile_ahead_are_told_apart_from_the_others():
    """A gap is the end of one step to the end of the next less the next's time; it is beside
    compile-ahead when a compile thread worked during it; boundaries with an event or a
    checkpoint are left out (their gaps hold the stall or the save)."""
    from tenplex_jax._src.cli.replay import _loop_beside_compiles

    job = types.SimpleNamespace(
        records=[types.SimpleNamespace(step=4)],
        checkpoints=[(0, 0.01), (5, 0.02)],
        steps_cache=types.SimpleNamespace(background=[(2.5, 3.05), (9.0, 9.5)]),
    )
    # (step, end, seconds): gaps of steps 1..6 are 0.1, 0.2, 0.3, (4: event), (5: checkpoint), 0.05
    ends = [(0, 1.0, 1.0), (1, 2.0, 0.9), (2, 3.0, 0.8), (3, 4.0, 0.7), (4, 5.0, 0.5)]
    ends += [(5, 6.0, 0.5), (6, 7.0, 0.95)]
    run = types.SimpleNamespace(job=job, ends=ends)
    got = _loop_beside_compiles(run)
    assert got["steps"] == 2 and abs(got["seconds"] - 0.5) < 1e-9  # steps 2 and 3: 0.2 + 0.3
    assert abs(got["median_gap_ms"] - 250) < 1e-6
    assert got["other_steps"] == 2 and abs(got["other_median_gap_ms"] - 75) < 1e-6  # 1 and 6
