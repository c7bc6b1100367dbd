"""Training through data-parallel and FSDP resizes gives the bits of a fixed run."""

from __future__ import annotations

import functools

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax_models import GPT, GPTConfig, example_losses
from tests.helpers import RULES, host_copy, tiny_samples

C = tj.ParallelConfig
BATCH = 24
GRAD_UNITS = 8
BATCH_AXES = ("data", "fsdp")


def build(seed: int = 0):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=20)
    with nnx.use_eager_sharding(False):
        model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    return nnx.split((model, optimizer))


STEPS_BY_LAYOUT: dict = {}  # a layout's jitted step, shared by the runs that use it


def compiled_step(
    graphdef, ptc: tj.PTC, layout: tj.data.BatchLayout, microbatches: int = 0, axes=BATCH_AXES
):
    """The jitted step; ``microbatches > 0`` runs the layers as a pipeline over ``pipe``. One
    function object per layout, so a run on a layout another run compiled takes its executable
    from JAX's in-memory cache (``build`` gives every run the same graphdef)."""
    key = (ptc.config, ptc.device_ids, layout, microbatches, axes)
    if key not in STEPS_BY_LAYOUT:
        STEPS_BY_LAYOUT[key] = _compiled_step(graphdef, ptc, layout, microbatches, axes)
    return STEPS_BY_LAYOUT[key]


def _compiled_step(graphdef, ptc: tj.PTC, layout: tj.data.BatchLayout, microbatches: int, axes):
    mesh = ptc.mesh()
    loss = example_losses
    if microbatches:
        loss = functools.partial(example_losses, mesh=mesh, microbatches=microbatches)
    grad_fn = tj.data.batch_value_and_grad(loss, layout, mesh, batch_axes=axes)

    def step(state, batch, weights):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, batch, weights)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    shardings = ptc.shardings(mesh)
    return jax.jit(
        step,
        in_shardings=(shardings, NamedSharding(mesh, P(axes)), None),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def train(
    schedule: dict,
    steps: int,
    grad_units: int | None = GRAD_UNITS,
    microbatches: int = 0,
    every_axis: bool = False,
):
    """Train ``steps`` steps, changing layout at the schedule's steps; (losses, state, samples).
    The batch is split over ``data`` and ``fsdp``, or with ``every_axis`` over every mesh axis
    (a bitwise job's way)."""
    graphdef, state = build()
    dataset = tj.DatasetPTC(tiny_samples(), BATCH, seed=3)  # 100 samples: epochs end mid-batch
    ptc, losses, seen = None, [], []
    for i in range(steps):
        if i in schedule:
            config, ids = schedule[i]
            devs = [jax.devices()[d] for d in ids]
            new = (
                tj.PTC.of(state, RULES, config, devs) if ptc is None else ptc.relayout(config, devs)
            )
            if ptc is None:
                state = tj.place(state, new)
            else:
                new = tj.allocate(ptc, new)
                state, _ = tj.reshard(state, tj.make_plan(ptc, new))
            ptc = new
            axes = tuple(config.shape) if every_axis else BATCH_AXES
            ranks = int(np.prod([config.size(a) for a in axes]))
            layout = tj.data.BatchLayout(BATCH, ranks=ranks, grad_units=grad_units)
            micro = microbatches if config.pipe > 1 else 0
            step = compiled_step(graphdef, ptc, layout, micro, axes)
        batch, weights, samples = tj.data.device_batch(
            dataset, dataset.step, layout, ptc.mesh(), axes
        )
        dataset.step += 1
        state, loss = step(state, batch, weights)
        losses.append(float(loss))
        seen.append(samples[samples >= 0])
    return losses, host_copy(state), seen


@pytest.fixture(scope="module")
def fixed_run():
    return train({0: (C(data=8), range(8))}, 8)


def test_dp_and_fsdp_resizes_train_bitwise_equal_to_a_fixed_run(fixed_run):
    losses, state, seen = train(
        {
            0: (C(data=8), range(8)),
            2: (C(data=4), range(4)),  # shrink
            4: (C(data=3, fsdp=2), range(2, 8)),  # 3 ranks do not divide 8 gradient units
            6: (C(data=2, fsdp=4), range(8)),  # back to 8 devices, sharded optimizer state
        },
        8,
    )
    fixed_losses, fixed_state, fixed_seen = fixed_run
    assert losses == fixed_losses
    for got, want in zip(state, fixed_state):
        np.testing.assert_array_equal(got, want)
    for got, want in zip(seen, fixed_seen):
        np.testing.assert_array_equal(got, want)
    stream = np.concatenate(seen)  # 8 batches of 24 over 100 samples: one epoch and 92 more
    assert sorted(stream[:100]) == list(range(100))
    assert len(set(stream[100:])) == 92


def max_relative_difference(got, want) -> float:
    """max |got - want| / max |want| over the float leaves: a scale-aware relative error."""
    return max(
        float(np.max(np.abs(a - b)) / max(np.max(np.abs(b)), 1e-30))
        for a, b in zip(got, want)
        if b.dtype.kind == "f"
    )


TENSOR_RESIZES = {
    0: (C(data=8), range(8)),
    3: (C(data=4, tensor=2), range(8)),
    5: (C(data=2, tensor=4), range(8)),
    6: (C(pipe=2, tensor=2), range(4)),
}


def test_tensor_and_pipe_resizes_train_bitwise_with_the_batch_over_every_axis():
    """Over every axis (a bitwise job's way), tensor and pipe changes keep every bit of a run on
    one device."""
    losses, state, _ = train(TENSOR_RESIZES, 8, every_axis=True)
    fixed_losses, fixed_state, _ = train({0: (C(), range(1))}, 8, every_axis=True)
    assert losses == fixed_losses
    for got, want in zip(state, fixed_state):
        np.testing.assert_array_equal(got, want)


def test_tensor_resizes_with_tensor_parallel_compute_stay_within_fp32_rounding(fixed_run):
    """With tensor-parallel compute (the batch over ``data`` and ``fsdp`` only), a tensor change
    regroups the contractions' sums: within rounding of the fixed run, not bit for bit."""
    losses, state, _ = train(TENSOR_RESIZES, 8)
    fixed_losses, fixed_state, _ = fixed_run
    np.testing.assert_allclose(losses, fixed_losses, rtol=1e-6)
    assert max_relative_difference(state, fixed_state) <= 1e-6


@functools.cache
def unpadded_reference(rows: tuple[int, ...]):
    """The loss and gradient of ``build``'s model on the samples ``rows`` alone, op by op on the
    host (no padding, no layout, nothing jitted); the same for every parametrization below."""
    graphdef, state = build()
    model, _ = nnx.merge(graphdef, jax.tree.map(np.asarray, state))
    unpadded = jax.tree.map(lambda x: x[np.asarray(rows)], tiny_samples())
    return nnx.value_and_grad(lambda m: example_losses(m, unpadded).mean())(model)


@pytest.mark.parametrize("grad_units, accumulate", [(None, 1), (None, 2), (4, 1)])
def test_padded_uneven_ranks_give_the_gradient_of_the_unpadded_batch(grad_units, accumulate):
    """3 ranks, global batch 16: 6, 5, 5 real rows; the padding must not count."""
    graphdef, state = build()
    config = C(data=3)
    ptc = tj.PTC.of(state, RULES, config, jax.devices()[:3])
    state = tj.place(state, ptc)
    mesh = ptc.mesh()
    dataset = tj.DatasetPTC(tiny_samples(), 16, seed=1)
    layout = tj.data.BatchLayout(16, ranks=3, grad_units=grad_units, accumulate=accumulate)
    grad_fn = tj.data.batch_value_and_grad(example_losses, layout, mesh)

    @jax.jit
    def grads(state, batch, weights):
        model, _ = nnx.merge(graphdef, state)
        return grad_fn(model, batch, weights)

    batch, weights, samples = tj.data.device_batch(dataset, 0, layout, mesh)
    assert int((samples < 0).sum()) == layout.rows - 16
    loss, got = grads(state, batch, weights)

    want_loss, want = unpadded_reference(tuple(dataset.indices(0)[0]))
    np.testing.assert_allclose(float(loss), float(want_loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-7)


@pytest.mark.parametrize("config, annotated", [(C(data=4), False), (C(data=2, tensor=2), True)])
def test_units_annotate_no_op_unless_an_axis_stays_automatic(config, annotated):
    """The units' ``shard_map`` is manual over every axis when the others than the batch's have
    size 1: JAX then annotates no op of its body with a sharding (an open one on every op where
    some axis is automatic: a third of a GPT step's program, a fifth of its compile)."""
    graphdef, state = build()
    ptc = tj.PTC.of(state, RULES, config, jax.devices()[:4])
    state, mesh = tj.place(state, ptc), ptc.mesh()
    layout = tj.data.BatchLayout(16, ranks=config.size("data"), grad_units=4)
    grad_fn = tj.data.batch_value_and_grad(example_losses, layout, mesh)
    batch, weights, _ = tj.data.device_batch(tj.DatasetPTC(tiny_samples(), 16), 0, layout, mesh)

    def grads(state, batch, weights):
        model, _ = nnx.merge(graphdef, state)
        return grad_fn(model, batch, weights)

    text = jax.jit(grads).lower(state, batch, weights).as_text()
    lines = [line for line in text.splitlines() if "sdy.sharding_constraint" in line]
    assert lines  # the gradient's, replicated after the units
    assert any("{?}" in line for line in lines) == annotated, config


@pytest.mark.parametrize("config, annotated", [(C(pipe=2), False), (C(pipe=2, tensor=2), True)])
def test_a_pipeline_annotates_no_op_unless_an_axis_stays_automatic(config, annotated):
    """The same for the pipeline's ``shard_map`` over ``pipe`` (in a step without units, whose
    ``shard_map`` leaves ``pipe`` automatic: its body is annotated whatever the pipeline's)."""
    from tenplex_jax_models import LOGICAL_RULES, build_state, make_train_step

    graphdef, state, _ = build_state("tiny", 1e-3)
    ptc = tj.PTC.of(state, LOGICAL_RULES, config, jax.devices()[: config.num_devices])
    state, layout = tj.place(state, ptc), tj.data.BatchLayout(8, ranks=1)
    batch, weights, _ = tj.data.device_batch(
        tj.DatasetPTC(tiny_samples(), 8), 0, layout, ptc.mesh()
    )
    lowered = make_train_step(graphdef, ptc, layout).lower(state, batch, weights)
    lines = [line for line in lowered.as_text().splitlines() if "sdy.sharding_constraint" in line]
    assert any("{?}" in line for line in lines) == annotated, config


def test_a_layout_for_another_rank_count_than_the_mesh_is_refused():
    mesh = C(data=4, tensor=2).make_mesh(jax.devices())
    with pytest.raises(
        tj.errors.DataError, match=r"for 8 data-parallel ranks, but the mesh .* has 4"
    ):
        tj.data.batch_value_and_grad(example_losses, tj.data.BatchLayout(24, ranks=8), mesh)
    with pytest.raises(tj.errors.DataError, match="not axes of the mesh"):
        tj.data.batch_value_and_grad(
            example_losses, tj.data.BatchLayout(24, ranks=4), mesh, batch_axes=("replica",)
        )


def test_grad_units_train_a_pipelined_model(fixed_run):
    """The pipeline's shard_map over ``pipe`` runs inside the gradient units' shard_map over the
    batch."""
    schedule = {0: (C(data=8), range(8)), 2: (C(data=4, pipe=2), range(8))}
    losses, state, seen = train(schedule, 4, microbatches=3)
    fixed_losses, _, fixed_seen = fixed_run
    np.testing.assert_allclose(losses, fixed_losses[:4], rtol=1e-5)
    for got, want in zip(seen, fixed_seen):
        np.testing.assert_array_equal(got, want)
    assert max_relative_difference(state, train({0: (C(data=8), range(8))}, 4)[1]) <= 1e-4
