"""The tensor store server: ``python -m tenplex_jax.store --dir DIR [--port 0] [--ready-file F]``.

One process per host (the launcher starts it; it outlives the workers). A threaded TCP server,
bound to 127.0.0.1 unless ``--host`` says otherwise; bound anywhere else it refuses to start
without ``--token-file``. ``--unix-socket PATH`` serves the same store on a Unix socket too (mode
0600), for clients on the same host: ``StoreClient("unix:PATH")``.

**Tiers.** Objects live in a memory tier (at most ``--memory-bytes``, least recently used clean
objects evicted first) and on disk under ``DIR/objects``. A plain put is acknowledged once it is
in the memory tier and queued for disk; ``durable=True`` (and any object larger than the memory
tier) is acknowledged only after its file is complete. ``flush`` waits until every object
acknowledged before it is on disk; ``put_json`` flushes first (unless asked not to), then writes
durably, so a commit marker on disk implies that the objects put before it are on disk. SIGTERM / SIGINT flush too.

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
import collections
import dataclasses
import fcntl
import hashlib
import hmac
import ipaddress
import json
import os
import pathlib
import queue
import shutil
import signal
import socket
import socketserver
import struct
import sys
import threading
import uuid

import numpy as np

from tenplex_jax.errors import StoreError
from tenplex_jax.store import wire
from tenplex_jax.store.wire import ObjectInfo

FILE_MAGIC = b"TPXO"
FILE_PREFIX = struct.Struct("!4sI")
DEFAULT_MEMORY_BYTES = 4 << 30
DEFAULT_MAX_BODY_BYTES = 8 << 30
DEFAULT_TIMEOUT = 120.0
IO_CHUNK_BYTES = 256 << 20
WRITERS = 4  # threads writing the memory tier back to disk


@dataclasses.dataclass(frozen=True)
class Entry:
    info: ObjectInfo
    seq: int  # puts of one key are ordered by seq; the newest one wins
    on_disk: bool  # the file under objects/ holds this version


class Refused(Exception):
    """A request the server answers with an error; the connection stays usable."""

    def __init__(self, message: str, reason: str = "refused"):
        super().__init__(message)
        self.reason = reason


def _key(kind: str, path: str, box: wire.Box = ()) -> str:
    text = json.dumps([kind, path, [list(b) for b in box]], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


class Store:
    """The store's state: the index, the memory tier, the disk writer. Thread-safe."""

    def __init__(self, directory: pathlib.Path, memory_bytes: int):
        self.dir = pathlib.Path(directory)
        self.memory_bytes = memory_bytes
        self.objects_dir = self.dir / "objects"
        self.json_dir = self.dir / "json"
        self.tmp_dir = self.dir / "tmp"
        self.corrupt_dir = self.dir / "corrupt"
        for d in (self.objects_dir, self.json_dir, self.corrupt_dir):
            d.mkdir(parents=True, exist_ok=True)
        shutil.rmtree(self.tmp_dir, ignore_errors=True)  # partial writes of an earlier run
        self.tmp_dir.mkdir()
        self.lock = threading.Lock()
        self.seq = 0
        self.index: dict[str, Entry] = {}
        self.by_path: dict[str, set[str]] = collections.defaultdict(set)
        # key -> (seq, bytes), least recently used first
        self.memory: collections.OrderedDict[str, tuple[int, np.ndarray]]
        self.memory = collections.OrderedDict()
        self.memory_used = 0
        self.dirty: dict[str, int] = {}  # keys whose newest version is only in memory -> bytes
        self.dirty_bytes = 0
        self.json: dict[str, bytes] = {}
        self.writes: queue.Queue = queue.Queue()  # (ticket, key, seq) to write back, in put order
        self.queued = 0  # tickets handed out
        self.pending: set[int] = set()  # tickets not yet written back
        self.written_cond = threading.Condition(self.lock)
        self.failed: dict[str, str] = {}  # dirty keys whose write-back failed -> the error
        self.closing = False
        self._load()
        # several writers: their fsyncs overlap, as the file system's journal commits them together
        self.writers = [
            threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
            for _ in range(WRITERS)
        ]
        for writer in self.writers:
            writer.start()

    # -- index and memory tier (call with the lock held) -------------------------------------

    def _index_set(self, key: str, entry: Entry) -> None:
        self.index[key] = entry
        self.by_path[entry.info.path].add(key)

    def _index_del(self, key: str) -> None:
        entry = self.index.pop(key, None)
        if entry is not None:
            keys = self.by_path[entry.info.path]
            keys.discard(key)
            if not keys:
                del self.by_path[entry.info.path]
        self._forget(key)
        self._clean(key)

    def _clean(self, key: str) -> None:
        self.dirty_bytes -= self.dirty.pop(key, 0)

    def _remember(self, key: str, seq: int, data: np.ndarray) -> None:
        self._forget(key)
        self.memory[key] = (seq, data)
        self.memory_used += len(data)

    def _forget(self, key: str) -> None:
        old = self.memory.pop(key, None)
        if old is not None:
            self.memory_used -= len(old[1])

    def _evict(self) -> None:
        """Drop clean objects, least recently used first, until the memory tier fits."""
        if self.memory_used <= self.memory_bytes:
            return
        for key in list(self.memory):
            if self.memory_used <= self.memory_bytes:
                break
            if key not in self.dirty:
                self._forget(key)

    # -- disk ------------------------------------------------------------------------------

    def _load(self) -> None:
        """Index the complete object files (headers only; data is verified when read)."""
        for file in sorted(self.objects_dir.glob("*.obj")):
            try:
                info = ObjectInfo.from_json(self._read_header(file))
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                self._set_aside(file, f"incomplete or unreadable: {error!r}")
                continue
            if _key("array", info.path, info.box) != file.stem:
                self._set_aside(file, "its name is not its (path, box)")
                continue
            self.seq += 1
            self._index_set(file.stem, Entry(info, self.seq, on_disk=True))
        for file in sorted(self.json_dir.glob("*.obj")):
            try:
                header, data = self._read_file(file)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                self._set_aside(file, f"incomplete or corrupt: {error!r}")
                continue
            self.json[header["path"]] = bytes(data)

    @staticmethod
    def _read_header(file: pathlib.Path) -> dict:
        with open(file, "rb") as f:
            magic, n = FILE_PREFIX.unpack(f.read(FILE_PREFIX.size))
            if magic != FILE_MAGIC:
                raise ValueError(f"bad magic {magic!r}")
            header = json.loads(f.read(n))
            size = os.fstat(f.fileno()).st_size
        if size != FILE_PREFIX.size + n + int(header["nbytes"]):
            raise ValueError(f"file size {size} disagrees with its header")
        return header

    @staticmethod
    def _read_file(file: pathlib.Path) -> tuple[dict, np.ndarray]:
        """A file's header and bytes; ``ValueError`` unless the bytes match its checksum."""
        with open(file, "rb") as f:
            magic, n = FILE_PREFIX.unpack(f.read(FILE_PREFIX.size))
            if magic != FILE_MAGIC:
                raise ValueError(f"bad magic {magic!r}")
            header = json.loads(f.read(n))
            data = np.empty(int(header["nbytes"]), np.uint8)
            view, got = memoryview(data), 0
            while got < len(data):  # in chunks: one read(2) moves at most ~2 GiB
                k = f.readinto(view[got : got + IO_CHUNK_BYTES])
                if not k:
                    break
                got += k
            extra = f.read(1)
        if got != len(data) or extra:
            raise ValueError(f"file holds {got + len(extra)}+ bytes, its header says {len(data)}")
        digest = wire.checksum(data)
        if digest != header["checksum"]:
            raise ValueError(f"checksum {digest}, its header says {header['checksum']}")
        return header, data

    def _set_aside(self, file: pathlib.Path, why: str) -> None:
        print(f"tenplex_jax.store: {file} is not served: {why}", file=sys.stderr, flush=True)
        try:
            os.replace(file, self.corrupt_dir / f"{file.name}.{uuid.uuid4().hex[:8]}")
        except OSError:
            pass

    def _write_tmp(self, header: dict, data) -> pathlib.Path:
        """A complete, fsynced file under tmp/ (not yet visible)."""
        tmp = self.tmp_dir / f"{uuid.uuid4().hex}.tmp"
        encoded = json.dumps(header, separators=(",", ":")).encode()
        try:
            with open(tmp, "wb") as f:
                f.write(FILE_PREFIX.pack(FILE_MAGIC, len(encoded)) + encoded)
                view = memoryview(data).cast("B")
                f.writelines(
                    view[start : start + IO_CHUNK_BYTES]
                    for start in range(0, view.nbytes, IO_CHUNK_BYTES)
                )
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return tmp

    @staticmethod
    def _sync_dir(directory: pathlib.Path) -> None:
        """fsync a directory, so that a rename into it survives a crash of the machine. Called
        after the lock is released (the rename is done under it): an fsync takes milliseconds."""
        fd = os.open(directory, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def _write_loop(self) -> None:
        while True:
            item = self.writes.get()
            if item is None:
                return
            ticket, key, seq = item
            try:
                self._write_back(key, seq)
            except Exception as error:  # noqa: BLE001 (the object stays in memory; flush says so)
                with self.lock:
                    self.failed[key] = repr(error)
            with self.lock:
                self.pending.discard(ticket)
                self.written_cond.notify_all()

    def _queue_write(self, key: str, seq: int) -> None:
        """Queue a write-back (call with the lock held)."""
        self.queued += 1
        self.pending.add(self.queued)
        self.writes.put((self.queued, key, seq))

    def _write_back(self, key: str, seq: int) -> None:
        with self.lock:
            held, entry = self.memory.get(key), self.index.get(key)
            if held is None or held[0] != seq or entry is None or entry.seq != seq:
                return  # replaced or deleted since it was queued
            data = held[1]
        tmp = self._write_tmp(entry.info.to_json(), data)
        with self.lock:
            entry = self.index.get(key)
            if entry is None or entry.seq != seq:
                tmp.unlink(missing_ok=True)
                return
            os.replace(tmp, self.objects_dir / f"{key}.obj")
            self.index[key] = dataclasses.replace(entry, on_disk=True)
            self._clean(key)
            self.failed.pop(key, None)
            self._evict()
        self._sync_dir(self.objects_dir)

    def flush(self) -> None:
        """Wait until every object acknowledged before this call is on disk (later puts do not
        hold it up); write-backs that failed are retried once, then reported."""
        for attempt in (0, 1):
            with self.lock:
                if attempt:
                    for key in self.failed:
                        held = self.memory.get(key)
                        if held is not None and key in self.dirty:
                            self._queue_write(key, held[0])
                target = self.queued
                while min(self.pending, default=target + 1) <= target:
                    self.written_cond.wait()
                failed = {k: e for k, e in self.failed.items() if k in self.dirty}
                self.failed = failed
            if not failed:
                return
        paths = {self.index[k].info.path: e for k, e in failed.items() if k in self.index}
        raise Refused(f"disk writes failed (the objects stay in memory only): {paths}", "disk")

    # -- operations -----------------------------------------------------------------------------

    def put(self, info: ObjectInfo, data: np.ndarray, durable: bool) -> None:
        key = _key("array", info.path, info.box)
        with self.lock:
            if self.closing:
                raise Refused("the store is shutting down; nothing stored", "unavailable")
            self.seq += 1
            seq = self.seq
            # the memory tier may hold it if it fits next to the objects not yet on disk
            room = self.memory_bytes - self.dirty_bytes + self.dirty.get(key, 0)
            if not durable and len(data) <= room:
                self._clean(key)
                self._remember(key, seq, data)
                self._index_set(key, Entry(info, seq, on_disk=False))
                self.dirty[key] = len(data)
                self.dirty_bytes += len(data)
                self._evict()
                self.failed.pop(key, None)
                self._queue_write(key, seq)
                return
        tmp = self._write_tmp(info.to_json(), data)  # write-through
        with self.lock:
            entry = self.index.get(key)
            if entry is not None and entry.seq > seq:
                tmp.unlink(missing_ok=True)  # a newer put of the same key won
                return
            os.replace(tmp, self.objects_dir / f"{key}.obj")
            self._index_set(key, Entry(info, seq, on_disk=True))
            self._clean(key)
            self.failed.pop(key, None)
            self._forget(key)
            if len(data) <= self.memory_bytes:
                self._remember(key, seq, data)
                self._evict()
        self._sync_dir(self.objects_dir)

    def find(self, path: str, box: wire.Box | None) -> str:
        """The key of the object under ``path`` that contains ``box`` (None: the whole array)."""
        with self.lock:
            candidates = [self.index[k].info for k in self.by_path.get(path, ())]
        if not candidates:
            raise Refused(f"no object at path {path!r}", "not_found")
        if box is None:
            box = wire.full_box(candidates[0].global_shape)
        holding = [i for i in candidates if wire.contains(i.box, box)]
        if not holding:
            stored = sorted(i.box for i in candidates)
            raise Refused(
                f"no object at path {path!r} contains box {box}; stored boxes: {stored}",
                "not_found",
            )
        best = min(holding, key=lambda i: i.nbytes)
        return _key("array", best.path, best.box)

    def read(self, key: str) -> tuple[Entry, np.ndarray]:
        """An object's entry and bytes: from the memory tier, else from its verified file."""
        file = self.objects_dir / f"{key}.obj"
        for _ in range(5):
            with self.lock:
                entry = self.index.get(key)
                if entry is None:
                    raise Refused("the object was deleted while it was read", "not_found")
                held = self.memory.get(key)
                if held is not None and held[0] == entry.seq:
                    self.memory.move_to_end(key)
                    return entry, held[1]
            failure = None
            try:
                header, data = self._read_file(file)
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                failure = repr(error)
            with self.lock:
                if self.index.get(key) is not entry:
                    continue  # replaced while it was read: look again
                if failure is None and header != entry.info.to_json():
                    failure = "the file holds another version than the index"
                if failure is not None:
                    self._index_del(key)
                    self._set_aside(file, failure)
                    raise Refused(
                        f"object {entry.info.path!r} box {entry.info.box} is corrupt on disk "
                        f"({failure}); it is not served",
                        "corrupt",
                    )
                if len(data) <= self.memory_bytes:
                    self._remember(key, entry.seq, data)
                    self._evict()
                return entry, data
        raise Refused("the object kept changing while it was read", "busy")

    def list(self, prefix: str) -> list[ObjectInfo]:
        with self.lock:
            infos = [e.info for e in self.index.values() if e.info.path.startswith(prefix)]
        return sorted(infos, key=lambda i: (i.path, i.box))

    def delete(self, prefix: str) -> int:
        with self.lock:
            keys = [k for k, e in self.index.items() if e.info.path.startswith(prefix)]
            for key in keys:
                self._index_del(key)
                (self.objects_dir / f"{key}.obj").unlink(missing_ok=True)
            paths = [p for p in self.json if p.startswith(prefix)]
            for path in paths:
                del self.json[path]
                (self.json_dir / f"{_key('json', path)}.obj").unlink(missing_ok=True)
        if keys or paths:  # so that deleted objects stay deleted after a crash of the machine
            self._sync_dir(self.objects_dir)
            self._sync_dir(self.json_dir)
        return len(keys) + len(paths)

    def put_json(self, path: str, data: np.ndarray, flush: bool = True) -> None:
        if flush:
            self.flush()  # the objects put before a commit marker reach disk before it
        header = {"path": path, "nbytes": len(data), "checksum": wire.checksum(data)}
        tmp = self._write_tmp(header, data)
        with self.lock:
            os.replace(tmp, self.json_dir / f"{_key('json', path)}.obj")
            self.json[path] = bytes(data)
        self._sync_dir(self.json_dir)

    def close(self) -> None:
        """Refuse further puts, write every object still only in memory, stop the writer."""
        with self.lock:
            self.closing = True
        for _ in self.writers:
            self.writes.put(None)
        for writer in self.writers:
            writer.join()


# ---------------------------------------------------------------------------------------------
# the TCP server


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
                except (Refused, StoreError) as error:
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
        except wire.StoreProtocolError as error:
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
            raise wire.StoreProtocolError("a connection must open with a hello frame")
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

    def _body(self, sock: socket.socket, nbody: int, expected: int) -> tuple[np.ndarray, str]:
        """Say continue, then read a body of exactly ``expected`` bytes; (bytes, checksum)."""
        if nbody != expected:
            raise Refused(f"the body must be {expected} bytes (shape x itemsize); got {nbody}")
        wire.send_frame(sock, {"ok": True, "continue": True})
        return wire.recv_body(sock, nbody)

    def _check_body_limit(self, nbody: int, what: str, limit: int | None = None) -> None:
        limit = self.server.max_body if limit is None else limit
        if nbody > limit:
            raise Refused(
                f"a request body is at most {limit} bytes (--max-body-bytes); {what} is "
                f"{nbody} bytes",
                "too_large",
            )

    def _serve(self, sock: socket.socket, header: dict, nbody: int) -> None:
        op, store = header.get("op"), self.server.store
        if op != "put" and op != "put_json" and nbody:
            raise wire.StoreProtocolError(f"op {op!r} takes no body")
        if op == "put":
            path = wire.check_path(header.get("path"))
            dtype = wire.dtype_of(str(header.get("dtype")))
            global_shape = tuple(int(n) for n in header["global_shape"])
            box = wire.as_box(header["box"])
            wire.check_box(path, box, global_shape)
            expected = wire.nbytes_of(wire.box_shape(box), dtype)
            self._check_body_limit(nbody, f"put of {path!r} box {box}")
            data, digest = self._body(sock, nbody, expected)
            if digest != header.get("checksum"):
                raise Refused(
                    f"put of {path!r} box {box}: the bytes received have checksum {digest}, the "
                    f"client sent {header.get('checksum')}; nothing stored",
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
                sub = full.reshape(info.shape)[wire.local_index(info.box, box)]
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
                raise Refused(f"delete needs a string prefix; got {prefix!r}")
            wire.send_frame(sock, {"ok": True, "deleted": store.delete(prefix)})
        elif op == "put_json":
            path = wire.check_path(header.get("path"))
            self._check_body_limit(nbody, f"put_json of {path!r}", wire.MAX_JSON_BYTES)
            data, _ = self._body(sock, nbody, nbody)
            try:
                json.loads(data.tobytes())
            except (UnicodeDecodeError, json.JSONDecodeError) as error:
                raise Refused(f"put_json of {path!r}: the body is not JSON: {error}") from error
            store.put_json(path, data, flush=header.get("flush", True) is not False)
            wire.send_frame(sock, {"ok": True})
        elif op == "get_json":
            path = wire.check_path(header.get("path"))
            with store.lock:
                data = store.json.get(path)
            if data is None:
                raise Refused(f"no JSON object at path {path!r}", "not_found")
            wire.send_frame(sock, {"ok": True}, data)
        elif op == "flush":
            store.flush()
            wire.send_frame(sock, {"ok": True})
        elif op == "stats":
            with store.lock:
                stats = {"objects": len(store.index), "memory_bytes": store.memory_used,
                         "memory_objects": len(store.memory), "dirty": len(store.dirty),
                         "json": len(store.json), "pid": os.getpid()}  # fmt: skip
            wire.send_frame(sock, {"ok": True, "stats": stats})
        else:
            raise Refused(f"unknown op {op!r}")


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
        prog="python -m tenplex_jax.store",
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
    print(f"tenplex_jax.store: serving {directory} on {address}", file=sys.stderr, flush=True)
    while not stop.wait(1.0):
        pass
    for each in servers:
        each.shutdown()
        each.server_close()
    if args.unix_socket:
        pathlib.Path(args.unix_socket).unlink(missing_ok=True)
    store.close()
    return 0
