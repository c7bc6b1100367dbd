"""A survivor's side of a change, piece by piece: breaking its collectives with its peers (real
TCP connections to real processes on 127.0.0.1) and the launcher's messages on its stdin.

The whole path — a launched job whose survivors stay in their processes when process 0 dies with
the others blocked in a collective — is in ``tests/test_survivors.py``.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tenplex_jax._src.multihost import membership

PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"x")
data = s.recv(1)  # blocks until the other side sends, or shuts the connection down
sys.exit(0 if data == b"" else 3)
"""


def _peer(listener: socket.socket) -> tuple[subprocess.Popen, socket.socket]:
    """A process connected to ``listener``, blocked in a receive; our end of its connection."""
    port = listener.getsockname()[1]
    proc = subprocess.Popen([sys.executable, "-c", PEER, str(port)])
    conn, _ = listener.accept()
    assert conn.recv(1) == b"x"  # it is connected and about to block
    return proc, conn


def test_breaking_collectives_shuts_the_connections_to_the_peers_only():
    with socket.create_server(("127.0.0.1", 0)) as listener:
        blocked, ours = _peer(listener)
        other, kept = _peer(listener)
        try:
            shut = membership.break_collectives([blocked.pid])
            assert shut == 1
            assert blocked.wait(30) == 0  # its receive returned: the connection was shut down
            assert ours.recv(1) == b""  # our end too
            # the connection to a process that is not a peer still works
            kept.sendall(b"y")
            assert other.wait(30) == 3
        finally:
            for proc in (blocked, other):
                proc.kill()
                proc.wait()
            ours.close()
            kept.close()


def test_breaking_collectives_with_no_live_peer_shuts_nothing():
    assert membership.break_collectives([os.getpid(), 2**22 + 1]) == 0


class _Lines:
    """A stream the test writes lines into, read by the control thread (blocking)."""

    def __init__(self):
        self._r, self._w = os.pipe()
        self.reader = os.fdopen(self._r, "r")

    def send(self, message: dict | None) -> None:
        if message is None:
            os.close(self._w)
        else:
            os.write(self._w, (json.dumps(message) + "\n").encode())


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_the_end_of_a_generation_interrupts_the_script_while_armed():
    lines = _Lines()
    control = membership.Control(lines.reader)
    control.arm()
    lines.send({"end": "failure", "peers": []})
    interrupted = False
    try:
        try:
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:  # a script busy in Python code
                time.sleep(0.001)
        finally:
            control.disarm()
    except membership.GenerationEnded:
        interrupted = True
    assert interrupted
    assert control.ending.is_set()


def test_a_disarmed_process_is_told_but_not_interrupted_and_takes_its_next_rank():
    lines = _Lines()
    control = membership.Control(lines.reader)
    lines.send({"end": "failure", "peers": []})
    assert control.wait_ending(30)
    for _ in range(1000):  # a pending interruption would be raised here
        pass
    rank = {"env": {"TENPLEX_JOB": "{}"}, "log": None, "warm": True}
    lines.send(rank)
    assert control.rank(timeout=30) == rank
    lines.send(None)  # EOF: the launcher has no use for this process
    assert control.rank(timeout=30) is None
