"""A lean parameter server: a blocking watch instead of polling, heartbeats outside the ledger, a
compacted log, and leaves cut by bytes over the stores; on real stores on 127.0.0.1."""

from __future__ import annotations

import json
import threading

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.wsp import pieces
from tenplex_jax._src.wsp.ledger import PATH
from tenplex_jax._src.wsp.pieces import cut
from tenplex_jax._src.wsp.records import BEATS, LOG_KEPT
from tenplex_jax.errors import StoreError, WSPError
from tenplex_jax.multihost.store import StoreClient
from tenplex_jax.wsp import ParameterServer
from tests.helpers import raw_socket, recv_frame
from tests.wsp.ps_clients import BIG, hold_apply, two_vws


def test_a_watch_answers_when_its_object_changes_and_only_then(stores):
    address = stores.start("s0").address
    with StoreClient(address) as client:
        client.put_json("n", {"count": 0})
        _, version, _ = client.get_json("n", versioned=True)
        # nothing changes: the same version, after the wait
        assert client.get_json("n", versioned=True, newer_than=version, wait=0.2)[:2] == (
            {"count": 0},
            version,
        )
        got, asking = [], threading.Event()

        def watch():
            asking.set()
            got.append(client.get_json("n", versioned=True, newer_than=version, wait=25.0))

        watcher = threading.Thread(target=watch)
        watcher.start()
        asking.wait(10)
        client.put_json("n", {"count": 1})
        watcher.join(timeout=10)  # woken by the write, not the 25 s wait
        assert not watcher.is_alive() and got[0][0] == {"count": 1} and got[0][1] > version
        with pytest.raises(StoreError, match="newer_than is a version"):
            client._call({"op": "get_json", "path": "n", "newer_than": "x", "wait": 1})
    for wait in (float("nan"), -1.0):  # NaN passed every comparison: an uncapped spin
        sock = raw_socket(address)  # the client itself never sends NaN
        try:
            request = {"op": "get_json", "path": "n", "newer_than": version, "wait": wait}
            wire.send_frame(sock, request)
            reply, _ = recv_frame(sock)
        finally:
            sock.close()
        assert not reply["ok"] and "newer_than is a version" in reply["error"], reply


def _tiny(stores, count: int = 1, **create) -> ParameterServer:
    addresses = [stores.start(f"s{i}").address for i in range(count)]
    ps = ParameterServer(addresses)
    ps.create({"w": np.zeros(4, np.float32)}, total=None, **create)
    return ps


def test_initial_weights_holding_nan_or_inf_are_refused_before_anything_is_written(stores):
    ps = ParameterServer([stores.start("s0").address])
    for bad in (np.nan, np.inf, 1e39):  # 1e39 is Inf once cast to float32
        with pytest.raises(WSPError, match=r"leaf 'b'.*NaN or Inf") as error:
            ps.create({"a": np.zeros(4), "b": np.array([0.0, bad])}, total=None)
        assert error.value.reason == "invalid"
    assert ps.coordinator.get_json(PATH, default=None) is None  # no job: create may run again
    ps.create({"a": np.zeros(4), "b": np.zeros(2)}, total=None)
    ps.close()


def test_heartbeats_write_no_ledger_and_a_long_run_keeps_it_bounded(stores):
    with _tiny(stores) as ps:
        ps.beat("vw", 0)
        ps.update(lambda led: (led.join("vw"), None))
        before = ps.coordinator.get_json(PATH, versioned=True)[1]
        for count in range(1, 4):
            ps.beat("vw", count)
        assert ps.coordinator.get_json(PATH, versioned=True)[1] == before  # untouched
        assert ps.beats() == {"vw": 3}
        sizes = []  # the ledger's bytes after each wave
        for wave in range(6 * LOG_KEPT):
            ps.update(lambda led, wave=wave: led.claim("vw", wave, 2))
            ps.push("vw", wave, {"w": np.ones(4, np.float32)})
            sizes.append(len(json.dumps(ps.ledger().to_json())))
        ledger = ps.ledger()
        assert len(ledger.log) <= 2 * LOG_KEPT and ledger.archive is not None
        # three times the waves, the same size (the log alone would have tripled)
        assert max(sizes[-2 * LOG_KEPT :]) <= 1.2 * max(sizes[2 * LOG_KEPT : 4 * LOG_KEPT])
        whole = ps.history()
        assert [wave for _, wave, _ in whole.log] == list(range(6 * LOG_KEPT))
        assert (
            whole.trained() == list(range(12 * LOG_KEPT)) and ledger.trained_count == 12 * LOG_KEPT
        )
        np.testing.assert_array_equal(ps.pull()["w"], np.full(4, 6 * LOG_KEPT, np.float32))
        assert ps.rollback().trained_count == 12 * LOG_KEPT - 2  # the kept last entry
        ps.update(lambda led: (led.leave("vw"), None))
        ps.forget("vw")
        assert ps.beats() == {} and not ps.coordinator.list_json(BEATS)


def test_a_waiting_client_wakes_on_the_commit_it_waits_for(stores):
    with _tiny(stores) as ps, ParameterServer(ps.addresses) as other:
        other.open()
        ps.update(lambda led: (led.join("a"), None))
        ps.update(lambda led: led.claim("a", 0, 1))
        seen, asking = [], threading.Event()

        def wait():
            other.ledger()
            asking.set()
            seen.append(other.wait(25.0))

        waiter = threading.Thread(target=wait)
        waiter.start()
        asking.wait(10)
        ps.push("a", 0, {"w": np.ones(4, np.float32)})
        waiter.join(timeout=10)
        assert not waiter.is_alive() and seen[0].clocks == {"a": 1}


def test_leaves_are_cut_by_bytes_over_the_stores_and_placed_where_asked(stores):
    rng = np.random.default_rng(0)
    weights = {
        "big": rng.standard_normal((64, 1024)).astype(np.float32),  # 256 KiB: 4 pieces
        "stage1": rng.standard_normal((3, 100)).astype(np.float32),
        "small": rng.standard_normal(7).astype(np.float32),
    }
    addresses = [stores.start(f"s{i}").address for i in range(3)]
    with ParameterServer(addresses) as ps:
        with pytest.raises(WSPError, match=r"'stage1'.*0\.\.2.*\[3\]") as bad:
            ps.create(weights, total=None, piece_bytes=64 << 10, stores={"stage1": [3]})
        assert bad.value.reason == "invalid" and not ps.coordinator.list_json()  # nothing written
        ps.create(weights, total=None, piece_bytes=64 << 10, stores={"stage1": [2]})
        # big and small end to end (65,543 elements): 5 pieces of 64 KiB at most, made 6, 2 a
        # store, equal; stage1 alone on store 2; small shares the last of big's pieces
        spans = [[(s.leaf, s.start, s.stop) for s in p.spans] for p in ps.layout]
        assert spans[:6] == [
            [("big", 0, 10923)],
            [("big", 10923, 21847)],
            [("big", 21847, 32771)],
            [("big", 32771, 43695)],
            [("big", 43695, 54619)],
            [("big", 54619, 65536), ("small", 0, 7)],
        ]
        assert spans[6:] == [[("stage1", 0, 300)]] and ps.layout[6].store == 2
        held = [
            sum(i.nbytes for i in StoreClient(a).list("wsp/w/")) for a in addresses
        ]  # about equal bytes
        assert max(held) - min(held) <= 64 << 10, held
        update = {p: rng.standard_normal(w.shape).astype(np.float32) for p, w in weights.items()}
        ps.update(lambda led: (led.join("vw"), None))
        ps.update(lambda led: led.claim("vw", 0, 1))
        with pytest.raises(WSPError, match=r"'small' has shape \(8,\).*\(7,\)"):
            ps.push("vw", 0, {**update, "small": np.zeros(8, np.float32)})
        ps.push("vw", 0, update)
        with ParameterServer(addresses) as reader:
            assert reader.open() == ps.layout
            pulled = reader.pull()
        for path, w in weights.items():
            assert pulled[path].shape == w.shape
            np.testing.assert_array_equal(pulled[path], w + update[path])


def test_cut_packs_small_leaves_into_equal_pieces_and_refuses_a_piece_below_one_element():
    small = {"a": (10,), "b": (30,), "c": (20,)}
    layout = cut(small, stores=2, piece_bytes=1 << 20, spread_bytes=4)
    assert [(p.key, p.store, p.size) for p in layout] == [("p0", 0, 30), ("p1", 1, 30)]
    # 240 bytes are not worth a second store's requests; 3 MiB take 3 stores of 4
    assert [(p.store, p.size) for p in cut(small, stores=2)] == [(0, 60)]
    spread = cut({"a": (3 << 18,)}, stores=4)
    assert [(p.store, p.size) for p in spread] == [(0, 1 << 18), (1, 1 << 18), (2, 1 << 18)]
    assert [[(s.leaf, s.start, s.stop) for s in p.spans] for p in layout] == [
        [("a", 0, 10), ("b", 0, 20)],  # the weights' order, end to end
        [("b", 20, 30), ("c", 0, 20)],
    ]
    few = cut({"a": (3,), "empty": (0, 4)}, stores=4, piece_bytes=4)
    assert [(p.store, p.size) for p in few] == [(0, 1), (1, 1), (2, 1)]  # no empty piece
    assert cut({"empty": (0,)}, stores=2) == ()
    for bad in ({"piece_bytes": 2}, {"spread_bytes": 0}):
        with pytest.raises(WSPError, match="piece_bytes and spread_bytes are at least"):
            cut({"a": (10,)}, stores=1, **bad)


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 300), min_size=1, max_size=8),
    stores=st.integers(1, 4),
    piece=st.integers(1, 64),
)
def test_cut_covers_every_leaf_once_in_equal_pieces_balanced_over_the_stores(sizes, stores, piece):
    shapes = {f"l{i}": (n,) for i, n in enumerate(sizes)}
    layout = cut(shapes, stores, piece_bytes=4 * piece)
    pieces.check_layout(layout, shapes, stores)  # every element in exactly one piece
    sizes = [p.size for p in layout]
    assert all(0 < n <= piece for n in sizes)
    assert not sizes or max(sizes) - min(sizes) <= 1  # equal pieces
    elements = sum(p.size for p in layout)
    # as many stores as the weights have pieces for (spread_bytes is larger than any piece here)
    spread = min(stores, -(-elements // piece))
    assert {p.store for p in layout} == set(range(spread))
    counts = [sum(p.store == i for p in layout) for i in range(spread)]
    assert not counts or max(counts) - min(counts) <= 1  # as many on each store
    assert not layout or len(layout) % spread == 0 or len(layout) == elements  # or an element each


def test_a_layout_of_another_format_or_that_misses_elements_is_refused_on_open(stores):
    with _tiny(stores, count=2, piece_bytes=8) as ps:
        good = ps.coordinator.get_json("wsp/layout")
        bad = {
            "format 1": {k: v for k, v in good.items() if k != "format"},
            "a gap": {**good, "pieces": [[0, [["w", 0, 1]]], [1, [["w", 2, 4]]]]},
            "no store 5": {**good, "pieces": [[5, [["w", 0, 4]]]]},
            "spans apart": {  # v's end first, then a piece of w and v's start: not one run
                "format": good["format"],
                "shapes": {"w": [4], "v": [4]},
                "pieces": [[0, [["v", 2, 4]]], [1, [["w", 0, 4], ["v", 0, 2]]]],
            },
        }
        for name, record in bad.items():
            ps.coordinator.put_json("wsp/layout", record)
            with ParameterServer(ps.addresses) as reader:
                with pytest.raises(
                    WSPError, match=r"format 1|covers? leaf 'w'|store 5|not consecutive"
                ) as no:
                    reader.open()
                assert no.value.reason == "corrupt" and reader.layout == (), name
        ps.coordinator.put_json("wsp/layout", good)
        with ParameterServer(ps.addresses) as reader:
            assert reader.open() == ps.layout


def test_a_read_into_an_array_that_does_not_fit_is_refused_at_once(stores):
    with StoreClient(stores.start("s0").address, retry_seconds=60) as client:
        client.put("x", np.arange(6, dtype=np.float32))
        out = np.empty(6, np.float32)
        assert client.get("x", out=out) is out and out[5] == 5
        with pytest.raises(StoreError, match=r"out is a float32 array of shape \(5,\)") as bad:
            client.get("x", out=np.empty(5, np.float32))
        assert bad.value.reason == "invalid"  # not retried for a minute
        with pytest.raises(StoreError, match="not C-contiguous"):
            client.get("x", out=np.empty(12, np.float32)[::2])


def test_a_pull_beside_the_vws_own_push_in_flight_holds_that_push_once(stores):
    with _tiny(stores, count=2, piece_bytes=8) as ps:  # two pieces, one per store
        ps.update(lambda led: (led.join("vw"), None))
        ps.update(lambda led: led.claim("vw", 0, 1))
        ps.push("vw", 0, {"w": np.full(4, 2.0, np.float32)})
        ps.update(lambda led: led.claim("vw", 1, 1))
        update = np.arange(4, dtype=np.float32)
        pending = ("vw", 1, {"w": update})
        # wave 1's push is in flight, in no store yet: the pull adds it to every piece
        np.testing.assert_array_equal(ps.pull(pending=pending)["w"], 2.0 + update)
        np.testing.assert_array_equal(ps.pull()["w"], np.full(4, 2.0, np.float32))
        ps.push("vw", 1, {"w": update})
        # in every store now: added by none
        np.testing.assert_array_equal(ps.pull(pending=pending)["w"], 2.0 + update)


def test_a_wait_answers_at_once_for_a_change_another_thread_of_the_client_made(stores):
    # a VW commits on its push thread while its main thread waits for the ledger to change:
    # the waiter has not seen that commit, so it must not wait for a change after it
    with _tiny(stores) as ps:
        ps.update(lambda led: (led.join("vw"), None))
        seen, claimed, answered = (threading.Event() for _ in range(3))
        got = []

        def waiter():
            ps.ledger()  # this thread's view: the join
            seen.set()
            claimed.wait(60)
            got.append(ps.wait(600.0))
            answered.set()

        threading.Thread(target=waiter, daemon=True).start()
        assert seen.wait(60)
        ps.update(lambda led: led.claim("vw", 0, 1))  # another thread of the same client
        claimed.set()
        # (a store answers a wait within 30 s at most: it would come, but late)
        assert answered.wait(15), "the waiter waited for a change after one it had not seen"
        assert got[0].leases["vw"].minibatches == (0,)


def test_a_push_checked_beside_a_committed_wave_never_leaves_the_ledger_ahead(stores):
    """a's wave is committed and not yet added when b's push of the same update is checked:
    b's is refused (the two could overflow), a's is added, and a pull ends."""
    first, second = two_vws(stores)
    held, pushed = hold_apply(first), []
    committed, release = held.started, held.release
    pushing = threading.Thread(target=lambda: pushed.append(first.push("a", 0, BIG)))
    pushing.start()
    try:
        assert committed.wait(60)
        with pytest.raises(WSPError, match="could overflow") as error:
            second.push("b", 0, BIG)
        assert error.value.reason == "invalid"
    finally:
        release.set()
        pushing.join(60)
    ledger = second.ledger()
    assert pushed and ledger.pushed("a", 0) and not ledger.pushed("b", 0)
    assert second.pull(timeout=30)["w"][0] == np.float32(2e38)
    assert not second.coordinator.list("wsp/stage/b/")  # b's stage is gone with its refusal
    first.close()
    second.close()


def test_concurrent_pushes_whose_sum_overflows_commit_one_and_every_pull_ends(stores):
    first, second = two_vws(stores)
    outcomes, start = {}, threading.Barrier(2)

    def push(ps, vw):
        start.wait(30)
        try:
            ps.push(vw, 0, BIG)
            outcomes[vw] = "committed"
        except WSPError as error:
            outcomes[vw] = error.reason

    threads = [threading.Thread(target=push, args=a) for a in ((first, "a"), (second, "b"))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(60)
    assert sorted(outcomes.values()) == ["committed", "invalid"], outcomes
    assert first.pull(timeout=30)["w"][0] == np.float32(2e38)
    first.close()
    second.close()
