"""The tensor store server: ``python -m tenplex_jax.multihost.store --dir DIR [--port 0]
[--ready-file F]``.

One process per host (the launcher starts it; it outlives the workers). A threaded TCP server,
bound to 127.0.0.1 unless ``--host`` says otherwise; bound anywhere else it refuses to start
without ``--token-file``. ``--unix-socket PATH`` serves the same store on a Unix socket too (mode
0600), for clients on the same host: ``StoreClient("unix:PATH")``.

**Limits.** At most ``--max-connections`` connections at once (one more is told ``"busy"``), a
hello within ``--handshake-timeout`` seconds, and every request body and reply admitted against
one transfer budget of ``max(--memory-bytes, 64 MiB)`` before its bytes are received or produced
(``Budget``): the server's memory stays within the memory tier plus that budget, plus a bounded
header per connection, whatever clients do. An object larger than the budget streams through a
``STREAM_CHUNK_BYTES`` buffer: written to disk as it arrives, read from disk a chunk at a time.

**Tiers.** Objects live in a memory tier (at most ``--memory-bytes``, least recently used clean
objects evicted first) and on disk under ``DIR/objects``. A plain put is acknowledged once it is
in the memory tier and queued for disk; ``durable=True`` (and any object larger than the memory
tier) is acknowledged only after its file is complete. ``flush`` waits until every object
acknowledged before it is on disk; ``put_json`` flushes first (unless asked not to), then writes
durably, so a commit marker on disk implies that the objects put before it are on disk.
SIGTERM / SIGINT flush too.

**Atomic files.** An object is one file: ``b"TPX2"`` + header length + the header's crc32 + a
JSON header (path, box, global shape, dtype, checksum) + the bytes. It is written to ``DIR/tmp``
and fsynced; only then is it renamed into ``DIR/objects`` and does the index point at it (the
directory is fsynced before a durable put or a flush returns). Several writer threads overlap
their fsyncs. A restarted store deletes ``DIR/tmp``, indexes complete files whose header checks (a
file whose header fails its crc32, or whose size disagrees with it, is set aside), and verifies
every file's data checksum when it reads it: a file that fails is moved to ``DIR/corrupt`` and
never served. So after a crash the store serves each object's last complete
version or nothing; never a partial one.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import errno
import fcntl
import hmac
import ipaddress
import itertools
import json
import os
import pathlib
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
import typing
import zlib

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import checksums
from tenplex_jax._src.errors import StoreError, StoreProtocolError
from tenplex_jax._src.multihost.store import tiers, wire
from tenplex_jax._src.multihost.store.tiers import DEFAULT_MEMORY_BYTES, Store
from tenplex_jax._src.multihost.store.wire import ObjectInfo

DEFAULT_MAX_BODY_BYTES = 8 << 30
DEFAULT_TIMEOUT = 120.0
DEFAULT_MAX_CONNECTIONS = 64
DEFAULT_HANDSHAKE_TIMEOUT = 10.0
ACCEPT_ERRORS = (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM)  # out of fds or memory


class Budget:
    """The bytes of request bodies and replies in flight, at most ``limit`` at once.

    A transfer is admitted before its bytes are received or produced: it waits for room until
    ``timeout`` seconds pass, then is refused (reason ``"busy"``); one larger than the whole budget
    is refused at once (``"too_large"``). So however clients behave (bodies sent without their
    checksum trailer, replies never read), the bytes in flight stay within ``limit``.
    """

    def __init__(self, limit: int, timeout: float):
        self.limit, self.timeout, self.used, self.waiting = limit, timeout, 0, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int, what: str):
        if nbytes > self.limit:
            raise StoreError(
                f"{what} is {nbytes} bytes, more than the store's transfer budget of "
                f"{self.limit} bytes (--memory-bytes)",
                "too_large",
            )
        deadline = time.monotonic() + self.timeout
        with self.cond:
            self.waiting += 1
            try:
                while self.used + nbytes > self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        raise StoreError(
                            f"{what} ({nbytes} bytes) waited {self.timeout:.0f} s for room in the "
                            f"store's transfer budget of {self.limit} bytes (--memory-bytes), "
                            f"held by other transfers; try again",
                            "busy",
                        )
                    self.cond.wait(left)
            finally:
                self.waiting -= 1
            self.used += nbytes
        try:
            yield
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


class Handler(socketserver.BaseRequestHandler):
    server: Server

    def handle(self) -> None:
        sock: socket.socket = self.request
        sock.settimeout(self.server.timeout_s)
        if sock.family != socket.AF_UNIX:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        try:
            if not self._hello(sock):
                return
            while True:
                prefix = wire.recv_prefix(sock)
                if prefix is None:
                    return
                nheader, nbody = prefix
                header = wire.recv_header(sock, nheader, wire.MAX_HEADER_BYTES)
                try:
                    self._serve(sock, header, nbody)
                except StoreError as error:
                    reason = getattr(error, "reason", "refused")
                    wire.send_frame(sock, {"ok": False, "error": str(error), "reason": reason})
                except (KeyError, TypeError, ValueError, OverflowError) as error:
                    message = f"malformed {header.get('op')!r} request: {error!r}"
                    wire.send_frame(sock, {"ok": False, "error": message, "reason": "protocol"})
                except OSError as error:  # the store's disk, not the connection
                    if isinstance(error, (ConnectionError, TimeoutError)):
                        raise
                    message = f"{header.get('op')!r} failed on the store's disk: {error!r}"
                    wire.send_frame(sock, {"ok": False, "error": message, "reason": "disk"})
        except StoreProtocolError as error:
            self._try_send(sock, {"ok": False, "error": str(error), "reason": "protocol"})
        except (OSError, ConnectionError):
            return  # the client went away or timed out

    def _try_send(self, sock, header) -> None:
        with contextlib.suppress(OSError):
            wire.send_frame(sock, header)

    def _hello(self, sock: socket.socket) -> bool:
        # the whole hello within the handshake deadline, however slowly a peer sends it (a
        # per-receive timeout alone lets one byte a second hold a connection for ever)
        hello = wire.recv_hello(sock, time.monotonic() + self.server.handshake_s)
        if hello is None:
            return False
        header, nbody = hello
        if header.get("op") != "hello" or nbody:
            raise StoreProtocolError("a connection must open with a hello frame")
        token = self.server.token
        if token is not None:
            given = header.get("token")
            try:
                valid = isinstance(given, str) and hmac.compare_digest(
                    given.encode(), token.encode()
                )
            except UnicodeEncodeError:  # a lone surrogate: no token of ours
                valid = False
            if not valid:
                missing = "no token" if given is None else "a wrong token"
                wire.send_frame(
                    sock,
                    {
                        "ok": False,
                        "error": f"this store requires a token; got {missing}",
                        "reason": "auth",
                    },
                )
                return False
        wire.send_frame(sock, {"ok": True, "version": 1})
        return True

    def _body(self, sock: socket.socket, nbody: int, expected: int, path: str):
        """Say continue, then read a body of exactly ``expected`` bytes; (bytes, checksum). Call
        with the body's bytes held in the transfer budget."""
        if nbody != expected:
            raise StoreError(
                f"the body must be {expected} bytes (shape x itemsize); got {nbody}", "refused"
            )
        wire.send_frame(sock, {"ok": True, "continue": True})
        receiving, me = self.server.store.receiving, threading.get_ident()
        receiving[me] = {"path": path, "bytes": 0, "of": nbody}
        try:
            return wire.recv_body(
                sock,
                nbody,
                lambda got: receiving.update({me: {"path": path, "bytes": got, "of": nbody}}),
            )
        finally:
            receiving.pop(me, None)

    def _check_claim(self, sock: socket.socket, header: dict, digest: str, what: str) -> None:
        """The checksum the client claims for a put's body (in its header, or in a trailer frame
        after the body) must be the one of the bytes received."""
        claimed = header.get("checksum")
        if claimed is None:
            prefix = wire.recv_prefix(sock)
            if prefix is None:
                raise ConnectionError("the client left before its checksum trailer")
            if prefix[1]:
                raise StoreProtocolError("a checksum trailer has no body")
            claimed = wire.recv_header(sock, prefix[0], wire.HELLO_HEADER_BYTES).get("checksum")
        if digest != claimed:
            raise StoreError(
                f"{what}: the bytes received have checksum {digest}, the client sent {claimed}; "
                f"nothing stored",
                "checksum",
            )

    def _put_streamed(self, sock, header: dict, info: ObjectInfo, what: str) -> ObjectInfo:
        """A put larger than the transfer budget: its body goes to a tmp file as it arrives,
        a chunk at a time, and becomes the object once its checksum is confirmed."""
        wire.send_frame(sock, {"ok": True, "continue": True})
        buf = np.empty(min(tiers.STREAM_CHUNK_BYTES, info.nbytes), np.uint8)
        receiving, me = self.server.store.receiving, threading.get_ident()

        def chunks():
            for at in range(0, info.nbytes, len(buf)):
                receiving[me] = {"path": info.path, "bytes": at, "of": info.nbytes}
                view = memoryview(buf)[: min(len(buf), info.nbytes - at)]
                wire.recv_into(sock, view)
                yield view

        try:
            tmp, digest = self.server.store.receive_file(info, chunks())
        finally:
            receiving.pop(me, None)
        try:
            self._check_claim(sock, header, digest, what)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        info = dataclasses.replace(info, checksum=digest)
        self.server.store.put_file(info, tmp)
        return info

    def _get_streamed(self, sock, key: str, info: ObjectInfo, box) -> None:
        """A reply larger than the transfer budget, read from disk a chunk at a time; its
        checksum follows in a trailer frame, or an error when the file fails its own."""
        nbytes = wire.nbytes_of(boxes.shape(box), wire.dtype_of(info.dtype))
        reply = {
            "ok": True,
            "info": info.to_json(),
            "box": [list(b) for b in box],
            "checksum": None,
        }
        pieces = self.server.store.stream(key, box)
        first = next(pieces, None)  # a file that cannot be opened or read is an error reply
        wire.send_header(sock, reply, nbytes)
        crc, sent = 0, 0
        try:
            for piece in itertools.chain([] if first is None else [first], pieces):
                crc = zlib.crc32(piece, crc)
                wire.send_body(sock, piece)
                sent += piece.nbytes
        except StoreError as error:  # the file failed its checksum: the bytes sent are void
            if sent != nbytes:
                raise ConnectionError("a streamed reply broke off") from error
            wire.send_frame(sock, {"ok": False, "error": str(error), "reason": error.reason})
            return
        wire.send_frame(sock, {"ok": True, "checksum": checksums.text(crc)})

    def _check_body_limit(self, nbody: int, what: str, limit: int | None = None) -> None:
        limit = self.server.max_body if limit is None else limit
        if nbody > limit:
            raise StoreError(
                f"a request body is at most {limit} bytes (--max-body-bytes); {what} is "
                f"{nbody} bytes",
                "too_large",
            )

    def _serve(self, sock: socket.socket, header: dict, nbody: int) -> None:
        op = header.get("op")
        serve = self.OPS.get(op) if isinstance(op, str) else None
        if serve is None:
            raise StoreError(f"unknown op {op!r}; ops: {sorted(self.OPS)}", "refused")
        if nbody and op not in self.WITH_BODY:
            raise StoreProtocolError(f"op {op!r} takes no body")
        serve(self, sock, header, nbody)

    def _put(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store = self.server.store
        path = wire.check_path(header.get("path"))
        dtype = wire.dtype_of(str(header.get("dtype")))
        global_shape = wire.as_shape(header["global_shape"])
        box = wire.as_box(header["box"])
        wire.check_box(path, box, global_shape)
        expected = wire.nbytes_of(boxes.shape(box), dtype)
        what = f"put of {path!r} box {box}"
        self._check_body_limit(nbody, what)
        info = ObjectInfo(path, box, global_shape, dtype.name, expected, "")
        if nbody > self.server.budget.limit:  # written to disk as it arrives
            with self.server.budget.hold(tiers.STREAM_CHUNK_BYTES, what):
                info = self._put_streamed(sock, header, info, what)
        else:
            with self.server.budget.hold(nbody, what):
                data, digest = self._body(sock, nbody, expected, path)
                self._check_claim(sock, header, digest, what)
                info = dataclasses.replace(info, checksum=digest)
                store.put(info, data, durable=bool(header.get("durable")))
                del data  # the store holds it now, or has written it through
        wire.send_frame(sock, {"ok": True, "info": info.to_json()})

    def _get(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store = self.server.store
        path = wire.check_path(header.get("path"))
        box = None if header.get("box") is None else wire.as_box(header["box"])
        key = store.find(path, box)
        info, in_memory = store.info(key)
        whole = box is None or box == info.box
        # the object as read from disk (one in the memory tier is shared), a sub-box's copy
        reply_bytes = (0 if in_memory else info.nbytes) + (
            0 if whole else wire.nbytes_of(boxes.shape(box), wire.dtype_of(info.dtype))
        )
        if reply_bytes > self.server.budget.limit:  # read from disk a chunk at a time
            with self.server.budget.hold(tiers.STREAM_CHUNK_BYTES, f"get of {path!r}"):
                self._get_streamed(sock, key, info, box or info.box)
            return
        with self.server.budget.hold(reply_bytes, f"get of {path!r} box {box}"):
            entry, data = store.read(key)
            info = entry.info
            if whole:
                box, out, digest = info.box, data, info.checksum
            else:
                dtype = wire.dtype_of(info.dtype)
                full = np.frombuffer(data, dtype=np.dtype(f"V{dtype.itemsize}"))
                sub = full.reshape(info.shape)[boxes.index(box, info.box)]
                out = wire.as_bytes(np.ascontiguousarray(sub))
                digest = wire.checksum(out)
            reply = {
                "ok": True,
                "info": info.to_json(),
                "box": [list(b) for b in box],
                "checksum": digest,
            }
            wire.send_frame(sock, reply, out)
            del data, out

    def _accumulate(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Add a staged array into a stored one, once per (name, clock): ``Store.accumulate``."""
        path, stage = wire.check_path(header.get("path")), wire.check_path(header.get("stage"))
        name, clock = wire.check_name(header.get("name")), header.get("clock")
        if not wire._is_int(clock) or clock < 0:
            raise StoreError(f"accumulate needs an integer clock >= 0, got {clock!r:.50}")
        store = self.server.store
        info, _ = store.info(store.find(path, None))
        # the array, the update and their sum may all be in hand at once
        with self.server.budget.hold(3 * info.nbytes, f"accumulate into {path!r}"):
            info, applied = store.accumulate(path, stage, name, int(clock))
        wire.send_frame(sock, {"ok": True, "applied": applied, "info": info.to_json()})

    def _list(self, sock: socket.socket, header: dict, nbody: int) -> None:
        listing = [i.to_json() for i in self.server.store.list(str(header.get("prefix", "")))]
        wire.send_frame(sock, {"ok": True}, json.dumps(listing).encode())

    def _list_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store, prefix = self.server.store, str(header.get("prefix", ""))
        with store.lock:
            paths = sorted(p for p in store.json if p.startswith(prefix))
        wire.send_frame(sock, {"ok": True, "paths": paths})

    def _delete(self, sock: socket.socket, header: dict, nbody: int) -> None:
        prefix = header.get("prefix")
        if not isinstance(prefix, str):
            raise StoreError(f"delete needs a string prefix; got {prefix!r}", "refused")
        wire.send_frame(sock, {"ok": True, "deleted": self.server.store.delete(prefix)})

    def _json_body(self, sock: socket.socket, header: dict, nbody: int, what: str):
        """A JSON request body, received within the budget and checked (checksum, JSON)."""
        path = wire.check_path(header.get("path"))
        self._check_body_limit(nbody, what, wire.MAX_JSON_BYTES)
        data, digest = self._body(sock, nbody, nbody, path)
        if digest != header.get("checksum"):
            raise StoreError(
                f"{what}: the bytes received have checksum {digest}, the client "
                f"sent {header.get('checksum')}; nothing stored",
                "checksum",
            )
        try:
            json.loads(data.tobytes())
        except (ValueError, RecursionError) as error:
            raise StoreError(f"{what}: the body is not JSON: {error!r:.300}", "refused") from None
        return path, data

    def _put_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        what = f"put_json of {header.get('path')!r:.200}"
        with self.server.budget.hold(nbody, what):
            path, data = self._json_body(sock, header, nbody, what)
            self.server.store.put_json(path, data, flush=header.get("flush", True) is not False)
        wire.send_frame(sock, {"ok": True})

    def _get_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store, path = self.server.store, wire.check_path(header.get("path"))
        with self.server.budget.hold(store.json_bytes(path), f"get_json of {path!r}"):
            data = store.get_json(path)
            wire.send_frame(
                sock, {"ok": True, "checksum": wire.checksum(data), "time": time.time()}, data
            )

    def _cas_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Compare and swap a JSON object; the reply carries the object now and the store's
        clock (one clock for every client of the store, whatever host it runs on)."""
        expect = header.get("expect")
        if expect is not None and (
            not isinstance(expect, str) or not expect.startswith(checksums.PREFIX)
        ):
            raise StoreError(f"cas_json expects a checksum or null, got {expect!r:.100}")
        what = f"cas_json of {header.get('path')!r:.200}"
        store = self.server.store
        with store.lock:  # the object now, as read back to compare (a racing put may grow it)
            current = store.json.get(str(header.get("path")), 0)
        with self.server.budget.hold(nbody + 2 * current, what):
            path, data = self._json_body(sock, header, nbody, what)
            swapped, digest, now = store.cas_json(path, expect, data)
            reply = {"ok": True, "swapped": swapped, "checksum": digest, "time": time.time()}
            wire.send_frame(sock, reply, b"" if now is None else now)

    def _flush(self, sock: socket.socket, header: dict, nbody: int) -> None:
        self.server.store.flush()
        wire.send_frame(sock, {"ok": True})

    def _stats(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store = self.server.store
        with store.lock:
            stats = {
                "objects": len(store.index),
                "memory_bytes": store.memory_used,
                "memory_objects": len(store.memory),
                "dirty": len(store.dirty),
                "json": len(store.json),
                "pid": os.getpid(),
                # transfers under way: request bodies arriving, files being written
                "receiving": list(store.receiving.values()),
                "writing": list(store.writing.values()),
                "connections": self.server.connections(),
                "transfer_bytes": self.server.budget.used,
                "transfers_waiting": self.server.budget.waiting,
                "transfer_limit": self.server.budget.limit,
            }
        wire.send_frame(sock, {"ok": True, "stats": stats})

    OPS: typing.ClassVar[dict] = {
        "put": _put,
        "get": _get,
        "accumulate": _accumulate,
        "list": _list,
        "list_json": _list_json,
        "delete": _delete,
        "put_json": _put_json,
        "get_json": _get_json,
        "cas_json": _cas_json,
        "flush": _flush,
        "stats": _stats,
    }
    WITH_BODY = frozenset({"put", "put_json", "cas_json"})


class _Limits:
    """What both servers share: the store, its token, its limits, and the connection cap.

    At most ``max_connections`` connections are served at once; one beyond is answered with a
    ``"busy"`` error and closed, without a thread. When ``accept`` fails for want of file
    descriptors or memory, the accept loop backs off (10 ms doubling to 1 s) instead of spinning.
    """

    daemon_threads = True
    request_queue_size = 128

    def setup_limits(self, store: Store, token, options) -> None:
        self.store, self.token = store, token
        self.max_body, self.timeout_s = options.max_body_bytes, options.timeout
        self.handshake_s, self.max_connections = options.handshake_timeout, options.max_connections
        self.budget = options.budget
        self._lock, self._active, self._backoff = threading.Lock(), 0, 0.0

    def connections(self) -> int:
        with self._lock:
            return self._active

    def get_request(self):
        try:
            request = super().get_request()
        except OSError as error:
            if error.errno in ACCEPT_ERRORS:
                self._backoff = min(max(2 * self._backoff, 0.01), 1.0)
                time.sleep(self._backoff)
            raise
        self._backoff = 0.0
        return request

    def process_request(self, request, client_address):
        with self._lock:
            admitted = self._active < self.max_connections
            self._active += admitted
        if admitted:
            super().process_request(request, client_address)
            return
        _refuse(
            request,
            f"this store serves at most {self.max_connections} connections at "
            f"once (--max-connections); try again",
        )
        self.shutdown_request(request)

    def process_request_thread(self, request, client_address):
        try:
            super().process_request_thread(request, client_address)
        finally:
            with self._lock:
                self._active -= 1


class Server(_Limits, socketserver.ThreadingTCPServer):
    allow_reuse_address = True

    def __init__(self, address, store: Store, token: str | None, options):
        self.address_family = socket.AF_INET6 if ":" in address[0] else socket.AF_INET
        self.setup_limits(store, token, options)
        super().__init__(address, Handler)


class UnixServer(_Limits, socketserver.ThreadingUnixStreamServer):
    """The same service on a Unix socket (same host only; about twice TCP loopback's bandwidth).

    It takes ``path`` only when nothing is there or a stale socket is (one whose server is gone);
    a live server's socket or any other file is refused, never removed. ``remove`` deletes the
    socket at exit only if it is still this server's (the same inode).
    """

    def __init__(self, path: str, store: Store, token: str | None, options):
        self.setup_limits(store, token, options)
        _claim_socket_path(path)
        umask = os.umask(0o077)  # only this user may connect, from the moment it exists
        try:
            super().__init__(path, Handler)
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
    """Tell a connection over the cap "busy", from the accept loop without waiting: the frame
    fits the new socket's empty send buffer, and a Linux peer reads it even when closing the
    socket with its hello unread sends a reset."""
    with contextlib.suppress(OSError):
        sock.setblocking(False)
        wire.send_frame(sock, {"ok": False, "error": message, "reason": "busy"})


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m tenplex_jax.multihost.store",
        description="A tenplex_jax tensor store server (one per host).",
    )
    parser.add_argument("--dir", required=True, help="directory of the disk tier")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: any free port)")
    parser.add_argument("--token-file", help="file holding the token clients must present")
    parser.add_argument(
        "--memory-bytes",
        type=int,
        default=DEFAULT_MEMORY_BYTES,
        help=f"memory tier size (default {DEFAULT_MEMORY_BYTES})",
    )
    parser.add_argument(
        "--max-body-bytes",
        type=int,
        default=DEFAULT_MAX_BODY_BYTES,
        help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES})",
    )
    parser.add_argument(
        "--timeout",
        type=float,
        default=DEFAULT_TIMEOUT,
        help="seconds a connection may stay silent, and a transfer may wait for "
        "room in the budget (default 120)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        help="seconds a new connection has to complete its hello (default 10)",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"connections served at once; more are refused as busy (default "
        f"{DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument("--ready-file", help='written with "host:port" once listening')
    parser.add_argument(
        "--unix-socket", metavar="PATH", help='also serve on this Unix socket (address "unix:PATH")'
    )
    args = parser.parse_args(argv)

    token = None
    if args.token_file:
        token = pathlib.Path(args.token_file).read_text().strip()
        if not token:
            parser.error(f"--token-file {args.token_file} is empty")
        mode = pathlib.Path(args.token_file).stat().st_mode
        if mode & 0o077:
            print(
                f"tenplex_jax.multihost.store: warning: --token-file {args.token_file} can be read "
                f"by other users (mode {stat.S_IMODE(mode):o}); chmod 600 it",
                file=sys.stderr,
                flush=True,
            )
    for name in ("memory_bytes", "max_body_bytes", "max_connections"):
        if getattr(args, name) < (0 if name == "memory_bytes" else 1):
            parser.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    # the bytes in flight (request bodies, replies) share one budget the size of the memory tier
    args.budget = Budget(max(args.memory_bytes, wire.MAX_JSON_BYTES), args.timeout)
    if not is_loopback(args.host) and token is None:
        parser.error(
            f"binding to {args.host} (not a loopback address) requires --token-file: any host "
            f"that reaches it could otherwise read and overwrite the training state"
        )
    directory = pathlib.Path(args.dir)
    directory.mkdir(parents=True, exist_ok=True)
    lock = open(directory / "LOCK", "w")  # noqa: SIM115 (held for the life of the process)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        parser.error(f"another store server is serving {directory}")

    store = Store(directory, args.memory_bytes)
    server = Server((args.host, args.port), store, token, args)
    host, port = server.server_address[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servers = [server]
    if args.unix_socket:
        try:
            servers.append(UnixServer(args.unix_socket, store, token, args))
        except StoreError as error:
            server.server_close()
            store.close()
            parser.error(str(error))
    for each in servers:
        threading.Thread(target=each.serve_forever, name="store-server", daemon=True).start()
    if args.ready_file:
        ready = pathlib.Path(args.ready_file)
        tmp = ready.with_name(ready.name + ".tmp")
        tmp.write_text(address)
        os.replace(tmp, ready)
    print(
        f"tenplex_jax.multihost.store: serving {directory} on {address}",
        file=sys.stderr,
        flush=True,
    )
    while not stop.wait(1.0):
        pass
    for each in servers:
        each.shutdown()
        each.server_close()
        if isinstance(each, UnixServer):
            each.remove()
    store.close()
    return 0
