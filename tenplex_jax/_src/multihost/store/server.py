"""The tensor store server: ``python -m tenplex_jax.multihost.store --dir DIR [--port 0]
[--ready-file F]``.

docs/multihost.md ("The tensor store") states its rules. Who is served: ``connections``; the
tiers and the atomic files: ``tiers``. Here: each request's :class:`Handler`, the :class:`Budget`
every request body and reply is admitted against, and :func:`main`.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import fcntl
import itertools
import json
import os
import pathlib
import resource
import select
import signal
import socket
import socketserver
import stat
import sys
import threading
import time
import typing

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import checksums
from tenplex_jax._src.errors import StoreError, StoreProtocolError
from tenplex_jax._src.multihost.store import tiers, updates, wire
from tenplex_jax._src.multihost.store.connections import (
    DEFAULT_HANDSHAKE_TIMEOUT,
    DEFAULT_MAX_CONNECTIONS,
    DEFAULT_MAX_HANDSHAKES,
    Server,
    UnixServer,
    is_loopback,
)
from tenplex_jax._src.multihost.store.shared import SHM
from tenplex_jax._src.multihost.store.tiers import DEFAULT_MEMORY_BYTES
from tenplex_jax._src.multihost.store.updates import Store
from tenplex_jax._src.multihost.store.wire import ObjectInfo

DEFAULT_MAX_BODY_BYTES = 8 << 30
DEFAULT_TIMEOUT = 120.0
# a JSON body's parsed objects, and its check's re-encoding, take at most this many times its
# bytes (measured: 33 for ``[[[]],[[]],...]``, rising with the depth of nested lists to 45 at 40
# levels and about 48 as the depth grows), counted in the transfer budget while it is checked
JSON_PARSE_FACTOR = 56
PEER_CHECK_SECONDS = 0.25  # how often a transfer waiting for room looks at its client's socket
MAX_WAIT = 30.0  # the longest a get_json waits for a newer version of its object


class Budget:
    """The bytes of request bodies and replies in flight, at most ``limit`` at once.

    A transfer is admitted before its bytes are received or produced: it waits for room until
    ``timeout`` seconds pass, then is refused (``"busy"``); one larger than the whole budget is
    refused at once (``"too_large"``). One that waits leaves as soon as its client (``peer``,
    looked at every ``PEER_CHECK_SECONDS``) has closed the connection.
    """

    def __init__(self, limit: int, timeout: float):
        self.limit, self.timeout, self.used, self.waiting = limit, timeout, 0, 0
        self.cond = threading.Condition()

    @contextlib.contextmanager
    def hold(self, nbytes: int, what: str, peer: socket.socket | None = None):
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
                    if peer is not None and _closed(peer):
                        raise ConnectionAbortedError(
                            f"{what}: its client closed the connection while it waited for room"
                        )
                    self.cond.wait(left if peer is None else min(left, PEER_CHECK_SECONDS))
            finally:
                self.waiting -= 1
            self.used += nbytes
        try:
            yield
        finally:
            with self.cond:
                self.used -= nbytes
                self.cond.notify_all()


def _closed(sock: socket.socket) -> bool:
    """Whether the peer has closed ``sock`` (or reset it), seen without blocking and without
    taking any byte it sent."""
    poller = select.poll()
    poller.register(sock, select.POLLIN)
    events = poller.poll(0)
    if not events:
        return False  # nothing to read and no end of stream: the client is still waiting
    if events[0][1] & (select.POLLERR | select.POLLNVAL):
        return True
    try:
        return sock.recv(1, socket.MSG_PEEK) == b""  # readable now, so it does not block
    except OSError:
        return True


def _beside(beside) -> list[tuple[str, int, str]]:
    """A check's ``beside``: ``[name, clock, stage]`` of at most ``wire.MAX_BESIDE`` pushes."""
    beside = beside or []
    if not isinstance(beside, list) or len(beside) > wire.MAX_BESIDE:
        raise StoreError(f"a check's beside is a list of at most {wire.MAX_BESIDE} pushes")
    for each in beside:
        if not (isinstance(each, list) and len(each) == 3 and wire._is_int(each[1])):
            raise StoreError(f"a check's beside holds [name, clock, stage]: {each!r:.100}")
        wire.check_name(each[0]), wire.check_path(each[2])
    return [tuple(each) for each in beside]


def _check_plain_json(data: bytes, what: str) -> None:
    """Refuse bytes that are not a plain JSON object: without NaN or Infinity, a key twice in one
    object, or a lone surrogate."""
    try:
        obj = json.loads(data, parse_constant=_no_constant, object_pairs_hook=wire.unique_keys)
        # a lone surrogate (an escape no UTF-8 text holds) would be kept as written, and fail
        # whoever re-encodes the object
        json.dumps(obj, ensure_ascii=False).encode("utf-8")
    except (ValueError, RecursionError) as error:
        raise StoreError(f"{what}: the body is not plain JSON: {error!r:.300}", "refused") from None
    if not isinstance(obj, dict):
        raise StoreError(
            f"{what}: the store keeps JSON objects; the body is a {type(obj).__name__}",
            "refused",
        )


def _no_constant(name: str):
    raise ValueError(f"{name} is not plain JSON")


class _RequestSocket:
    """A served connection whose requests each arrive whole within ``seconds`` of their first
    byte (``--timeout``), as well as each receive within it: a client that trickles a request
    holds its connection's slot that long, never longer. Sends and the rest go to the socket."""

    def __init__(self, sock: socket.socket, seconds: float):
        self._sock, self._seconds, self._deadline = sock, seconds, None

    def between_requests(self) -> None:
        """The next receive waits for a new request: the idle timeout alone."""
        self._deadline = None
        self._sock.settimeout(self._seconds)

    def _arm(self) -> None:
        if self._deadline is not None:
            left = self._deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"a request took longer than {self._seconds:g} s to arrive")
            self._sock.settimeout(min(left, self._seconds))

    def _started(self, got: int) -> None:
        if got and self._deadline is None:
            self._deadline = time.monotonic() + self._seconds

    def recv(self, n: int, flags: int = 0) -> bytes:
        if flags:  # a look (MSG_PEEK: is the client gone?), not a request's bytes
            return self._sock.recv(n, flags)
        self._arm()
        data = self._sock.recv(n)
        self._started(len(data))
        return data

    def recv_into(self, buffer, nbytes: int = 0) -> int:
        self._arm()
        got = self._sock.recv_into(buffer, nbytes)
        self._started(got)
        return got

    def __getattr__(self, name: str):
        return getattr(self._sock, name)


class Handler(socketserver.BaseRequestHandler):
    """Serves the requests of one admitted connection: its hello has passed and been answered
    (``connections``), so it starts at the request loop."""

    server: Server
    rid: str | None = None  # the id of the request being served (its replies echo it)
    # bytes of the body of the request being served that its client sent without waiting for
    # "continue" (``eager``) and that are not read yet: after an error reply the connection
    # closes (they would be taken for the next request)
    unread: int = 0

    def handle(self) -> None:
        raw: socket.socket = self.request
        raw.settimeout(self.server.timeout_s)
        if raw.family != socket.AF_UNIX:
            raw.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        sock = _RequestSocket(raw, self.server.timeout_s)
        try:
            while True:
                sock.between_requests()
                prefix = wire.recv_prefix(sock)
                if prefix is None:
                    return
                nheader, nbody = prefix
                self.rid = None  # until this request's header is read
                header = wire.recv_header(sock, nheader, wire.MAX_HEADER_BYTES)
                rid = header.get("rid")
                self.rid = rid if isinstance(rid, str) and len(rid) <= wire.MAX_RID_CHARS else None
                eager = header.get("eager") is True and header.get("op") in self.WITH_BODY
                self.unread = nbody if eager else 0
                try:
                    self._serve(sock, header, nbody)
                except StoreError as error:
                    reason = getattr(error, "reason", "refused")
                    self._send(sock, {"ok": False, "error": str(error), "reason": reason})
                except (KeyError, TypeError, ValueError, OverflowError) as error:
                    message = f"malformed {header.get('op')!r} request: {error!r}"
                    self._send(sock, {"ok": False, "error": message, "reason": "protocol"})
                except OSError as error:  # the store's disk, not the connection
                    if isinstance(error, (ConnectionError, TimeoutError)):
                        raise
                    message = f"{header.get('op')!r} failed on the store's disk: {error!r}"
                    self._send(sock, {"ok": False, "error": message, "reason": "disk"})
                if self.unread:  # refused before its eager body was read
                    return
        except StoreProtocolError as error:
            with contextlib.suppress(OSError):
                self._send(sock, {"ok": False, "error": str(error), "reason": "protocol"})
        except (OSError, ConnectionError):
            return  # the client went away or timed out

    def _send(self, sock, header: dict, body=None) -> None:
        """A reply frame to the request being served: it echoes the request's id (``rid``), so
        that a client can tell a reply of its request from a stale or repeated one."""
        wire.send_frame(sock, header if self.rid is None else {**header, "rid": self.rid}, body)

    def _body(self, sock: socket.socket, nbody: int, expected: int, path: str):
        """Say continue, then read a body of exactly ``expected`` bytes; (bytes, checksum). Call
        with the body's bytes held in the transfer budget."""
        if nbody != expected:
            raise StoreError(
                f"the body must be {expected} bytes (shape x itemsize); got {nbody}", "refused"
            )
        self._continue(sock)
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

    def _continue(self, sock: socket.socket) -> None:
        """Let the body come: say continue, unless the client sent it without waiting
        (``eager``: a small body, or one refused rarely, spares a round trip)."""
        if self.unread:
            self.unread = 0  # read next, by the caller
        else:
            self._send(sock, {"ok": True, "continue": True})

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
        self._continue(sock)
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
        wire.send_header(sock, reply if self.rid is None else {**reply, "rid": self.rid}, nbytes)
        crc, sent = 0, 0
        try:
            for piece in itertools.chain([] if first is None else [first], pieces):
                crc = checksums.crc32(piece, crc)
                wire.send_body(sock, piece)
                sent += piece.nbytes
        except StoreError as error:  # the file failed its checksum: the bytes sent are void
            if sent != nbytes:
                raise ConnectionError("a streamed reply broke off") from error
            self._send(sock, {"ok": False, "error": str(error), "reason": error.reason})
            return
        self._send(sock, {"ok": True, "checksum": checksums.text(crc)})

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
        """Store an array; with ``check`` (``{"into", "name", "beside"}``: a parameter server's
        stage), written through to a file and checked against the array it will be added into
        (``Store.check_stage``), whose record the reply carries as ``into``. ``sync`` false: a
        file written through is fsynced behind the reply."""
        store = self.server.store
        path = wire.check_path(header.get("path"))
        check = header.get("check")
        if check is not None:
            if not isinstance(check, dict):
                raise StoreError(f"a put's check holds into, name and beside: {check!r:.100}")
            into, name = wire.check_path(check.get("into")), wire.check_name(check.get("name"))
            beside = _beside(check.get("beside"))
        swap = self._swap_of(header) if check is not None else None
        # a stage whose swap this request made already (its reply was lost): answered as done,
        # not checked again (its update may be added and its stage gone by now), nor stored
        # again unless its body streams to disk (then a stage no push names: ``collect``'s)
        done = None if swap is None else store.written_by(swap[0], self.rid)
        durable = check is not None or bool(header.get("durable"))
        sync = header.get("sync", True) is not False
        dtype = wire.dtype_of(str(header.get("dtype")))
        global_shape = wire.as_shape(header["global_shape"])
        box = wire.as_box(header["box"])
        wire.check_box(path, box, global_shape)
        expected = wire.nbytes_of(boxes.shape(box), dtype)
        what = f"put of {path!r} box {box}"
        self._check_body_limit(nbody, what)
        info = ObjectInfo(path, box, global_shape, dtype.name, expected, "")
        if nbody > self.server.budget.limit:  # written to disk as it arrives
            with self.server.budget.hold(tiers.STREAM_CHUNK_BYTES, what, peer=sock):
                info = self._put_streamed(sock, header, info, what)
        else:
            with self.server.budget.hold(nbody, what, peer=sock):
                data, digest = self._body(sock, nbody, expected, path)
                self._check_claim(sock, header, digest, what)
                info = dataclasses.replace(info, checksum=digest)
                if done is None:
                    store.put(info, data, durable=durable, sync=sync)
                del data  # the store holds it now, or has written it through
        reply = {"ok": True, "info": info.to_json()}
        if done is not None:
            reply["into"] = store.info(store.find(into, None))[0].to_json()
            reply["swap"] = {"swapped": True, "version": done, "time": time.time()}
            self._send(sock, reply)
            return
        store.reshare(path)
        if check is not None:
            chunks = (3 + len(beside)) * min(info.nbytes, updates.ACCUMULATE_CHUNK_BYTES)
            with self.server.budget.hold(chunks, f"check of {path!r}", peer=sock):
                into_info = store.check_stage(path, into, name, beside)
                reply["into"] = into_info.to_json()
                if swap is not None:  # the check passed: the swap it carries
                    reply["swap"] = self._swap_checked(swap, into_info, sync)
        self._send(sock, reply)

    @staticmethod
    def _swap_of(header: dict) -> tuple[str, int | None, np.ndarray, dict[str, int]] | None:
        """A stage's swap (``{"path", "expect", "value", "basis"}``, see ``StoreClient.stage``),
        checked before anything is stored: ``(path, expect, the object's bytes, basis)``."""
        swap = header.get("swap")
        if swap is None:
            return None
        what = f"the swap of stage {header.get('path')!r:.200}"
        if not isinstance(swap, dict) or not isinstance(swap.get("basis"), dict):
            raise StoreError(f"{what} holds path, expect, value and basis: {swap!r:.100}")
        path, expect, value = (
            wire.check_path(swap.get("path")),
            swap.get("expect"),
            swap.get("value"),
        )
        if expect is not None and (not wire._is_int(expect) or expect < 0):
            raise StoreError(f"{what} expects a version or null; got {expect!r:.80}")
        if not isinstance(value, str) or len(value) > wire.MAX_SWAP_BYTES:
            raise StoreError(
                f"{what} holds its object as JSON text of at most {wire.MAX_SWAP_BYTES} bytes"
            )
        data = value.encode()
        _check_plain_json(data, what)
        basis = {wire.check_name(n): c for n, c in swap["basis"].items()}
        if not all(wire._is_int(c) and c >= 0 for c in basis.values()):
            raise StoreError(f"{what}: its basis maps names to clocks (ints >= 0)")
        return path, expect, np.frombuffer(data, np.uint8), basis

    def _swap_checked(self, swap, into: ObjectInfo, sync: bool) -> dict:
        """A stage's swap (:meth:`_swap_of`), made once its check passed, if the array checked
        (``into``) holds the basis: the pushes the check took as added, which a store that lost
        a sum lacks (then the check was short: nothing swaps, version null)."""
        path, expect, data, basis = swap
        held = dict(into.clocks)
        if any(held.get(n, 0) < c for n, c in basis.items()):
            return {"swapped": False, "version": None, "time": time.time()}
        swapped, version, now = self.server.store.cas_json(path, expect, data, self.rid, sync)
        out = {"swapped": swapped, "version": version, "time": time.time()}
        if now is not None and now.nbytes <= wire.MAX_SWAP_BYTES:
            out["value"] = now.tobytes().decode()
        return out

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
            with self.server.budget.hold(tiers.STREAM_CHUNK_BYTES, f"get of {path!r}", peer=sock):
                self._get_streamed(sock, key, info, box or info.box)
            return
        with self.server.budget.hold(reply_bytes, f"get of {path!r} box {box}", peer=sock):
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
            self._send(sock, reply, out)
            del data, out

    def _accumulate(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Add a staged array into a stored one, once per (name, clock): ``Store.accumulate``."""
        path, stage = wire.check_path(header.get("path")), wire.check_path(header.get("stage"))
        name, clock = wire.check_name(header.get("name")), header.get("clock")
        if not wire._is_int(clock) or clock < 0:
            raise StoreError(f"accumulate needs an integer clock >= 0, got {clock!r:.50}")
        update = header.get("update")
        if update is not None and not (
            isinstance(update, str) and update.startswith(checksums.PREFIX)
        ):
            raise StoreError(f"accumulate's update is a checksum or null, got {update!r:.100}")
        beside = _beside(header.get("beside"))
        store, budget = self.server.store, self.server.budget
        info, _ = store.info(store.find(path, None))
        # the sum is made a chunk at a time from the array and the update (from the memory tier,
        # or read a chunk at a time); it is built in memory when it fits the budget next to
        # those chunks, else written to a file as it is made
        chunks = (3 + len(beside)) * min(info.nbytes, updates.ACCUMULATE_CHUNK_BYTES)
        in_memory = info.nbytes + chunks <= budget.limit and not header.get("check")
        with budget.hold(
            info.nbytes + chunks if in_memory else chunks, f"accumulate of {path!r}", peer=sock
        ):
            info, applied = store.accumulate(
                path,
                stage,
                name,
                int(clock),
                update=update,
                consume=bool(header.get("consume")),
                check=bool(header.get("check")),
                in_memory=in_memory,
                keep=None if header.get("keep") is None else wire.check_path(header["keep"]),
                beside=beside,
            )
        store.reshare(path)
        self._send(sock, {"ok": True, "applied": applied, "info": info.to_json()})

    def _revert(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Put back the version an accumulate kept: ``Store.revert``."""
        path, kept = wire.check_path(header.get("path")), wire.check_path(header.get("kept"))
        name, clock = wire.check_name(header.get("name")), header.get("clock")
        if not wire._is_int(clock) or clock < 0:
            raise StoreError(f"revert needs an integer clock >= 0, got {clock!r:.50}")
        store = self.server.store
        info, _ = store.info(store.find(kept, None))
        with self.server.budget.hold(info.nbytes, f"revert of {path!r}", peer=sock):
            info = store.revert(path, kept, name, int(clock), bool(header.get("check")))
        store.reshare(path)
        self._send(sock, {"ok": True, "info": info.to_json()})

    def _get_shared(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """A whole array's record and the segment holding it for a reader on this host
        (``Store.share``; see ``shared``)."""
        store = self.server.store
        path = wire.check_path(header.get("path"))
        info, in_memory = store.info(store.find(path, None))
        with self.server.budget.hold(
            0 if in_memory else info.nbytes, f"get_shared of {path!r}", peer=sock
        ):
            info, file, seq, digest = store.share(path)
        epoch = store.segments.epoch
        reply = {"ok": True, "info": info.to_json(), "segment": file, "epoch": epoch, "seq": seq}
        self._send(sock, {**reply, "digest": digest})

    def _list(self, sock: socket.socket, header: dict, nbody: int) -> None:
        listing = [i.to_json() for i in self.server.store.list(str(header.get("prefix", "")))]
        self._send(sock, {"ok": True}, json.dumps(listing).encode())

    def _list_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        store, prefix = self.server.store, str(header.get("prefix", ""))
        with store.lock:
            paths = sorted(p for p in store.json if p.startswith(prefix))
        self._send(sock, {"ok": True, "paths": paths})

    def _delete(self, sock: socket.socket, header: dict, nbody: int) -> None:
        prefix = header.get("prefix")
        if not isinstance(prefix, str):
            raise StoreError(f"delete needs a string prefix; got {prefix!r}", "refused")
        self._send(sock, {"ok": True, "deleted": self.server.store.delete(prefix)})

    def _json_body(self, sock: socket.socket, header: dict, nbody: int, what: str):
        """A JSON request body, received and parsed within the transfer budget (holding
        ``JSON_PARSE_FACTOR`` times its bytes more while it is parsed), checked (its checksum; a
        JSON object, without NaN or Infinity, a key twice in one object, or a lone surrogate)."""
        path = wire.check_path(header.get("path"))
        self._check_body_limit(nbody, what, wire.MAX_JSON_BYTES)
        with self.server.budget.hold(
            nbody * (1 + JSON_PARSE_FACTOR), f"{what} ({nbody} bytes)", peer=sock
        ):
            data, digest = self._body(sock, nbody, nbody, path)
            if digest != header.get("checksum"):
                raise StoreError(
                    f"{what}: the bytes received have checksum {digest}, the client "
                    f"sent {header.get('checksum')}; nothing stored",
                    "checksum",
                )
            _check_plain_json(data.tobytes(), what)
        return path, data

    def _done_before(self, sock: socket.socket, header: dict, **reply) -> bool:
        """Answer a JSON write this store has done already (its reply was lost and the client
        tries again) with its outcome, before its body is sent again (an eager body sent
        already is read and dropped); whether it was one."""
        done = self.server.store.written_by(wire.check_path(header.get("path")), self.rid)
        if done is not None:
            self._check_body_limit(self.unread, "a JSON write's body", wire.MAX_JSON_BYTES)
            while self.unread:
                n = min(self.unread, 1 << 16)
                wire.recv_exact(sock, n)
                self.unread -= n
            self._send(sock, {"ok": True, "version": done, "time": time.time(), **reply})
        return done is not None

    def _put_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        what = f"put_json of {header.get('path')!r:.200}"
        if self._done_before(sock, header):
            return
        path, data = self._json_body(sock, header, nbody, what)
        with self.server.budget.hold(nbody, what, peer=sock):
            flush = header.get("flush", True) is not False
            version = self.server.store.put_json(path, data, flush, self.rid)
        self._send(sock, {"ok": True, "version": version})

    def _get_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Read a JSON object; with ``newer_than`` (a version) and ``wait`` (seconds, at most
        ``MAX_WAIT``), first wait until the object is another version than that one."""
        store, path = self.server.store, wire.check_path(header.get("path"))
        newer_than, wait = header.get("newer_than"), header.get("wait", 0)
        if newer_than is not None:
            # ``not wait >= 0`` refuses NaN too, which no comparison holds (it would skip the cap)
            if not wire._is_int(newer_than) or not isinstance(wait, (int, float)) or not wait >= 0:
                raise StoreError(
                    f"get_json of {path!r}: newer_than is a version (an int) and wait seconds "
                    f"(>= 0); got {newer_than!r:.40} and {wait!r:.40}"
                )
            store.wait_json(
                path, newer_than, min(float(wait), MAX_WAIT), gone=lambda: _closed(sock)
            )
        with self.server.budget.hold(store.json_bytes(path), f"get_json of {path!r}", peer=sock):
            file_header, data = store.get_json(path)
            reply = {
                "ok": True,
                "checksum": wire.checksum(data),
                "version": int(file_header.get("version", 0)),
                "time": time.time(),
            }
            self._send(sock, reply, data)

    def _cas_json(self, sock: socket.socket, header: dict, nbody: int) -> None:
        """Compare and swap a JSON object by version; the reply carries the version now and the
        store's clock (one clock for every client of the store, whatever host it runs on), and
        the object now only when it did not swap (a swapped one is the request's)."""
        expect = header.get("expect")
        if expect is not None and (not wire._is_int(expect) or expect < 0):
            raise StoreError(
                f"cas_json expects a version (an int >= 0) or null; got {expect!r:.80}"
            )
        what = f"cas_json of {header.get('path')!r:.200}"
        store = self.server.store
        if self._done_before(sock, header, swapped=True):
            return
        path, data = self._json_body(sock, header, nbody, what)
        with store.lock:  # the object now, as read back to compare (a racing put may grow it)
            current = store.json.get(path, 0)
        with self.server.budget.hold(nbody + 2 * current, what, peer=sock):
            sync = header.get("sync", True) is not False  # false: fsynced behind the reply
            swapped, version, now = store.cas_json(path, expect, data, self.rid, sync)
            reply = {"ok": True, "swapped": swapped, "version": version, "time": time.time()}
            if now is not None:
                reply["checksum"] = wire.checksum(now)
            self._send(sock, reply, now)

    def _flush(self, sock: socket.socket, header: dict, nbody: int) -> None:
        self.server.store.flush()
        self._send(sock, {"ok": True})

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
                # connections served (their hello passed), and those still in their handshake
                "connections": self.server.connections(),
                "handshakes": self.server.handshakes(),
                "transfer_bytes": self.server.budget.used,
                "transfers_waiting": self.server.budget.waiting,
                "transfer_limit": self.server.budget.limit,
                "shared_bytes": store.segments.used,
            }
        self._send(sock, {"ok": True, "stats": stats})

    OPS: typing.ClassVar[dict] = {
        "put": _put,
        "get": _get,
        "get_shared": _get_shared,
        "accumulate": _accumulate,
        "revert": _revert,
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


def main(argv=None) -> int:
    """Run a store server until SIGTERM or SIGINT (then write what is only in memory to disk)."""
    parser = _parser()
    args = parser.parse_args(argv)
    token = _token(args, parser)
    for name in ("memory_bytes", "max_body_bytes", "max_connections", "max_handshakes"):
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
    store = Store(directory, args.memory_bytes, shm=args.shm, max_segments=_segment_files(args))
    servers = [Server((args.host, args.port), store, token, args, Handler)]
    if args.unix_socket:
        try:
            servers.append(UnixServer(args.unix_socket, store, token, args, Handler))
        except StoreError as error:
            servers[0].server_close()
            store.close()
            parser.error(str(error))
    _serve(servers, store, args.ready_file, directory)
    return 0


def _serve(servers: list, store: Store, ready_file: str | None, directory: pathlib.Path) -> None:
    """Serve until SIGTERM or SIGINT; say where (``ready_file``) once listening."""
    host, port = servers[0].server_address[:2]
    address = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    for each in servers:
        threading.Thread(target=each.serve_forever, name="store-server", daemon=True).start()
    if ready_file:
        ready = pathlib.Path(ready_file)
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


def _segment_files(args) -> int:
    """How many segments the store may keep: two file descriptors each (the store's and its
    mapping's), from what the process may open beside its connections, pending handshakes,
    files and stores' own (64)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    if soft == resource.RLIM_INFINITY:
        return 1 << 30
    return max(0, (soft - args.max_connections - args.max_handshakes - 64) // 2)


def _token(args, parser) -> str | None:
    """The secret in ``--token-file`` (a file others can read is warned about), or None."""
    if not args.token_file:
        return None
    try:
        token = pathlib.Path(args.token_file).read_text().strip()
    except (OSError, UnicodeDecodeError) as error:
        parser.error(f"--token-file {args.token_file} cannot be read: {error}")
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
    return token


def _parser() -> argparse.ArgumentParser:
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
        help="seconds a connection may stay silent, a request may take to arrive whole from its "
        "first byte, and a transfer may wait for room in the budget (default 120)",
    )
    parser.add_argument(
        "--handshake-timeout",
        type=float,
        default=DEFAULT_HANDSHAKE_TIMEOUT,
        help=f"seconds a new connection has to complete its hello (default "
        f"{DEFAULT_HANDSHAKE_TIMEOUT:g})",
    )
    parser.add_argument(
        "--max-connections",
        type=int,
        default=DEFAULT_MAX_CONNECTIONS,
        help=f"connections served at once, their hello passed; more are refused as busy "
        f"(default {DEFAULT_MAX_CONNECTIONS})",
    )
    parser.add_argument(
        "--max-handshakes",
        type=int,
        default=DEFAULT_MAX_HANDSHAKES,
        help=f"connections waiting for their hello at once; a new one closes the oldest "
        f"(default {DEFAULT_MAX_HANDSHAKES})",
    )
    parser.add_argument(
        "--shm",
        default=SHM,
        metavar="DIR",
        help=f"shared memory for whole-array reads by clients on this host (default {SHM}; "
        f"not a writable directory: every read goes over the socket)",
    )
    parser.add_argument("--ready-file", help='written with "host:port" once listening')
    parser.add_argument(
        "--unix-socket", metavar="PATH", help='also serve on this Unix socket (address "unix:PATH")'
    )
    return parser
