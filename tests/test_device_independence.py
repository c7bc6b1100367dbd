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
from models import GPT, GPTConfig, corpus_samples, example_losses, stdlib_corpus
from tests.helpers import RULES, host_copy

C = tj.ParallelConfig
BATCH = 24
WORKERS = 8


def build(seed: int = 0):
    schedule = optax.warmup_cosine_decay_schedule(0.0, 3e-3, warmup_steps=3, decay_steps=20)
    with nnx.use_eager_sharding(False):
        model = GPT(GPTConfig.tiny(), rngs=nnx.Rngs(seed))
        optimizer = nnx.Optimizer(model, optax.adamw(schedule), wrt=nnx.Param)
    return nnx.split((model, optimizer))


@functools.cache
def dataset_source():
    return corpus_samples(stdlib_corpus(2**20), seq_len=32, num_samples=100)


def compiled_step(graphdef, ptc: tj.PTC, layout: tj.BatchLayout):
    mesh = ptc.mesh()
    grad_fn = tj.batch_value_and_grad(example_losses, layout, mesh)

    def step(state, batch, weights):
        model, optimizer = nnx.merge(graphdef, state)
        loss, grads = grad_fn(model, batch, weights)
        optimizer.update(model, grads)
        return nnx.state((model, optimizer)), loss

    shardings = ptc.shardings(mesh)
    return jax.jit(
        step,
        in_shardings=(shardings, NamedSharding(mesh, P(("data", "fsdp"))), None),
        out_shardings=(shardings, NamedSharding(mesh, P())),
        donate_argnums=0,
    )


def train(schedule: dict, steps: int, workers: int | None = WORKERS):
    """Train ``steps`` steps, changing layout at the schedule's steps; (losses, state, samples)."""
    graphdef, state = build()
    dataset = tj.DatasetPTC(dataset_source(), BATCH, seed=3)  # 100 samples: epochs end mid-batch
    ptc, losses, seen = None, [], []
    for i in range(steps):
        if i in schedule:
            config, ids = schedule[i]
            new = tj.PTC.of(state, RULES, config, [jax.devices()[d] for d in ids])
            if ptc is None:
                state = tj.place(state, new)
            else:
                state, _ = tj.reshard(state, tj.make_plan(ptc, tj.allocate(ptc, new)))
                new = tj.allocate(ptc, new)
            ptc = new
            layout = tj.BatchLayout(BATCH, ranks=config.data * config.fsdp, workers=workers)
            step = compiled_step(graphdef, ptc, layout)
        batch, weights, samples = tj.device_batch(dataset, dataset.step, layout, ptc.mesh())
        dataset.step += 1
        state, loss = step(state, batch, weights)
        losses.append(float(loss))
        seen.append(samples[samples >= 0])
    return losses, host_copy(state), seen
