"""The store's state: the index, the memory tier (least recently used clean objects evicted
first) and the disk tier (docs/multihost.md, "Tiers", states the rules).

**Atomic files.** An object is one file: ``b"TPX2"`` + header length + the header's crc32 + a
JSON header (path, box, global shape, dtype, checksum) + the bytes, written to ``DIR/tmp`` and
fsynced, then renamed into ``DIR/objects``; only then does the index point at it. Restarted on
the same directory, the store deletes ``DIR/tmp``, indexes the complete files whose header checks
and verifies each file's data checksum when it reads it. JSON objects are files too, of two
slots written in place (``slots``), read and checked on every ``get_json`` (never held in
memory). A file that fails is moved to ``DIR/corrupt`` and never served.

**Synced now or behind.** A write acknowledged with ``sync`` is fsynced (its file and its
directory) before the reply: a crash of the machine keeps it. One without is renamed into place
before the reply and fsynced by a writer thread from ``LATER_SECONDS`` after it (queued like
a write-back: ``flush`` waits for it): a kill of the store keeps it (the file is in the
kernel's page cache), a crash of the machine before that fsync may not.

**Later.** An accumulated sum (and the version it replaced) and a fsync behind a reply are
queued ``LATER_SECONDS`` late, so that a piece updated at every push is written once for
several pushes (until then the stages it consumed stay on disk) and a file removed meanwhile
is never synced; ``flush`` and ``close`` let them through at once.
"""

from __future__ import annotations

import collections
import contextlib
import dataclasses
import hashlib
import itertools
import json
import math
import os
import pathlib
import queue
import shutil
import struct
import sys
import threading
import time
import uuid

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import checksums
from tenplex_jax._src.errors import StoreError
from tenplex_jax._src.multihost.store import slots, wire
from tenplex_jax._src.multihost.store.wire import ObjectInfo

FILE_MAGIC = b"TPX2"  # an object file: magic, header bytes, header crc32, JSON header, data
FILE_PREFIX = struct.Struct("!4sII")
DEFAULT_MEMORY_BYTES = 4 << 30
IO_CHUNK_BYTES = 256 << 20
STREAM_CHUNK_BYTES = 16 << 20  # objects larger than the transfer budget move this much at a time
WRITERS = 4  # threads writing the memory tier back to disk
RIDS_KEPT = 64  # ids of the last writes a JSON object's file remembers
HIGHEST = "HIGHEST"  # json/HIGHEST: the highest JSON version handed out when one was deleted
# a write behind a reply that is replaced often (an accumulated sum, a fsync behind) waits this
# long first: the versions replaced meanwhile are never written (a flush lets it go at once)
LATER_SECONDS = 0.1
JSON_READS = 100  # a get_json whose slot was rewritten while it read it reads again this often


@dataclasses.dataclass(frozen=True)
class Entry:
    info: ObjectInfo
    seq: int  # puts of one key are ordered by seq; the newest one wins
    on_disk: bool  # the file under objects/ holds this version


def _piece(raw: bytes, dtype, lead, j, rows, shape, axis, local) -> memoryview | None:
    """The part of ``local`` (a tuple of slices into an object of ``shape``) inside one
    contiguous read: indices ``lead`` on the axes before ``axis``, rows ``j .. j + rows`` on it;
    None when the read holds none of it."""
    for i, s in zip(lead, local):
        if not s.start <= i < s.stop:
            return None
    lo, hi = max(j, local[axis].start), min(j + rows, local[axis].stop)
    if lo >= hi:
        return None
    block = np.frombuffer(raw, np.dtype(f"V{dtype.itemsize}")).reshape((rows,) + shape[axis + 1 :])
    part = block[(slice(lo - j, hi - j),) + tuple(local[axis + 1 :])]
    return wire.as_bytes(np.ascontiguousarray(part))


def _key(kind: str, path: str, box: boxes.Box = ()) -> str:
    text = json.dumps([kind, path, [list(b) for b in box]], separators=(",", ":"))
    return hashlib.blake2b(text.encode(), digest_size=20).hexdigest()


class Tiers:
    """The store's state: the index, the memory tier, the disk writer. Thread-safe. (Its
    read-modify-write operations are ``updates.Store``'s.)"""

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
        self.json: dict[str, int] = {}  # path -> bytes of the JSON objects (on disk only)
        self.versions: dict[str, int] = {}  # path -> the JSON object's version
        # path -> {rid: version} of its last RIDS_KEPT writes (also in its file's header)
        self.json_rids: dict[str, dict[str, int]] = {}
        # path -> (the slot of its newest version, the slot's bytes); none for a file of the
        # earlier format (one record), until its next write
        self.json_slots: dict[str, tuple[int, int]] = {}
        self.version = 0  # the highest version handed out (versions only grow)
        # array key -> [(seq, stage path)]: stages consumed by accumulates, removed once the
        # array's version ``seq`` (or a later one) is on disk
        self.consumed: dict[str, list[tuple[int, str]]] = {}
        self.writes: queue.Queue = queue.Queue()  # (ticket, key, seq) to write back, in put order
        self.queued = 0  # tickets handed out
        self.pending: set[int] = set()  # tickets not yet written back
        self.written_cond = threading.Condition(self.lock)
        self.json_changed = threading.Condition(self.lock)  # a JSON object written or deleted
        self.failed: dict[str, str] = {}  # dirty keys whose write-back failed -> the error
        self.unsynced: dict[str, str] = {}  # files whose fsync behind failed -> the error
        # transfers under way, by thread, for `stats` (set and popped whole: atomic under the GIL)
        self.receiving: dict[int, dict] = {}  # request bodies: path, bytes so far, of
        self.writing: dict[int, dict] = {}  # files being written: path, bytes so far, of
        self.closing = False
        self.later: queue.Queue = queue.Queue()  # (due, ticket, key, seq) for the writers, late
        self.hurrying = 0  # flushes under way: the later writes go now
        self.hurry = threading.Condition(self.lock)
        self._load()
        # several writers: their fsyncs overlap, as the file system's journal commits them together
        self.writers = [
            threading.Thread(target=self._write_loop, name="store-writer", daemon=True)
            for _ in range(WRITERS)
        ]
        for writer in self.writers:
            writer.start()
        self.later_thread = threading.Thread(
            target=self._later_loop, name="store-later", daemon=True
        )
        self.later_thread.start()

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
            except (OSError, ValueError, KeyError, TypeError, struct.error, StoreError) as error:
                self._set_aside(file, f"incomplete or unreadable: {error!r}")
                continue
            if _key("array", info.path, info.box) != file.stem:
                self._set_aside(file, "its name is not its (path, box)")
                continue
            self.seq += 1
            self._index_set(file.stem, Entry(info, self.seq, on_disk=True))
        for file in sorted(self.json_dir.glob("*.obj")):
            try:
                with open(file, "rb") as f:
                    header, data, slot = self._json_of(f)
                    size = os.fstat(f.fileno()).st_size // 2
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                self._set_aside(file, f"incomplete or corrupt: {error!r}")
                continue
            if slot is not None:
                self.json_slots[header["path"]] = (slot, size)
            self.json[header["path"]] = len(data)
            self.versions[header["path"]] = int(header.get("version", 0))
            self.json_rids[header["path"]] = {str(r): int(v) for r, v in header.get("rids", ())}
        self.version = max(self.versions.values(), default=0)
        with contextlib.suppress(OSError, ValueError):  # the highest a delete left behind
            self.version = max(self.version, int((self.json_dir / HIGHEST).read_text()))

    @staticmethod
    def _header_of(f) -> dict:
        """The JSON header at the start of an open object file, checked against its crc32."""
        magic, n, crc = FILE_PREFIX.unpack(f.read(FILE_PREFIX.size))
        if magic != FILE_MAGIC:
            raise ValueError(f"bad magic {magic!r} (not a {FILE_MAGIC!r} object file)")
        encoded = f.read(n)
        if checksums.crc32(encoded) != crc:
            raise ValueError(
                f"the header's checksum is {checksums.crc32(encoded):08x}, not {crc:08x}"
            )
        header = json.loads(encoded)
        if not isinstance(header, dict) or type(header.get("nbytes")) is not int:
            raise ValueError(
                f"a header is a JSON object with an integer nbytes, got {header!r:.200}"
            )
        return header

    @classmethod
    def _read_header(cls, file: pathlib.Path) -> dict:
        with open(file, "rb") as f:
            header = cls._header_of(f)
            size, at = os.fstat(f.fileno()).st_size, f.tell()
        if size != at + header["nbytes"]:
            raise ValueError(f"file size {size} disagrees with its header")
        return header

    @classmethod
    def _read_file(cls, file: pathlib.Path) -> tuple[dict, np.ndarray]:
        """A file's header and bytes; ``ValueError`` unless both match their checksums."""
        with open(file, "rb") as f:
            return cls._read_open(f)

    @classmethod
    def _read_open(cls, f) -> tuple[dict, np.ndarray]:
        """:meth:`_read_file` of a file open as ``f``, at its start."""
        header = cls._header_of(f)
        data = np.empty(header["nbytes"], np.uint8)
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

    @classmethod
    def _json_of(cls, f, slot: int | None = None) -> tuple[dict, bytes, int | None]:
        """The header and data of the JSON object's file open as ``f``: its newest whole slot,
        or ``slot`` (``slots``), or its one record in the earlier format (slot None);
        ``ValueError`` unless the header and the data match their checksums."""
        if os.pread(f.fileno(), len(FILE_MAGIC), 0) != FILE_MAGIC:
            return slots.read(f.fileno(), slot)
        return (*cls._read_open(f), None)

    def _set_aside(self, file: pathlib.Path, why: str) -> None:
        print(
            f"tenplex_jax.multihost.store: {file} is not served: {why}", file=sys.stderr, flush=True
        )
        with contextlib.suppress(OSError):
            os.replace(file, self.corrupt_dir / f"{file.name}.{uuid.uuid4().hex[:8]}")

    def _write_tmp(self, header: dict, data, sync: bool = True) -> pathlib.Path:
        """A complete file under tmp/ (not yet visible) holding ``data``, fsynced if ``sync``."""
        view = memoryview(data).cast("B")
        chunks = (view[at : at + IO_CHUNK_BYTES] for at in range(0, view.nbytes, IO_CHUNK_BYTES))
        return self._write_chunks(header, chunks, sync)[0]

    def _write_chunks(self, header: dict, chunks, sync: bool = True) -> tuple[pathlib.Path, str]:
        """A complete file under tmp/ from ``chunks`` (bytes-like, in order, together
        ``header["nbytes"]``), fsynced if ``sync``; (its path, the data's checksum). A header
        whose checksum is None gets the data's, computed as they are written: the header goes
        first with a placeholder of the same length, then again."""
        tmp = self.tmp_dir / f"{uuid.uuid4().hex}.tmp"
        digest = header.get("checksum")
        path, nbytes, me = header.get("path"), header["nbytes"], threading.get_ident()

        def encoded_header(checksum: str) -> bytes:
            encoded = json.dumps({**header, "checksum": checksum}, separators=(",", ":")).encode()
            return FILE_PREFIX.pack(FILE_MAGIC, len(encoded), checksums.crc32(encoded)) + encoded

        try:
            with open(tmp, "wb") as f:
                f.write(encoded_header(digest or checksums.text(0)))
                crc, done = 0, 0
                for chunk in chunks:
                    self.writing[me] = {"path": path, "bytes": done, "of": nbytes}
                    if digest is None:
                        crc = checksums.crc32(chunk, crc)
                    f.write(chunk)
                    done += memoryview(chunk).nbytes
                if done != nbytes:
                    raise StoreError(f"{path!r}: {done} bytes written of {nbytes}", "protocol")
                self.writing[me] = {"path": path, "bytes": done, "of": nbytes}
                if digest is None:
                    digest = checksums.text(crc)
                    f.seek(0)
                    f.write(encoded_header(digest))
                f.flush()
                if sync:
                    os.fsync(f.fileno())
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            self.writing.pop(me, None)
        return tmp, digest

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
                if seq is None:  # a file renamed into place unsynced: fsync it behind
                    self._sync_file(pathlib.Path(key))
                else:
                    self._write_back(key, seq)
            except Exception as error:
                with self.lock:
                    (self.failed if seq is not None else self.unsynced)[key] = repr(error)
            with self.lock:
                self.pending.discard(ticket)
                self.written_cond.notify_all()

    def _queue_write(self, key: str, seq: int | None, later: bool = False) -> None:
        """Queue a write-back of ``key``'s version ``seq``, or with ``seq`` None an fsync of the
        file ``key`` and its directory; ``later``: ``LATER_SECONDS`` from now (call with the
        lock held)."""
        self.queued += 1
        self.pending.add(self.queued)
        if later:
            self.later.put((time.monotonic() + LATER_SECONDS, self.queued, key, seq))
        else:
            self.writes.put((self.queued, key, seq))

    def _later_loop(self) -> None:
        """Hand each later write to the writers when it is due, or at once while a flush waits
        or the store closes."""
        while True:
            item = self.later.get()
            if item is None:
                return
            due, *write = item
            with self.lock:
                while not (self.hurrying or self.closing) and time.monotonic() < due:
                    self.hurry.wait(due - time.monotonic())
            self.writes.put(tuple(write))

    def _sync_file(self, file: pathlib.Path) -> None:
        """fsync a file written without ``sync``, then its directory; a file replaced or
        removed since is its successor's to sync (or gone: nothing to keep)."""
        try:
            fd = os.open(file, os.O_RDONLY)
        except FileNotFoundError:
            return
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        self._sync_dir(file.parent)

    def _write_back(self, key: str, seq: int) -> None:
        """Write ``key``'s newest version (``seq`` or a later one: those replaced are never
        written, and a key replaced at every push is still written one write behind)."""
        with self.lock:
            held, entry = self.memory.get(key), self.index.get(key)
            if held is None or entry is None or held[0] != entry.seq or entry.on_disk:
                return  # deleted, or its newest version is on disk already
            seq, data = entry.seq, held[1]
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
            consumed = self._on_disk(key, seq)
        self._sync_dir(self.objects_dir)
        self.remove(consumed)

    def flush(self) -> None:
        """Wait until every object acknowledged before this call is on disk (later puts do not
        hold it up); write-backs that failed are retried once, then reported."""
        with self.lock:
            self.hurrying += 1
            self.hurry.notify_all()
        try:
            self._flush()
        finally:
            with self.lock:
                self.hurrying -= 1

    def _flush(self) -> None:
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
                unsynced, self.unsynced = self.unsynced, {}
            if unsynced:
                raise StoreError(f"fsyncs behind their writes failed: {unsynced}", "disk")
            if not failed:
                return
        paths = {self.index[k].info.path: e for k, e in failed.items() if k in self.index}
        raise StoreError(f"disk writes failed (the objects stay in memory only): {paths}", "disk")

    # -- operations -----------------------------------------------------------------------------

    def _put(
        self,
        info: ObjectInfo,
        data: np.ndarray,
        durable: bool,
        sync: bool = True,
        later: bool = False,
    ) -> None:
        """Store an object. It replaces the objects of its path it conflicts with: another
        global shape or dtype (another array), or a box that overlaps its own (stale bytes);
        disjoint boxes of the same array are its siblings and stay. ``durable``: its file is
        written before this returns, fsynced now if ``sync``, else behind (later); else it is
        written back, ``later`` if asked."""
        key = _key("array", info.path, info.box)
        with self.lock:
            if self.closing:
                raise StoreError("the store is shutting down; nothing stored", "unavailable")
            dropped = self._drop_conflicts(key, info)
            self.seq += 1
            seq = self.seq
            # the memory tier may hold it if it fits next to the objects not yet on disk
            room = self.memory_bytes - self.dirty_bytes + self.dirty.get(key, 0)
            in_memory = not durable and len(data) <= room
            if in_memory:
                self._clean(key)
                self._remember(key, seq, data)
                self._index_set(key, Entry(info, seq, on_disk=False))
                self.dirty[key] = len(data)
                self.dirty_bytes += len(data)
                self._evict()
                self.failed.pop(key, None)
                self._queue_write(key, seq, later)
        if dropped:  # the conflicting objects stay gone after a crash of the machine
            self._sync_dir(self.objects_dir)
        if in_memory:
            return
        tmp = self._write_tmp(info.to_json(), data, sync)  # write-through
        with self.lock:
            entry = self.index.get(key)
            if entry is not None and entry.seq > seq:
                tmp.unlink(missing_ok=True)  # a newer put of the same key won
                return
            os.replace(tmp, self.objects_dir / f"{key}.obj")
            if not sync:
                self._queue_write(str(self.objects_dir / f"{key}.obj"), None, later=True)
            self._index_set(key, Entry(info, seq, on_disk=True))
            self._clean(key)
            self.failed.pop(key, None)
            self._forget(key)
            if len(data) <= self.memory_bytes:
                self._remember(key, seq, data)
                self._evict()
            consumed = self._on_disk(key, seq)
        if sync:
            self._sync_dir(self.objects_dir)
        self.remove(consumed)

    def receive_file(self, info: ObjectInfo, chunks) -> tuple[pathlib.Path, str]:
        """Write an object too large to hold in memory straight to a tmp file as its bytes
        arrive (``chunks``); (the file, the data's checksum). ``put_file`` makes it visible."""
        header = {**info.to_json(), "checksum": None}
        return self._write_chunks(header, chunks)

    def _put_file(self, info: ObjectInfo, tmp: pathlib.Path) -> None:
        """Make a complete tmp file of ``info`` the object (it replaces what it conflicts with,
        as ``put``); the newest install of a key wins."""
        key = _key("array", info.path, info.box)
        with self.lock:
            if self.closing:
                tmp.unlink(missing_ok=True)
                raise StoreError("the store is shutting down; nothing stored", "unavailable")
            self._drop_conflicts(key, info)
            self.seq += 1
            os.replace(tmp, self.objects_dir / f"{key}.obj")
            self._forget(key)
            self._clean(key)
            self.failed.pop(key, None)
            self._index_set(key, Entry(info, self.seq, on_disk=True))
            consumed = self._on_disk(key, self.seq)
        self._sync_dir(self.objects_dir)
        self.remove(consumed)

    def stream(self, key: str, box: boxes.Box, chunk_bytes: int = STREAM_CHUNK_BYTES):
        """The bytes of ``box`` of an object on disk, in C order, as pieces read a chunk at a
        time (at most ``chunk_bytes`` held at once). The whole file is read, so that its checksum
        is checked: after the last piece, a file that fails raises ``StoreError`` ("corrupt"),
        is set aside and is no longer served."""
        with self.lock:
            entry = self.index.get(key)
        if entry is None:
            raise StoreError("the object was deleted before it was read", "not_found")
        info, file = entry.info, self.objects_dir / f"{key}.obj"
        dtype = wire.dtype_of(info.dtype)
        # a scalar is read as the one element of a 1-d array (the same bytes)
        shape, item = info.shape or (1,), dtype.itemsize
        local = boxes.index(box, info.box)[1:] or (slice(0, 1),)  # the sub-box, object coords
        # split along the first axis whose trailing block fits a chunk (the last one at worst):
        # each read is contiguous, ``step`` indices of that axis
        last = len(shape) - 1
        axis = next(
            k
            for k in range(last + 1)
            if k == last or math.prod(shape[k + 1 :]) * item <= chunk_bytes
        )
        inner = math.prod(shape[axis + 1 :]) * item
        step = max(1, chunk_bytes // inner)
        crc = 0
        try:
            with open(file, "rb") as f:
                header = self._header_of(f)
                if header != info.to_json():
                    raise ValueError("the file holds another version than the index")
                start = f.tell()
                for lead in itertools.product(*(range(n) for n in shape[:axis])):
                    for j in range(0, shape[axis], step):
                        rows = min(step, shape[axis] - j)
                        flat = int(np.ravel_multi_index(lead + (j,), shape[: axis + 1]))
                        f.seek(start + flat * inner)
                        raw = f.read(rows * inner)
                        if len(raw) != rows * inner:
                            raise ValueError(f"the file ends {len(raw)} bytes into a read")
                        crc = checksums.crc32(raw, crc)
                        wanted = _piece(raw, dtype, lead, j, rows, shape, axis, local)
                        if wanted is not None:
                            yield wanted
                if f.read(1):
                    raise ValueError("the file holds more bytes than its header says")
            if checksums.text(crc) != info.checksum:
                raise ValueError(f"checksum {checksums.text(crc)}, its header says {info.checksum}")
        except (OSError, ValueError, struct.error) as error:
            raise self._corrupt(key, entry, repr(error)) from None

    def _corrupt(self, key: str, entry: Entry, why: str) -> StoreError:
        """Set ``entry``'s file aside (unless the index holds another version); the error."""
        with self.lock:
            if self.index.get(key) is entry:
                self._index_del(key)
                self._set_aside(self.objects_dir / f"{key}.obj", why)
        info = entry.info
        return StoreError(
            f"object {info.path!r} box {info.box} is corrupt on disk ({why}); it is not served",
            "corrupt",
        )

    def _drop_conflicts(self, key: str, info: ObjectInfo) -> int:
        """Remove the objects ``info`` replaces (call with the lock held); how many."""
        dropped = 0
        for other_key in list(self.by_path.get(info.path, ())):
            other = self.index[other_key].info
            if other_key == key:
                continue
            overlap = all(lo < hi for lo, hi in boxes.intersect(other.box, info.box))
            if (other.global_shape, other.dtype) != (info.global_shape, info.dtype) or overlap:
                self._index_del(other_key)
                (self.objects_dir / f"{other_key}.obj").unlink(missing_ok=True)
                dropped += 1
        return dropped

    def info(self, key: str) -> tuple[ObjectInfo, bool]:
        """An object's record, and whether its bytes are in the memory tier (objects not yet
        on disk always are)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                raise StoreError("the object was deleted before it was read", "not_found")
            held = self.memory.get(key)
            return entry.info, held is not None and held[0] == entry.seq

    def find(self, path: str, box: boxes.Box | None) -> str:
        """The key of the object under ``path`` that contains ``box`` (None: the whole array)."""
        with self.lock:
            candidates = [self.index[k].info for k in self.by_path.get(path, ())]
        if not candidates:
            raise StoreError(f"no object at path {path!r}", "not_found")
        if box is None:
            box = boxes.full(candidates[0].global_shape)
        holding = [i for i in candidates if boxes.contains(i.box, box)]
        if not holding:
            stored = sorted(i.box for i in candidates)
            raise StoreError(
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
                    raise StoreError("the object was deleted while it was read", "not_found")
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
                    raise StoreError(
                        f"object {entry.info.path!r} box {entry.info.box} is corrupt on disk "
                        f"({failure}); it is not served",
                        "corrupt",
                    )
                if len(data) <= self.memory_bytes:
                    self._remember(key, entry.seq, data)
                    self._evict()
                return entry, data
        raise StoreError("the object kept changing while it was read", "busy")

    def _on_disk(self, key: str, seq: int) -> list[str]:
        """The stages consumed into versions up to ``seq`` of ``key``, which is on disk now (call
        with the lock held; ``remove`` them once the directory is synced)."""
        waiting = self.consumed.pop(key, [])
        later = [(s, path) for s, path in waiting if s > seq]
        if later:
            self.consumed[key] = later
        return [path for s, path in waiting if s <= seq]

    def remove(self, paths: list[str]) -> None:
        """Remove the array objects at exactly these paths (not a prefix: ``delete``)."""
        if not paths:
            return
        with self.lock:
            keys = [k for path in paths for k in list(self.by_path.get(path, ()))]
            for key in keys:
                self._index_del(key)
                (self.objects_dir / f"{key}.obj").unlink(missing_ok=True)
        if keys:
            self._sync_dir(self.objects_dir)

    def list(self, prefix: str) -> list[ObjectInfo]:
        with self.lock:
            infos = [e.info for e in self.index.values() if e.info.path.startswith(prefix)]
        return sorted(infos, key=lambda i: (i.path, i.box))

    def _write_highest(self) -> None:
        """Keep the highest JSON version handed out in ``json/HIGHEST`` (durably, before the
        files that hold it are deleted): a restarted store hands out higher ones even when its
        clock stepped back (call with the lock held)."""
        tmp = self.json_dir / f"{HIGHEST}.tmp"
        with open(tmp, "w") as f:
            f.write(str(self.version))
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, self.json_dir / HIGHEST)

    def delete(self, prefix: str) -> int:
        with self.lock:
            keys = [k for k, e in self.index.items() if e.info.path.startswith(prefix)]
            for key in keys:
                self._index_del(key)
                (self.objects_dir / f"{key}.obj").unlink(missing_ok=True)
            paths = [p for p in self.json if p.startswith(prefix)]
            if paths:  # versions only grow, also past a restart without these files
                self._write_highest()
            for path in paths:
                del self.json[path]
                self.versions.pop(path, None)
                self.json_rids.pop(path, None)
                self.json_slots.pop(path, None)
                (self.json_dir / f"{_key('json', path)}.obj").unlink(missing_ok=True)
            if paths:
                self.json_changed.notify_all()
        if keys or paths:  # so that deleted objects stay deleted after a crash of the machine
            self._sync_dir(self.objects_dir)
            self._sync_dir(self.json_dir)
        return len(keys) + len(paths)

    def written_by(self, path: str, rid: str | None) -> int | None:
        """The version of JSON object ``path`` that request ``rid`` wrote, if it is one of the
        object's last ``RIDS_KEPT`` writes (known across a restart: they are in its file)."""
        # no lock: each path's ids are replaced whole (atomic under the GIL)
        return self.json_rids.get(path, {}).get(rid) if rid else None

    def _write_json(self, path: str, data: np.ndarray, rid: str | None, sync: bool = True) -> int:
        """Write a JSON object's file with a new version, fsynced now if ``sync``, else behind;
        the version. Its header keeps the ids of the last ``RIDS_KEPT`` requests that wrote it
        (``[rid, version]``), so that a request tried again after a restart of the store is
        known as done."""
        with self.lock:
            # above every version this store has handed out, and above the wall clock's
            # microseconds: a store restarted without the file of its highest version (deleted)
            # still never repeats one
            self.version = version = max(self.version + 1, time.time_ns() // 1000)
            rids = [*self.json_rids.get(path, {}).items(), *([(rid, version)] if rid else [])]
        header = {
            "path": path,
            "nbytes": len(data),
            "checksum": wire.checksum(data),
            "version": version,
            "rids": [list(pair) for pair in rids[-RIDS_KEPT:]],
        }
        record, file = slots.record(header, data), self.json_dir / f"{_key('json', path)}.obj"
        with self.lock:
            at = self.json_slots.get(path)
            fd = None
            if at is not None and len(record) <= at[1]:
                with contextlib.suppress(FileNotFoundError):
                    fd = os.open(file, os.O_WRONLY)
        if fd is not None:  # in place, into the slot not holding the newest version
            try:
                slots.write(fd, record, 1 - at[0], at[1], sync)
            finally:
                os.close(fd)
            with self.lock:
                if self.json_slots.get(path) == at:  # else deleted meanwhile: a new file
                    self._json_written(path, (1 - at[0], at[1]), len(data), version, rids, sync)
                    return version
        size = slots.slot_bytes(len(record))  # a new file: written under tmp/, renamed in
        tmp = self.tmp_dir / f"{uuid.uuid4().hex}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.ftruncate(fd, 2 * size)
            slots.write(fd, record, 0, size, sync)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        finally:
            os.close(fd)
        with self.lock:
            os.replace(tmp, file)
            self._json_written(path, (0, size), len(data), version, rids, sync)
        if sync:
            self._sync_dir(self.json_dir)
        return version

    def _json_written(self, path, at, nbytes, version, rids, sync) -> None:
        """Index a JSON object's version just written into slot ``at`` (call with the lock)."""
        self.json[path], self.versions[path], self.json_slots[path] = nbytes, version, at
        self.json_rids[path] = dict(rids[-RIDS_KEPT:])
        self.json_changed.notify_all()
        if not sync:
            file = self.json_dir / f"{_key('json', path)}.obj"
            self._queue_write(str(file), None, later=True)

    def wait_json(self, path: str, version: int, timeout: float, gone=None) -> None:
        """Return once JSON object ``path`` is another version than ``version`` (written since,
        or deleted), the store closes, ``timeout`` seconds have passed, or ``gone()`` (asked
        every quarter of a second: the waiting client left) is true."""
        deadline = time.monotonic() + timeout
        with self.json_changed:
            while self.versions.get(path) == version and not self.closing:
                left = deadline - time.monotonic()
                if left <= 0 or (gone is not None and gone()):
                    return
                self.json_changed.wait(left if gone is None else min(left, 0.25))

    def json_bytes(self, path: str) -> int:
        with self.lock:
            nbytes = self.json.get(path)
        if nbytes is None:
            raise StoreError(f"no JSON object at path {path!r}", "not_found")
        return nbytes

    def get_json(self, path: str) -> tuple[dict, np.ndarray]:
        """A JSON object's file header (its version, the ids of its last writes) and bytes, read
        from its file (JSON objects are not held in memory) and checked; a file that fails is
        set aside and the object is gone."""
        file = self.json_dir / f"{_key('json', path)}.obj"
        for _ in range(JSON_READS):
            with self.lock:  # the file and the slot of one version
                version, at = self.versions.get(path), self.json_slots.get(path)
                try:
                    fd = os.open(file, os.O_RDONLY) if path in self.json else None
                except FileNotFoundError:
                    fd = None
            if fd is None:
                raise StoreError(f"no JSON object at path {path!r}", "not_found")
            try:
                with open(fd, "rb") as f:
                    header, data, _ = self._json_of(f, None if at is None else at[0])
                if header.get("path") != path:
                    raise ValueError(f"the file holds {header.get('path')!r}")
            except (OSError, ValueError, KeyError, TypeError, struct.error) as error:
                with self.lock:
                    if self.versions.get(path) != version:
                        continue  # its slot was written again while it was read
                    self.json.pop(path, None)
                    self._set_aside(file, repr(error))
                raise StoreError(
                    f"JSON object {path!r} is corrupt on disk ({error!r}); it is not served",
                    "corrupt",
                ) from None
            return header, np.frombuffer(data, np.uint8)
        raise StoreError(f"JSON object {path!r} rewritten as it was read, {JSON_READS}x", "busy")

    def close(self) -> None:
        """Refuse further puts, write every object still only in memory, stop the writer."""
        with self.lock:
            self.closing = True
            self.json_changed.notify_all()
            self.hurry.notify_all()
        self.later.put(None)
        self.later_thread.join()
        for _ in self.writers:
            self.writes.put(None)
        for writer in self.writers:
            writer.join()
