"""The tensor store: path-addressed arrays outside the workers, with range reads and replicas.

A store server runs per host (``python -m tenplex_jax.store --dir DIR --port 0 --ready-file F``,
or ``StoreProcess.start``) and outlives the workers. An object is an array addressed by
``(path, box)``: ``path`` names a leaf (``"v3/model/layers/0/attn/wq"``: a version prefix plus the
leaf's tree path), ``box`` the global index box it covers, ``((start, stop), ...)`` per dim as in
``tenplex_jax.ptc.Box``. A read asks for any sub-box of one stored object; the server slices and
sends only those bytes. Every object carries its global shape, dtype and a crc32 checksum, which
is checked on every hop: client to server, disk to server, server to client.

Example::

    proc = StoreProcess.start("/tmp/store0")                 # or the launcher starts it
    store = StoreClient(proc.address)
    store.put("v1/w", w_shard, box=((0, 4), (0, 8)), global_shape=(8, 8))
    store.get("v1/w", ((2, 4), (0, 8)))                      # == w_shard[2:4]
    store.put_json("v1/COMMIT", {"step": 100})               # durable, after the objects above
    stores = ReplicatedStore([p.address for p in procs], replicas=1)
    stores.put(0, "v1/w", w_shard, box=..., global_shape=...)  # on stores 0 and 1, in parallel
    stores.get("v1/w", box, prefer=0)                        # store 0, else its replica

**Acknowledgement.** ``put`` returns once the object is in the server's memory tier and queued
for disk (it survives the death of any worker, not of the store process); ``durable=True`` returns
only after the object's file is complete and fsynced; ``flush()`` waits for every earlier put to
reach disk, and ``put_json`` flushes first (``flush=False`` skips that wait), so a commit marker
on disk implies its objects are.

**Versions.** Give every commit its own path prefix (``"v3/"``) and ``delete`` old prefixes:
a put replaces an object atomically on each store, but a ``ReplicatedStore.put`` that raised may
have reached some of its stores, and a replica that missed an overwrite of the same
``(path, box)`` would still hold the old bytes.

**Errors.** Every failure raises ``StoreError`` with a ``reason``: ``"not_found"``, ``"corrupt"``
(a checksum failed; the object is set aside, not served), ``"unavailable"`` (no answer within the
timeouts), ``"too_large"``, ``"auth"``, ``"checksum"``, ``"disk"``, ``"protocol"``, ``"refused"``,
or ``"invalid"`` for bad arguments caught before anything was sent.

**Interface notes.** Beyond the planned interface: ``put`` returns the ``ObjectInfo`` and takes
``durable``; ``get``'s box may be None (the whole array); ``get_json`` takes a ``default``;
``delete`` also removes JSON objects under the prefix and returns how many it removed; ``flush``,
``list_json``, ``stats`` and ``ping`` exist; ``StoreClient`` and ``ReplicatedStore`` take
``connect_timeout`` (the time to connect and be greeted; a stopped store is skipped after it);
an address may be ``"unix:PATH"`` for a server started with ``--unix-socket PATH``;
``ReplicatedStore.put`` returns the store indices written and raises unless ``min_copies``
(default: all k+1) were; ``ReplicatedStore`` also has ``holders``, ``list``, ``delete``,
``put_json``, ``get_json``, ``flush`` and ``close``; ``StoreProcess`` starts a server subprocess.
The module is a package (``tenplex_jax/store/``: this client, ``server.py``, ``wire.py``) so that
``python -m tenplex_jax.store`` runs the server without importing this module twice.
"""

from __future__ import annotations

import concurrent.futures
import json
import os
import pathlib
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Sequence
from typing import Any, Self

import numpy as np

from tenplex_jax.errors import StoreError
from tenplex_jax.store import wire
from tenplex_jax.store.wire import Box, ObjectInfo, Shape

__all__ = ["ObjectInfo", "ReplicatedStore", "StoreClient", "StoreProcess"]

_MISSING = object()
_BROKEN = ("unavailable", "protocol")  # reasons after which a connection is not reused
DISK_BYTES_PER_S = 50e6  # the slowest disk a durable put waits for, for its reply timeout


def parse_address(address: str) -> tuple[str, int]:
    """``"127.0.0.1:5000"`` or ``"[::1]:5000"`` → (host, port)."""
    if address.startswith("unix:"):
        raise StoreError(f"{address!r} is a Unix socket address, not host:port")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StoreError(f'a store address is "host:port"; got {address!r}')
    return host.strip("[]"), int(port)


class StoreClient:
    """A connection to one store server. Thread-safe: each call takes a pooled connection.

    ``timeout`` bounds every socket operation (seconds); ``connect_timeout`` (default: ``timeout``)
    bounds opening a connection, so a dead store is given up on quickly.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
    ):
        self.address = address
        self._unix = address[len("unix:") :] if address.startswith("unix:") else None
        self._host, self._port = (None, None) if self._unix else parse_address(address)
        self._token = token
        self._timeout = timeout
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False

    def __repr__(self) -> str:
        return f"StoreClient({self.address!r})"

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # -- connections ------------------------------------------------------------------------

    def _connect(self) -> socket.socket:
        try:
            if self._unix is not None:
                sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                try:
                    sock.settimeout(self._connect_timeout)
                    sock.connect(self._unix)
                except BaseException:
                    sock.close()
                    raise
            else:
                sock = socket.create_connection((self._host, self._port), self._connect_timeout)
        except OSError as error:
            raise StoreError(f"cannot reach the store at {self.address}: {error}", "unavailable")
        try:
            if self._unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the hello exchange is part of connecting: a store that accepts but does not answer
            # (stopped, overloaded) is given up on within the connect timeout too
            sock.settimeout(self._connect_timeout)
            wire.send_frame(sock, {"op": "hello", "token": self._token})
            self._reply(sock)
            sock.settimeout(self._timeout)
        except BaseException:
            sock.close()
            raise
        return sock

    def _checkout(self) -> tuple[socket.socket, bool]:
        """A connection: an idle pooled one (reused=True) or a new one."""
        if self._closed:
            raise StoreError(f"the client of {self.address} is closed", "closed")
        with self._lock:
            if self._idle:
                return self._idle.pop(), True
        return self._connect(), False

    def _checkin(self, sock: socket.socket) -> None:
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _reply(self, sock: socket.socket) -> tuple[dict, int]:
        """The next response header (raises StoreError for an error reply) and its body size."""
        try:
            prefix = wire.recv_prefix(sock)
            if prefix is None:
                raise ConnectionError("the store closed the connection")
            header = wire.recv_header(sock, prefix[0], wire.MAX_RESPONSE_HEADER_BYTES)
        except (OSError, wire.StoreProtocolError) as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        if not header.get("ok"):
            reason = header.get("reason", "refused")
            raise StoreError(f"store {self.address}: {header.get('error')}", reason)
        return header, prefix[1]

    def _call(self, request: dict, body=None, into=None) -> tuple[dict, Any]:
        """One request → (reply header, reply body). ``body`` follows a "continue" reply;
        ``into(header)`` may return a writable array for the reply body (no copy)."""
        for attempt in (0, 1):
            sock, reused = self._checkout()
            try:
                result = self._exchange(sock, request, body, into)
            except StoreError as error:
                if error.reason in _BROKEN:
                    sock.close()
                    # a pooled connection the server has since closed (idle timeout, restart):
                    # retry once on a new one; every request is idempotent
                    if error.reason == "unavailable" and reused and not attempt:
                        continue
                else:  # an error reply: the connection is in a known state
                    self._checkin(sock)
                raise
            except BaseException:
                sock.close()  # its state is unknown: never reuse it
                raise
            self._checkin(sock)
            return result
        raise AssertionError("unreachable")

    def _exchange(self, sock, request: dict, body, into) -> tuple[dict, Any]:
        nbody = 0 if body is None else memoryview(body).nbytes
        try:
            wire.send_header(sock, request, nbody)
        except OSError as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        if request["op"] in ("put", "put_json"):
            self._reply(sock)  # "continue", or the reason the request is refused
            try:
                if nbody:
                    wire.send_body(sock, body)
            except OSError as error:
                raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        # a reply may wait for disk writes: a durable put for its bytes, flush and put_json for
        # every object not yet on disk
        if request["op"] in ("flush", "put_json"):
            sock.settimeout(self._timeout * 10)
        elif request.get("durable"):
            sock.settimeout(self._timeout + nbody / DISK_BYTES_PER_S)
        try:
            header, nreply = self._reply(sock)
        finally:
            sock.settimeout(self._timeout)
        out = into(header) if into is not None else None
        try:
            if out is None:
                data = wire.recv_exact(sock, nreply)
            else:
                if out.nbytes != nreply:
                    raise StoreError(
                        f"store {self.address}: sent {nreply} bytes for {out.nbytes}", "protocol"
                    )
                header["received"] = wire.recv_into(sock, wire.as_bytes(out), digest=True)
                data = out
        except OSError as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        return header, data

    def close(self) -> None:
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()

    # -- objects ----------------------------------------------------------------------------

    def put(
        self,
        path: str,
        array,
        *,
        box: Box | None = None,
        global_shape: Shape | None = None,
        durable: bool = False,
        _checksum: str | None = None,
    ) -> ObjectInfo:
        """Store ``array`` as the ``box`` of a global array of ``global_shape`` (default: the
        whole array). Atomic: readers see the old object or the new one, never a mix."""
        array = np.asarray(array, order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("="))
        path = wire.check_path(path)
        box = wire.full_box(array.shape) if box is None else wire.as_box(box)
        global_shape = (
            wire.box_shape(box) if global_shape is None else tuple(int(n) for n in global_shape)
        )
        wire.check_box(path, box, global_shape)
        if wire.box_shape(box) != array.shape:
            raise StoreError(
                f"the array's shape must be its box's extent; got shape {array.shape} for box "
                f"{box} at path {path!r}"
            )
        dtype = wire.dtype_of(array.dtype.name)
        data = wire.as_bytes(array)
        request = {
            "op": "put",
            "path": path,
            "box": [list(b) for b in box],
            "global_shape": list(global_shape),
            "dtype": dtype.name,
            "checksum": _checksum or wire.checksum(data),
            "durable": bool(durable),
        }
        header, _ = self._call(request, data)
        return ObjectInfo.from_json(header["info"])

    def get(self, path: str, box: Box | None = None) -> np.ndarray:
        """The ``box`` (global coordinates; None: the whole array) of the object at ``path``
        that contains it, as a new array. Raises ``StoreError`` (reason ``"not_found"``) when no
        object under ``path`` contains ``box``."""
        path = wire.check_path(path)
        box = None if box is None else wire.as_box(box)
        request = {
            "op": "get",
            "path": path,
            "box": None if box is None else [list(b) for b in box],
        }

        def into(header):
            info = ObjectInfo.from_json(header["info"])
            shape = wire.box_shape(wire.as_box(header["box"]))
            return np.empty(shape, wire.dtype_of(info.dtype))

        header, out = self._call(request, into=into)
        digest = header["received"]  # computed as the bytes arrived
        if digest != header["checksum"]:
            raise StoreError(
                f"store {self.address}: get of {path!r} box {box}: received bytes have checksum "
                f"{digest}, the store sent {header['checksum']}",
                "corrupt",
            )
        return out

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """Every array object whose path starts with ``prefix`` (plain string prefix)."""
        _, body = self._call({"op": "list", "prefix": str(prefix)})
        return [ObjectInfo.from_json(obj) for obj in json.loads(body)]

    def delete(self, prefix: str) -> int:
        """Remove the array and JSON objects whose path starts with ``prefix``; how many."""
        if not isinstance(prefix, str):
            raise StoreError(f"delete takes a path prefix string; got {prefix!r}")
        header, _ = self._call({"op": "delete", "prefix": prefix})
        return int(header["deleted"])

    def put_json(self, path: str, obj: Any, *, flush: bool = True) -> None:
        """Store a small JSON-able object durably and atomically (a commit marker, a manifest).

        With ``flush`` (the default) it is written only after every earlier put to this store has
        reached disk, so after a crash of the store the marker implies its objects. ``flush=False``
        skips that wait: enough while the store process lives (it outlives the workers), but a
        store restarted from disk may then hold the marker without some objects."""
        path = wire.check_path(path)
        data = json.dumps(obj).encode()
        if len(data) > wire.MAX_JSON_BYTES:
            raise StoreError(
                f"put_json objects are at most {wire.MAX_JSON_BYTES} bytes; {path!r} is "
                f"{len(data)} bytes"
            )
        self._call({"op": "put_json", "path": path, "flush": bool(flush)}, data)

    def get_json(self, path: str, default: Any = _MISSING) -> Any:
        """The JSON object at ``path``; ``default`` if given and there is none."""
        try:
            _, body = self._call({"op": "get_json", "path": wire.check_path(path)})
        except StoreError as error:
            if error.reason == "not_found" and default is not _MISSING:
                return default
            raise
        return json.loads(body)

    def list_json(self, prefix: str = "") -> list[str]:
        header, _ = self._call({"op": "list_json", "prefix": str(prefix)})
        return list(header["paths"])

    def flush(self) -> None:
        """Wait until every object put so far is on the store's disk."""
        self._call({"op": "flush"})

    def stats(self) -> dict:
        header, _ = self._call({"op": "stats"})
        return header["stats"]

    def ping(self) -> bool:
        """Whether the store answers a new connection's hello within the connect timeout."""
        try:
            self._connect().close()
        except StoreError:
            return False
        return True


class ReplicatedStore:
    """Stores on n hosts; host i's objects are also written to hosts i+1 .. i+k (mod n).

    ``put`` writes the copies in parallel (one thread per store), so replication costs about one
    write. ``get`` reads from the writer's host first, then its replicas, then the other stores;
    a store that does not answer within ``connect_timeout`` is skipped.
    """

    def __init__(
        self,
        addresses: Sequence[str],
        *,
        replicas: int = 1,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float = 2.0,
    ):
        addresses = list(addresses)
        if not addresses:
            raise StoreError("a ReplicatedStore needs at least one store address")
        if not 0 <= replicas < len(addresses):
            raise StoreError(
                f"replicas must be in [0, number of stores - 1]; got replicas={replicas} for "
                f"{len(addresses)} stores {addresses}"
            )
        self.addresses = addresses
        self.replicas = replicas
        self.clients = [
            StoreClient(a, token=token, timeout=timeout, connect_timeout=connect_timeout)
            for a in addresses
        ]
        self._pool = concurrent.futures.ThreadPoolExecutor(
            max_workers=len(addresses), thread_name_prefix="store-put"
        )

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def holders(self, host: int) -> list[int]:
        """The stores that hold host ``host``'s objects: itself, then its k successors."""
        n = len(self.clients)
        if not 0 <= host < n:
            raise StoreError(f"host must be in [0, {n}); got {host}")
        return [(host + i) % n for i in range(self.replicas + 1)]

    def put(
        self,
        host: int,
        path: str,
        array,
        *,
        box: Box | None = None,
        global_shape: Shape | None = None,
        durable: bool = False,
        min_copies: int | None = None,
    ) -> list[int]:
        """Write to stores ``host, host+1 .. host+k`` (mod n) in parallel; the stores written.

        Raises ``StoreError`` naming each failed store unless at least ``min_copies`` (default:
        all k+1) copies were written."""
        targets = self.holders(host)
        need = len(targets) if min_copies is None else min_copies
        array = np.asarray(array, order="C")
        digest = wire.checksum(wire.as_bytes(array))
        futures = {
            i: self._pool.submit(
                self.clients[i].put,
                path,
                array,
                box=box,
                global_shape=global_shape,
                durable=durable,
                _checksum=digest,
            )
            for i in targets
        }
        written, failed = [], []
        for i, future in futures.items():
            try:
                future.result()
                written.append(i)
            except StoreError as error:
                failed.append(f"store {i} ({self.addresses[i]}): {error}")
        if len(written) < need:
            raise StoreError(
                f"put of {path!r} box {box} from host {host} reached {len(written)} of "
                f"{len(targets)} stores (needed {need}): " + "; ".join(failed),
                "unavailable",
            )
        return written

    def get(self, path: str, box: Box | None = None, *, prefer: int) -> np.ndarray:
        """The sub-box from the first store that has it: ``prefer`` (the writer's host), its
        replicas, then the others. ``StoreError`` naming path, box and every store tried."""
        order = self.holders(prefer)
        order += [i for i in range(len(self.clients)) if i not in order]
        tried = []
        for i in order:
            try:
                return self.clients[i].get(path, box)
            except StoreError as error:
                tried.append(f"store {i} ({self.addresses[i]}): {error.reason}")
        raise StoreError(
            f"no store holds {path!r} box {None if box is None else wire.as_box(box)} (written "
            f"by host {prefer}, replicas on stores {self.holders(prefer)}); tried "
            + "; ".join(tried),
            "not_found",
        )

    def alive(self) -> list[bool]:
        """Whether each store answers, checked in parallel."""
        return list(self._pool.map(lambda c: c.ping(), self.clients))

    def list(self, prefix: str = "") -> list[list[ObjectInfo] | None]:
        """Each store's objects under ``prefix`` (None for a store that does not answer)."""
        return list(self._pool.map(lambda c: _or_none(c.list, prefix), self.clients))

    def delete(self, prefix: str) -> list[int | None]:
        """Delete ``prefix`` on every store that answers; the count per store (None: down)."""
        return list(self._pool.map(lambda c: _or_none(c.delete, prefix), self.clients))

    def put_json(
        self,
        path: str,
        obj: Any,
        *,
        stores: Sequence[int] | None = None,
        flush: bool = True,
    ) -> list[int]:
        """Write a JSON object to ``stores`` (default: all) in parallel (``StoreClient.put_json``
        says what ``flush`` means); the stores written. Raises ``StoreError`` when none was."""
        targets = range(len(self.clients)) if stores is None else stores
        futures = {
            i: self._pool.submit(self.clients[i].put_json, path, obj, flush=flush) for i in targets
        }
        written, failed = [], []
        for i, future in futures.items():
            try:
                future.result()
                written.append(i)
            except StoreError as error:
                failed.append(f"store {i} ({self.addresses[i]}): {error}")
        if not written:
            raise StoreError(f"put_json of {path!r} reached no store: " + "; ".join(failed),
                             "unavailable")  # fmt: skip
        return written

    def get_json(self, path: str, default: Any = _MISSING, *, prefer: int = 0) -> Any:
        """The JSON object at ``path`` from the first store that has it."""
        order = self.holders(prefer) + [
            i for i in range(len(self.clients)) if i not in self.holders(prefer)
        ]
        tried = []
        for i in order:
            try:
                return self.clients[i].get_json(path)
            except StoreError as error:
                tried.append(f"store {i} ({self.addresses[i]}): {error.reason}")
        if default is not _MISSING:
            return default
        raise StoreError(f"no store holds JSON {path!r}; tried " + "; ".join(tried), "not_found")

    def flush(self) -> None:
        for _ in self._pool.map(lambda c: c.flush(), self.clients):
            pass

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for client in self.clients:
            client.close()


def _or_none(fn, *args):
    try:
        return fn(*args)
    except StoreError:
        return None


class StoreProcess:
    """A store server subprocess: ``StoreProcess.start(dir)`` waits until it listens.

    ``address`` is its "host:port" (``unix_address`` its "unix:PATH" when started with
    ``unix_socket``); ``pid`` and ``popen`` identify the child; ``stop()`` sends
    SIGTERM (the server writes what is only in memory to disk) and waits; ``kill()`` SIGKILLs.
    """

    def __init__(
        self,
        popen: subprocess.Popen,
        address: str,
        directory: pathlib.Path,
        unix_address: str | None = None,
    ):
        self.popen, self.address, self.dir = popen, address, directory
        self.unix_address = unix_address

    @property
    def pid(self) -> int:
        return self.popen.pid

    @classmethod
    def start(
        cls,
        directory,
        *,
        host: str = "127.0.0.1",
        port: int = 0,
        memory_bytes: int | None = None,
        max_body_bytes: int | None = None,
        token_file=None,
        unix_socket=None,
        timeout: float = 60.0,
        stderr=None,
    ) -> StoreProcess:
        directory = pathlib.Path(directory)
        directory.mkdir(parents=True, exist_ok=True)
        ready = directory.parent / f".{directory.name}.ready.{os.getpid()}.{time.monotonic_ns()}"
        ready.unlink(missing_ok=True)
        cmd = [sys.executable, "-m", "tenplex_jax.store", "--dir", str(directory),
               "--host", host, "--port", str(port), "--ready-file", str(ready)]  # fmt: skip
        if memory_bytes is not None:
            cmd += ["--memory-bytes", str(memory_bytes)]
        if max_body_bytes is not None:
            cmd += ["--max-body-bytes", str(max_body_bytes)]
        if token_file is not None:
            cmd += ["--token-file", str(token_file)]
        if unix_socket is not None:
            cmd += ["--unix-socket", str(unix_socket)]
        # the server runs the same tenplex_jax as this process, wherever the caller's cwd is
        root = str(pathlib.Path(__file__).resolve().parents[2])
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        popen = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stderr=stderr, env=env)
        deadline = time.monotonic() + timeout
        try:
            while not ready.exists():
                if popen.poll() is not None:
                    raise StoreError(
                        f"the store server for {directory} exited with {popen.returncode} "
                        f"before listening: {' '.join(cmd)}"
                    )
                if time.monotonic() > deadline:
                    raise StoreError(f"the store server for {directory} did not listen in "
                                     f"{timeout} s: {' '.join(cmd)}")  # fmt: skip
                time.sleep(0.02)
            address = ready.read_text().strip()
        except BaseException:
            popen.kill()
            popen.wait()
            raise
        finally:
            ready.unlink(missing_ok=True)
        unix_address = None if unix_socket is None else f"unix:{unix_socket}"
        return cls(popen, address, directory, unix_address)

    def stop(self, timeout: float = 30.0) -> int:
        """SIGTERM, then wait (SIGKILL after ``timeout``); the exit code."""
        if self.popen.poll() is None:
            self.popen.terminate()
            try:
                return self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                pass
        return self.kill()

    def kill(self) -> int:
        if self.popen.poll() is None:
            self.popen.kill()
        return self.popen.wait()
