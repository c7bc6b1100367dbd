"""Bitwise training through every kind of layout change (``JobOptions(bitwise=True)``).

The runs split each global batch over every mesh axis and take the gradient in units with
``batch.value_and_grad``, so the layout only says where the state is stored. Each is compared
with the same training on one device: every loss, and every leaf of the params and the AdamW
state after every step, bit for bit. The mixture of experts routes top-2 with capacity, so a
rounding difference anywhere would also show as a routing flip. The suite's processes run with
``tj.elastic.use_bitwise_flags()``'s XLA flags (``tests/conftest.py``).
"""

from __future__ import annotations

import functools

import hypothesis
import jax
import numpy as np
import optax
import pytest
from flax import linen, nnx
from hypothesis import strategies as st

import tenplex_jax as tj
from tenplex_jax._src import bitwise
from tenplex_jax_models import (
    GPT,
    MOE_RULES,
    GPTConfig,
    corpus_samples,
    example_losses,
    moe_config,
    stdlib_corpus,
    train_step,
)
from tests.helpers import host_copy

E = moe_config
BATCH = 16
GRAD_UNITS = 8
MODEL = GPTConfig.moe_tiny()
# (config, device count): every axis, alone and mixed, on 1 to 8 devices (8 units: none idle)
LAYOUTS = [
    (E(data=8), 8),
    (E(fsdp=4), 4),
    (E(tensor=4), 4),
    (E(pipe=2), 2),
    (E(expert=4), 4),
    (E(expert=4, data=2), 8),
    (E(expert=2, tensor=2), 4),
    (E(pipe=2, data=3), 6),
    (E(pipe=2, fsdp=2, tensor=2), 8),
    (E(expert=2, data=3), 6),
]


@functools.cache
def source():
    return corpus_samples(stdlib_corpus(2**20), seq_len=MODEL.seq_len, num_samples=64)


def build():
    """The MoE GPT and AdamW after clipping the gradient's global norm (an all-parameter
    reduction, which binds here: the norm starts near 1)."""
    with nnx.use_eager_sharding(False):
        model = GPT(MODEL, rngs=nnx.Rngs(0))
        tx = optax.chain(optax.clip_by_global_norm(0.1), optax.adamw(3e-3))
        return nnx.split({"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)})


@functools.cache
def graphdef():
    return build()[0]


def fresh_state():
    return build()[1]


@functools.cache
def step_for(config, ids: tuple[int, ...]):
    """The reference GPT's step (``train_step``) jitted for one layout, and its layout."""
    devices = [jax.devices()[i] for i in ids]
    ptc = tj.PTC.of(jax.eval_shape(fresh_state), MOE_RULES, config, devices)
    mesh = ptc.mesh()
    layout = tj.data.BatchLayout(BATCH, ranks=len(ids), grad_units=GRAD_UNITS)
    step = jax.jit(
        train_step(graphdef()),
        in_shardings=(ptc.shardings(mesh), None),
        out_shardings=(ptc.shardings(mesh), None),
        donate_argnums=0,
    )
    return ptc, layout, step


def move(state, ptc, new):
    """``state`` laid out as ``new``: placed (``ptc`` None: the first layout), else by a plan
    from ``ptc`` and a reshard."""
    if ptc is None:
        return tj.place(state, new)
    return tj.reshard(state, tj.make_plan(ptc, tj.allocate(ptc, new)))[0]


def train(schedule: dict[int, tuple], steps: int) -> tuple[list[float], list[list[np.ndarray]]]:
    """Train ``steps`` steps, moving to ``schedule[i] = (config, device ids)`` before step i
    (by a plan and a reshard); the losses and the state on the host after every step."""
    state, dataset, ptc = fresh_state(), tj.DatasetPTC(source(), BATCH, seed=1), None
    losses, states = [], []
    for i in range(steps):
        if i in schedule:
            new, layout, step = step_for(*schedule[i])
            state = move(state, ptc, new)
            ptc, mesh = new, new.mesh()
        axes = tuple(mesh.axis_names)
        data, weights, _ = tj.data.device_batch(dataset, i, layout, mesh, axes)
        state, metrics = step(state, tj.Batch(data, weights, layout, mesh, axes))
        losses.append(float(metrics["loss"]))
        states.append(host_copy(state))
    return losses, states


STEPS = 4


@functools.cache
def single_device():
    return train({0: (E(), (0,))}, STEPS)


def assert_bitwise(got, want, what: str) -> None:
    losses, states = got
    assert losses == want[0], what
    for i, (state, expected) in enumerate(zip(states, want[1])):
        for j, (a, b) in enumerate(zip(state, expected)):
            np.testing.assert_array_equal(a, b, err_msg=f"{what}: step {i}, leaf {j}")


layouts = st.sampled_from(LAYOUTS)


@hypothesis.settings(max_examples=4, deadline=None, derandomize=True)
@hypothesis.given(
    first=layouts,
    changes=st.dictionaries(st.integers(1, STEPS - 1), layouts, min_size=1, max_size=3),
    reversed_ids=st.booleans(),
)
def test_random_schedules_train_bitwise_equal_to_one_device(first, changes, reversed_ids):
    """Every change (data, fsdp, tensor, pipe, expert and their mixes, onto other device counts
    and device orders) leaves every loss and every bit of the state after every step as on one
    device."""

    def placed(layout):
        config, n = layout
        return config, tuple(range(8)[-n:][::-1] if reversed_ids else range(n))

    schedule = {0: placed(first)} | {i: placed(layout) for i, layout in changes.items()}
    assert_bitwise(train(schedule, STEPS), single_device(), f"schedule {schedule}")


def test_init_jitted_into_any_layout_has_the_same_bits():
    abstract = jax.eval_shape(fresh_state)
    want = None
    for config, n in [(E(), 1), (E(fsdp=4), 4), (E(expert=2, tensor=2), 4), (E(pipe=2), 2)]:
        ptc = tj.PTC.of(abstract, MOE_RULES, config, jax.devices()[:n])
        got = host_copy(jax.jit(fresh_state, out_shardings=ptc.shardings(ptc.mesh()))())
        want = got if want is None else want
        for a, b in zip(got, want):
            np.testing.assert_array_equal(a, b, err_msg=str(config))


# the default demo's schedule: data=2,expert=4 -> expert=2,tensor=2 -> pipe=2,data=3 -> back
DEMO = [(E(expert=4, data=2), 8), (E(expert=2, tensor=2), 4), (E(pipe=2, data=3), 6)]


def run_job(events: bool, step_fn=None, log=None):
    """The MoE GPT in an ``ElasticJob(bitwise=True)``: the demo's schedule by events, or none on
    one device; (losses, state on the host, job records, job)."""
    configs = {n: config for config, n in DEMO} | {8: DEMO[0][0]}
    options = tj.elastic.JobOptions(bitwise=True, compile_ahead=False, log=log)
    job = tj.ElasticJob(
        MOE_RULES,
        tj.DatasetPTC(source(), BATCH, seed=1),
        initial=range(8) if events else [0],
        grad_units=GRAD_UNITS,
        config=lambda n: configs.get(n, E(data=n)),  # compile-ahead may guess any count
        steps=7,
        options=options,
    )
    losses = []
    with job:
        state = job.start(fresh_state)
        step = job.jit(step_fn or train_step(graphdef()))
        while job.step < job.steps:
            if events and job.step in (2, 4, 6):
                job.redeploy(range({2: 4, 4: 6, 6: 8}[job.step]))
            state, batch = job.next(state)
            state, metrics = step(state, batch)
            losses.append(float(metrics["loss"]))
        return losses, host_copy(state), job.records, job


def test_the_demo_schedule_in_a_job_is_bitwise_and_its_records_say_so():
    losses, state, records, job = run_job(events=True)
    want_losses, want_state, _, alone = run_job(events=False)
    assert [r.config_after for r in records] == [
        "expert=2,tensor=2",
        "pipe=2,data=3",
        "data=2,expert=4",
    ]
    assert losses == want_losses
    for a, b in zip(state, want_state):
        np.testing.assert_array_equal(a, b)
    assert job.bitwise and job.not_bitwise is None and alone.bitwise
    assert [r.bitwise for r in records] == [True, True, True]


def test_a_step_not_taking_its_gradient_by_units_is_named_not_bitwise():
    """A step whose gradient is ``nnx.value_and_grad`` over the whole sharded batch still
    trains; the job says once why its changes are not bitwise, and so does every record."""
    g = graphdef()

    def plain_step(state, batch):
        nodes = nnx.merge(g, state)

        def loss(model):
            return (example_losses(model, batch.data) * batch.weights).sum() / batch.weights.sum()

        value, grads = nnx.value_and_grad(loss)(nodes["model"])
        nodes["optimizer"].update(nodes["model"], grads)
        return nnx.state(nodes), {"loss": value}

    lines = []
    losses, _, records, job = run_job(events=True, step_fn=plain_step, log=lines.append)
    assert np.all(np.isfinite(losses))
    assert not job.bitwise and "batch.value_and_grad" in job.not_bitwise
    said = [line for line in lines if "not bitwise" in line]
    assert len(said) == 1 and "batch.value_and_grad" in said[0]
    assert [r.bitwise for r in records] == [False, False, False]


def test_bitwise_needs_grad_units_and_the_flags(monkeypatch):
    with pytest.raises(tj.errors.LayoutError, match=r"bitwise=True\) needs grad_units"):
        tj.ElasticJob(
            MOE_RULES,
            tj.DatasetPTC(source(), BATCH),
            options=tj.elastic.JobOptions(bitwise=True),
        )
    with pytest.raises(tj.errors.LayoutError, match=r"JobOptions\.bitwise is a bool"):
        tj.elastic.JobOptions(bitwise=1)
    assert bitwise.unmet("cpu") is None  # the suite's flags
    monkeypatch.setenv("XLA_FLAGS", "--xla_cpu_max_isa=AVX2")
    assert "FMA" in bitwise.unmet("cpu") and "--xla_cpu_max_isa=AVX" in bitwise.unmet("cpu")
    monkeypatch.setenv("XLA_FLAGS", "")
    assert "--xla_gpu_deterministic_ops=true" in bitwise.unmet("gpu")
    jax.devices()  # the backend runs: too late to set them
    with pytest.raises(RuntimeError, match="backends have started without"):
        tj.elastic.use_bitwise_flags()


class LinenMLP(linen.Module):
    @linen.compact
    def __call__(self, x):
        init = linen.initializers.lecun_normal()
        h = linen.Dense(32, kernel_init=linen.with_logical_partitioning(init, ("embed", "mlp")))(x)
        out = linen.Dense(1, kernel_init=linen.with_logical_partitioning(init, ("mlp", None)))
        return out(jax.nn.gelu(h))[:, 0]


def test_a_linen_model_trains_bitwise_through_tensor_pipe_and_fsdp_changes():
    """Linen's params, a plain pytree: ``batch.value_and_grad`` differentiates every leaf and
    returns a gradient of the same structure, and the changes keep every bit of one device."""
    x = np.random.default_rng(0).normal(size=(64, 8)).astype(np.float32)
    dataset = tj.DatasetPTC({"x": x, "y": np.sin(x).sum(1)}, global_batch=16)
    model, tx = LinenMLP(), optax.adamw(1e-2)
    params = model.init(jax.random.key(0), x[:2])
    start = {"params": params, "opt": tx.init(params)}

    def step(state, batch):
        def losses(p, b):
            return (model.apply(p, b["x"]) - b["y"]) ** 2

        loss, grads = batch.value_and_grad(losses)(state["params"])
        updates, opt = tx.update(grads, state["opt"], state["params"])
        return {"params": optax.apply_updates(state["params"], updates), "opt": opt}, loss

    rules = (("embed", "fsdp"), ("mlp", "tensor"))

    def run(schedule):
        state, ptc, losses = start, None, []
        for i in range(4):
            if i in schedule:
                config, n = schedule[i]
                new = tj.PTC.of(jax.eval_shape(lambda: start), rules, config, jax.devices()[:n])
                state = move(state, ptc, new)
                ptc, mesh = new, new.mesh()
                axes = tuple(mesh.axis_names)
                layout = tj.data.BatchLayout(16, ranks=n, grad_units=8)
                shardings = ptc.shardings(mesh)
                jitted = jax.jit(
                    step, in_shardings=(shardings, None), out_shardings=(shardings, None)
                )
            data, weights, _ = tj.data.device_batch(dataset, i, layout, mesh, axes)
            state, loss = jitted(state, tj.Batch(data, weights, layout, mesh, axes))
            losses.append(float(loss))
        return losses, [host_copy(state)]

    C = tj.ParallelConfig
    changed = run({0: (C(data=2, tensor=4), 8), 2: (C(pipe=2, fsdp=2), 4)})
    assert_bitwise(changed, run({0: (C(), 1)}), "linen")
