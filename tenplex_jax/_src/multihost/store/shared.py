"""Whole arrays read through shared memory by clients on the store's host (docs/multihost.md,
"Shared reads", states the rules): a mapping the reader keeps and copies out of comes near a
memcpy, which no reply over a socket does.

A *segment* is a file in ``/dev/shm`` (``--shm``) holding an array's current version after a
small header (magic, state, the store's epoch, the version's sequence number, its bytes). The
store writes it holding an exclusive ``flock``, a reader copies holding a shared one (the lock is
also the memory barrier between the processes). A store killed while it writes leaves the segment
in the *writing* state, which no reader uses; a version other than the one the store named (an
older or newer sequence number, or another store process's epoch), or bytes other than those the
store wrote for it (their digest, in the reply), fails the reader's check, and it asks again.
A segment's file never changes size (a new size is a new file), and its pages are
allocated when it is created: shared memory that runs out refuses a segment (the client reads
over the socket), never faults a process later. Files are 0600 in a 0700 directory named with
the store's pid and epoch, whose leftovers the next store on the host removes. Without a writable
shared-memory directory the store shares nothing, and its clients read over the socket.
"""

from __future__ import annotations

import collections
import contextlib
import errno
import fcntl
import hashlib
import itertools
import json
import mmap
import os
import pathlib
import shutil
import stat
import struct
import sys
import threading
import time

import numpy as np
import xxhash

from tenplex_jax._src.errors import StoreError

MAGIC = b"TPXS"
HEADER = struct.Struct("!4sIQQQ")  # magic, state, epoch, the version's sequence number, bytes
# after it, the version's own record: its digest (XXH3) and the bytes of its clocks' JSON, which
# follow; a reader that knows the segment reads a version with no request (``Reader.current``)
RECORD = struct.Struct("!QI")
RECORD_OFFSET = 64
CLOCKS_OFFSET = RECORD_OFFSET + RECORD.size
DATA_OFFSET = 4096  # the data starts on a page of its own
NO_CLOCKS = 0xFFFFFFFF  # clocks too long for the header page: a reader asks the store
WRITING, VALID = 1, 2
SHM = "/dev/shm"
PREFIX = "tenplex-segments-"  # + the store's pid and its epoch, in SHM
LOCK_SECONDS = 2.0  # the longest a store or a reader waits for a segment's lock
LIFE_LOCK = "LOCK"  # in a store's segment directory, flocked for the store process's life
COPY_CHUNK_BYTES = 1 << 20  # a reader copies and checks this much at a time
SHM_RESERVE_BYTES = 16 << 20  # shared memory segments leave free for the rest of the host
READER_MAPPINGS = 256  # segments a client keeps mapped, least recently used closed first


class _Segment:
    """One segment's file and mapping, its pages allocated up front. A write and the removal
    take turns (``lock``): a path deleted while its update rewrites the segment ends that write,
    not the store's reply."""

    def __init__(self, file: pathlib.Path, nbytes: int, epoch: int):
        self.file, self.nbytes, self.epoch, self.seq, self.digest = file, nbytes, epoch, -1, ""
        self.lock, self.closed = threading.Lock(), False
        fd = os.open(file, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.posix_fallocate(fd, 0, DATA_OFFSET + nbytes)  # ENOSPC now, not SIGBUS later
            self.map = mmap.mmap(fd, DATA_OFFSET + nbytes)
        except BaseException:
            os.close(fd)
            file.unlink(missing_ok=True)
            raise
        self.fd = fd

    def write(self, seq: int, data: np.ndarray, clocks: bytes = b"") -> None:
        """Version ``seq`` (``data``, whose clocks' JSON is ``clocks``) into the segment, and its
        digest into ``self.digest``."""
        with self.lock:
            if self.closed:
                raise StoreError(f"{self.file.name}: removed (its array was deleted)", "not_found")
            if os.fstat(self.fd).st_size != DATA_OFFSET + self.nbytes:  # cut by another process
                raise StoreError(f"{self.file.name}: truncated under the store", "corrupt")
            if not _flock_within(self.fd, fcntl.LOCK_EX, LOCK_SECONDS):
                raise StoreError(
                    f"{self.file.name}: a reader held it for {LOCK_SECONDS:g} s (stopped?)", "busy"
                )
            try:
                HEADER.pack_into(self.map, 0, MAGIC, WRITING, self.epoch, 0, self.nbytes)
                with memoryview(self.map) as whole:
                    dst = np.frombuffer(whole[DATA_OFFSET : DATA_OFFSET + self.nbytes], np.uint8)
                    digest = copy_digest(dst, np.frombuffer(memoryview(data).cast("B"), np.uint8))
                    del dst  # the mapping's export ends with the view
                fits = CLOCKS_OFFSET + len(clocks) <= DATA_OFFSET
                RECORD.pack_into(
                    self.map, RECORD_OFFSET, _digest_int(digest), len(clocks) if fits else NO_CLOCKS
                )
                if fits:
                    self.map[CLOCKS_OFFSET : CLOCKS_OFFSET + len(clocks)] = clocks
                HEADER.pack_into(self.map, 0, MAGIC, VALID, self.epoch, seq, self.nbytes)
                self.seq, self.digest = seq, digest
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

    def __init__(self, limit: int, shm: str | None = SHM, max_segments: int = 1 << 30):
        # a store process's own epoch, in its directory's name, every segment's header and every
        # reply naming a segment: a file or a version of an earlier store is never taken for one
        # of this store's, whatever the names and sequence numbers
        self.epoch = int.from_bytes(os.urandom(8), "big") >> 1
        self.limit, self.used, self.max_segments = limit, 0, max_segments
        self._names = itertools.count()
        self._by_path: dict[str, _Segment] = {}
        self._lock = threading.Lock()
        self._said_full = False
        self.dir: pathlib.Path | None = None
        if shm and os.path.isdir(shm) and os.access(shm, os.W_OK):  # memory alone, no disk
            _collect(pathlib.Path(shm))
            self.dir = pathlib.Path(shm) / f"{PREFIX}{os.getpid()}-{self.epoch:016x}"
            self.dir.mkdir(mode=0o700)
            self._life = os.open(self.dir / LIFE_LOCK, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
            fcntl.flock(self._life, fcntl.LOCK_EX)  # released by the kernel when this process ends
        else:
            _say(f"no writable shared memory at {shm!r}: clients on this host read over the socket")

    def has(self, path: str) -> bool:
        return path in self._by_path

    def publish(self, path: str, seq: int, data: np.ndarray, clocks=()) -> tuple[str, str]:
        """The file of ``path``'s segment, holding version ``seq`` (``data``, with its
        ``clocks``: ``ObjectInfo.clocks``) once this returns, and the version's digest there
        (:func:`copy_digest`).

        Raises:
          StoreError: ``"too_large"``: the segments would pass the store's memory tier's size, or
            the shared memory left free (then the client reads over the socket); ``"refused"``:
            the store has no shared memory.
        """
        if self.dir is None:
            raise StoreError("this store has no shared memory", "refused")
        nbytes = memoryview(data).nbytes
        with self._lock:
            segment = self._by_path.get(path)
            if segment is not None and segment.nbytes != nbytes:  # a new size is a new file
                self._drop(path)
                segment = None
            if segment is None:
                segment = self._create(path, nbytes)
        record = json.dumps(dict(clocks), separators=(",", ":")).encode()
        if segment.seq != seq:
            try:
                segment.write(seq, data, record)
            except StoreError as error:
                if error.reason not in ("corrupt", "busy"):
                    raise
                # cut short, or held by a stopped reader: a new file for this version (the
                # reader keeps its mapping of the old one, whose version is no longer named)
                with self._lock:
                    if self._by_path.get(path) is segment:
                        self._drop(path)
                    segment = self._create(path, nbytes)
                segment.write(seq, data, record)
        return str(segment.file), segment.digest

    def withdraw(self, path: str) -> None:
        """Remove ``path``'s segment, if it has one: its array has a newer version that the
        segment does not hold (a reader that kept the file finds it unlinked, and asks)."""
        with self._lock:
            if path in self._by_path:
                self._drop(path)

    def _create(self, path: str, nbytes: int) -> _Segment:
        """A new segment for ``path`` (call with the lock held), within the memory tier's size
        and the shared memory left free."""
        if self.used + nbytes > self.limit:
            raise StoreError(
                f"a segment for {path!r} ({nbytes} bytes) would pass the {self.limit} bytes "
                f"segments may hold (the memory tier's size)",
                "too_large",
            )
        if len(self._by_path) >= self.max_segments:  # two file descriptors each
            self._full(f"{self.max_segments} segments, the file descriptors they may hold")
        free = _free_bytes(self.dir)
        if DATA_OFFSET + nbytes + SHM_RESERVE_BYTES > free:
            self._full(f"{free} bytes free, a segment of {nbytes} bytes wanted")
        name = f"{next(self._names)}-{hashlib.sha256(path.encode()).hexdigest()[:16]}"
        try:
            segment = _Segment(self.dir / name, nbytes, self.epoch)
        except OSError as error:
            if error.errno not in (errno.ENOSPC, errno.ENOMEM, errno.EFBIG):
                raise StoreError(f"segment for {path!r}: {error}", "disk") from None
            self._full(f"{error.strerror} for a segment of {nbytes} bytes")
        self._by_path[path] = segment
        self.used += nbytes
        return segment

    def _full(self, why: str):
        if not self._said_full:  # once per store: clients read over the socket meanwhile
            self._said_full = True
            _say(f"shared memory {self.dir.parent} is full ({why}): reads go over the socket")
        raise StoreError(f"the segments are full: {why}", "too_large")

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
        if self.dir is not None:
            shutil.rmtree(self.dir, ignore_errors=True)
            os.close(self._life)


def _free_bytes(directory: pathlib.Path) -> int:
    fs = os.statvfs(directory)
    return fs.f_bavail * fs.f_frsize


def _say(line: str) -> None:
    print(f"tenplex_jax.multihost.store: {line}", file=sys.stderr, flush=True)


def _collect(shm: pathlib.Path) -> None:
    """Remove the segments of store processes that died without removing them (SIGKILL): a
    directory is dead when its life lock can be taken, which holds in any PID namespace sharing
    the directory (a pid would not). A directory without one (being made, or not a store's) is
    left, and one another store removes meanwhile is passed over, never an error."""
    for stale in shm.glob(f"{PREFIX}*-*"):
        try:
            if stale.lstat().st_uid != os.getuid() or not stale.is_dir():
                continue
            fd = os.open(stale / LIFE_LOCK, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
        except OSError:  # removed meanwhile, not ours, or no life lock (yet)
            continue
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # its store is alive
            continue
        else:
            shutil.rmtree(stale, ignore_errors=True)
        finally:
            os.close(fd)


def _flock_within(fd: int, kind: int, seconds: float) -> bool:
    """``flock(fd, kind)`` taken within ``seconds``: whether it was (a holder stopped or frozen
    costs the waiter this long, never more)."""
    deadline, pause = time.monotonic() + seconds, 0.0005
    while True:
        try:
            fcntl.flock(fd, kind | fcntl.LOCK_NB)
            return True
        except BlockingIOError:
            if time.monotonic() >= deadline:
                return False
            time.sleep(pause)
            pause = min(2 * pause, 0.02)


class Reader:
    """A client's mappings of its stores' segments (thread-safe)."""

    def __init__(self):
        self._maps: collections.OrderedDict[str, tuple[int, mmap.mmap]] = collections.OrderedDict()
        self._lock = threading.Lock()

    def read(self, file: str, epoch: int, seq: int, digest: str, out: np.ndarray) -> bool | None:
        """Copy version ``seq`` of the store process ``epoch`` out of the segment ``file`` into
        ``out`` (C-contiguous, of the segment's bytes), checked as it is copied against the
        ``digest`` the store named for that version (:func:`copy_digest`): True; False, with
        ``out`` unspecified, when the segment does not hold that version whole and unchanged (a
        segment cut short also loses its mapping); None when it cannot be opened here. One read
        at a time: a mapping is never closed under a copy."""
        with self._lock:
            try:
                fd, mapping = self._open(file)
            except (OSError, ValueError):
                return None
            cut = False
            if not _flock_within(fd, fcntl.LOCK_SH, LOCK_SECONDS):  # a store stopped mid-write
                return False
            try:
                size = os.fstat(fd).st_size  # truncated: a copy would fault
                cut = size != len(mapping) or size != DATA_OFFSET + out.nbytes
                if cut or HEADER.unpack_from(mapping, 0) != (MAGIC, VALID, epoch, seq, out.nbytes):
                    return False
                with memoryview(mapping) as whole:
                    src = np.frombuffer(whole[DATA_OFFSET:], np.uint8)
                    copied = copy_digest(out.reshape(-1).view(np.uint8), src)
                    del src  # the mapping's export ends with the view
                return copied == digest
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                if cut:
                    self._drop(file)

    def current(self, file: str, epoch: int, out: np.ndarray) -> tuple[int, str, bytes] | None:
        """Copy the version the segment ``file`` of the store process ``epoch`` holds now into
        ``out`` (C-contiguous, of the segment's bytes), with no request to the store: ``(its
        sequence number, its digest, its clocks' JSON)``, the copy checked against the digest the
        store wrote beside it; None, with ``out`` unspecified, when the segment holds no whole
        version of that store now (being written, removed or replaced, cut short, another
        store's, clocks too long for its header page, or not on this host). The caller decides
        from the clocks whether that version will do."""
        with self._lock:
            try:
                fd, mapping = self._open(file)
            except (OSError, ValueError):
                return None
            if not _flock_within(fd, fcntl.LOCK_SH, LOCK_SECONDS):
                return None
            gone = False
            try:
                st = os.fstat(fd)
                # withdrawn (a newer version is not in it), or cut short: a copy would fault
                gone = st.st_nlink == 0 or st.st_size != len(mapping)
                if gone or st.st_size != DATA_OFFSET + out.nbytes:
                    return None
                magic, state, held, seq, nbytes = HEADER.unpack_from(mapping, 0)
                if (magic, state, held, nbytes) != (MAGIC, VALID, epoch, out.nbytes):
                    return None
                digest, length = RECORD.unpack_from(mapping, RECORD_OFFSET)
                if length == NO_CLOCKS or CLOCKS_OFFSET + length > DATA_OFFSET:
                    return None
                clocks = bytes(mapping[CLOCKS_OFFSET : CLOCKS_OFFSET + length])
                with memoryview(mapping) as whole:
                    src = np.frombuffer(whole[DATA_OFFSET:], np.uint8)
                    copied = copy_digest(out.reshape(-1).view(np.uint8), src)
                    del src  # the mapping's export ends with the view
                return (seq, copied, clocks) if _digest_int(copied) == digest else None
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
                if gone:
                    self._drop(file)

    def _open(self, file: str) -> tuple[int, mmap.mmap]:
        """The mapping of ``file``, opened now if it is not yet (call with the lock held): a
        regular file of this user's (a FIFO or a device named by a false store never blocks or
        maps). Opening one drops the mappings of files their stores have removed."""
        if file in self._maps:
            self._maps.move_to_end(file)
            return self._maps[file]
        fd = os.open(file, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW)
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or st.st_uid != os.getuid():
                raise OSError(f"{file}: not a regular file of this user's")
            if st.st_size < DATA_OFFSET:
                raise OSError(f"{file}: {st.st_size} bytes, not a segment")
            mapping = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ)
        except BaseException:
            os.close(fd)
            raise
        for gone in [f for f, (held, _) in self._maps.items() if os.fstat(held).st_nlink == 0]:
            self._drop(gone)  # deleted or replaced: its pages are the reader's alone
        self._maps[file] = (fd, mapping)
        while len(self._maps) > READER_MAPPINGS:
            _close(*self._maps.popitem(last=False)[1])
        return fd, mapping

    def forget(self, file: str) -> None:
        """Close the mapping of ``file`` (the store named another file for its array)."""
        with self._lock:
            self._drop(file)

    def _drop(self, file: str) -> None:
        entry = self._maps.pop(file, None)
        if entry is not None:
            _close(*entry)

    def close(self) -> None:
        with self._lock:
            while self._maps:
                _close(*self._maps.popitem()[1])


def copy_digest(dst: np.ndarray, src: np.ndarray) -> str:
    """``src`` copied into ``dst`` (bytes of one size); the copy's digest (``"xxh3:<16 hex
    digits>"``), taken a chunk at a time while the chunk is in the cache. The store writes a
    version's bytes into its segment with it and names the digest in its reply; a reader copies
    them out with it and keeps the copy only if the digests agree. XXH3 runs at about 4x the
    crc32 (35 against 9 GB/s from the cache on the project's 2-core machine): a read checked
    with it takes 0.81-0.92 of the time of a copy alone, with the crc32 0.60-0.67
    (``benchmarks/shared_check.py``)."""
    running = xxhash.xxh3_64()
    for start in range(0, dst.size, COPY_CHUNK_BYTES):
        chunk = dst[start : start + COPY_CHUNK_BYTES]
        np.copyto(chunk, src[start : start + COPY_CHUNK_BYTES])
        running.update(chunk)
    return f"xxh3:{running.intdigest():016x}"


def _digest_int(digest: str) -> int:
    """A :func:`copy_digest` as the integer a segment's record holds."""
    return int(digest.removeprefix("xxh3:"), 16)


def _close(fd: int, mapping: mmap.mmap) -> None:
    with contextlib.suppress(BufferError):  # a view left by a failed copy: the mapping leaks
        mapping.close()
    os.close(fd)
