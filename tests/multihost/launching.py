"""What the launch tests share: ``tenplex-jax launch`` of the example job, waiting on its run
directory (read through ``tj.multihost.RunDir``), and killing a process by PID."""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import subprocess
import sys
import time

from tenplex_jax.multihost import RunDir
from tests.helpers import LAUNCH_BATCH, LAUNCH_GRAD_UNITS, LAUNCH_SAMPLES, ROOT

EXAMPLE = ROOT / "examples" / "elastic_gpt.py"
# seconds: a whole job, and one phase of it (a generation to start, compile and pause), each
# several times what they take on a loaded 2-core machine
TIMEOUT = 600
PHASE = 300


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = PHASE):
    """Wait until ``predicate()``; an AssertionError naming ``what`` and, from the launcher's
    log (``launch_example`` sets ``proc.log``), what happened instead, when the launcher exits
    first or ``timeout`` seconds pass."""
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(
                f"the launcher exited ({proc.returncode}) before {what}:\n{log_tail(proc)}"
            )
        if time.monotonic() > deadline:
            raise AssertionError(
                f"timed out after {timeout:.0f} s waiting for {what}:\n{log_tail(proc)}"
            )
        time.sleep(0.05)


def log_tail(proc: subprocess.Popen, chars: int = 3000) -> str:
    """The end of the launcher's output (``proc.log``), or a note that there is none."""
    path = getattr(proc, "log", None)
    if path is None or not path.exists():
        return "(no launcher log)"
    return path.read_text(errors="replace")[-chars:]


def launch(run: pathlib.Path, script: pathlib.Path, flags=(), args=(), env=None):
    """``tenplex-jax launch FLAGS --run-dir RUN SCRIPT ARGS``, started from the repository's
    root, its output in RUN_DIR/launcher.log (``proc.log``)."""
    command = [sys.executable, "-m", "tenplex_jax", "launch", *flags, "--run-dir", str(run)]
    with open(run / "launcher.log", "wb") as out:
        proc = subprocess.Popen(
            [*command, str(script), *args], cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT
        )
    proc.log = run / "launcher.log"
    return proc


def launch_example(run: pathlib.Path, nprocs: int, steps: int, *, flags=(), script=()):
    """``tenplex-jax launch`` of the example job as the launch tests run it (2 devices per
    process, replicas=1, a commit every 2 steps, the final state to RUN_DIR/final.npz): ``flags``
    go to the launcher, ``script`` to the script."""
    launcher = ["--nprocs", str(nprocs), "--devices-per-proc", "2", "--replicas", "1"]
    launcher += ["--commit-every", "2", *flags]
    sizes = ["--batch", str(LAUNCH_BATCH), "--grad-units", str(LAUNCH_GRAD_UNITS)]
    sizes += ["--samples", str(LAUNCH_SAMPLES), "--out", str(run / "final.npz")]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    return launch(run, EXAMPLE, launcher, ["--steps", str(steps), *sizes, *script], env)


def last(run: pathlib.Path, kind: str) -> dict | None:
    """The launcher's last event of ``kind`` so far, or None."""
    found = RunDir(run).events(kind)
    return found[-1] if found else None


def paused(run: pathlib.Path, step: int, processes: int) -> bool:
    """Whether ``processes`` processes of the example job wait at the boundary after ``step``
    (``--pause-after``)."""
    return all((run / f"paused-{step}-p{i}").exists() for i in range(processes))


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def alive(pids) -> list[int]:
    """Those of ``pids`` that are still processes (none, once every child was reaped)."""
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive
