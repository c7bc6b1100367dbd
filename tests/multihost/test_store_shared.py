"""Whole arrays read through shared memory (``StoreClient(..., shared=True)``, the parameter
server's pulls) are the bytes and the record a read over the socket gives, after every kind of
update, never a version half written or an older one (also across a restart of the store),
and any segment a client cannot use is read over the socket instead. Real servers on 127.0.0.1."""

from __future__ import annotations

import json
import os
import pathlib
import signal
import struct
import threading

import numpy as np
import pytest
import xxhash

from tenplex_jax._src.multihost.store import shared
from tenplex_jax.errors import StoreError
from tenplex_jax.multihost import store

MIB = 1 << 20


def _digest(array: np.ndarray) -> str:
    """The digest a segment's version is named by, taken here in one call (the store and the
    readers take it a chunk at a time)."""
    return f"xxh3:{xxhash.xxh3_64_intdigest(array.tobytes()):016x}"


def _segments(proc) -> list:
    """The files of the segments of the store ``proc``."""
    files = pathlib.Path(shared.SHM).glob(f"{shared.PREFIX}{proc.pid}-*/*")
    return sorted(f for f in files if f.name != shared.LIFE_LOCK)


def test_a_shared_read_is_a_socket_read_after_every_kind_of_update(stores):
    proc = stores.start("s0")
    w = np.arange(MIB // 4, dtype=np.float32)
    with (
        store.StoreClient(proc.address, shared=True) as fast,
        store.StoreClient(proc.address) as plain,
    ):

        def same(path: str) -> np.ndarray:
            reads = fast.shared_reads
            got, info = fast.get(path, with_info=True)
            want, want_info = plain.get(path, with_info=True)
            assert fast.shared_reads == reads + 1  # through the segment, not the socket
            assert np.array_equal(got, want) and info == want_info
            return got

        fast.put("w", w)
        assert np.array_equal(same("w"), w)
        fast.put("u", np.full_like(w, 0.5))
        fast.accumulate("w", "u", name="vw", clock=0, keep="w-before")
        assert np.array_equal(same("w"), w + 0.5)
        out = np.empty_like(w)  # received into the caller's array, as over the socket
        assert fast.get("w", out=out) is out and np.array_equal(out, w + 0.5)
        fast.revert("w", "w-before", name="vw", clock=0)
        assert np.array_equal(same("w"), w)
        fast.put("w", np.ones(8, np.float16))  # another shape and size: another segment
        assert same("w").dtype == np.float16
        assert len(_segments(proc)) == 1 and fast.stats()["shared_bytes"] == 16
        # a box, or an object that is not a whole array, goes over the socket
        box = ((2, 6),)
        assert np.array_equal(fast.get("w", box), np.ones(4, np.float16))
        fast.put("part", np.zeros(4, np.float32), box=((0, 4),), global_shape=(8,))
        reads = fast.shared_reads
        assert np.array_equal(fast.get("part", ((0, 4),)), np.zeros(4, np.float32))
        assert fast.shared_reads == reads
        fast.delete("w")
        assert _segments(proc) == [] and fast.stats()["shared_bytes"] == 0


def test_a_segment_left_half_written_or_unreadable_is_read_over_the_socket(stores):
    proc = stores.start("s0")
    w = np.arange(1024, dtype=np.float32)
    with store.StoreClient(proc.address, shared=True) as client:
        client.put("w", w)
        client.get("w")
        [segment] = _segments(proc)
        with open(segment, "r+b") as f:  # a store killed while it wrote the segment
            magic, _, epoch, seq, nbytes = shared.HEADER.unpack(f.read(shared.HEADER.size))
            f.seek(0)
            f.write(shared.HEADER.pack(magic, shared.WRITING, epoch, seq, nbytes))
        reads = client.shared_reads
        assert np.array_equal(client.get("w"), w) and client.shared_reads == reads
        segment.unlink()  # as on another host: never opened, so never tried again
        client.put("w", w + 1)
        with store.StoreClient(proc.address, shared=True) as elsewhere:
            assert np.array_equal(elsewhere.get("w"), w + 1) and elsewhere.shared_reads == 0
            assert np.array_equal(elsewhere.get("w"), w + 1) and elsewhere.shared_reads == 0


def test_a_restarted_store_is_read_afresh_never_through_a_dead_store_s_segment(stores):
    proc = stores.start("s0")
    port = store.parse_address(proc.address)[1]
    with store.StoreClient(proc.address, shared=True, retry_seconds=30) as client:
        client.put("w", np.zeros(4096, np.float32), durable=True)
        assert client.get("w").sum() == 0 and client.shared_reads == 1
        proc.kill()
        proc = stores.start("s0", port=port)
        # the new store holds the same version under a new sequence of its own; the old
        # segment's file is gone, its pages still mapped by this client
        client.put("w", np.ones(4096, np.float32), durable=True)
        assert client.get("w").sum() == 4096 and client.shared_reads == 2


def test_shared_reads_never_see_a_version_torn_by_concurrent_updates(stores):
    proc = stores.start("s0")
    n, pushes = 2 * MIB // 4, 40
    with (
        store.StoreClient(proc.address, shared=True) as reader,
        store.StoreClient(proc.address) as writer,
    ):
        writer.put("w", np.zeros(n, np.float32))
        writer.put("one", np.ones(n, np.float32))
        done, bad, seen = threading.Event(), [], set()

        def read():
            while not done.is_set():
                data, info = reader.get("w", with_info=True)
                clock = dict(info.clocks).get("vw", 0)
                if not (data[0] == data[-1] == clock and (data == clock).all()):
                    bad.append((clock, float(data.min()), float(data.max())))
                seen.add(clock)

        thread = threading.Thread(target=read)
        thread.start()
        try:
            for clock in range(pushes):
                writer.accumulate("w", "one", name="vw", clock=clock)
        finally:
            done.set()
            thread.join(timeout=60)
        assert not bad, bad[:5]
        assert len(seen) > 1 and reader.shared_reads > 0  # it read while the versions changed
        assert reader.get("w")[0] == pushes


def test_a_segment_file_is_readable_by_its_owner_only(stores):
    proc = stores.start("s0")
    with store.StoreClient(proc.address, shared=True) as client:
        client.put("w", np.zeros(16, np.float32))
        client.get("w")
    [segment] = _segments(proc)
    assert segment.stat().st_mode & 0o077 == 0 and segment.parent.stat().st_mode & 0o077 == 0
    assert segment.stat().st_size == shared.DATA_OFFSET + 64
    assert struct.unpack_from("!4s", segment.read_bytes())[0] == shared.MAGIC


WRITER = """
import sys, time
import numpy as np
from tenplex_jax._src.multihost.store import shared
segments = shared.Segments(1 << 30, sys.argv[1])
versions = [np.full(int(sys.argv[2]), v, np.float32) for v in (0, 1)]
print(segments.publish("w", 0, versions[0])[0], flush=True)
seq, end = 0, time.monotonic() + float(sys.argv[3])
while time.monotonic() < end:
    seq += 1
    segments.publish("w", seq, versions[seq % 2])
    time.sleep(0.0002)  # a reader's turn: a store writes a version per update, not back to back
print(seq, flush=True)
"""


def test_a_reader_never_copies_a_version_while_another_process_writes_it(tmp_path):
    import subprocess
    import sys

    n = MIB // 4
    writer = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(tmp_path), str(n), "3"],
        stdout=subprocess.PIPE,
        text=True,
    )
    reader, out = shared.Reader(), np.empty(n, np.float32)
    sums = [_digest(np.full(n, v, np.float32)) for v in (0, 1)]
    try:
        file = writer.stdout.readline().strip()
        copied, missed = 0, 0
        with open(file, "rb", buffering=0) as peek:
            while writer.poll() is None:
                # unlocked, so only a guess (as the store's answer is a version that a later
                # update may replace before the copy)
                header = os.pread(peek.fileno(), shared.HEADER.size, 0)
                epoch, seq = shared.HEADER.unpack(header)[2:4]
                if reader.read(file, epoch, seq, sums[seq % 2], out):
                    copied += 1
                    assert out[0] == out[-1] == seq % 2 and (out == seq % 2).all(), seq
                else:
                    missed += 1  # the guess was stale, or the version was being written
        writes = int(writer.stdout.readline())
    finally:
        writer.kill()
        writer.wait(timeout=30)
        reader.close()
    assert writes > 100 and copied > 100, (writes, copied, missed)


def test_a_segment_removed_under_an_update_ends_that_write_with_a_store_error(tmp_path):
    segments = shared.Segments(MIB, str(tmp_path))
    segments.publish("w", 0, np.zeros(4, np.float32))
    segment = segments._by_path["w"]  # as an update holds it while a delete removes the array
    segments.drop("w")
    with pytest.raises(StoreError) as error:
        segment.write(1, np.ones(4, np.float32))
    assert error.value.reason == "not_found"  # reshare passes over it; a reader asks again
    assert segments.used == 0 and not segment.file.exists()
    segments.close()


def test_a_dead_store_s_segments_are_collected_by_their_life_lock_and_a_live_one_s_never(
    tmp_path, monkeypatch
):
    """A store's directory is dead when its life lock can be taken, in any PID namespace: a
    live store's is kept whatever its pid says (here a pid no process has), a dead one's is
    removed whatever its pid says (here this process's), a directory without a lock is left,
    and one that vanishes meanwhile is passed over."""
    alive = shared.Segments(MIB, str(tmp_path))  # holds its lock
    alive.dir.rename(tmp_path / f"{shared.PREFIX}999999999-live")
    dead = tmp_path / f"{shared.PREFIX}{os.getpid()}-dead"
    dead.mkdir()
    (dead / shared.LIFE_LOCK).touch()  # nobody holds it: its store was killed
    making = tmp_path / f"{shared.PREFIX}1-making"
    making.mkdir()  # a store between its mkdir and its lock
    real = pathlib.Path.lstat

    def vanishing(self):  # another store removes it between the listing and the look
        if self.name.endswith("-gone"):
            raise FileNotFoundError(self)
        return real(self)

    (tmp_path / f"{shared.PREFIX}1-gone").mkdir()
    monkeypatch.setattr(pathlib.Path, "lstat", vanishing)
    segments = shared.Segments(MIB, str(tmp_path))
    assert not dead.exists() and making.exists()
    assert (tmp_path / f"{shared.PREFIX}999999999-live").exists()
    segments.close()
    alive.close()


def test_a_version_of_an_earlier_store_process_is_never_read_whatever_its_name_and_seq(tmp_path):
    """Two store processes' segments of one path, version for version: a reader that kept the
    first one's mapping is refused it by the epoch the second store names."""
    first, second = shared.Segments(MIB, str(tmp_path)), shared.Segments(MIB, str(tmp_path))
    old, zeros = first.publish("w", 1, np.zeros(256, np.float32))
    new, ones = second.publish("w", 1, np.ones(256, np.float32))
    assert (zeros, ones) == (_digest(np.zeros(256, np.float32)), _digest(np.ones(256, np.float32)))
    assert first.epoch != second.epoch and old != new
    reader, out = shared.Reader(), np.empty(256, np.float32)
    try:
        assert reader.read(old, first.epoch, 1, zeros, out) and (out == 0).all()
        assert reader.read(old, second.epoch, 1, ones, out) is False  # old file, new epoch
        assert reader.read(new, second.epoch, 1, ones, out) and (out == 1).all()
    finally:
        reader.close()
        first.close()
        second.close()


def test_a_store_without_shared_memory_serves_every_read_current_over_the_socket(stores):
    proc = stores.start("s0", args=("--shm", str(stores.root / "no-such-dir")))
    port = store.parse_address(proc.address)[1]
    with store.StoreClient(proc.address, shared=True, retry_seconds=30) as client:
        for restart in range(3):
            client.put("w", np.full(4096, restart, np.float32), durable=True)
            assert (client.get("w") == restart).all()
            proc.kill()
            proc = stores.start("s0", port=port, args=("--shm", str(stores.root / "no-such-dir")))
        assert (client.get("w") == 2).all() and client.shared_reads == 0
        assert client.stats()["shared_bytes"] == 0


def test_a_segment_changed_or_cut_short_in_place_is_read_over_the_socket(stores):
    proc = stores.start("s0")
    w = np.full(4096, 2.0, np.float32)
    with store.StoreClient(proc.address, shared=True) as client:
        client.put("w", w)
        assert (client.get("w") == 2).all() and client.shared_reads == 1
        [segment] = _segments(proc)
        with open(segment, "r+b") as f:  # another process of the store's user writes a float
            f.seek(shared.DATA_OFFSET + 40)
            f.write(np.float32(np.inf).tobytes())
        assert (client.get("w") == 2).all() and client.shared_reads == 1
        os.truncate(segment, shared.DATA_OFFSET)  # then cuts the file: no read faults on it
        assert (client.get("w") == 2).all() and client.shared_reads == 1
        client.put("w", w + 1)  # the store drops the cut segment and shares the array anew
        assert (client.get("w") == 3).all() and client.shared_reads == 2
        assert proc.popen.poll() is None


def test_shared_memory_that_runs_out_refuses_a_segment_once_said_never_a_fault(
    tmp_path, monkeypatch, capsys
):
    segments = shared.Segments(64 * MIB, str(tmp_path))
    monkeypatch.setattr(shared, "_free_bytes", lambda directory: 8 * MIB)
    with pytest.raises(StoreError) as error:
        segments.publish("big", 0, np.zeros(MIB, np.float32))  # 4 MiB + the reserve > 8 MiB
    assert error.value.reason == "too_large" and "free" in str(error.value)
    monkeypatch.setattr(shared, "_free_bytes", lambda directory: 1 << 40)

    def no_space(fd, offset, length):
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(os, "posix_fallocate", no_space)
    with pytest.raises(StoreError) as error:
        segments.publish("big", 0, np.zeros(MIB, np.float32))
    assert error.value.reason == "too_large" and segments.used == 0
    assert [f.name for f in segments.dir.iterdir()] == [shared.LIFE_LOCK]  # no page, no file
    assert capsys.readouterr().err.count("is full") == 1  # one line, not one per read
    segments.close()


HOLD = """
import fcntl, os, signal, sys
fd = os.open(sys.argv[1], os.O_RDONLY)
fcntl.flock(fd, fcntl.LOCK_SH)  # as a reader does while it copies
print("held", flush=True)
os.kill(os.getpid(), signal.SIGSTOP)
"""


def test_a_stopped_reader_costs_its_own_read_never_another_client_s_request(stores):
    import subprocess
    import sys

    proc = stores.start("s0")
    w = np.zeros(MIB // 4, np.float32)
    with store.StoreClient(proc.address, shared=True, timeout=30, retry_seconds=0) as client:
        client.put("w", w)
        client.get("w")
        [segment] = _segments(proc)
        holder = subprocess.Popen(
            [sys.executable, "-c", HOLD, str(segment)], stdout=subprocess.PIPE
        )
        try:
            assert holder.stdout.readline().strip() == b"held"
            client.put("w", w + 1)  # answered: the store gives the held segment up
            assert (client.get("w") == 1).all() and client.shared_reads == 2
            assert _segments(proc) != [segment]
            client.delete("w")
            client.put("v", w + 2)
            assert (client.get("v") == 2).all() and client.shared_reads == 3
        finally:
            holder.kill()
            holder.wait(timeout=30)


def test_a_reader_keeps_no_mapping_of_a_deleted_segment_and_never_opens_a_fifo(stores, tmp_path):
    proc = stores.start("s0")
    with store.StoreClient(proc.address, shared=True) as client:
        for name in "abc":
            client.put(name, np.zeros(1024, np.float32))
            client.get(name)
        assert len(client._reader._maps) == 3
        client.delete("a")
        client.delete("b")
        client.put("d", np.ones(1024, np.float32))
        assert (client.get("d") == 1).all() and len(client._reader._maps) == 2
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)  # what a false store could name: opening it would wait for a writer
    reader = shared.Reader()
    assert reader.read(str(fifo), 0, 0, "xxh3:0000000000000000", np.empty(4, np.float32)) is None
    reader.close()


def test_segments_stay_within_their_file_descriptors(tmp_path):
    segments = shared.Segments(64 * MIB, str(tmp_path), max_segments=2)
    segments.publish("a", 0, np.zeros(4, np.float32))
    segments.publish("b", 0, np.zeros(4, np.float32))
    with pytest.raises(StoreError, match="file descriptors") as error:
        segments.publish("c", 0, np.zeros(4, np.float32))
    assert error.value.reason == "too_large"  # the client reads over the socket
    segments.drop("a")
    segments.publish("c", 0, np.zeros(4, np.float32))
    segments.close()


def test_a_store_keeps_segments_within_the_files_it_may_open(stores):
    """With 256 files (a container's limit), the store keeps fewer segments than its
    connections need descriptors: every read is served, the last ones over the socket."""
    import resource

    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))  # the store inherits it
    try:
        proc = stores.start("s0", args=("--max-connections", "16", "--max-handshakes", "16"))
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
    with store.StoreClient(proc.address, shared=True) as client:
        for i in range(120):
            client.put(f"a{i}", np.full(16, i, np.float32))
            assert (client.get(f"a{i}") == i).all()
        assert client.shared_reads == (256 - 16 - 16 - 64) // 2  # 80 segments, then the socket
        with store.StoreClient(proc.address) as other:  # a new connection is still served
            assert (other.get("a0") == 0).all()


def test_a_peek_reads_the_newest_version_and_its_clocks_with_no_request(stores):
    """Once a shared read has named an array's segment, ``peek`` copies the version the store
    holds now out of it with no request at all (the store is stopped while it peeks): the bytes
    and clocks a read over the socket gives, after each update."""
    proc = stores.start("s0")
    w = np.arange(4096, dtype=np.float32)
    out = np.empty_like(w)
    with (
        store.StoreClient(proc.address, shared=True) as client,
        store.StoreClient(proc.address) as plain,
    ):
        client.put("w", w)
        client.put("u", np.ones_like(w))
        assert client.peek("w", out) is None  # no segment named yet: ask
        client.get("w")
        for clock in range(3):
            client.accumulate("w", "u", name="vw", clock=clock)
            os.kill(proc.pid, signal.SIGSTOP)  # any request would wait for ever
            try:
                clocks = client.peek("w", out)
            finally:
                os.kill(proc.pid, signal.SIGCONT)
            want, info = plain.get("w", with_info=True)
            assert clocks == info.clocks == (("vw", clock + 1),)
            np.testing.assert_array_equal(out, want)
            np.testing.assert_array_equal(out, w + clock + 1)
        for other in (
            np.empty(4095, np.float32),
            np.empty(4096, np.float64),
            np.empty((2, 4096), np.float32)[:, 0],
        ):
            assert client.peek("w", other) is None  # not the array's shape, dtype or layout


def test_a_peek_never_takes_a_withdrawn_changed_cut_or_other_store_s_version(tmp_path):
    segments = shared.Segments(MIB, str(tmp_path))
    reader, out = shared.Reader(), np.empty(256, np.float32)
    try:
        file, _ = segments.publish("w", 1, np.ones(256, np.float32), (("a", 2),))
        seq, digest, clocks = reader.current(file, segments.epoch, out)
        assert (seq, digest, json.loads(clocks)) == (1, _digest(out), {"a": 2})
        assert (out == 1).all()
        assert reader.current(file, segments.epoch + 1, out) is None  # another store's
        assert reader.current(file, segments.epoch, np.empty(255, np.float32)) is None
        with open(file, "r+b") as f:  # a byte changed in place: its digest beside it fails
            f.seek(shared.DATA_OFFSET + 8)
            f.write(np.float32(5).tobytes())
        assert reader.current(file, segments.epoch, out) is None
        segments.publish("w", 2, np.full(256, 2.0, np.float32), (("a", 3), ("b", 1)))
        assert json.loads(reader.current(file, segments.epoch, out)[2]) == {"a": 3, "b": 1}
        assert (out == 2).all()
        many = tuple((f"vw{i:05d}", i) for i in range(400))  # past the header's page: ask
        segments.publish("w", 3, np.full(256, 3.0, np.float32), many)
        assert reader.current(file, segments.epoch, out) is None
        segments.publish("w", 4, np.full(256, 4.0, np.float32), (("a", 4),))
        assert reader.current(file, segments.epoch, out)[0] == 4
        segments.withdraw("w")  # a newer version the segment does not hold: the file goes
        assert reader.current(file, segments.epoch, out) is None
        again, _ = segments.publish("w", 5, np.full(256, 5.0, np.float32), (("a", 5),))
        assert again != file and reader.current(again, segments.epoch, out)[0] == 5
        os.truncate(again, shared.DATA_OFFSET)  # cut short under the reader: no fault
        assert reader.current(again, segments.epoch, out) is None
    finally:
        reader.close()
        segments.close()
