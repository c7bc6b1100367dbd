"""The tensor store's operations for a parameter server: ``accumulate`` (an atomic add, once per
pusher and clock) and ``cas_json`` (compare and swap), under concurrent clients, threads and
processes, on real servers on 127.0.0.1."""

from __future__ import annotations

import subprocess
import sys
import threading

import numpy as np
import pytest

from tenplex_jax.errors import StoreError
from tenplex_jax.multihost import store
from tests.helpers import Stores

N = 1 << 16  # floats per array: large enough that a torn read would show


@pytest.fixture
def server(tmp_path):
    started = Stores(tmp_path)
    try:
        yield started.start("s0")
    finally:
        started.reap()


def _push(client, name: str, clock: int, value: float, n: int = N) -> bool:
    stage = f"stage/{name}/{clock}"
    client.put(stage, np.full(n, value, np.float32))
    _, applied = client.accumulate("w", stage, name=name, clock=clock)
    client.delete(stage)
    return applied


PUSHER = """
import sys
import numpy as np
from tenplex_jax.multihost.store import StoreClient
address, name, waves, value = sys.argv[1], sys.argv[2], int(sys.argv[3]), float(sys.argv[4])
with StoreClient(address) as client:
    for clock in range(waves):
        stage = f"stage/{name}/{clock}"
        client.put(stage, np.full(SIZE, value, np.float32))
        client.accumulate("w", stage, name=name, clock=clock)
""".replace("SIZE", str(N))


def test_concurrent_accumulates_lose_no_update_and_no_read_is_torn(server):
    client = store.StoreClient(server.address)
    client.put("w", np.zeros(N, np.float32))
    waves, values = 12, {f"t{i}": float(i + 1) for i in range(3)} | {"p0": 10.0, "p1": 20.0}
    reads, errors = [], []
    stop = threading.Event()

    def read():
        with store.StoreClient(server.address) as reader:
            while not stop.is_set():
                w, info = reader.get("w", with_info=True)
                reads.append((float(w[0]), bool((w == w[0]).all()), dict(info.clocks)))

    def push(name):
        try:
            with store.StoreClient(server.address) as mine:
                for clock in range(waves):
                    assert _push(mine, name, clock, values[name])
        except Exception as error:  # reported below
            errors.append(error)

    reader = threading.Thread(target=read)
    threads = [threading.Thread(target=push, args=(n,)) for n in values if n.startswith("t")]
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", PUSHER, server.address, n, str(waves), str(values[n])]
        )
        for n in values
        if n.startswith("p")
    ]
    reader.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for p in procs:
        assert p.wait(timeout=120) == 0
    stop.set()
    reader.join(timeout=60)
    assert not errors, errors
    w, info = client.get("w", with_info=True)
    assert dict(info.clocks) == dict.fromkeys(values, waves)
    assert np.all(w == waves * sum(values.values()))  # every update of every pusher, once
    assert len(reads) > 5
    for first, whole, clocks in reads:  # each read is one version: uniform, and its clocks' sum
        assert whole and first == sum(values[n] * c for n, c in clocks.items())


def test_an_accumulate_applies_once_in_turn_and_checks_its_arrays(server):
    client = store.StoreClient(server.address)
    client.put("w", np.arange(8, dtype=np.float32))
    assert _push(client, "a", 0, 1.0, n=8)
    staged = client.put("stage/a/0", np.ones(8, np.float32))
    info, applied = client.accumulate("w", "stage/a/0", name="a", clock=0)  # in already: skipped
    assert not applied and dict(info.clocks) == {"a": 1}
    # the same push tried again knows it is in (the update in is its own); another update is not
    _, applied = client.accumulate("w", "stage/a/0", name="a", clock=0, update=staged.checksum)
    assert applied and dict(info.sources) == {"a": staged.checksum}
    other = client.put("stage/a/x", np.full(8, 2.0, np.float32)).checksum
    assert not client.accumulate("w", "stage/a/x", name="a", clock=0, update=other)[1]
    np.testing.assert_array_equal(client.get("w"), np.arange(8) + 1)
    with pytest.raises(StoreError, match="out of turn") as refused:
        client.accumulate("w", "stage/a/0", name="a", clock=2)
    assert refused.value.reason == "refused"
    client.put("stage/b/0", np.ones(9, np.float32))
    with pytest.raises(StoreError, match="one shape and dtype"):
        client.accumulate("w", "stage/b/0", name="b", clock=0)
    client.put("i", np.arange(8, dtype=np.int32))
    with pytest.raises(StoreError, match="float"):
        client.accumulate("i", "stage/a/0", name="a", clock=0)
    with pytest.raises(StoreError, match="name"):
        client.accumulate("w", "stage/a/0", name="a/b", clock=0)
    np.testing.assert_array_equal(client.get("w"), np.arange(8) + 1)  # refusals change nothing


def test_accumulated_arrays_and_their_clocks_survive_a_restart(tmp_path):
    stores = Stores(tmp_path)
    try:
        proc = stores.start("s0")
        with store.StoreClient(proc.address) as client:
            client.put("w", np.zeros(4, np.float32))
            _push(client, "a", 0, 2.0, n=4)
            client.flush()
        proc.stop()
        proc = stores.start("s0")
        with store.StoreClient(proc.address) as client:
            w, info = client.get("w", with_info=True)
            assert dict(info.clocks) == {"a": 1} and np.all(w == 2.0)
    finally:
        stores.reap()


def test_compare_and_swap_under_concurrent_increments(server):
    client = store.StoreClient(server.address)
    first = client.cas_json("n", {"count": 0}, expect=None)
    assert first.swapped and first.value == {"count": 0}
    again = client.cas_json("n", {"count": 9}, expect=None)  # it exists now: refused
    assert not again.swapped and again.value == {"count": 0} and again.version == first.version

    def bump(times):
        with store.StoreClient(server.address) as mine:
            value, version, _ = mine.get_json("n", versioned=True)
            for _ in range(times):
                while True:
                    cas = mine.cas_json("n", {"count": value["count"] + 1}, expect=version)
                    value, version = cas.value, cas.version
                    if cas.swapped:
                        break

    threads = [threading.Thread(target=bump, args=(25,)) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert client.get_json("n") == {"count": 100}
    assert client.get_json("missing", None, versioned=True) == (None, None, None)
