"""The tensor store against hostile peers: bounded memory, connections and handshakes, refused
Unix socket paths, and malformed requests answered with errors, never a crash.

Every server is a real subprocess on 127.0.0.1, every attacker a raw socket speaking the wire
protocol (or not). Tests wait on what the server reports (``stats``, its peak RSS, its open file
descriptors, a connection it closed), never on a fixed sleep.
"""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import resource
import socket
import subprocess
import sys
import threading
import time

import numpy as np
import psutil
import pytest

import tenplex_jax as tj
from tenplex_jax._src.multihost.store import wire
from tenplex_jax.multihost import store
from tests.helpers import peak_rss, raw_socket, recv_frame

MIB = 1 << 20


def _wait_for(predicate, what: str, timeout: float = 30.0):
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)
    return value


def _closed_by_peer(sock: socket.socket, timeout: float) -> bool:
    """Whether the peer closes ``sock`` within ``timeout`` (reading and dropping what it sends)."""
    sock.settimeout(timeout)
    try:
        while sock.recv(1 << 16):
            pass
    except TimeoutError:
        return False
    except OSError:  # reset
        return True
    return True


# -- memory: one budget for every byte in flight ---------------------------------------------------


def _put_header(sock: socket.socket, path: str, size: int) -> None:
    """The header of a put of ``size`` bytes, its body not sent (it waits for "continue")."""
    request = {
        "op": "put",
        "path": path,
        "box": [[0, size]],
        "global_shape": [size],
        "dtype": "uint8",
        "checksum": None,
    }
    wire.send_header(sock, request, size)


def test_withheld_trailers_and_unread_replies_stay_within_the_memory_bound(stores) -> None:
    """20 puts of 40 MiB that send their body but never the checksum trailer, then 8 gets of
    40 MiB disk objects whose replies are never read: the server's peak RSS grows by at most
    the stated bound, 2 x --memory-bytes (the memory tier and the transfer budget), and a small
    put from a well-behaved client is still served while the attack holds the budget."""
    limit, size = 64 * MIB, 40 * MIB
    body = np.ones(size, np.uint8)
    proc = stores.start(memory_bytes=limit)
    with store.StoreClient(proc.address) as client:
        for i in range(8):  # objects for the gets
            client.put(f"disk/{i}", body, durable=True)
    proc.stop()
    proc = stores.start(memory_bytes=limit, args=("--timeout", "60"))  # they are on disk only
    with store.StoreClient(proc.address) as client:
        base = peak_rss(proc.pid)
        attackers = []
        try:
            for i in range(20):
                sock = raw_socket(proc.address)
                _put_header(sock, f"w/{i}", size)
                attackers.append(sock)
            # one put is admitted and receives its body; the other 19 wait for room
            admitted = next(s for s in attackers if _ready(s))
            assert recv_frame(admitted)[0]["continue"]
            admitted.sendall(body)  # and then never the trailer
            _wait_for(
                lambda: (
                    (st := client.stats())["transfers_waiting"] == 19
                    and st["receiving"] == []
                    and st["transfer_bytes"] == size
                ),
                "one body received, 19 puts waiting",
            )
            put_peak = peak_rss(proc.pid) - base
            client.put("ok/small", np.arange(1000))  # fits beside the held body
            np.testing.assert_array_equal(client.get("ok/small"), np.arange(1000))
        finally:
            for sock in attackers:
                sock.close()
        # the 19 waiting puts leave one by one as they find their client gone, so the budget can
        # be empty while some still wait: wait until none holds it and none waits for it
        _wait_for(
            lambda: (st := client.stats())["transfer_bytes"] == 0 and st["transfers_waiting"] == 0,
            "the budget released and no put waiting",
        )
        readers = []
        try:
            for i in range(8):
                sock = raw_socket(proc.address)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4096)
                wire.send_frame(sock, {"op": "get", "path": f"disk/{i}", "box": None})
                readers.append(sock)  # never read
            _wait_for(lambda: client.stats()["transfers_waiting"] == 7, "7 gets waiting")
            get_peak = peak_rss(proc.pid) - base
        finally:
            for sock in readers:
                sock.close()
    bound = 2 * limit + 16 * MIB  # + the allocator's slack
    assert put_peak <= bound, f"withheld trailers: peak RSS grew {put_peak / MIB:.0f} MiB"
    assert get_peak <= bound, f"unread replies: peak RSS grew {get_peak / MIB:.0f} MiB"


def _ready(sock: socket.socket) -> bool:
    """Whether the server has answered ``sock`` (without reading the answer)."""
    sock.settimeout(0.0)
    try:
        return bool(sock.recv(1, socket.MSG_PEEK))
    except BlockingIOError:
        return False
    finally:
        sock.settimeout(30)


def test_a_transfer_waiting_for_room_leaves_when_its_client_closes(stores) -> None:
    """One put holds the whole budget (its trailer withheld); 6 more wait for room, and their
    clients give up and close. The store drops them within seconds, not at its 60 s timeout; a
    put that comes next waits alone behind the held one and is admitted when it is released."""
    size = 40 * MIB
    proc = stores.start(memory_bytes=64 * MIB, args=("--timeout", "60"))
    with store.StoreClient(proc.address) as client:
        holder = raw_socket(proc.address)
        _put_header(holder, "held", size)
        assert recv_frame(holder)[0]["continue"]
        holder.sendall(np.ones(size, np.uint8))  # and never the trailer
        waiting = []
        for i in range(6):
            waiting.append(raw_socket(proc.address))
            _put_header(waiting[-1], f"w/{i}", size)
        _wait_for(lambda: client.stats()["transfers_waiting"] == 6, "6 puts waiting")
        for sock in waiting:
            sock.close()
        tic = time.monotonic()
        _wait_for(lambda: client.stats()["transfers_waiting"] == 0, "the closed ones gone", 15)
        assert time.monotonic() - tic < 15 and client.stats()["transfer_bytes"] == size
        late = raw_socket(proc.address)  # a put that stays waits for room as before
        _put_header(late, "late", size)
        _wait_for(lambda: client.stats()["transfers_waiting"] == 1, "the late put waiting")
        holder.close()  # the held put ends, and the late one is admitted
        assert recv_frame(late)[0]["continue"]
        late.close()


def test_a_watch_whose_client_closes_leaves_its_slot_at_once(stores) -> None:
    """A get_json that waits for a newer version (up to 30 s) ends when its client goes."""
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        client.put_json("n", {"count": 0})
        _, version, _ = client.get_json("n", versioned=True)
        watcher = raw_socket(proc.address)
        wire.send_frame(
            watcher, {"op": "get_json", "path": "n", "newer_than": version, "wait": 25.0}
        )
        _wait_for(lambda: client.stats()["connections"] == 2, "the watch served")
        watcher.close()
        _wait_for(lambda: client.stats()["connections"] == 1, "the watch's slot free", 10)


def test_an_object_larger_than_the_budget_streams_through_disk_a_chunk_at_a_time(stores) -> None:
    """With a memory tier of 0 the transfer budget is 64 MiB: a 96 MiB put is written to disk as
    it arrives and gets read it back a 16 MiB chunk at a time, whole or a sub-box, bit for bit,
    the server's peak RSS growing by far less than the object; a damaged file is refused."""
    proc = stores.start(memory_bytes=0)
    full = np.random.default_rng(0).integers(0, 255, (96, 1 << 20), dtype=np.uint8)
    with store.StoreClient(proc.address) as client:
        idle = peak_rss(proc.pid)
        client.put("big", full)
        np.testing.assert_array_equal(client.get("big"), full)
        np.testing.assert_array_equal(client.get("big", ((17, 80), (5, 1000))), full[17:80, 5:1000])
        assert peak_rss(proc.pid) - idle < 64 * MIB
        assert client.stats()["transfer_bytes"] == 0
        [file] = (proc.dir / "objects").glob("*.obj")
        with open(file, "r+b") as f:  # one bit of the data, far from the header
            f.seek(50 * MIB)
            byte = f.read(1)
            f.seek(50 * MIB)
            f.write(bytes([byte[0] ^ 4]))
        with pytest.raises(tj.errors.StoreError, match="corrupt on disk") as err:
            client.get("big", ((0, 2), (0, 8)))
        assert err.value.reason == "corrupt"
        with pytest.raises(tj.errors.StoreError) as err:
            client.get("big")
        assert err.value.reason == "not_found"  # set aside, never served again
        assert len(list((proc.dir / "corrupt").iterdir())) == 1


# -- connections: a cap, a handshake deadline, an accept loop that backs off -----------------------


def test_connections_over_the_cap_are_told_busy_and_silent_ones_leave_at_the_deadline(
    stores,
) -> None:
    """8 connections whose hello passed hold every slot of --max-connections 8, and 300 silent
    ones (no hello) wait in their handshake: the server keeps a thread for each of the 8 and
    none for a silent one, answers one more hello "busy" without blocking its loop, closes every
    silent one (the oldest as newer ones come over --max-handshakes, the rest at the handshake
    deadline), and serves a real client once the 8 have left."""
    proc = stores.start(
        args=("--max-connections", "8", "--max-handshakes", "32", "--handshake-timeout", "2")
    )
    threads_before = psutil.Process(proc.pid).num_threads()
    held = [raw_socket(proc.address) for _ in range(8)]
    silent = [raw_socket(proc.address, hello=False) for _ in range(300)]
    try:
        with pytest.raises(tj.errors.StoreError, match=r"at most 8 connections") as err:
            store.StoreClient(proc.address, timeout=10).list()
        assert err.value.reason == "busy"
        # a thread per admitted connection, a timer-free deadline: no thread per pending one
        assert psutil.Process(proc.pid).num_threads() <= threads_before + 8
        # every silent connection is closed by the server: evicted or at the deadline
        assert all(_closed_by_peer(sock, timeout=30) for sock in silent)
    finally:
        for sock in silent + held:
            sock.close()
    with _wait_for(lambda: _served_client(proc.address), "a slot freed by the 8 leaving") as client:
        client.put("after", np.arange(4))
        _wait_for(lambda: client.stats()["connections"] == 1, "the 8 threads gone")
        assert client.stats()["handshakes"] == 0


def test_a_hello_sent_a_byte_at_a_time_is_cut_at_the_handshake_deadline(stores) -> None:
    """The per-receive timeout (--timeout) alone let one byte a second hold a connection."""
    proc = stores.start(args=("--handshake-timeout", "1", "--timeout", "120"))
    frame = wire.PREFIX.pack(wire.MAGIC, 200, 0) + b" " * 200
    sock = raw_socket(proc.address, hello=False)
    start = time.monotonic()
    try:
        for i in range(len(frame)):
            try:
                sock.send(frame[i : i + 1])
            except OSError:
                break  # reset by the server
            if _closed_by_peer(sock, timeout=0.2):
                break
        waited = time.monotonic() - start
    finally:
        sock.close()
    assert waited < 10, f"the trickling hello held its connection {waited:.1f} s"


def test_requests_trickled_past_the_handshake_are_cut_at_the_request_deadline(stores) -> None:
    """Each served slot held by a client that sends its request a byte at a time, each byte
    within the per-receive timeout: a request must arrive whole within --timeout of its first
    byte, so the slots free and another client is served."""
    proc = stores.start(args=("--max-connections", "4", "--timeout", "2"))
    frame = wire.PREFIX.pack(wire.MAGIC, 200, 0) + b" " * 200
    stop, cut = threading.Event(), []

    def trickle():
        sock = raw_socket(proc.address)  # its hello passed: it holds a served slot
        try:
            for i in range(len(frame)):
                sock.send(frame[i : i + 1])
                if _closed_by_peer(sock, timeout=0.5) or stop.is_set():
                    break
            cut.append(not stop.is_set())
        except OSError:  # reset by the server
            cut.append(True)
        finally:
            sock.close()

    tricklers = [threading.Thread(target=trickle) for _ in range(4)]
    for thread in tricklers:
        thread.start()
    try:
        _wait_for(lambda: len(cut) == 4, "the server cutting every trickled request", 60)
        with store.StoreClient(proc.address, retry_seconds=30) as client:
            client.put_json("served", {"ok": 1})
            assert client.get_json("served") == {"ok": 1}
    finally:
        stop.set()
        for thread in tricklers:
            thread.join(30)
    assert all(cut), cut


@pytest.mark.parametrize("hello", [True, False], ids=["served", "silent"])
def test_at_the_descriptor_limit_the_accept_loop_backs_off_and_recovers(stores, hello) -> None:
    """With no file descriptor left, accept fails; the server must neither spin on it (a core at
    100 %) nor stop serving once descriptors are free again. Served connections hold the
    descriptors: the loop stops accepting for a backoff; silent ones: each accept that fails
    closes the oldest pending handshake for the connection waiting."""
    proc = stores.start(args=("--handshake-timeout", "60"))
    server = psutil.Process(proc.pid)
    limit = server.num_fds() + 20
    resource.prlimit(proc.pid, resource.RLIMIT_NOFILE, (limit, limit))
    held = []
    try:
        for _ in range(40):  # 20 are accepted, the rest wait in the listen backlog
            held.append(raw_socket(proc.address, hello=False))
            if hello:  # not waiting for the answer, which only 20 get
                wire.send_frame(held[-1], {"op": "hello", "token": None})
        _wait_for(lambda: server.num_fds() >= limit, "the server at its descriptor limit")
        cpu = sum(server.cpu_times()[:2])
        time.sleep(3.0)  # a window to measure: the CPU the accept loop burns in 3 s
        burnt = sum(server.cpu_times()[:2]) - cpu
        assert burnt < 0.5, f"the accept loop spun: {burnt:.2f} s of CPU in 3 s"
    finally:
        for sock in held:
            sock.close()
    with store.StoreClient(proc.address, timeout=30) as client:
        client.put("after", np.arange(4))
        np.testing.assert_array_equal(client.get("after"), np.arange(4))


# -- the Unix socket path ------------------------------------------------------------------------


def test_the_unix_socket_path_is_never_a_file_and_never_a_live_servers(stores, tmp_path) -> None:
    path = tmp_path / "store.sock"
    path.write_text("precious")
    with pytest.raises(tj.errors.StoreError, match="exited with 2"):
        stores.start("a", unix_socket=path, stderr=subprocess.DEVNULL)
    assert path.read_text() == "precious"
    path.unlink()

    first = stores.start("b", unix_socket=path)
    with pytest.raises(tj.errors.StoreError, match="exited with 2"):
        stores.start("c", unix_socket=path, stderr=subprocess.DEVNULL)
    with store.StoreClient(first.unix_address) as client:  # still the first server's socket
        client.put("x", np.arange(3))
        assert client.stats()["pid"] == first.pid

    first.kill()  # leaves a stale socket behind
    assert path.is_socket()
    second = stores.start("d", unix_socket=path)
    with store.StoreClient(second.unix_address) as client:
        assert client.stats()["pid"] == second.pid
    second.stop()
    assert not path.exists()  # its own socket, removed at exit


# -- malformed requests: an error reply, never a crash ---------------------------------------------

# each with the body size the request implies (so that only the rule it breaks refuses it)
BAD_PUTS = {
    "inverted box": ({"box": [[5, 2]], "global_shape": [8], "dtype": "int8"}, 0),
    "float box entry": ({"box": [[0.5, 4]], "global_shape": [8], "dtype": "int8"}, 4),
    "bool box entry": ({"box": [[False, True]], "global_shape": [8], "dtype": "int8"}, 1),
    "float global shape": ({"box": [[0, 4]], "global_shape": [8.0], "dtype": "int8"}, 4),
    "100 dims": ({"box": [[0, 1]] * 100, "global_shape": [1] * 100, "dtype": "int8"}, 1),
    "str dtype": ({"box": [[0, 10**15]], "global_shape": [10**15], "dtype": "str"}, 0),
    "bytes dtype": ({"box": [[0, 4]], "global_shape": [4], "dtype": "bytes"}, 0),
    "void dtype": ({"box": [[0, 4]], "global_shape": [4], "dtype": "void"}, 0),
    "object dtype": ({"box": [[0, 4]], "global_shape": [4], "dtype": "object"}, 32),
    "negative dim": ({"box": [[0, 0]], "global_shape": [-1], "dtype": "int8"}, 0),
}


@pytest.mark.parametrize("case", list(BAD_PUTS))
def test_a_malformed_put_is_refused_with_a_reason(stores, case, tmp_path) -> None:
    log = tmp_path / "stderr"
    fields, nbody = BAD_PUTS[case]
    with open(log, "w") as stderr:
        proc = stores.start(stderr=stderr)
        sock = raw_socket(proc.address)
        wire.send_header(sock, {"op": "put", "path": "bad", "checksum": None, **fields}, nbody)
        reply = recv_frame(sock)[0]
        assert not reply["ok"] and reply["reason"] in ("invalid", "refused", "protocol"), reply
        wire.send_frame(sock, {"op": "list", "prefix": ""})  # the connection goes on
        assert recv_frame(sock)[0]["ok"]
        sock.close()
    with store.StoreClient(proc.address) as client:
        assert client.list() == []
    assert "Traceback" not in log.read_text()


@pytest.mark.parametrize(
    "box", [[[5, 2]], [[0.5, 2]], [[0, 1]] * 40], ids=["inverted", "float", "40 dims"]
)
def test_a_malformed_get_is_refused_with_a_reason(stores, box) -> None:
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        client.put("x", np.arange(8))
    sock = raw_socket(proc.address)
    wire.send_frame(sock, {"op": "get", "path": "x", "box": box})
    reply = recv_frame(sock)[0]
    assert not reply["ok"] and reply["reason"] in ("invalid", "refused", "protocol"), reply
    sock.close()


@pytest.mark.parametrize(
    "header",
    [
        b"[" * 30000 + b"]" * 30000,  # deeply nested
        b'{"op": "list", "prefix": ' + b"9" * 5000 + b"}",  # an integer of 5000 digits
        b'{"op": "get", "path": "\\ud800"}',  # a lone surrogate
        b'{"op": "put", "path": "x", "box": {"a": 1}, "global_shape": [1], "dtype": "int8"}',
        b"\xff\xfe not UTF-8",
        b'{"op": "list", "prefix": "a", "prefix": "b"}',  # which prefix?
    ],
    ids=["nested", "huge int", "lone surrogate", "box object", "bad utf8", "a key twice"],
)
def test_malformed_headers_get_an_error_reply_and_the_server_serves_on(stores, header) -> None:
    proc = stores.start()
    sock = raw_socket(proc.address)
    sock.sendall(wire.PREFIX.pack(wire.MAGIC, len(header), 0) + header)
    reply = recv_frame(sock)[0]
    assert not reply["ok"] and reply["reason"] in ("protocol", "invalid", "refused"), reply
    sock.close()
    with store.StoreClient(proc.address) as client:
        client.put("alive", np.arange(2))


@pytest.mark.parametrize(
    "body",
    [b'{"step": 1, "step": 2}', b'{"note": "\\ud800"}', b'{"a": [1, {"b": 1, "b": 1}]}'],
    ids=["a key twice", "a lone surrogate", "a key twice inside"],
)
def test_a_json_body_that_is_not_plain_json_is_refused_and_nothing_stored(stores, body) -> None:
    proc = stores.start()
    sock = raw_socket(proc.address)
    request = {"op": "put_json", "path": "j", "flush": False, "checksum": wire.checksum(body)}
    wire.send_frame(sock, request, body)
    reply = recv_frame(sock)[0]
    if reply.get("continue"):
        reply = recv_frame(sock)[0]
    sock.close()
    assert not reply["ok"] and reply["reason"] == "refused", reply
    assert "not plain JSON" in reply["error"], reply
    with store.StoreClient(proc.address) as client:
        assert client.get_json("j", default=None) is None


def test_a_lone_surrogate_token_is_a_wrong_token(stores, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    token_file.chmod(0o600)
    proc = stores.start(token_file=token_file)
    sock = raw_socket(proc.address, hello=False)
    wire.send_frame(sock, {"op": "hello", "token": "\ud800"})
    reply = recv_frame(sock)[0]
    assert not reply["ok"] and reply["reason"] == "auth"
    with store.StoreClient(proc.address, token="s3cret") as client:
        client.put("alive", np.arange(2))


def test_a_token_file_others_can_read_is_warned_about(stores, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret")
    log = tmp_path / "stderr"
    for mode, warned in ((0o644, True), (0o600, False)):
        token_file.chmod(mode)
        with open(log, "w") as stderr:
            stores.start(f"s{mode:o}", token_file=token_file, stderr=stderr).stop()
        assert ("can be read by other users" in log.read_text()) == warned, mode


def test_a_missing_token_file_is_a_usage_error(tmp_path) -> None:
    command = [sys.executable, "-m", "tenplex_jax.multihost.store", "--dir", str(tmp_path)]
    done = subprocess.run(
        [*command, "--token-file", str(tmp_path / "missing")],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2 and "cannot be read" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr


# -- a hostile server: the client checks every size before it allocates ---------------------------


class _FakeServer:
    """A server on 127.0.0.1 answering every request after the hello with ``reply(request)``."""

    def __init__(self, reply):
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.reply = reply
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()
        host, port = self.listener.getsockname()
        self.address = f"{host}:{port}"

    def _serve(self):
        with contextlib.suppress(OSError):
            conn, _ = self.listener.accept()
            with conn:
                while (prefix := wire.recv_prefix(conn)) is not None:
                    request = wire.recv_header(conn, prefix[0], 1 << 20)
                    if request["op"] == "hello":
                        wire.send_frame(conn, {"ok": True})
                        continue
                    header, nbody = self.reply(request)
                    header = {**header, "rid": request["rid"]}  # a reply to this request
                    data = json.dumps(header).encode()  # announces nbody, sends a little of it
                    conn.sendall(wire.PREFIX.pack(wire.MAGIC, len(data), nbody) + data)
                    conn.sendall(b"\0" * min(nbody, 1 << 16))

    def close(self):
        self.listener.close()
        self.thread.join(10)


HUGE = {
    "path": "w",
    "box": [[0, 2**60]],
    "global_shape": [2**60],
    "dtype": "int32",
    "nbytes": 2**62,
    "checksum": "crc32:00000000",
}
SMALL_BOX = {"ok": True, "box": [[0, 1]], "checksum": "x"}


@pytest.mark.parametrize(
    "op, reply",
    [
        ("get", lambda r: ({"ok": True, "info": HUGE, "box": HUGE["box"], "checksum": "x"}, 2**62)),
        ("get", lambda r: ({**SMALL_BOX, "info": {**HUGE, "nbytes": 4}}, 4)),
        ("get", lambda r: ({**SMALL_BOX, "info": {**HUGE, "path": "other"}}, 4)),
        ("list", lambda r: ({"ok": True}, 2**62)),
        ("get_json", lambda r: ({"ok": True, "checksum": "x"}, 2**62)),
    ],
    ids=["2^62-byte object", "nbytes disagrees", "another path", "huge listing", "huge json"],
)
def test_the_client_checks_a_servers_claims_before_allocating(op, reply) -> None:
    fake = _FakeServer(reply)
    try:
        client = store.StoreClient(fake.address, timeout=10)
        call = {
            "get": lambda: client.get("w"),
            "list": client.list,
            "get_json": lambda: client.get_json("w"),
        }[op]
        with pytest.raises(tj.errors.StoreError) as err:
            call()
        assert err.value.reason in ("protocol", "too_large"), err.value
        client.close()
    finally:
        fake.close()


# -- handshakes: their own cap and deadline, and a flood of unauthenticated peers -----------------

TOKEN = "s3cret-of-the-flood-tests"

# 70 peers without the token, each re-opening its connection as soon as the store closes it:
# argv host, port, peers, seconds. Prints "flooding" once every peer has connected, then (at the
# end) the connections each kind of peer opened, as JSON.
_FLOOD = r"""
import collections, json, socket, sys, threading, time
from tenplex_jax._src.multihost.store import wire

host, port, peers, seconds = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), float(sys.argv[4])

def frame(header):
    data = json.dumps(header).encode()
    return wire.PREFIX.pack(wire.MAGIC, len(data), 0) + data

HELLOS = {
    "silent": b"",
    "wrong token": frame({"op": "hello", "token": "not the token"}),
    "no token": frame({"op": "hello"}),
    "partial hello": frame({"op": "hello", "token": "x" * 200})[:40],
}
opened, lock, end = collections.Counter(), threading.Lock(), [float("inf")]
connected = threading.Barrier(peers + 1)

def peer(kind):
    first = True
    while time.monotonic() < end[0]:
        try:
            sock = socket.create_connection((host, port), timeout=5)
        except OSError:
            continue
        with lock:
            opened[kind] += 1
        if first:
            connected.wait()
            first = False
        try:
            sock.sendall(HELLOS[kind])
            sock.settimeout(0.5)
            while time.monotonic() < end[0]:
                try:
                    if not sock.recv(4096):
                        break
                except TimeoutError:
                    pass
        except OSError:
            pass
        finally:
            sock.close()

threads = [threading.Thread(target=peer, args=(kind,), daemon=True)
           for kind, _ in zip(list(HELLOS) * peers, range(peers))]
for thread in threads:
    thread.start()
connected.wait()
end[0] = time.monotonic() + seconds
print("flooding", flush=True)
for thread in threads:
    thread.join()
print(json.dumps(opened), flush=True)
"""


def _token_file(tmp_path) -> pathlib.Path:
    path = tmp_path / "token"
    path.write_text(TOKEN)
    path.chmod(0o600)
    return path


def _served_client(address: str, token: str | None = None):
    """A client whose connection passed its hello and was served (None: it was told busy)."""
    client = store.StoreClient(address, token=token, timeout=10)
    try:
        client.stats()
    except tj.errors.StoreError as error:
        client.close()
        if error.reason != "busy":
            raise
        return None
    return client


def _connect(address: str) -> socket.socket:
    """A raw connection, no hello, to "host:port" or "unix:PATH"."""
    if not address.startswith("unix:"):
        return socket.create_connection(store.parse_address(address), timeout=30)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(30)
    sock.connect(address[len("unix:") :])
    return sock


def _untouched(sock: socket.socket) -> bool:
    """Whether the peer has neither sent anything on ``sock`` nor closed it."""
    sock.settimeout(0.0)
    try:
        sock.recv(1, socket.MSG_PEEK)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        sock.settimeout(30)
    return False


@pytest.mark.parametrize("transport", ["tcp", "unix"])
def test_pending_handshakes_stay_within_their_cap_and_leave_at_the_deadline(
    stores, tmp_path, transport
) -> None:
    """--max-handshakes 4: of 10 silent connections opened one after another, each one past the
    4th closes the oldest still pending (told "busy"), the newer ones stay open, and the server
    never reports more than 4 pending; the last 4 are closed at the --handshake-timeout deadline
    (2 s from connecting), told why. The Unix socket's server behaves as the TCP one."""
    proc = stores.start(
        token_file=_token_file(tmp_path),
        unix_socket=tmp_path / "s.sock",
        args=("--max-handshakes", "4", "--handshake-timeout", "2"),
    )
    address = proc.address if transport == "tcp" else proc.unix_address
    seen = []

    def pending(expected: int) -> bool:
        seen.append(watcher.stats()["handshakes"])
        return seen[-1] == expected

    with store.StoreClient(address, token=TOKEN, timeout=10) as watcher:
        watcher.stats()  # its own connection is served before the silent ones come
        silent, opened = [], []
        try:
            for i in range(10):
                silent.append(_connect(address))
                opened.append(time.monotonic())
                if i >= 4:  # the oldest pending one is closed for the new one
                    evicted = recv_frame(silent[i - 4])[0]
                    assert evicted["reason"] == "busy", evicted
                    assert "--max-handshakes" in evicted["error"]
                    assert _closed_by_peer(silent[i - 4], timeout=10)
                _wait_for(lambda i=i: pending(min(i + 1, 4)), f"{min(i + 1, 4)} pending")
                assert all(_untouched(sock) for sock in silent[max(0, i - 3) :])
            for sock, start in zip(silent[6:], opened[6:], strict=True):
                reply = recv_frame(sock)[0]
                waited = time.monotonic() - start
                assert reply["reason"] == "protocol" and "--handshake-timeout" in reply["error"]
                assert 1.5 < waited < 10, f"a silent connection closed after {waited:.2f} s"
                assert _closed_by_peer(sock, timeout=10)
            _wait_for(lambda: pending(0), "no handshake pending")
        finally:
            for sock in silent:
                sock.close()
    assert max(seen) <= 4, seen


def _requests_during(proc, pooled, server, seconds: float):
    """An authorized client's requests for ``seconds``, each on a new connection, and beside
    them on the ``pooled`` one: (new connections' (reason or None, seconds), pooled ones'
    reasons or None, handshakes pending, the server's descriptors)."""
    fresh, reused, pending, fds = [], [], [], []
    end = time.monotonic() + seconds

    def request(client, i: int) -> None:
        if i % 2:
            pending.append(client.stats()["handshakes"])
        else:
            assert client.list_json("flood/") == ["flood/marker"]

    def on_new_connections() -> None:
        i = 0
        while time.monotonic() < end:
            start = time.monotonic()
            try:
                with store.StoreClient(proc.address, token=TOKEN, timeout=5) as client:
                    request(client, i)
                fresh.append((None, time.monotonic() - start))
            except tj.errors.StoreError as error:
                fresh.append((error.reason, time.monotonic() - start))
            i += 1

    def on_the_pooled_connection() -> None:
        i = 0
        while time.monotonic() < end:
            try:
                request(pooled, i)
                reused.append(None)
            except tj.errors.StoreError as error:
                reused.append(error.reason)
            fds.append(server.num_fds())
            i += 1

    threads = [
        threading.Thread(target=on_new_connections),
        threading.Thread(target=on_the_pooled_connection),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return fresh, reused, pending, fds


def test_authorized_clients_are_served_through_a_flood_of_unauthenticated_connections(
    stores, tmp_path
) -> None:
    """70 peers without the token (silent, a wrong token, no token, a partial hello), each
    re-opening its connection as soon as the store closes it, against --max-connections 8 and
    --max-handshakes 32. For 5 s, at least 95 % of an authorized client's requests are served
    each on a new connection (the hardest case: a hello to pass every time), and every request
    over a pooled connection is; the server never holds more than its caps' worth of sockets."""
    max_handshakes, max_connections = 32, 8
    proc = stores.start(
        token_file=_token_file(tmp_path),
        args=(
            "--max-connections",
            str(max_connections),
            "--max-handshakes",
            str(max_handshakes),
        ),
    )
    server = psutil.Process(proc.pid)
    host, port = store.parse_address(proc.address)
    env = dict(os.environ)
    root = str(pathlib.Path(tj.__file__).resolve().parents[1])
    env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
    with store.StoreClient(proc.address, token=TOKEN, timeout=5) as pooled:
        pooled.put_json("flood/marker", {"served": True})
        fds_before = server.num_fds()
        flood = subprocess.Popen(
            [sys.executable, "-c", _FLOOD, host, str(port), "70", "6"],
            stdout=subprocess.PIPE,
            env=env,
        )
        try:
            assert flood.stdout.readline() == b"flooding\n"
            fresh, reused, pending, fds = _requests_during(proc, pooled, server, seconds=5.0)
            out, _ = flood.communicate(timeout=30)
            opened = json.loads(out)
        finally:
            flood.kill()
            flood.wait()
    served = sum(reason is None for reason, _ in fresh) / len(fresh)
    latencies = sorted(seconds for _, seconds in fresh)
    report = (
        f"new connections: {served:.1%} of {len(fresh)} served (p50 "
        f"{latencies[len(latencies) // 2] * 1e3:.1f} ms, max {latencies[-1] * 1e3:.0f} ms; "
        f"failures {sorted({r for r, _ in fresh if r})}); pooled: "
        f"{reused.count(None)} of {len(reused)} served; peers opened {dict(opened)}; "
        f"pending at most {max(pending, default=0)}, descriptors at most {max(fds, default=0)} "
        f"(from {fds_before})"
    )
    print(report)
    assert len(fresh) >= 20 and served >= 0.95, report
    assert reused.count(None) == len(reused), report
    assert pending and max(pending) <= max_handshakes, report
    assert max(fds) <= fds_before + max_handshakes + max_connections + 8, report
    assert sum(opened.values()) >= 10 * 70, report  # a flood: every peer re-opened many times


def test_socketservers_own_handle_request_is_refused_and_serves_no_one() -> None:
    """The store admits a connection, checking its hello and token, only in its own accept loop.
    ``socketserver``'s inherited ``handle_request`` would accept a waiting connection and run the
    handler on it unchecked: it is refused, and the connection is not accepted."""
    import socketserver
    import types

    from tenplex_jax._src.multihost.store.connections import Server

    handled = []

    class Handler(socketserver.BaseRequestHandler):
        def handle(self):
            handled.append(self.client_address)

    limits = types.SimpleNamespace(
        max_body_bytes=MIB,
        timeout=5.0,
        handshake_timeout=5.0,
        max_connections=4,
        max_handshakes=4,
        budget=None,
    )
    server = Server(("127.0.0.1", 0), None, "token", limits, Handler)
    try:
        server.timeout = 2.0  # the inherited method would wait this long for a connection
        with (
            socket.create_connection(server.server_address, timeout=5.0),
            pytest.raises(NotImplementedError, match="only in serve_forever"),
        ):
            server.handle_request()
        assert handled == [] and server.connections() == 0
    finally:
        server.server_close()
