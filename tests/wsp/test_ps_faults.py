"""The parameter server under faults, on real store processes on 127.0.0.1.

A proxy in front of each store (``tests/wsp/store_proxy.py``) drops a reply (the store did the
request), delays one past the client's timeout, or delivers one twice; and stores are SIGKILLed
mid-run and restarted on the same directory and port. The contract: every request carries an id
(``rid``) that its replies echo and its retries repeat, the store answers a repeated id with the
original outcome, a client retries a broken request within ``retry_seconds``, and an
acknowledged push survives a SIGKILL. So every run finishes, trains every minibatch exactly once,
loses no acknowledged wave and ends with the weights of a run without faults, bit for bit.

The parameter server is driven by a plain-NumPy virtual worker (``drive``: what
``VirtualWorker.run`` does, with an update that is a function of the pulled weights and the
minibatch ids), so one run is deterministic and the weights a ledger's log implies can be
computed (``replay``); one test runs a real ``VirtualWorker`` on the tiny GPT.
"""

from __future__ import annotations

import dataclasses
import random
import re
import statistics
import threading
import time

import jax
import numpy as np
import pytest

from tenplex_jax._src.multihost.store import wire
from tenplex_jax._src.wsp import pieces
from tenplex_jax.multihost.store import StoreClient, parse_address
from tenplex_jax.wsp import ParameterServer, VirtualWorker, WorkerOptions, weights_of
from tenplex_jax_models import build_state
from tenplex_jax_models import wsp as job_parts
from tests.helpers import Stores, raw_socket, recv_frame
from tests.wsp.store_proxy import KINDS, FaultProxy

VW = "vw1"
NM = 2  # minibatches a wave
TOTAL = 8  # minibatches of a fault-injection run: 4 waves
LEAVES = {"embed": (12, 16), "dense/kernel": (16, 16), "dense/bias": (16,), "head": (160,)}
TIMEOUT = 1.0  # the clients' socket timeout in the fault-injection runs
LONG = 1.5 * TIMEOUT  # a delay the client gives up on: it retries while the reply is held
SHORT = 0.2
MUTATING = {"put", "put_json", "cas_json", "accumulate", "delete"}
RETRY = 20.0  # seconds a client retries a broken request
REAP = 3600.0  # no member is silent this long in these runs: nobody is reaped
PULL = 5.0  # seconds a pull waits for the weights to hold the ledger's commits
PIECE = 256  # bytes: the larger leaves are cut into pieces over both stores
RID = re.compile(r"[0-9a-f]{32}")


# -- a deterministic virtual worker on NumPy ------------------------------------------------------


def initial_weights() -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    return {p: rng.standard_normal(s).astype(np.float32) for p, s in LEAVES.items()}


def update(weights: dict[str, np.ndarray], minibatches) -> dict[str, np.ndarray]:
    """A wave's update: a function of the weights it started from and of its minibatches, so a
    wave lost, applied twice or trained on other weights changes the result."""
    phase = np.float32(sum(0.37 * (m + 1) for m in minibatches))
    out = {}
    for path, w in weights.items():
        ramp = np.arange(w.size, dtype=np.float32).reshape(w.shape)
        out[path] = (np.float32(-0.05) * w + np.float32(0.01) * np.sin(ramp + phase)).astype(
            np.float32
        )
    return out


def replay(initial: dict[str, np.ndarray], log) -> dict[str, np.ndarray]:
    """The weights a ledger's log implies for one VW pulling before every wave: each wave's
    update from the weights of the waves before it, added in float32 as the store adds it."""
    weights = {p: w.copy() for p, w in initial.items()}
    for _, _, minibatches in log:
        for path, u in update(weights, minibatches).items():
            weights[path] = weights[path] + u
    return weights


@dataclasses.dataclass(frozen=True)
class Run:
    """A driven run: the ledger after the VW left, the weights pulled after its last push, and
    the waves whose push returned (acknowledged)."""

    ledger: object
    weights: dict[str, np.ndarray]
    acked: tuple[int, ...]


def drive(
    ps: ParameterServer, total: int, *, piece_bytes: int = PIECE, on_wave=None, on_push=None
) -> Run:
    """Create a job of ``total`` minibatches and train it with one VW, as ``VirtualWorker.run``
    and ``_wave`` do: join, pull, then claim ``NM`` minibatches, update, push, pull until the
    ledger is done; leave. ``on_wave(wave)`` before each claim, ``on_push(wave)`` after each
    push returned. Pieces of ``piece_bytes`` (the default: over both stores; ``PIECE_BYTES``:
    all on the ledger's store, each push staging, checking and committing in one request)."""
    ps.create(initial_weights(), total=total, piece_bytes=piece_bytes)
    ps.open()
    ledger, _ = ps.update(lambda led: (led.join(VW), None))
    wave = ledger.clocks[VW]
    weights = ps.pull(ledger, timeout=PULL)
    acked = []
    for _ in range(total + 1):  # each wave claims at least one minibatch
        if on_wave is not None:
            on_wave(wave)
        led, minibatches = ps.update(lambda led, wave=wave: led.claim(VW, wave, NM))
        if not minibatches:
            assert led.done, f"nothing to claim, yet the run is not done: {led}"
            break
        ledger = ps.push(VW, wave, update(weights, minibatches))
        acked.append(wave)
        if on_push is not None:
            on_push(wave)
        weights = ps.pull(ledger, timeout=PULL)
        wave += 1
    else:
        raise AssertionError(f"the run did not finish in {total + 1} waves")
    ledger, _ = ps.update(lambda led: (led.leave(VW), None))
    return Run(ps.history(ledger), weights, tuple(acked))


def assert_exactly_once(run: Run, total: int) -> None:
    assert run.ledger.done, run.ledger
    assert sorted(run.ledger.trained()) == list(range(total))  # each minibatch once
    assert list(run.acked) == [wave for _, wave, _ in run.ledger.log]  # every ack logged, once


def assert_bitwise_equal(got: dict, want: dict, what: str) -> None:
    assert set(got) == set(want), what
    for path in want:
        assert got[path].dtype == want[path].dtype, (what, path)
        assert np.array_equal(got[path], want[path]), f"{what}: {path} differs"


def _wipe(addresses) -> None:
    """Delete every object of a finished run, straight from the stores (not through a proxy)."""
    for address in addresses:
        with StoreClient(address) as client:
            client.delete("")


def _server(addresses) -> ParameterServer:
    return ParameterServer(addresses, timeout=TIMEOUT, retry_seconds=RETRY)


@pytest.fixture(scope="module")
def store_addresses(tmp_path_factory):
    started = Stores(tmp_path_factory.mktemp("ps_faults"))
    try:
        yield [started.start(f"s{i}").address for i in range(2)]
    finally:
        started.reap()


# -- the proxy itself ----------------------------------------------------------------------------


def _ask(sock, header: dict) -> None:
    wire.send_frame(sock, header)


def test_the_proxy_relays_every_exchange_and_drops_delays_or_duplicates_the_nth_reply(tmp_path):
    """Raw wire requests through the proxy: what each fault does to the bytes a client gets."""
    started = Stores(tmp_path)
    try:
        # a budget of 64 MiB: a larger object is put and got streamed, a trailer after its body
        address = started.start("s0", memory_bytes=1 << 20).address
        big = np.arange(17 << 20, dtype=np.float32)
        with FaultProxy(address) as proxy:
            with StoreClient(proxy.address) as client:
                client.put("x", np.arange(1000, dtype=np.float32))  # continue, body, trailer
                client.put("big", big)  # streamed to the store's disk
                client.put_json("j", {"a": 1})
                np.testing.assert_array_equal(client.get("x"), np.arange(1000))
            assert proxy.ops == {"put": 2, "put_json": 1, "get": 1}
            assert not proxy.injected
            sock = raw_socket(proxy.address)
            get = {"op": "get", "path": "x", "box": None}
            proxy.inject("get", "duplicate", nth=2)
            _ask(sock, {**get, "rid": "1" * 32})
            header, body = recv_frame(sock)
            assert header["ok"] and body == np.arange(1000, dtype=np.float32).tobytes()
            _ask(sock, {**get, "rid": "2" * 32})
            first, again = recv_frame(sock), recv_frame(sock)  # the same reply, twice
            assert first == again and first[1] == body
            assert {**first[0], "rid": None} == {**header, "rid": None}
            _ask(sock, {"op": "list_json", "prefix": "", "rid": "3" * 32})
            assert recv_frame(sock)[0]["paths"] == ["j"]  # the next reply is the next request's
            # a streamed get: header, body and checksum trailer, all twice
            proxy.inject("get", "duplicate")
            _ask(sock, {"op": "get", "path": "big", "box": None, "rid": "4" * 32})
            for _ in range(2):
                header, body = recv_frame(sock)
                assert header["ok"] and header["checksum"] is None and body == big.tobytes()
                trailer, _ = recv_frame(sock)
                assert trailer["ok"] and trailer["checksum"].startswith("crc32:")
            proxy.inject("list_json", "delay", seconds=0.5)
            tic = time.monotonic()
            _ask(sock, {"op": "list_json", "prefix": "", "rid": "5" * 32})
            assert recv_frame(sock)[0]["paths"] == ["j"] and time.monotonic() - tic >= 0.45
            proxy.inject("delete", "drop")
            _ask(sock, {"op": "delete", "prefix": "x", "rid": "6" * 32})
            assert sock.recv(1) == b""  # closed, no reply
            sock.close()
            with StoreClient(address) as client:  # ... yet the store did it
                assert [i.path for i in client.list()] == ["big"]
            fired = [(f.op, f.kind, f.nth, f.rid) for f in proxy.injected]
            assert fired == [
                ("get", "duplicate", 2, "2" * 32),
                ("get", "duplicate", 1, "4" * 32),
                ("list_json", "delay", 1, "5" * 32),
                ("delete", "drop", 1, "6" * 32),
            ]
            assert not proxy.armed()
            assert proxy.ops == {"put": 2, "put_json": 1, "get": 4, "list_json": 2, "delete": 1}
    finally:
        started.reap()


# -- one store client: the request id ------------------------------------------------------------


def test_a_retried_request_gets_its_first_outcome_and_a_stale_reply_is_never_taken(store_addresses):
    """A lost or late reply of a mutating request is retried with the same rid and answered with
    the first outcome (an accumulate of the same update reports ``applied``, a swap
    ``swapped``: not "skipped" or "conflict" by the retry itself); a duplicated reply never
    answers the next request."""
    _wipe(store_addresses)
    with FaultProxy(store_addresses[0]) as proxy:
        with StoreClient(proxy.address, timeout=TIMEOUT, retry_seconds=RETRY) as client:
            client.put("w", np.zeros(8, np.float32))
            update = client.put("stage", np.ones(8, np.float32)).checksum
            for kind, seconds, clock in (("drop", 0.0, 0), ("delay", LONG, 1)):
                proxy.inject("accumulate", kind, seconds=seconds)
                info, applied = client.accumulate(
                    "w", "stage", name="a", clock=clock, update=update
                )
                assert applied and dict(info.clocks) == {"a": clock + 1}, kind
            np.testing.assert_array_equal(client.get("w"), np.full(8, 2, np.float32))
            proxy.inject("cas_json", "drop")
            assert client.cas_json("n", {"count": 0}, expect=None).swapped
            _, version, _ = client.get_json("n", versioned=True)
            proxy.inject("cas_json", "delay", seconds=LONG)
            cas = client.cas_json("n", {"count": 1}, expect=version)
            assert cas.swapped and cas.value == {"count": 1}
            client.put_json("other", {"other": True})
            proxy.inject("get_json", "duplicate")
            assert client.get_json("n") == {"count": 1}
            assert client.get_json("other") == {"other": True}  # not the stale copy of "n"
            assert client.get("w").shape == (8,)
        assert [(f.op, f.kind) for f in proxy.injected] == [
            ("accumulate", "drop"),
            ("accumulate", "delay"),
            ("cas_json", "drop"),
            ("cas_json", "delay"),
            ("get_json", "duplicate"),
        ]
        rids = [rid for _, rid in proxy.requests]
        assert all(isinstance(r, str) and RID.fullmatch(r) for r in rids), rids
        for fault in proxy.injected[:4]:  # a lost or late reply: retried with the same rid
            assert rids.count(fault.rid) >= 2, fault
        assert not proxy.unechoed


# -- a. every op's reply dropped, delayed or duplicated --------------------------------------------


def _clean_run(store_addresses, piece_bytes: int) -> tuple[Run, list]:
    _wipe(store_addresses)
    with FaultProxy(store_addresses[0]) as p0, FaultProxy(store_addresses[1]) as p1:
        with _server([p0.address, p1.address]) as ps:
            run = drive(ps, TOTAL, piece_bytes=piece_bytes)
        proxies = [p0, p1]
    return run, proxies


@pytest.mark.parametrize(
    "piece_bytes", [PIECE, pieces.PIECE_BYTES], ids=["two-stores", "one-store"]
)
def test_the_parameter_server_survives_each_reply_dropped_delayed_or_duplicated(
    store_addresses, piece_bytes
):
    """A clean run through the proxies records the ops the parameter server uses on each store;
    then one run per store x op x fault, the fault on the middle request of that op (a delay of
    a mutating op outlasts the client's timeout). Every run must match the clean one. With the
    weights on both stores, and on the ledger's store alone (each push's last put commits)."""
    clean, proxies = _clean_run(store_addresses, piece_bytes)
    assert_exactly_once(clean, TOTAL)
    assert_bitwise_equal(clean.weights, replay(initial_weights(), clean.ledger.log), "clean")
    ops = [dict(p.ops) for p in proxies]
    # the ops a push, a pull and the ledger need; more are covered as the server starts using them
    # (a pull reads each piece through shared memory: get_shared, then the segment)
    assert {"cas_json", "get_json", "put", "get_shared", "accumulate"} <= set(ops[0]), ops
    spread = piece_bytes == PIECE
    assert spread == ({"put", "get_shared", "accumulate"} <= set(ops[1])), ops
    for proxy in proxies:
        assert all(RID.fullmatch(str(rid)) for _, rid in proxy.requests), proxy.requests[:3]
        assert not proxy.unechoed, proxy.unechoed[:5]  # every reply frame echoes its rid
    failures = []
    for store in (0, 1):
        for op in sorted(ops[store]):
            for kind in KINDS:
                nth = (ops[store][op] + 1) // 2  # the middle one: a run half done
                seconds = (LONG if op in MUTATING - {"put_json"} else SHORT) * (kind == "delay")
                where = f"{kind} of reply {nth} of {ops[store][op]} {op!r} on store {store}"
                try:
                    _faulty_run(
                        store_addresses, (store, op, kind, nth, seconds), clean, piece_bytes
                    )
                except Exception as error:  # every case runs; all failures are reported
                    failures.append(f"{where}: {type(error).__name__}: {error}"[:400])
    assert not failures, f"{len(failures)} cases failed:\n" + "\n".join(failures)


def _faulty_run(store_addresses, fault: tuple, clean: Run, piece_bytes: int):
    store, op, kind, nth, seconds = fault
    _wipe(store_addresses)
    with FaultProxy(store_addresses[0]) as p0, FaultProxy(store_addresses[1]) as p1:
        proxy = (p0, p1)[store]
        proxy.inject(op, kind, nth=nth, seconds=seconds)
        with _server([p0.address, p1.address]) as ps:
            run = drive(ps, TOTAL, piece_bytes=piece_bytes)
        assert [(f.op, f.kind) for f in proxy.injected] == [(op, kind)], proxy.injected
        fault = proxy.injected[0]
        if kind == "drop" or seconds > TIMEOUT:  # the reply never came in time: retried
            assert [rid for _, rid in proxy.requests].count(fault.rid) >= 2, "not retried"
    assert_exactly_once(run, TOTAL)
    assert_bitwise_equal(run.weights, clean.weights, "the weights")


# -- b. a real virtual worker through mixed faults -------------------------------------------------


def test_a_virtual_worker_finishes_exactly_once_through_mixed_faults(store_addresses):
    total, lr = 6, 0.05
    parts = job_parts.job(1, optimizer="sgd", lr=lr)
    _, state, _ = build_state("tiny", lr, optimizer="sgd")  # what parts["init"] builds
    initial = weights_of(state)
    devices = jax.devices()[:1]
    steps = job_parts.step_cache(parts, devices, donate=True)  # both runs: one compile

    def run(faults):
        _wipe(store_addresses)
        with FaultProxy(store_addresses[0]) as p0, FaultProxy(store_addresses[1]) as p1:
            proxies = (p0, p1)
            for store, op, kind, nth, seconds in faults:
                proxies[store].inject(op, kind, nth=nth, seconds=seconds)
            with ParameterServer(
                [p0.address, p1.address], timeout=2 * TIMEOUT, retry_seconds=RETRY
            ) as ps:
                ps.create(initial, total=total)
                worker = VirtualWorker(
                    VW,
                    ps,
                    parts["rules"],
                    parts["dataset"],
                    state,
                    parts["train_step"],
                    devices=devices,
                    config=parts["config"],
                    # no heartbeat in so short a run
                    options=WorkerOptions(minibatches=NM, timeout=REAP, steps=steps),
                )
                records = worker.run()
                ledger = ps.ledger()
                weights = ps.pull(ledger, timeout=PULL)
            fired = [(f.op, f.kind) for p in proxies for f in p.injected]
        return records, ledger, weights, fired

    try:
        records, ledger, clean, fired = run([])
        assert not fired and len(records) == total // NM
        faults = [
            (0, "cas_json", "drop", 3, 0.0),  # the first claim's swap: done, its reply lost
            (0, "accumulate", "duplicate", 2, 0.0),  # the tiny GPT: on the ledger's store
            # past the client's timeout: retried. The first: a piece's first pull asks for its
            # segment, and later pulls read it with no request while it holds the ledger's waves
            (0, "get_shared", "delay", 1, 3 * TIMEOUT),
        ]
        records, ledger, weights, fired = run(faults)
    finally:
        steps.close()
    assert sorted(fired) == sorted((op, kind) for _, op, kind, _, _ in faults)
    assert ledger.done and sorted(ledger.trained()) == list(range(total))
    assert sorted(m for r in records for m in r.minibatches) == list(range(total))
    assert_bitwise_equal(weights, clean, "the weights after faults")
    assert max(np.abs(clean[p] - initial[p]).max() for p in clean) > 1e-4  # training moved them


# -- c. stores SIGKILLed and restarted mid-run ---------------------------------------------------


KILLS = 12
KILL_TOTAL = 240  # 120 waves: the kills need about 30, so every kill lands mid-run


@pytest.mark.parametrize(
    "piece_bytes", [PIECE, pieces.PIECE_BYTES], ids=["two-stores", "one-store"]
)
def test_no_acknowledged_wave_is_lost_when_stores_are_sigkilled_and_restarted(
    tmp_path, piece_bytes
):
    started = Stores(tmp_path)
    procs = [started.start(f"s{i}") for i in range(2)]
    ports = [parse_address(p.address)[1] for p in procs]
    rng = random.Random(1234)
    stop, pushed, waving = threading.Event(), threading.Event(), threading.Event()
    began: dict[int, float] = {}
    durations: dict[int, float] = {}  # each wave's, from its claim to its push returned
    kills: list[tuple[int, int]] = []  # (store, the wave under way)
    errors: list[BaseException] = []
    current = [0]

    def on_wave(wave):
        current[0] = wave
        began[wave] = time.monotonic()
        waving.set()

    def on_push(wave):
        durations[wave] = time.monotonic() - began[wave]
        pushed.set()

    def next_time(event) -> bool:
        """Wait for ``event`` to be set after now; False when the test stops (``halt`` sets
        ``stop`` before the events, so a stop is seen either here or by the wait)."""
        event.clear()
        return not stop.is_set() and event.wait(60) and not stop.is_set()

    def kill_loop():
        try:
            for i in range(KILLS):
                # once the VW pushed since the last restart, at a random point of its next wave
                if not (next_time(pushed) and next_time(waving)):
                    return
                # the median of the waves no kill slowed (a kill's wave and the next): early in
                # the run those few slow waves were most of them, and the killer waited past the
                # run's end
                slowed = {wave + d for _, wave in kills for d in (0, 1)}
                steady = [t for wave, t in list(durations.items()) if wave not in slowed]
                typical = statistics.median(steady or list(durations.values()))
                if stop.wait(rng.uniform(0.0, 1.5) * typical):
                    return
                # the ledger's store, then the other; only the ledger's when it holds every piece
                victim = i % 2 if piece_bytes == PIECE else 0
                procs[victim].kill()
                kills.append((victim, current[0]))
                procs[victim] = started.start(f"s{victim}", port=ports[victim])
        except BaseException as error:  # reported by the test
            errors.append(error)

    def halt():  # wakes the killer wherever it waits
        stop.set()
        pushed.set()
        waving.set()
        killer.join(timeout=60)

    killer = threading.Thread(target=kill_loop, name="store-killer", daemon=True)
    try:
        with ParameterServer([p.address for p in procs], timeout=5.0, retry_seconds=30.0) as ps:
            killer.start()
            run = drive(ps, KILL_TOTAL, piece_bytes=piece_bytes, on_wave=on_wave, on_push=on_push)
            halt()
            assert not killer.is_alive() and not errors, errors
            assert len(kills) == KILLS, f"the run ended after {len(kills)} kills: {kills}"
            assert {store for store, _ in kills} == ({0, 1} if piece_bytes == PIECE else {0})
            assert_exactly_once(run, KILL_TOTAL)
            ledger = run.ledger
            logged = {(vw, wave) for vw, wave, _ in ledger.log}
            assert {(VW, wave) for wave in run.acked} <= logged  # no acknowledged wave lost
            assert ps.open() and ps.layout
            expected = replay(initial_weights(), ledger.log)
            assert_bitwise_equal(run.weights, expected, "the weights pulled last")
            stored, places = pieces.pull_buffer(ps.layout, ps.shapes)
            for piece in ps.layout:
                with StoreClient(procs[piece.store].address) as client:
                    out = places[piece.index]
                    _, info = client.get("wsp/w/" + piece.key, with_info=True, out=out)
                # the weights hold every acknowledged wave, each once
                assert dict(info.clocks) == {VW: ledger.committed[VW]}, (piece, info.clocks)
                assert ledger.committed[VW] == len(run.acked) == max(run.acked) + 1
            assert_bitwise_equal(stored, expected, "the weights the log implies")
    finally:
        if killer.is_alive():
            halt()
        started.reap()
