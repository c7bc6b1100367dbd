"""HetPipe's pipeline run from its tick table (``tenplex_jax._src.wsp.hetpipe``): the GPT (its
embedding on the first stage, its blocks over two, its head and loss on the last) trains what the
sequential reference does, on the unbroken table and on the wave program's alike, a blocked
minibatch and a pull between calls included."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding
from jax.sharding import PartitionSpec as P

from tenplex_jax._src.errors import WSPError
from tenplex_jax._src.wsp import hetpipe
from tenplex_jax._src.wsp.pipeline import schedule
from tenplex_jax_models.gpt import GPT, GPTConfig, block_fn, stacked

STAGES, NM, MB = 2, 2, 4
WAITS = (0, 2, 0)  # wave 1's last minibatch waits for a pull
BLOCKED = NM + NM - 1


def _gpt(cfg: GPTConfig) -> hetpipe.StageModel:
    """The GPT as the stages run it: the embedding on the first, the head and loss on the last."""

    def first(outer, tokens):
        return jnp.take(outer["tok_embed"], tokens, axis=0) + outer["pos_embed"][: tokens.shape[-1]]

    def loss(outer, h, targets):
        norm = h * jax.lax.rsqrt(jnp.mean(jnp.square(h), -1, keepdims=True) + 1e-6)
        logits = (norm * outer["final_norm_scale"]) @ outer["unembed"]
        return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()

    return hetpipe.StageModel(first, block_fn(cfg), loss)


@pytest.fixture(scope="module")
def job():
    cfg = GPTConfig.tiny()
    with nnx.use_eager_sharding(False):
        gpt = GPT(cfg, rngs=nnx.Rngs(0))
    weights = nnx.to_pure_dict(nnx.state(gpt, nnx.Param))
    layers = {k: jnp.asarray(weights[k]) for k in stacked(cfg)}
    outer = {k: jnp.asarray(v) for k, v in weights.items() if k not in layers}
    rng = np.random.default_rng(0)
    n = NM * len(WAITS)
    tokens = jnp.asarray(rng.integers(0, cfg.vocab, size=(n, MB, cfg.seq_len)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=-1)
    # another VW's waves, in the weights a pull brings
    other = jax.tree.map(
        lambda v: jnp.asarray(rng.normal(size=v.shape) * 1e-2, v.dtype), (layers, outer)
    )
    optimizer = optax.sgd(0.05, momentum=0.9)
    return _gpt(cfg), optimizer, (layers, outer), tokens, targets, other


def _reference(model, optimizer, weights, xs, targets, other=None):
    """Minibatch p's gradient at the weights holding the updates up to p - Nm, landed in order;
    with ``other``, a pull adds it once the wave before the blocked minibatch's has landed (the
    blocked minibatch and every later one read it; the wave in flight lands on it)."""

    def loss(w, x, target):
        (layers, outer), step = w, lambda h, p: (model.layer(h, p), None)
        return model.loss(outer, jax.lax.scan(step, model.first(outer, x), layers)[0], target)

    grad = jax.jit(jax.value_and_grad(loss))
    state, versions, losses = optimizer.init(weights), [weights] * NM, []
    for p in range(xs.shape[0]):
        read = versions[p % NM]
        value, g = grad(read, xs[p], targets[p])
        updates, state = optimizer.update(g, state, read)
        weights = versions[p % NM] = optax.apply_updates(weights, updates)
        if p == BLOCKED - NM and other is not None:  # the wave before the blocked one landed
            weights = versions[p % NM] = jax.tree.map(jnp.add, weights, other)
        losses.append(float(value))
    return weights, losses


def _mesh():
    devices = jax.devices()[:STAGES]
    return jax.make_mesh((STAGES,), ("pipe",), devices=devices, axis_types=(AxisType.Explicit,))


def _place(weights, mesh):
    """The layers' rows over the stages, the outer weights whole on each."""
    layers, outer = weights
    on = lambda spec: NamedSharding(mesh, spec)
    return jax.device_put(layers, on(P("pipe"))), jax.device_put(outer, on(P()))


def _assert_close(got, want, what):
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want)):
        diff = np.abs(np.asarray(g) - np.asarray(w)).max()
        assert diff <= 1e-6 * np.abs(np.asarray(w)).max(), (what, jax.tree_util.keystr(path))


def _assert_equal(got, want):
    for g, w in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))


def test_the_unbroken_pipeline_trains_what_the_sequential_reference_does(job):
    model, optimizer, weights, xs, targets, _ = job
    mesh = _mesh()
    want, want_losses = _reference(*job[:-1])
    got = {}
    for unbroken in (False, True):
        table = schedule(STAGES, NM, WAITS, unbroken=unbroken)
        placed = _place(weights, mesh)
        start = hetpipe.start(table, model, placed, optimizer.init(placed), xs, mesh=mesh)
        end, losses = hetpipe.run(table, model, optimizer, start, xs, targets, mesh=mesh)
        got[unbroken] = end.weights
        np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-6)
        _assert_close(end.weights, want, unbroken)
    # fewer ticks, the same slots: the same bits
    ticks = [schedule(STAGES, NM, WAITS, unbroken=u).ticks for u in (True, False)]
    assert ticks[0] < ticks[1]
    _assert_equal(got[True], got[False])


def test_what_is_in_flight_carries_across_calls_and_a_pull_lands_on_it(job):
    # the VW's calls: up to the blocked minibatch's pull point (wave 0's last landing), the
    # in-flight minibatch while the pull is awaited, then on; the pull rebases what is in flight
    model, optimizer, weights, xs, targets, other = job
    mesh = _mesh()
    table = schedule(STAGES, NM, WAITS, unbroken=True)
    pull, enter = table.landed(BLOCKED - NM) + 1, table.entered(BLOCKED)
    assert table.landed(BLOCKED - 1) < enter  # the minibatch in flight lands while it waits
    placed = _place(weights, mesh)
    inflight = hetpipe.start(table, model, placed, optimizer.init(placed), xs, mesh=mesh)
    run = lambda inflight, first, end: hetpipe.run(
        table, model, optimizer, inflight, xs, targets, mesh=mesh, ticks=(first, end)
    )[0]
    drained = run(run(inflight, 0, pull), pull, enter)
    whole, _ = hetpipe.run(table, model, optimizer, inflight, xs, targets, mesh=mesh)
    _assert_equal(run(drained, enter, table.ticks).weights, whole.weights)  # 3 calls, 1 call
    slots = hetpipe.slots_after(table, pull, enter)
    assert slots == [True, True]  # the blocked minibatch's version, and the one landed since
    pulled = hetpipe.rebased(drained, _place(other, mesh), jnp.asarray(slots))
    end, losses = hetpipe.run(
        table, model, optimizer, pulled, xs, targets, mesh=mesh, ticks=(enter, table.ticks)
    )
    want, want_losses = _reference(*job)
    np.testing.assert_allclose(np.asarray(losses), want_losses, rtol=1e-6)
    _assert_close(end.weights, want, "pulled")
    _, unpulled_losses = _reference(*job[:-1])
    assert not np.allclose(want_losses[BLOCKED:], unpulled_losses[BLOCKED:], rtol=1e-6)


def test_a_table_of_other_stages_minibatches_or_ticks_is_refused(job):
    model, optimizer, weights, xs, targets, _ = job
    mesh = _mesh()
    state = optimizer.init(weights)
    three = schedule(3, NM, WAITS, unbroken=True)
    with pytest.raises(WSPError, match=r"3 stages and 6 minibatches .* got 2 stages, 6 inputs"):
        hetpipe.start(three, model, weights, state, xs, mesh=mesh)
    short = schedule(STAGES, NM, WAITS[:2], unbroken=True)
    with pytest.raises(WSPError, match=r"2 stages and 4 minibatches .* 2 stages, 6 inputs"):
        hetpipe.start(short, model, weights, state, xs, mesh=mesh)
    table = schedule(STAGES, NM, WAITS, unbroken=True)
    one = (jax.tree.map(lambda w: w[:1], weights[0]), weights[1])
    with pytest.raises(WSPError, match=r"evenly over the 2 stages.*\['wq'\]\": 1"):
        hetpipe.start(table, model, one, state, xs, mesh=mesh)
    inflight = hetpipe.start(table, model, weights, state, xs, mesh=mesh)
    with pytest.raises(WSPError, match=rf"<= {table.ticks} \(the table's\), got \[3, 2\)"):
        hetpipe.run(table, model, optimizer, inflight, xs, targets, mesh=mesh, ticks=(3, 2))


def test_a_window_is_refused_off_a_wave_or_short_of_the_minibatches_its_slots_run():
    table = schedule(STAGES, NM, WAITS, unbroken=True)
    whole = hetpipe.window(table, 0, table.ticks, base=0, n=len(table.forward))
    assert whole.ticks == table.ticks and whole.stages == STAGES
    assert sum(whole.idle_ticks()) == sum(map(sum, table.idle_ticks()))
    with pytest.raises(WSPError, match=r"a multiple of Nm = 2 .* got base 1") as no:
        hetpipe.window(table, 0, 4, base=1, n=4)
    assert no.value.reason == "invalid"
    with pytest.raises(WSPError, match=r"got base 0, 1 minibatches, slots running \[0, 1\]"):
        hetpipe.window(table, 0, 3, base=0, n=1)
