"""A push acknowledged after two rounds of requests and added behind its acknowledgement, a pull
in one round or none, on real stores on 127.0.0.1: the stage and its check in one request per
store, a commit from the last ledger the client saw, the apply behind it; a piece whose segment
holds the ledger's commits is read with no request; the writes fsynced behind their replies
still survive a SIGKILL of their store."""

from __future__ import annotations

import collections
import itertools
import threading

import numpy as np
import pytest

from tenplex_jax._src.multihost.store import client as store_client
from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.multihost.store.client import Swap
from tenplex_jax._src.wsp.ps import STAGE
from tenplex_jax.errors import StoreError, WSPError
from tenplex_jax.multihost.store import StoreClient
from tenplex_jax.wsp import ParameterServer
from tests.helpers import raw_socket, recv_frame
from tests.wsp.ps_clients import BIG, hold_apply, two_vws
from tests.wsp.store_proxy import FaultProxy

LEAVES = {"embed": (64, 16), "norm": (16,), "head": (16, 64)}


def _requests(proxies, since) -> list[collections.Counter]:
    """The ops each proxy relayed after its first ``since[i]`` requests."""
    return [collections.Counter(op for op, _ in p.requests[n:]) for p, n in zip(proxies, since)]


@pytest.mark.parametrize("spread", [False, True], ids=["one-store", "two-stores"])
def test_a_push_is_a_request_per_piece_then_its_apply_and_a_pull_none(stores, spread):
    """Weights over two stores: a push is a put (the stage and its check) per piece and one
    compare-and-swap of the ledger, then an accumulate per piece behind its acknowledgement: no
    flush, no listing, no read of the ledger. Weights under ``spread_bytes`` live on the
    ledger's store, and the last piece's put commits the wave too: no compare-and-swap. The
    first pull asks each piece's store for it (naming its segment); every later pull given the
    ledger copies the pieces out of their segments, no request."""
    procs = [stores.start(f"s{i}") for i in range(2)]
    with FaultProxy(procs[0].address) as p0, FaultProxy(procs[1].address) as p1:
        proxies = (p0, p1)
        with ParameterServer([p.address for p in proxies]) as ps:
            weights = {k: np.zeros(s, np.float32) for k, s in LEAVES.items()}
            ps.create(weights, total=None, **({"spread_bytes": 4} if spread else {}))
            ps.update(lambda led: (led.join("a"), None))
            updates = {k: np.full(s, 1e-3, np.float32) for k, s in LEAVES.items()}
            per_store = collections.Counter(p.store for p in ps.layout)
            assert set(per_store) == ({0, 1} if spread else {0})
            for wave in range(3):
                ps.update(lambda led, wave=wave: led.claim("a", wave, 1))
                since = [len(p.requests) for p in proxies]
                ledger = ps.push("a", wave, updates)
                assert ledger.pushed("a", wave) and ps.push_seconds["commit"] >= 0
                ps.settle()
                pushed = _requests(proxies, since)
                since = [len(p.requests) for p in proxies]
                weights = ps.pull(ledger)
                pulled = _requests(proxies, since)
                for store in (0, 1):
                    n = per_store[store]
                    commit = {"cas_json": 1} if store == 0 and spread else {}
                    expected = collections.Counter(put=n, accumulate=n, **commit)
                    assert pushed[store] == +expected, (wave, store, pushed)
                    asked = {"get_shared": n} if wave == 0 and n else {}
                    assert pulled[store] == asked, (wave, store, pulled)
                for k, s in LEAVES.items():
                    np.testing.assert_array_equal(
                        weights[k], np.full(s, (wave + 1) * 1e-3, np.float32)
                    )
            assert ps.ledger() == ledger  # the commit the put made is the stored ledger


def test_a_push_is_acknowledged_at_its_commit_and_added_behind_it(stores):
    """The push returns while its apply is held; meanwhile the stores' pieces lack it, and
    another client's pull adds it from the stage itself. Released, the pusher's own apply finds
    its update in (no error), and its next pull and push wait for that apply first."""
    addresses = [stores.start(f"s{i}").address for i in range(2)]
    pusher, other = ParameterServer(addresses), ParameterServer(addresses)
    pusher.create({k: np.zeros(s, np.float32) for k, s in LEAVES.items()}, total=None)
    other.open()
    pusher.update(lambda led: (led.join("a"), None))
    pusher.update(lambda led: led.claim("a", 0, 1))
    held = hold_apply(pusher)
    started, release, done = held.started, held.release, held.done
    updates = {k: np.full(s, 0.5, np.float32) for k, s in LEAVES.items()}
    try:
        ledger = pusher.push("a", 0, updates)  # acknowledged: committed, its apply held
        assert started.wait(60) and ledger.pushed("a", 0) and not done.is_set()
        for p in other.layout:  # no piece holds it yet
            info = other.clients[p.store].list(f"wsp/w/{p.key}")[0]
            assert dict(info.clocks).get("a", 0) == 0, info
        pulled = other.pull(ledger)  # adds the committed wave from its stage
        for k, s in LEAVES.items():
            np.testing.assert_array_equal(pulled[k], np.full(s, 0.5, np.float32))
    finally:
        release.set()
    pusher.settle()  # the held apply found its own update in: no error
    assert done.is_set()
    again = pusher.pull(ledger)
    for k, s in LEAVES.items():
        np.testing.assert_array_equal(again[k], np.full(s, 0.5, np.float32))
    pusher.close()
    other.close()


def test_a_stage_the_check_refuses_is_not_kept_and_one_it_passes_is(stores):
    client = StoreClient(stores.start("s0").address)
    client.put("w", np.array([1.0, 1e38, 0.0], np.float32))
    staged, held, swap = client.stage("s/0", np.ones(3, np.float32), into="w", name="a")
    assert swap is None and held.path == "w" and dict(held.clocks) == {}
    np.testing.assert_array_equal(client.get("s/0"), np.ones(3, np.float32))
    assert staged.checksum == wire.checksum(wire.as_bytes(np.ones(3, np.float32)))
    with pytest.raises(StoreError, match="at element 1") as error:
        client.stage("s/1", np.array([0.0, np.nan, 0.0], np.float32), into="w", name="a")
    assert error.value.reason == "nonfinite" and not client.list("s/1")
    # finite beside the array alone, but not beside a pending push of the same update
    big = np.array([0.0, 1.5e38, 0.0], np.float32)
    client.stage("s/2", big, into="w", name="a")
    with pytest.raises(StoreError, match="could overflow") as error:
        client.stage("s/3", big, into="w", name="b", beside=[("a", 0, "s/2")])
    assert error.value.reason == "nonfinite" and not client.list("s/3")
    assert [i.path for i in client.list("s/")] == ["s/0", "s/2"]
    client.close()


def test_a_stage_swaps_its_object_only_once_its_check_passed_on_its_basis(stores):
    """A stage's swap (a parameter server's commit in the stage's request) is made after the
    check passed, if the version matches and the array holds the basis; a stage the check
    refuses swaps nothing; a malformed swap is refused before the stage is stored."""
    client = StoreClient(stores.start("s0").address)
    client.put("w", np.array([1.0, 1e38, 0.0], np.float32))
    cas = client.cas_json("led", {"n": 0}, expect=None)
    ones = np.ones(3, np.float32)
    # the array holds no push of "a": a basis that takes one as added is not met
    got = client.stage(
        "s/0", ones, into="w", name="b", swap=Swap("led", {"n": 1}, cas.version, {"a": 1})
    )
    assert got.swap[:3] == (False, None, None) and got.swap.time > cas.time - 60
    assert client.get_json("led", versioned=True)[:2] == ({"n": 0}, cas.version)
    # a stale version: not swapped, and the object there now comes back
    stale = client.stage("s/1", ones, into="w", name="b", swap=Swap("led", {"n": 1}, 99, {}))
    assert stale.swap[:3] == (False, cas.version, {"n": 0})
    # the check refuses: nothing staged, nothing swapped
    nan = np.array([0.0, np.nan, 0.0], np.float32)
    with pytest.raises(StoreError, match="at element 1") as error:
        client.stage("s/2", nan, into="w", name="b", swap=Swap("led", {"n": 1}, cas.version, {}))
    assert error.value.reason == "nonfinite"
    assert client.get_json("led", versioned=True)[0] == {"n": 0} and not client.list("s/2")
    # malformed: refused before the stage is stored
    for bad in ({"n": float("nan")}, {"n": "x" * (wire.MAX_SWAP_BYTES + 1)}):
        with pytest.raises(StoreError, match="swap"):
            client.stage("s/3", ones, into="w", name="b", swap=Swap("led", bad, cas.version, {}))
    with pytest.raises(StoreError, match="basis"):
        client.stage("s/3", ones, into="w", name="b", swap=Swap("led", {}, cas.version, {"a": -1}))
    assert not client.list("s/3")
    done = client.stage(
        "s/4", ones, into="w", name="b", swap=Swap("led", {"n": 1}, cas.version, {})
    )
    assert done.swap.swapped and done.swap.value == {"n": 1} and done.swap.version > cas.version
    assert client.get_json("led", versioned=True)[:2] == ({"n": 1}, done.swap.version)
    client.close()


def test_a_stage_refused_before_its_body_is_read_raises_the_refusal_not_a_broken_pipe(stores):
    """An eager stage the store refuses from its header closes the connection with its body
    unread: the client's send then breaks, and the refusal the store sent is what it raises."""
    client = StoreClient(stores.start("s0").address, retry_seconds=0)
    n = 8 << 20  # 32 MiB: far more than the socket buffers, so the send always breaks
    client.put("w", np.zeros(n, np.float32))
    for _ in range(3):
        bad = Swap("led", {}, None, {"a": -1})
        with pytest.raises(StoreError, match="basis") as error:
            client.stage("s/0", np.ones(n, np.float32), into="w", name="b", swap=bad)
        assert error.value.reason == "invalid" and not client.list("s/")
    client.close()


def test_a_stage_and_a_ledger_fsynced_behind_their_replies_survive_a_sigkill(stores):
    """Written without ``sync``: in their files before the reply, so a SIGKILL of the store
    right after it loses neither (the store's disk writers are busy with earlier puts then: a
    stage left to them would be lost)."""
    proc = stores.start("s0")
    update = np.arange(1 << 16, dtype=np.float32)
    with StoreClient(proc.address) as client:
        client.put("w", np.zeros(1 << 16, np.float32))
        for i in range(8):  # queued for the writers before the stage
            client.put(f"busy/{i}", np.ones(2 << 20, np.float32))
        client.stage("s", update, into="w", name="a", sync=False)
        cas = client.cas_json("ledger", {"n": 1}, expect=None, sync=False)
        assert cas.swapped
    port = int(proc.address.rpartition(":")[2])
    proc.kill()
    proc = stores.start("s0", port=port)
    with StoreClient(proc.address) as client:
        np.testing.assert_array_equal(client.get("s"), update)
        assert client.get_json("ledger", versioned=True)[:2] == ({"n": 1}, cas.version)
        client.flush()  # the fsyncs behind them are done (none failed)


def test_an_eager_body_refused_before_it_is_read_closes_the_connection(stores):
    """A request whose body was sent without waiting for "continue" is refused before the
    store reads it: the reply says why, then the store closes the connection (the body's bytes
    are never taken for a request)."""
    proc = stores.start("s0")
    sock = raw_socket(proc.address)
    header = {"op": "put", "path": "x", "dtype": "float32", "global_shape": [4]}
    header |= {"box": [[0, 4]], "eager": True, "rid": "r1"}
    wire.send_header(sock, header, 8)  # 4 float32 are 16 bytes
    sock.sendall(b"\0" * 8)
    reply, _ = recv_frame(sock)
    assert not reply["ok"] and reply["reason"] == "refused" and "16 bytes" in reply["error"]
    assert wire.recv_prefix(sock) is None  # closed
    sock.close()
    with StoreClient(proc.address) as client:
        assert not client.list("x")


def test_a_check_that_assumed_a_wave_added_that_a_piece_lacks_checks_again(stores):
    """a's wave is committed and not yet added; b's client believes every piece holds it (as
    after a store that lost the sum restarted): b's first check leaves a's update out, sees the
    piece's clocks behind its belief, checks again beside it and is refused (the two could
    overflow)."""
    first, second = two_vws(stores)
    held, pushed = hold_apply(first), []
    committed, release, big = held.started, held.release, BIG
    pushing = threading.Thread(target=lambda: pushed.append(first.push("a", 0, big)))
    pushing.start()
    try:
        assert committed.wait(60)
        second.ledger()  # the commit seen: only the clocks are wrong
        second._clocks = {p.key: {"a": 1} for p in second.layout}
        with pytest.raises(WSPError, match="could overflow") as error:
            second.push("b", 0, big)
        assert error.value.reason == "invalid"
    finally:
        release.set()
        pushing.join(60)
    assert pushed and not second.ledger().pushed("b", 0)
    assert not second.coordinator.list(f"{STAGE}b/")
    pulled = second.pull(timeout=30)
    assert pulled["w"][0] == np.float32(2e38)
    assert {k: dict(v) for k, v in second._clocks.items()} == {
        p.key: {"a": 1} for p in second.layout
    }
    first.close()
    second.close()


def test_a_stage_whose_swap_was_made_is_answered_as_done_when_tried_again(stores, monkeypatch):
    """A stage tried again under the id of a request that made its swap (its reply was lost) is
    answered with that outcome, and not staged or checked again: its update may be added and
    its stage gone by then, and a check of it against the sum could refuse a committed wave."""
    client = StoreClient(stores.start("s0").address)
    client.put("w", np.zeros(3, np.float32))
    cas = client.cas_json("led", {"n": 0}, expect=None)
    monkeypatch.setattr(store_client, "_RIDS", itertools.repeat(7))  # every request: one id
    ones = np.ones(3, np.float32)
    first = client.stage("s", ones, into="w", name="a", swap=Swap("led", {"n": 1}, cas.version, {}))
    assert first.swap.swapped
    client.delete("s")  # as an apply consumes it
    again = client.stage("s", ones, into="w", name="a", swap=Swap("led", {"n": 1}, cas.version, {}))
    assert again.swap[:2] == (True, first.swap.version) and again.update == first.update
    assert again.into.path == "w" and not client.list("s")
    assert client.get_json("led", versioned=True)[:2] == ({"n": 1}, first.swap.version)
    client.close()
