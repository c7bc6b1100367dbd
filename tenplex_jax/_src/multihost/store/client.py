"""``StoreClient``: one store server's objects, over pooled connections (TCP or a Unix socket)."""

from __future__ import annotations

import contextlib
import itertools
import json
import os
import socket
import threading
import time
from collections.abc import Mapping, Sequence
from typing import Any, NamedTuple, Self

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src.box import Box, Shape
from tenplex_jax._src.errors import StoreError, StoreProtocolError
from tenplex_jax._src.multihost.store import shared as segments
from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.wire import ObjectInfo

_MISSING = object()
_BROKEN = ("unavailable", "protocol")  # reasons after which a connection is not reused
_RETRIED = (*_BROKEN, "busy")  # reasons a request is tried again within ``retry_seconds``
SHARED_TRIES = 3  # a shared read whose version was replaced meanwhile asks again this often;
# a client whose shared reads could not open their segment this many times in a row reads over
# the connection from then on (the store is on another host)
DISK_BYTES_PER_S = 50e6  # the slowest disk a durable put waits for, for its reply timeout


class CAS(NamedTuple):
    """A ``cas_json`` reply: whether it swapped, and the object at the path now (None: none),
    with its version and the store's clock (seconds)."""

    swapped: bool
    version: int | None
    value: Any
    time: float


class Swap(NamedTuple):
    """A JSON object's compare-and-swap that a :meth:`StoreClient.stage` makes once its update
    passed the check (a parameter server's commit, in the stage's request): ``obj`` stored at
    ``path`` if the object there is version ``expect`` (None: there is none) and the array
    checked holds at least ``basis`` (name -> clock: the pushes the check took as added)."""

    path: str
    obj: dict
    expect: int | None
    basis: Mapping[str, int]


class Staged(NamedTuple):
    """A :meth:`StoreClient.stage` reply: the update's record, the record of the array it will
    be added into (its clocks say which pushes beside it holds already), and the outcome of
    the stage's :class:`Swap` (None without one)."""

    update: ObjectInfo
    into: ObjectInfo
    swap: CAS | None


def _new_rids() -> None:
    """Request ids: 16 random hex digits of this process and a count (a uuid4 per request costs
    more than the rest of a small request's Python); drawn again in a forked child, so that no
    two processes send the same id."""
    global _RID_PREFIX, _RIDS
    _RID_PREFIX, _RIDS = os.urandom(8).hex(), itertools.count()


_new_rids()
os.register_at_fork(after_in_child=_new_rids)


def parse_address(address: str) -> tuple[str, int]:
    """The host and port of a TCP store address.

    >>> parse_address("127.0.0.1:5000"), parse_address("[::1]:5000")
    (('127.0.0.1', 5000), ('::1', 5000))

    Args:
      address: ``"host:port"``, an IPv6 host in brackets.

    Returns:
      ``(host, port)``.

    Raises:
      StoreError: the address is a Unix socket's (``"unix:PATH"``) or not ``host:port``.
    """
    if address.startswith("unix:"):
        raise StoreError(f"{address!r} is a Unix socket address, not host:port")
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit():
        raise StoreError(f'a store address is "host:port"; got {address!r}')
    return host.strip("[]"), int(port)


class StoreClient:
    """A connection to one store server. Thread-safe: each call takes a pooled connection.

    A context manager (leaving it closes the pool). Every failure raises ``StoreError`` with a
    ``reason``.

    **Safe to repeat.** Each call carries a request id (``rid``) that every reply echoes, the
    same for every try of the call; the store answers a repeated id of a request it has done with
    that request's outcome instead of doing it again. So a request whose reply was lost, delayed
    past the timeout or duplicated is tried again on a new connection without being applied
    twice: once when a pooled connection the server has since closed breaks, and for up to
    ``retry_seconds`` (a store restarting on the same address) otherwise. Example::

        with StoreClient(proc.address) as store:
            store.put("v1/w", w_shard, box=((0, 4), (0, 8)), global_shape=(8, 8))
            store.get("v1/w", ((2, 4), (0, 8)))          # == w_shard[2:4]: only those bytes travel

    Args:
      address: the server's ``"host:port"`` or ``"unix:PATH"``.
      token: the secret the server was started with (``--token-file``), if any.
      timeout: seconds any socket operation may take (replies that wait for disk get more).
      connect_timeout: seconds opening a connection and its hello may take (default:
        ``timeout``), so a dead store is given up on quickly.
      retry_seconds: how long a request whose connection broke, or that the store was too busy
        to take, is tried again (backing off from 50 ms to 1 s); 0: once, and only on a broken
        pooled connection.
      shared: read whole arrays (``get`` without a box) through shared memory when the store
        is on this host (:mod:`~tenplex_jax._src.multihost.store.shared`): the record over the
        connection, the bytes copied out of a mapping this client keeps and checked against
        the record's checksum; over the connection when the store is elsewhere, for anything
        the store will not share, and for a segment changed or cut short in place.

    Attributes:
      shared_reads: the reads served through shared memory so far.

    Raises:
      StoreError: the address is not ``host:port`` or ``unix:PATH``.
    """

    def __init__(
        self,
        address: str,
        *,
        token: str | None = None,
        timeout: float = 30.0,
        connect_timeout: float | None = None,
        retry_seconds: float = 0.0,
        shared: bool = False,
    ):
        self.address = address
        self._retry = float(retry_seconds)
        self._unix = address[len("unix:") :] if address.startswith("unix:") else None
        self._host, self._port = (None, None) if self._unix else parse_address(address)
        self._token = token
        self._timeout = timeout
        self._connect_timeout = timeout if connect_timeout is None else connect_timeout
        self._idle: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        self._reader = segments.Reader() if shared else None
        self._segment_of: dict[str, str] = {}  # path -> the segment file the store last named
        # path -> (that file, the store's epoch, the array's dtype and shape): what peek reads
        self._peekable: dict[str, tuple[str, int, np.dtype, tuple[int, ...]]] = {}
        self.shared_reads = 0
        self._unopened = 0  # shared reads in a row whose segment could not be opened here

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
            raise StoreError(
                f"cannot reach the store at {self.address}: {error}", "unavailable"
            ) from None
        try:
            if self._unix is None:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            # the hello exchange is part of connecting: a store that accepts but does not answer
            # (stopped, overloaded) is given up on within the connect timeout too
            sock.settimeout(self._connect_timeout)
            # a failed send: the reply says why (a store over its connection cap answers and closes)
            with contextlib.suppress(OSError):
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
        if sock.fileno() < 0:  # closed
            return
        with self._lock:
            if not self._closed:
                self._idle.append(sock)
                return
        sock.close()

    def _reply(self, sock: socket.socket, rid: str | None = None) -> tuple[dict, int]:
        """The next response header (raises StoreError for an error reply) and its body size;
        a reply to another request than ``rid`` (stale or repeated) is a broken connection."""
        try:
            prefix = wire.recv_prefix(sock)
            if prefix is None:
                raise ConnectionError("the store closed the connection")
            header = wire.recv_header(sock, prefix[0], wire.MAX_RESPONSE_HEADER_BYTES)
        except (OSError, StoreProtocolError) as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        if rid is not None and header.get("rid") != rid:
            raise StoreError(
                f"store {self.address}: a reply to request {str(header.get('rid'))!r:.40} "
                f"arrived for request {rid!r}; the connection is out of step",
                "protocol",
            )
        if not header.get("ok"):
            reason = header.get("reason", "refused")
            raise StoreError(f"store {self.address}: {header.get('error')}", reason)
        return header, prefix[1]

    def _call(self, request: dict, body=None, into=None) -> tuple[dict, Any]:
        """One request → (reply header, reply body). ``body`` follows a "continue" reply;
        ``into(header, body bytes)`` returns a writable array for the reply body (no copy), having
        checked the sizes the server announced (raising ``StoreError``). Every try carries the
        same request id: the store does a request once, however often it arrives."""
        request = {**request, "rid": f"{_RID_PREFIX}{next(_RIDS):016x}"}
        give_up, pause, first = time.monotonic() + self._retry, 0.05, True
        while True:
            sock, reused = None, False
            try:
                sock, reused = self._checkout()
                result = self._exchange(sock, request, body, into)
            except StoreError as error:
                if sock is not None and error.reason in _BROKEN:
                    sock.close()
                elif sock is not None:  # an error reply: the connection is in a known state
                    self._checkin(sock)
                # a pooled connection the server has since closed (idle timeout, restart) is
                # tried again at once; within ``retry_seconds``, any broken or busy try
                if reused and first and error.reason in _BROKEN:
                    first = False
                    continue
                if error.reason not in _RETRIED or time.monotonic() + pause > give_up:
                    raise
                first = False
                time.sleep(pause)
                pause = min(2 * pause, 1.0)
                continue
            except BaseException:
                if sock is not None:
                    sock.close()  # its state is unknown: never reuse it
                raise
            self._checkin(sock)
            return result

    def _exchange(self, sock, request: dict, body, into) -> tuple[dict, Any]:
        """Send ``request`` (and ``body`` once the store says continue) on ``sock``; the reply
        header and body (see :meth:`_call`)."""
        parts = [] if body is None else body if isinstance(body, list) else [body]
        nbody, rid = sum(memoryview(part).nbytes for part in parts), request["rid"]
        try:
            wire.send_header(sock, request, nbody)
        except OSError as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        if request["op"] in ("put", "put_json", "cas_json"):
            # "continue"; the reason the request is refused; or, when the store has done this
            # request already (a lost reply tried again), its outcome: then no body is sent.
            # An eager request sends its body at once (the store closes the connection if it
            # refuses it unread)
            if not request.get("eager"):
                header, nreply = self._reply(sock, rid)
                if not header.get("continue"):
                    return header, wire.recv_exact(sock, nreply) if nreply else b""
            try:
                if request["op"] == "put" and request.get("checksum") is None:
                    digest = wire.send_body(sock, body, digest=True)
                    wire.send_frame(sock, {"checksum": digest})  # the trailer
                elif nbody:
                    wire.send_body(sock, body)
            except OSError as error:
                if request.get("eager"):  # refused unread: the refusal may be waiting
                    self._refusal(sock, rid)
                raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error
        # a reply may wait for disk writes: a durable put for its bytes, flush and put_json for
        # every object not yet on disk
        if request["op"] in ("flush", "put_json"):
            sock.settimeout(self._timeout * 10)
        elif request.get("wait"):  # a get_json waiting for a newer version
            sock.settimeout(self._timeout + request["wait"])
        elif request.get("durable"):
            sock.settimeout(self._timeout + nbody / DISK_BYTES_PER_S)
        try:
            header, nreply = self._reply(sock, rid)
        except StoreError:
            if request.get("eager"):  # the store may close it: its body may be unread
                sock.close()
            else:
                sock.settimeout(self._timeout)
            raise
        sock.settimeout(self._timeout)
        return header, self._reply_body(sock, request, header, nreply, into)

    def _refusal(self, sock: socket.socket, rid: str) -> None:
        """Raise the error reply a store sent before closing the connection on an eager request
        it refused unread (the body's send then fails: a broken pipe or a reset); return if no
        refusal came."""
        sock.settimeout(min(self._timeout, 5.0))
        try:
            self._reply(sock, rid)
        except StoreError as error:
            if error.reason not in _BROKEN:
                sock.close()
                raise
        finally:
            if sock.fileno() >= 0:
                sock.settimeout(self._timeout)

    def _reply_body(self, sock, request: dict, header: dict, nreply: int, into):
        """The reply's body of ``nreply`` bytes: into the array ``into`` gives (its checksum as
        received in ``header["received"]``), else new bytes. The sizes the server claims are
        checked before a byte is allocated for them."""
        try:
            if into is not None:
                out = into(header, nreply)
            elif nreply > wire.MAX_REPLY_BODY_BYTES:
                raise StoreError(
                    f"a {request['op']!r} reply body is at most "
                    f"{wire.MAX_REPLY_BODY_BYTES} bytes; the store announced "
                    f"{nreply}",
                    "protocol",
                )
        except (StoreError, MemoryError, ValueError) as error:
            sock.close()  # the reply's body is unread: the connection cannot be reused
            if not isinstance(error, StoreError):  # NumPy: no memory, or an impossible size
                raise StoreError(
                    f"store {self.address}: no memory for the reply of {nreply} bytes", "too_large"
                ) from None
            # the caller's own mistake (an ``out`` that does not fit) is not tried again
            reason = "invalid" if error.reason == "invalid" else "protocol"
            raise StoreError(f"store {self.address}: {error}", reason) from None
        except BaseException:
            sock.close()
            raise
        try:
            if into is None:
                return wire.recv_exact(sock, nreply)
            header["received"] = wire.recv_into(sock, wire.as_bytes(out), digest=True)
            if header.get("checksum") is None:  # streamed from the store's disk: a trailer
                header["checksum"] = self._reply(sock, request["rid"])[0].get("checksum")
            return out
        except OSError as error:
            raise StoreError(f"store {self.address}: {error!r}", "unavailable") from error

    def close(self) -> None:
        """Close the pooled connections; a later call raises ``StoreError`` (``"closed"``)."""
        with self._lock:
            self._closed = True
            idle, self._idle = self._idle, []
        for sock in idle:
            sock.close()
        if self._reader is not None:
            self._reader.close()

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
        """Store an array as a box of a global array, replacing any object at ``path``.

        Atomic: readers see the old object or the new one, never a mix. The bytes are
        checksummed as they are sent, and the server checks them before it acknowledges.

        Args:
          path: the object's path (``"v3/model/w"``).
          array: the array; its shape is the box's extent.
          box: the block of the global array it covers (default: the whole array).
          global_shape: the global array's shape (default: the box's extent; needed when the box
            does not start at the origin).
          durable: acknowledge only once the object's file is on disk (default: from the memory
            tier).

        Returns:
          The stored object's :class:`ObjectInfo`.

        Raises:
          StoreError: a bad path, box, shape or dtype (``"invalid"``, nothing sent), or the store
            refused or failed the request (its ``reason``: ``"too_large"``, ``"corrupt"``,
            ``"unavailable"``, ...).
        """
        array = np.asarray(array, order="C")
        if array.dtype.byteorder == ">":
            array = array.astype(array.dtype.newbyteorder("="))
        request = _put_request(wire.check_path(path), array.shape, array.dtype, box, global_shape)
        request |= {"checksum": _checksum, "durable": bool(durable)}  # None: in a trailer
        header, _ = self._call(request, wire.as_bytes(array))
        return ObjectInfo.from_json(header["info"])

    def stage(
        self,
        path: str,
        array,
        *,
        into: str,
        name: str,
        beside: Sequence[tuple[str, int, str]] = (),
        sync: bool = True,
        swap: Swap | None = None,
    ) -> Staged:
        """Put an update its pusher will add into the array at ``into`` (a parameter server's
        stage), and check it there, in one request: the update is written through to its file
        (a kill of the store keeps it; fsynced before the reply if ``sync``, else behind it),
        then checked as ``accumulate(into, path, check=True, beside=beside)`` checks; then, with
        ``swap``, a JSON object swapped as :meth:`cas_json` swaps it, only if the check passed
        and ``into`` holds ``swap.basis`` (a parameter server commits a wave there: one request
        for stage, check and commit).

        Args:
          path: the update's path.
          array: the update, of ``into``'s shape and dtype; or a sequence of arrays of one
            dtype, the runs of a 1-D update laid end to end (sent one after another: a
            parameter server's piece spans leaves, and is never gathered into one buffer).
          into: the array it will be added into.
          name: the pusher's name.
          beside: ``(name, clock, stage)`` of other pushes that will be added into ``into``
            too (see :meth:`accumulate`).
          sync: fsync the update, and the swapped object, before the reply.
          swap: the compare-and-swap to make after the check (its object at most
            ``MAX_SWAP_BYTES`` as JSON).

        Returns:
          A :class:`Staged`: the update's :class:`ObjectInfo`, ``into``'s, and the swap's
          :class:`CAS` (with the object now when it did not swap and that object is at most
          ``MAX_SWAP_BYTES``, else None; version None when ``into`` lacked the basis).

        Raises:
          StoreError: the sum could be non-finite (``"nonfinite"``: then the update is not
            kept, and nothing swapped), the arrays do not match (``"refused"``), ``into`` is
            missing (``"not_found"``), the swap's object is too large, or the store failed the
            request.
        """
        if isinstance(array, np.ndarray):
            runs = [np.asarray(array, order="C")]
            shape = runs[0].shape
        else:
            runs = [np.ascontiguousarray(run).reshape(-1) for run in array]
            shape = (sum(run.size for run in runs),)
        dtypes = sorted(dtype.name for dtype in {run.dtype for run in runs})
        if len(dtypes) != 1:
            raise StoreError(f"stage of {path!r}: its runs are of one dtype; got {dtypes}")
        runs = [np.asarray(run, run.dtype.newbyteorder("=")) for run in runs]  # native order
        request = _put_request(wire.check_path(path), shape, runs[0].dtype, None, None)
        # its checksum in a trailer; sent at once (a stage is refused rarely: no "continue")
        request |= {"checksum": None, "durable": True, "sync": bool(sync), "eager": True}
        request["check"] = {
            "into": wire.check_path(into),
            "name": wire.check_name(name),
            "beside": [[wire.check_name(n), int(c), wire.check_path(s)] for n, c, s in beside],
        }
        if swap is not None:
            request["swap"] = _swap_request(path, swap)
        header, _ = self._call(request, [wire.as_bytes(run) for run in runs])
        staged, held = ObjectInfo.from_json(header["info"]), ObjectInfo.from_json(header["into"])
        if swap is None:
            return Staged(staged, held, None)
        reply = header["swap"]
        if reply["swapped"]:
            cas = CAS(True, int(reply["version"]), swap.obj, float(reply["time"]))
        else:
            value = reply.get("value")
            value = None if value is None else json.loads(value)
            cas = CAS(False, reply.get("version"), value, float(reply["time"]))
        return Staged(staged, held, cas)

    def get(
        self,
        path: str,
        box: Box | None = None,
        *,
        with_info: bool = False,
        out: np.ndarray | None = None,
    ):
        """Read a box of a stored object: only its bytes travel, checksummed on arrival.

        Args:
          path: the object's path.
          box: the block to read, in global coordinates, inside the object's box (``None``: the
            whole object).
          with_info: also return the object's :class:`ObjectInfo` (its ``clocks`` among them).
          out: a C-contiguous array of the box's shape and the object's dtype to receive the
            bytes into (a view of a larger array: no allocation, no copy); its contents are
            unspecified when the read fails.

        Returns:
          The box as a new array (or ``out``), or ``(array, ObjectInfo)`` with ``with_info``.

        Raises:
          StoreError: no object at ``path`` contains ``box`` (``"not_found"``), the bytes
            arrived damaged (``"corrupt"``), or the store failed the request.
        """
        path = wire.check_path(path)
        box = None if box is None else wire.as_box(box)
        if self._reader is not None and box is None:  # through shared memory, if it can be
            got = self._get_shared(path, out)
            if got is not None:
                return got if with_info else got[0]
        request = {
            "op": "get",
            "path": path,
            "box": None if box is None else [list(b) for b in box],
        }
        into = lambda header, nreply: _get_into(header, nreply, path, box, out)
        header, out = self._call(request, into=into)
        digest = header["received"]  # computed as the bytes arrived
        if digest != header["checksum"]:
            raise StoreError(
                f"store {self.address}: get of {path!r} box {box}: received bytes have checksum "
                f"{digest}, the store sent {header['checksum']}",
                "corrupt",
            )
        return (out, ObjectInfo.from_json(header["info"])) if with_info else out

    def peek(self, path: str, out: np.ndarray) -> tuple[tuple[str, int], ...] | None:
        """Copy the whole array at ``path`` into ``out`` from the segment the store last named
        for it (a client on the store's host, ``shared=True``), with no request: the clocks of
        the version copied (``ObjectInfo.clocks``), which the caller checks; None when it must
        ask (:meth:`get`): no segment known yet, ``out`` not of the array's shape and dtype, or
        the segment holds no whole version of that store now. The version is the newest the
        store has, or one it replaced a moment ago: never torn, never another array's."""
        known, reader = self._peekable.get(path), self._reader
        if known is None or reader is None:
            return None
        file, epoch, dtype, shape = known
        if out.shape != shape or out.dtype != dtype or not out.flags.c_contiguous:
            return None
        held = reader.current(file, epoch, out)
        if held is None:
            return None
        try:
            clocks = wire.as_clocks(json.loads(held[2]))
        except (ValueError, StoreError):
            return None
        self.shared_reads += 1
        return clocks

    def _get_shared(
        self, path: str, out: np.ndarray | None
    ) -> tuple[np.ndarray, ObjectInfo] | None:
        """The whole array at ``path`` read through its segment, or None: read it over the
        connection (the store does not share it, or the segment cannot be read here)."""
        reader = self._reader
        for _ in range(SHARED_TRIES):
            try:
                header, _ = self._call({"op": "get_shared", "path": path})
            except StoreError as error:
                if error.reason in ("refused", "too_large"):  # not whole, full, no shared memory
                    return None
                raise
            try:
                info = ObjectInfo.from_json(header.get("info"))
                file, epoch, seq = header.get("segment"), header.get("epoch"), header.get("seq")
                digest = header.get("digest")
                if (
                    info.path != path
                    or not (isinstance(file, str) and isinstance(digest, str))
                    or not (wire._is_int(seq) and wire._is_int(epoch))
                ):
                    raise StoreError(f"{file!r}, {epoch!r}, {seq!r}, {digest!r}", "protocol")
                dtype = wire.dtype_of(info.dtype)
            except StoreError as error:
                raise StoreError(f"get_shared of {path!r}: {error}", "protocol") from None
            into = _receiver(out, path, info.box, dtype)
            before = self._segment_of.get(path)
            if before is not None and before != file:
                reader.forget(before)
            self._segment_of[path] = file
            self._peekable[path] = (file, epoch, dtype, boxes.shape(info.box))
            read = reader.read(file, epoch, seq, digest, into)
            if read is None:  # not on this host, or gone meanwhile: over the socket
                self._unopened += 1
                if self._unopened >= SHARED_TRIES:  # never opened here: stop asking
                    self._reader = None
                return None
            self._unopened = 0
            if read:
                self.shared_reads += 1
                return into, info
        return None  # replaced under every try: over the connection

    def accumulate(
        self,
        path: str,
        stage: str,
        *,
        name: str,
        clock: int,
        update: str | None = None,
        consume: bool = False,
        check: bool = False,
        keep: str | None = None,
        beside: Sequence[tuple[str, int, str]] = (),
    ) -> tuple[ObjectInfo, bool]:
        """Add the float array stored at ``stage`` into the one at ``path``, on the store, once.

        The store counts each pusher's accumulates into the array (its ``clocks``) and keeps
        the checksum of each one's last update (its ``sources``): push ``clock`` of ``name`` is
        applied when it is the next one, refused when out of turn, and when it is in already,
        ``applied`` says whether the update in is ``update`` (a try of this same push: its
        reply was lost). An update holding NaN or Inf, or whose sum overflows, is refused and
        the array is left as it was. The parameter server's updates use it.

        Args:
          path: the array to add into.
          stage: the array to add, of the same shape.
          name: the pusher's name (a virtual worker's).
          clock: the pusher's push number, from 0.
          update: the stage's checksum (its ``put`` returned it), to tell this push from
            another one of the same name and clock.
          consume: remove the stage once the sum is on the store's disk (until then the stage
            is what a restarted store adds again). Without it the sum is acknowledged from the
            memory tier, as a put is: a store SIGKILLed before its write-back loses it, as it
            loses a put made without ``durable``. Sums that must survive a kill consume their
            stage (the parameter server's do).
          check: only check that the sum would be finite now (whatever the clocks); change
            nothing.
          beside: with ``check``: ``(name, clock, stage)`` of other pushes that will be added
            into the array too; those it does not hold yet count, and the check refuses an
            update when adding them all, in any order, could overflow.
          keep: keep the array's version before the sum at this path, so that :meth:`revert`
            can put it back.

        Returns:
          ``(info, applied)``: the array's :class:`ObjectInfo` after the call, and whether this
          update is in it as that push.

        Raises:
          StoreError: the push is out of turn (``"refused"``), it is not finite
            (``"nonfinite"``), an object is missing (``"not_found"``), or the store failed the
            request.
        """
        request = {
            "op": "accumulate",
            "path": wire.check_path(path),
            "stage": wire.check_path(stage),
            "name": wire.check_name(name),
            "clock": int(clock),
            "update": update,
            "consume": bool(consume),
            "check": bool(check),
            "keep": None if keep is None else wire.check_path(keep),
        }
        if beside:
            request["beside"] = [
                [wire.check_name(n), int(c), wire.check_path(s)] for n, c, s in beside
            ]
        header, _ = self._call(request)
        return ObjectInfo.from_json(header["info"]), bool(header["applied"])

    def revert(
        self, path: str, kept: str, *, name: str, clock: int, check: bool = False
    ) -> ObjectInfo:
        """Undo the last accumulate into ``path``: put back the version it kept at ``kept``.

        The array's clocks stay as they are (the push counts as made, its update undone).

        Args:
          path: the accumulated array.
          kept: where the accumulate kept the version before it (its ``keep``).
          name: the pusher of that accumulate.
          clock: its push number.
          check: only check that it can be undone.

        Returns:
          The array's :class:`ObjectInfo` after the call.

        Raises:
          StoreError: that push is not the last update into ``path`` (``"refused"``), an
            object is missing (``"not_found"``), or the store failed the request.
        """
        request = {
            "op": "revert",
            "path": wire.check_path(path),
            "kept": wire.check_path(kept),
            "name": wire.check_name(name),
            "clock": int(clock),
            "check": bool(check),
        }
        header, _ = self._call(request)
        return ObjectInfo.from_json(header["info"])

    def list(self, prefix: str = "") -> list[ObjectInfo]:
        """The array objects under a prefix.

        Args:
          prefix: a plain string prefix of paths (``""``: every object).

        Returns:
          Their :class:`ObjectInfo` records.

        Raises:
          StoreError: the store failed the request.
        """
        _, body = self._call({"op": "list", "prefix": str(prefix)})
        listing = self._decode(body, "list")
        if not isinstance(listing, list):
            raise StoreError(f"store {self.address}: a listing is a JSON list", "protocol")
        return [ObjectInfo.from_json(obj) for obj in listing]

    def _checked_json(self, path: str, header: dict, body, what: str) -> Any:
        """A JSON reply's object, its bytes checked against the checksum the store sent."""
        if wire.checksum(body) != header.get("checksum"):
            raise StoreError(
                f"store {self.address}: {what} of {path!r}: received bytes have checksum "
                f"{wire.checksum(body)}, the store sent {header.get('checksum')}",
                "corrupt",
            )
        return self._decode(body, what)

    def _decode(self, body, what: str) -> Any:
        try:
            return json.loads(body)
        except (ValueError, RecursionError) as error:
            raise StoreError(
                f"store {self.address}: the {what} reply is not JSON: {error!r:.200}", "protocol"
            ) from None

    def delete(self, prefix: str) -> int:
        """Remove the array and JSON objects under a prefix.

        Args:
          prefix: a plain string prefix of paths.

        Returns:
          How many objects were removed.

        Raises:
          StoreError: ``prefix`` is not a string, or the store failed the request.
        """
        if not isinstance(prefix, str):
            raise StoreError(f"delete takes a path prefix string; got {prefix!r}")
        header, _ = self._call({"op": "delete", "prefix": prefix})
        return int(header["deleted"])

    def put_json(self, path: str, obj: Any, *, flush: bool = True) -> None:
        """Store a small JSON object durably and atomically (a commit marker, a manifest).

        Args:
          path: the object's path.
          obj: a plain JSON object (a dict; no NaN), at most the wire's JSON size limit.
          flush: write it only after every earlier put to this store has reached disk, so after
            a crash of the store the marker implies its objects. ``False`` skips that wait:
            enough while the store process lives (it outlives the workers), but a store
            restarted from disk may then hold the marker without some objects.

        Raises:
          StoreError: ``obj`` is not a plain JSON object or too large (``"invalid"``), or the
            store failed the request.
        """
        path = wire.check_path(path)
        data = self._json_bytes(path, obj, "put_json")
        request = {
            "op": "put_json",
            "path": path,
            "flush": bool(flush),
            "checksum": wire.checksum(data),
        }
        self._call(request, data)

    def get_json(
        self,
        path: str,
        default: Any = _MISSING,
        *,
        versioned: bool = False,
        newer_than: int | None = None,
        wait: float = 0.0,
    ) -> Any:
        """Read a JSON object; or wait for another version of it, then read it (a blocking watch
        instead of polling: the store answers when the object is written).

        Args:
          path: the object's path.
          default: returned when there is none (without it, that raises).
          versioned: also return the object's version and the store's clock.
          newer_than: a version of the object: first wait until the object is another one
            (written since, or deleted), for at most ``wait`` seconds.
          wait: the longest wait, seconds (the store waits 30 s at most); after it, the object
            is read as it is (the same version).

        Returns:
          The object, or with ``versioned`` ``(object, its version, the store's clock in
          seconds)``: the version is what :meth:`cas_json` expects (``(default, None, None)``
          when absent).

        Raises:
          StoreError: there is no object and no ``default`` (``"not_found"``), the bytes arrived
            damaged (``"corrupt"``), or the store failed the request.
        """
        request = {"op": "get_json", "path": wire.check_path(path)}
        if newer_than is not None:
            request |= {"newer_than": int(newer_than), "wait": max(0.0, float(wait))}
        try:
            header, body = self._call(request)
        except StoreError as error:
            if error.reason == "not_found" and default is not _MISSING:
                return (default, None, None) if versioned else default
            raise
        obj = self._checked_json(path, header, body, "get_json")
        return (obj, int(header["version"]), float(header["time"])) if versioned else obj

    def cas_json(self, path: str, obj: Any, *, expect: int | None, sync: bool = True) -> CAS:
        """Compare-and-swap a JSON object: store ``obj`` only if the object there is the version
        expected, atomically. Versions count up for ever (a path deleted and written again
        does not repeat one), so a writer holding an old version never wins.

        Args:
          path: the object's path.
          obj: the new object (a plain JSON object: a dict).
          expect: the version expected there (from ``get_json(..., versioned=True)`` or an
            earlier reply); ``None``: only if there is none.
          sync: the reply waits for the object's file to be fsynced (a crash of the machine
            keeps it); False: it is written to its file before the reply, fsynced behind it
            (a kill of the store keeps it).

        Returns:
          A ``CAS`` named tuple ``(swapped, version, value, time)``: whether it swapped, and the
          object there now (``obj`` when it swapped) with its version and the store's clock, to
          retry from.

        Raises:
          StoreError: ``obj`` is not a plain JSON object or too large, the reply arrived damaged
            (``"corrupt"``), or the store failed the request.
        """
        path = wire.check_path(path)
        data = self._json_bytes(path, obj, "cas_json")
        if expect is not None and (not wire._is_int(expect) or expect < 0):
            raise StoreError(f"cas_json of {path!r}: expect is a version (an int) or None")
        request = {
            "op": "cas_json",
            "path": path,
            "expect": None if expect is None else int(expect),
            "checksum": wire.checksum(data),
            "sync": bool(sync),
            "eager": True,  # a small body: sent at once, no "continue"
        }
        header, body = self._call(request, data)
        version = header.get("version")
        if header.get("swapped"):  # the object there now is ``obj``: the reply does not echo it
            return CAS(True, int(version), obj, float(header["time"]))
        if version is None:
            return CAS(False, None, None, float(header["time"]))
        value = self._checked_json(path, header, body, "cas_json")
        return CAS(False, int(version), value, float(header["time"]))

    @staticmethod
    def _json_bytes(path: str, obj: Any, what: str) -> bytes:
        if not isinstance(obj, dict):
            raise StoreError(
                f"{what} of {path!r}: the store keeps JSON objects (dicts); got "
                f"{type(obj).__name__}"
            )
        try:
            data = json.dumps(obj, allow_nan=False).encode()
        except (TypeError, ValueError) as error:
            raise StoreError(f"{what} of {path!r}: not plain JSON: {error}") from error
        if len(data) > wire.MAX_JSON_BYTES:
            raise StoreError(
                f"{what} objects are at most {wire.MAX_JSON_BYTES} bytes; {path!r} is "
                f"{len(data)} bytes"
            )
        return data

    def list_json(self, prefix: str = "") -> list[str]:
        """The paths of the JSON objects under a prefix.

        Args:
          prefix: a plain string prefix of paths (``""``: every JSON object).

        Returns:
          Their paths.

        Raises:
          StoreError: the store failed the request.
        """
        header, _ = self._call({"op": "list_json", "prefix": str(prefix)})
        return list(header["paths"])

    def flush(self) -> None:
        """Wait until every object put so far is on the store's disk.

        Raises:
          StoreError: the store failed the request.
        """
        self._call({"op": "flush"})

    def stats(self) -> dict:
        """The server's counters: objects, memory tier bytes and objects, objects not yet on
        disk, JSON objects, its pid, transfers under way and connections.

        Raises:
          StoreError: the store failed the request.
        """
        header, _ = self._call({"op": "stats"})
        return header["stats"]

    def ping(self) -> bool:
        """Whether the store answers a new connection's hello within the connect timeout
        (``False`` where the other calls raise ``StoreError``)."""
        try:
            self._connect().close()
        except StoreError:
            return False
        return True


def _receiver(out: np.ndarray | None, path: str, box: Box, dtype: np.dtype) -> np.ndarray:
    """Where a get of ``box`` of ``path`` receives its bytes: ``out`` once checked, else a new
    array."""
    if out is None:
        return np.empty(boxes.shape(box), dtype)
    if out.shape != boxes.shape(box) or out.dtype != dtype or not out.flags.c_contiguous:
        raise StoreError(  # the caller's mistake: not tried again
            f"get of {path!r} box {box}: out is a {out.dtype.name} array of shape "
            f"{out.shape}{'' if out.flags.c_contiguous else ', not C-contiguous'}; the "
            f"box is {boxes.shape(box)} of {dtype.name}",
            "invalid",
        )
    return out


def _swap_request(stage: str, swap: Swap) -> dict:
    """A stage's :class:`Swap` as its request carries it (in the header: at most
    ``wire.MAX_SWAP_BYTES`` of JSON)."""
    value = json.dumps(swap.obj, separators=(",", ":"))
    if not isinstance(swap.obj, dict) or len(value) > wire.MAX_SWAP_BYTES:
        raise StoreError(
            f"stage of {stage!r}: a swap's object is a JSON object of at most "
            f"{wire.MAX_SWAP_BYTES} bytes; got a {type(swap.obj).__name__} of {len(value)}"
        )
    expect = swap.expect
    if expect is not None and (not wire._is_int(expect) or expect < 0):
        raise StoreError(f"stage of {stage!r}: a swap expects a version (an int) or None")
    return {
        "path": wire.check_path(swap.path),
        "expect": None if expect is None else int(expect),
        "value": value,
        "basis": {wire.check_name(n): int(c) for n, c in swap.basis.items()},
    }


def _put_request(path: str, shape: Shape, dtype: np.dtype, box, global_shape) -> dict:
    """A put's request for an array of ``shape`` and ``dtype`` as ``box`` of ``global_shape``,
    checked before it is sent (``StoreError``, reason ``"invalid"``)."""
    box = boxes.full(shape) if box is None else wire.as_box(box)
    if global_shape is None and any(start for start, _ in box):
        raise StoreError(
            f"put of {path!r}: global_shape is needed when the box {box} does not start at "
            f"the origin"
        )
    global_shape = boxes.shape(box) if global_shape is None else wire.as_shape(global_shape)
    wire.check_box(path, box, global_shape)
    if boxes.shape(box) != tuple(shape):
        raise StoreError(
            f"the array's shape must be its box's extent; got shape {tuple(shape)} for box "
            f"{box} at path {path!r}"
        )
    return {
        "op": "put",
        "path": path,
        "box": [list(b) for b in box],
        "global_shape": list(global_shape),
        "dtype": wire.dtype_of(dtype.name).name,
    }


def _get_into(header: dict, nreply: int, path: str, box, out: np.ndarray | None) -> np.ndarray:
    """Where a get's reply goes (``out``, or a new array), once the reply's claims are checked:
    the object and box asked for, of as many bytes as they hold (else reason ``"protocol"``)."""
    try:  # the server's claims: a reply that breaks them is a protocol error
        info = ObjectInfo.from_json(header.get("info"))
        sent = wire.as_box(header.get("box"))
        dtype = wire.dtype_of(info.dtype)
    except StoreError as error:
        raise StoreError(f"get of {path!r}: {error}", "protocol") from None
    if (
        info.path != path
        or not boxes.contains(info.box, sent)
        or sent != (info.box if box is None else box)
    ):
        raise StoreError(
            f"get of {path!r} box {box}: the reply is for {info.path!r} "
            f"box {sent} of an object {info.box}",
            "protocol",
        )
    if nreply != wire.nbytes_of(boxes.shape(sent), dtype):
        raise StoreError(
            f"get of {path!r}: {nreply} bytes announced for box {sent} of {dtype.name}", "protocol"
        )
    return _receiver(out, path, sent, dtype)
