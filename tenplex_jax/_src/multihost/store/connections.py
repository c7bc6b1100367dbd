"""Who the tensor store server serves: connections, their hellos, and the caps on both
(docs/multihost.md, "Bounded memory and connections", states the rules).

A new connection is first a **pending handshake**: no thread, no served slot, and a buffer of at
most one hello frame (``wire.PREFIX`` + ``wire.HELLO_HEADER_BYTES``), read by the one selector
loop of its server (the thread that runs ``serve_forever``). A hello that passes the token check
gets a thread of its own (the server's ``Handler``). A new connection evicts the oldest pending
one rather than being refused: an authorized client sends its hello the moment it connects, so
its hello is read long before enough later connections arrive to evict it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import errno
import hmac
import ipaddress
import os
import selectors
import socket
import socketserver
import stat
import threading
import time
import typing

from tenplex_jax._src.errors import StoreError, StoreProtocolError
from tenplex_jax._src.multihost.store import wire

if typing.TYPE_CHECKING:
    from tenplex_jax._src.multihost.store.updates import Store

DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_MAX_HANDSHAKES = 128
# A client sends its hello (one small segment) the moment it connects: it arrives within a round
# trip, or two retransmissions (1 s, then 2 s) on a lossy path. A peer slower than that is holding
# a socket, not connecting; with eviction the deadline no longer guards service, only descriptors.
DEFAULT_HANDSHAKE_TIMEOUT = 5.0
ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # out of fds or memory
ACCEPT_BATCH = 32  # at most this many connections accepted in a row, then pending hellos read


@dataclasses.dataclass(frozen=True, eq=False)
class _Pending:
    """A connection whose hello is not yet whole: its socket, the bytes of its hello so far, and
    the time (``time.monotonic()``) by which the rest must have come."""

    sock: socket.socket
    address: typing.Any
    deadline: float
    buf: bytearray = dataclasses.field(default_factory=bytearray)


def check_hello(header: dict, nbody: int, token: str | None) -> dict | None:
    """The error reply to a connection's first frame, or None when it is a hello that may pass:
    op ``"hello"``, no body, and the server's token (compared in constant time) if it has one."""
    if header.get("op") != "hello" or nbody:
        return _error("a connection must open with a hello frame", "protocol")
    if token is None:
        return None
    given = header.get("token")
    try:
        valid = isinstance(given, str) and hmac.compare_digest(given.encode(), token.encode())
    except UnicodeEncodeError:  # a lone surrogate: no token of ours
        valid = False
    if valid:
        return None
    missing = "no token" if given is None else "a wrong token"
    return _error(f"this store requires a token; got {missing}", "auth")


def _error(message: str, reason: str) -> dict:
    return {"ok": False, "error": message, "reason": reason}


class _Limits:
    """What both servers share: the store, its token, its limits, and connection admission.

    ``serve_forever`` is one selector loop over the listening socket and the pending handshakes
    (the module's docstring says how they are capped); an admitted connection is handed to
    ``ThreadingMixIn.process_request`` (a thread running the handler's request loop), and its
    served slot is given back when that thread ends.
    """

    daemon_threads = True
    request_queue_size = 128

    def setup_limits(self, store: Store, token: str | None, options) -> None:
        self.store, self.token = store, token
        self.max_body, self.timeout_s = options.max_body_bytes, options.timeout
        self.handshake_s, self.max_connections = options.handshake_timeout, options.max_connections
        self.max_handshakes = options.max_handshakes
        self.budget = options.budget
        self._lock, self._active = threading.Lock(), 0
        # the loop thread's own: pending handshakes, oldest first (so earliest deadline first)
        self._pending: dict[_Pending, bool] = {}
        self._selector = selectors.DefaultSelector()
        self._wake, self._waker = socket.socketpair()  # shutdown() interrupts the select
        self._wake.setblocking(False)
        self._stop, self._stopped = threading.Event(), threading.Event()
        self._stopped.set()

    def connections(self) -> int:
        """Connections served now (their hello passed)."""
        with self._lock:
            return self._active

    def handshakes(self) -> int:
        """Connections whose hello is not yet whole."""
        return len(self._pending)

    def handle_request(self) -> None:
        """Refused, deliberately: ``socketserver``'s one-request loop would take a connection
        past the handshakes' cap and deadline, the limits that keep authorized clients served
        under a flood. Not a stub: ``serve_forever`` is the one way in."""
        raise NotImplementedError("the store server admits connections only in serve_forever")

    def serve_forever(self, poll_interval: float = 0.5) -> None:
        """Accept connections and read their hellos until ``shutdown`` (``poll_interval`` is
        unused: a deadline or ``shutdown`` wakes the loop)."""
        self._stopped.clear()
        listener, selector = self.socket, self._selector
        listener.setblocking(False)
        selector.register(self._wake, selectors.EVENT_READ, None)
        listening, resume, backoff = False, 0.0, 0.0
        try:
            while not self._stop.is_set():
                now = time.monotonic()
                self._expire(now)
                if not listening and now >= resume:
                    selector.register(listener, selectors.EVENT_READ, listener)
                    listening = True
                wake_at = [next(iter(self._pending)).deadline] if self._pending else []
                wake_at += [] if listening else [resume]
                timeout = max(0.0, min(wake_at) - now) if wake_at else None
                accept = False
                for key, _ in selector.select(timeout):
                    if key.data is listener:
                        accept = True
                    elif key.data is None:
                        with contextlib.suppress(OSError):
                            self._wake.recv(64)
                    elif key.data in self._pending:  # not closed earlier in this round
                        self._read(key.data)
                # the hellos that arrived are read before new connections can evict them
                if accept and not self._accept():
                    backoff = min(max(2 * backoff, 0.01), 1.0)
                    selector.unregister(listener)
                    listening, resume = False, time.monotonic() + backoff
                elif accept:
                    backoff = 0.0
        finally:
            for pending in list(self._pending):
                self._close(pending)
            for sock in (self._wake, listener) if listening else (self._wake,):
                selector.unregister(sock)
            self._stop.clear()
            self._stopped.set()

    def shutdown(self) -> None:
        """Stop ``serve_forever`` and wait until it has (pending handshakes are closed; served
        connections go on until their threads end)."""
        self._stop.set()
        with contextlib.suppress(OSError):
            self._waker.send(b"\0")
        self._stopped.wait()

    def server_close(self) -> None:
        super().server_close()
        self._selector.close()
        self._wake.close()
        self._waker.close()

    def _accept(self) -> bool:
        """Take the connections waiting, a few per turn of the loop; False when out of
        descriptors (or memory) with no pending handshake to close for one."""
        # at most a quarter of the handshake cap per turn: a connection is evicted no sooner than
        # 4 turns after it was accepted, and each turn reads every hello that has arrived
        for turn in range(max(1, min(ACCEPT_BATCH, self.max_handshakes // 4))):
            try:
                sock, address = self.socket.accept()
            except BlockingIOError:
                return True
            except OSError as error:
                if error.errno not in ACCEPT_ERRORS:
                    return True  # aborted before it was accepted: nothing to do
                # Linux fails for want of a descriptor before it looks for a connection: only
                # the first try of a turn (the select saw one waiting) knows that one waits
                if turn:
                    return True
                if not self._pending:
                    return False
                self._close(next(iter(self._pending)), _EVICTED)  # frees a descriptor
                continue
            self._begin(sock, address)
        return True

    def _begin(self, sock: socket.socket, address) -> None:
        """A new connection: its hello is read at once (a client's is often there already); if
        not whole, it waits as a pending handshake, the oldest evicted when the cap is full."""
        try:
            sock.setblocking(False)
        except OSError:
            sock.close()
            return
        pending = _Pending(sock, address, time.monotonic() + self.handshake_s)
        if not self._read(pending):
            return
        if len(self._pending) >= self.max_handshakes:
            self._close(next(iter(self._pending)), _EVICTED)
        try:
            self._selector.register(sock, selectors.EVENT_READ, pending)
        except (OSError, ValueError, KeyError):
            sock.close()
            return
        self._pending[pending] = True

    def _read(self, pending: _Pending) -> bool:
        """Read what has arrived of the hello (never past its end: the requests after it are the
        handler's); once whole, admit or refuse the connection. True while it is incomplete;
        otherwise the connection is closed or handed to a thread, and no longer pending."""
        buf, nbody = pending.buf, 0
        try:
            while True:
                want = wire.PREFIX.size - len(buf)
                if want <= 0:
                    nheader, nbody = wire._unpack_prefix(buf[: wire.PREFIX.size])
                    if nheader > wire.HELLO_HEADER_BYTES:
                        raise StoreProtocolError(
                            f"a hello header is at most {wire.HELLO_HEADER_BYTES} bytes; got one "
                            f"of {nheader}"
                        )
                    want += nheader
                    if want == 0:
                        break
                chunk = pending.sock.recv(want)
                if not chunk:  # the peer left
                    self._close(pending)
                    return False
                buf += chunk
            header = wire._parse_header(buf[wire.PREFIX.size :])
        except BlockingIOError:
            return True
        except StoreProtocolError as error:
            self._close(pending, _error(str(error), "protocol"))
            return False
        except OSError:  # reset by the peer
            self._close(pending)
            return False
        refusal = check_hello(header, nbody, self.token)
        if refusal is not None:
            self._close(pending, refusal)
        else:
            self._admit(pending)
        return False

    def _admit(self, pending: _Pending) -> None:
        """A hello that passed: a served slot and a thread, or "busy" when every slot is taken."""
        self._release(pending)
        sock = pending.sock
        with self._lock:
            admitted = self._active < self.max_connections
            self._active += admitted
        if not admitted:
            _refuse(
                sock,
                f"this store serves at most {self.max_connections} connections at "
                f"once (--max-connections); try again",
            )
            self.shutdown_request(sock)
            return
        try:
            # a few bytes into the new socket's empty send buffer: never blocks the loop
            wire.send_frame(sock, {"ok": True, "version": 1})
            sock.setblocking(True)
            self.process_request(sock, pending.address)  # ThreadingMixIn's: a thread
        except (OSError, RuntimeError):  # the peer left, or no thread could be started
            with self._lock:
                self._active -= 1
            sock.close()

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._active -= 1

    def _expire(self, now: float) -> None:
        while self._pending:
            oldest = next(iter(self._pending))
            if oldest.deadline > now:
                return
            message = (
                f"no whole hello within {self.handshake_s:g} s of connecting (--handshake-timeout)"
            )
            self._close(oldest, _error(message, "protocol"))

    def _release(self, pending: _Pending) -> None:
        """Stop watching a pending handshake (before its socket is closed or handed over)."""
        if self._pending.pop(pending, False):
            self._selector.unregister(pending.sock)

    def _close(self, pending: _Pending, reply: dict | None = None) -> None:
        self._release(pending)
        if reply is not None:
            with contextlib.suppress(OSError):
                wire.send_frame(pending.sock, reply)  # non-blocking: a frame or nothing
        pending.sock.close()


_EVICTED = _error(
    "this store had more connections in their handshake than --max-handshakes; the oldest, this "
    "one, was closed; try again",
    "busy",
)


class Server(_Limits, socketserver.ThreadingTCPServer):
    """The store on TCP: ``handler`` (a ``socketserver.BaseRequestHandler``) serves each admitted
    connection's requests, its hello already answered."""

    allow_reuse_address = True

    def __init__(self, address, store: Store, token: str | None, options, handler):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.setup_limits(store, token, options)
        super().__init__(address, handler)


class UnixServer(_Limits, socketserver.ThreadingUnixStreamServer):
    """The same service on a Unix socket (same host only; about twice TCP loopback's bandwidth).

    It takes ``path`` only when nothing is there or a stale socket is (one whose server is gone);
    a live server's socket or any other file is refused, never removed. ``remove`` deletes the
    socket at exit only if it is still this server's (the same inode).
    """

    def __init__(self, path: str, store: Store, token: str | None, options, handler):
        self.setup_limits(store, token, options)
        _claim_socket_path(path)
        umask = os.umask(0o077)  # only this user may connect, from the moment it exists
        try:
            super().__init__(path, handler)
        finally:
            os.umask(umask)
        os.chmod(path, 0o600)
        status = os.stat(path)
        self.socket_path, self.socket_id = path, (status.st_dev, status.st_ino)

    def remove(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            status = os.stat(self.socket_path)
            if (status.st_dev, status.st_ino) == self.socket_id:
                os.unlink(self.socket_path)


def _claim_socket_path(path: str) -> None:
    """Make ``path`` free for a new socket: nothing there, or a stale socket (removed)."""
    try:
        status = os.lstat(path)
    except FileNotFoundError:
        return
    if not stat.S_ISSOCK(status.st_mode):
        raise StoreError(
            f"--unix-socket {path} exists and is not a socket; it is not removed", "refused"
        )
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.settimeout(2.0)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)  # no server behind it: left by one that was killed
        return
    except OSError as error:
        raise StoreError(
            f"--unix-socket {path}: cannot tell whether a server uses it ({error}); "
            f"it is not removed",
            "refused",
        ) from None
    finally:
        probe.close()
    raise StoreError(
        f"--unix-socket {path} is the socket of a running server; it is not taken", "refused"
    )


def _refuse(sock: socket.socket, message: str) -> None:
    """Tell a connection over the cap "busy" from the loop without waiting: the frame fits the
    socket's empty send buffer, and a Linux peer reads it even when closing the socket with
    unread bytes sends a reset."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        wire.send_frame(sock, _error(message, "busy"))


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False
