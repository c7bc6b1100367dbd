"""``FaultProxy``: a loopback proxy in front of one tensor store that drops, delays or duplicates
replies, for fault-injection tests.

It speaks the store's wire protocol (``tenplex_jax._src.multihost.store.wire``) in both
directions, one exchange at a time per connection, as the protocol itself does: it reads a
request frame from the client, forwards it, and for ``put``/``put_json``/``cas_json`` forwards the
server's ``continue`` frame, then the body (and a ``put``'s checksum trailer) the client sends
after it (an ``eager`` request's body and trailer follow its header at once). It then reads the
server's whole final reply (a streamed ``get``: header, body and its checksum trailer) and
delivers it, or injects the fault armed for that request:

- ``"drop"``: the reply is withheld and both sides of the connection are closed. The server has
  done the request; only its reply is lost.
- ``"delay"``: the reply is delivered ``seconds`` later (longer than the client's socket timeout,
  the client gives up on the connection and retries while the reply is still held).
- ``"duplicate"``: the reply (every frame, body included) is delivered twice; the copy is a stale
  reply to whatever the client sends next on that connection.

Example::

    with FaultProxy(proc.address) as proxy:
        proxy.inject("accumulate", "drop", nth=2)   # the 2nd accumulate from now loses its reply
        with StoreClient(proxy.address, retry_seconds=10) as client:
            ...
        assert [f.kind for f in proxy.injected] == ["drop"]

``ops`` counts the requests seen by op (not the hello), ``requests`` lists ``(op, rid)`` in
arrival order (a retry shows as a second request with the same rid), ``unechoed`` lists the
server's reply frames whose ``rid`` is not their request's.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import json
import socket
import threading
import time

from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.client import parse_address

KINDS = ("drop", "delay", "duplicate")
WITH_BODY = frozenset({"put", "put_json", "cas_json"})  # answered "continue" before the body
PUMP_BYTES = 1 << 20


@dataclasses.dataclass(frozen=True)
class Fault:
    """A fault armed by :meth:`FaultProxy.inject`; once it fired, ``rid`` is its request's id."""

    op: str
    kind: str
    nth: int
    seconds: float = 0.0
    rid: str | None = None


@dataclasses.dataclass(frozen=True)
class Frame:
    """One frame as it travelled: its bytes (prefix, header, body) and its parsed header."""

    raw: bytes
    header: dict


class FaultProxy:
    """A threaded proxy on 127.0.0.1 (a free port: ``address``) in front of the store at
    ``upstream`` (``"host:port"``). A context manager: leaving it (or :meth:`close`) closes every
    socket and joins every thread within ``join_timeout`` seconds."""

    def __init__(self, upstream: str, *, join_timeout: float = 10.0):
        self.upstream = parse_address(upstream)
        self.join_timeout = join_timeout
        self.ops: collections.Counter[str] = collections.Counter()
        self.requests: list[tuple[str, str | None]] = []
        self.injected: list[Fault] = []
        self.unechoed: list[tuple[str, str | None, str | None]] = []  # (op, request's, reply's)
        self.connections = 0
        self._armed: list[list] = []  # [fault, requests of its op seen since armed]
        self._lock = threading.Lock()
        self._closing = threading.Event()
        self._sockets: set[socket.socket] = set()
        self._threads: list[threading.Thread] = []
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.address = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._spawn(self._accept, "fault-proxy-accept")

    def __repr__(self) -> str:
        return f"FaultProxy({self.address} -> {self.upstream[0]}:{self.upstream[1]})"

    def __enter__(self) -> FaultProxy:
        return self

    def __exit__(self, *exc) -> None:
        self.close(check=exc[0] is None)

    # -- faults --------------------------------------------------------------------------------

    def inject(self, op: str, kind: str, nth: int = 1, seconds: float = 0.0) -> Fault:
        """Arm a fault for the ``nth`` request of ``op`` from now on (1: the next one).

        Args:
          op: the request's op (``"cas_json"``, ``"accumulate"``, ...).
          kind: ``"drop"``, ``"delay"`` or ``"duplicate"`` (see the module's docstring).
          nth: which request of ``op``, counting those that arrive after this call.
          seconds: the delay of a ``"delay"``.

        Returns:
          The armed fault (``injected`` holds it, with its request's rid, once it fired).
        """
        if kind not in KINDS or nth < 1 or seconds < 0 or (kind == "delay") != (seconds > 0):
            raise ValueError(
                f"a fault is one of {KINDS} of the nth >= 1 request of an op, a delay with "
                f"seconds > 0 (only a delay); got {kind!r} nth={nth} seconds={seconds}"
            )
        fault = Fault(op, kind, nth, float(seconds))
        with self._lock:
            self._armed.append([fault, 0])
        return fault

    def armed(self) -> list[Fault]:
        """The faults armed that have not met their request yet."""
        with self._lock:
            return [fault for fault, _ in self._armed]

    def _arrived(self, op: str, rid: str | None) -> Fault | None:
        """Count a request; the armed fault it meets (taken off the armed list), if any."""
        with self._lock:
            self.ops[op] += 1
            self.requests.append((op, rid))
            hit = None
            for entry in self._armed:
                if entry[0].op == op:
                    entry[1] += 1
                    if hit is None and entry[1] == entry[0].nth:
                        hit = entry
            if hit is None:
                return None
            self._armed.remove(hit)
            return dataclasses.replace(hit[0], rid=rid)

    # -- threads and sockets -------------------------------------------------------------------

    def _spawn(self, target, name: str, *args) -> bool:
        """Start a thread that ``close`` joins; False (none started) once closing."""
        thread = threading.Thread(target=target, args=args, name=name, daemon=True)
        with self._lock:
            if self._closing.is_set():
                return False
            self._threads = [t for t in self._threads if t.is_alive()]
            self._threads.append(thread)
            thread.start()
        return True

    def _track(self, sock: socket.socket) -> bool:
        """Register a socket for :meth:`close`; False (and closed) when closing already."""
        with self._lock:
            if not self._closing.is_set():
                self._sockets.add(sock)
                return True
        sock.close()
        return False

    def _drop(self, *socks: socket.socket) -> None:
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
            with self._lock:
                self._sockets.discard(sock)

    def close(self, check: bool = True) -> None:
        """Close the listener and every connection (both sides), then join every thread.

        Raises:
          RuntimeError: with ``check``, a thread still runs ``join_timeout`` seconds later.
        """
        with self._lock:
            self._closing.set()
            socks, self._sockets = list(self._sockets), set()
        with contextlib.suppress(OSError):
            self._listener.shutdown(socket.SHUT_RDWR)  # wakes the accept() on Linux
        self._listener.close()
        for sock in socks:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes a recv() blocked in another thread
            sock.close()
        deadline = time.monotonic() + self.join_timeout
        with self._lock:
            threads = list(self._threads)
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        alive = [t.name for t in threads if t.is_alive()]
        if alive and check:
            raise RuntimeError(f"{self!r}: threads still running after close: {alive}")

    def _accept(self) -> None:
        while not self._closing.is_set():
            try:
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            if not self._track(client):
                return
            with self._lock:
                self.connections += 1
                n = self.connections
            if not self._spawn(self._serve, f"fault-proxy-conn-{n}", client):
                self._drop(client)
                return

    # -- one connection ------------------------------------------------------------------------

    def _serve(self, client: socket.socket) -> None:
        server = None
        try:
            server = socket.create_connection(self.upstream, timeout=10.0)
            server.settimeout(None)  # close() ends a wait; the store's own timeouts bound it
            if not self._track(server):
                return
            for sock in (client, server):
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            while self._exchange(client, server):
                pass
        except (OSError, ValueError):
            pass  # either side went away, or sent what is not a frame: the connection ends
        finally:
            self._drop(client, *([] if server is None else [server]))

    def _exchange(self, client: socket.socket, server: socket.socket) -> bool:
        """Relay one request and its reply; False when the connection is done."""
        request = _read_frame(client)
        if request is None:
            return False
        header, nbody = request.header, _body_bytes(request.raw)
        server.sendall(request.raw)
        op = header.get("op")
        if op == "hello":  # the handshake: no rid, never faulted
            client.sendall(_read_frame(server, expect=True).raw)
            return True
        rid = header.get("rid")
        fault = self._arrived(str(op), rid)
        frames = []
        if op in WITH_BODY and not header.get("eager"):
            first = _read_frame(server, expect=True, with_body=True)
            if first.header.get("ok") and first.header.get("continue"):
                self._check_echo(op, rid, first)
                client.sendall(first.raw)
                _pump(client, server, nbody)
                if op == "put" and header.get("checksum") is None:
                    server.sendall(_read_frame(client, expect=True).raw)  # the checksum trailer
            else:  # refused before the body: this is the final reply
                frames.append(first)
        elif nbody:
            _pump(client, server, nbody)
            if op == "put" and header.get("checksum") is None:
                server.sendall(_read_frame(client, expect=True).raw)  # the checksum trailer
        if not frames:
            frames.append(_read_frame(server, expect=True, with_body=True))
            reply = frames[0].header
            if (
                op == "get"
                and reply.get("ok")
                and "checksum" in reply
                and reply["checksum"] is None
            ):
                frames.append(_read_frame(server, expect=True, with_body=True))  # the trailer
        for frame in frames:
            self._check_echo(op, rid, frame)
        return self._deliver(client, server, b"".join(f.raw for f in frames), fault)

    def _check_echo(self, op, rid, frame: Frame) -> None:
        if frame.header.get("rid") != rid:
            with self._lock:
                self.unechoed.append((str(op), rid, frame.header.get("rid")))

    def _deliver(self, client, server, reply: bytes, fault: Fault | None) -> bool:
        if fault is not None:
            with self._lock:
                self.injected.append(fault)
        if fault is None:
            client.sendall(reply)
        elif fault.kind == "drop":
            self._drop(client, server)
            return False
        elif fault.kind == "delay":
            if self._closing.wait(fault.seconds):
                return False
            client.sendall(reply)
        else:  # duplicate
            client.sendall(reply + reply)
        return True


def _body_bytes(raw: bytes) -> int:
    """The body length a frame's prefix announces (a request's body follows separately)."""
    return wire.PREFIX.unpack(raw[: wire.PREFIX.size])[2]


def _read_frame(
    sock: socket.socket, *, expect: bool = False, with_body: bool = False
) -> Frame | None:
    """The next frame: prefix and header (and, ``with_body``, the body that follows at once,
    as a reply's does); None on a clean close before it unless ``expect``."""
    first = sock.recv(wire.PREFIX.size)
    if not first:
        if expect:
            raise ConnectionError("the peer closed the connection before its frame")
        return None
    prefix = bytes(first) + bytes(wire.recv_exact(sock, wire.PREFIX.size - len(first)))
    magic, nheader, nbody = wire.PREFIX.unpack(prefix)
    if magic != wire.MAGIC or nheader > wire.MAX_RESPONSE_HEADER_BYTES:
        raise ValueError(f"not a store frame: magic {magic!r}, header of {nheader} bytes")
    encoded = bytes(wire.recv_exact(sock, nheader))
    header = json.loads(encoded)
    if not isinstance(header, dict):
        raise ValueError(f"a frame header is a JSON object; got {encoded[:100]!r}")
    body = bytes(wire.recv_exact(sock, nbody)) if with_body else b""
    return Frame(prefix + encoded + body, header)


def _pump(source: socket.socket, sink: socket.socket, nbytes: int) -> None:
    """Relay exactly ``nbytes`` from ``source`` to ``sink``, a chunk at a time."""
    buf = bytearray(min(nbytes, PUMP_BYTES))
    view = memoryview(buf)
    left = nbytes
    while left:
        got = source.recv_into(view, min(left, len(buf)))
        if not got:
            raise ConnectionError(f"the peer closed the connection with {left} body bytes unsent")
        sink.sendall(view[:got])
        left -= got
