"""The store's read-modify-write operations: one at a time per path (a put and an accumulate of
one path never interleave: the later one wins, whole), and safe to repeat (docs/multihost.md,
"Safe to repeat" and "Shared reads", states the rules).

An accumulate's ``consume`` removes the stage once the new version is on disk, not before: after
a crash the stage is the write-ahead record of an update the array's file lacks.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
from collections.abc import Iterator, Sequence

import numpy as np

from tenplex_jax._src import box as boxes
from tenplex_jax._src import checksums
from tenplex_jax._src.errors import StoreError
from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.shared import SHM, Segments
from tenplex_jax._src.multihost.store.tiers import Tiers
from tenplex_jax._src.multihost.store.wire import ObjectInfo

ACCUMULATE_CHUNK_BYTES = 4 << 20  # an accumulate adds this much at a time
# a checked sum beside pending pushes stays this fraction below the dtype's largest value: in
# float32 the rounding of up to about 4,000 additions (each by at most 2**-24) fits in it
BOUND_MARGIN = 2.0**-12
PATH_LOCKS = 1024
# a checked bound is summed this many elements at a time, in float64 buffers small enough to be
# reused from the heap (fresh pages cost a fault each: about 7 us a page on a small VM)
BOUND_CHUNK = 4096


class Store(Tiers):
    """The store's state (:class:`Tiers`) and its read-modify-write operations. Thread-safe."""

    def __init__(
        self, directory, memory_bytes: int, shm: str | None = SHM, max_segments: int = 1 << 30
    ):
        # a fixed set of locks, a path's chosen by its hash: one per path would grow with every
        # stage a long run puts; two paths sharing one only take turns
        self.path_locks = [threading.Lock() for _ in range(PATH_LOCKS)]
        super().__init__(directory, memory_bytes)
        self.segments = Segments(memory_bytes, shm, max_segments)

    def _path_lock(self, kind: str, path: str) -> threading.Lock:
        return self.path_locks[hash((kind, path)) % PATH_LOCKS]

    # -- arrays ----------------------------------------------------------------------------------

    def put(self, info: ObjectInfo, data: np.ndarray, durable: bool, sync: bool = True) -> None:
        """Store an array object (``Tiers._put``) under its path's lock."""
        with self._path_lock("array", info.path):
            self._put(info, data, durable, sync)

    def check_stage(
        self, stage: str, into: str, name: str, beside: Sequence[tuple[str, int, str]]
    ) -> ObjectInfo:
        """Check the update just put at ``stage`` against the array ``into`` it will be added
        to, beside the pushes ``beside`` (``accumulate``'s ``check``); an update the check
        refuses (``"nonfinite"``) is removed: nothing of it stays. The array's record (its
        clocks say which of ``beside`` it holds already)."""
        try:
            return self.accumulate(into, stage, name, 0, check=True, beside=beside)[0]
        except StoreError as error:
            if error.reason == "nonfinite":
                self.remove([stage])
            raise

    def put_file(self, info: ObjectInfo, tmp) -> None:
        """Install a complete tmp file as an array object (``Tiers._put_file``) under its path's
        lock."""
        with self._path_lock("array", info.path):
            self._put_file(info, tmp)

    def _chunks(self, key: str, step: int) -> Iterator[memoryview]:
        """An object's bytes, ``step`` at a time: from the memory tier when it is there, else
        read from its file into one buffer (each chunk is valid until the next), whose checksum
        is checked after the last chunk: a file that fails is set aside (``"corrupt"``)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is None:
                raise StoreError("the object was deleted before it was read", "not_found")
            held = self.memory.get(key)
            data = held[1] if held is not None and held[0] == entry.seq else None
        if data is not None:
            view = memoryview(data)
            for at in range(0, len(data), step):
                yield view[at : at + step]
            return
        file, crc = self.objects_dir / f"{key}.obj", 0
        buf = np.empty(min(step, entry.info.nbytes), np.uint8)
        try:
            with open(file, "rb") as f:
                if self._header_of(f) != entry.info.to_json():
                    raise ValueError("the file holds another version than the index")
                for at in range(0, entry.info.nbytes, step):
                    view = memoryview(buf)[: min(step, entry.info.nbytes - at)]
                    if f.readinto(view) != len(view):
                        raise ValueError(f"the file ends {at} bytes into its data")
                    crc = checksums.crc32(view, crc)
                    yield view
                if f.read(1):
                    raise ValueError("the file holds more bytes than its header says")
            if checksums.text(crc) != entry.info.checksum:
                raise ValueError(f"checksum {checksums.text(crc)}, header {entry.info.checksum}")
        except (OSError, ValueError) as error:
            raise self._corrupt(key, entry, repr(error)) from None

    def accumulate(
        self,
        path: str,
        stage: str,
        name: str,
        clock: int,
        *,
        update: str | None = None,
        consume: bool = False,
        check: bool = False,
        in_memory: bool = True,
        keep: str | None = None,
        beside: Sequence[tuple[str, int, str]] = (),
    ) -> tuple[ObjectInfo, bool]:
        """Add the whole float array at ``stage`` into the whole array at ``path``, once per
        ``(name, clock)``: applied when the array holds exactly ``clock`` pushes of ``name``,
        refused when fewer (out of turn). When it holds more, ``applied`` says whether the push
        in is this update: push ``clock`` was ``name``'s last and its checksum is ``update``.

        ``check`` only checks that the sum would be finite now (raising ``"nonfinite"`` if not),
        whatever the clocks, changing nothing; with ``beside``, ``(name, clock, stage)`` of
        pushes that will be added too (those the array does not hold yet count), it checks
        that no order of adding them all can overflow: ``|array| + |update| + |each of them|``
        stays within the dtype's range, less a margin for rounding (:data:`BOUND_MARGIN`);
        ``consume`` removes the stage once the new version is on disk; ``in_memory=False``
        writes the sum to a file a chunk at a time (an array larger than the transfer budget);
        ``keep`` keeps the array's version before the sum as an object at that path (what
        ``revert`` puts back). Returns (the array's record, applied)."""
        with self._path_lock("array", path):
            key = self.find(path, None)
            info = self.info(key)[0]
            have = dict(info.clocks).get(name, 0)
            where = f"accumulate of {stage!r} into {path!r} by {name!r}"
            if clock < have and not check:  # in already: this push tried again, or another's
                mine = clock == have - 1 and dict(info.sources).get(name) == update
                if consume and mine:
                    self._consume(key, stage)
                return info, mine
            if clock > have and not check:
                raise StoreError(
                    f"{where}: wave {clock} is out of turn; the array holds "
                    f"{have} waves of {name!r}",
                    "refused",
                )
            skey = self.find(stage, None)
            staged = self.info(skey)[0]
            self._check_addable(info, staged, where)
            if check:
                held = dict(info.clocks)
                pending = [s for n, c, s in beside if c >= held.get(n, 0)]
                keys = [key, skey, *(self.find(s, None) for s in pending)]
                for other in keys[2:]:
                    self._check_addable(info, self.info(other)[0], where)
                if self._within(keys, wire.dtype_of(info.dtype)):
                    return info, False
            if check and beside:
                self._check_bound(keys, wire.dtype_of(info.dtype), where, len(pending))
                return info, False
            out = np.empty(info.nbytes, np.uint8) if in_memory and not check else None
            sums = self._sums(key, skey, wire.dtype_of(info.dtype), where, out)
            if check:
                collections.deque(sums, maxlen=0)  # every chunk made and checked
                return info, False
            clocks = tuple(sorted({**dict(info.clocks), name: clock + 1}.items()))
            sources = tuple(sorted({**dict(info.sources), name: staged.checksum}.items()))
            new = dataclasses.replace(info, clocks=clocks, sources=sources)
            if out is not None:
                new = self._store_sum(key, info, new, sums, out, keep)
                if consume:
                    self._consume(key, stage)
            else:
                new = self._store_sum_file(key, info, new, sums, keep)
                if consume:
                    self.remove([stage])
            return new, True

    def _within(self, keys: Sequence[str], dtype) -> bool:
        """Whether the largest magnitudes of the objects ``keys`` add up within ``dtype``'s
        largest value less :data:`BOUND_MARGIN` (False for NaN): then so does every element's
        sum, in any order. Two reductions an object, no scratch memory: a check that passes
        here is done; one that does not is checked element by element (:meth:`_check_bound`)."""
        total = 0.0
        for key in keys:
            for chunk in self._chunks(key, ACCUMULATE_CHUNK_BYTES):
                x = np.frombuffer(chunk, dtype)
                if x.size:
                    total += max(float(x.max()), -float(x.min()))
        return total <= float(np.finfo(dtype).max) * (1 - BOUND_MARGIN)

    def _check_bound(self, keys: Sequence[str], dtype, where: str, pending: int) -> None:
        """``"nonfinite"`` unless ``sum(|x| for x in objects keys)`` (in float64, a chunk at a
        time) stays within ``dtype``'s largest value less :data:`BOUND_MARGIN`: then the array
        (the first key) plus the others, added in any order with rounding, stays finite."""
        step = BOUND_CHUNK * dtype.itemsize
        limit = float(np.finfo(dtype).max) * (1 - BOUND_MARGIN)
        buffers = np.empty((2, BOUND_CHUNK), np.float64)
        for at, chunks in zip(range(0, 1 << 62, step), zip(*(self._chunks(k, step) for k in keys))):
            total, part = buffers[:, : len(chunks[0]) // dtype.itemsize]
            np.abs(np.frombuffer(chunks[0], dtype), out=total)
            for chunk in chunks[1:]:
                total += np.abs(np.frombuffer(chunk, dtype), out=part)
            bad = np.flatnonzero(~(total <= limit))  # NaN or Inf too
            if len(bad):
                i = int(bad[0])
                raise StoreError(
                    f"{where}: the sum could overflow: |array| + |update| + |the {pending} "
                    f"push(es) committed before it and not yet added| is {total[i]:.4g} at "
                    f"element {at // dtype.itemsize + i} (the largest {dtype} is "
                    f"{float(np.finfo(dtype).max):.4g}); refused, the array is unchanged",
                    "nonfinite",
                )

    @staticmethod
    def _check_addable(info: ObjectInfo, staged: ObjectInfo, where: str) -> None:
        """Both arrays whole float arrays of one shape and dtype, or ``"refused"``."""
        whole = info.box == boxes.full(info.global_shape)
        same = (staged.global_shape, staged.dtype, staged.box) == (
            info.global_shape,
            info.dtype,
            info.box,
        )
        if not (whole and same and wire.dtype_of(info.dtype).kind == "f"):
            raise StoreError(
                f"{where}: both must be whole float arrays of one shape and dtype; the array "
                f"is {info.dtype}{list(info.global_shape)} box {info.box}, the update "
                f"{staged.dtype}{list(staged.global_shape)} box {staged.box}",
                "refused",
            )

    def _store_sum(self, key, info, new, sums, out, keep) -> ObjectInfo:
        """The sum made into ``out`` (memory), stored as ``new``; the version before it kept
        at ``keep``, if given."""
        collections.deque(sums, maxlen=0)  # made into out
        new = dataclasses.replace(new, checksum=wire.checksum(out))
        if keep is not None:
            self._keep(key, info, keep)
        self._put(new, out, durable=False, later=True)  # replaced by the next push, likely
        return new

    def _store_sum_file(self, key, info, new, sums, keep) -> ObjectInfo:
        """The sum written to a file a chunk at a time as it is made, stored as ``new``."""
        tmp, digest = self._write_chunks({**new.to_json(), "checksum": None}, sums)
        new = dataclasses.replace(new, checksum=digest)
        try:
            if keep is not None:
                self._keep(key, info, keep)
            self._put_file(new, tmp)
        except BaseException:
            tmp.unlink(missing_ok=True)
            raise
        return new

    def _sums(self, key: str, skey: str, dtype, where: str, out: np.ndarray | None):
        """``array + update`` a chunk at a time, each chunk checked finite (``"nonfinite"``
        naming the first bad element), into ``out`` (bytes) or else one scratch buffer (each
        chunk valid until the next)."""
        step = max(1, ACCUMULATE_CHUNK_BYTES // dtype.itemsize) * dtype.itemsize
        scratch = np.empty(0, dtype)
        for at, (a, b) in zip(
            range(0, 1 << 62, step), zip(self._chunks(key, step), self._chunks(skey, step))
        ):
            x, y = np.frombuffer(a, dtype), np.frombuffer(b, dtype)
            if out is not None:
                buf = out[at : at + len(a)].view(dtype)
            else:
                if len(scratch) != len(x):
                    scratch = np.empty(len(x), dtype)
                buf = scratch
            with np.errstate(over="ignore", invalid="ignore"):
                np.add(x, y, out=buf)
            bad = np.flatnonzero(~np.isfinite(buf))
            if len(bad):
                i = int(bad[0])
                what = (
                    f"the update holds {y[i]}"
                    if not np.isfinite(y[i])
                    else f"the sum overflows: {x[i]} + {y[i]}"
                )
                raise StoreError(
                    f"{where}: {what} at element {at // dtype.itemsize + i} (and "
                    f"{len(bad) - 1} more in that chunk); a non-finite update is refused and "
                    f"the array is unchanged",
                    "nonfinite",
                )
            yield buf.view(np.uint8)

    def _keep(self, key: str, info: ObjectInfo, keep: str) -> None:
        """Keep the version ``info`` of ``key`` at path ``keep``: the bytes the memory tier holds
        (written back to disk as any put), else copied from its file a chunk at a time."""
        kept = dataclasses.replace(info, path=wire.check_path(keep))
        with self.lock:
            held = self.memory.get(key)
            entry = self.index.get(key)
            data = held[1] if held is not None and entry and held[0] == entry.seq else None
        if data is not None:
            self._put(kept, data, durable=False, later=True)
            return
        tmp, _ = self._write_chunks(kept.to_json(), self._chunks(key, ACCUMULATE_CHUNK_BYTES))
        self._put_file(kept, tmp)

    def revert(self, path: str, kept: str, name: str, clock: int, check: bool) -> ObjectInfo:
        """Put back the version of ``path`` kept at ``kept`` by the accumulate of push ``clock``
        of ``name``, which must be the last one into ``path``. The array's clocks and sources
        stay: the push counts as made, its update undone. ``check``: only check."""
        with self._path_lock("array", path):
            key, kkey = self.find(path, None), self.find(kept, None)
            info, before = self.info(key)[0], self.info(kkey)[0]
            undone = {k: v for k, v in {**dict(info.clocks), name: clock}.items() if v}
            kept_clocks = {k: v for k, v in before.clocks if v}
            if dict(info.clocks).get(name) != clock + 1 or kept_clocks != undone:
                raise StoreError(
                    f"revert of {path!r} to {kept!r}: push {clock} of {name!r} is not the last "
                    f"update into it (the array holds pushes {dict(info.clocks)}, the version "
                    f"kept {dict(before.clocks)}); only the last one can be undone",
                    "refused",
                )
            if check:
                return info
            new = dataclasses.replace(info, checksum=before.checksum)
            _, data = self.read(kkey)
            self._put(new, data, durable=False)
            self.remove([kept])
            return new

    def _consume(self, key: str, stage: str) -> None:
        """Remove ``stage`` once the array's version now in the index is on disk (now, if it
        is)."""
        with self.lock:
            entry = self.index.get(key)
            if entry is not None and not entry.on_disk:
                self.consumed.setdefault(key, []).append((entry.seq, stage))
                return
        self.remove([stage])

    # -- shared reads ------------------------------------------------------------------------

    def share(self, path: str) -> tuple[ObjectInfo, str, int, str]:
        """The whole array at ``path`` in its segment: (its record, the segment's file, the
        version's sequence number, its digest there), the segment holding that version when this
        returns.

        Raises:
          StoreError: no array at ``path``, or not a whole one (``"refused"``), or the segments
            are full (``"too_large"``).
        """
        with self._path_lock("array", path):
            key = self.find(path, None)
            entry, data = self.read(key)
            info = entry.info
            if info.box != boxes.full(info.global_shape):
                raise StoreError(
                    f"{path!r} holds box {info.box} of an array {list(info.global_shape)}: only "
                    f"a whole array is read through shared memory",
                    "refused",
                )
            file, digest = self.segments.publish(path, entry.seq, data, info.clocks)
            return info, file, entry.seq, digest

    def reshare(self, path: str) -> None:
        """After an update of ``path``: its segment, if it has one, holds the new version (when
        the version is in the memory tier; else the next :meth:`share` writes it)."""
        if not self.segments.has(path):
            return
        try:
            if self.info(self.find(path, None))[1]:
                self.share(path)
                return
        except StoreError:  # deleted meanwhile, or no longer whole
            pass
        # a reader without a request must not take the old version for the newest
        self.segments.withdraw(path)

    def delete(self, prefix: str) -> int:
        deleted = super().delete(prefix)
        self.segments.drop(prefix)
        return deleted

    def close(self) -> None:
        super().close()
        self.segments.close()

    # -- JSON objects ------------------------------------------------------------------------

    def put_json(self, path: str, data: np.ndarray, flush: bool = True, rid=None) -> int:
        """Store a JSON object (after every object put before it is on disk, unless ``flush``
        is False); its version. A request ``rid`` that wrote it already is not written again."""
        with self._path_lock("json", path):
            done = self.written_by(path, rid)
            if done is not None:
                return done
            if flush:
                self.flush()  # the objects put before a commit marker reach disk before it
            return self._write_json(path, data, rid)

    def cas_json(
        self, path: str, expect: int | None, data: np.ndarray, rid=None, sync: bool = True
    ) -> tuple[bool, int | None, np.ndarray | None]:
        """Compare and swap a JSON object: store ``data`` at ``path`` if the object there now is
        version ``expect`` (None: there is none), fsynced before this returns if ``sync``, else
        behind. (swapped, the version now, the bytes now when not swapped). A request ``rid``
        that swapped already answers as it did."""
        with self._path_lock("json", path):
            done = self.written_by(path, rid)
            if done is not None:
                return True, done, None
            with self.lock:  # the version in memory: a swap that matches reads no file
                version = self.versions.get(path) if path in self.json else None
            if version == expect:
                return True, self._write_json(path, data, rid, sync), None
            try:
                header, current = self.get_json(path)
            except StoreError as error:
                if error.reason != "not_found":
                    raise
                header, current = None, None
            version = None if header is None else int(header.get("version", 0))
            if version != expect:
                return False, version, current
            return True, self._write_json(path, data, rid, sync), None
