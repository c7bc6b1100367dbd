"""The store's read-modify-write operations lose nothing: a request repeated is done once (also
across a restart), JSON bodies are parsed inside the memory bound, compare-and-swap versions
only grow, a non-finite update is refused, a put and an accumulate of one path take turns, and
an array larger than the transfer budget is accumulated a chunk at a time. Real servers on
127.0.0.1."""

from __future__ import annotations

import json
import threading

import numpy as np
import psutil
import pytest

from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.server import JSON_PARSE_FACTOR
from tenplex_jax.errors import StoreError, WSPError
from tenplex_jax.multihost import store
from tenplex_jax.wsp import ParameterServer
from tests.helpers import peak_rss, raw_socket, recv_frame

MIB = 1 << 20


def _cas(sock, path: str, obj, expect, rid: str) -> dict:
    """One cas_json request with a chosen request id, as a client that lost its reply sends it
    again."""
    data = obj if isinstance(obj, bytes) else json.dumps(obj).encode()
    request = {"op": "cas_json", "path": path, "expect": expect, "rid": rid}
    wire.send_header(sock, {**request, "checksum": wire.checksum(data)}, len(data))
    header, _ = recv_frame(sock)
    continued = bool(header.get("continue"))
    if continued:
        wire.send_body(sock, data)
        header, _ = recv_frame(sock)
    assert header.get("rid") == rid  # every reply names its request
    return header | {"body_sent": continued}


def test_a_compare_and_swap_repeated_is_done_once_also_after_a_restart(stores):
    proc = stores.start("s0")
    with store.StoreClient(proc.address) as client:
        client.put_json("led", {"n": 0})
        _, v0, _ = client.get_json("led", versioned=True)
    sock = raw_socket(proc.address)
    first = _cas(sock, "led", {"n": 1}, v0, "a" * 32)
    again = _cas(sock, "led", {"n": 1}, v0, "a" * 32)  # its reply was lost: the same request
    assert first["swapped"] and again["swapped"] and again["version"] == first["version"]
    assert first["body_sent"] and not again["body_sent"]  # answered before its body came again
    other = _cas(sock, "led", {"n": 9}, v0, "b" * 32)  # another writer with the old version
    assert not other["swapped"] and other["version"] == first["version"]
    sock.close()
    proc.kill()
    proc = stores.start("s0")  # the ids of the last writes are in the object's file
    sock = raw_socket(proc.address)
    assert _cas(sock, "led", {"n": 1}, v0, "a" * 32)["swapped"]
    with store.StoreClient(proc.address) as client:
        assert client.get_json("led", versioned=True)[:2] == ({"n": 1}, first["version"])
    sock.close()


def test_versions_only_grow_so_a_stale_writer_never_wins_and_only_objects_are_kept(stores):
    proc = stores.start("s0")
    with store.StoreClient(proc.address) as client:
        assert client.cas_json("k", {"v": "A"}, expect=None).swapped
        _, stale, _ = client.get_json("k", versioned=True)
        b = client.cas_json("k", {"v": "B"}, expect=stale)
        a = client.cas_json("k", {"v": "A"}, expect=b.version)  # A -> B -> A
        assert a.swapped and stale < b.version < a.version
        late = client.cas_json("k", {"v": "stale"}, expect=stale)
        assert not late.swapped and late.value == {"v": "A"} and late.version == a.version
        client.delete("k")  # written again after a delete: still a new version
        assert client.cas_json("k", {"v": "A"}, expect=None).version > a.version
        for obj in (5, None, [], "x"):
            with pytest.raises(StoreError, match="JSON objects"):
                client.put_json("j", obj)
    # a client of another kind sends what it likes: the store refuses
    sock = raw_socket(proc.address)
    for body in (b"5", b"null", b"[]", b'{"a": NaN}', b'{"a": Infinity}', b"{"):
        reply = _cas(sock, "j", body, None, "c" * 32)
        assert not reply["ok"] and reply["reason"] == "refused", (body, reply)
    sock.close()


def test_json_bodies_are_parsed_inside_the_memory_bound(stores):
    budget = 64 * MIB  # --memory-bytes 16 MiB: the budget's floor, 64 MiB
    proc = stores.start("s0", memory_bytes=16 * MIB)
    pid = proc.pid
    with store.StoreClient(proc.address, timeout=120) as client:
        client.put_json("small", {"warm": [1]})
        base = psutil.Process(pid).memory_info().rss
        huge = {"a": [[[]]] * (10 * MIB)}  # 60 MiB of the costliest JSON to parse
        with pytest.raises(StoreError, match="transfer budget") as refused:
            client.put_json("huge", huge)
        assert refused.value.reason == "too_large"
        # each as large as the budget admits (it holds 1 + JSON_PARSE_FACTOR times the body)
        fits = {"a": [[[]]] * (budget // (JSON_PARSE_FACTOR + 2) // 6)}

        def put(i):
            with store.StoreClient(proc.address, timeout=120) as mine:
                mine.put_json(f"fits/{i}", fits, flush=False)

        threads = [threading.Thread(target=put, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        assert client.list_json("fits/") == [f"fits/{i}" for i in range(4)]
    grown = peak_rss(pid) - base
    # the parsed bodies take turns in the budget: the peak stays within it (measured: ~0.8x)
    assert grown < 1.25 * budget, grown / budget


def test_a_non_finite_update_is_refused_and_the_weights_are_untouched(stores):
    addresses = [stores.start(f"s{i}").address for i in range(2)]
    w = {"a": np.ones(64, np.float32), "b": np.full(64, 3e38, np.float32)}
    with ParameterServer(addresses) as ps:
        ps.create(w, total=None)
        ps.update(lambda led: (led.join("vw"), None))
        for leaf, bad, what in [
            ("a", np.nan, "holds nan"),
            ("a", np.inf, "holds inf"),
            ("b", 1e38, "overflows"),
        ]:
            ps.update(lambda led: led.claim("vw", 0, 1))
            update = {"a": np.zeros(64, np.float32), "b": np.zeros(64, np.float32)}
            update[leaf][7] = bad
            with pytest.raises(WSPError, match=what) as refused:
                ps.push("vw", 0, update)
            assert refused.value.reason == "invalid" and "element 7" in str(refused.value)
            ledger = ps.ledger()
            assert ledger.log == () and ledger.leases["vw"].wave == 0  # nothing committed
            pulled = ps.pull()
            assert all(np.array_equal(pulled[k], w[k]) for k in w)  # the weights untouched
            assert not any(c.list("wsp/stage/") for c in ps.clients)  # the stage deleted
        ps.push("vw", 0, {"a": np.ones(64, np.float32), "b": np.zeros(64, np.float32)})
        assert np.all(ps.pull()["a"] == 2.0)


def test_a_put_and_an_accumulate_of_one_path_take_turns(stores):
    proc = stores.start("s0")
    n = 1 << 20
    with store.StoreClient(proc.address) as client:
        for trial in range(30):
            client.put("w", np.zeros(n, np.float32))
            client.put("stage", np.ones(n, np.float32))
            go = threading.Barrier(2)

            def put(go=go):
                with store.StoreClient(proc.address) as mine:
                    go.wait()
                    mine.put("w", np.full(n, 5.0, np.float32))

            def accumulate(go=go):
                with store.StoreClient(proc.address) as mine:
                    go.wait()
                    mine.accumulate("w", "stage", name="p", clock=0)

            threads = [threading.Thread(target=f) for f in (put, accumulate)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            w, info = client.get("w", with_info=True)
            # either order, never the accumulate's sum of the old array over the put
            assert (np.all(w == 5.0) and info.clocks == ()) or (
                np.all(w == 6.0) and dict(info.clocks) == {"p": 1}
            ), (trial, w[:2], info.clocks)


def test_an_array_larger_than_the_budget_is_accumulated_a_chunk_at_a_time(stores):
    proc = stores.start("s0", memory_bytes=16 * MIB)  # transfer budget: 64 MiB
    n = 24 * MIB  # 96 MiB of float32: more than the whole budget
    with store.StoreClient(proc.address, timeout=120) as client:
        client.put("w", np.arange(n, dtype=np.float32))
        client.put("stage", np.full(n, 0.5, np.float32))
        base = psutil.Process(proc.pid).memory_info().rss
        info, applied = client.accumulate("w", "stage", name="p", clock=0, consume=True)
        assert applied and dict(info.clocks) == {"p": 1}
        grown = peak_rss(proc.pid) - base
        got = client.get("w")
        assert got[0] == 0.5 and got[-1] == n - 1 + 0.5 and info.checksum == wire.checksum(got)
        assert client.list("stage") == []  # consumed: the sum is on disk
    assert grown < 64 * MIB, grown / MIB  # a few chunks, not the arrays


def test_a_consumed_stage_stays_until_the_sum_is_on_disk(stores):
    proc = stores.start("s0")
    with store.StoreClient(proc.address) as client:
        client.put("w", np.zeros(1024, np.float32))
        client.flush()
        client.put("stage/0", np.ones(1024, np.float32))
        client.accumulate("w", "stage/0", name="p", clock=0, consume=True)
        client.flush()  # the sum reached disk: the stage is gone
        assert client.list("stage/") == []
    proc.kill()
    proc = stores.start("s0")
    with store.StoreClient(proc.address) as client:
        w, info = client.get("w", with_info=True)
        assert np.all(w == 1.0) and dict(info.clocks) == {"p": 1}


def test_an_operator_rolls_the_last_wave_back(stores):
    addresses = [stores.start(f"s{i}").address for i in range(2)]
    w = {"a": np.ones(8, np.float32), "b": np.zeros(8, np.float32)}
    with ParameterServer(addresses) as ps:
        ps.create(w, total=4)
        for vw in ("v1", "v2"):
            ps.update(lambda led, vw=vw: (led.join(vw), None))
        ps.update(lambda led: led.claim("v1", 0, 1))
        ps.push("v1", 0, {"a": np.full(8, 1.0, np.float32), "b": np.full(8, 2.0, np.float32)})
        before = ps.pull()
        ps.update(lambda led: led.claim("v2", 0, 1))
        ps.push("v2", 0, {"a": np.full(8, 0.5, np.float32), "b": np.full(8, 9.0, np.float32)})
        ledger = ps.rollback()  # v2's wave was bad
        assert ledger.undone == (("v2", 0, (1,)),) and ledger.returned == (1,)
        assert ledger.trained() == [0] and ledger.committed["v2"] == 1
        after = ps.pull()  # the weights hold every committed push again (v2's as a no-op)
        assert all(np.array_equal(after[k], before[k]) for k in w)
        with pytest.raises(WSPError, match="cannot be rolled back") as refused:
            ps.rollback()  # v1's wave is the last in the log, but not the last in each leaf
        assert refused.value.reason == "refused" and ps.ledger().trained() == [0]
        ps.update(lambda led: led.claim("v2", 1, 1))  # minibatch 1 is trained again
        ps.push("v2", 1, {"a": np.full(8, 0.25, np.float32), "b": np.zeros(8, np.float32)})
        assert sorted(ps.ledger().trained()) == [0, 1]
        assert np.all(ps.pull()["a"] == 2.25)


def test_json_versions_only_grow_past_a_delete_a_restart_and_a_clock_stepped_back(
    tmp_path, monkeypatch
):
    """A version is above every one the store handed out, also when the file of the highest
    was deleted before a restart and the clock has stepped back since: a client holding an old
    version never sees it handed out again (a compare-and-swap it expects would pass)."""
    import time

    from tenplex_jax._src.multihost.store import tiers
    from tenplex_jax._src.multihost.store.updates import Store

    ahead = time.time_ns() + 3600 * 10**9  # the clock an hour ahead, then set right
    monkeypatch.setattr(tiers.time, "time_ns", lambda: ahead)
    first = Store(tmp_path, 1 << 20, shm=None)
    old = first.put_json("ledger", np.frombuffer(b'{"n": 1}', np.uint8))
    assert first.delete("ledger") == 1
    first.close()
    monkeypatch.undo()
    again = Store(tmp_path, 1 << 20, shm=None)
    new = again.put_json("ledger", np.frombuffer(b'{"n": 2}', np.uint8))
    again.close()
    assert new > old
