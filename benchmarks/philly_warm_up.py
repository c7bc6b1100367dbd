"""The Philly replay's loading run with and without ``JobOptions.warm_up``, alternating in one run.

``python -m tenplex_jax_benchmarks.philly_warm_up OUT [--pairs N]``: one replay of
``meshes/philly.toml``
fills ``OUT/executables`` (the compiling run, not counted), then ``N`` pairs of loading runs, each
a fresh ``tenplex-jax replay`` process that loads every step from ``OUT/executables``: warmed
(the default) and ``--no-warm-up``, in turns, so that the machine's load falls on both alike.
Per run and event: the stall against its bound 1.5 x (reshard + one step) + 0.1 s, the first
step on the new layout over that layout's median step, the warm-up's seconds; per run the
elastic goodput over the same replay without events. Writes ``OUT/philly_warm_up.json`` and
prints a short log; the load average is read before and after each run.

``--baseline DIR``: the pairs are instead the code as it is and the project's checkout in ``DIR``
(an earlier commit, run from ``DIR`` with it first on ``PYTHONPATH``), both warmed, in turns,
sharing the executables.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import statistics
import subprocess
import sys
import time

TRACE = pathlib.Path(__file__).resolve().parents[1] / "meshes" / "philly.toml"


def replay(
    out: pathlib.Path,
    executables: pathlib.Path,
    warm_up: bool,
    timeout: float,
    code: pathlib.Path | None = None,
) -> dict:
    """One ``tenplex-jax replay`` process (of the checkout in ``code``, else the installed
    project); its summary.json, with the load averages around it."""
    env = dict(os.environ)
    if code is not None:
        env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(code), env.get("PYTHONPATH")]))
    command = [sys.executable, "-m", "tenplex_jax", "replay", str(TRACE)]
    command += ["--out", str(out), "--executable-cache", str(executables)]
    command += [] if warm_up else ["--no-warm-up"]
    before = os.getloadavg()
    cpu = _children_cpu()
    tic = time.perf_counter()
    done = subprocess.run(  # ``-m`` puts the working directory first on the path
        command, capture_output=True, text=True, timeout=timeout, env=env, cwd=code
    )
    seconds = time.perf_counter() - tic
    if done.returncode:
        raise RuntimeError(f"{' '.join(command)} exited {done.returncode}: {done.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    summary["bench"] = {
        "load_before": before,
        "load_after": os.getloadavg(),
        "seconds": seconds,
        "cpu_seconds": _children_cpu() - cpu,  # the process's user and system time
    }
    return summary


def _children_cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def events(summary: dict) -> list[dict]:
    """Each event that moved the job: its stall, bound, first step over its layout's median."""
    steady = summary["step_seconds_by_config"]
    rows = []
    for e in summary["events"]:
        if e["stall_seconds"] is None:
            continue
        step = steady[e["config_after"]]
        bound = 1.5 * (e["reshard_seconds"] + step) + 0.1
        rows.append(
            {
                "step": e["step"],
                "kind": e["kind"],
                "config": e["config_after"],
                "compile": e["compile"],
                "stall_seconds": e["stall_seconds"],
                "bound_seconds": bound,
                "within": e["stall_seconds"] <= bound,
                "first_step_seconds": e["first_step_seconds"],
                "steady_step_seconds": step,
                "first_over_steady": e["first_step_seconds"] / step,
                "warm_up_seconds": e.get("warm_up_seconds"),
                "compile_wait_seconds": e["compile_wait_seconds"],
            }
        )
    return rows


def row(summary: dict) -> dict:
    g = summary["goodput"]
    rows = events(summary)
    return {
        "warm_up": summary["warm_up"],
        "traced": summary.get("traced"),
        "compile_thread_seconds": summary.get("compile_thread_seconds"),
        "load_before": summary["bench"]["load_before"],
        "load_after": summary["bench"]["load_after"],
        "seconds": summary["bench"]["seconds"],
        "cpu_seconds": summary["bench"]["cpu_seconds"],
        "elastic": g["elastic"],
        "no_events": g["no_events"],
        "elastic_over_no_events": g["elastic_over_no_events"],
        "within_bound": sum(r["within"] for r in rows),
        "events": rows,
        "median_first_over_steady": statistics.median(r["first_over_steady"] for r in rows),
        "loop_seconds": g["lost_seconds_to"]["loop"],
        "loop_without_events_seconds": g["lost_seconds_to"]["loop_without_events"],
        "loop_beside_compiles": g["lost_seconds_to"]["loop_beside_compiles"],
    }


def log_line(r: dict) -> str:
    firsts = " ".join(f"{e['first_over_steady']:.2f}" for e in r["events"])
    stalls = " ".join(
        f"{e['stall_seconds']:.3f}/{e['bound_seconds']:.3f}{'' if e['within'] else '!'}"
        for e in r["events"]
    )
    load = f"{r['load_before'][0]:.1f}-{r['load_after'][0]:.1f}"
    beside = r["loop_beside_compiles"]
    threads = r["compile_thread_seconds"]
    work = "" if threads is None else f"; compile threads {threads:.2f} s, {r['traced']} traced"
    return (
        f"{r['variant']:10} load {load}, {r['seconds']:.1f} s, cpu {r['cpu_seconds']:.1f} s: "
        f"within bound {r['within_bound']}/"
        f"{len(r['events'])}, stall/bound {stalls}; first/steady {firsts}; elastic "
        f"{r['elastic']:.3f} no-events {r['no_events']:.3f} ratio {r['elastic_over_no_events']:.3f}"
        f"; loop {r['loop_seconds']:.2f} s ({r['loop_without_events_seconds']:.2f}), beside "
        f"compiles {beside['seconds']:.2f} s over {beside['steps']} steps (median gap "
        f"{beside['median_gap_ms'] or 0:.2f} ms, others {beside['other_median_gap_ms'] or 0:.2f})"
        f"{work}"
    )


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=pathlib.Path)
    parser.add_argument("--pairs", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=900.0, help="seconds a replay may take")
    parser.add_argument("--baseline", type=pathlib.Path, help="a checkout to run against")
    args = parser.parse_args(argv)
    executables = args.out / "executables"
    if not any(executables.glob("*.xla")):
        print("compiling run (fills the executable cache, not counted)", flush=True)
        replay(args.out / "compiling", executables, True, args.timeout)
    if args.baseline is None:  # (variant, warm_up, code)
        variants = [("warm_up", True, None), ("no_warm_up", False, None)]
    else:
        variants = [("current", True, None), ("baseline", True, args.baseline.resolve())]
    runs = []
    for pair in range(args.pairs):
        for name, warm_up, code in variants if pair % 2 == 0 else variants[::-1]:
            out = args.out / f"run{len(runs)}"
            r = {"variant": name} | row(replay(out, executables, warm_up, args.timeout, code))
            runs.append(r)
            print(log_line(r), flush=True)
    result = {"trace": str(TRACE), "runs": runs}
    for name, _, _ in variants:
        mine = [r for r in runs if r["variant"] == name]
        result[name] = {
            "within_bound": [r["within_bound"] for r in mine],
            "median_first_over_steady": statistics.median(
                e["first_over_steady"] for r in mine for e in r["events"]
            ),
            "elastic_over_no_events": [r["elastic_over_no_events"] for r in mine],
            "compile_thread_seconds": [r["compile_thread_seconds"] for r in mine],
            "cpu_seconds": [r["cpu_seconds"] for r in mine],
            "loop_beside_compiles_seconds": [r["loop_beside_compiles"]["seconds"] for r in mine],
        }
    (args.out / "philly_warm_up.json").write_text(json.dumps(result, indent=2) + "\n")
    for name, _, _ in variants:
        print(name, json.dumps(result[name]))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
