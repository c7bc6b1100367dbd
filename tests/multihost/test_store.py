"""The tensor store: real server processes on 127.0.0.1, killed and restarted on the same dir."""

from __future__ import annotations

import contextlib
import json
import os
import pathlib
import signal
import socket
import subprocess
import sys
import threading
import time

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tenplex_jax as tj
from tenplex_jax._src import box as boxes
from tenplex_jax._src.multihost.store import wire
from tenplex_jax.multihost import store
from tests.helpers import Stores

BIG = 200 << 20  # bytes of the object a server is killed while writing to disk
STREAMED = 64 << 20  # bytes of the object a server is killed while receiving


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    started = Stores(tmp_path_factory.mktemp("store"))
    try:
        yield started.start()
    finally:
        started.reap()


@pytest.fixture
def client(server):
    with store.StoreClient(server.address, timeout=30) as c:
        yield c
        c.delete("")


def _rng_array(shape, dtype, seed=0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    if np.dtype(dtype) == np.bool_:
        return rng.integers(0, 2, shape).astype(bool)
    if np.issubdtype(np.dtype(dtype), np.integer):
        return rng.integers(-1000, 1000, shape).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@contextlib.contextmanager
def _partial_put(address: str, path: str, array: np.ndarray, *, durable: bool, fraction: int):
    """A raw connection that starts a put of ``array`` and sends only 1/fraction of its body."""
    data = wire.as_bytes(array)
    host, port = store.parse_address(address)
    with socket.create_connection((host, port), timeout=30) as raw:
        wire.send_frame(raw, {"op": "hello", "token": None})
        assert wire.recv_header(raw, wire.recv_prefix(raw)[0], 1 << 20)["ok"]
        header = {
            "op": "put",
            "path": path,
            "box": [[0, array.size]],
            "global_shape": [array.size],
            "dtype": str(array.dtype),
            "checksum": wire.checksum(data),
            "durable": durable,
        }
        wire.send_header(raw, header, array.nbytes)
        assert wire.recv_header(raw, wire.recv_prefix(raw)[0], 1 << 20)["continue"]
        raw.sendall(data[: array.nbytes // fraction])
        yield raw


def _when(proc: store.StoreProcess, condition, timeout: float = 60.0):
    """Ask the store for its stats until ``condition(stats)`` is truthy; return that value. The
    store reports its transfers under way, so a test acts on what the store says it is doing."""
    deadline = time.monotonic() + timeout
    with store.StoreClient(proc.address) as client:
        while time.monotonic() < deadline:
            found = condition(client.stats())
            if found:
                return found
    raise AssertionError(f"the store never reported what the test waits for in {timeout:.0f} s")


def _kill(proc: store.StoreProcess) -> None:
    os.kill(proc.pid, signal.SIGKILL)
    proc.popen.wait(timeout=30)


# -- round trips, range reads, list, delete --------------------------------------------------


@pytest.mark.parametrize(
    "shape, dtype",
    [
        ((4, 6), np.float32),
        ((3, 5, 2), ml_dtypes.bfloat16),
        ((7,), np.int32),
        ((), np.float32),
        ((), np.int32),
        ((2, 3), np.bool_),
        ((0, 3), np.float16),
        ((5,), np.uint8),
        ((2, 2), np.float64),
    ],
)
def test_round_trip_is_bitwise(client, shape, dtype) -> None:
    array = _rng_array(shape, dtype)
    info = client.put("rt/x", array)
    assert info.box == boxes.full(shape) and info.global_shape == shape
    assert info.dtype == np.dtype(dtype).name and info.nbytes == array.nbytes
    out = client.get("rt/x")
    assert out.dtype == array.dtype and out.shape == shape
    assert out.tobytes() == array.tobytes()
    assert client.get("rt/x", boxes.full(shape)).tobytes() == array.tobytes()


def test_non_contiguous_arrays_are_stored_in_c_order(client) -> None:
    array = _rng_array((6, 4), np.float32).T[::2]
    client.put("nc/x", array)
    np.testing.assert_array_equal(client.get("nc/x"), array)


def test_range_reads_equal_numpy_slicing(client) -> None:
    full = _rng_array((10, 7, 6), np.float32, seed=1)
    box = ((2, 7), (0, 7), (3, 6))  # this object holds full[2:7, :, 3:6]
    client.put("rr/w", full[2:7, :, 3:6], box=box, global_shape=full.shape)
    rng = np.random.default_rng(2)
    for _ in range(30):
        sub = []
        for start, stop in box:
            a, b = sorted(rng.integers(start, stop + 1, 2))
            sub.append((int(a), int(b)))
        got = client.get("rr/w", tuple(sub))
        np.testing.assert_array_equal(got, full[tuple(slice(a, b) for a, b in sub)])
    # a box that leaves the stored object is refused with the stored boxes named
    with pytest.raises(
        tj.errors.StoreError, match=r"contains box .*stored boxes: \[\(\(2, 7\)"
    ) as err:
        client.get("rr/w", ((1, 3), (0, 7), (3, 6)))
    assert err.value.reason == "not_found"
    with pytest.raises(tj.errors.StoreError, match="no object at path 'rr/missing'"):
        client.get("rr/missing", ((0, 1),))


def test_list_and_delete_by_prefix(client) -> None:
    for version in (1, 2):
        for name in ("a", "b/c"):
            client.put(f"v{version}/{name}", np.full((2,), version, np.int32))
        client.put_json(f"v{version}/COMMIT", {"step": version})
    infos = client.list("v1/")
    assert [i.path for i in infos] == ["v1/a", "v1/b/c"]
    assert infos[0].checksum == wire.checksum(np.full((2,), 1, np.int32).tobytes())
    assert client.list_json("v") == ["v1/COMMIT", "v2/COMMIT"]
    assert client.delete("v1/") == 3  # two arrays and the marker
    assert [i.path for i in client.list()] == ["v2/a", "v2/b/c"]
    assert client.get_json("v1/COMMIT", default=None) is None
    assert client.get_json("v2/COMMIT") == {"step": 2}
    with pytest.raises(tj.errors.StoreError, match="no JSON object") as err:
        client.get_json("v1/COMMIT")
    assert err.value.reason == "not_found"


def test_bad_arguments_are_refused_before_sending(client) -> None:
    with pytest.raises(tj.errors.StoreError, match="shape must be its box's extent"):
        client.put("bad/x", np.zeros((2, 3)), box=((0, 2), (0, 2)), global_shape=(4, 4))
    with pytest.raises(tj.errors.StoreError, match=r"global_shape=\(4, 4\)"):
        client.put("bad/x", np.zeros((2, 3)), box=((3, 5), (0, 3)), global_shape=(4, 4))
    with pytest.raises(tj.errors.StoreError, match="non-empty string"):
        client.put("", np.zeros(2))
    with pytest.raises(tj.errors.StoreError, match="plain numeric arrays"):
        client.put("bad/x", np.array(["a"], dtype=object))
    with pytest.raises(tj.errors.StoreError, match="global_shape is needed"):
        client.put("bad/x", np.zeros(2), box=((2, 4),))
    with pytest.raises(tj.errors.StoreError, match="not plain JSON"):
        client.put_json("bad/m", {"n": np.int64(3)})
    assert client.list("bad/") == []


def test_server_verifies_the_checksum_of_a_put(client) -> None:
    with pytest.raises(tj.errors.StoreError, match="nothing stored") as err:
        client.put("ck/x", np.arange(4, dtype=np.int32), _checksum="crc32:00000000")
    assert err.value.reason == "checksum"
    assert client.list("ck/") == []


def test_concurrent_puts_and_gets_on_one_client(client) -> None:
    arrays = {i: _rng_array((64, 64), np.float32, seed=i) for i in range(16)}
    errors = []

    def work(i):
        try:
            client.put(f"cc/{i}", arrays[i])
            np.testing.assert_array_equal(
                client.get(f"cc/{i}", ((8, 16), (0, 64))), arrays[i][8:16]
            )
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(i,)) for i in arrays]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert len(client.list("cc/")) == 16


# -- limits and tokens -----------------------------------------------------------------------


def test_oversize_requests_are_refused_and_the_server_keeps_serving(stores) -> None:
    proc = stores.start(max_body_bytes=1 << 20)
    with store.StoreClient(proc.address) as client:
        with pytest.raises(
            tj.errors.StoreError, match=r"at most 1048576 bytes .* 2097152 bytes"
        ) as err:
            client.put("big/x", np.zeros(1 << 19, np.float32))  # 2 MiB
        assert err.value.reason == "too_large"
        client.put("big/y", np.ones(1 << 10, np.float32))  # the same connection still works
        np.testing.assert_array_equal(client.get("big/y"), np.ones(1 << 10, np.float32))
        assert [i.path for i in client.list()] == ["big/y"]

        # a raw client announcing a 2 GiB header gets an error frame, not a 2 GiB allocation
        host, port = store.parse_address(proc.address)
        with socket.create_connection((host, port), timeout=10) as raw:
            wire.send_frame(raw, {"op": "hello", "token": None})
            assert wire.recv_header(raw, wire.recv_prefix(raw)[0], 1 << 20)["ok"]
            raw.sendall(wire.PREFIX.pack(wire.MAGIC, 2**31, 0))
            reply = wire.recv_header(raw, wire.recv_prefix(raw)[0], 1 << 20)
            assert not reply["ok"] and "at most 65536 bytes" in reply["error"]
        # garbage instead of a frame
        with socket.create_connection((host, port), timeout=10) as raw:
            raw.sendall(b"GET / HTTP/1.1\r\n\r\n")
            reply = wire.recv_header(raw, wire.recv_prefix(raw)[0], 1 << 20)
            assert not reply["ok"] and "not a tenplex_jax store frame" in reply["error"]
        np.testing.assert_array_equal(client.get("big/y"), np.ones(1 << 10, np.float32))
    with pytest.raises(tj.errors.StoreError, match="request header is at most"):
        store.StoreClient(proc.address).list("p" * (1 << 17))


def test_a_token_is_required_when_configured(stores, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("s3cret-token\n")
    proc = stores.start(token_file=token_file)
    for token, what in ((None, "no token"), ("wrong", "a wrong token")):
        with pytest.raises(tj.errors.StoreError, match=f"requires a token; got {what}") as err:
            store.StoreClient(proc.address, token=token).list()
        assert err.value.reason == "auth"
    with store.StoreClient(proc.address, token="s3cret-token") as client:
        client.put("t/x", np.arange(3))
        np.testing.assert_array_equal(client.get("t/x"), np.arange(3))


def test_a_non_loopback_address_without_token_refuses_to_start(tmp_path) -> None:
    # 192.0.2.1 (TEST-NET-1) is on no interface: even a broken check could not bind it
    cmd = [
        sys.executable,
        "-m",
        "tenplex_jax.multihost.store",
        "--dir",
        str(tmp_path / "d"),
        "--host",
        "192.0.2.1",
        "--ready-file",
        str(tmp_path / "ready"),
    ]
    done = subprocess.run(cmd, check=False, capture_output=True, text=True, timeout=60)
    assert done.returncode == 2, done.stderr
    assert "requires --token-file" in done.stderr
    assert not (tmp_path / "ready").exists()


# -- crashes, restarts and corruption --------------------------------------------------------


def test_objects_survive_a_clean_restart_and_a_kill_after_flush(stores) -> None:
    arrays = {f"r/{i}": _rng_array((100, 10), np.float32, seed=i) for i in range(5)}
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        for path, array in arrays.items():
            client.put(path, array)  # memory tier; SIGTERM writes them out
        client.put_json("r/COMMIT", {"step": 7})
    proc.stop()
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        for path, array in arrays.items():
            np.testing.assert_array_equal(client.get(path), array)
        client.put("r/late", arrays["r/0"] + 1)
        client.flush()
        _kill(proc)
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        np.testing.assert_array_equal(client.get("r/late"), arrays["r/0"] + 1)
        assert client.get_json("r/COMMIT") == {"step": 7}
        assert len(client.list("r/")) == 6


def test_a_commit_marker_on_disk_implies_its_objects_are(stores) -> None:
    proc = stores.start()
    arrays = [_rng_array((256, 256), np.float32, seed=i) for i in range(8)]
    with store.StoreClient(proc.address) as client:
        for i, array in enumerate(arrays):
            client.put(f"c/{i}", array)  # acknowledged from memory
        client.put_json("c/COMMIT", {"objects": len(arrays)})
    _kill(proc)  # no chance to write anything more
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        assert client.get_json("c/COMMIT") == {"objects": 8}
        for i, array in enumerate(arrays):
            np.testing.assert_array_equal(client.get(f"c/{i}"), array)


def test_kill_while_a_large_put_streams_serves_the_old_version(stores) -> None:
    proc = stores.start()
    old = np.arange(STREAMED // 4, dtype=np.float32)
    with store.StoreClient(proc.address) as client:
        client.put("k/w", old, durable=True)
    with _partial_put(proc.address, "k/w", old + 1, durable=False, fraction=2):
        # the store reports half the body received (the rest never comes): then it dies
        seen = _when(
            proc,
            lambda stats: [
                r for r in stats["receiving"] if r["path"] == "k/w" and r["bytes"] == STREAMED // 2
            ],
        )
        assert seen[0]["of"] == STREAMED
        _kill(proc)
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        got = client.get("k/w")
        assert got.tobytes() == old.tobytes()
        assert [i.checksum for i in client.list("k/")] == [wire.checksum(wire.as_bytes(old))]
        assert list((proc.dir / "tmp").iterdir()) == []


def test_kill_after_a_memory_acknowledged_put_serves_one_whole_version(stores) -> None:
    proc = stores.start()
    v1 = np.arange(8 << 20, dtype=np.float32)  # 32 MiB: the disk writer may still be busy
    with store.StoreClient(proc.address) as client:
        client.put("a/w", v1, durable=True)
        client.put("a/w", v1 + 1)  # acknowledged from memory
    _kill(proc)
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        got = client.get("a/w")
        assert np.array_equal(got, v1) or np.array_equal(got, v1 + 1)
        assert client.list("a/")[0].checksum == wire.checksum(wire.as_bytes(got))


def test_kill_during_the_disk_write_never_serves_a_partial_object(stores) -> None:
    proc = stores.start()
    old = np.arange(BIG // 4, dtype=np.float32)
    with store.StoreClient(proc.address) as client:
        client.put("k/w", old, durable=True)
    tmp_dir = proc.dir / "tmp"
    outcome = {}

    def put_new():
        try:
            with store.StoreClient(proc.address) as c:
                c.put("k/w", old * 2, durable=True)
            outcome["acked"] = True
        except tj.errors.StoreError as error:
            outcome["error"] = error

    writer = threading.Thread(target=put_new)
    writer.start()
    # the store reports the new version's file being written (in tmp/, not yet renamed)
    seen = _when(proc, lambda stats: [w for w in stats["writing"] if w["path"] == "k/w"])
    _kill(proc)  # mid-write: the tmp file holds part of the new version
    writer.join(60)
    assert seen[0]["of"] == BIG and "acked" not in outcome, outcome
    assert outcome["error"].reason == "unavailable"
    proc = stores.start()
    assert list(tmp_dir.iterdir()) == []  # the partial write is gone
    with store.StoreClient(proc.address) as client:
        got = client.get("k/w")
        # the old version, as the kill lands mid-write; the new one only if the machine stalled
        # this test past the write's rename (complete either way, never a mix)
        assert np.array_equal(got, old) or np.array_equal(got, old * 2)
        assert client.list("k/")[0].checksum == wire.checksum(wire.as_bytes(got))


@pytest.mark.parametrize("when", ["restart", "running"])
def test_a_corrupted_file_is_detected_and_not_served(stores, when) -> None:
    array = _rng_array((64, 64), np.float32)
    proc = stores.start(memory_bytes=0)  # every read comes from disk
    with store.StoreClient(proc.address) as client:
        client.put("x/w", array, durable=True)
        client.put("x/ok", array + 1, durable=True)
    [file] = [f for f in (proc.dir / "objects").glob("*.obj") if b'"x/w"' in f.read_bytes()[:400]]
    if when == "restart":
        proc.stop()
    raw = bytearray(file.read_bytes())
    raw[-100] ^= 0xFF  # one flipped byte in the array's bytes
    file.write_bytes(raw)
    if when == "restart":
        proc = stores.start(memory_bytes=0)
    with store.StoreClient(proc.address) as client:
        with pytest.raises(
            tj.errors.StoreError, match=r"'x/w' box \(\(0, 64\), \(0, 64\)\) is corrupt"
        ):
            client.get("x/w", ((0, 1), (0, 64)))
        with pytest.raises(tj.errors.StoreError) as err:
            client.get("x/w")
        assert err.value.reason == "not_found"  # set aside: not listed, not served
        assert [i.path for i in client.list("x/")] == ["x/ok"]
        np.testing.assert_array_equal(client.get("x/ok"), array + 1)
    assert len(list((proc.dir / "corrupt").iterdir())) == 1


@pytest.mark.parametrize("when", ["running", "restart"])
def test_a_corrupted_json_object_is_set_aside_never_served(stores, when) -> None:
    """JSON objects (commit markers, manifests) live on disk only, each read checked on every
    get_json (and at start): a flipped byte is never served, and never parsed."""
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        client.put_json("v1/COMMIT", {"step": 12345})
        client.put_json("v1/OTHER", {"step": 1})
    [file] = [f for f in (proc.dir / "json").glob("*.obj") if b"12345" in f.read_bytes()]
    if when == "restart":
        proc.stop()
    file.write_bytes(file.read_bytes().replace(b"12345", b"12346"))
    if when == "restart":
        proc = stores.start()
    with store.StoreClient(proc.address) as client:
        if when == "running":
            with pytest.raises(tj.errors.StoreError, match="'v1/COMMIT' is corrupt") as err:
                client.get_json("v1/COMMIT")
            assert err.value.reason == "corrupt"
        assert client.get_json("v1/COMMIT", default=None) is None
        assert client.list_json("v1/") == ["v1/OTHER"]
    assert len(list((proc.dir / "corrupt").iterdir())) == 1


@pytest.mark.parametrize(
    "field, old, new",
    [
        ("global_shape", b'"global_shape":[64,64]', b'"global_shape":[64,66]'),
        ("dtype", b'"dtype":"int8"', b'"dtype":"int4"'),
        ("path", b'"path":"v00000003/commit/0"', b'"path":"v00000002/commit/0"'),
    ],
)
def test_a_flipped_header_field_is_set_aside_never_served(stores, field, old, new) -> None:
    """An object's header (its path, box, global shape, dtype) is checksummed like its bytes: a
    file whose header does not match its checksum is set aside at start, not indexed."""
    proc = stores.start(memory_bytes=0)
    with store.StoreClient(proc.address) as client:
        client.put("h/w", np.ones((64, 64), np.int8), durable=True)
        client.put_json("v00000003/commit/0", {"process": 0})  # flushes every earlier put
        client.put("h/ok", np.zeros(3, np.float32), durable=True)
    proc.stop()
    [file] = [f for f in proc.dir.rglob("*.obj") if old in f.read_bytes()[:600]]
    file.write_bytes(file.read_bytes().replace(old, new, 1))  # same length: only the header differs
    proc = stores.start(memory_bytes=0)
    with store.StoreClient(proc.address) as client:
        assert [i.path for i in client.list("h/")] == (
            ["h/ok"] if field != "path" else ["h/ok", "h/w"]
        )
        for path in ("v00000003/commit/0", "v00000002/commit/0"):
            if field == "path":
                with pytest.raises(tj.errors.StoreError) as err:
                    client.get_json(path)
                assert err.value.reason == "not_found"
        if field != "path":
            with pytest.raises(tj.errors.StoreError) as err:
                client.get("h/w")
            assert err.value.reason == "not_found"
    assert [f.name.split(".")[0] for f in (proc.dir / "corrupt").iterdir()] == [file.stem]


def test_a_truncated_file_is_set_aside_at_start(stores) -> None:
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        client.put("t/w", np.arange(1000, dtype=np.int32), durable=True)
    proc.stop()
    [file] = (proc.dir / "objects").glob("*.obj")
    file.write_bytes(file.read_bytes()[:-10])
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        assert client.list() == []
    assert [f.name.split(".")[0] for f in (proc.dir / "corrupt").iterdir()] == [file.stem]


def test_the_memory_tier_is_bounded_and_evicted_objects_come_from_disk(stores) -> None:
    proc = stores.start(memory_bytes=10_000)
    arrays = [_rng_array((1000,), np.float32, seed=i) for i in range(6)]  # 4000 bytes each
    with store.StoreClient(proc.address) as client:
        for i, array in enumerate(arrays):
            client.put(f"m/{i}", array)
        client.flush()
        assert client.stats()["memory_bytes"] <= 10_000
        for _ in range(2):
            for i, array in enumerate(arrays):
                np.testing.assert_array_equal(client.get(f"m/{i}", ((10, 20),)), array[10:20])
                assert client.stats()["memory_bytes"] <= 10_000


# -- replication ------------------------------------------------------------------------------


def test_a_killed_store_is_recovered_from_its_replica(stores) -> None:
    procs = [stores.start(f"s{i}") for i in range(3)]
    full = _rng_array((12, 8), np.float32)
    with store.ReplicatedStore([p.address for p in procs], replicas=1, connect_timeout=1) as rs:
        for host in range(3):  # host h writes rows 4h:4h+4 to stores h and h+1
            box = ((4 * host, 4 * host + 4), (0, 8))
            written = rs.put(
                host, "v1/w", full[4 * host : 4 * host + 4], box=box, global_shape=full.shape
            )
            assert written == [host, (host + 1) % 3]
        assert [len(c.list()) for c in rs.clients] == [2, 2, 2]
        _kill(procs[2])
        assert rs.alive() == [True, True, False]
        tic = time.monotonic()
        got = rs.get("v1/w", ((9, 12), (2, 5)), prefer=2)  # host 2's rows, from store 0
        assert time.monotonic() - tic < 5
        np.testing.assert_array_equal(got, full[9:12, 2:5])
        np.testing.assert_array_equal(rs.get("v1/w", ((4, 8), (0, 8)), prefer=1), full[4:8])
        # a put to a dead store fails unless fewer copies are accepted
        with pytest.raises(tj.errors.StoreError, match=r"reached 1 of 2 stores .*store 2 \(127"):
            rs.put(1, "v2/w", full[4:8], box=((4, 8), (0, 8)), global_shape=full.shape)
        assert rs.put(
            1, "v2/w", full[4:8], box=((4, 8), (0, 8)), global_shape=full.shape, min_copies=1
        ) == [1]
        _kill(procs[0])
        with pytest.raises(tj.errors.StoreError) as err:
            rs.get("v1/w", ((9, 12), (2, 5)), prefer=2)
        message = str(err.value)
        assert "'v1/w' box ((9, 12), (2, 5))" in message
        for i in (2, 0, 1):
            assert f"store {i} ({procs[i].address})" in message
        assert "unavailable" in message and "not_found" in message


def test_a_corrupt_replica_is_skipped_for_a_good_one(stores) -> None:
    procs = [stores.start(f"s{i}", memory_bytes=0) for i in range(2)]
    array = _rng_array((32, 32), np.float32)
    with store.ReplicatedStore([p.address for p in procs], replicas=1) as rs:
        assert rs.put(0, "v/w", array, durable=True) == [0, 1]
        [file] = (procs[0].dir / "objects").glob("*.obj")
        raw = bytearray(file.read_bytes())
        raw[-1] ^= 0x01
        file.write_bytes(raw)
        np.testing.assert_array_equal(rs.get("v/w", prefer=0), array)
        assert rs.clients[0].list() == []  # detected on store 0 and set aside
        rs.put_json("v/COMMIT", {"ok": True})
        assert rs.get_json("v/COMMIT", prefer=1) == {"ok": True}
        assert json.loads(json.dumps(rs.delete("v/"))) == [1, 2]


def test_a_client_dying_mid_put_leaves_the_old_object(client, server) -> None:
    old = np.arange(1 << 18, dtype=np.int32)
    client.put("d/w", old)
    with _partial_put(server.address, "d/w", old + 1, durable=True, fraction=3):
        pass  # a third of the body is sent: then the worker dies
    np.testing.assert_array_equal(client.get("d/w"), old)
    assert [i.checksum for i in client.list("d/")] == [wire.checksum(wire.as_bytes(old))]


def _stopped(pid: int) -> bool:
    """Whether every thread of process ``pid`` is stopped (state T in its stat)."""
    states = []
    for stat in pathlib.Path(f"/proc/{pid}/task").glob("*/stat"):
        with contextlib.suppress(FileNotFoundError):  # a thread that ended meanwhile
            states.append(stat.read_text().rsplit(")", 1)[1].split()[0])
    return bool(states) and all(state == "T" for state in states)


def test_a_stopped_store_is_skipped_within_the_connect_timeout(stores) -> None:
    procs = [stores.start(f"s{i}") for i in range(2)]
    array = _rng_array((16, 16), np.float32)
    addresses = [p.address for p in procs]
    with store.ReplicatedStore(addresses, replicas=1) as rs:
        rs.put(0, "v/w", array)
    os.kill(procs[0].pid, signal.SIGSTOP)  # accepts connections (the kernel does), never answers
    # kill() returns before every thread of the server has stopped: a hello answered in between
    # would make the store look alive, so wait until the kernel reports each thread stopped
    deadline = time.monotonic() + 10
    while not _stopped(procs[0].pid):
        assert time.monotonic() < deadline, "the store did not stop"
        time.sleep(0.001)
    with store.ReplicatedStore(addresses, replicas=1, connect_timeout=1) as rs:
        tic = time.monotonic()
        np.testing.assert_array_equal(rs.get("v/w", ((0, 4), (0, 16)), prefer=0), array[:4])
        assert time.monotonic() - tic < 10
        assert rs.alive() == [False, True]


def test_a_second_server_on_the_same_dir_refuses_to_start(stores) -> None:
    stores.start("s0")
    with pytest.raises(tj.errors.StoreError, match="exited with 2 before listening"):
        stores.start("s0", stderr=subprocess.DEVNULL)


def test_the_unix_socket_serves_the_same_store_to_this_user_only(stores, tmp_path) -> None:
    token_file = tmp_path / "token"
    token_file.write_text("tok")
    path = tmp_path / "store.sock"
    proc = stores.start(token_file=token_file, unix_socket=path)
    assert proc.unix_address == f"unix:{path}"
    assert path.stat().st_mode & 0o077 == 0  # no access for group or others
    full = _rng_array((8, 8), ml_dtypes.bfloat16)
    with store.StoreClient(proc.unix_address, token="tok") as unix:
        unix.put("u/w", full)
        with store.StoreClient(proc.address, token="tok") as tcp:
            np.testing.assert_array_equal(tcp.get("u/w", ((2, 5), (1, 8))), full[2:5, 1:8])
    with pytest.raises(tj.errors.StoreError, match="requires a token"):
        store.StoreClient(proc.unix_address).list()
    proc.stop()
    assert not path.exists()


def test_a_failed_disk_write_blocks_the_commit_marker_until_it_succeeds(stores) -> None:
    from tenplex_jax._src.multihost.store.tiers import _key

    proc = stores.start()
    array = _rng_array((128,), np.float32)
    blocker = proc.dir / "objects" / f"{_key('array', 'f/w', ((0, 128),))}.obj"
    blocker.mkdir()  # a directory where the object's file must go: its rename fails
    (blocker / "x").write_text("x")
    with store.StoreClient(proc.address) as client:
        with pytest.raises(tj.errors.StoreError, match="failed on the store's disk") as err:
            client.put("f/w", array, durable=True)
        assert err.value.reason == "disk"
        client.put("f/w", array)  # acknowledged from memory; its write-back fails
        with pytest.raises(tj.errors.StoreError, match=r"disk writes failed .*'f/w'") as err:
            client.put_json("f/COMMIT", {"step": 1})
        assert err.value.reason == "disk"
        assert client.get_json("f/COMMIT", default=None) is None
        client.put_json("f/NOTE", {"step": 1}, flush=False)  # does not wait for the objects
        assert client.get_json("f/NOTE") == {"step": 1}
        np.testing.assert_array_equal(client.get("f/w"), array)  # still served from memory
        (blocker / "x").unlink()
        blocker.rmdir()
        client.put_json("f/COMMIT", {"step": 1})  # the write-back is retried, then the marker
        assert client.stats()["dirty"] == 0
    _kill(proc)
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        np.testing.assert_array_equal(client.get("f/w"), array)
        assert client.get_json("f/COMMIT") == {"step": 1}


def test_the_client_refuses_bytes_that_fail_their_checksum() -> None:
    """A server (here a fake one on 127.0.0.1) whose bytes were damaged in transit or in memory."""
    listener = socket.create_server(("127.0.0.1", 0))
    good = np.arange(6, dtype=np.int32)
    bad = good.copy()
    bad[3] ^= 1

    def serve():
        conn, _ = listener.accept()
        with conn:
            for _ in range(2):  # hello, get
                nheader, _ = wire.recv_prefix(conn)
                request = wire.recv_header(conn, nheader, 1 << 20)
                if request["op"] == "hello":
                    wire.send_frame(conn, {"ok": True})
                    continue
                info = store.ObjectInfo("w", ((0, 6),), (6,), "int32", 24, wire.checksum(good))
                reply = {
                    "ok": True,
                    "info": info.to_json(),
                    "box": [[0, 6]],
                    "checksum": info.checksum,
                    "rid": request["rid"],
                }
                wire.send_frame(conn, reply, bad.tobytes())

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        host, port = listener.getsockname()
        with pytest.raises(tj.errors.StoreError, match="received bytes have checksum") as err:
            store.StoreClient(f"{host}:{port}", timeout=10).get("w")
        assert err.value.reason == "corrupt"
    finally:
        thread.join(10)
        listener.close()


def test_concurrent_puts_gets_and_deletes_stay_consistent_across_a_kill(stores) -> None:
    proc = stores.start(memory_bytes=64 << 10)  # evictions and write-throughs both happen
    keys = [f"cc/{k}" for k in range(6)]
    written = {k: set() for k in keys}
    errors = []

    def work(thread: int):
        rng = np.random.default_rng(thread)
        try:
            with store.StoreClient(proc.address) as client:
                for i in range(40):
                    key = keys[rng.integers(len(keys))]
                    tag = thread * 1000 + i
                    action = rng.random()
                    if action < 0.6:
                        written[key].add(tag)
                        n = int(rng.choice([1000, 8000]))  # 4 KB or 32 KB
                        client.put(key, np.full(n, tag, np.int32), durable=bool(rng.random() < 0.2))
                    elif action < 0.9:
                        try:
                            got = client.get(key)
                        except tj.errors.StoreError as error:
                            assert error.reason == "not_found", error
                            continue
                        assert (got == got[0]).all() and int(got[0]) in written[key]
                    else:
                        client.delete(key)
        except Exception as error:
            errors.append(error)

    threads = [threading.Thread(target=work, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors
    with store.StoreClient(proc.address) as client:
        client.flush()
        before = {(i.path, i.box): i.checksum for i in client.list("cc/")}
    _kill(proc)
    proc = stores.start(memory_bytes=64 << 10)
    with store.StoreClient(proc.address) as client:
        after = {(i.path, i.box): i.checksum for i in client.list("cc/")}
        assert after == before  # flushed: exactly what was served before the kill
        for (path, box), digest in after.items():  # a 4 KB and a 32 KB object per path
            got = client.get(path, box)
            assert (got == got[0]).all() and int(got[0]) in written[path]
            assert wire.checksum(wire.as_bytes(got)) == digest


@pytest.mark.parametrize("durable", [False, True])
def test_a_put_replaces_the_objects_of_its_path_it_conflicts_with(stores, durable) -> None:
    """Pieces of one array (disjoint boxes, same global shape and dtype) live side by side; a put
    of another shape or dtype, or of an overlapping box, replaces what it conflicts with, so a
    later get can only return the newest bytes, also after a restart."""
    proc = stores.start()
    a = np.arange(16, dtype=np.float32).reshape(4, 4)
    with store.StoreClient(proc.address) as client:
        client.put("r/w", a[:2], box=((0, 2), (0, 4)), global_shape=(4, 4), durable=durable)
        client.put("r/w", a[2:], box=((2, 4), (0, 4)), global_shape=(4, 4), durable=durable)
        assert sorted(i.box for i in client.list("r/")) == [((0, 2), (0, 4)), ((2, 4), (0, 4))]
        # an overlapping box of the same array replaces the pieces it overlaps, not the others
        client.put("r/w", a[1:3] + 100, box=((1, 3), (0, 4)), global_shape=(4, 4), durable=durable)
        assert [i.box for i in client.list("r/")] == [((1, 3), (0, 4))]
        # another global shape: another array, every old piece goes
        new = np.full((2, 3), 7, np.float32)
        client.put("r/w", new, durable=durable)
        assert [(i.box, i.global_shape) for i in client.list("r/")] == [(((0, 2), (0, 3)), (2, 3))]
        np.testing.assert_array_equal(client.get("r/w"), new)
        client.put("r/w", new.astype(np.int32), durable=durable)  # another dtype
        assert [i.dtype for i in client.list("r/")] == ["int32"]
        client.flush()
    proc.stop()
    proc = stores.start()
    with store.StoreClient(proc.address) as client:
        assert [(i.dtype, i.global_shape) for i in client.list("r/")] == [("int32", (2, 3))]
        np.testing.assert_array_equal(client.get("r/w"), new.astype(np.int32))


@settings(max_examples=60, deadline=None)
@given(data=st.data())
def test_streamed_reads_of_any_sub_box_equal_numpy_slicing(tmp_path_factory, data) -> None:
    """``Store.stream`` reads an object from disk a chunk at a time (here a few bytes, so that
    every axis is split somewhere) and yields exactly the sub-box's bytes in C order."""
    from tenplex_jax._src.multihost.store.tiers import _key
    from tenplex_jax._src.multihost.store.updates import Store

    shape = tuple(data.draw(st.lists(st.integers(1, 5), min_size=1, max_size=4)))
    dtype = data.draw(st.sampled_from([np.int8, np.float32, ml_dtypes.bfloat16]))
    offset = tuple(data.draw(st.integers(0, 3)) for _ in shape)
    box = tuple((o, o + n) for o, n in zip(offset, shape))
    sub = tuple(
        sorted(data.draw(st.tuples(st.integers(o, o + n), st.integers(o, o + n))))
        for o, n in zip(offset, shape)
    )
    chunk = data.draw(st.integers(1, 64))
    array = _rng_array(shape, dtype, seed=len(shape))
    root = tmp_path_factory.mktemp("stream")
    tiers = Store(root, memory_bytes=0)
    try:
        info = store.ObjectInfo(
            "s/w",
            box,
            tuple(o + n for o, n in box),
            np.dtype(dtype).name,
            array.nbytes,
            wire.checksum(wire.as_bytes(array)),
        )
        tiers.put(info, np.frombuffer(array.tobytes(), np.uint8), durable=True)
        got = b"".join(bytes(p) for p in tiers.stream(_key("array", "s/w", box), sub, chunk))
        want = array[boxes.index(sub, box)]
        assert got == np.ascontiguousarray(want).tobytes()
    finally:
        tiers.close()
