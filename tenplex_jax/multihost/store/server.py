"""The tensor store server: ``python -m tenplex_jax.multihost.store --dir DIR [--port 0] [--ready-file F]``.

One process per host (the launcher starts it; it outlives the workers). A threaded TCP server,
bound to 127.0.0.1 unless ``--host`` says otherwise; bound anywhere else it refuses to start
without ``--token-file``. ``--unix-socket PATH`` serves the same store on a Unix socket too (mode
0600), for clients on the same host: ``StoreClient("unix:PATH")``.

**Tiers.** Objects live in a memory tier (at most ``--memory-bytes``, least recently used clean
objects evicted first) and on disk under ``DIR/objects``. A plain put is acknowledged once it is
in the memory tier and queued for disk; ``durable=True`` (and any object larger than the memory
tier) is acknowledged only after its file is complete. ``flush`` waits until every object
acknowledged before it is on disk; ``put_json`` flushes first (unless asked not to), then writes
durably, so a commit marker on disk implies that the objects put before it are on disk.
SIGTERM / SIGINT flush too.

**Atomic files.** An object is one file: ``b"TPXO"`` + header length + a JSON header (path, box,
global shape, dtype, checksum) + the bytes. It is written to ``DIR/tmp`` and fsynced; only then
is it renamed into ``DIR/objects`` and does the index point at it (the directory is fsynced before
a durable put or a flush returns). Several writer threads overlap their fsyncs. A restarted
store deletes ``DIR/tmp``, indexes complete files (a file whose size disagrees with its header is
set aside), and verifies every file's checksum when it reads it: a file that fails is moved to
``DIR/corrupt`` and never served. So after a crash the store serves each object's last complete
version or nothing; never a partial one.
"""

from __future__ import annotations

import argparse
import fcntl
import hmac
import ipaddress
import json
import os
import pathlib
import signal
import socket
import socketserver
import sys
import threading

import numpy as np

from tenplex_jax import box as boxes
from tenplex_jax.errors import StoreError, StoreProtocolError
from tenplex_jax.multihost.store import wire
from tenplex_jax.multihost.store.tiers import DEFAULT_MEMORY_BYTES, Store
from tenplex_jax.multihost.store.wire import ObjectInfo

DEFAULT_MAX_BODY_BYTES = 8 << 30
DEFAULT_TIMEOUT = 120.0


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
        try:
            wire.send_frame(sock, header)
        except OSError:
            pass

    def _hello(self, sock: socket.socket) -> bool:
        prefix = wire.recv_prefix(sock)
        if prefix is None:
            return False
        nheader, nbody = prefix
        header = wire.recv_header(sock, nheader, wire.HELLO_HEADER_BYTES)
        if header.get("op") != "hello" or nbody:
            raise StoreProtocolError("a connection must open with a hello frame")
        token = self.server.token
        if token is not None:
            given = header.get("token")
            if not isinstance(given, str) or not hmac.compare_digest(
                given.encode(), token.encode()
            ):
                missing = "no token" if given is None else "a wrong token"
                wire.send_frame(
                    sock,
                    {"ok": False, "error": f"this store requires a token; got {missing}",
                     "reason": "auth"},
                )  # fmt: skip
                return False
        wire.send_frame(sock, {"ok": True, "version": 1})
        return True

    def _body(self, sock: socket.socket, nbody: int, expected: int, path: str):
        """Say continue, then read a body of exactly ``expected`` bytes; (bytes, checksum)."""
        if nbody != expected:
            raise StoreError(
                f"the body must be {expected} bytes (shape x itemsize); got {nbody}", "refused"
            )
        wire.send_frame(sock, {"ok": True, "continue": True})
        receiving, me = self.server.store.receiving, threading.get_ident()
        receiving[me] = {"path": path, "bytes": 0, "of": nbody}
        try:
            return wire.recv_body(sock, nbody, lambda got: receiving.update(
                {me: {"path": path, "bytes": got, "of": nbody}}))  # fmt: skip
        finally:
            receiving.pop(me, None)

    def _check_body_limit(self, nbody: int, what: str, limit: int | None = None) -> None:
        limit = self.server.max_body if limit is None else limit
        if nbody > limit:
            raise StoreError(
                f"a request body is at most {limit} bytes (--max-body-bytes); {what} is "
                f"{nbody} bytes",
                "too_large",
            )

    def _serve(self, sock: socket.socket, header: dict, nbody: int) -> None:
        op, store = header.get("op"), self.server.store
        if op != "put" and op != "put_json" and nbody:
            raise StoreProtocolError(f"op {op!r} takes no body")
        if op == "put":
            path = wire.check_path(header.get("path"))
            dtype = wire.dtype_of(str(header.get("dtype")))
            global_shape = tuple(int(n) for n in header["global_shape"])
            box = wire.as_box(header["box"])
            wire.check_box(path, box, global_shape)
            expected = wire.nbytes_of(boxes.shape(box), dtype)
            self._check_body_limit(nbody, f"put of {path!r} box {box}")
            data, digest = self._body(sock, nbody, expected, path)
            claimed = header.get("checksum")
            if claimed is None:  # in a trailer frame after the body
                prefix = wire.recv_prefix(sock)
                if prefix is None:
                    raise ConnectionError("the client left before its checksum trailer")
                if prefix[1]:
                    raise StoreProtocolError("a checksum trailer has no body")
                claimed = wire.recv_header(sock, prefix[0], wire.HELLO_HEADER_BYTES).get("checksum")
            if digest != claimed:
                raise StoreError(
                    f"put of {path!r} box {box}: the bytes received have checksum {digest}, the "
                    f"client sent {claimed}; nothing stored",
                    "checksum",
                )
            info = ObjectInfo(path, box, global_shape, dtype.name, expected, digest)
            store.put(info, data, durable=bool(header.get("durable")))
            wire.send_frame(sock, {"ok": True, "info": info.to_json()})
        elif op == "get":
            path = wire.check_path(header.get("path"))
            box = None if header.get("box") is None else wire.as_box(header["box"])
            entry, data = store.read(store.find(path, box))
            info = entry.info
            if box is None or box == info.box:
                box, out, digest = info.box, data, info.checksum
            else:
                dtype = wire.dtype_of(info.dtype)
                full = np.frombuffer(data, dtype=np.dtype(f"V{dtype.itemsize}"))
                sub = full.reshape(info.shape)[boxes.index(box, info.box)]
                out = wire.as_bytes(np.ascontiguousarray(sub))
                digest = wire.checksum(out)
            reply = {"ok": True, "info": info.to_json(), "box": [list(b) for b in box],
                     "checksum": digest}  # fmt: skip
            wire.send_frame(sock, reply, out)
        elif op == "list":
            listing = [i.to_json() for i in store.list(str(header.get("prefix", "")))]
            wire.send_frame(sock, {"ok": True}, json.dumps(listing).encode())
        elif op == "list_json":
            prefix = str(header.get("prefix", ""))
            with store.lock:
                paths = sorted(p for p in store.json if p.startswith(prefix))
            wire.send_frame(sock, {"ok": True, "paths": paths})
        elif op == "delete":
            prefix = header.get("prefix")
            if not isinstance(prefix, str):
                raise StoreError(f"delete needs a string prefix; got {prefix!r}", "refused")
            wire.send_frame(sock, {"ok": True, "deleted": store.delete(prefix)})
        elif op == "put_json":
            path = wire.check_path(header.get("path"))
            self._check_body_limit(nbody, f"put_json of {path!r}", wire.MAX_JSON_BYTES)
            data, _ = self._body(sock, nbody, nbody, path)
            try:
                json.loads(data.tobytes())
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise StoreError(
                    f"put_json of {path!r}: the body is not JSON: {error}", "refused"
                ) from error
            store.put_json(path, data, flush=header.get("flush", True) is not False)
            wire.send_frame(sock, {"ok": True})
        elif op == "get_json":
            path = wire.check_path(header.get("path"))
            with store.lock:
                data = store.json.get(path)
            if data is None:
                raise StoreError(f"no JSON object at path {path!r}", "not_found")
            wire.send_frame(sock, {"ok": True}, data)
        elif op == "flush":
            store.flush()
            wire.send_frame(sock, {"ok": True})
        elif op == "stats":
            with store.lock:
                stats = {"objects": len(store.index), "memory_bytes": store.memory_used,
                         "memory_objects": len(store.memory), "dirty": len(store.dirty),
                         "json": len(store.json), "pid": os.getpid(),
                         # transfers under way: request bodies arriving, files being written
                         "receiving": list(store.receiving.values()),
                         "writing": list(store.writing.values())}  # fmt: skip
            wire.send_frame(sock, {"ok": True, "stats": stats})
        else:
            raise StoreError(f"unknown op {op!r}", "refused")


class Server(socketserver.ThreadingTCPServer):
    daemon_threads = True
    allow_reuse_address = True
    request_queue_size = 128

    def __init__(self, address, store: Store, token: str | None, max_body: int, timeout_s: float):
        host = address[0]
        self.address_family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self.store, self.token, self.max_body, self.timeout_s = store, token, max_body, timeout_s
        super().__init__(address, Handler)


class UnixServer(socketserver.ThreadingUnixStreamServer):
    """The same service on a Unix socket (same host only; about twice TCP loopback's bandwidth)."""

    daemon_threads = True
    request_queue_size = 128

    def __init__(self, path: str, store: Store, token: str | None, max_body: int, timeout_s: float):
        self.store, self.token, self.max_body, self.timeout_s = store, token, max_body, timeout_s
        if os.path.exists(path) and not os.path.isdir(path):
            os.unlink(path)  # a socket left by a killed server (the dir lock says none runs)
        umask = os.umask(0o077)  # only this user may connect, from the moment it exists
        try:
            super().__init__(path, Handler)
        finally:
            os.umask(umask)
        os.chmod(path, 0o600)


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
    parser.add_argument("--memory-bytes", type=int, default=DEFAULT_MEMORY_BYTES,
                        help=f"memory tier size (default {DEFAULT_MEMORY_BYTES})")  # fmt: skip
    parser.add_argument("--max-body-bytes", type=int, default=DEFAULT_MAX_BODY_BYTES,
                        help=f"largest request body (default {DEFAULT_MAX_BODY_BYTES})")  # fmt: skip
    parser.add_argument("--timeout", type=float, default=DEFAULT_TIMEOUT,
                        help="seconds a connection may stay silent (default 120)")  # fmt: skip
    parser.add_argument("--ready-file", help='written with "host:port" once listening')
    parser.add_argument("--unix-socket", metavar="PATH",
                        help='also serve on this Unix socket (address "unix:PATH")')  # fmt: skip
    args = parser.parse_args(argv)

    token = None
    if args.token_file:
        token = pathlib.Path(args.token_file).read_text().strip()
        if not token:
            parser.error(f"--token-file {args.token_file} is empty")
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
    server = Server((args.host, args.port), store, token, args.max_body_bytes, args.timeout)
    host, port = server.server_address[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    servers = [server]
    if args.unix_socket:
        servers.append(
            UnixServer(args.unix_socket, store, token, args.max_body_bytes, args.timeout)
        )
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
    if args.unix_socket:
        pathlib.Path(args.unix_socket).unlink(missing_ok=True)
    store.close()
    return 0
