"""A launched job beside CPU hogs: slow is not dead.

``tenplex-jax launch`` runs the example job (``examples/elastic_gpt.py``, ``--nprocs`` processes
x 2 CPU devices, a replica per process, a commit every 2 steps) while ``--hogs`` processes spin
on the CPU (the host's load several times its cores). Nothing is killed, so the job must end in
the generation it started in: a generation change here is a healthy process taken for a dead
one (a missed heartbeat, a timeout). Prints the run's wall time, the load average at its end
and the launcher's events; exits 1 if the job changed generation or failed.

    python -m tenplex_jax_benchmarks.launch_under_load [--hogs 8] [--nprocs 4] [--steps 40]
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

from tenplex_jax.multihost import RunDir, RunEvent

ROOT = pathlib.Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "elastic_gpt.py"


def run(hogs: int, nprocs: int, steps: int, timeout: float) -> dict:
    """The job beside ``hogs`` spinning processes: its events, wall time and the load."""
    spin = [sys.executable, "-c", "while True: pass"]
    spinning = [subprocess.Popen(spin) for _ in range(hogs)]
    run_dir = pathlib.Path(tempfile.mkdtemp(prefix="tenplex-load-"))
    launcher = ["--nprocs", str(nprocs), "--devices-per-proc", "2", "--replicas", "1"]
    launcher += ["--commit-every", "2", "--run-dir", str(run_dir)]
    script = ["--steps", str(steps)]
    command = [sys.executable, "-m", "tenplex_jax", "launch", *launcher, str(EXAMPLE), *script]
    start = time.monotonic()
    try:
        with open(run_dir / "launcher.log", "wb") as log:
            job = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT)
        try:
            code = job.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            job.kill()
            code = job.wait()
        load = os.getloadavg()[0]
    finally:
        for each in spinning:
            each.kill()
            each.wait()
    events = RunDir(run_dir).events()
    return {
        "hogs": hogs,
        "processes": nprocs,
        "steps": steps,
        "exit": code,
        "seconds": round(time.monotonic() - start, 1),
        "load": round(load, 1),
        "generations": len([e for e in events if e["event"] == RunEvent.GENERATION]),
        "failures": [e.get("detail") for e in events if e["event"] == RunEvent.FAILURE],
        "events": [e["event"] for e in events],
        "run_dir": str(run_dir),
    }


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--hogs", type=int, default=8, help="spinning processes (default 8)")
    parser.add_argument("--nprocs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--timeout", type=float, default=1200.0)
    parser.add_argument("--out", type=pathlib.Path, help="write the row as JSON here")
    args = parser.parse_args(argv)
    row = run(args.hogs, args.nprocs, args.steps, args.timeout)
    print(json.dumps(row, indent=1))
    if args.out:
        args.out.write_text(json.dumps(row, indent=1) + "\n")
    healthy = row["exit"] == 0 and row["generations"] == 1 and not row["failures"]
    return 0 if healthy else 1


if __name__ == "__main__":
    sys.exit(main())
