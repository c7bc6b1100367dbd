"""Whole arrays read through shared memory by clients on the store's host (docs/multihost.md,
"Shared reads", states the rules): a mapping the reader keeps and copies out of comes near a
memcpy, which no reply over a socket does.

A *segment* is a file in ``/dev/shm`` (else under ``DIR``) holding an array's current version
after a small header (magic, state, the version's sequence number, its bytes). The store writes
it holding an exclusive ``flock``, a reader copies holding a shared one (the lock is also the
memory barrier between the processes). A store killed while it writes leaves the segment in the
*writing* state, which no reader uses; a version newer than the one the store named fails the
reader's check, and it asks again. A segment's file never changes size (a new size is a new
file), so no reader's mapping ever loses its pages; files are 0600 in a 0700 directory named
with the store's pid, whose leftovers the next store on the host removes.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import hashlib
import itertools
import mmap
import os
import pathlib
import shutil
import struct
import threading
import uuid

import numpy as np

from tenplex_jax._src.errors import StoreError

MAGIC = b"TPXS"
HEADER = struct.Struct("!4sIQQ")  # magic, state, the version's sequence number, data bytes
DATA_OFFSET = 4096  # the data starts on a page of its own
WRITING, VALID = 1, 2
SHM = "/dev/shm"
PREFIX = "tenplex-segments-"  # + the store's pid and a random part, in SHM (else DIR/PREFIX)
READER_MAPPINGS = 256  # segments a client keeps mapped, least recently used closed first


class _Segment:
    """One segment's file and mapping. A write and the removal take turns (``lock``): a path
    deleted while its update rewrites the segment ends that write, not the store's reply."""

    def __init__(self, file: pathlib.Path, nbytes: int):
        self.file, self.nbytes, self.seq = file, nbytes, -1
        self.lock, self.closed = threading.Lock(), False
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, DATA_OFFSET + nbytes)
            self.map = mmap.mmap(fd, DATA_OFFSET + nbytes)
        except BaseException:
            os.close(fd)
            file.unlink(missing_ok=True)
            raise
        self.fd = fd

    def write(self, seq: int, data: np.ndarray) -> None:
        with self.lock:
            if self.closed:
                raise StoreError(f"{self.file.name}: removed (its array was deleted)", "not_found")
            fcntl.flock(self.fd, fcntl.LOCK_EX)
            try:
                HEADER.pack_into(self.map, 0, MAGIC, WRITING, 0, self.nbytes)
                self.map[DATA_OFFSET : DATA_OFFSET + self.nbytes] = memoryview(data).cast("B")
                HEADER.pack_into(self.map, 0, MAGIC, VALID, seq, self.nbytes)
                self.seq = seq
            finally:
                fcntl.flock(self.fd, fcntl.LOCK_UN)

    def close(self) -> None:
        with self.lock:
            self.closed = True
            self.map.close()
            os.close(self.fd)
            self.file.unlink(missing_ok=True)


class Segments:
    """A store's segments, by path (thread-safe; call :meth:`publish` under the path's lock)."""

    def __init__(self, directory: pathlib.Path, limit: int):
        shm = pathlib.Path(SHM)
        if shm.is_dir() and os.access(shm, os.W_OK):  # memory alone: no write-back to a disk
            _collect(shm)
            self.dir = shm / f"{PREFIX}{os.getpid()}-{uuid.uuid4().hex}"
        else:  # in the page cache of DIR's file system
            shutil.rmtree(directory / PREFIX, ignore_errors=True)  # a killed store's
            self.dir = directory / PREFIX
        # a file name is never used twice (a counter, a directory per store process): a
        # reader's mapping of an earlier file, kept under its name, is never taken for a later one
        self.dir.mkdir(mode=0o700)
        self._names = itertools.count()
        self.limit, self.used = limit, 0
        self._by_path: dict[str, _Segment] = {}
        self._lock = threading.Lock()

    def has(self, path: str) -> bool:
        return path in self._by_path

    def publish(self, path: str, seq: int, data: np.ndarray) -> str:
        """The file of ``path``'s segment, holding version ``seq`` (``data``) once this returns.

        Raises:
          StoreError: ``"too_large"``: the segments would pass the store's memory tier's size.
        """
        nbytes = memoryview(data).nbytes
        with self._lock:
            segment = self._by_path.get(path)
            if segment is not None and segment.nbytes != nbytes:  # a new size is a new file
                self._drop(path)
                segment = None
            if segment is None:
                if self.used + nbytes > self.limit:
                    raise StoreError(
                        f"a segment for {path!r} ({nbytes} bytes) would pass the "
                        f"{self.limit} bytes segments may hold (the memory tier's size)",
                        "too_large",
                    )
                name = f"{next(self._names)}-{hashlib.sha256(path.encode()).hexdigest()[:16]}"
                segment = _Segment(self.dir / name, nbytes)
                self._by_path[path] = segment
                self.used += nbytes
        if segment.seq != seq:
            segment.write(seq, data)
        return str(segment.file)

    def drop(self, prefix: str) -> None:
        """Remove the segments of the paths under ``prefix`` (their arrays were deleted)."""
        with self._lock:
            for path in [p for p in self._by_path if p.startswith(prefix)]:
                self._drop(path)

    def _drop(self, path: str) -> None:
        segment = self._by_path.pop(path)
        self.used -= segment.nbytes
        segment.close()

    def close(self) -> None:
        with self._lock:
            for path in list(self._by_path):
                self._drop(path)
        shutil.rmtree(self.dir, ignore_errors=True)


def _collect(shm: pathlib.Path) -> None:
    """Remove the segments of store processes that died without removing them (SIGKILL); a
    directory another store starting at once removes first is passed over, never an error."""
    for stale in shm.glob(f"{PREFIX}*-*"):
        pid = stale.name[len(PREFIX) :].split("-")[0]
        try:
            if not pid.isdigit() or stale.lstat().st_uid != os.getuid() or not stale.is_dir():
                continue
            os.kill(int(pid), 0)
        except ProcessLookupError:  # its store is dead
            shutil.rmtree(stale, ignore_errors=True)
        except OSError:  # removed meanwhile, alive (another user's), or not ours to ask about
            continue


class Reader:
    """A client's mappings of its stores' segments (thread-safe)."""

    def __init__(self):
        self._maps: collections.OrderedDict[str, tuple[int, mmap.mmap]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def read(self, file: str, seq: int, out: np.ndarray) -> bool | None:
        """Copy version ``seq`` out of the segment ``file`` into ``out`` (C-contiguous, of the
        segment's bytes): True; False, with ``out`` unspecified, when the segment does not hold
        that version whole; None when it cannot be opened here. One read at a time: a mapping
        is never closed under a copy."""
        with self._lock:
            try:
                fd, mapping = self._open(file)
            except (OSError, ValueError):
                return None
            fcntl.flock(fd, fcntl.LOCK_SH)
            try:
                magic, state, held, nbytes = HEADER.unpack_from(mapping, 0)
                if (magic, state, held, nbytes) != (MAGIC, VALID, seq, out.nbytes):
                    return False
                with memoryview(mapping) as whole:
                    src = np.frombuffer(whole[DATA_OFFSET : DATA_OFFSET + nbytes], np.uint8)
                    np.copyto(out.reshape(-1).view(np.uint8), src)
                    del src  # the mapping's export ends with the view
                return True
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)

    def _open(self, file: str) -> tuple[int, mmap.mmap]:
        """The mapping of ``file``, opened now if it is not yet (call with the lock held)."""
        if file in self._maps:
            self._maps.move_to_end(file)
            return self._maps[file]
        fd = os.open(file, os.O_RDONLY)
        try:
            size = os.fstat(fd).st_size
            if size < DATA_OFFSET:
                raise OSError(f"{file}: {size} bytes, not a segment")
            mapping = mmap.mmap(fd, size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        self._maps[file] = (fd, mapping)
        while len(self._maps) > READER_MAPPINGS:
            _close(*self._maps.popitem(last=False)[1])
        return fd, mapping

    def forget(self, file: str) -> None:
        """Close the mapping of ``file`` (the store named another file for its array)."""
        with self._lock:
            entry = self._maps.pop(file, None)
            if entry is not None:
                _close(*entry)

    def close(self) -> None:
        with self._lock:
            while self._maps:
                _close(*self._maps.popitem()[1])


def _close(fd: int, mapping: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view left by a failed copy: the mapping leaks
        mapping.close()
    os.close(fd)
