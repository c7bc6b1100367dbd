"""A survivor's side of a change, piece by piece: breaking its collectives with its peers (real
TCP connections to real processes on 127.0.0.1) and the launcher's messages on its stdin.

The whole path — a launched job whose survivors stay in their processes when process 0 dies with
the others blocked in a collective — is in ``tests/multihost/test_survivors.py``.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time

import pytest

from tenplex_jax._src.multihost import membership
from tenplex_jax._src.multihost.processes import free_port

SURVIVOR = """
import json, os, socket, subprocess, sys, time
from tenplex_jax._src.multihost import membership
from tenplex_jax._src.multihost.processes import free_port

def connected(listener, argv):
    port = str(listener.getsockname()[1])
    proc = subprocess.Popen([sys.executable, "-c", sys.argv[1], port, *argv])
    conn, _ = listener.accept()
    assert conn.recv(1) == b"x"
    return proc, conn

def within(listener):  # a connection of this process with itself: both ends
    near = socket.create_connection(listener.getsockname())
    far, _ = listener.accept()
    return near, far

def shut(conn):  # whether this end was shut down: a receive returns at once, with nothing
    conn.settimeout(0.2)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False

with (
    socket.create_server(("127.0.0.1", 0)) as listener,
    socket.create_server(("127.0.0.1", 0)) as collectives,  # its published endpoint
    socket.create_server(("127.0.0.1", 0)) as service,  # a service of its own: not published
):
    peer, to_peer = connected(listener, ["wait"])  # a trainer of the generation
    other, to_other = connected(listener, ["wait"])  # a process that is not one (a store)
    dead, to_dead = connected(listener, ["exit"])  # a trainer that died: its end is gone
    dead.wait()
    mine, own = within(collectives)  # gloo's between this process's own devices
    client, served = within(service)  # e.g. a compile-only topology's client and service
    endpoints = ["0100007F:%04X" % collectives.getsockname()[1]]
    count = membership.break_collectives([peer.pid, dead.pid, os.getpid()], endpoints)
    result = {"count": count, "peer": shut(to_peer), "other": shut(to_other),
              "dead": shut(to_dead), "own": shut(mine) and shut(own),
              "service": shut(client) or shut(served)}
    to_other.sendall(b"y")  # still open both ways
    client.sendall(b"z")
    result["service_saw"] = served.recv(1).decode()
    result["peer_saw"] = peer.wait(30)
    result["other_saw"] = other.wait(30)
    print(json.dumps(result))
"""

PEER = """
import socket, sys
s = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
s.sendall(b"x")
if sys.argv[2] == "exit":
    sys.exit(0)
data = s.recv(1)  # blocks until the other side sends, or shuts the connection down
sys.exit(4 if data == b"" else 3)
"""


def test_breaking_collectives_shuts_the_trainers_connections_only():
    """In a process of its own (it shuts connections within itself too): its connections with a
    peer, with a dead peer and within itself through its published endpoint are shut; one with
    another process, and one within itself to a service of its own, stay."""
    done = subprocess.run(
        [sys.executable, "-c", SURVIVOR, PEER], capture_output=True, text=True, timeout=120
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["peer"] and result["own"] and result["dead"], result
    assert not result["other"] and not result["service"], result
    assert result["service_saw"] == "z", result  # it received the byte sent after the break
    assert result["peer_saw"] == 4  # its receive returned: the connection was shut down
    assert result["other_saw"] == 3  # it received the byte sent after the break
    assert result["count"] == 4, result  # the peer's, the dead peer's, both ends of its own


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


PUBLISHED = """
import json, socket, subprocess, sys
from tenplex_jax._src.multihost import membership
from tenplex_jax._src.multihost.processes import free_port

def endpoint(sock):  # as /proc/net/tcp writes 127.0.0.1:port
    return "0100007F:%04X" % sock.getsockname()[1]

def shut(conn):
    conn.settimeout(0.2)
    try:
        return conn.recv(1) == b""
    except TimeoutError:
        return False

def child(script, *argv):
    command = [sys.executable, "-c", script, *argv]
    proc = subprocess.Popen(command, stdout=subprocess.PIPE, text=True)
    return proc, int(proc.stdout.readline())

with socket.create_server(("127.0.0.1", 0)) as mine:
    # a trainer on "another host": not a pid this process is told; it listens, and connects to
    # this process's listener as gloo's pairs do
    trainer, port = child(sys.argv[1], str(mine.getsockname()[1]))
    to_trainer = socket.create_connection(("127.0.0.1", port))  # to its published endpoint
    from_trainer, _ = mine.accept()  # on this process's published endpoint
    store, store_port = child(sys.argv[2])  # a store: listens, not published
    to_store = socket.create_connection(("127.0.0.1", store_port))
    assert membership.listening() == [endpoint(mine)]
    endpoints = [endpoint(mine), "0100007F:%04X" % port]
    count = membership.break_collectives([], endpoints)
    result = {"count": count, "to_trainer": shut(to_trainer), "from_trainer": shut(from_trainer),
              "store": shut(to_store)}
    to_store.sendall(b"y")
    result["store_open"] = to_store.recv(1) == b"y"  # echoed: open both ways
    result["trainer_saw"], result["store_saw"] = trainer.wait(30), store.wait(30)
    print(json.dumps(result))
"""

STORE = """
import socket
with socket.create_server(("127.0.0.1", 0)) as listener:
    print(listener.getsockname()[1], flush=True)
    conn, _ = listener.accept()
    conn.sendall(conn.recv(1))
"""

TRAINER = """
import socket, sys
with socket.create_server(("127.0.0.1", 0)) as listener:
    print(listener.getsockname()[1], flush=True)
    accepted, _ = listener.accept()
    out = socket.create_connection(("127.0.0.1", int(sys.argv[1])))
    # each receive returns b"" once the survivor shuts its end down
    sys.exit(5 if accepted.recv(1) == b"" and out.recv(1) == b"" else 3)
"""


def test_breaking_collectives_shuts_the_connections_of_published_endpoints_on_any_host():
    """With no pid to find them by (a trainer on another host), the connections to a trainer's
    published collectives endpoint and those accepted on this process's own are shut; a
    connection to an endpoint nobody published (a store) stays."""
    done = subprocess.run(
        [sys.executable, "-c", PUBLISHED, TRAINER, STORE],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert done.returncode == 0, done.stderr
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["to_trainer"] and result["from_trainer"], result
    assert not result["store"] and result["store_open"] and result["store_saw"] == 0, result
    assert result["trainer_saw"] == 5, result  # both of its ends saw the shutdown
    assert result["count"] == 2, result


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
    control.close()
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
    control.close()


def test_a_growth_announced_reaches_the_job_that_watches_once_and_ends_with_its_generation():
    """The launcher announces a planned growth while the generation trains: a job watching
    hears it on the control thread, and one that starts watching after it hears it at once;
    a rank (the next generation) forgets it; a job that stopped watching hears nothing."""
    lines = _Lines()
    control = membership.Control(lines.reader)
    heard: list[tuple[str, int]] = []
    arrived = threading.Event()

    def first(n):
        heard.append(("first", n))
        arrived.set()

    control.watch_growth(first)
    lines.send({"grow": 4})
    assert arrived.wait(30)
    control.watch_growth(None)
    control.watch_growth(lambda n: heard.append(("late", n)))  # announced before it watched
    assert heard == [("first", 4), ("late", 4)]
    control.watch_growth(None)
    lines.send({"grow": 5})  # nobody watches: kept for a job that starts watching
    rank = {"env": {"TENPLEX_JOB": "{}"}, "log": None, "warm": True}
    lines.send(rank)
    assert control.rank(timeout=30) == rank  # the next generation: the announcement is gone
    control.watch_growth(lambda n: heard.append(("next", n)))
    assert heard == [("first", 4), ("late", 4)]
    lines.send(None)
    control.close()


@pytest.mark.skipif(
    threading.current_thread() is not threading.main_thread(), reason="needs the main thread"
)
def test_the_end_of_a_generation_interrupts_a_wait_on_a_future():
    """A main thread waiting on a future (a compile, a pull) is interrupted too: an
    asynchronous exception alone would wait until the future is done."""
    import concurrent.futures

    lines = _Lines()
    control = membership.Control(lines.reader)
    never: concurrent.futures.Future = concurrent.futures.Future()
    control.arm()
    threading.Timer(0.2, lines.send, [{"end": "failure", "peers": []}]).start()
    tic = time.monotonic()
    try:
        try:
            never.result(timeout=60)
        finally:
            control.disarm()
    except membership.GenerationEnded:
        pass
    control.close()
    assert time.monotonic() - tic < 30


JOINING = """
import time
from tenplex_jax._src.multihost import membership
from tenplex_jax._src.multihost.processes import free_port

control = membership.Control()
with control.joining():
    print("joining", flush=True)
    time.sleep(60)  # as uninterruptible as jax.distributed's connect, for this test
"""


def test_a_process_still_joining_when_its_generation_ends_exits_for_its_standby():
    proc = subprocess.Popen(
        [sys.executable, "-c", JOINING], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout.readline().strip() == "joining"
        proc.stdin.write(json.dumps({"end": "failure", "peers": []}) + "\n")
        proc.stdin.flush()
        assert proc.wait(30) == membership.REJOIN
    finally:
        proc.kill()
        proc.wait()


LEAVING = """
import sys, time
from tenplex_jax._src.multihost import membership
from tenplex_jax._src.multihost.processes import free_port

process, port = int(sys.argv[1]), sys.argv[2]
membership.join(f"127.0.0.1:{port}", 2, process, 1, hosted=False)
if process == 1:
    time.sleep(2)  # slow to leave: process 0, which hosts the service, has exited by then
"""


def test_where_process_0_hosts_the_service_a_process_slower_to_leave_exits_cleanly():
    """``--no-keep``: every process leaves at a planned change and process 0 hosts the
    coordination service. Its exit must not end the service under a slower process's
    shutdown: with recoverable tasks (which skip the shutdown barrier) that process aborted,
    and the launcher saw a failure instead of the change."""
    port = str(free_port())
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", LEAVING, str(i), port],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        for i in range(2)
    ]
    try:
        codes = [proc.wait(120) for proc in procs]
        assert codes == [0, 0], [proc.stdout.read()[-2000:] for proc in procs]
    finally:
        for proc in procs:
            proc.kill()
            proc.wait()
