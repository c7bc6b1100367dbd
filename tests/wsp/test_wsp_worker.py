"""A virtual worker's own schedule and state: HetPipe's local staleness (``Nm`` minibatches in
flight, minibatch ``p`` reading the weights with the VW's own updates up to ``p - Nm``) against a
plain sequential reference of the same schedule (no parameter server, no pipeline, optax by hand);
and a joining VW keeping the optimizer: it takes the freshest state a VW shared through the
parameter server's stores, whole and never half written, instead of fresh moments. (The bounds
of several asynchronous VWs' staleness are checked on the demo's run, in ``test_wsp.py``.)"""

from __future__ import annotations

import re
import threading

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import tenplex_jax as tj
from tenplex_jax._src import tree
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax._src.errors import StoreError, WSPError
from tenplex_jax._src.wsp import optimizer
from tenplex_jax.elastic import ResourceTrace
from tenplex_jax.wsp import Coordinator, ParameterServer, Threads, WorkerOptions, weights_of
from tenplex_jax_models import build_state, example_losses, wave_step
from tenplex_jax_models import wsp as job_parts

LR, MINIBATCHES = 3e-3, 12


@pytest.fixture(scope="module")
def job():
    """The tiny GPT as one-device VWs' parts, a step cache they share, and the reference's
    gradient: the bitwise gradient the VW's step takes, in plain JAX (each compiled once)."""
    # SGD with momentum: an optimizer state that each update changes, and no division by a
    # running norm (AdamW's turns the rounding of a gradient that cancels to about 0 into a step
    # of lr: 2.4e-5 of the weights' scale after 12 minibatches even with Nm = 1)
    parts = job_parts.job(1, lr=LR, optimizer="momentum")
    graphdef, state, _ = build_state("tiny", LR, optimizer="momentum")  # what parts["init"] is
    dataset = parts["dataset"]
    sample = jax.tree.map(np.asarray, dataset.load(np.zeros(1, np.int64)))
    steps = StepCache(parts["train_step"], sample, jax.devices()[:1], donate=False)
    mgraph, params, rest = nnx.split(nnx.merge(graphdef, state)["model"], nnx.Param, ...)
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), (AxisType.Auto,) * 2, devices=jax.devices()[:1])
    layout = tj.data.BatchLayout(dataset.global_batch, ranks=1)
    value_and_grad = tj.data.batch_value_and_grad(example_losses, layout, mesh)
    grad = jax.jit(lambda p, data, w: value_and_grad(nnx.merge(mgraph, p, rest), data, w)[1])

    def gradient(p, q):
        data, weights, _ = tj.data.device_batch(dataset, q, layout, mesh)
        return grad(p, data, weights)

    return parts, state, steps, params, gradient


TX = optax.sgd(LR, momentum=0.9)  # what build_state's "momentum" is


@jax.jit
def _update(grads, opt, read, weights):
    """The optimizer's update for a gradient at ``read``, applied to ``weights``."""
    updates, opt = TX.update(grads, opt, read)
    return optax.apply_updates(weights, updates), opt


@jax.jit
def _push(glob, end, start):
    return jax.tree.map(lambda g, e, s: g + (e - s), glob, end, start)


def _reference(params, gradient, nm: int, distance: int) -> dict[str, np.ndarray]:
    """One VW's schedule by its definition: minibatch ``p``'s gradient at the weights holding
    updates ``0 .. p - nm``, its update applied to the weights as they are when it lands; a wave's
    change pushed into the global weights when its last update lands; before wave ``k``'s last
    minibatch reads, the global weights pulled when the last pull is older than ``k - D``."""
    opt = TX.init(params)
    w = glob = params
    start, fresh, reads = w, 0, {}

    def land(q):
        nonlocal w, opt, glob, start
        read = reads.pop(q)
        w, opt = _update(gradient(read, q), opt, read, w)
        if (q + 1) % nm == 0:  # the wave's last update: push its change
            glob = _push(glob, w, start)

    for p in range(MINIBATCHES):
        wave, j = divmod(p, nm)
        if p >= nm:
            land(p - nm)
        if j == nm - 1:  # WSP before the wave's last read
            if fresh < wave - distance:
                w, fresh = glob, wave
            start = w
        reads[p] = w
    for q in range(MINIBATCHES - nm, MINIBATCHES):
        land(q)
    return weights_of({"model": glob})


def _vw(name, address, job, **kwargs):
    parts, state, steps = job[:3]
    kwargs.setdefault("steps", steps)
    return job_parts.virtual_worker(parts, name, [0], [address], state, **kwargs)


@pytest.mark.parametrize(
    "field,value,rule",
    [
        ("minibatches", 0, "an int >= 1"),
        ("minibatches", True, "an int >= 1"),
        ("distance", -1, "an int >= 0"),
        ("slowdown", 0.5, "a number >= 1"),
        ("timeout", 0, "seconds > 0"),
        ("part", "", "a non-empty str"),
        ("stages", (3, 1), "a tj.pipelining.Stages or None"),
        ("on_record", "print", "a callable or None"),
    ],
)
def test_worker_options_name_the_field_the_rule_and_the_value_they_refuse(field, value, rule):
    with pytest.raises(WSPError, match=re.escape(f"WorkerOptions.{field} is {rule}, got")) as no:
        WorkerOptions(**{field: value})
    assert no.value.reason == "invalid" and repr(value) in str(no.value)
    assert WorkerOptions(minibatches=np.int64(4), slowdown=np.float32(2.0)).minibatches == 4


@pytest.mark.parametrize("distance,donate", [(0, False), (1, True)])
def test_a_vw_with_nm_in_flight_trains_what_the_sequential_reference_does(
    stores, job, distance, donate
):
    parts, state, steps, params, gradient = job
    if donate:  # a step that deletes its input: the reads still needed go in as copies
        sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
        steps = StepCache(parts["train_step"], sample, jax.devices()[:1])
    for nm in (1, 2, 4):
        address = stores.start(f"nm{nm}").address
        with ParameterServer([address]) as ps:
            ps.create(weights_of(state), total=MINIBATCHES)
            worker = _vw("vw", address, job, minibatches=nm, distance=distance, steps=steps)
            records = worker.run()
            got = ps.pull()
        want = _reference(params, gradient, nm, distance)
        # the schedule: minibatch p read the VW's updates 0 .. p - nm, missing nm - 1 of them
        # once the pipeline is full; one VW is never behind itself
        order = [m for r in records for m in r.minibatches]
        assert order == list(range(MINIBATCHES))
        versions = [v for r in records for v in r.local_versions]
        assert versions == [max(p - nm + 1, 0) for p in range(MINIBATCHES)]
        assert [s for r in records for s in r.local_staleness] == [
            min(p, nm - 1) for p in range(MINIBATCHES)
        ]
        assert all(g <= distance for r in records for g in r.global_staleness)
        assert [r.pulled for r in records] == [
            k > 0 and (distance == 0 or k % 2 == 0) for k in range(MINIBATCHES // nm)
        ]
        for path in want:
            diff = np.abs(got[path] - want[path]).max() / np.abs(want[path]).max()
            assert diff <= 1e-6, (nm, distance, path, diff)
        moved = max(np.abs(got[p] - weights_of(state)[p]).max() for p in got)
        assert moved > 1e-3, moved  # training moved them


WAVE_STEP = []


@pytest.mark.parametrize("distance", [0, 1])
def test_a_pipelined_wave_trains_what_the_sequential_reference_does(stores, job, distance):
    # HetPipe's pipeline: a VW of two stages runs each wave as one program, its Nm minibatches
    # in flight (each on the weights it read), and lands the same updates as the reference
    parts, state, _, params, gradient = job
    parts = dict(parts, config=tj.ParallelConfig(pipe=2))
    if not WAVE_STEP:  # one for both distances: their VWs share its compiled programs
        WAVE_STEP.append(wave_step(build_state("tiny", LR, optimizer="momentum", abstract=True)[0]))
    sample = jax.tree.map(np.asarray, parts["dataset"].load(np.zeros(1, np.int64)))
    steps = StepCache(parts["train_step"], sample, jax.devices()[:2], donate=False)
    for nm in (1, 2, 4):  # each wave's program compiled once: the VWs share it
        address = stores.start(f"wave{nm}").address
        with ParameterServer([address]) as ps:
            ps.create(weights_of(state), total=MINIBATCHES)
            worker = job_parts.virtual_worker(
                parts,
                "vw",
                [0, 1],
                [address],
                state,
                minibatches=nm,
                distance=distance,
                steps=steps,
                wave_step=WAVE_STEP[0],
            )
            records = worker.run()
            got = ps.pull()
        want = _reference(params, gradient, nm, distance)
        assert [m for r in records for m in r.minibatches] == list(range(MINIBATCHES))
        versions = [v for r in records for v in r.local_versions]
        assert versions == [max(p - nm + 1, 0) for p in range(MINIBATCHES)]
        assert [r.idle_ticks for r in records] == [1] * (MINIBATCHES // nm)  # per wave, not nm
        assert all(np.isfinite(x) for r in records for x in r.losses)
        for path in want:
            diff = np.abs(got[path] - want[path]).max() / np.abs(want[path]).max()
            assert diff <= 1e-6, (nm, distance, path, diff)


def _optimizer(vw) -> dict[str, np.ndarray]:
    paths, leaves, _ = tree.arrays(vw.state)
    return {p: np.asarray(x) for p, x in zip(paths, leaves) if p.startswith("optimizer/")}


def test_a_joiner_takes_the_freshest_shared_optimizer_state(stores, job):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        first = _vw("a", address, job, minibatches=2, optimizer_every=2)
        first.run(waves=3)  # shares at its clock 2, and at 3 when it leaves
        assert first.optimizer_from is None  # nothing was shared when it joined
        shared = _optimizer(first)
        assert int(shared["optimizer/step"]) == 6  # the optimizer's count: 3 waves of 2
        joiner = _vw("b", address, job)
        fresh = _optimizer(joiner)
        joiner.run(waves=0)  # joins, takes the state, leaves
        assert joiner.optimizer_from == ("a", 3)
        took = _optimizer(joiner)
        assert set(took) == set(shared)
        for path in shared:  # bitwise the state "a" left with, not init()'s
            np.testing.assert_array_equal(took[path], shared[path], err_msg=path)
        assert any(not np.array_equal(fresh[p], shared[p]) for p in shared)
        # a share whose leaf is gone (a store that lost it, a delete under the reader) is never
        # taken; the next freshest is
        optimizer.share(ps, "c", 9, {p: np.zeros_like(x) for p, x in shared.items()})
        assert optimizer.freshest(ps)[:2] == ("c", 9)
        ps.clients[0].delete("wsp/optimizer/c/9/optimizer/step")
        assert optimizer.freshest(ps)[:2] == ("a", 3)
        # the older share of a VW is deleted once the new one is named
        assert not ps.clients[0].list("wsp/optimizer/a/2/")


def test_a_vw_leaving_shares_its_last_clock_even_when_a_slow_share_skipped_the_others(
    stores, job, monkeypatch
):
    # the share of clock 1 is held on its thread until the VW leaves, so those of clocks 2 and 3
    # are skipped (a share still being written); the VW leaving at clock 3 still shares clock 3
    address = stores.start().address
    leaving, written, share = threading.Event(), [], optimizer.share

    def held(ps, vw, wave, leaves):
        if not written:
            assert leaving.wait(60)
        share(ps, vw, wave, leaves)
        written.append(wave)

    monkeypatch.setattr(optimizer, "share", held)
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        vw = _vw("a", address, job, minibatches=1, optimizer_every=1)
        sharing = vw._share_optimizer

        def spy(wait=False):
            if wait:
                leaving.set()
            sharing(wait)

        vw._share_optimizer = spy
        vw.run(waves=3)
        assert written == [1, 3]
        assert optimizer.freshest(ps)[:2] == ("a", 3)


def test_a_shared_state_that_does_not_fit_is_a_clear_error(stores, job):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        paths = tree.arrays(job[1])[0]
        bad = {p: np.zeros((3,), np.float32) for p in paths if p.startswith("optimizer/")}
        optimizer.share(ps, "odd", 1, bad)
        joiner = _vw("b", address, job)
        with pytest.raises(WSPError, match=r"does not fit 'b': optimizer/\S+ is \(3,\)"):
            joiner.run()


def test_vws_of_different_stages_train_one_job_through_unpadded_weights(stores):
    # the tiny GPT with 4 layers: "a" pipelines them as stages (3, 1) over 2 devices (stacked
    # leaves padded to 3 + 3 rows), "b" runs them unpipelined, "c" as stages (1, 3); each joiner
    # takes the optimizer state the one before shared, through the unpadded leaves
    layers, wide = 4, "optimizer/opt_state/0/mu/w1"
    state = job_parts.job(1, layers=layers)["init"]()
    address = stores.start().address

    def vw(name, devices, stages, **options):
        parts = job_parts.job(len(devices), layers=layers, stages=stages)
        if stages is not None:
            parts["config"] = tj.ParallelConfig(pipe=2)
        return job_parts.virtual_worker(
            parts,
            name,
            devices,
            [address],
            state,
            minibatches=2,
            optimizer_every=1,
            stages=stages,
            **options,
        )

    flat = job_parts.job(1, layers=layers)  # "b" and "b2" share its compiled step
    sample = jax.tree.map(np.asarray, flat["dataset"].load(np.zeros(1, np.int64)))
    steps = StepCache(flat["train_step"], sample, jax.devices()[2:3], donate=False)

    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=12)
        a = vw("a", [0, 1], tj.pipelining.Stages((3, 1)))
        padded = _optimizer(a)[wide]
        assert a.ptc.leaf("model/w1").shape[0] == 6 and padded.shape[0] == 6
        assert a.host_weights()["model/w1"].shape[0] == layers
        a.run(waves=2)
        rows = a.options.stages.mask
        a_moments = _optimizer(a)[wide]
        assert not a_moments[~rows].any() and a_moments[rows].any()  # padding rows stay zero
        b = vw("b", [2], None, steps=steps)
        b.run(waves=0)  # joins, takes the state, leaves
        assert b.optimizer_from == ("a", 2)
        np.testing.assert_array_equal(_optimizer(b)[wide], a_moments[rows])  # unpadded
        vw("b2", [2], None, steps=steps).run(waves=3)
        c = vw("c", [4, 5], tj.pipelining.Stages((1, 3)))
        records = c.run()
        assert c.optimizer_from == ("b2", 3)
        assert records and c.ptc.leaf("model/w1").shape[0] == 6
        assert not _optimizer(c)[wide][~c.options.stages.mask].any()
        ledger = ps.history()
        assert sorted(ledger.trained()) == list(range(12))
        got = ps.pull()
    assert {p: x.shape for p, x in got.items()} == {
        p: x.shape for p, x in weights_of(state).items()
    }
    assert all(np.isfinite(x).all() for x in got.values())
    assert max(np.abs(got[p] - weights_of(state)[p]).max() for p in got) > 1e-3
    with pytest.raises(WSPError, match=r"cannot be padded for stages \(1, 3\): it needs 4 rows"):
        c.set_weights({p: np.zeros((5,) + x.shape[1:], x.dtype) for p, x in got.items()})


def _pushes(worker, before_push):
    """Wrap ``worker``'s pushes: ``before_push(wave)`` runs on the push thread first."""
    push = worker.ps.push

    def wrapped(vw, wave, updates, **kwargs):
        before_push(wave)
        return push(vw, wave, updates, **kwargs)

    worker.ps.push = wrapped


def test_a_push_runs_beside_the_next_wave_which_is_leased_ahead(stores, job):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        claimed = {}
        next_claimed = threading.Event()

        def on_wave(name, wave, minibatches):
            claimed[wave] = minibatches
            if wave == 1:
                next_claimed.set()

        worker = _vw("a", address, job, minibatches=2, distance=1, on_wave=on_wave)
        seen = {}

        def hold(wave):
            if wave == 0:  # wave 0's push waits until wave 1 is claimed: the VW went on
                assert next_claimed.wait(120), "wave 1 was not claimed while wave 0 pushed"
                seen["ledger"] = ps.ledger()
                seen["records"] = len(worker.records)

        _pushes(worker, hold)
        records = worker.run(waves=3)
        ahead = seen["ledger"].ahead["a"]
        assert (ahead.wave, ahead.minibatches) == (1, claimed[1]) == (1, (2, 3))
        assert seen["records"] == 0  # a wave's record comes with its commit
        assert [r.minibatches for r in records] == [(0, 1), (2, 3), (4, 5)]
        history = ps.history()
        assert [(vw, w) for vw, w, _ in history.log] == [("a", 0), ("a", 1), ("a", 2)]
        assert not history.leases and not history.ahead
        assert worker.push_waits >= 0 and records[1].push_wait_seconds >= 0


def test_a_vw_that_dies_with_a_push_in_flight_records_exactly_what_committed(stores, job):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        worker = _vw("a", address, job, minibatches=1, distance=1)

        def die(wave):
            if wave == 1:  # dies while pushing: the commit may still land, as it does here
                worker.crashed.set()

        _pushes(worker, die)
        records = worker.run()  # returns at once, its push finished
        ledger = ps.ledger()
        committed = [(vw, w, m) for vw, w, m in ledger.log]
        assert [(r.vw, r.wave, r.minibatches) for r in records] == committed
        assert [w for _, w, _ in committed] == [0, 1]
        assert "a" in ledger.clocks  # silent, not gone: the others drop it after the timeout


@pytest.mark.parametrize("distance", [0, 1])
def test_a_push_that_fails_on_its_thread_ends_the_vw_with_its_error(stores, job, distance):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=None)
        worker = _vw("a", address, job, minibatches=1, distance=distance)

        def fail(wave):
            if wave == 1:
                raise StoreError("injected: the store went away", "unavailable")

        _pushes(worker, fail)
        # D = 0: the VW waits for its own commit before wave 2, which never comes: it must see
        # the failure instead of waiting for ever; D = 1: the next push settles it
        with pytest.raises(StoreError, match="injected"):
            worker.run(waves=4)
        assert [w for _, w, _ in ps.ledger().log] == [0]


def test_the_coordinator_returns_when_every_vw_has_failed(stores, job):
    address = stores.start().address
    with ParameterServer([address]) as ps:
        ps.create(weights_of(job[1]), total=40)

        def make(name, devices):
            worker = _vw(name, address, job, minibatches=1, distance=1)

            def fail(wave):
                if wave == 1:
                    raise StoreError("injected: the store went away", "unavailable")

            _pushes(worker, fail)
            return worker

        with Coordinator(ps, Threads(make)) as coordinator:
            coordinator.add([0])
            # the VW fails after one wave; follow sees that no VW runs (it would wait its
            # timeout for commits that never come)
            coordinator.follow(ResourceTrace("none", 1, 40, ()), group=1, timeout=120)
            assert ps.ledger().trained_count == 1
            [(name, error)] = coordinator.runner.errors
            assert name == "vw1" and "injected" in str(error)
