"""Pipeline parallelism: a GPipe schedule over ``pipe`` computes what the unpipelined model does."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax_models import GPTConfig, batch_at, loss_fn, stdlib_corpus
from tests.helpers import RULES, train_state

C = tj.ParallelConfig
CFG = dataclasses.replace(GPTConfig.tiny(), n_layers=4)
BATCH = 8


def _batch():
    return batch_at(stdlib_corpus(2**20), 3, BATCH, CFG.seq_len, seed=1)


@pytest.fixture(scope="module")
def reference():
    """Loss and grads of the unpipelined model on one device."""
    model, _ = train_state(CFG)
    loss, grads = nnx.jit(nnx.value_and_grad(loss_fn))(model, _batch())
    return float(loss), {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}


def _pipelined(config: C, microbatches: int, stages: tj.pipelining.Stages | None = None):
    model, _ = train_state(CFG)
    graphdef, state = nnx.split(model)
    if stages is not None:  # the uneven layout: stacked weights padded per stage
        state = jax.tree.map(
            lambda v: stages.pad(v) if v.shape and v.shape[0] == CFG.n_layers else v, state
        )
    ptc = tj.PTC.of(state, RULES, config, jax.devices()[: config.num_devices])
    state = tj.place(state, ptc)
    mesh = ptc.mesh()
    batch = jax.device_put(_batch(), NamedSharding(mesh, P(("data", "fsdp"))))

    @jax.jit
    def value_and_grad(state, batch):
        model = nnx.merge(graphdef, state)
        loss = functools.partial(loss_fn, mesh=mesh, microbatches=microbatches, stages=stages)
        return nnx.value_and_grad(loss)(model, batch)

    loss, grads = value_and_grad(state, batch)
    text = value_and_grad.lower(state, batch).as_text()
    flat = {k: np.asarray(v) for k, v in nnx.to_flat_state(grads)}
    if stages is not None:
        padded = {k for k, v in flat.items() if v.shape and v.shape[0] == len(stages.index)}
        for k in padded:  # padding rows get no gradient
            np.testing.assert_array_equal(flat[k][~stages.mask], 0, err_msg=k)
        flat = {k: np.asarray(stages.unpad(v)) if k in padded else v for k, v in flat.items()}
    return float(loss), flat, text, ptc


@pytest.mark.parametrize(
    "config, microbatches",
    [
        (C(pipe=2, data=2, tensor=2), 2),
        (C(pipe=4, fsdp=2), 4),
    ],
    ids=str,
)
def test_pipelined_loss_and_grads_equal_the_unpipelined_model(reference, config, microbatches):
    want_loss, want_grads = reference
    loss, grads, text, ptc = _pipelined(config, microbatches)
    # the stages really are on different devices and talk by collective permutes
    assert "collective_permute" in text
    assert ptc.leaf("wq").spec[0] == "pipe"
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    assert grads.keys() == want_grads.keys()
    for name, want in want_grads.items():
        np.testing.assert_allclose(grads[name], want, rtol=2e-4, atol=2e-6, err_msg=name)


@pytest.mark.parametrize(
    "config, stages",
    [(C(pipe=2, data=2, tensor=2), (1, 3)), (C(pipe=3, data=2), (2, 1, 1))],
    ids=str,
)
def test_uneven_stages_equal_the_unpipelined_model(reference, config, stages):
    want_loss, want_grads = reference
    stages = tj.pipelining.Stages(stages)
    loss, grads, _, ptc = _pipelined(config, 2, stages)
    assert ptc.leaf("wq").shape[0] == config.pipe * stages.slots  # stored padded
    np.testing.assert_allclose(loss, want_loss, rtol=1e-5)
    for name, want in want_grads.items():
        np.testing.assert_allclose(grads[name], want, rtol=2e-4, atol=2e-6, err_msg=name)


def _train(schedule: dict[int, tuple], steps: int):
    """Train ``steps`` steps, moving to (config, devices, microbatches[, stages]) at the schedule's
    steps; returns the losses and the plans of the moves."""
    model, optimizer = train_state(CFG, lr=3e-3)
    graphdef, state = nnx.split((model, optimizer))
    corpus = stdlib_corpus(2**20)
    ptc = tj.PTC.of(state, RULES, C(), jax.devices()[:1])
    state, stages = tj.place(state, ptc), None
    losses, plans = [], []
    for i in range(steps):
        if i in schedule:
            config, devices, microbatches, *new_stages = schedule[i]
            new_stages = new_stages[0] if new_stages else None
            if new_stages != stages:  # uneven stages: re-pad the layers dim first
                state, ptc = tj.pipelining.restage(state, ptc, RULES, stages, new_stages)
                stages = new_stages
            new = ptc.relayout(config, [jax.devices()[d] for d in devices])
            # the core plan, nothing pipeline-specific: the layers dim changes its spec
            plans.append(tj.make_plan(ptc, new))
            state, _ = tj.reshard(state, plans[-1])
            ptc, step = new, _step(graphdef, new, microbatches, stages)
        state, loss = step(state, batch_at(corpus, i, BATCH, CFG.seq_len, seed=7))
        losses.append(float(loss))
    return losses, plans


STEPS_BY_LAYOUT: dict = {}  # a layout's jitted step, shared by the runs that use it


def _step(graphdef, ptc, microbatches, stages=None):
    """One function object per layout (every run's graphdef is the same), so a run on a layout
    another run compiled takes its executable from JAX's in-memory cache."""
    key = (ptc.config, ptc.device_ids, microbatches, stages)
    if key not in STEPS_BY_LAYOUT:
        STEPS_BY_LAYOUT[key] = _jitted_step(graphdef, ptc, microbatches, stages)
    return STEPS_BY_LAYOUT[key]


def _jitted_step(graphdef, ptc, microbatches, stages):
    mesh = ptc.mesh()

    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss = functools.partial(loss_fn, mesh=mesh, microbatches=microbatches, stages=stages)
        loss, grads = nnx.value_and_grad(loss)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    batch = NamedSharding(mesh, P(("data", "fsdp")))
    return jax.jit(
        step,
        in_shardings=(ptc.shardings(mesh), batch),
        out_shardings=(ptc.shardings(mesh), NamedSharding(mesh, P())),
        donate_argnums=0,
    )


@functools.cache
def _fixed(steps: int) -> list[float]:
    """The losses of a run on one fixed, unpipelined layout."""
    return _train({0: (C(data=2), range(2), 1)}, steps)[0]


def test_pipe_degree_resizes_2_4_1_mid_training_through_the_core_plan():
    steps = 5
    fixed = _fixed(steps)
    resized, plans = _train(
        {
            0: (C(pipe=2, data=2, tensor=2), range(8), 2),
            2: (C(pipe=4, data=2), range(8), 4),
            4: (C(data=2), range(2, 4), 1),
        },
        steps,
    )
    assert fixed[-1] < fixed[0]
    np.testing.assert_allclose(resized, fixed, rtol=5e-5)
    plans = plans[1:]  # the first one places the state from one device
    # the layers dim is resharded like any other: 2 -> 4 stages keeps part of each device's layers
    wq = [next(leaf for leaf in p.leaves if leaf.path == "0/wq") for p in plans]
    assert [(p.src.config.pipe, p.dst.config.pipe) for p in plans] == [(2, 4), (4, 1)]
    assert all(w.src.spec[0] == w.dst.spec[0] == "pipe" for w in wq)
    assert wq[0].bytes_kept > 0 and wq[0].bytes_moved > 0
    # 4 stages -> none on devices 2, 3: their layers come from the devices of all four stages
    senders = {piece.src_device for shard in wq[1].shards for piece in shard.pieces}
    assert {d // 2 for d in senders} == {0, 1, 2, 3}


def test_uneven_stage_boundaries_change_mid_training_by_restage_then_the_core_plan():
    steps = 5
    fixed = _fixed(steps)
    resized, plans = _train(
        {
            0: (C(pipe=2, data=2), range(4), 2, tj.pipelining.Stages((1, 3))),
            2: (C(pipe=2, data=2), range(4, 8), 2, tj.pipelining.Stages((3, 1))),
            4: (C(data=2), range(2, 4), 1),  # no pipeline: the unpadded layout
        },
        steps,
    )
    np.testing.assert_allclose(resized, fixed, rtol=5e-5)
    assert [p.dst.leaf("0/wq").shape[0] for p in plans] == [6, 6, 4]


def test_pytree_activations_flow_through_the_pipeline_as_a_moe_layers_loss():
    """The mixture-of-experts GPT carries (activations, per-sequence balance loss) through its
    layers; pipelined over pipe=2 (with experts on an expert axis) it computes what the scan
    does."""
    from tenplex_jax_models import GPT, MOE_RULES, example_losses, moe_config

    with nnx.use_eager_sharding(False):
        model = GPT(GPTConfig.moe_tiny(), rngs=nnx.Rngs(0))
    batch = {k: jnp.asarray(v) for k, v in batch_at(stdlib_corpus(2**20), 1, 6, 32).items()}
    want = example_losses(model, batch)
    graphdef, state = nnx.split(model)
    ptc = tj.PTC.of(state, MOE_RULES, moe_config(pipe=2, expert=2), jax.devices()[:4])
    mesh = ptc.mesh()
    got = jax.jit(
        lambda s, b: example_losses(nnx.merge(graphdef, s), b, mesh=mesh, microbatches=3)
    )(tj.place(state, ptc), batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=2e-6)


def test_bad_pipelines_are_refused_before_anything_runs():
    mesh = C(pipe=4, data=2).make_mesh(jax.devices())
    layer = lambda h, p: h @ p["w"]
    params = {"w": jnp.zeros((2, 8, 8))}
    with pytest.raises(
        tj.errors.LayoutError, match="2 layers do not split evenly into 4 pipeline stages"
    ):
        tj.pipelining.pipeline(layer, params, jnp.zeros((8, 8)), mesh=mesh, microbatches=2)
    params = {"w": jnp.zeros((4, 8, 8))}
    with pytest.raises(tj.errors.LayoutError, match=r"divide into 3 microbatches.*shape \(8, 8\)"):
        tj.pipelining.pipeline(layer, params, jnp.zeros((8, 8)), mesh=mesh, microbatches=3)
    with pytest.raises(tj.errors.LayoutError, match="has 2 stages but mesh axis 'pipe' has size 4"):
        tj.pipelining.pipeline(
            layer,
            params,
            jnp.zeros((8, 8)),
            mesh=mesh,
            microbatches=2,
            stages=tj.pipelining.Stages((1, 3)),
        )
    with pytest.raises(
        tj.errors.LayoutError, match=r"needs 8 rows .* leaf \"\['w'\]\" has shape \(4, 8, 8\)"
    ):
        stages = tj.pipelining.Stages((1, 1, 1, 2))  # padded: 4 stages x 2 slots
        tj.pipelining.pipeline(
            layer, params, jnp.zeros((8, 8)), mesh=mesh, microbatches=2, stages=stages
        )


@pytest.mark.parametrize("types", ["Auto", "Explicit"])
@pytest.mark.parametrize("stages", [None, (1, 3)])
def test_a_pipeline_runs_on_auto_and_explicit_axes_and_equals_the_scan(types, stages):
    """``jax.make_mesh`` gives Explicit axes by default; on jax 0.12 a shard_map input whose
    sharding differs from its spec is refused there, so nothing the pipeline adds is an input."""
    axis_type = getattr(jax.sharding.AxisType, types)
    mesh = jax.make_mesh((2, 4), ("pipe", "data"), axis_types=(axis_type,) * 2)
    split = tj.pipelining.Stages(stages) if stages else tj.pipelining.Stages.even(4, 2)
    rng = np.random.default_rng(0)
    layers = jnp.asarray(rng.normal(size=(4, 8, 8)) * 0.3, jnp.float32)
    x = jnp.asarray(rng.normal(size=(8, 8)), jnp.float32)
    layer = lambda h, p: jnp.tanh(h @ p)
    want = jax.lax.scan(lambda h, p: (layer(h, p), None), x, layers)[0]
    params = jax.device_put(split.pad(layers), NamedSharding(mesh, P("pipe")))
    batch = jax.device_put(x, NamedSharding(mesh, P("data")))
    run = jax.jit(
        lambda w, h: tj.pipelining.pipeline(layer, w, h, mesh=mesh, microbatches=2, stages=split)
    )
    got = run(params, batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize(
    "pipe,stages,types",
    [(1, None, "Auto"), (2, None, "Auto"), (2, None, "Explicit"), (2, (3, 1), "Auto")],
)
def test_versions_run_each_microbatch_on_its_own_weights_with_its_own_gradient(pipe, stages, types):
    # HetPipe's minibatches in flight: microbatch j on weight version j on every stage
    axes = (getattr(jax.sharding.AxisType, types),) * 2
    mesh = jax.make_mesh((pipe, 2), ("pipe", "data"), axes, devices=jax.devices()[: 2 * pipe])
    split = tj.pipelining.Stages(stages) if stages else None
    rng = np.random.default_rng(0)
    m, layer = 3, lambda h, p: jnp.tanh(h @ p)
    versions = jnp.asarray(rng.normal(size=(m, 4, 8, 8)) * 0.3, jnp.float32)
    xs = jnp.asarray(rng.normal(size=(m, 4, 8)), jnp.float32)

    def scans(w, x):
        return jnp.stack(
            [jax.lax.scan(lambda h, p: (layer(h, p), None), x[j], w[j])[0] for j in range(m)]
        )

    def pipelined(w, x):
        w = w if split is None else jax.vmap(split.pad)(w)
        kw = {"mesh": mesh, "microbatches": m, "stages": split, "versions": True}
        return tj.pipelining.pipeline(layer, w, x, **kw)

    placed = versions  # on Explicit axes laid out as the spec (jax 0.12's shard_map wants it)
    if types == "Explicit":
        placed = jax.device_put(versions, NamedSharding(mesh, P(None, "pipe")))
    np.testing.assert_allclose(
        jax.jit(pipelined)(placed, xs), scans(versions, xs), rtol=1e-5, atol=1e-6
    )
    second = lambda f, w: jax.grad(lambda w: (f(w, xs)[1] ** 2).sum())(w)
    grads, want = jax.jit(lambda w: second(pipelined, w))(placed), second(scans, versions)
    assert not np.asarray(grads[0]).any() and not np.asarray(grads[2]).any()  # not theirs
    np.testing.assert_allclose(grads, want, rtol=1e-5, atol=1e-6)
    with pytest.raises(tj.errors.LayoutError, match=r"leads with the 3 microbatches.*\(4, 8, 8\)"):
        tj.pipelining.pipeline(layer, versions[0], xs, mesh=mesh, microbatches=m, versions=True)
