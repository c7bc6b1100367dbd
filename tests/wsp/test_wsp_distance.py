"""WSP's clock distance ``D`` checked numerically across virtual workers: two or three VWs of the
tiny GPT (plain SGD), ``D`` 1 and 2, ``Nm`` 1 and 2, driven through a fixed interleaving of wave
starts and commits (``wsp_gates.py``: real VWs on threads, a real parameter server on a real
store process), against WSP by its definition on the same interleaving (``wsp_reference.py``).
Minibatch by minibatch: which minibatches each wave claimed, which weights each minibatch read
(each VW's waves its last pull held, and its own updates), its local and global staleness, each
wave's push and the global weights after each commit (within 1e-6 of each leaf's scale), and
the final weights. Each interleaving makes a fast VW reach ``D`` waves ahead of the slowest,
so WSP must hold it until the slowest commits: a runtime that let it go (``D`` not enforced, or
off by one either way) fails here."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType

import tenplex_jax as tj
from tenplex_jax._src.errors import WSPError
from tenplex_jax.wsp import ParameterServer, WorkerOptions, weights_of
from tenplex_jax_models import build_state, example_losses
from tenplex_jax_models import wsp as job_parts
from tests.wsp.wsp_gates import Gates, versions
from tests.wsp.wsp_reference import interleaving, reference

LR = 0.1  # large enough that a wrong read moves the weights far past the tolerance
TOLERANCE = 1e-6  # of each leaf's scale

# "a" starts its next wave; "a^" commits a's oldest pushed wave. "a" is the fast VW: it runs
# ahead until it is D waves past the slowest's commits, and waits ("|" marks where; no step).
INTERLEAVINGS = {
    # a's wave 2 waits for b's first commit; its wave 3 for b's second
    (2, 1): "a b a a^ a | b^ a^ b a^ a | b^ b a^ b^",
    # a's wave 3 waits for b's wave 0; its wave 4 for b's wave 1; b's wave 3 pulls at once
    (2, 2): "a b a a^ a a^ a | b^ b a^ a^ a | b^ b a^ b^ b b^",
    # a waits for the slowest, c: b's commit does not let it go, c's does
    (3, 1): "a b c a a^ a | b^ c^ b a^ b^ a^ a | c c^ b c a^ b^ c^",
    (3, 2): "a b c a a^ a a^ a | c^ b^ b c a^ a^ a | b^ c^ b c a^ b^ c^",
}
NAMES = ("a", "b", "c")


@pytest.fixture(scope="module")
def job():
    """The tiny GPT with plain SGD as one-device VWs' parts, a step cache they share, and the
    reference's step: the optimizer on the bitwise gradient the VW's step takes, in plain JAX."""
    parts = job_parts.job(1, lr=LR, optimizer="sgd")
    graphdef, state, _ = build_state("tiny", LR, optimizer="sgd")  # what parts["init"] is
    dataset = parts["dataset"]
    steps = job_parts.step_cache(parts, jax.devices()[:1])
    mgraph, params, rest = nnx.split(nnx.merge(graphdef, state)["model"], nnx.Param, ...)
    mesh = jax.make_mesh((1, 1), ("data", "fsdp"), (AxisType.Auto,) * 2, devices=jax.devices()[:1])
    layout = tj.data.BatchLayout(dataset.global_batch, ranks=1)
    value_and_grad = tj.data.batch_value_and_grad(example_losses, layout, mesh)
    tx = optax.sgd(LR)

    @jax.jit
    def sgd(p, data, weights):
        grads = value_and_grad(nnx.merge(mgraph, p, rest), data, weights)[1]
        updates, _ = tx.update(grads, tx.init(p), p)
        return optax.apply_updates(p, updates)

    def step(p, q):
        data, weights, _ = tj.data.device_batch(dataset, q, layout, mesh)
        return sgd(p, data, weights)

    return parts, state, steps, params, step


def _close(got: dict, want: dict, scale: dict, what) -> None:
    assert set(got) == set(want), what
    for path in want:
        diff = np.abs(got[path] - want[path]).max() / np.abs(scale[path]).max()
        assert diff <= TOLERANCE, (what, path, diff)


@pytest.mark.parametrize("nm", [1, 2])
@pytest.mark.parametrize("count,distance", sorted(INTERLEAVINGS))
def test_vws_train_what_wsp_by_its_definition_does_on_a_fixed_interleaving(
    stores, job, count, distance, nm
):
    parts, state, steps, params, step = job
    names = NAMES[:count]
    want = reference(
        interleaving(INTERLEAVINGS[count, distance].replace("|", "")),
        names,
        params,
        step,
        minibatches=nm,
        distance=distance,
        host=lambda p: weights_of({"model": p}),
    )
    assert any(seen.waits for seen in want.steps)  # the interleaving reaches the distance
    address = stores.start().address
    gates = Gates()
    with ParameterServer([address]) as ps:
        ps.create(weights_of(state), total=want.total)
        workers = {
            name: gates.watch(
                job_parts.virtual_worker(
                    parts,
                    name,
                    [0],
                    [address],
                    state,
                    steps=steps,
                    minibatches=nm,
                    distance=distance,
                    timeout=60.0,  # no VW falls silent while the interleaving holds it
                    optimizer_every=0,
                    **gates.options(),
                )
            )
            for name in names
        }
        with gates.running(list(workers.values())):
            for i, seen in enumerate(want.steps):
                vw, where = seen.step.vw, f"step {i} ({seen.step})"
                if seen.step.commit:
                    pushed = gates.commit(vw, seen.wave)
                    _close(pushed.detail, want.waves[vw, seen.wave].change, seen.weights, where)
                    _close(ps.pull(), seen.weights, seen.weights, where)
                else:
                    got = gates.start(vw, seen.wave).kind
                    assert got == ("waiting" if seen.waits else "claimed"), where
                after = (vw, seen.wave) if seen.step.commit else None  # what lets it go
                for name, wave, minibatches in seen.starts:
                    claim = gates.claimed(name, wave, after)
                    assert claim.detail == minibatches, (where, name, wave)
        got = ps.pull()
        history = ps.history()
    _close(got, want.weights, want.weights, "the final weights")
    moved = max(np.abs(got[p] - weights_of(state)[p]).max() for p in got)
    assert moved > 1e-3, moved  # training moved them
    assert sorted(history.trained()) == list(range(want.total))
    for name, worker in workers.items():
        records = sorted(worker.records, key=lambda r: r.wave)
        waves = [w for (vw, _), w in sorted(want.waves.items()) if vw == name]
        assert [r.wave for r in records] == [w.wave for w in waves], name
        for record, wave in zip(records, waves):
            where = (name, wave.wave)
            assert record.minibatches == wave.minibatches, where
            assert (record.pulled, record.slowest) == (wave.pulled, wave.slowest), where
            assert record.local_versions == tuple(v.own for v in wave.versions), where
            assert record.local_staleness == wave.local_staleness, where
            assert record.global_staleness == wave.global_staleness, where
            assert max(wave.global_staleness) <= distance, where
        read = versions(records, gates.pulls(name), names)
        assert read == [v for w in waves for v in w.versions], name
        # on_ready before each wave, and once more before finding the run done
        ready = [e.wave for e in gates.events if e.kind == "ready" and e.vw == name]
        assert ready == list(range(len(waves) + 1)), name


def test_a_vw_s_on_ready_hook_must_be_callable():
    with pytest.raises(WSPError, match=r"WorkerOptions.on_ready is a callable or None, got 3"):
        WorkerOptions(on_ready=3)


@pytest.mark.parametrize(
    "text,rule",
    [
        ("a a a", r"step 2 \(a\): a starts wave 2 only once its wave 0 has committed"),
        ("a^", r"step 0 \(a\^\): a has no pushed wave to commit"),
        ("a b a a^ a a", r"step 5 \(a\): a waits to start wave 2; it cannot start another"),
        ("a b c a b a^ b^ a b c^", r"the commit lets \['a', 'b'\] start at once"),
        ("a b a^", r"the interleaving ends with VW b: waves \[0\] uncommitted"),
        ("a x", r"step 1 \(x\): no VW 'x' among \['a', 'b'\]"),
    ],
)
def test_the_reference_refuses_an_interleaving_the_runtime_cannot_take(text, rule):
    names = ("a", "b", "c") if "c" in text else ("a", "b")
    weights = {"w": np.float32(1.0)}
    with pytest.raises(ValueError, match=rule):
        reference(
            interleaving(text),
            names,
            weights,
            lambda w, q: {"w": w["w"] - 0.1 * (w["w"] - q)},
            minibatches=1,
            distance=1,
            host=lambda w: {k: np.asarray(v) for k, v in w.items()},
        )
