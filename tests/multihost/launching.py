"""What the launch tests share: ``tenplex-jax launch`` of the example job, waiting on its run
directory's events, and killing a process by PID."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import subprocess
import sys
import time

from tests.helpers import LAUNCH_BATCH, LAUNCH_GRAD_UNITS, LAUNCH_SAMPLES, ROOT, events

EXAMPLE = ROOT / "examples" / "elastic_gpt.py"
TIMEOUT = 300  # the whole job, seconds


def wait_for(predicate, what: str, proc: subprocess.Popen, timeout: float = 150.0):
    deadline = time.monotonic() + timeout
    while not predicate():
        if proc.poll() is not None:
            raise AssertionError(f"the launcher exited ({proc.returncode}) before {what}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


def launch_example(run: pathlib.Path, nprocs: int, steps: int, *, flags=(), script=()):
    """``tenplex-jax launch`` of the example job as the launch tests run it (2 devices per
    process, replicas=1, a commit every 2 steps, the final state to RUN_DIR/final.npz), started
    with its output in RUN_DIR/launcher.log: ``flags`` go to the launcher, ``script`` to the
    script."""
    command = [
        sys.executable,
        "-m",
        "tenplex_jax",
        "launch",
        "--nprocs",
        str(nprocs),
        "--devices-per-proc",
        "2",
        "--replicas",
        "1",
        "--commit-every",
        "2",
        *flags,
        "--run-dir",
        str(run),
        str(EXAMPLE),
        "--steps",
        str(steps),
        "--batch",
        str(LAUNCH_BATCH),
        "--grad-units",
        str(LAUNCH_GRAD_UNITS),
        "--samples",
        str(LAUNCH_SAMPLES),
        "--out",
        str(run / "final.npz"),
        *script,
    ]
    env = os.environ | {"JAX_PLATFORMS": "cpu"}
    with open(run / "launcher.log", "wb") as out:
        return subprocess.Popen(command, cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT)


def last(run: pathlib.Path, kind: str) -> dict | None:
    found = [e for e in events(run) if e["event"] == kind]
    return found[-1] if found else None


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


def step_records(run: pathlib.Path, generation: int) -> list[dict]:
    """How each process of ``generation`` got its step: loaded or compiled."""
    paths = sorted(run.glob(f"step-g{generation}-p*.json"))
    return [json.loads(path.read_text()) for path in paths]
