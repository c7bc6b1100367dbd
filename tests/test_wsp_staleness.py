"""HetPipe's local staleness inside a virtual worker: ``Nm`` minibatches in flight, minibatch ``p``
reading the weights with the VW's own updates up to ``p - Nm``, checked against a plain sequential
reference of the same schedule (no parameter server, no pipeline, optax by hand), and the
staleness bounds of a run of several asynchronous VWs."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import tenplex_jax as tj
from tenplex_jax._src.elastic.steps import StepCache
from tenplex_jax.wsp import Coordinator, ParameterServer, Threads, VirtualWorker, weights_of
from tenplex_jax_models import build_state, example_losses
from tenplex_jax_models import wsp as job_parts
from tests.helpers import Stores

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
    steps = StepCache(parts["train_step"], sample, jax.devices()[:1])
    mgraph, params, rest = nnx.split(nnx.merge(graphdef, state)["model"], nnx.Param, ...)
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), (AxisType.Auto,) * 2, devices=jax.devices()[:1])
    layout = tj.data.BatchLayout(dataset.global_batch, ranks=1)
    value_and_grad = tj.data.batch_value_and_grad(example_losses, layout, mesh)
    grad = jax.jit(lambda p, data, w: value_and_grad(nnx.merge(mgraph, p, rest), data, w)[1])

    def gradient(p, q):
        data, weights, _ = tj.data.device_batch(dataset, q, layout, mesh)
        return grad(p, data, weights)

    return parts, state, steps, params, gradient


def _reference(params, gradient, nm: int, distance: int) -> dict[str, np.ndarray]:
    """One VW's schedule by its definition: minibatch ``p``'s gradient at the weights holding
    updates ``0 .. p - nm``, its update applied to the weights as they are when it lands; a wave's
    change pushed into the global weights when its last update lands; before wave ``k``'s last
    minibatch reads, the global weights pulled when the last pull is older than ``k - D``."""
    tx = optax.sgd(LR, momentum=0.9)  # what build_state's "momentum" is
    opt = tx.init(params)
    w = glob = params
    start, fresh, reads = w, 0, {}

    def land(q):
        nonlocal w, opt, glob, start
        read = reads.pop(q)
        updates, opt = tx.update(gradient(read, q), opt, read)
        w = optax.apply_updates(w, updates)
        if (q + 1) % nm == 0:  # the wave's last update: push its change
            glob = jax.tree.map(lambda g, e, s: g + (e - s), glob, w, start)

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


@pytest.mark.parametrize("distance", [0, 1])
def test_a_vw_with_nm_in_flight_trains_what_the_sequential_reference_does(tmp_path, job, distance):
    parts, state, steps, params, gradient = job
    dataset = parts["dataset"]
    stores = Stores(tmp_path)
    try:
        for nm in (1, 2, 4):
            address = stores.start(f"nm{nm}").address
            with ParameterServer([address]) as ps:
                ps.create(weights_of(state), total=MINIBATCHES)
                worker = VirtualWorker(
                    "vw",
                    ParameterServer([address]),
                    parts["rules"],
                    dataset,
                    state,
                    parts["train_step"],
                    devices=jax.devices()[:1],
                    config=parts["config"],
                    minibatches=nm,
                    distance=distance,
                    steps=steps,
                )
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
    finally:
        stores.reap()


@pytest.mark.slow
def test_asynchronous_vws_keep_local_staleness_below_nm_and_global_below_d(tmp_path, job):
    parts, state, steps, _, _ = job
    stores = Stores(tmp_path)
    try:
        addresses = [stores.start(f"s{i}").address for i in range(2)]
        nms = {(0,): 4, (1,): 2, (2,): 1}
        with ParameterServer(addresses) as ps:
            ps.create(weights_of(state), total=28)

            def make(name, devices):
                return VirtualWorker(
                    name,
                    ParameterServer(addresses),
                    parts["rules"],
                    parts["dataset"],
                    state,
                    parts["train_step"],
                    devices=[jax.devices()[d] for d in devices],
                    config=parts["config"],
                    minibatches=nms[tuple(devices)],
                    distance=1,
                    slowdown=2.0 if devices == (2,) else 1.0,
                    steps=steps if devices == (0,) else None,
                )

            with Coordinator(ps, Threads(make)) as coordinator:
                coordinator.add([0], [1], [2])
                coordinator.wait(timeout=300)
            assert not coordinator.runner.errors
            assert sorted(ps.ledger().trained()) == list(range(28))  # each minibatch once
    finally:
        stores.reap()
    by_vw: dict[str, list] = {}
    for r in coordinator.records():
        by_vw.setdefault(r["vw"], []).append(r)
    for name, records in by_vw.items():
        nm = max(len(r["minibatches"]) for r in records)
        staleness = [s for r in records for s in r["local_staleness"]]
        versions = [v for r in records for v in r["local_versions"]]
        assert versions == sorted(versions), name  # a VW's reads never go back
        assert max(staleness) == nm - 1 and staleness[: nm - 1] == list(range(nm - 1)), name
        assert all(0 <= g <= 1 for r in records for g in r["global_staleness"]), name
        # the updates land in the order the minibatches read: version + staleness counts them
        assert [v + s for v, s in zip(versions, staleness)] == list(range(len(versions))), name
