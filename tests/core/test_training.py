"""After a resize, training goes on: same optimizer state, same losses as a run that never
resized."""

from __future__ import annotations

import functools

import jax
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

import tenplex_jax as tj
from tenplex_jax_models import batch_at, loss_fn, stdlib_corpus
from tests.helpers import RULES, train_state

C = tj.ParallelConfig
BATCH = 12


@functools.cache
def step_fn(graphdef):
    def step(state, batch):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = nnx.value_and_grad(loss_fn)(model, batch)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    return step


def compiled_step(graphdef, ptc):
    mesh = ptc.mesh()
    batch_sharding = NamedSharding(mesh, P(("data", "fsdp")))
    return jax.jit(
        step_fn(graphdef),
        in_shardings=(ptc.shardings(mesh), batch_sharding),
        out_shardings=(ptc.shardings(mesh), NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def run(schedule: dict[int, tuple[C, range]], steps: int) -> tuple[list[float], list]:
    """Train for ``steps``, resizing at the schedule's steps; returns losses and final host
    state."""
    model, optimizer = train_state(lr=3e-3)
    graphdef, state = nnx.split((model, optimizer))
    corpus = stdlib_corpus(2**20)
    ptc = None
    losses = []
    for i in range(steps):
        if i in schedule:
            config, devices = schedule[i]
            devs = [jax.devices()[d] for d in devices]
            new = (
                tj.PTC.of(state, RULES, config, devs) if ptc is None else ptc.relayout(config, devs)
            )
            if ptc is None:
                state = tj.place(state, new)
            else:
                state, _ = tj.reshard(state, tj.make_plan(ptc, new))
            ptc, step = new, compiled_step(graphdef, new)
        state, loss = step(state, batch_at(corpus, i, BATCH, 32, seed=7))
        losses.append(float(loss))
    return losses, [np.asarray(x) for x in jax.tree.leaves(nnx.state(state, nnx.Param))]


def test_training_continues_after_resizes_with_the_losses_of_a_fixed_run():
    steps = 9
    fixed, fixed_params = run({0: (C(data=2, fsdp=2, tensor=2), range(8))}, steps)
    resized, resized_params = run(
        {
            0: (C(data=2, fsdp=2, tensor=2), range(8)),
            3: (C(data=2, tensor=2), range(4)),  # shrink; DP, FSDP and TP change
            5: (C(data=3, tensor=2), range(2, 8)),  # grow onto an overlapping set
            7: (C(fsdp=4), range(4, 8)),  # shrink onto a partly disjoint set
        },
        steps,
    )
    assert fixed[-1] < fixed[0]  # it trains
    np.testing.assert_allclose(resized, fixed, rtol=2e-5)
    for a, b in zip(resized_params, fixed_params):
        np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-6)
