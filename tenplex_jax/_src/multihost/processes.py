"""The launcher's children: started in their own session, signalled and reaped by PID.

A child dies with the launcher (Linux's parent-death signal), even when the launcher is
SIGKILLed, and is never found by name.
"""

from __future__ import annotations

import contextlib
import os
import pathlib
import signal
import socket
import subprocess
import sys

from tenplex_jax._src import libc


def kill(proc: subprocess.Popen, sig=signal.SIGKILL, timeout: float = 10.0) -> None:
    """Signal ``proc`` by PID unless it has exited; reap it (SIGKILL if ``sig`` does not do)."""
    if proc.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            with contextlib.suppress(ProcessLookupError):
                proc.kill()
            proc.wait(timeout)
    else:
        proc.wait()


def exited(proc: subprocess.Popen) -> bool:
    """Whether ``proc`` has exited, reaped or not. ``proc.poll()`` says None while another thread
    waits for ``proc`` (``Popen`` waits under a lock that ``poll`` does not wait for), even after
    the exit: this asks the kernel without reaping."""
    if proc.returncode is not None:
        return True
    try:
        return os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT) is not None
    except ChildProcessError:  # reaped meanwhile, by the thread that waits for it
        return True


def release(proc: subprocess.Popen) -> None:
    """Tell a process that waits for a rank to exit (EOF on its stdin), and reap it."""
    with contextlib.suppress(OSError):
        proc.stdin.close()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(2.0)
    kill(proc)


def spawn(command: list[str], **kwargs) -> subprocess.Popen:
    """A child in its own session (a Ctrl-C at the terminal reaches the launcher only, which then
    kills it by PID) that Linux SIGKILLs if the launcher dies, even by SIGKILL."""
    prctl = libc.function("prctl") if sys.platform.startswith("linux") else None
    die = None if prctl is None else (lambda: prctl(1, signal.SIGKILL))  # PR_SET_PDEATHSIG
    # the callable only calls a libc function resolved here, before the fork
    return subprocess.Popen(command, start_new_session=True, preexec_fn=die, **kwargs)


def write_token(path: pathlib.Path) -> pathlib.Path:
    """A fresh secret for the job's stores, in a file only this user can read; its path."""
    import secrets

    path.unlink(missing_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secrets.token_hex(32))
    return path


def status(code: int) -> str:
    if code < 0:
        return f"was killed by {signal.Signals(-code).name}"
    return f"exited with status {code}"


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]
